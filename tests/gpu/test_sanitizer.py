"""Out-of-range data runs clean under ``compute-sanitizer --tool memcheck``."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

HERE = pathlib.Path(__file__).resolve().parent


def _sanitizer():
    exe = shutil.which("compute-sanitizer")
    for guess in ("/usr/local/cuda/bin/compute-sanitizer", "/opt/nvidia/compute-sanitizer/compute-sanitizer"):
        if exe is None and os.path.exists(guess):
            exe = guess
    if exe is None:
        pytest.skip("compute-sanitizer is not installed")
    return exe


def test_out_of_range_runs_clean_under_memcheck(capsys):
    exe = _sanitizer()
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cases = os.environ.get("KVCANARY_SANITIZER_CASES", "25")
    r = subprocess.run([exe, "--tool", "memcheck", "--error-exitcode", "99", sys.executable,
                        str(HERE / "sanitizer_workload.py"), cases],
                       env=env, capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    with capsys.disabled():
        print("\n" + "\n".join(line for line in out.splitlines()
                              if "ERROR SUMMARY" in line or "parity fuzz" in line))
    assert "ERROR SUMMARY: 0 errors" in out, out[-6000:]
    assert r.returncode == 0, out[-6000:]
