"""Out-of-range data never raises and never reads out of bounds.

A bad row of a plan is dropped and counted in ``input_errors`` (cumulative, in each
plan passed); a slot outside the canary becomes a SLOT_OUT_OF_RANGE violation; a
forged plan is reported, not crashed on. Good rows in the same batch are untouched.
"""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from tests.workloads import Env, arr, chain_of, host, s64, vrow

N = 64
ROW1 = [5, 9, 2, 30, 17, 8, 40, 41, 3, 22, 60, 33, 12, 13, 14, 15]
ROW2 = [50, 51, 52, 7, 6, 4, 19, 20, 21, 23, 24, 25, 26, 27, 28, 29]
TABLE = np.array([[0] * 16, ROW1, ROW2], dtype=np.int64)
V = kc.LaunchTag.VERIFY

pytestmark = pytest.mark.usefixtures("chain_kind")


def env(xp, device, **kw):
    return Env(xp, device, table=kw.pop("table", TABLE), **kw)


def check_plan(e, rp, P, E, *, good, errors, prior=0, prior_unstamped=None, **kw):
    """Plan, then: rows in ``good`` (index -> (slots, seed)) planned as given, every other
    active row dropped (no entries, seed SEED_SKIP), ``errors`` more input errors. Every row
    keeps its span of ``E`` tokens in the write plan while its length can be a span; after
    one that cannot, no row stamps, and the write plan counts each live one it skips."""
    e.plan(rp, P, E, **kw)
    offs, woffs, seeds = host(e.vp.offsets), host(e.wp.offsets), host(e.wp.seed_slots)
    slots = e.entries()["slot_indices"]
    width = (host(kw["block_table"]).shape[1] * kw["page_size"] if "block_table" in kw else e.table.shape[1])
    known = [0 <= x <= width for x in E]
    after = [not all(known[:r]) for r in range(len(rp))]
    for r in range(len(rp)):
        n, w = offs[r + 1] - offs[r], woffs[r + 1] - woffs[r]
        assert w == (E[r] if known[r] else 0), r
        if r in good:
            want_slots, want_seed = good[r]
            assert slots[offs[r]:offs[r + 1]].tolist() == want_slots, r
            assert seeds[r] == (kc.SEED_SKIP if after[r] else want_seed), r
        else:
            assert n == 0 and seeds[r] == kc.SEED_SKIP, r
    assert e.scalars()["input_errors"] == prior + errors
    unstamped = errors + sum(1 for r in good if after[r])
    assert int(host(e.wp.input_errors)[0]) == (prior if prior_unstamped is None else prior_unstamped) + unstamped


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_table_rows_out_of_range(xp, device, dtype):
    e = env(xp, device, dtype=dtype)
    big = int(np.iinfo(dtype).max)
    rp, P, E = [1, 3, -1, 2, big, -big], [2, 2, 2, 1, 1, 1], [1, 1, 1, 1, 1, 1]
    good = {0: (ROW1[:2], ROW1[1]), 3: (ROW2[:1], ROW2[0])}
    check_plan(e, rp, P, E, good=good, errors=4)
    check_plan(e, rp, P, E, good=good, errors=4, prior=4)  # cumulative


def test_lengths_against_the_table_width(xp, device):
    e = env(xp, device)
    rp = [1, 2, 1, 2, 1, 2, 1]
    P = [17, 16, 10, 10, -1, 3, 1 << 40]
    E = [0, 0, 7, 6, 1, -1, 0]
    good = {1: (ROW2, -1), 3: (ROW2[:10], ROW2[9])}
    check_plan(e, rp, P, E, good=good, errors=5)


def test_huge_lengths_do_not_wrap(xp, device):
    e = env(xp, device)
    i64 = np.iinfo(np.int64)
    check_plan(e, [1, 1, 1, 2], [i64.max, 3, i64.min, 2], [1, i64.max, 1, i64.min], good={}, errors=4)


