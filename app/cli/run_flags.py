"""Command-line flags into request fields: the `POST /runs` body of `hybridtrain runs create` and
the checks of each flag that can be wrong (a task reference, JSON task args, a target, a bundle's
sha256, a script inside the work dir), and the work dir packed and uploaded as a bundle. A bad
flag raises `UsageError` naming it; the commands (app/cli/run_commands.py,
app/cli/inventory_commands.py) turn that into exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from hybridtrain.contract import SHA256, check_task_ref, parse_target
from hybridtrain.option_flags import option_flags

MIB = 1024 * 1024


class UsageError(Exception):
    """A command line that cannot become a request; the message is one line naming the flag."""


def ids(text: str) -> list[int]:
    """`--nodes 1,2,3` as a list of ids (argparse's `type`)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ids, got {text!r}") from exc


def cluster_ref(text: str) -> int | str:
    """`--cluster 1` or `--cluster local` (argparse's `type`): an id, or a name the command
    looks up once it reaches the control plane."""
    text = text.strip()
    if not text:
        raise argparse.ArgumentTypeError("expected a cluster id or name")
    return int(text) if text.isdigit() else text


def config_file(path: str | None) -> dict[str, Any]:
    """`--config`: the request fields a YAML or JSON file holds (JSON is YAML); {} without one."""
    if path is None:
        return {}
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror}") from None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not YAML or JSON ({str(exc).splitlines()[0]})") from None
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise UsageError(f"--config {path}: expected a mapping of request fields, e.g. 'strategy: diloco'")
    for section, example in (("compression", "density: 0.05"), ("local_sgd", "sync_every: 20")):
        if section in value and not isinstance(value[section], dict):
            raise UsageError(f"--config {path}: {section} must be a mapping, e.g. '{section}: {{{example}}}'")
    return value


