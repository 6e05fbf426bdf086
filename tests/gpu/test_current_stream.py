"""The caller's current CuPy stream is still current after every kvcanary call that runs
CuPy work on the op's stream (see runtime.on_cupy_stream). If it were not, the caller's
next CuPy work would leave its stream, unordered with the ops queued there."""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvMode

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy  # noqa: PLC0415

    before = cupy.cuda.get_current_stream()
    yield cupy
    before.use()


def _calls(cp, op_stream):
    """Zero-argument calls of every entry point that queues CuPy work on ``op_stream``."""
    log = kc.ViolationLog.allocate(capacity=8, device="cuda")
    canary = kc.CanaryBuffer.allocate(num_slots=64, device="cuda")
    wp = kc.WritePlan.allocate(max_batch=1, device="cuda")
    kv = cp.arange(64 * 32, dtype=cp.uint8).reshape(64, 32)
    src = kc.RealKvSource(kv, page_size=1, bytes_per_token=32)
    table = cp.asarray(np.arange(16, dtype=np.int32).reshape(1, 16) + 1).repeat(2, axis=0)
    one, zero, four = (cp.full(1, v, dtype=cp.int64) for v in (1, 0, 4))
    ids, loc = cp.arange(4), cp.arange(1, 5)
    cp.cuda.Device().synchronize()  # inputs made on the current stream are ready for the op's

    def write():  # a new set of sources: its fold table is uploaded on the op's stream
        kc.plan(None, wp, req_pool_indices=one, prefix_lens=zero, extend_lens=four, req_to_token=table,
                stream=op_stream)
        kc.write(canary, wp, input_ids=ids, positions=ids, out_cache_loc=loc,
                 log=log, tag=1, real_kv=src, real_kv_mode=RealKvMode.ALL, stream=op_stream)

    return {"log.clear": lambda: log.clear(op_stream), "log.reset_counters": lambda: log.reset_counters(op_stream),
            "write with sources": write}


@pytest.mark.parametrize("how", ["use", "with"])
def test_ops_on_another_stream_leave_the_callers_stream_current(cp, how):
    mine = cp.cuda.Stream(non_blocking=True)
    op_stream = cp.cuda.Stream(non_blocking=True)
    calls = _calls(cp, op_stream)
    for name, call in calls.items():
        if how == "use":
            mine.use()
            call()
            assert cp.cuda.get_current_stream() == mine, name
        else:
            with mine:
                call()
                assert cp.cuda.get_current_stream() == mine, name
    op_stream.synchronize()


def test_torch_import_leaves_the_callers_stream_current(cp):
    torch = pytest.importorskip("torch")
    mine = cp.cuda.Stream(non_blocking=True).use()
    vp = kc.VerifyPlan.allocate(capacity=8, max_batch=1, device="cuda")
    t = torch.arange(1, 9, dtype=torch.int32, device="cuda").reshape(1, 8).repeat(2, 1)
    one = torch.ones(1, dtype=torch.int64, device="cuda")
    kc.plan(vp, None, req_pool_indices=one, prefix_lens=one * 3, extend_lens=one * 0, req_to_token=t)
    assert cp.cuda.get_current_stream() == mine
    torch.cuda.synchronize()
    assert vp.host_entries()["slot_indices"].tolist() == [1, 2, 3]
