"""The scan chain (format v2) written by ``write`` against a scalar oracle.

Rows are built at random with hypothesis: rows of one token (decode), rows longer
than a warp's share and than a block's step (prefill), many rows, skipped tokens
(a negative slot), seeds from a record or the anchor, the chain-position check,
a slot written twice within a row (its last write wins) and slots past the canary.
The expected records come from ``tests.workloads.nxt``, scalar Python on ints
written from the record format alone. Runs on NumPy and, with a GPU, on CuPy.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from tests import workloads
from tests.workloads import arr, host, s64

LONG = 2600  # longer than a block's step (256 tokens) many times over, and than a warp's share (128)


def oracle(recs, rows, ids, pos, loc, check_pos):
    """(records after, {(slot, position, bits)} of violations) of one write, scalar."""
    out = recs.copy()
    bad = set()
    N = recs.shape[0]
    for o0, o1, seed in rows:
        if seed >= 0:
            t0, p0, l0 = (int(x) for x in recs[seed, :3])
            running, prev = workloads.nxt(l0, t0, p0), p0
        else:
            running, prev = workloads.first_link(), None
        for i in range(o0, o1):
            s, t, p = int(loc[i]), int(ids[i]), int(pos[i])
            if s < 0:
                continue
            bits = 0
            if check_pos and prev is not None and p != prev + 1:
                bits |= F.WRITE_POSITION
            if s >= N:
                bits |= F.SLOT_OUT_OF_RANGE
            else:
                out[s] = [t, p, s64(running), 0]
            if bits:
                bad.add((s, p, int(bits)))
            running, prev = workloads.nxt(running, t, p), p
    return out, bad


@st.composite
def batches(draw):
    lengths = draw(st.lists(st.one_of(st.just(1), st.integers(0, 40), st.integers(100, 300),
                                      st.integers(1000, LONG)), min_size=1, max_size=40))
    if sum(lengths) > 6000:  # keep the scalar oracle quick
        lengths = lengths[:1]
    return lengths, draw(st.integers(0, 2**32 - 1))


@pytest.fixture
def scan():
    saved, workloads.CHAIN = workloads.CHAIN, "scan"
    yield
    workloads.CHAIN = saved


# A caller's bound on the rows' tokens (max_row_tokens), right, too small or absent: the
# same records, only the route differs.
BOUNDS = st.one_of(st.none(), st.integers(0, 2), st.sampled_from([32, 127, 128, 129, 300]), st.integers(0, LONG))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches(), check_pos=st.booleans(), bound=BOUNDS)
def test_scan_write_matches_the_scalar_chain(xp, device, scan, batch, check_pos, bound):
    lengths, seed = batch
    rng = np.random.default_rng(seed)
    bs = len(lengths)
    total = int(sum(lengths))
    N = total + bs + 16
    recs = rng.integers(-(2**62), 2**62, size=(N, 4), dtype=np.int64)
    # Distinct slots for the rows' tokens and seeds (rows must not share slots: their
    # order would be a race), and within a row a few repeats and skips.
    perm = rng.permutation(np.arange(1, N))
    seeds = np.where(rng.random(bs) < 0.5, perm[total:total + bs], -1)
    loc = perm[:total].copy()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for r in range(bs):
        a, b = int(offsets[r]), int(offsets[r + 1])
        if b - a > 1:
            k = rng.integers(0, b - a, size=3)
            loc[a + k[0]] = -1  # skipped: the chain does not advance
            loc[a + k[1]] = loc[a + k[2]]  # written twice within the row: the last write wins
            if rng.random() < 0.3:
                loc[a + int(rng.integers(0, b - a))] = N + 3  # past the canary
    ids = rng.integers(0, 50000, size=total)
    pos = np.concatenate([np.arange(n) + int(rng.integers(0, 9000)) for n in lengths]).astype(np.int64)
    pos[rng.random(total) < 0.01] += 1  # position slips for the check

    canary = kc.CanaryBuffer(arr(xp, recs), "scan")
    wp = kc.WritePlan.allocate(max_batch=bs, device=device)
    wp.offsets[...] = arr(xp, offsets)
    wp.seed_slots[...] = arr(xp, seeds)
    wp.num_rows.fill(bs)
    wp.position_check.fill(int(check_pos))
    log = kc.ViolationLog.allocate(capacity=4 * total + 8, device=device)
    kc.write(canary, wp, input_ids=arr(xp, ids), positions=arr(xp, pos), out_cache_loc=arr(xp, loc), log=log,
             tag=kc.LaunchTag.WRITE, max_row_tokens=bound)

    want, bad = oracle(recs, [(int(offsets[r]), int(offsets[r + 1]), int(seeds[r])) for r in range(bs)],
                       ids, pos, loc, check_pos)
    got = host(canary.records)
    assert np.array_equal(got, want), np.nonzero((got != want).any(axis=1))[0][:8]
    rows = log.read()
    assert {(v.slot, v.position, int(v.reasons)) for v in rows} == bad
    assert log.counters()["tokens_skipped"] == int((loc < 0).sum())
    assert log.counters()["slots_written"] == int(((loc >= 0) & (loc < N)).sum())


@pytest.mark.parametrize("bound", [None, 1])  # 1: a bound the row breaks, the short rows' route
def test_a_long_row_links_like_its_closed_form(xp, device, scan, bound):
    # One 5000-token row: link k = SCAN_MUL^k SCAN_ANCHOR + sum_{i<k} term_i SCAN_MUL^(k-1-i) mod P61.
    n, P61 = 5000, (1 << 61) - 1
    rng = np.random.default_rng(7)
    ids, pos = rng.integers(0, 1000, size=n), np.arange(n)
    canary = kc.CanaryBuffer.allocate(num_slots=n + 1, device=device)
    wp = kc.WritePlan.allocate(max_batch=1, device=device)
    kc.plan(None, wp, req_pool_indices=arr(xp, [1]), prefix_lens=arr(xp, [0]), extend_lens=arr(xp, [n]),
            req_to_token=arr(xp, np.vstack([np.zeros(n), np.arange(1, n + 1)])))
    log = kc.ViolationLog.allocate(capacity=8, device=device)
    kc.write(canary, wp, input_ids=arr(xp, ids), positions=arr(xp, pos), out_cache_loc=arr(xp, np.arange(1, n + 1)),
             log=log, tag=kc.LaunchTag.WRITE, max_row_tokens=bound)
    links = host(canary.records)[1:, 2]
    terms = kc.scan_term(ids, pos)
    x = kc.SCAN_ANCHOR
    for k in (0, 1, 127, 128, 1023, 1024, 1025, 4999):
        x = kc.SCAN_ANCHOR * pow(kc.SCAN_MUL, k, P61)
        x += sum(int(terms[i]) * pow(kc.SCAN_MUL, k - 1 - i, P61) for i in range(k))
        assert int(links[k]) == x % P61, k
    assert log.count == 0
