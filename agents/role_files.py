"""What a role has on disk before it starts, and the command line that names it: the user's
code (the launch order's bundle, unpacked once per run in `runs/<run>/code`), its metrics file,
the spool of what it could not deliver, and its secrets, each handed to the trainer by a flag
among its own options (`agents.supervisor` starts the process)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agents.bundles import BundleCache
from agents.errors import BundleError
from agents.reports import METRICS_OPTIONS, SPOOL_FILE, file_size, metrics_file, with_flag
from agents.roles import LINK_SECRET_FILE, TOKEN_FILE, write_secret
from agents.spec import RoleSpec, trainer_argv


# The role's data sets and the node's cache for them (hybridtrain.datasets.DatasetsFile).
DATASETS_FILE = "datasets.json"


@dataclass(frozen=True)
class DataCache:
    """This node's data cache (`dir`, at most `max_bytes`) and its site's cache, if any."""

    dir: Path
    max_bytes: int
    site_url: str | None = None


def datasets_document(spec: RoleSpec, cache: DataCache | None) -> str:
    """The `--datasets-file` of `spec`: its data sets, read through this node's site cache."""
    site = cache.site_url if cache else None
    datasets = [a.model_copy(update={"cache_url": site}) if site else a for a in spec.datasets]
    doc = {"datasets": [a.model_dump(mode="json") for a in datasets]}
    if cache is not None:
        doc |= {"cache_dir": str(cache.dir.resolve()), "cache_bytes": cache.max_bytes}
    return json.dumps(doc)


@dataclass(frozen=True)
class RoleFiles:
    """A role's command line and the files it names; `metrics_from` is the metrics file's size
    before this launch (what is past it is this launch's to deliver after a crash)."""

    spec: RoleSpec
    argv: list[str]
    metrics: Path
    metrics_from: int
    spool: Path | None


def prepare_code(bundles: BundleCache | None, spec: RoleSpec, run_dir: Path) -> Path | None:
    """The unpacked bundle of `spec` (fetched if needed), or None without a bundle."""
    if spec.bundle is None:
        return None
    if bundles is None:
        raise BundleError(f"bundle {spec.bundle.short}: this agent has no bundle cache")
    if not spec.report_token:
        raise BundleError(f"bundle {spec.bundle.short}: the launch order carries no run token to fetch it with")
    archive = bundles.ensure(spec.bundle, spec.report_token)
    return bundles.unpack(archive, run_dir / "code", ref=spec.bundle)


def lay_out(spec: RoleSpec, trainer_command: list[str], rank_dir: Path, code_dir: Path | None,
            data_cache: DataCache | None = None) -> RoleFiles:
    """Write `spec`'s secrets under `rank_dir` and build its command line: the trainer's
    options, then the agent's flags for the files it reads and writes."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    metrics = metrics_file(spec.options, rank_dir)
    options = {k: v for k, v in spec.options.items() if k not in METRICS_OPTIONS}
    spec = spec.model_copy(update={"options": {**options, "metrics-out": str(metrics.resolve())}})
    # A rank launched again (a restart, a rejoin) appends: only what this launch wrote is this
    # role's to deliver after a crash.
    metrics_from = file_size(metrics)
    after = len(trainer_command)
    argv = trainer_argv(spec, trainer_command)
    spool = None
    if spec.report_url:
        # What the trainer could not deliver before it exits; posted after the exit.
        spool = rank_dir / SPOOL_FILE
        spool.unlink(missing_ok=True)
        argv = with_flag(argv, "--report-spool", str(spool.resolve()), after=after)
    for secret, name, flag in ((spec.report_token, TOKEN_FILE, "--report-token-file"),
                               (spec.link_secret, LINK_SECRET_FILE, "--link-secret-file")):
        if secret:
            # Not on the command line, which anyone on the node can read in `ps`.
            path = write_secret(rank_dir / name, secret)
            argv = with_flag(argv, flag, str(path.resolve()), after=after)
    if spec.datasets:
        # Owner-only, like the secrets: it carries the store's credentials.
        path = write_secret(rank_dir / DATASETS_FILE, datasets_document(spec, data_cache))
        argv = with_flag(argv, "--datasets-file", str(path.resolve()), after=after)
    return RoleFiles(spec, with_code_dir(argv, code_dir, after=after), metrics, metrics_from, spool)


def with_code_dir(argv: list[str], code_dir: Path | None, *, after: int) -> list[str]:
    """`argv` with `--code-dir DIR` among the trainer's options (after the first `after` words,
    the trainer command)."""
    if code_dir is None:
        return argv
    # Absolute: the role starts in that directory, where a relative path (an agent run with a
    # relative --state-dir, as `hybridtrain local` does) would point below itself.
    return with_flag(argv, "--code-dir", str(Path(code_dir).resolve()), after=after)
