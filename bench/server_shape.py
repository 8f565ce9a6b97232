"""The parameter server's shape, as docs/trainer.md ("The parameter server's structure") reports
it: the attributes each of its classes defines (and reads but does not define), the attributes
of one server instance and of each helper it holds, and the project files whose code one step
runs on the server's thread (a middle step of an in-process run of 3 workers, `ps-bz-gc` and
`diloco` with H = 2).

    .venv/bin/python bench/server_shape.py                      # this tree
    .venv/bin/python bench/server_shape.py --baseline 4779127   # and that revision, side by side

A class's attributes are the names it assigns as `self.X` (or declares in its body, properties
included); "from elsewhere" are the `self.X` it reads that are neither its own attributes nor
its methods: what a mixin takes from the class it is mixed into.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

# The server's own modules over the project's history; those a tree lacks are skipped.
MODULES = ("server", "boundary", "handshake", "joiner", "departures", "gathering", "donors", "aggregator",
           "planner", "checkpointing", "progress", "membership")
ROUND_START = "boundary"  # the method every round begins with, before and after the reshaping


def class_attributes(path: Path) -> dict[str, dict[str, list[str]]]:
    """Per class of `path`: the attributes it defines and those it reads from elsewhere."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        defined, read, methods = set(), set(), set()
        for item in node.body:
            if isinstance(item, ast.FunctionDef):
                methods.add(item.name)
                if any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                    defined.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                defined.add(item.target.id)
            elif isinstance(item, ast.Assign):
                defined.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                (defined if isinstance(sub.ctx, ast.Store) else read).add(sub.attr)
        out[node.name] = {"defined": sorted(defined), "from_elsewhere": sorted(read - defined - methods)}
    return out


def files_of_a_step(root: Path, strategy: str, **options) -> tuple[list[str], dict[str, int]]:
    """The project files whose code a middle step runs on the server's thread, and the
    attributes of the server instance and of each project object it holds."""
    import trainer.server as server_mod
    from trainer_testing import config, run_in_process

    rounds: list[set[str]] = [set()]

    def trace(frame, event, arg):
        code = frame.f_code
        if code.co_name == ROUND_START and Path(code.co_filename).parent.name == "trainer":
            rounds.append(set())
        try:
            rel = Path(code.co_filename).resolve().relative_to(root)
        except ValueError:
            return None
        if rel.parts[0] in ("trainer", "hybridtrain"):
            rounds[-1].add(str(rel))
        return None

    serve = server_mod.ParameterServer.serve

    def traced(self):
        sys.settrace(trace)
        try:
            return serve(self)
        finally:
            sys.settrace(None)

    server_mod.ParameterServer.serve = traced
    try:
        run = run_in_process(config(strategy=strategy, workers=3, global_batch=48, max_steps=8, **options), 8)
    finally:
        server_mod.ParameterServer.serve = serve
    steps = rounds[1:-1]  # the first holds the handshake, the last the goodbye
    held = {"ParameterServer": len(vars(run.server))}
    for name, value in vars(run.server).items():
        kind = type(value)
        if kind.__module__.startswith("trainer.") and hasattr(value, "__dict__") and name not in (
                "cfg", "transport", "metrics", "inbox"):
            held[f"{name} ({kind.__name__})"] = len(vars(value))
    return sorted(steps[len(steps) // 2]), held


def measure(root: Path) -> dict:
    """Every figure of the tree at `root` (its trainer imported from there)."""
    sys.path[:0] = [str(root), str(root / "tests"), str(root / "tests" / "trainer")]
    classes = {}
    for name in MODULES:
        path = root / "trainer" / f"{name}.py"
        if path.exists():
            classes.update({f"trainer/{name}.py:{cls}": attrs for cls, attrs in class_attributes(path).items()})
    files, held = files_of_a_step(root, "ps-bz-gc")
    local_files, _ = files_of_a_step(root, "diloco", sync_every=2)
    return {"classes": classes, "instance": held, "files_ps_bz_gc": files, "files_diloco": local_files}


def report(label: str, figures: dict) -> None:
    print(f"== {label}")
    for name, attrs in figures["classes"].items():
        print(f"  {name}: {len(attrs['defined'])} defined, {len(attrs['from_elsewhere'])} from elsewhere"
              + (f" {attrs['from_elsewhere']}" if attrs["from_elsewhere"] else ""))
    print("  attributes of one instance: " + ", ".join(f"{k} {v}" for k, v in figures["instance"].items()))
    for key in ("files_ps_bz_gc", "files_diloco"):
        print(f"  {key}: {len(figures[key])}: {' '.join(figures[key])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git revision to measure beside this tree")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # measure this tree only, as JSON (a subprocess)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.one).resolve())))
        return 0
    here = Path(__file__).resolve().parent.parent
    trees = [("this tree", here)]
    with tempfile.TemporaryDirectory(prefix="server-shape-") as tmp:
        if args.baseline:
            archive = subprocess.run(["git", "archive", args.baseline], cwd=here, capture_output=True, check=True)
            tarfile.open(fileobj=BytesIO(archive.stdout)).extractall(tmp, filter="data")
            trees.insert(0, (args.baseline, Path(tmp)))
        for label, root in trees:
            # A process per tree: each imports its own trainer. The runs' own lines go to stderr.
            done = subprocess.run([sys.executable, __file__, "--one", str(root)], cwd=root, capture_output=True,
                                  text=True, check=True)
            report(label, json.loads(done.stdout.strip().splitlines()[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
