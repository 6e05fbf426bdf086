"""plan_verify_write: a step's plan, verify and write in one launch, against the reference.

Each case runs the same steps through the CUDA op and through the NumPy reference's
plan, verify and write, one after another, and compares what they leave: records,
plans, counters and violation rows (as multisets: a GPU appends in no fixed order).
Hand-made cases with known answers sit beside random ones: a slot the step reads and
writes in the same step (the check sees the record as it was; the next step flags it),
two rows writing one slot (the later row wins), a step whose plan leaves the small
route (a row longer than 8192 positions) or overflows its verify plan (nothing is
verified, the write still stamps), inputs shorter than the plan's tokens, both chain
kinds, a seed the check could not read (past the pool, the reserved slot), and a capture
in a CUDA graph replayed with refilled inputs.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import format as fmt
from kvcanary_cupy.runtime import to_host

pytestmark = pytest.mark.gpu

POISON = -4242


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


class Side:
    """A canary, plans and a log on one device."""

    def __init__(self, xp, device, num_slots, chain, capacity, max_batch):
        self.xp, self.device = xp, device
        self.canary = kc.CanaryBuffer.allocate(num_slots=num_slots, device=device, chain=chain)
        self.vp = kc.VerifyPlan.allocate(capacity=capacity, max_batch=max_batch, device=device)
        self.wp = kc.WritePlan.allocate(max_batch=max_batch, device=device)
        self.log = kc.ViolationLog.allocate(capacity=4096, device=device)
        self.wp.seed_slots.fill(POISON)
        self.wp.offsets.fill(POISON)
        self.vp.offsets.fill(POISON)
        self.log.ring.fill(POISON)

    def step(self, table, rpi, pre, ext, ids, pos, loc, *, fused: bool, check_tokens=False, expected=None):
        a = self.xp.asarray
        plan_in = dict(req_pool_indices=a(rpi), prefix_lens=a(pre), extend_lens=a(ext), req_to_token=a(table))
        tokens = dict(input_ids=a(ids), positions=a(pos), out_cache_loc=a(loc))
        if expected is not None:
            plan_in["expected"] = kc.ExpectedTokens(a(expected[0]), a(expected[1]))
        if fused:
            kc.plan_verify_write(self.vp, self.wp, self.canary, **plan_in, **tokens, log=self.log,
                                 tag=kc.LaunchTag.VERIFY, write_tag=kc.LaunchTag.WRITE, check_tokens=check_tokens)
        else:
            kc.plan(self.vp, self.wp, **plan_in)
            kc.verify(self.canary, self.vp, log=self.log, tag=kc.LaunchTag.VERIFY, check_tokens=check_tokens)
            kc.write(self.canary, self.wp, **tokens, log=self.log, tag=kc.LaunchTag.WRITE)

    def state(self) -> dict:
        return dict(records=to_host(self.canary.records), wo=to_host(self.wp.offsets), ws=to_host(self.wp.seed_slots),
                    rows=collections.Counter(tuple(int(x) for x in r) for r in self.log.rows()),
                    counters=self.log.counters(), scalars=self.vp.host_scalars(), vo=to_host(self.vp.offsets),
                    wrows=int(to_host(self.wp.num_rows)[0]), errors=int(to_host(self.wp.input_errors)[0]))


def pair(cp, *, num_slots=4096, chain="scan", capacity=4096, max_batch=8):
    return (Side(np, "cpu", num_slots, chain, capacity, max_batch),
            Side(cp, "cuda", num_slots, chain, capacity, max_batch))


def same(ref: Side, dev: Side):
    r, d = ref.state(), dev.state()
    assert d["counters"] == r["counters"]
    assert d["rows"] == r["rows"], f"only device {d['rows'] - r['rows']}, only reference {r['rows'] - d['rows']}"
    for k in ("records", "wo", "ws", "vo"):
        assert np.array_equal(d[k], r[k]), k
    assert d["scalars"] == r["scalars"] and d["wrows"] == r["wrows"] and d["errors"] == r["errors"]
    return r


def decode_inputs(table, rows, prefix, *, token0=100):
    """A decode step: one token per active row at position ``prefix[r]``, written to its table
    slot (a padding row, request row 0, extends by nothing)."""
    rows, prefix = np.asarray(rows), np.asarray(prefix)
    live = rows != 0
    loc = table[rows[live], prefix[live]].astype(np.int64)
    return dict(rpi=rows, pre=prefix, ext=live.astype(np.int64), ids=token0 + np.arange(loc.size),
                pos=prefix[live].copy(), loc=loc)


def prefill(sides, table, rows, lengths):
    """Stamp each row's first ``lengths[r]`` positions through the unfused ops."""
    rows, lengths = np.asarray(rows), np.asarray(lengths)
    if rows.size == 0:
        return
    ids = np.concatenate([np.arange(n) * 7 + r for r, n in zip(rows, lengths)])
    pos = np.concatenate([np.arange(n) for n in lengths])
    loc = np.concatenate([table[r, :n] for r, n in zip(rows, lengths)]).astype(np.int64)
    for s in sides:
        s.step(table, rows, np.zeros_like(rows), lengths, ids, pos, loc, fused=False)