def test_negative_table_entries(xp, device):
    t = TABLE.copy()
    t[1, 3] = -1
    e = env(xp, device, table=t)
    # P=3 reads 0..2 and its seed at 2; P=4 and P=5 read position 3
    check_plan(e, [1, 1, 1], [3, 4, 5], [1, 0, 2], good={0: (ROW1[:3], ROW1[2])}, errors=2)
    # with a window of 1: P=5 reads 4 and its predecessor 3; P=6 reads 5 and 4
    sw = kc.SwaWindow(1, arr(xp, np.arange(N)))
    check_plan(e, [1, 1], [5, 6], [0, 1], good={1: ([ROW1[5]], ROW1[5])}, errors=1, prior=2, swa=sw)


def test_negative_page_in_a_block_table(xp, device):
    bt = np.array([[0, 0], [1, -3], [2, 3]], dtype=np.int32)
    e = env(xp, device)
    kw = dict(block_table=arr(xp, bt, np.int32), page_size=16)
    good = {0: (list(range(16, 32)), 31), 2: (list(range(32, 49)), -1)}
    check_plan(e, [1, 1, 2], [16, 17, 17], [1, 0, 0], good=good, errors=1, **kw)


def test_page_arithmetic_that_wraps_negative_is_unreadable(xp, device):
    bt = np.array([[0], [1 << 62], [3]], dtype=np.int64)  # page 2**62 * 2 wraps to -2**63
    e = env(xp, device)
    check_plan(e, [1, 2], [1, 1], [1, 1], good={1: ([6], 6)}, errors=1, block_table=arr(xp, bt), page_size=2)


I64_MAX = (1 << 63) - 1


def test_page_arithmetic_that_wraps_onto_a_valid_slot_is_unreadable(xp, device):
    # 2**61 * 8 and (2**62 + 1) * 4 wrap, mod 2**64, to the small slots 0.. and 4..: a
    # wrapped slot must be unreadable like a negative one, not an alias of a valid one.
    bt = np.array([[0], [1 << 61], [(1 << 62) + 1], [3]], dtype=np.int64)
    for page in (8, 4):
        e = env(xp, device)
        rp = [1, 3] if page == 8 else [2, 3]
        check_plan(e, rp, [2, 2], [1, 1], good={1: ([3 * page, 3 * page + 1], 3 * page + 1)}, errors=1,
                   block_table=arr(xp, bt), page_size=page)


def test_page_slot_at_the_int64_limit(xp, device):
    # page 3: v * 3 = 2**63 - 2, so offsets 0 and 1 fit (the last is 2**63 - 1) and 2 is one past.
    v = (I64_MAX - 1) // 3
    bt = np.array([[0], [v], [v + 1]], dtype=np.int64)
    e = env(xp, device)
    kw = dict(block_table=arr(xp, bt), page_size=3)
    check_plan(e, [1, 1, 2], [2, 3, 1], [1, 0, 0], good={0: ([I64_MAX - 1, I64_MAX], I64_MAX)}, errors=2, **kw)
    # with a window of 1 the row reads positions 1 and 2: position 2 is one past the limit
    check_plan(e, [1], [3], [0], good={}, errors=1, prior=2, swa=kc.SwaWindow(1, arr(xp, np.arange(N))), **kw)


def test_the_widest_table_row_keeps_its_spans(xp, device):
    # 2 pages of 2**30 slots: the widest row a table may have (2**31 positions). A span of the
    # whole width is a span; one past it is not, and the rows after it stamp nothing.
    page = 1 << 30
    bt = np.array([[0, 0], [1, 0], [2, 0]], dtype=np.int64)
    e = env(xp, device)
    good = {0: ([page, page + 1], page + 1), 1: ([2 * page], -1), 2: ([page], page)}
    check_plan(e, [1, 2, 1, 1], [2, 1, 1, 1], [1, 0, 2 * page - 1, 2 * page + 1], good=good, errors=1,
               block_table=arr(xp, bt), page_size=page)
    assert int(host(e.wp.offsets)[4]) == 1 + 2 * page - 1
    with pytest.raises(ValueError, match="kvcanary: page_size"):
        e.plan([1], [0], [1], block_table=arr(xp, bt), page_size=1 << 31)


