"""Scan-chain writes whose long rows the CUDA backend cuts into tiles spread over the grid.

A launch of more than 512 input tokens and at most 256 rows, its offsets in order,
cuts each row longer than 128 tokens into tiles of 256 tokens (one block step), and
tiles learn the chain's state from the tiles before them. Each case must leave exactly what the
NumPy reference leaves (records, violation rows, counters): rows of many tiles (more
than the 32 a look-back reads at once), a slot written twice in one tile, in two
tiles of one row and in two long rows (the later token wins), skipped tokens, slots
past the canary, seeds from records and from the anchor or out of range, short rows
beside long ones, the position and expected-token checks. The plan's tile state
lives across launches (its hash tables alternate, its flags carry a generation), so
launches of different sizes run one after another on the same plan, and a plan whose
offsets are out of order takes the block-per-row path.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import format as fmt
from tests.workloads import host

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


def _launch(rng, lengths, *, num_slots: int, dup_rows: bool = True) -> dict:
    """One write's inputs: rows of ``lengths`` tokens back to back, distinct slots but for
    the duplicates, skips and out-of-range slots mixed in."""
    total = int(sum(lengths))
    bs = len(lengths)
    perm = rng.permutation(np.arange(1, num_slots))
    loc = perm[:total].copy()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    seeds = np.where(rng.random(bs) < 0.6, perm[total:total + bs], -1)
    for r in range(bs):
        a, b = int(offsets[r]), int(offsets[r + 1])
        n = b - a
        if n < 2:
            continue
        k = rng.integers(0, n, size=6)
        loc[a + k[0]] = -1                            # skipped
        loc[a + k[1]] = loc[a + k[2]]                 # twice in the row, anywhere
        loc[a + min(n - 1, k[3] | 1)] = loc[a + (k[3] & ~1)]  # twice, side by side (one tile)
        if n > 600:
            loc[b - 1] = loc[a]                       # first and last token: first and last tile
        if rng.random() < 0.4:
            loc[a + k[4]] = num_slots + int(k[5])     # past the canary
    if dup_rows:
        long_rows = [r for r in range(bs) if offsets[r + 1] - offsets[r] > 600]
        for r0, r1 in zip(long_rows, long_rows[1:]):  # a slot of one long row written again by a later one
            loc[offsets[r1] + 7] = loc[offsets[r0] + 300]
    if bs > 2:
        seeds[1] = num_slots + 2                      # out of range: the row is reported, not written
    ids = rng.integers(0, 50000, size=total)
    pos = np.concatenate([np.arange(n) + int(rng.integers(0, 9000)) for n in lengths]).astype(np.int64)
    pos[rng.random(total) < 0.002] += 1               # position slips
    etok = np.where(rng.random(total) < 0.001, ids + 1, -1)
    return dict(offsets=offsets, seeds=seeds, ids=ids, pos=pos, loc=loc, etok=etok, bs=bs)


def _write(xp, device, recs, launches, *, max_batch: int, check_pos: bool = True):
    """Runs ``launches`` on one canary, plan and log; returns what each left."""
    canary = kc.CanaryBuffer(xp.array(recs, copy=True), "scan")  # NumPy's would write into recs
    wp = kc.WritePlan.allocate(max_batch=max_batch, device=device)
    out = []
    for i, w in enumerate(launches):
        log = kc.ViolationLog.allocate(capacity=4 * len(w["ids"]) + 64, device=device)
        wp.offsets[...] = xp.asarray(np.concatenate([w["offsets"], np.zeros(max_batch + 1 - len(w["offsets"]),
                                                                              np.int64)]))
        wp.seed_slots[...] = xp.asarray(np.concatenate([w["seeds"], np.full(max_batch - w["bs"], -1)]))
        wp.num_rows.fill(w["bs"])
        wp.position_check.fill(int(check_pos))
        kc.write(canary, wp, input_ids=xp.asarray(w["ids"]), positions=xp.asarray(w["pos"]),
                 out_cache_loc=xp.asarray(w["loc"]), log=log, tag=10 + i,
                 expected_inputs=(xp.asarray(w["etok"]), None))
        out.append((host(canary.records).copy(), sorted(tuple(int(x) for x in r) for r in log.rows()),
                    log.counters()))
    return out


def _compare(cp, recs, launches, *, max_batch: int) -> list:
    ref = _write(np, "cpu", recs, launches, max_batch=max_batch)
    dev = _write(cp, "cuda", recs, launches, max_batch=max_batch)
    for i, ((rr, rv, rc), (dr, dv, dc)) in enumerate(zip(ref, dev)):
        bad = np.nonzero((rr != dr).any(axis=1))[0]
        assert bad.size == 0, f"launch {i}: records differ at slots {bad[:8].tolist()}"
        assert dv == rv, f"launch {i}: violation rows"
        assert dc == rc, f"launch {i}: counters"
    return ref


CASES = {
    "one row of 79 tiles": [20000],
    "one row of 16K tokens": [16384],
    "long rows and short ones": [3000, 1, 129, 40, 700, 0, 5000, 128, 2, 1100],
    "rows of a tile or two": [200, 256, 257, 130, 300],
    "many rows, some long": [3] * 200 + [2048, 1500],
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(cp, case):
    rng = np.random.default_rng(list(CASES).index(case) + 100)
    lengths = CASES[case]
    num_slots = int(sum(lengths)) + len(lengths) + 64
    recs = rng.integers(-(2**62), 2**62, size=(num_slots, 4), dtype=np.int64)
    ref = _compare(cp, recs, [_launch(rng, lengths, num_slots=num_slots)], max_batch=len(lengths) + 3)
    assert ref[0][2]["slots_written"] > 0 and ref[0][1], "the case writes and reports"


def test_launches_one_after_another_leave_nothing_behind(cp):
    """Launches of growing, shrinking and repeated sizes on one plan: the tile state is
    reused, grown and its tables alternate; every launch matches the reference."""
    rng = np.random.default_rng(7)
    shapes = [[3000, 5], [3000, 5], [40000], [1200, 1200, 1200], [20, 2000], [40000], [2500]]
    num_slots = 40000 + 64
    recs = rng.integers(-(2**62), 2**62, size=(num_slots, 4), dtype=np.int64)
    launches = [_launch(rng, s, num_slots=num_slots) for s in shapes]
    _compare(cp, recs, launches, max_batch=8)


def test_offsets_out_of_order_take_the_block_path(cp):
    """A forged plan whose second row runs backwards: reported as out of range, while the
    long row before it is written as the reference writes it."""
    rng = np.random.default_rng(3)
    num_slots = 9000
    recs = rng.integers(-(2**62), 2**62, size=(num_slots, 4), dtype=np.int64)
    w = _launch(rng, [3000, 5000], num_slots=num_slots, dup_rows=False)
    w["offsets"] = np.array([0, 3000, 1000], np.int64)  # row 1 = [3000, 1000): reversed
    ref = _compare(cp, recs, [w], max_batch=4)
    assert any(r[fmt.COL_BATCH_ROW] == 1 for r in ref[0][1]), "the reversed row is reported"