def run_body(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /runs body of a `runs create` command line (its --config file, the flags given
    over it); UsageError naming a bad flag."""
    body: dict[str, Any] = config_file(getattr(args, "config", None))
    body["name"] = args.name
    if args.nodes is not None or args.cluster is not None:
        body.pop("node_ids", None)
        body.pop("cluster_id", None)
    if args.nodes is not None:
        body["node_ids"] = args.nodes
    else:
        body["cluster_id"] = args.cluster
    bundle_sha256 = bundle_flag(args.bundle)  # --workdir's is known once uploaded
    for key, value in [
        ("bundle_sha256", bundle_sha256), ("script_args", args.script_args or None), ("ps_node_id", args.ps_node),
        ("checkpoint_every", args.checkpoint_every), ("checkpoint_every_s", args.checkpoint_every_s),
        ("max_restarts", args.max_restarts), ("min_workers", args.min_workers),
        ("min_workers_wait_s", args.min_workers_wait_s), ("priority", args.priority), ("share_gpus", args.share_gpus),
        ("encrypt_links", args.encrypt_links), ("datasets", getattr(args, "datasets", None) or None),
    ]:
        if value is not None:
            body[key] = value
    # The training options' flags (hybridtrain.option_flags), each at its place in the request.
    checked = {"task": task_flag(args.task), "task_args": task_args_flag(args.task_args),
               "script": script_flag(args, bundle_sha256), "target": target_flag(args.target)}
    for path, flag in option_flags().items():
        value = checked[path] if path in checked else getattr(args, flag.dest, None)
        section, _, name = path.rpartition(".")
        if value is not None and section:
            body[section] = {**(body.get(section) or {}), name: value}
        elif value is not None:
            body[name] = value
    return body


def task_flag(text: str | None) -> str | None:
    """`--task`: a `module:function` reference, checked."""
    if text is None:
        return None
    try:
        return check_task_ref(text)
    except ValueError as exc:
        raise UsageError(f"--task: {exc}") from None


def task_args_flag(text: str | None) -> dict[str, Any] | None:
    """`--task-args`: a JSON object (no NaN or Infinity)."""
    if text is None:
        return None
    def no_constants(name: str) -> Any:
        raise UsageError(f"--task-args: {name} is not a JSON number: {text!r}")

    try:
        value = json.loads(text, parse_constant=no_constants)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--task-args: not JSON ({exc.msg} at character {exc.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise UsageError(f'--task-args: expected a JSON object such as \'{{"lr": 0.05}}\', got {text!r}')
    return value


def target_flag(text: str | None) -> str | None:
    """`--target`: `metric>=value`, normalised."""
    if text is None:
        return None
    try:
        return str(parse_target(text))
    except ValueError as exc:
        raise UsageError(f"--target: {exc}") from None


def bundle_flag(text: str | None) -> str | None:
    """`--bundle`: a bundle's sha256, lower case."""
    if text is None:
        return None
    if not SHA256.match(text.lower()):
        raise UsageError(f"--bundle: expected the 64 hex digits of a bundle's sha256, got {text!r}")
    return text.lower()


def script_flag(args: argparse.Namespace, bundle_sha256: str | None) -> str | None:
    """`--script`: a path relative to the work dir (which --workdir or --bundle must give)."""
    if args.script is None:
        if args.script_args:
            raise UsageError(f"arguments after -- ({' '.join(args.script_args)}) need --script")
        return None
    script = args.script.replace("\\", "/")
    path = PurePosixPath(script)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise UsageError(f"--script {args.script}: a path relative to the work dir, without '..'")
    if bundle_sha256 is None and args.workdir is None:
        raise UsageError("--script needs --workdir (or --bundle): the code the script is in")
    return str(path)


def pack(args: argparse.Namespace) -> Any:
    """Pack --workdir; the script, when given, must be one of the packed files."""
    from hybridtrain.packing import PackError, pack_workdir

    try:
        packed = pack_workdir(args.workdir, max_bytes=int(args.max_bundle_mb * MIB))
    except PackError as exc:
        raise UsageError(f"--workdir: {exc}") from None
    for warning in packed.warnings:
        print(f"hybridtrain: warning: {warning}", file=sys.stderr)
    if args.script is not None:
        script = str(PurePosixPath(args.script.replace("\\", "/")))
        if script not in packed.members:
            where = "is ignored by its ignore file" if (Path(args.workdir) / script).is_file() else "does not exist"
            raise UsageError(f"--script {args.script}: {where} in the work dir {args.workdir}")
    return packed


def upload(client: Any, packed: Any, workdir: str) -> str:
    """Upload a packed work dir unless the server has it already; its sha256."""
    from app.cli.client import ApiError

    try:
        client.get_bundle(packed.sha256)
        where = "already on the server"
    except ApiError as exc:
        if exc.status_code != 404:
            raise
        filename = f"{Path(workdir).resolve().name or 'workdir'}.tar.gz"
        client.upload_bundle(packed.data, packed.sha256, filename)
        where = "uploaded"
    print(f"hybridtrain: packed {packed.files} files, {packed.size_bytes / 1e6:.1f} MB, "
          f"sha256 {packed.sha256[:12]}\u2026 ({where})", file=sys.stderr)
    return packed.sha256


def add_code_flags(parser: argparse.ArgumentParser) -> None:
    """`--workdir DIR` or `--bundle SHA256`: the code of a task that is the user's own."""
    code = parser.add_mutually_exclusive_group()
    code.add_argument("--workdir", default=None, metavar="DIR",
                      help="pack DIR (minus .hybridtrainignore / .gitignore) and use that code bundle")
    code.add_argument("--bundle", default=None, metavar="SHA256", help="a bundle uploaded before")
    parser.set_defaults(max_bundle_mb=64.0, script=None)


def code_bundle(client: Any, args: argparse.Namespace) -> str | None:
    """The sha256 of `--bundle`, or of `--workdir` packed and uploaded (UsageError for bad ones)."""
    if args.workdir is None:
        return bundle_flag(args.bundle)
    return upload(client, pack(args), args.workdir)
