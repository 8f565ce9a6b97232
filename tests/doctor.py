"""What the test suite needs from this machine, checked up front: `make doctor` (and `make test`
before it starts) prints one line per prerequisite, how to get each missing one, and exits 1 if
any is missing, instead of the suite failing at its first test that needs it.

The addresses and paths are the suite's own (tests/conftest.py, tests/app/web/conftest.py,
testbed/system.py), so this report and the tests cannot disagree about them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.cgroup_fs import detect
from testbed.errors import NoCpuCgroupError
from tests.conftest import POSTGRES_ADMIN_DSN, REDIS_URL

CHROMIUM = Path("/usr/bin/chromium")  # tests/app/web/conftest.py's CHROMIUM (checked by tests/test_doctor.py)
MIN_PYTHON = (3, 11)


@dataclass(frozen=True)
class Check:
    """One prerequisite: what it is, whether it is there, what was seen, how to get it."""

    name: str
    ok: bool
    detail: str = ""
    fix: str = ""


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    return Check(f"Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}", sys.version_info[:2] >= MIN_PYTHON, version,
                 "install python3.11 or newer, then `make clean install-dev PYTHON=python3.11`")


def check_root() -> Check:
    uid = os.geteuid()
    return Check("root (network namespaces, tc, cgroups)", uid == 0, f"uid {uid}",
                 "run the suite as root: `sudo make test`")


def check_cgroup(mounts: str | None = None) -> Check:
    """The cpu controller of cgroup v1 or v2, as the testbed detects it (`mounts`: the text of
    /proc/self/mounts, read when None)."""
    name = "cgroup cpu controller, v1 or v2 (the testbed's CPU quotas)"
    try:
        found = detect(mounts)
    except NoCpuCgroupError as exc:
        return Check(name, False, exc.seen, exc.FIX)
    return Check(name, True, f"cgroup v{found.version} at {found.root}")


def _tool(name: str, argv: Sequence[str], package: str) -> Check:
    path = shutil.which(argv[0])
    fix = f"apt-get install {package}"
    if path is None:
        return Check(name, False, f"`{argv[0]}` not on PATH", fix)
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(name, False, f"`{' '.join(argv)}`: {exc}", fix)
    if proc.returncode != 0:
        return Check(name, False, f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()[:120]}", fix)
    return Check(name, True, path)


def check_ip_netns() -> Check:
    return _tool("`ip netns` (emulated sites and links)", ["ip", "netns", "list"], "iproute2")


def check_tc() -> Check:
    return _tool("`tc` (shaped links)", ["tc", "-V"], "iproute2")


def check_redis_server() -> Check:
    return _tool("`redis-server` on PATH (a broker on a test link's address)", ["redis-server", "--version"],
                 "redis-server")


def check_chromium(path: Path = CHROMIUM) -> Check:
    ok = path.is_file() and os.access(path, os.X_OK)
    return Check(f"Chromium at {path} (browser tests)", ok, "" if ok else "not found",
                 "`make chromium` (apt-get install chromium)")


def check_postgres(dsn: str = POSTGRES_ADMIN_DSN) -> Check:
    import psycopg

    name = f"Postgres at {dsn}"
    fix = ("apt-get install postgresql; let the `postgres` role in without a password from 127.0.0.1 "
           "(pg_hba.conf: `host all postgres 127.0.0.1/32 trust`), or set HYBRIDTRAIN_TEST_POSTGRES "
           "to the DSN of such a role")
    try:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            row = conn.execute(
                "SELECT rolsuper OR rolcreatedb, current_setting('server_version') FROM pg_roles "
                "WHERE rolname = current_user"
            ).fetchone()
    except psycopg.Error as exc:
        return Check(name, False, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, fix)
    if row is None or not row[0]:
        return Check(name, False, "connected, but the role may not create databases", fix)
    return Check(name, True, f"server {row[1]}")


def check_redis(url: str = REDIS_URL) -> Check:
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3).ping()
    except redis.RedisError as exc:
        return Check(f"Redis at {url}", False, str(exc),
                     "apt-get install redis-server && service redis-server start, "
                     "or set HYBRIDTRAIN_TEST_REDIS to a Redis the tests may flush")
    return Check(f"Redis at {url}", True)


CHECKS: tuple[Callable[[], Check], ...] = (
    check_python, check_root, check_cgroup, check_ip_netns, check_tc, check_postgres, check_redis,
    check_redis_server, check_chromium,
)


def report(checks: Sequence[Check]) -> str:
    """The report: a line per check, its fix under each missing one, then a verdict."""
    lines = ["hybridtrain test prerequisites"]
    for check in checks:
        detail = f": {check.detail}" if check.detail else ""
        lines.append(f"  {'ok' if check.ok else 'MISSING':<8} {check.name}{detail}")
        if not check.ok:
            lines.append(f"           fix: {check.fix}")
    missing = sum(not c.ok for c in checks)
    lines.append("everything the suite needs is here" if not missing else
                 f"{missing} missing: the tests that need {'it' if missing == 1 else 'them'} would fail")
    return "\n".join(lines)


def main() -> int:
    """Print the report; 0 when nothing is missing, 1 otherwise."""
    checks = [check() for check in CHECKS]
    print(report(checks))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
