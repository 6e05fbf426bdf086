"""Every example runs as a test: the CPU versions here, the GPU versions where a GPU is."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_example(name, *args, env=None):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], capture_output=True,
                         text=True, env={**ENV, **(env or {})}, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_numpy_quickstart():
    out = run_example("numpy_quickstart.py")
    assert "clean steps, violations: []" in out and "caught:" in out and "monitor raised:" in out


def test_torch_decode_loop_cpu():
    pytest.importorskip("torch")
    out = run_example("torch_decode_loop.py", "--device", "cpu")
    assert "fault caught" in out and "request 'req-2'" in out


def test_jax_paged_cache_cpu():
    pytest.importorskip("jax")
    out = run_example("jax_paged_cache.py", "--device", "cpu", env={"JAX_PLATFORMS": "cpu"})
    assert "fault caught" in out and "request 'bob'" in out


@pytest.mark.gpu
def test_torch_decode_loop_cuda_graph():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    out = run_example("torch_decode_loop.py", "--device", "cuda")
    assert "fault caught" in out and "(graph replays)" in out


@pytest.mark.gpu
def test_jax_paged_cache_cuda():
    pytest.importorskip("jax")
    env = {**ENV, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    # Probe in a child: JAX in this process would hold GPU memory for the rest of the session.
    code = "import jax; print(any(d.platform == 'gpu' for d in jax.devices()))"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if probe.stdout.strip() != "True":
        pytest.skip("JAX sees no GPU (a CPU-only jax is installed)")
    out = run_example("jax_paged_cache.py", "--device", "cuda", env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert "fault caught" in out