def test_lut_out_of_range(xp, device):
    short = arr(xp, np.arange(31))  # ROW1[3] = 30 fits, ROW1[6] = 40 does not
    e = env(xp, device)
    check_plan(e, [1, 1], [7, 4], [0, 1], good={1: (ROW1[:4], ROW1[3])}, errors=1, swa=kc.SwaWindow(8, short))
    lut = np.arange(N)
    lut[ROW1[4]] = -1
    e = env(xp, device)
    good = {0: (ROW1[:4], ROW1[3]), 2: (ROW1[:3], ROW1[2])}
    check_plan(e, [1, 1, 1], [4, 5, 3], [1, 0, 1], good=good, errors=1, swa=kc.SwaWindow(8, arr(xp, lut)))
    # a window head whose predecessor is unreadable drops the row too
    check_plan(e, [1, 1], [6, 7], [0, 1], good={1: ([ROW1[6]], ROW1[6])}, errors=1, prior=1,
               swa=kc.SwaWindow(1, arr(xp, lut)))


def test_expected_table_too_small(xp, device):
    e = env(xp, device)
    exp = kc.ExpectedTokens(arr(xp, np.arange(32).reshape(2, 16)), arr(xp, [16, 16, 16]))
    check_plan(e, [1, 2, 0], [3, 3, 3], [0, 0, 0], good={0: (ROW1[:3], -1)}, errors=1, expected=exp)
    assert e.entries()["expected_tokens"][:3].tolist() == [16, 17, 18]


def test_table_slots_past_the_canary_are_reported_by_verify(xp, device):
    t = TABLE.copy()
    t[1, 1] = N + 36
    e = env(xp, device, table=t)
    e.plan([1, 2], [0, 0], [3, 1])
    e.write([7, 8, 9, 4], [0, 1, 2, 0], list(t[1, :3]) + [ROW2[0]])  # the write reports the slot past the buffer
    assert e.rows() == [vrow(tag=kc.LaunchTag.WRITE, slot=N + 36, position=1, stored_token=8,
                             stored_link=chain_of([7, 8], [0, 1])[1], expected_link=chain_of([7, 8], [0, 1])[1],
                             bits=F.SLOT_OUT_OF_RANGE, batch_row=0, expected_position=1)]
    e.log.clear()
    exp = kc.ExpectedTokens(arr(xp, [[0] * 3, [7, 8, 9], [4, 4, 4]]), arr(xp, [1, 3]))
    e.plan([2, 1], [1, 3], [0, 1], expected=exp)
    assert host(e.wp.seed_slots)[1] == ROW1[2] and e.scalars()["input_errors"] == 0
    e.verify(check_tokens=True)
    assert e.rows() == sorted([
        vrow(tag=V, slot=N + 36, expected_token=8, bits=F.SLOT_OUT_OF_RANGE, batch_row=1, expected_position=1),
        vrow(tag=V, slot=ROW1[2], expected_token=9, bits=F.SLOT_OUT_OF_RANGE, batch_row=1, expected_position=2),
    ])  # slot and predecessor both checked; the first entry and the other row verify clean


def test_seed_past_the_canary_from_the_table(xp, device):
    t = TABLE.copy()
    t[2, 4] = N
    e = env(xp, device, table=t)
    e.plan([2], [5], [1])
    assert host(e.wp.seed_slots)[0] == N
    e.write([1], [5], [ROW2[5]])
    assert e.rows() == [vrow(tag=kc.LaunchTag.WRITE, slot=N, bits=F.SLOT_OUT_OF_RANGE, batch_row=0)]
    assert (e.records() == 0).all()


@pytest.mark.parametrize("prev", [-2, N, 1 << 50, -(1 << 62)])
def test_forged_prev_slots(xp, device, prev):
    e = env(xp, device)
    e.plan([1], [0], [3])
    e.write([1, 2, 3], [0, 1, 2], ROW1[:3])
    e.plan([1], [3], [0])
    e.vp.prev_slot_indices[1] = prev
    e.verify()
    assert e.rows() == [vrow(tag=V, slot=ROW1[1], bits=F.SLOT_OUT_OF_RANGE, batch_row=0, expected_position=1)]