@pytest.mark.parametrize("chain", ["scan", "sglang"])
def test_decode_steps_match_the_three_ops(cp, chain):
    rng = np.random.default_rng(3)
    ref, dev = pair(cp, chain=chain)
    table = rng.permutation(np.arange(1, 4096))[: 8 * 300].reshape(8, 300).astype(np.int32)
    table[0] = 0
    rows = np.array([1, 2, 3, 5, 0, 7])  # a padding row among them
    prefill((ref, dev), table, rows, [40, 1, 0, 17, 0, 250])
    prefix = np.array([40, 1, 0, 17, 0, 250])
    for k in range(3):  # three decode steps, each through the fused op on both sides
        d = decode_inputs(table, rows, prefix + k)
        for s in (ref, dev):
            s.step(table, d["rpi"], d["pre"], d["ext"], d["ids"], d["pos"], d["loc"], fused=True)
        r = same(ref, dev)
    assert r["rows"] == collections.Counter()
    assert r["counters"]["kernel_runs"] == 2 + 3 * 2  # the prefill's three ops' two, then two per fused step
    assert r["records"][table[1, 42], 1] == 42 and r["records"][table[7, 252], 1] == 252


def test_a_slot_read_and_written_in_one_step(cp):
    """The check reads the record as it stood: nothing this step; the next step's check flags it."""
    ref, dev = pair(cp)
    table = np.zeros((3, 64), np.int32)
    table[1] = np.arange(100, 164)
    table[2] = np.arange(200, 264)
    prefill((ref, dev), table, [1, 2], [10, 5])
    # Row 2 writes its position 5 into slot 103, which row 1 reads at position 3 in the same step.
    d = dict(rpi=np.array([1, 2]), pre=np.array([10, 5]), ext=np.array([1, 1]), ids=np.array([9, 8]),
             pos=np.array([10, 5]), loc=np.array([110, 103]))
    for s in (ref, dev):
        s.step(table, **d, fused=True)
    r = same(ref, dev)
    assert r["rows"] == collections.Counter()
    assert tuple(r["records"][103, :2]) == (8, 5)
    d = decode_inputs(table, [1], [11])
    for s in (ref, dev):
        s.step(table, d["rpi"], d["pre"], d["ext"], d["ids"], d["pos"], d["loc"], fused=True)
    r = same(ref, dev)
    flagged = {row[1] for row in r["rows"]}
    assert 103 in flagged  # its position (5) is not 3


def test_two_rows_write_one_slot_the_later_wins(cp):
    ref, dev = pair(cp)
    table = np.zeros((3, 16), np.int32)
    table[1] = np.arange(16, 32)
    table[2] = np.arange(32, 48)
    d = dict(rpi=np.array([1, 2]), pre=np.array([0, 0]), ext=np.array([3, 2]), ids=np.array([1, 2, 3, 4, 5]),
             pos=np.array([0, 1, 2, 0, 1]), loc=np.array([16, 17, 40, 40, 33]))
    for s in (ref, dev):
        s.step(table, **d, fused=True)
    r = same(ref, dev)
    assert tuple(r["records"][40, :2]) == (4, 0)


