"""The example and the overhead benchmark of the transformers adapter run on the CPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run(*cmd):
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_example_generates_identically_and_contains_a_fault():
    out = run(os.path.join("examples", "transformers_generate.py"), "--device", "cpu", "--requests", "8",
              "--new-tokens", "16")
    assert "token-identical with and without the canary: True" in out
    assert "0 violations" in out and "slots verified" in out
    assert "cancelled: its KV cache failed the canary: kvcanary violation [real_kv]" in out
    assert "the other 7 requests completed, 7 token-identical to the clean run" in out


def test_overhead_benchmark_dry_run_prints_its_table():
    out = run("-m", "bench.transformers_overhead", "--device", "cpu", "--small", "--batches", "1,4", "--runs", "1",
              "--new-tokens", "8")
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert lines[0].startswith("| batch | tokens/s without | tokens/s with canary | overhead")
    assert [ln.split("|")[1].strip() for ln in lines[1:]] == ["1", "4"]
