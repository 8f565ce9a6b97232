"""`make doctor` (tests/doctor.py): its report on this machine, which has everything the suite
needs, and what it says when a prerequisite is missing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests import doctor

ROOT = Path(__file__).resolve().parents[1]


def test_doctor_finds_every_prerequisite_on_this_machine():
    proc = subprocess.run([sys.executable, "-m", "tests.doctor"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines[0] == "hybridtrain test prerequisites" and lines[-1] == "everything the suite needs is here"
    checks = lines[1:-1]
    assert len(checks) == len(doctor.CHECKS) and all(line.startswith("  ok       ") for line in checks)
    for what in ("root", "cgroup cpu controller", "`ip netns`", "`tc`", "Postgres at postgresql://",
                 "Redis at redis://", "`redis-server` on PATH", "Chromium at /usr/bin/chromium"):
        assert any(what in line for line in checks), what


def test_an_unreachable_redis_is_reported_missing_with_its_fix():
    text = doctor.report([doctor.check_python(), doctor.check_redis("redis://127.0.0.1:1/0")])
    lines = text.splitlines()
    assert lines[1].startswith("  ok       Python >= 3.11")
    assert lines[2].startswith("  MISSING  Redis at redis://127.0.0.1:1/0: ")
    assert lines[3].startswith("           fix: apt-get install redis-server")
    assert lines[-1] == "1 missing: the tests that need it would fail"


def test_a_postgres_that_refuses_the_role_is_reported_missing():
    check = doctor.check_postgres("postgresql://postgres@127.0.0.1:1/postgres")
    assert not check.ok and "pg_hba.conf" in check.fix and "HYBRIDTRAIN_TEST_POSTGRES" in check.fix


def test_a_host_without_a_cgroup_cpu_controller_is_told_how_to_get_it(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory io\n")
    check = doctor.check_cgroup(f"cgroup2 {tmp_path} cgroup2 rw,nosuid 0 0\n")
    assert not check.ok and check.detail == f"cgroup2 at {tmp_path} (controllers: memory io)"
    assert "cgroup2" in check.fix and "/sys/fs/cgroup/cpu" in check.fix


def test_a_cgroup_v2_host_with_the_cpu_controller_is_fine(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    check = doctor.check_cgroup(f"cgroup2 {tmp_path} cgroup2 rw,nosuid,nodev,noexec 0 0\n")
    assert check.ok and check.detail == f"cgroup v2 at {tmp_path}"


def test_a_cgroup_v1_host_with_the_cpu_controller_is_fine():
    check = doctor.check_cgroup("cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n")
    assert check.ok and check.detail == "cgroup v1 at /sys/fs/cgroup/cpu"


def test_doctor_looks_for_chromium_where_the_browser_tests_start_it():
    from tests.app.web.conftest import CHROMIUM

    assert str(doctor.CHROMIUM) == CHROMIUM
    assert not doctor.check_chromium(Path("/nonexistent/chromium")).ok


def test_make_test_runs_the_doctor_before_the_suite():
    rules = dict(re.findall(r"^([\w-]+):([^\n=]*)$", (ROOT / "Makefile").read_text(), re.M))
    assert "doctor" in rules["test"].split()
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    lines = dry.splitlines()
    doctor_at = next(i for i, line in enumerate(lines) if line.endswith("python -m tests.doctor"))
    assert doctor_at < next(i for i, line in enumerate(lines) if "python -m pytest" in line)
