"""``python -m kvcanary_cupy selftest`` as a newcomer meets it: which backend and why, and what
the summary's numbers are.

A stand-in ``cupy`` package on PYTHONPATH plays "CuPy installed, no CUDA device" (or
"not installed") whatever this machine really has.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from kvcanary_cupy import selftest
from tests.fake_cupy import NO_DEVICE, NOT_INSTALLED, ROOT, fake_cupy_env


def selftest_cli(env, *args):
    return subprocess.run([sys.executable, "-m", "kvcanary_cupy", "selftest", "--steps", "20", "--injections", "1",
                           *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_auto_says_why_it_runs_on_numpy_when_cupy_sees_no_device(tmp_path):
    env = fake_cupy_env(tmp_path, NO_DEVICE)
    for quiet in ((), ("--quiet",)):
        out = selftest_cli(env, *quiet)
        assert out.returncode == 0, out.stdout + out.stderr
        notes = [ln for ln in out.stderr.splitlines() if "CuPy is installed" in ln]
        assert len(notes) == 1, out.stderr
        assert "found no CUDA device" in notes[0] and "cudaErrorNoDevice" in notes[0]
        assert notes[0].endswith("running on the NumPy backend")
        assert out.stdout.rstrip().endswith("on numpy")


def test_auto_without_cupy_runs_on_numpy_without_that_note(tmp_path):
    out = selftest_cli(fake_cupy_env(tmp_path, NOT_INSTALLED))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CuPy is installed" not in out.stderr and "NumPy backend" in out.stderr


@pytest.mark.parametrize("source", [NO_DEVICE, NOT_INSTALLED], ids=["no-device", "not-installed"])
def test_backend_cuda_without_a_device_is_one_line_not_a_traceback(tmp_path, source):
    out = selftest_cli(fake_cupy_env(tmp_path, source), "--backend", "cuda")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcanary: selftest:"), out.stderr
    assert "--backend numpy" in lines[0] and "Traceback" not in out.stderr


def test_the_clean_step_counts_are_explained_and_add_up():
    report = selftest.run(backend="numpy", steps=40, injections=1, seed=1, progress=lambda s: None)
    table = selftest.format_table(report)
    found = re.findall(r"clean steps \(no fault in effect\): (\d+) = (\d+) in the clean run \+ (\d+) in the "
                       r"injection runs before their fault fired; false positives over them: (\d+)", table)
    assert len(found) == len(report["chains"]) == 2, table  # one explanation per chain kind, in order
    for (kind, r), m in zip(report["chains"].items(), found):
        total, clean, before, fp = map(int, m)
        assert clean == r["clean"]["steps"] == 40, kind
        assert before == sum(c["clean_steps"] for c in r["classes"]) > 0
        assert total == clean + before and fp == 0


def test_the_summary_names_each_chain_kind_and_ends_with_the_verdict(tmp_path):
    env = fake_cupy_env(tmp_path, NOT_INSTALLED)
    out = selftest_cli(env, "--chain", "both")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "chain 'scan': PASS" in out.stdout and "chain 'sglang': PASS" in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("PASS (chain kinds: scan, sglang)")
    assert "chain kinds scan, sglang" in out.stderr
    one = selftest_cli(env, "--chain", "sglang")
    assert one.returncode == 0, one.stdout + one.stderr
    assert "chain 'scan'" not in one.stdout and "chain 'sglang': PASS" in one.stdout
    assert one.stdout.rstrip().splitlines()[-1].startswith("PASS (chain kinds: sglang)")


def _bad_json_paths(tmp_path):
    (tmp_path / "a_file").write_text("")
    return {"missing folder": str(tmp_path / "no" / "such" / "dir" / "x.json"),
            "a folder": str(tmp_path),
            "folder is a file": str(tmp_path / "a_file" / "x.json"),
            "empty": ""}


def test_an_unwritable_json_path_is_refused_before_the_run(tmp_path):
    env = fake_cupy_env(tmp_path, NOT_INSTALLED)
    for what, path in _bad_json_paths(tmp_path).items():
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "selftest", "--steps", "1", "--injections", "1",
                              "--json", path], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        took = time.monotonic() - t0
        assert out.returncode == 2, (what, out.returncode, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr, (what, out.stderr)
        assert lines[0].startswith(f"kvcanary: selftest: --json {path!r}: ") and "expected" in lines[0], lines[0]
        assert out.stdout == "" and "NumPy backend" not in out.stderr, what  # no run: no table, no progress
        assert took < 20, (what, took)
    path = tmp_path / "new" / "report.json"  # a path in a folder that exists gets the report
    path.parent.mkdir()
    out = selftest_cli(env, "--steps", "1", "--quiet", "--json", str(path))
    assert out.returncode == 0, out.stderr
    assert json.loads(path.read_text())["ok"] is True
