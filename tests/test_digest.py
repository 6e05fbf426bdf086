"""Digest and RankCompare, the device ops of tensor-parallel agreement, against scalar
oracles written from their definitions (on NumPy, and on CuPy through ``xp``).

Digest: the wrapping sum over rows of ``mix3(salt, -1, count)`` and, per counted
element, ``mix3(salt, index, value)``. RankCompare: the majority digest (the lowest
rank's on a tie) and a RANK_DIVERGENCE row for every rank that differs, on every
rank; the group's tally without the divergence rows every rank repeats.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from kvcanary_cupy import format as fmt
from tests.workloads import MASK64, host, mix, s64


def oracle(rows) -> int:
    """rows: (values list, count or None, gate or None, salt)."""
    total = 0
    for values, count, gate, salt in rows:
        n = len(values) if count is None else max(0, min(count, len(values)))
        if gate is not None and gate != 1:
            n = 0
        total += mix(salt, -1, n) + sum(mix(salt, i, int(v)) for i, v in enumerate(values[:n]))
    return s64(total & MASK64)


def run_digest(xp, rows, carry=None):
    out = xp.zeros(1 + (0 if carry is None else len(carry)), dtype=np.int64)
    spec = [kc.DigestRow(xp.asarray(np.asarray(v, dtype=dt)),
                         count=None if c is None else xp.asarray([c], dtype=np.int64),
                         gate=None if g is None else xp.asarray([g], dtype=np.int64), salt=salt)
            for (v, c, g, salt), dt in rows]
    d = kc.Digest(spec, out=out, carry=None if carry is None else xp.asarray(carry, dtype=np.int64))
    d.run()
    return [int(x) for x in host(out)]


row_st = st.tuples(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=40),
                   st.one_of(st.none(), st.integers(-3, 50)), st.one_of(st.none(), st.integers(-1, 2)),
                   st.sampled_from([np.int32, np.int64]))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(row_st, max_size=5))
def test_digest_matches_its_definition(rows):
    spec = [((v, c, g, k + 1), dt) for k, (v, c, g, dt) in enumerate(rows)]
    assert run_digest(np, spec) == [oracle([r for r, _ in spec])]


def test_digest_definition_on_the_device(xp):
    rng = np.random.default_rng(3)
    spec = []
    for k in range(6):
        v = rng.integers(-(1 << 62), 1 << 62, size=int(rng.integers(0, 3000)))
        spec.append(((v, int(rng.integers(-5, 3200)) if k % 2 else None, 1 if k == 3 else None, 7 * k + 3), np.int64))
    got = run_digest(xp, spec, carry=[42, -7])
    assert got == [oracle([r for r, _ in spec]), 42, -7]


def test_every_change_changes_the_digest(xp):
    base = [(([5, 6, 7, 8], None, None, 1), np.int64), (([9, 10], None, None, 2), np.int32)]
    ref = run_digest(xp, base)[0]
    variants = [
        [(([5, 6, 7, 9], None, None, 1), np.int64), base[1]],  # one value
        [(([5, 7, 6, 8], None, None, 1), np.int64), base[1]],  # two swapped
        [(([5, 6, 7], None, None, 1), np.int64), base[1]],  # one missing
        [(([5, 6, 7, 8, 0], None, None, 1), np.int64), base[1]],  # one extra (a zero)
        [(([9, 10], None, None, 1), np.int64), (([5, 6, 7, 8], None, None, 2), np.int32)],  # rows traded
        [(([5, 6, 7, 8], 3, None, 1), np.int64), base[1]],  # a shorter count
    ]
    for v in variants:
        assert run_digest(xp, v)[0] != ref, v
    assert run_digest(xp, [(([5, 6, 7, 8], None, None, 1), np.int32), (([9, 10], None, None, 2), np.int64)])[0] == ref
    # A count clamps to the row; a gate other than 1 counts nothing.
    assert run_digest(xp, [(([5, 6, 7, 8], 99, None, 1), np.int64), base[1]])[0] == ref
    assert run_digest(xp, [(([5, 6, 7, 8], None, 0, 1), np.int64), base[1]])[0] == \
        run_digest(xp, [(([1, 2], 0, None, 1), np.int64), base[1]])[0]


def test_digest_misuse(xp, device):
    a = xp.arange(4, dtype=np.int64)
    out = xp.zeros(1, dtype=np.int64)
    cases = [
        (lambda: kc.Digest(a, out=out), TypeError, "kvcanary: rows: expected a list of DigestRow"),
        (lambda: kc.Digest([kc.DigestRow(a, salt=3), kc.DigestRow(a, salt=3)], out=out), ValueError,
         r"kvcanary: rows\[1\].salt: 3 is also rows\[0\]'s"),
        (lambda: kc.Digest([a], out=xp.zeros(2, dtype=np.int64)), ValueError, r"kvcanary: out: expected length 1 \+"),
        (lambda: kc.Digest([a], out=out, carry=xp.zeros(1, dtype=np.int64)), ValueError, "kvcanary: out: expected length"),
        (lambda: kc.Digest([a[:1]], out=a[:1]), ValueError, r"kvcanary: Digest: out and rows\[0\].array share memory"),
        (lambda: kc.Digest([kc.DigestRow(a, count=xp.zeros(2, dtype=np.int64))], out=out), ValueError,
         r"kvcanary: rows\[0\].count: expected a device scalar"),
        (lambda: kc.Digest([kc.DigestRow(a, gate=xp.zeros(1, dtype=np.int32))], out=out), TypeError,
         r"kvcanary: rows\[0\].gate: expected dtype int64"),
        (lambda: kc.Digest([xp.zeros(3, dtype=np.float32)], out=out), TypeError, r"kvcanary: rows\[0\].array: expected dtype"),
        (lambda: kc.Digest([a], out=out.astype(np.int32)), TypeError, "kvcanary: out: expected dtype int64"),
    ]
    if xp is not np:
        cases.append((lambda: kc.Digest([np.arange(3)], out=out), ValueError,
                      r"kvcanary: rows\[0\].array: expected an array on cuda"))
    for make, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            make()


def compare(xp, gathered, *, rank=0, state=None, log=None):
    log = log or kc.ViolationLog.allocate(capacity=16, device="cpu" if xp is np else "cuda")
    state = state if state is not None else kc.RankCompare.allocate_state(log.device)
    kc.RankCompare(xp.asarray(np.asarray(gathered, dtype=np.int64)), rank=rank, state=state, log=log).run()
    return log, state


def test_majority_and_ties(xp):
    # Three ranks, rank 0 alone: ranks 1 and 2 hold the majority, rank 0 is named against rank 1.
    log, state = compare(xp, [[7, 0], [9, 0], [9, 0]])
    (v,) = log.read()
    assert (v.rank, v.reference_rank, v.agreement_step, v.reasons, v.tag) == (0, 1, 1, F.RANK_DIVERGENCE,
                                                                           kc.LaunchTag.TP_AGREE)
    assert (v.slot, v.batch_row, v.expected_position) == (-1, -1, 2)
    assert (v.stored_link, v.expected_link) == (7, 9)
    assert "rank 0's plan differs from rank 1's" in str(v)
    # Two ranks that disagree: rank 0's digest is the reference.
    log, _ = compare(xp, [[7, 0], [9, 0]], rank=1)
    assert [(v.rank, v.reference_rank) for v in log.read()] == [(1, 0)]
    # Four ranks, 2 against 2: the lowest rank's pair wins.
    log, _ = compare(xp, [[5, 0], [8, 0], [8, 0], [5, 0]])
    assert sorted(v.rank for v in log.read()) == [1, 2]
    # All agree: nothing.
    log, state = compare(xp, [[5, 3], [5, 4]])
    assert log.count == 0
    assert dict(zip(fmt.AGREE_STATE_FIELDS, host(state).tolist())) == dict(
        group_rows=7, divergences=0, agreement_steps=1, agreed_head=0, own_rows=3)


def test_tally_leaves_out_the_divergence_rows_every_rank_repeats(xp):
    dev = "cpu" if xp is np else "cuda"
    log = kc.ViolationLog.allocate(capacity=16, device=dev)
    state = kc.RankCompare.allocate_state(dev)
    compare(xp, [[1, 0], [2, 0]], state=state, log=log)  # round 1: rank 1 diverges, one row on each rank
    assert host(state).tolist() == [0, 1, 1, 1, 0]
    # Round 2: both heads carry round 1's divergence row, rank 1's also 2 rows of its own checks.
    compare(xp, [[3, 1], [3, 3]], state=state, log=log)
    assert host(state).tolist() == [2, 1, 2, 1, 0]
    compare(xp, [[3, 1], [3, 3]], rank=1, state=state, log=log)
    assert dict(zip(fmt.AGREE_STATE_FIELDS, host(state).tolist()))["own_rows"] == 2


def test_rank_compare_misuse(xp, device):
    log = kc.ViolationLog.allocate(capacity=4, device=device)
    state = kc.RankCompare.allocate_state(device)
    g = xp.zeros((2, 2), dtype=np.int64)
    cases = [
        (dict(gathered=xp.zeros((2, 1), dtype=np.int64)), ValueError, r"kvcanary: gathered: expected shape"),
        (dict(gathered=xp.zeros((fmt.MAX_RANKS + 1, 2), dtype=np.int64)), ValueError, "kvcanary: gathered"),
        (dict(rank=2), ValueError, "kvcanary: rank: expected an integer >= 0 and <= 1"),
        (dict(rank=1.0), TypeError, "kvcanary: rank: expected an integer"),
        (dict(state=xp.zeros(4, dtype=np.int64)), ValueError, "kvcanary: state: expected length 5"),
        (dict(log="log"), TypeError, "kvcanary: log: expected a ViolationLog"),
        (dict(state=log.ring[0, :5]), ValueError, "kvcanary: RankCompare: state and log.ring share memory"),
        (dict(tag="x"), TypeError, "kvcanary: tag: expected an integer"),
    ]
    if xp is not np:
        cases.append((dict(log=kc.ViolationLog.allocate(capacity=4)), ValueError,
                      "kvcanary: log: expected it on cuda"))
    for kw, exc, pattern in cases:
        args = dict(gathered=g, rank=0, state=state, log=log) | kw
        gathered = args.pop("gathered")
        with pytest.raises(exc, match=pattern):
            kc.RankCompare(gathered, **args)


# --- a digest run in a write's launch ------------------------------------------------
def _write_twin(xp, device):
    """A canary, write plan and log after planning rows 1 (3 tokens) and 2 (150: a long row)."""
    width = 160
    canary = kc.CanaryBuffer.allocate(num_slots=3 * width, device=device)
    wp = kc.WritePlan.allocate(max_batch=2, device=device)
    log = kc.ViolationLog.allocate(capacity=8, device=device)
    table = xp.asarray(np.arange(3 * width, dtype=np.int32).reshape(3, width))
    kc.plan(None, wp, req_pool_indices=xp.asarray([1, 2]), prefix_lens=xp.asarray([0, 0]),
            extend_lens=xp.asarray([3, 150]), req_to_token=table)
    return canary, wp, log


def test_write_runs_a_digest_beside_it(xp, device):
    """write(digest=d) leaves what write() then d.run() leave: the same records, log and
    counters, and d's value (poisoned before) by its definition."""
    rng = np.random.default_rng(11)
    ids = xp.asarray(rng.integers(0, 1000, size=153))
    pos = xp.asarray(np.r_[0:3, 0:150])
    loc = xp.asarray(np.r_[160:163, 320:470])
    spec = [((rng.integers(-(1 << 40), 1 << 40, size=300), 120, None, 5), np.int64),
            ((rng.integers(0, 1 << 20, size=33), None, 1, 6), np.int32)]
    rows = [kc.DigestRow(xp.asarray(np.asarray(v, dtype=dt)), count=None if c is None else xp.asarray([c]),
                         gate=None if g is None else xp.asarray([g]), salt=salt) for (v, c, g, salt), dt in spec]
    out = xp.full(1, -12345, dtype=np.int64)
    fused, plain = _write_twin(xp, device), _write_twin(xp, device)
    canary, wp, log = fused
    kc.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc, log=log, tag=kc.LaunchTag.WRITE,
             digest=kc.Digest(rows, out=out))
    canary2, wp2, log2 = plain
    kc.write(canary2, wp2, input_ids=ids, positions=pos, out_cache_loc=loc, log=log2, tag=kc.LaunchTag.WRITE)
    assert int(host(out)[0]) == oracle([r for r, _ in spec])
    np.testing.assert_array_equal(host(canary.records), host(canary2.records))
    assert host(log.head).tolist() == host(log2.head).tolist() == [0]
    assert log.counters() == log2.counters() and log.counters()["slots_written"] == 153


def test_write_digest_misuse(xp, device):
    canary, wp, log = _write_twin(xp, device)
    io = dict(input_ids=xp.zeros(153, dtype=np.int64), positions=xp.zeros(153, dtype=np.int64),
              out_cache_loc=xp.zeros(153, dtype=np.int64), log=log, tag=1)
    out = xp.zeros(2, dtype=np.int64)
    with pytest.raises(TypeError, match="kvcanary: digest: expected a kvcanary_cupy.digest.Digest"):
        kc.write(canary, wp, digest=object(), **io)
    carrying = kc.Digest([xp.arange(4)], out=out, carry=xp.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="kvcanary: digest: a digest run inside a write carries nothing"):
        kc.write(canary, wp, digest=carrying, **io)
    for what, row in (("log.head", log.head), ("canary.records", canary.records.reshape(-1))):
        with pytest.raises(ValueError, match=f"kvcanary: write: .*{what}"):
            kc.write(canary, wp, digest=kc.Digest([row], out=out[:1]), **io)
    with pytest.raises(ValueError, match="kvcanary: write: .*log.counters"):
        kc.write(canary, wp, digest=kc.Digest([xp.arange(3)], out=log.counter_array[:1]), **io)
