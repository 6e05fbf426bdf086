"""Every example runs as a test: the CPU versions here, the GPU versions where a GPU is."""
from __future__ import annotations

import os
import re
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


def check_violation_lines(out):
    """Each violation line is printed once, and an "expected token -1" is explained where it appears."""
    lines = [ln for ln in out.splitlines() if "kvcanary violation" in ln]
    assert lines, out
    assert len(lines) == len(set(lines)), "a violation line is printed more than once:\n" + out
    all_lines = out.splitlines() + [""]
    for i, ln in enumerate(all_lines):
        if "expected token -1" in ln and "not checked" not in ln:
            j = i + 1
            while "kvcanary violation" in all_lines[j]:
                j += 1
            assert "-1" in all_lines[j] and "not checked" in all_lines[j], \
                f"'expected token -1' is not explained after the violation lines: {ln}"


def test_numpy_quickstart():
    out = run_example("numpy_quickstart.py")
    assert "clean steps, violations: []" in out and "caught:" in out and "monitor raised:" in out
    check_violation_lines(out)


def test_torch_decode_loop_cpu():
    pytest.importorskip("torch")
    out = run_example("torch_decode_loop.py", "--device", "cpu")
    assert "fault caught" in out and "request 'req-2'" in out
    check_violation_lines(out)
    assert re.search(r"first seen at step \d+, [2-9]\d* rows to step \d+", out), out  # repeats folded, not repeated


def test_jax_paged_cache_cpu():
    pytest.importorskip("jax")
    out = run_example("jax_paged_cache.py", "--device", "cpu", env={"JAX_PLATFORMS": "cpu"})
    assert "fault caught" in out and "request 'bob'" in out
    check_violation_lines(out)


@pytest.mark.gpu
def test_torch_decode_loop_cuda_graph():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    out = run_example("torch_decode_loop.py", "--device", "cuda")
    assert "fault caught" in out and "(graph replays)" in out
    check_violation_lines(out)


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
    check_violation_lines(out)


def run_torchrun(name, *args, nproc=2):
    """An example under torchrun (``--standalone``: a free rendezvous port on this host)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "examples", name), *args]
    env = {**ENV, "NCCL_NVLS_ENABLE": "0"}
    if sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the hostname resolves to
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def check_tp_agreement(out):
    assert "both ranks reported rank 1 in the same step" in out, out
    for rank in (0, 1):
        assert f"[rank {rank}] caught:" in out and "rank 1's plan differs from rank 0's" in out, out


def test_tp_agreement_cpu():
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    check_tp_agreement(run_torchrun("tp_agreement.py", "--device", "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_tp_agreement_two_gpus(graph):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available():
        pytest.skip("needs 2 CUDA devices and NCCL")
    check_tp_agreement(run_torchrun("tp_agreement.py", *(["--graph"] if graph else [])))
