"""Ops inside CUDA graph capture are really captured and replay correctly.

A kernel launched on the wrong stream during a capture runs at once, outside the
graph, without any error. So every capture here starts from poisoned outputs and
checks they are still poisoned right after the capture (nothing ran), then
refills the static inputs in place, replays, and compares with the same step run
eagerly on fresh buffers. A negative control launches on a side stream and
checks that this detector fires.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvMode
from kvcanary_cupy.runtime import to_host

pytestmark = pytest.mark.gpu

try:  # imported at collection, before any test body runs (and before cuda.bindings is loaded)
    import torch as _torch
except ImportError:
    _torch = None


def _need_torch():
    if _torch is None:
        pytest.skip("PyTorch is not installed")
    return _torch

BS, WIDTH, NREQ = 6, 48, 8
N = NREQ * WIDTH + 64
POISON = -5555


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


class Step:
    """Buffers of one monitor-like step: plan, write, verify (sampled, real KV)."""

    def __init__(self, cp, rng):
        self.canary = kc.CanaryBuffer.allocate(num_slots=N, device="cuda")
        self.log = kc.ViolationLog.allocate(capacity=8192, device="cuda")  # never drops: GPU append order is free
        self.vp = kc.VerifyPlan.allocate(capacity=BS * WIDTH, max_batch=BS, device="cuda")
        self.wp = kc.WritePlan.allocate(max_batch=BS, device="cuda")
        self.sampler = kc.FingerprintSampler.allocate(period=3, device="cuda")
        self.pool = cp.asarray(rng.integers(0, 256, size=(2, N * 32), dtype=np.uint8))
        self.src = kc.RealKvSource(self.pool, page_size=1, bytes_per_token=32, layer_axis=True)

    def reset_after_warmup(self):
        """Forget what a warm-up run wrote (on CuPy's current stream): records, log, sampler and the
        plans' cumulative counters (the eager twin never saw the warm-up data), then poison the plans."""
        self.canary.records.fill(0)
        self.log.clear()
        self.log.reset_counters()
        self.sampler.state.fill(0)
        for f in ("input_errors", "overflows", "max_requested"):
            getattr(self.vp, f).fill(0)
        self.wp.input_errors.fill(0)
        self.poison()

    def poison(self):
        for f in kc.VerifyPlan.ENTRY_FIELDS + ("offsets",):
            getattr(self.vp, f).fill(POISON)
        self.wp.offsets.fill(POISON)
        self.wp.seed_slots.fill(POISON)
        self.log.ring.fill(POISON)

    def run(self, inp, stream=None, verify_stream=None):
        kc.plan(self.vp, self.wp, req_pool_indices=inp["rpi"], prefix_lens=inp["pre"], extend_lens=inp["ext"],
                req_to_token=inp["table"], stream=stream)
        kc.write(self.canary, self.wp, input_ids=inp["ids"], positions=inp["pos"], out_cache_loc=inp["loc"],
                 log=self.log, tag=kc.LaunchTag.WRITE, real_kv=[self.src], real_kv_mode=RealKvMode.ALL, stream=stream)
        kc.verify(self.canary, self.vp, log=self.log, tag=kc.LaunchTag.VERIFY, real_kv=[self.src],
                  real_kv_mode=RealKvMode.ALL, check_tokens=False, sample=self.sampler,
                  stream=stream if verify_stream is None else verify_stream)

    def state(self):
        rows = collections.Counter(tuple(int(x) for x in r) for r in self.log.rows())
        return dict(vp=self.vp.host_entries(), vps=self.vp.host_scalars(), wo=to_host(self.wp.offsets).tolist(),
                    ws=to_host(self.wp.seed_slots).tolist(), rec=self.canary.host_records(), rows=rows,
                    cnt=self.log.counters(), head=self.log.count, samp=to_host(self.sampler.state).tolist())

    def untouched(self) -> bool:
        return bool((to_host(self.vp.slot_indices) == POISON).all() and (to_host(self.wp.offsets) == POISON).all()
                    and self.log.count == 0 and self.log.counters()["kernel_runs"] == 0)


def fresh_data(rng):
    """A step's inputs as NumPy: distinct slots per request, corrupted positions now and then."""
    table = rng.permutation(np.arange(1, N))[: NREQ * WIDTH].reshape(NREQ, WIDTH)
    table[0] = 0
    rpi = rng.permutation(np.arange(1, NREQ))[:BS]
    rpi[rng.integers(0, BS)] = 0
    pre = rng.integers(0, 30, size=BS)
    ext = rng.integers(1, 4, size=BS)
    ext[rpi == 0] = 0
    ids, pos, loc = [], [], []
    for r in range(BS):
        for j in range(int(ext[r])):
            ids.append(int(rng.integers(0, 1000)))
            pos.append(int(pre[r]) + j + (1 if rng.random() < 0.1 else 0))
            loc.append(int(table[rpi[r], pre[r] + j]))
    tot = BS * 3
    pad = lambda a: np.array(a + [0] * (tot - len(a)), dtype=np.int64)  # noqa: E731
    return dict(rpi=rpi.astype(np.int64), pre=pre.astype(np.int64), ext=ext.astype(np.int64),
                table=table.astype(np.int32), ids=pad(ids), pos=pad(pos), loc=pad(loc))


def assert_same(a, b):
    for k in a:
        if k == "vp":
            for f in a[k]:
                assert np.array_equal(a[k][f], b[k][f]), f
        elif k == "rec":
            assert np.array_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


def _static_torch(torch, data):
    return {k: torch.from_numpy(v).cuda() for k, v in data.items()}


def _refill_torch(static, data):
    for k, v in data.items():
        static[k].copy_(static[k].new_tensor(v))


def test_torch_graph_capture_and_replay(cp):
    torch = _need_torch()
    rng = np.random.default_rng(1)
    g_step, e_step = Step(cp, np.random.default_rng(9)), Step(cp, np.random.default_rng(9))
    static = _static_torch(torch, fresh_data(rng))
    side = torch.cuda.Stream()
    # verify takes no framework inputs, so its default is CuPy's stream: pass torch's.
    with torch.cuda.stream(side):  # warm-up: first calls allocate the plan launch state and fold table
        g_step.run(static, verify_stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    g_step.reset_after_warmup()
    cp.cuda.Device().synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # plan and write get torch tensors: their default stream is the capture stream
        g_step.run(static, verify_stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert g_step.untouched(), "an op ran outside the graph during capture"
    e_step.poison()
    for i in range(4):
        data = fresh_data(rng)
        _refill_torch(static, data)
        graph.replay()
        e_step.run({k: cp.asarray(v) for k, v in data.items()})
        torch.cuda.synchronize()
        assert_same(g_step.state(), e_step.state())
    assert to_host(g_step.sampler.state).tolist() == [4, 0]


def test_torch_capture_with_preimported_views_and_explicit_stream(cp):
    """Engines import once and pass views: then the stream must be given."""
    torch = _need_torch()
    rng = np.random.default_rng(2)
    g_step, e_step = Step(cp, np.random.default_rng(4)), Step(cp, np.random.default_rng(4))
    static = _static_torch(torch, fresh_data(rng))
    views = {k: kc.as_view(v, k) for k, v in static.items()}
    g_step.run(views, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    g_step.reset_after_warmup()
    cp.cuda.Device().synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_step.run(views, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert g_step.untouched()
    e_step.poison()
    for _ in range(3):
        data = fresh_data(rng)
        _refill_torch(static, data)
        graph.replay()
        e_step.run({k: cp.asarray(v) for k, v in data.items()})
        torch.cuda.synchronize()
        assert_same(g_step.state(), e_step.state())


def test_capture_detector_catches_a_wrong_stream(cp):
    """Negative control: ops sent to a side stream during a capture run at once."""
    torch = _need_torch()
    rng = np.random.default_rng(3)
    step = Step(cp, np.random.default_rng(5))
    views = {k: cp.asarray(v) for k, v in fresh_data(rng).items()}
    wrong = cp.cuda.Stream(non_blocking=True)
    step.run(views, stream=wrong)
    wrong.synchronize()
    step.log.clear()
    step.log.reset_counters()
    step.poison()
    cp.cuda.Device().synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(views, stream=wrong)
        torch.zeros(1, device="cuda").add_(1)  # the graph needs at least one node
    torch.cuda.synchronize()
    wrong.synchronize()
    assert not step.untouched(), "the detector missed kernels launched outside the capture"


def test_cupy_stream_capture_and_replay(cp):
    rng = np.random.default_rng(6)
    g_step, e_step = Step(cp, np.random.default_rng(8)), Step(cp, np.random.default_rng(8))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        static = {k: cp.asarray(v) for k, v in fresh_data(rng).items()}
        g_step.run(static)  # warm-up on s (CuPy's current stream)
    s.synchronize()
    with s:
        g_step.reset_after_warmup()
    s.synchronize()
    with s:
        s.begin_capture()
        g_step.run(static)
        graph = s.end_capture()
    s.synchronize()
    assert g_step.untouched(), "an op ran outside the graph during capture"
    e_step.poison()
    for _ in range(4):
        data = fresh_data(rng)
        for k, v in data.items():
            static[k].set(v, stream=s)
        graph.launch(stream=s)
        s.synchronize()
        e_step.run({k: cp.asarray(v) for k, v in data.items()})
        cp.cuda.Device().synchronize()
        assert_same(g_step.state(), e_step.state())
    assert to_host(g_step.sampler.state).tolist() == [4, 0]
