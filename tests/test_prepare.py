"""kc.prepare: an op call validated once and launched again and again.

- A prepared plan, verify and write, refilled in place step after step, leave exactly
  what calling the ops each step leaves (records, violation rows, counters).
- Preparing validates at once and launches nothing; misuse is refused by name.
- A prepared op keeps what it was prepared with: temporaries passed to it stay valid.
- A ``Recording`` stream runs an op as usual and hands back its prepared launch.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import kvcanary_cupy as kc
from tests.workloads import Runner, arr, host, make_workload

MAX_TOKENS = 64


def rows_of(log):
    return sorted(map(tuple, log.rows().tolist()))


class Prepared:
    """A workload run through ops prepared once over fixed buffers, refilled every step:
    the step's rows first, then padding rows (request row 0), tokens past the step's unread."""

    def __init__(self, xp, device, wl):
        self.xp, self.wl = xp, wl
        self.canary = kc.CanaryBuffer.allocate(num_slots=wl.num_slots, device=device)
        self.log = kc.ViolationLog.allocate(capacity=4096, device=device)
        self.vp = kc.VerifyPlan.allocate(capacity=max(1, int(wl.lengths.sum())), max_batch=wl.max_batch,
                                         device=device)
        self.wp = kc.WritePlan.allocate(max_batch=wl.max_batch, device=device)
        b = wl.max_batch
        self.rows = {k: xp.zeros(b, np.int64) for k in ("rpi", "pre", "ext", "valid")}
        self.toks = {k: xp.zeros(MAX_TOKENS, np.int64) for k in ("ids", "pos", "loc")}
        table, tokens = arr(xp, wl.req_to_token), arr(xp, wl.tokens)
        self.launches = [
            kc.prepare(kc.plan, self.vp, self.wp, req_pool_indices=self.rows["rpi"], prefix_lens=self.rows["pre"],
                       extend_lens=self.rows["ext"], req_to_token=table,
                       expected=kc.ExpectedTokens(tokens, self.rows["valid"])),
            kc.prepare(kc.verify, self.canary, self.vp, log=self.log, tag=kc.LaunchTag.VERIFY, check_tokens=True),
            kc.prepare(kc.write, self.canary, self.wp, input_ids=self.toks["ids"], positions=self.toks["pos"],
                       out_cache_loc=self.toks["loc"], log=self.log, tag=kc.LaunchTag.WRITE),
        ]

    def step(self, step) -> None:
        xp = self.xp
        for k, v in zip(("rpi", "pre", "ext", "valid"),
                        (step.req_pool_indices, step.prefix_lens, step.extend_lens, step.valid_lens)):
            self.rows[k].fill(0)
            self.rows[k][:len(v)] = xp.asarray(v)
        for k, v in zip(("ids", "pos", "loc"), (step.input_ids, step.positions, step.out_cache_loc)):
            self.toks[k].fill(0)
            self.toks[k][:len(v)] = xp.asarray(v)
        for launch in self.launches:
            launch()


def test_prepared_ops_refilled_in_place_leave_what_the_ops_leave(xp, device):
    wl = make_workload(np.random.default_rng(11), num_requests=6, max_len=30)
    wl.max_batch = max(s.batch for s in wl.steps)
    assert max(len(s.input_ids) for s in wl.steps) <= MAX_TOKENS
    direct, prepared = Runner(xp, device, wl), Prepared(xp, device, wl)
    for k, step in enumerate(wl.steps):
        if k == len(wl.steps) // 2:  # the same stray write in both: later steps report it
            slot = int(wl.req_to_token[1, 0])
            for canary in (direct.canary, prepared.canary):
                canary.records[slot, 0] += 1
        direct.plan(step), direct.verify(), direct.write(step)
        prepared.step(step)
    np.testing.assert_array_equal(host(prepared.canary.records), host(direct.canary.records))
    assert direct.log.count > 0
    assert rows_of(prepared.log) == rows_of(direct.log)
    assert prepared.log.counters() == direct.log.counters()


def small(xp, device):
    canary = kc.CanaryBuffer.allocate(num_slots=32, device=device)
    wp = kc.WritePlan.allocate(max_batch=1, device=device)
    log = kc.ViolationLog.allocate(capacity=8, device=device)
    table = xp.asarray(np.arange(32, dtype=np.int32).reshape(2, 16))
    kc.plan(None, wp, req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([0]), extend_lens=xp.asarray([2]),
            req_to_token=table)
    return canary, wp, log


def test_preparing_validates_at_once_and_launches_nothing(xp, device):
    canary, wp, log = small(xp, device)
    tokens = dict(input_ids=xp.asarray([7, 8]), positions=xp.asarray([0, 1]), out_cache_loc=xp.asarray([16, 17]))
    with pytest.raises(TypeError, match="^kvcanary: input_ids"):
        kc.prepare(kc.write, canary, wp, **{**tokens, "input_ids": xp.asarray([7.0, 8.0])}, log=log,
                   tag=kc.LaunchTag.WRITE)
    with pytest.raises(TypeError, match="^kvcanary: write_plan"):
        kc.prepare(kc.write, canary, object(), **tokens, log=log, tag=kc.LaunchTag.WRITE)
    stamp = kc.prepare(kc.write, canary, wp, **tokens, log=log, tag=kc.LaunchTag.WRITE)
    assert not host(canary.records).any()  # prepared, not run
    stamp()
    assert host(canary.records)[16:18, :2].tolist() == [[7, 0], [8, 1]]
    assert log.counters()["kernel_runs"] == 1 and log.counters()["slots_written"] == 2


def test_prepare_refuses_what_is_not_an_op_or_a_stream():
    canary, wp, log = small(np, "cpu")
    with pytest.raises(TypeError, match="^kvcanary: op: expected one of plan, verify, write"):
        kc.prepare(print, canary)
    with pytest.raises(TypeError, match="^kvcanary: stream"):
        kc.prepare(kc.write, canary, wp, input_ids=np.array([7]), positions=np.array([0]),
                   out_cache_loc=np.array([16]), log=log, tag=kc.LaunchTag.WRITE, stream=kc.Recording())


def test_a_prepared_op_keeps_what_it_was_prepared_with(xp, device):
    canary, wp, log = small(xp, device)
    stamp = kc.prepare(kc.write, canary, wp, input_ids=xp.asarray([70, 80]), positions=xp.asarray([0, 1]),
                       out_cache_loc=xp.asarray([20, 21]), log=log, tag=kc.LaunchTag.WRITE)
    gc.collect()
    litter = [xp.full(2, -5, np.int64) for _ in range(64)]  # would take over freed memory
    stamp()
    del litter
    assert host(canary.records)[20:22, :2].tolist() == [[70, 0], [80, 1]]


def test_a_recording_stream_runs_the_op_and_hands_back_its_launch(xp, device):
    canary, wp, log = small(xp, device)
    loc = xp.asarray([16, 17])
    rec = kc.Recording()
    kc.write(canary, wp, input_ids=xp.asarray([7, 8]), positions=xp.asarray([0, 1]), out_cache_loc=loc, log=log,
             tag=kc.LaunchTag.WRITE, stream=rec)
    assert host(canary.records)[16:18, 0].tolist() == [7, 8] and len(rec.ops) == 1
    loc[:] = xp.asarray([18, 19])
    rec.ops[0]()
    assert host(canary.records)[18:20, 0].tolist() == [7, 8]
    assert log.counters()["kernel_runs"] == 2


def test_a_prepared_op_takes_torch_tensors_and_reads_them_in_place():
    torch = pytest.importorskip("torch")
    canary, wp, log = small(np, "cpu")
    loc = torch.tensor([16, 17])
    stamp = kc.prepare(kc.write, canary, wp, input_ids=torch.tensor([7, 8]), positions=torch.tensor([0, 1]),
                       out_cache_loc=loc, log=log, tag=kc.LaunchTag.WRITE)
    gc.collect()  # the imported views are the prepared op's to keep
    stamp()
    loc.copy_(torch.tensor([18, 19]))  # refilled in place
    stamp()
    assert canary.records[16:20, 0].tolist() == [7, 8, 7, 8]


@pytest.mark.gpu
def test_a_prepared_op_launched_on_a_capturing_stream_is_captured():
    import cupy as cp  # noqa: PLC0415

    canary, wp, log = small(cp, "cuda")
    loc = cp.asarray([16, 17])
    stamp = kc.prepare(kc.write, canary, wp, input_ids=cp.asarray([7, 8]), positions=cp.asarray([0, 1]),
                       out_cache_loc=loc, log=log, tag=kc.LaunchTag.WRITE)
    s = cp.cuda.Stream(non_blocking=True)
    # The plan and the inputs above were made on the current stream, which a non-blocking
    # stream does not wait for.
    cp.cuda.get_current_stream().synchronize()
    stamp(s)  # eager, on s
    s.synchronize()
    assert host(canary.records)[16:18, 0].tolist() == [7, 8]
    canary.records.fill(0)
    cp.cuda.Device().synchronize()
    s.begin_capture()
    stamp(s)
    graph = s.end_capture()
    assert not host(canary.records).any()  # captured, not run
    loc[:] = cp.asarray([20, 21])
    cp.cuda.Device().synchronize()
    graph.launch(s)
    s.synchronize()
    assert host(canary.records)[20:22, 0].tolist() == [7, 8]
