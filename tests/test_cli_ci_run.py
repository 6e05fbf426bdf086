"""``.ci/run``: its exit status is the README test command's, with stand-in python / pip.

The script runs in a copy of itself, against stub ``python3`` / ``python`` / ``pip``
executables that log each call and exit with the status the test asks for, so the
order of the installs and the handling of pytest's exit codes are checked in seconds.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
echo "{name} $*" >> "$CI_LOG"
{body}
"""

PYTHON3 = """if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin"
    printf 'export PATH="%s:$PATH"\\n' "$CI_STUBS" > "$3/bin/activate"
fi
exit 0"""

PYTHON = """if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then exit "$PYTEST_RC"; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then exit 0; fi
exit 0"""

PIP = 'exit "$PIP_RC"'

bash = shutil.which("bash")


def _stub(d: pathlib.Path, name: str, body: str) -> None:
    p = d / name
    p.write_text(STUB.format(name=name, body=body))
    p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def ci(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _stub(stubs, "python3", PYTHON3)
    _stub(stubs, "python", PYTHON)
    _stub(stubs, "pip", PIP)
    log = tmp_path / "calls.log"

    def run(pytest_rc=0, pip_rc=0):
        log.write_text("")
        env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "CI_LOG": str(log),
               "CI_STUBS": str(stubs), "PYTEST_RC": str(pytest_rc), "PIP_RC": str(pip_rc)}
        env.pop("VIRTUAL_ENV", None)
        out = subprocess.run([bash, str(repo / ".ci" / "run")], capture_output=True, text=True, env=env,
                             timeout=60)
        return out, log.read_text().splitlines()

    return run


pytestmark = pytest.mark.skipif(bash is None, reason="needs bash")


def test_passing_tests_pass_ci_after_the_pinned_installs(ci):
    out, calls = ci(pytest_rc=0)
    assert out.returncode == 0, out.stderr
    readme = [i for i, c in enumerate(calls) if c == "pip install -e .[test]"]
    tests = [i for i, c in enumerate(calls) if c.startswith("python -m pytest")]
    assert readme and tests and readme[0] < tests[0], calls
    torch = [i for i, c in enumerate(calls) if "torch==2.13.0" in c]
    nvrtc = [i for i, c in enumerate(calls) if "nvidia-cuda-nvrtc==13.0.88" in c]
    assert torch and nvrtc and max(torch[0], nvrtc[0]) < readme[0], calls


@pytest.mark.parametrize("rc", [1, 2, 3, 4, 5])
def test_every_pytest_failure_status_fails_ci(ci, rc):
    out, calls = ci(pytest_rc=rc)
    assert out.returncode == rc, (out.stdout, out.stderr)
    assert out.stderr.strip().splitlines()[-1].startswith("kvcanary:")


def test_a_failed_install_fails_ci_and_runs_no_tests(ci):
    out, calls = ci(pip_rc=1)
    assert out.returncode != 0
    assert not any(c.startswith("python -m pytest") for c in calls), calls