def test_a_long_row_and_an_overflowing_plan_still_stamp(cp):
    """A row of more than 8192 positions leaves the small route; a verify plan too small for
    the step verifies nothing and counts it. Either way the write stamps the step."""
    for capacity in (20000, 100):
        ref, dev = pair(cp, num_slots=20000, capacity=capacity)
        table = np.zeros((3, 9100), np.int32)
        table[1] = np.arange(1, 9101)
        table[2, :20] = np.arange(9500, 9520)
        prefill((ref, dev), table, [1, 2], [9000, 12])
        d = decode_inputs(table, [1, 2], [9000, 12])
        for s in (ref, dev):
            s.step(table, d["rpi"], d["pre"], d["ext"], d["ids"], d["pos"], d["loc"], fused=True)
        r = same(ref, dev)
        assert r["counters"]["verifies_skipped"] == (capacity < 9012)
        assert tuple(r["records"][9001, :2]) == (100, 9000)


def test_a_seed_its_check_could_not_read(cp):
    """A row whose seed (the slot of its last read position) is past the pool or is the
    reserved slot: the check reports it and publishes no seed state, so the write takes the
    seed the plan stored, as plan, verify and write do. Past the pool, the write reports the
    seed and stamps nothing of that row; the reserved slot's record seeds the chain."""
    N = 4096
    ref, dev = pair(cp, num_slots=N)
    table = np.zeros((4, 64), np.int32)
    for r in (1, 2, 3):
        table[r] = np.arange(100 * r, 100 * r + 64)
    prefill((ref, dev), table, [1, 2, 3], [8, 8, 8])
    table[1, 7] = N + 5  # row 1's seed: past the pool
    table[2, 7] = 0  # row 2's seed: the reserved slot
    d = decode_inputs(table, [1, 2, 3], [8, 8, 8])
    for s in (ref, dev):
        s.step(table, d["rpi"], d["pre"], d["ext"], d["ids"], d["pos"], d["loc"], fused=True)
    r = same(ref, dev)
    col = fmt.VIOLATION_COLUMNS.index
    write_rows = {(row[col("slot")], row[col("fail_bits")]) for row in r["rows"] if row[0] == int(kc.LaunchTag.WRITE)}
    assert (N + 5, int(kc.FailReason.SLOT_OUT_OF_RANGE)) in write_rows
    check_rows = {(row[col("slot")], row[col("fail_bits")]) for row in r["rows"] if row[0] == int(kc.LaunchTag.VERIFY)}
    assert {(N + 5, int(kc.FailReason.SLOT_OUT_OF_RANGE)), (0, int(kc.FailReason.RESERVED_SLOT))} <= check_rows
    assert not r["records"][108].any()  # row 1 stamped nothing
    assert r["records"][208, 1] == 8 and r["records"][308, 1] == 8


def test_random_steps_with_faults_and_checks(cp):
    """Random decode and speculative steps with skipped, out-of-range and doubled slots,
    position slips, inputs shorter than the plan, expected tokens and inputs, int32 and int64."""
    rng = np.random.default_rng(11)
    for case in range(12):
        chain = ("scan", "sglang")[case % 2]
        nreq, width, N = 12, 96, 3000
        ref, dev = pair(cp, num_slots=N, chain=chain, capacity=int(rng.choice([64, 2000])), max_batch=10)
        table = rng.permutation(np.arange(1, N))[: nreq * width].reshape(nreq, width).astype(np.int32)
        table[0] = 0
        bs = int(rng.integers(1, 11))
        rows = rng.permutation(np.arange(1, nreq))[:bs]
        rows[rng.random(bs) < 0.15] = 0
        pre = rng.integers(0, 60, size=bs)
        prefill((ref, dev), table, rows[rows > 0], pre[rows > 0])
        ext = rng.integers(0, 5, size=bs)
        ids, pos, loc = [], [], []
        for r in range(bs):
            for j in range(int(ext[r])):
                ids.append(int(rng.integers(0, 500)))
                pos.append(int(pre[r]) + j + int(rng.random() < 0.05))
                loc.append(int(table[rows[r], pre[r] + j]))
        ids, pos, loc = np.array(ids + [0], np.int64)[:-1], np.array(pos + [0], np.int64)[:-1], np.array(loc + [0])[:-1]
        if loc.size:
            k = rng.integers(0, loc.size, size=3)
            loc[k[0]] = -1 if rng.random() < 0.5 else loc[k[0]]
            loc[k[1]] = N + 3 if rng.random() < 0.3 else loc[k[1]]
            loc[k[2]] = loc[k[0]] if rng.random() < 0.3 else loc[k[2]]
        if rng.random() < 0.2 and loc.size:
            ids, pos, loc = ids[:-1], pos[:-1], loc[:-1]  # fewer inputs than the plan's tokens
        cast = (lambda a: a.astype(np.int32)) if rng.random() < 0.5 else (lambda a: a)
        expected = None
        if rng.random() < 0.5:
            etab = np.full((nreq, width), -1, np.int64)
            etab[rows, 0] = rows  # the prefill's token of position 0 is the row index
            expected = (etab, (pre + ext).astype(np.int64))
        for s in (ref, dev):
            s.step(table, cast(rows), pre, cast(ext), cast(ids), pos, loc, fused=True,
                   check_tokens=expected is not None, expected=expected)
        same(ref, dev)


