"""The vLLM connector's host-time benchmark runs on the CPU engine and accounts for its time."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_connector_bench_splits_its_time_and_checks_clean(tmp_path):
    path = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "bench.vllm_connector_overhead", "--requests", "4", "--batches", "2",
                          "--new", "6", "--cpu-backends", "auto,numba", "--json", str(path)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = json.loads(path.read_text())
    # "auto" in an engine run in this process: the NumPy reference (numba would keep vLLM's CPU
    # worker from starting a later engine here); then numba's compiled ops, as asked.
    assert [r["cpu_backend"] for r in runs] == ["numpy", "numba"]
    for r in runs:
        assert r["batch"] == 2 and r["decode_steps"] >= 1 and r["violations"] == 0
        assert 0 < r["connector_us"] < r["engine_step_us"]
        # The kernels' work and the K/V gather are inside the connector, each measured, and the
        # three kinds of time account for it (medians of per-step sums, so up to rounding).
        assert 0 < r["backend_us"] < r["monitor_us"] <= r["connector_us"]
        assert 0 < r["gather_us"] < r["connector_us"]
        assert r["python_us"] > 0
        assert r["backend_us"] + r["gather_us"] + r["python_us"] == pytest.approx(r["connector_us"], rel=0.25)
    lines = [ln for ln in out.stdout.splitlines() if "batch   2:" in ln]
    assert [ln.split()[0] for ln in lines] == ["numpy", "numba"]
    assert all("by kind: backend" in ln and "0 violations" in ln for ln in lines)
