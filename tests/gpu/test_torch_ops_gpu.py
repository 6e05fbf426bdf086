"""The torch.library custom ops on CUDA tensors (tests/test_torch_ops.py's harness on a GPU).

The reference is the library's own ops on CuPy arrays (the same CUDA backend), so every
byte must agree, except the order of violation rows, which GPU atomics leave open (rows
are compared as a multiset). Beyond the CPU tests: the ops run on PyTorch's current
stream (a side stream that is still busy, and a CUDA graph capture, would both expose a
launch anywhere else), and the compiled step replays from a CUDA graph.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.test_torch_ops import (
    LibraryEngine,
    TorchEngine,
    assert_faults_found,
    assert_same_state,
    flat_args,
    make_workload,
    run_side_by_side,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch sees no CUDA device")]


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def _engines(wl, cp, *, fused, sampler_period=0, **torch_kw):
    return {"library": LibraryEngine(wl, xp=cp, device="cuda", fused=fused, sampler_period=sampler_period),
            "torch_ops": TorchEngine(wl, device="cuda", fused=fused, sampler_period=sampler_period, **torch_kw)}


def _rows(state):
    return state["log.ring"][: int(state["log.head"][0])]


@pytest.mark.parametrize("fused", [True, False], ids=["plan_and_verify", "plan+verify"])
@pytest.mark.parametrize("paged", [False, True], ids=["req_to_token", "block_table"])
def test_eager_custom_ops_on_cuda_write_the_bytes_of_the_library_ops(cp, fused, paged):
    wl = make_workload(11, paged=paged)
    final = run_side_by_side(wl, _engines(wl, cp, fused=fused, sampler_period=2), rows_as_multiset=True)
    assert_faults_found(wl, _rows(final["torch_ops"]))


@pytest.mark.parametrize("fused", [True, False], ids=["plan_and_verify", "plan+verify"])
def test_compiled_fullgraph_step_on_cuda_matches_the_library(cp, fused):
    torch.compiler.reset()
    wl = make_workload(12)
    engines = _engines(wl, cp, fused=fused)
    engines["compiled"] = TorchEngine(wl, device="cuda", fused=fused, compiled=True)
    final = run_side_by_side(wl, engines, rows_as_multiset=True)
    assert_faults_found(wl, _rows(final["compiled"]))


def test_plan_verify_write_op_on_cuda_matches_the_library(cp):
    """A step stamped before its forward: the library's plan_verify_write on CuPy arrays, the
    custom op eager and in a fullgraph-compiled step."""
    torch.compiler.reset()
    wl = make_workload(16)
    engines = {"library": LibraryEngine(wl, xp=cp, device="cuda", stamp=True),
               "eager": TorchEngine(wl, device="cuda", stamp=True),
               "compiled": TorchEngine(wl, device="cuda", stamp=True, compiled=True)}
    final = run_side_by_side(wl, engines, rows_as_multiset=True)
    assert_faults_found(wl, _rows(final["compiled"]), real_kv=False)


@pytest.mark.parametrize("op", ["plan", "verify", "write", "plan_and_verify", "plan_verify_write"])
def test_opcheck_on_cuda(op):
    wl = make_workload(13)
    eng = TorchEngine(wl, device="cuda", sampler_period=3, stamp=op == "plan_verify_write")
    for s in wl.steps[:3]:
        eng.step(s)
    torch.library.opcheck(getattr(torch.ops.kvcanary, op).default, flat_args(eng, op))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ops_run_on_the_current_torch_stream(cp, compiled):
    """On a side stream kept busy before its inputs are refilled (device to device, queued
    behind the busy kernel), a launch on any other stream would read the previous step's
    inputs."""
    torch.compiler.reset()
    wl = make_workload(14)
    ref = LibraryEngine(wl, xp=cp, device="cuda", fused=True)
    eng = TorchEngine(wl, device="cuda", compiled=compiled)
    staged = [eng.stage(s) for s in wl.steps]
    side = torch.cuda.Stream()
    for k, s in enumerate(wl.steps):
        ref.step(s)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of a busy stream
            eng.load(staged[k], staged=True)
            eng.run(**eng.inputs)
        side.synchronize()
        assert_same_state(ref.state(), eng.state(), f"step {k}", rows_as_multiset=True)


def test_compiled_step_captured_in_a_cuda_graph_replays_like_the_library(cp):
    """Warm up on a side stream, capture one compiled step, then refill the static inputs
    and replay for every later step. Nothing may run during the capture itself (a launch
    outside the capture stream would), and every replay must match the library."""
    torch.compiler.reset()
    wl = make_workload(15, num_steps=9)
    ref = LibraryEngine(wl, xp=cp, device="cuda", fused=True)
    eng = TorchEngine(wl, device="cuda", compiled=True)
    warm = 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in wl.steps[:warm]:
            eng.step(s)
    torch.cuda.current_stream().wait_stream(side)
    for s in wl.steps[:warm]:
        ref.step(s)
    assert_same_state(ref.state(), eng.state(), "warm-up", rows_as_multiset=True)

    eng.load(wl.steps[warm])
    torch.cuda.synchronize()
    before = eng.state()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eng.run(**eng.inputs)
    torch.cuda.synchronize()
    assert_same_state(before, eng.state(), "right after the capture (nothing may have run)")

    for k, s in enumerate(wl.steps[warm:], start=warm):
        eng.load(s)
        graph.replay()
        ref.step(s)
        assert_same_state(ref.state(), eng.state(), f"replay of step {k}", rows_as_multiset=True)
    assert_faults_found(wl, _rows(eng.state()))