def test_more_tokens_than_a_launch_stamps_is_refused(cp):
    _, dev = pair(cp)
    table = cp.zeros((2, 600), dtype=cp.int32)
    n = kc.ops.STEP_WRITE_TOKENS + 1
    with pytest.raises(ValueError, match="kvcanary: input_ids: plan_verify_write stamps at most 256"):
        kc.plan_verify_write(dev.vp, dev.wp, dev.canary, req_pool_indices=cp.array([1]), prefix_lens=cp.array([0]),
                             extend_lens=cp.array([n]), req_to_token=table, input_ids=cp.zeros(n, cp.int64),
                             positions=cp.arange(n), out_cache_loc=cp.arange(n), log=dev.log,
                             tag=kc.LaunchTag.VERIFY, write_tag=kc.LaunchTag.WRITE)
    assert dev.log.counters()["kernel_runs"] == 0


def test_graph_capture_and_replay(cp):
    """Captured once, replayed with refilled inputs: the same as eager launches on fresh buffers."""
    rng = np.random.default_rng(5)
    table = rng.permutation(np.arange(1, 4096))[: 8 * 200].reshape(8, 200).astype(np.int32)
    table[0] = 0
    rows = np.array([1, 4, 6])

    def data(k):
        return decode_inputs(table, rows, np.array([20, 50, 90]) + k, token0=10 * k)

    g, e = Side(cp, "cuda", 4096, "scan", 2048, 4), Side(cp, "cuda", 4096, "scan", 2048, 4)
    prefill((g, e), table, rows, [20, 50, 90])
    s = cp.cuda.Stream(non_blocking=True)
    static = {k: cp.asarray(v) for k, v in data(0).items()}
    dtable = cp.asarray(table)
    # The prefill and the copies above ran on the current stream, which a non-blocking stream
    # does not wait for.
    cp.cuda.get_current_stream().synchronize()
    with s:
        g.step(dtable, static["rpi"], static["pre"], static["ext"], static["ids"], static["pos"], static["loc"],
               fused=True)  # warm-up: compiles and prepares outside the capture
        s.synchronize()
        e.step(table, **{k: v for k, v in data(0).items()}, fused=True)
        runs = g.log.counters()["kernel_runs"]
        s.begin_capture()
        g.step(dtable, static["rpi"], static["pre"], static["ext"], static["ids"], static["pos"], static["loc"],
               fused=True)
        graph = s.end_capture()
    s.synchronize()
    assert g.log.counters()["kernel_runs"] == runs, "a launch ran outside the graph during capture"
    for k in range(1, 4):
        for name, v in data(k).items():
            static[name].set(v, stream=s)
        graph.launch(stream=s)
        s.synchronize()
        e.step(table, **data(k), fused=True)
        cp.cuda.Device().synchronize()
        gs, es = g.state(), e.state()
        assert np.array_equal(gs["records"], es["records"]) and gs["counters"] == es["counters"]
        assert gs["rows"] == es["rows"] == collections.Counter()