@pytest.mark.parametrize("slot", [N + 1 << 40, -(1 << 63) + 1])
def test_write_slot_far_past_the_buffer(xp, device, slot):
    e = env(xp, device)
    e.plan([1], [0], [2])
    e.write([1, 2], [0, 1], [slot, ROW1[1]])
    rows = e.rows()
    if slot < 0:  # a negative slot is a skip, not an error: the next token starts the chain
        assert rows == [] and e.records()[ROW1[1]].tolist() == [2, 1, s64(chain_of([2], [1])[0]), 0]
    else:
        assert [(r[1], r[7]) for r in rows] == [(slot, int(F.SLOT_OUT_OF_RANGE))]
        assert e.records()[ROW1[1]].tolist() == [2, 1, s64(chain_of([1, 2], [0, 1])[1]), 0]


def _garbage(rng, n):
    picks = np.array([0, -1, -2, N - 1, N, 1 << 40, -(1 << 63), (1 << 63) - 1, 1, 5], dtype=np.int64)
    out = rng.integers(-(1 << 63), (1 << 63) - 1, size=n, dtype=np.int64)
    m = rng.random(n) < 0.6
    out[m] = rng.choice(picks, size=int(m.sum()))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_forged_verify_plan_is_reported_not_crashed(xp, device, seed):
    rng = np.random.default_rng(seed)
    e = env(xp, device, capacity=40, max_batch=5)
    e.plan([1, 2], [0, 0], [10, 10])
    e.write(list(range(20)), list(range(10)) * 2, ROW1[:10] + ROW2[:10])
    for f in kc.VerifyPlan.ENTRY_FIELDS + ("offsets",):
        a = getattr(e.vp, f)
        a[...] = arr(xp, _garbage(rng, a.shape[0]))
    for nv in (40, 1 << 62, -5, 17):
        e.vp.num_valid.fill(nv)
        e.vp.enable.fill(1)
        e.log.clear()
        e.verify(check_tokens=True)
        slots = e.entries()["slot_indices"][:max(0, min(nv, 40))]
        prev = e.entries()["prev_slot_indices"][:max(0, min(nv, 40))]
        oor = ((slots != 0) & ((slots < 0) | (slots >= N) | (prev < -1) | (prev >= N))).sum()
        rows = e.log.read()
        assert sum(v.reasons == F.SLOT_OUT_OF_RANGE for v in rows) == oor
        assert sum(v.reasons == F.RESERVED_SLOT for v in rows) == (slots == 0).sum()  # read, never skipped
        assert all(0 < v.slot < N for v in rows if v.reasons not in (F.SLOT_OUT_OF_RANGE, F.RESERVED_SLOT))
    e.vp.enable.fill(7)  # anything but 1 disables
    e.log.clear()
    e.verify()
    assert e.log.count == 0


@pytest.mark.parametrize("seed", range(6))
def test_forged_write_plan_is_reported_not_crashed(xp, device, seed):
    rng = np.random.default_rng(seed)
    e = env(xp, device, max_batch=4)
    e.wp.offsets[...] = arr(xp, _garbage(rng, 5))
    e.wp.seed_slots[...] = arr(xp, _garbage(rng, 4))
    ids = rng.integers(0, 100, size=12)
    loc = _garbage(rng, 12)
    for nr in (4, 1 << 40, -1, -2, -3, 2):
        e.wp.num_rows.fill(nr)
        e.log.clear()
        e.write(ids, np.arange(12), loc)
        offs, seeds = host(e.wp.offsets), host(e.wp.seed_slots)
        n = max(0, min(nr, 4))
        skip = [seeds[r] == kc.SEED_SKIP for r in range(n)]  # stamps nothing, reports nothing
        bad_span = [not skip[r] and ((offs[r] < 0) | (offs[r + 1] > 12) | (offs[r + 1] < offs[r]))
                    for r in range(n)]
        rows = e.log.read()
        assert sorted(v.batch_row for v in rows if v.reasons == F.INPUT_OUT_OF_RANGE) == \
            [r for r in range(n) if bad_span[r]]
        assert sorted(v.batch_row for v in rows if v.reasons == F.SLOT_OUT_OF_RANGE and v.position == -1) == \
            [r for r in range(n) if not skip[r] and not bad_span[r] and (seeds[r] < -1 or seeds[r] >= N)]
    recs = e.records()
    assert all(s in set(loc.tolist()) for s in np.nonzero(recs.any(axis=1))[0])  # only planned slots written
