"""Hand-made cases for plan / write / verify / scatter with answers worked out by hand.

Expected records come from the scalar oracles in ``workloads`` (``chain_of``,
``fingerprint_of``) or ``format.make_records``, never from running an op twice.
Every test runs on NumPy and, where a GPU is visible, on CuPy.
"""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from kvcanary_cupy import RealKvMode
from tests.workloads import (
    ANCHOR_HASH,
    Env,
    KvPool,
    arr,
    chain,
    chain_of,
    fingerprint_of,
    host,
    kv_sources,
    nxt,
    first_link,
    s64,
    sm64,
    vrow,
)

N = 64
ROW1 = [5, 9, 2, 30, 17, 8, 40, 41, 3, 22, 60, 33, 12, 13, 14, 15]
ROW2 = [50, 51, 52, 7, 6, 4, 19, 20, 21, 23, 24, 25, 26, 27, 28, 29]
TABLE = np.array([[0] * 16, ROW1, ROW2], dtype=np.int32)
TOK1 = [7001, 7013, 7019, 7027, 7039, 7043, 7057, 7069, 7079, 7103, 7109, 7121, 7127, 7129, 7151, 7159]
TOK2 = [901, 907, 911, 919, 929, 937, 941, 947, 953, 967, 971, 977, 983, 991, 997, 1009]
TOKENS = np.array([[-1] * 16, TOK1, TOK2], dtype=np.int64)
W, V = kc.LaunchTag.WRITE, kc.LaunchTag.VERIFY
pytestmark = pytest.mark.usefixtures("chain_kind")


def env(xp, device, **kw):
    return Env(xp, device, table=TABLE, **kw)


def links(tokens, start=0, seed=None):
    return chain_of(tokens, range(start, start + len(tokens)), seed)


def prefill(e, rp, n, row, toks):
    e.plan([rp], [0], [n])
    e.write(toks[:n], range(n), row[:n])


def check_chain(recs, row, toks, n, fps=None):
    lk = links(toks[:n])
    for i in range(n):
        fp = 0 if fps is None else fps[i]
        assert recs[row[i]].tolist() == [toks[i], i, s64(lk[i]), s64(fp)], i


# --- the oracle itself ------------------------------------------------------------
def test_scalar_oracle_matches_the_published_constants():
    assert sm64(1) == 0x5692161D100B05E5
    assert sm64(0xC0FFEE1234567890) == ANCHOR_HASH == kc.ANCHOR_HASH
    assert int(kc.splitmix64(1)) == sm64(1)
    assert kc.make_records([3, 4], [0, 1], chain=chain())[:, 2].tolist() == [s64(x) for x in links([3, 4])]


# --- plan + write + verify: the clean paths -----------------------------------------
def test_single_prefill_then_verify(xp, device):
    e = env(xp, device)
    e.plan([1], [0], [5])
    assert host(e.wp.offsets).tolist() == [0, 5] + [5] * 7
    assert host(e.wp.seed_slots).tolist() == [-1] * 8
    assert int(host(e.wp.num_rows)[0]) == 1
    assert e.scalars() == dict(num_valid=0, enable=1, requested=0, input_errors=0, overflows=0, max_requested=0)
    assert host(e.vp.offsets).tolist() == [0] * 9
    assert (e.entries()["slot_indices"] == Env.POISON).all()  # nothing planned, nothing written

    e.write(TOK1[:5], range(5), ROW1[:5])
    recs = e.records()
    assert (recs[ROW1[:5]] == kc.make_records(TOK1[:5], range(5), chain=chain())).all()
    check_chain(recs, ROW1, TOK1, 5)
    untouched = np.setdiff1d(np.arange(N), ROW1[:5])
    assert (recs[untouched] == 0).all()

    e.plan([1], [5], [0], write_plan=False)
    ent = e.entries()
    assert ent["slot_indices"][:5].tolist() == ROW1[:5]
    assert ent["prev_slot_indices"][:5].tolist() == [-1] + ROW1[:4]
    assert ent["expected_positions"][:5].tolist() == [0, 1, 2, 3, 4]
    assert ent["expected_tokens"][:5].tolist() == [-1] * 5
    assert (ent["slot_indices"][5:] == Env.POISON).all()
    assert e.scalars() == dict(num_valid=5, enable=1, requested=5, input_errors=0, overflows=0, max_requested=5)
    assert host(e.vp.offsets).tolist() == [0, 5] + [5] * 7
    e.verify()
    assert e.rows() == []
    assert e.log.counters() == dict(kernel_runs=2, slots_checked=5, slots_written=5, verifies_skipped=0,
                                    writes_skipped=0, tokens_skipped=0)


def test_decode_extends_the_chain(xp, device):
    e = env(xp, device)
    prefill(e, 1, 5, ROW1, TOK1)
    e.plan([1], [5], [1])
    assert host(e.wp.seed_slots)[0] == ROW1[4]
    assert host(e.wp.offsets)[:2].tolist() == [0, 1]
    e.verify()
    e.write([TOK1[5]], [5], [ROW1[5]])
    recs = e.records()
    assert recs[ROW1[5]].tolist() == kc.make_records(TOK1[:6], range(6), chain=chain())[5].tolist()
    check_chain(recs, ROW1, TOK1, 6)
    e.plan([1], [6], [0])
    e.verify()
    assert e.rows() == []


def test_mixed_batch_prefill_padding_decode(xp, device):
    """A padding row keeps its span of the step's tokens (the engine's layout) and stamps nothing."""
    e = env(xp, device)
    prefill(e, 2, 3, ROW2, TOK2)
    e.plan([1, 0, 2], [0, -7, 3], [4, 1, 1])
    assert host(e.wp.offsets).tolist() == [0, 4, 5, 6, 6, 6, 6, 6, 6]
    assert host(e.wp.seed_slots).tolist() == [-1, kc.SEED_SKIP, ROW2[2]] + [-1] * 5
    assert int(host(e.wp.num_rows)[0]) == 3
    assert host(e.vp.offsets).tolist() == [0, 0, 0, 3, 3, 3, 3, 3, 3]
    assert e.entries()["slot_indices"][:3].tolist() == ROW2[:3]
    assert e.scalars()["input_errors"] == 0
    assert int(host(e.wp.input_errors)[0]) == 0
    e.verify()
    # The padding row's token (slot 0) sits between the rows; 2 trailing pads after them.
    e.write(TOK1[:4] + [5, TOK2[3], 5, 5], [0, 1, 2, 3, 0, 3, 0, 0], ROW1[:4] + [0, ROW2[3], 0, 0])
    recs = e.records()
    check_chain(recs, ROW1, TOK1, 4)
    check_chain(recs, ROW2, TOK2, 4)
    assert (recs[0] == 0).all()  # padding tokens are never stored
    e.plan([2, 1], [4, 4], [0, 0])
    e.verify()
    assert e.rows() == []
    assert e.log.counters()["slots_written"] == 3 + 5


def test_rows_after_an_unknown_span_stamp_nothing_and_are_counted(xp, device):
    """A row whose extend length is out of range (here a padding row's 2**40) leaves the layout
    after it unknown: the later rows are verified but stamp nothing, and each live one is counted."""
    e = env(xp, device)
    prefill(e, 2, 3, ROW2, TOK2)
    e.plan([1, 0, 2], [0, -7, 3], [4, 1 << 40, 1])
    assert host(e.wp.offsets).tolist() == [0, 4, 4, 5, 5, 5, 5, 5, 5]
    assert host(e.wp.seed_slots).tolist() == [-1, kc.SEED_SKIP, kc.SEED_SKIP] + [-1] * 5
    assert host(e.vp.offsets).tolist() == [0, 0, 0, 3, 3, 3, 3, 3, 3]  # row 2 is still verified
    assert e.scalars()["input_errors"] == 0
    assert int(host(e.wp.input_errors)[0]) == 1
    e.verify()
    e.write(TOK1[:4] + [TOK2[3]], [0, 1, 2, 3, 3], ROW1[:4] + [ROW2[3]])
    recs = e.records()
    check_chain(recs, ROW1, TOK1, 4)
    assert (recs[ROW2[3]] == 0).all()  # not stamped from a guess
    assert e.rows() == []
    assert e.log.counters()["slots_written"] == 3 + 4


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_padding_rows_with_garbage_lengths_produce_nothing(xp, device, dtype):
    e = env(xp, device, dtype=dtype)
    big = np.iinfo(dtype).max
    e.plan([0, 0, 0, 0], [-5, big, 7, np.iinfo(dtype).min], [big, -2, 3, 0])
    assert e.scalars() == dict(num_valid=0, enable=1, requested=0, input_errors=0, overflows=0, max_requested=0)
    assert host(e.vp.offsets).tolist() == [0] * 9
    # Row 0's length is no span: the layout after it is unknown, and no row stamps.
    assert host(e.wp.offsets).tolist() == [0, 0, 0, 3] + [3] * 5
    assert host(e.wp.seed_slots).tolist() == [kc.SEED_SKIP] * 4 + [-1] * 4
    assert int(host(e.wp.input_errors)[0]) == 0  # padding rows: nothing live was skipped
    e.write([1, 2], [0, 1], [7, 8])
    assert (e.records() == 0).all()
    assert e.rows() == []


# --- SWA ------------------------------------------------------------------------------
LUT = (np.arange(N) * 37) % N  # a permutation of the pool with lut[0] = 0


@pytest.mark.parametrize("size", [1, 4, 11, 12, 20])
def test_swa_window_and_lut(xp, device, size):
    e = env(xp, device)
    lut = [int(v) for v in LUT]
    sw = [lut[s] for s in ROW1]
    e.plan([1], [0], [12], swa=kc.SwaWindow(size, arr(xp, LUT)))
    assert host(e.wp.seed_slots)[0] == -1
    e.write(TOK1[:12], range(12), sw[:12])  # the engine writes SWA-pool slots
    e.plan([1], [12], [1], swa=kc.SwaWindow(size, arr(xp, LUT, np.int32)))
    start = max(0, 12 - size)
    ent = e.entries()
    n = 12 - start
    assert e.scalars()["num_valid"] == n
    assert ent["slot_indices"][:n].tolist() == sw[start:12]
    assert ent["prev_slot_indices"][:n].tolist() == ([-1] if start == 0 else [sw[start - 1]]) + sw[start:11]
    assert ent["expected_positions"][:n].tolist() == list(range(start, 12))
    assert host(e.wp.seed_slots)[0] == sw[11]  # the seed goes through the LUT too
    e.verify()
    assert e.rows() == []  # the window head links to its real predecessor: clean
    e.write([TOK1[12]], [12], [sw[12]])
    check_chain(e.records(), sw, TOK1, 13)


# --- capacity ---------------------------------------------------------------------------
@pytest.mark.parametrize("cap, enable", [(9, 1), (8, 0)])
def test_capacity_exact_and_one_short(xp, device, cap, enable):
    e = env(xp, device, capacity=cap)
    prefill(e, 1, 5, ROW1, TOK1)
    prefill(e, 2, 4, ROW2, TOK2)
    e.canary.records[ROW1[1], 0] = 1  # corrupt: a verify that runs must report it
    e.plan([1, 2], [5, 4], [1, 1])
    s = e.scalars()
    assert s == dict(num_valid=min(9, cap), enable=enable, requested=9, input_errors=0, overflows=1 - enable,
                     max_requested=9)
    assert host(e.vp.offsets).tolist() == [0, 5, 9] + [9] * 6  # offsets are planned either way
    assert host(e.wp.seed_slots)[:2].tolist() == [ROW1[4], ROW2[3]]
    ent = e.entries()
    if enable:
        assert ent["slot_indices"].tolist() == ROW1[:5] + ROW2[:4]
    else:
        for f, a in ent.items():
            assert (a == Env.POISON).all(), f  # no entry written on overflow
    before = e.log.counters()
    e.verify(check_tokens=True)
    after = e.log.counters()
    assert after["kernel_runs"] == before["kernel_runs"] + 1
    assert after["slots_checked"] - before["slots_checked"] == (9 if enable else 0)
    assert [r[1] for r in e.rows()] == ([ROW1[2]] if enable else [])  # the successor's chain breaks


# --- expected tokens ----------------------------------------------------------------------
EXP = np.array([[0] * 16, [100 + i for i in range(16)], [200 + i for i in range(16)]], dtype=np.int64)


@pytest.mark.parametrize("offset, width, valid, want", [
    (0, 16, 4, [100, 101, 102, 103, -1, -1]),
    (1, 16, 4, [101, 102, 103, -1, -1, -1]),
    (0, 3, 10, [100, 101, 102, -1, -1, -1]),
    (1, 3, 10, [101, 102, -1, -1, -1, -1]),
    (0, 16, 0, [-1] * 6),
    (0, 16, 6, [100, 101, 102, 103, 104, 105]),
    (1, 16, 7, [101, 102, 103, 104, 105, 106]),
])
def test_expected_tokens_at_and_past_valid_lens(xp, device, offset, width, valid, want):
    e = env(xp, device)
    exp = kc.ExpectedTokens(arr(xp, EXP[:, :width], np.int32), arr(xp, [9, valid]), offset=offset)
    e.plan([2, 1], [0, 6], [3, 0], expected=exp)
    assert e.entries()["expected_tokens"][:6].tolist() == want


# --- page-level tables ---------------------------------------------------------------
@pytest.mark.parametrize("page", [1, 16])
def test_block_table_equals_token_table(xp, device, page):
    if page == 16:
        bt = np.array([[0, 0], [3, 1], [2, 0]], dtype=np.int32)
        rt = np.array([[0] * 32, list(range(48, 64)) + list(range(16, 32)), list(range(32, 48)) + list(range(16))],
                      dtype=np.int32)
    else:
        bt = rt = TABLE
    rp, P, E = [1, 0, 2], ([20, 5, 10] if page == 16 else [10, 5, 6]), [3, 1, 2]
    results = []
    for kw in (dict(block_table=arr(xp, bt, np.int32), page_size=page), dict(req_to_token=arr(xp, rt, np.int32))):
        e = Env(xp, device, num_slots=80)
        e.plan(rp, P, E, **kw)
        results.append((e.entries(), host(e.vp.offsets), host(e.wp.offsets), host(e.wp.seed_slots), e.scalars()))
    (ent_b, *rest_b), (ent_t, *rest_t) = results
    for f in ent_b:
        assert ent_b[f].tolist() == ent_t[f].tolist(), f
    for a, b in zip(rest_b, rest_t):
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
    n = P[0] + P[2]
    want = [int(rt[1, p]) for p in range(P[0])] + [int(rt[2, p]) for p in range(P[2])]
    assert ent_b["slot_indices"][:n].tolist() == want
    assert rest_b[2].tolist()[:3] == [int(rt[1, P[0] - 1]), kc.SEED_SKIP, int(rt[2, P[2] - 1])]
    if page == 16:
        assert want[:17] == list(range(48, 64)) + [16]


# --- real-KV fingerprints -----------------------------------------------------------------
def hand_pools(rng):
    a = KvPool(rng.integers(0, 256, (N, 32), dtype=np.uint8), 1, 32, 32, False)
    b = KvPool(rng.integers(0, 256, (2, N, 48), dtype=np.uint8), 1, 48, 32, True)
    c = KvPool(rng.integers(0, 256, (N // 4, 4 * 16), dtype=np.uint8), 4, 16, 16, False)
    return [a, b, c]


def test_fingerprint_oracle_by_hand():
    data = np.zeros((4, 32), dtype=np.uint8)
    data[2, 0] = 1  # slot 2: lo word 1, hi word 0; second chunk all zero
    p = KvPool(data, 1, 32, 32, False)
    fold_partial = sm64(sm64(0 ^ 1) ^ 0)
    assert fingerprint_of([p], RealKvMode.PARTIAL, 2) == sm64(0 ^ fold_partial)
    fold_all = sm64(sm64(fold_partial ^ 0) ^ 0)
    assert fingerprint_of([p], RealKvMode.ALL, 2) == sm64(fold_all)
    assert fingerprint_of([p, p], RealKvMode.PARTIAL, 2) == sm64(sm64(fold_partial) ^ fold_partial)
    assert fingerprint_of([p], RealKvMode.NONE, 2) == 0


@pytest.mark.parametrize("mode", list(RealKvMode))
def test_real_kv_modes_sources_and_layers(xp, device, mode):
    pools = hand_pools(np.random.default_rng(int(mode) + 1))
    kv, (a, b, c) = kv_sources(xp, pools)
    e = env(xp, device)
    e.plan([1], [0], [6])
    e.write(TOK1[:6], range(6), ROW1[:6], real_kv=[a, b, c], real_kv_mode=mode)
    fps = [fingerprint_of(pools, mode, s) for s in ROW1[:6]]
    check_chain(e.records(), ROW1, TOK1, 6, fps)
    assert len(set(fps)) == (1 if mode == RealKvMode.NONE else 6)
    e.plan([1], [6], [0])
    e.verify(real_kv=[a, b, c], real_kv_mode=mode)
    assert e.rows() == []
    e.verify(real_kv=[b, a, c], real_kv_mode=mode)  # order matters
    rows = e.rows()
    if mode == RealKvMode.NONE:
        assert rows == []
    else:
        assert sorted(r[1] for r in rows) == sorted(ROW1[:6])
        assert all(r[7] == F.REAL_KV for r in rows)
    if mode != RealKvMode.NONE:
        # a single source whose layers are swapped also differs: layers are ordered
        swapped = KvPool(np.ascontiguousarray(pools[1].data[::-1]), 1, 48, 32, True)
        _, (bs,) = kv_sources(xp, [swapped])
        e.log.clear()
        e.verify(real_kv=[a, bs, c], real_kv_mode=mode)
        assert len(e.rows()) == 6


@pytest.mark.parametrize("mode", [RealKvMode.PARTIAL, RealKvMode.ALL])
@pytest.mark.parametrize("which, layer, byte, seen", [
    (0, 0, 3, {RealKvMode.PARTIAL, RealKvMode.ALL}),
    (0, 0, 20, {RealKvMode.ALL}),  # past the 16 bytes PARTIAL reads
    (1, 1, 31, {RealKvMode.ALL}),
    (1, 1, 40, set()),  # past read_bytes: never hashed
    (2, 0, 15, {RealKvMode.PARTIAL, RealKvMode.ALL}),
])
def test_one_kv_byte(xp, device, mode, which, layer, byte, seen):
    pools = hand_pools(np.random.default_rng(7))
    kv, srcs = kv_sources(xp, pools)
    e = env(xp, device)
    e.plan([1], [0], [6])
    e.write(TOK1[:6], range(6), ROW1[:6], real_kv=srcs, real_kv_mode=mode)
    e.plan([1], [6], [0])
    slot = ROW1[4]
    old_fp = s64(fingerprint_of(pools, mode, slot))
    p = pools[which]
    row, col = divmod(slot, p.page_size)
    idx = (layer, row, col * p.bytes_per_token + byte) if p.layer_axis else (row, col * p.bytes_per_token + byte)
    kv[which][idx] = int(host(kv[which][idx])) ^ 0x5A
    e.verify(real_kv=srcs, real_kv_mode=mode)
    rows = e.rows()
    if mode in seen:
        lk = s64(links(TOK1[:6])[4])
        assert rows == [vrow(tag=V, slot=slot, position=4, stored_token=TOK1[4], expected_token=-1,
                             stored_link=lk, expected_link=lk, bits=F.REAL_KV, batch_row=0, expected_position=4)]
        assert int(e.records()[slot, 3]) == old_fp
    else:
        assert rows == []


# --- negative out_cache_loc ---------------------------------------------------------------
def test_negative_out_cache_loc_is_skipped(xp, device):
    e = env(xp, device)
    e.plan([1], [0], [4])
    e.write([11, 99, 12, 13], [0, 1, 1, 2], [ROW1[0], -1, ROW1[1], ROW1[2]])
    recs = e.records()
    check_chain(recs, ROW1, [11, 12, 13], 3)  # the skipped token neither stored nor chained
    assert e.rows() == []  # continuity runs from the last stored position
    assert e.log.counters()["slots_written"] == 3
    # a stored token after a skip is still checked against the last stored position
    e.plan([1], [0], [3])
    e.write([11, 99, 12], [0, 1, 2], [ROW1[0], -5, ROW1[1]])
    lk = nxt(first_link(), 11, 0)
    assert e.rows() == [vrow(tag=W, slot=ROW1[1], position=2, stored_token=12, stored_link=lk, expected_link=lk,
                             bits=F.WRITE_POSITION, batch_row=0, expected_position=1)]


# --- single corruptions found by verify -------------------------------------------------------
@pytest.fixture
def two_requests(xp, device):
    """Row 2 holds 3 tokens, row 1 holds 6; a verify plan over batch [2, 1] with expected tokens."""
    e = env(xp, device)
    prefill(e, 2, 3, ROW2, TOK2)
    prefill(e, 1, 6, ROW1, TOK1)
    e.plan([2, 1], [3, 6], [0, 0], expected=kc.ExpectedTokens(arr(xp, TOKENS), arr(xp, [3, 6])))
    return e


def l1():
    return links(TOK1[:6])


def test_clean_two_requests(two_requests):
    e = two_requests
    e.verify(check_tokens=True)
    assert e.rows() == []
    assert e.entries()["expected_tokens"][:9].tolist() == TOK2[:3] + TOK1[:6]


def test_corrupt_token(two_requests):
    e = two_requests
    e.canary.records[ROW1[2], 0] = 4242
    e.verify(check_tokens=True)
    assert e.rows() == sorted([
        vrow(tag=V, slot=ROW1[2], position=2, stored_token=4242, expected_token=TOK1[2], stored_link=l1()[2],
             expected_link=l1()[2], bits=F.TOKEN, batch_row=1, expected_position=2),
        vrow(tag=V, slot=ROW1[3], position=3, stored_token=TOK1[3], expected_token=TOK1[3], stored_link=l1()[3],
             expected_link=nxt(l1()[2], 4242, 2), bits=F.CHAIN, batch_row=1, expected_position=3),
    ])
    e.log.clear()
    e.verify(check_tokens=False)  # without the token check the successor's chain still catches it
    assert [r[1] for r in e.rows()] == [ROW1[3]]


def test_corrupt_last_token_of_first_row(two_requests):
    e = two_requests
    e.canary.records[ROW2[2], 0] = 5
    e.verify(check_tokens=True)
    L2 = links(TOK2[:3])
    assert e.rows() == [vrow(tag=V, slot=ROW2[2], position=2, stored_token=5, expected_token=TOK2[2],
                             stored_link=L2[2], expected_link=L2[2], bits=F.TOKEN, batch_row=0, expected_position=2)]


def test_corrupt_position(two_requests):
    e = two_requests
    e.canary.records[ROW1[2], 1] = 99
    e.verify(check_tokens=True, tag=17)
    assert e.rows() == sorted([
        vrow(tag=17, slot=ROW1[2], position=99, stored_token=TOK1[2], expected_token=TOK1[2], stored_link=l1()[2],
             expected_link=l1()[2], bits=F.POSITION, batch_row=1, expected_position=2),
        vrow(tag=17, slot=ROW1[3], position=3, stored_token=TOK1[3], expected_token=TOK1[3], stored_link=l1()[3],
             expected_link=nxt(l1()[2], TOK1[2], 99), bits=F.CHAIN, batch_row=1, expected_position=3),
    ])


def test_corrupt_link(two_requests):
    e = two_requests
    bad = 0x0123456789ABCDEF
    e.canary.records[ROW1[2], 2] = bad
    e.verify(check_tokens=True)
    assert e.rows() == sorted([
        vrow(tag=V, slot=ROW1[2], position=2, stored_token=TOK1[2], expected_token=TOK1[2], stored_link=bad,
             expected_link=l1()[2], bits=F.CHAIN, batch_row=1, expected_position=2),
        vrow(tag=V, slot=ROW1[3], position=3, stored_token=TOK1[3], expected_token=TOK1[3], stored_link=l1()[3],
             expected_link=nxt(bad, TOK1[2], 2), bits=F.CHAIN, batch_row=1, expected_position=3),
    ])


def test_corrupt_first_link_checks_against_anchor(two_requests):
    e = two_requests
    e.canary.records[ROW1[0], 2] = 1
    e.verify()
    rows = e.rows()
    assert vrow(tag=V, slot=ROW1[0], position=0, stored_token=TOK1[0], expected_token=TOK1[0], stored_link=1,
                expected_link=first_link(), bits=F.CHAIN, batch_row=1, expected_position=0) in rows


def test_corrupt_fingerprint_field(two_requests):
    e = two_requests
    e.canary.records[ROW2[1], 3] = -3
    e.verify()  # mode NONE: the expected fingerprint is 0
    L2 = links(TOK2[:3])
    assert e.rows() == [vrow(tag=V, slot=ROW2[1], position=1, stored_token=TOK2[1], expected_token=TOK2[1],
                             stored_link=L2[1], expected_link=L2[1], bits=F.REAL_KV, batch_row=0,
                             expected_position=1)]


def test_a_prefix_on_slot_0_is_reported_and_its_successor_chain_unchecked(xp, device):
    e = env(xp, device)
    table = TABLE.copy()
    table[1, 2] = 0  # position 2 on the reserved slot: a live row's bookkeeping bug
    e.plan([1], [0], [4], req_to_token=arr(xp, table))
    e.write(TOK1[:4], range(4), table[1, :4])
    e.canary.records[ROW1[3], 2] = 77  # the record after the padding slot: its chain is unchecked
    e.plan([1], [4], [0], req_to_token=arr(xp, table))
    assert e.entries()["prev_slot_indices"][:4].tolist() == [-1, ROW1[0], ROW1[1], 0]
    e.verify()
    # Slot 0 is reported, never read; its successor's chain is not checked against it.
    assert e.rows() == [vrow(tag=V, slot=0, bits=F.RESERVED_SLOT, batch_row=0, expected_position=2)]
    assert e.log.counters()["slots_checked"] == 4


# --- write-side checks ------------------------------------------------------------------
def test_write_expected_tokens_and_positions(xp, device):
    e = env(xp, device)
    e.plan([1], [0], [4])
    e.write([5, 6, 7, 8], [0, 1, 2, 3], ROW1[:4],
            expected_inputs=(arr(xp, [5, 9, -1, 8]), arr(xp, [0, 1, -1, 7])))
    lk = links([5, 6, 7, 8])
    assert e.rows() == sorted([
        vrow(tag=W, slot=ROW1[1], position=1, stored_token=6, expected_token=9, stored_link=lk[1],
             expected_link=lk[1], bits=F.WRITE_TOKEN, batch_row=0, expected_position=1),
        vrow(tag=W, slot=ROW1[3], position=3, stored_token=8, expected_token=8, stored_link=lk[3],
             expected_link=lk[3], bits=F.WRITE_POSITION, batch_row=0, expected_position=7),
    ])
    check_chain(e.records(), ROW1, [5, 6, 7, 8], 4)  # stored on the actual values all the same
    e.log.clear()
    e.plan([1], [0], [2])
    e.write([5, 6], [0, 1], ROW1[:2], expected_inputs=(None, arr(xp, [0, 4])))
    assert [(r[1], r[7], r[9]) for r in e.rows()] == [(ROW1[1], int(F.WRITE_POSITION), 4)]


@pytest.mark.parametrize("on", [True, False])
def test_write_chain_position_check(xp, device, on):
    e = env(xp, device)
    prefill(e, 1, 5, ROW1, TOK1)
    e.plan([1], [5], [1])
    e.wp.set_position_check(on)
    e.write([TOK1[5]], [7], [ROW1[5]])  # the seed record holds position 4
    lk = s64(nxt(l1()[4], TOK1[4], 4))
    want = [vrow(tag=W, slot=ROW1[5], position=7, stored_token=TOK1[5], stored_link=lk, expected_link=lk,
                 bits=F.WRITE_POSITION, batch_row=0, expected_position=5)]
    assert e.rows() == (want if on else [])
    assert e.records()[ROW1[5]].tolist() == [TOK1[5], 7, lk, 0]
    # without a seed the first token has no previous position; later ones do
    e.log.clear()
    e.plan([2], [0], [3])
    e.wp.set_position_check(on)
    e.write([1, 2, 3], [3, 4, 6], ROW2[:3])
    got = [(r[1], r[2], r[9]) for r in e.rows()]
    assert got == ([(ROW2[2], 6, 5)] if on else [])


@pytest.mark.parametrize("seed", [N, N + 3, -3, -(1 << 40)])
def test_write_seed_out_of_range(xp, device, seed):
    e = env(xp, device)
    prefill(e, 1, 5, ROW1, TOK1)
    e.plan([2, 1], [0, 5], [1, 1])
    e.wp.seed_slots[1] = seed
    before = e.records()
    e.write([TOK2[0], TOK1[5]], [0, 5], [ROW2[0], ROW1[5]])
    assert e.rows() == [vrow(tag=W, slot=seed, bits=F.SLOT_OUT_OF_RANGE, batch_row=1)]
    after = e.records()
    assert after[ROW1[5]].tolist() == before[ROW1[5]].tolist()  # the row is not written
    assert after[ROW2[0]].tolist() == [TOK2[0], 0, s64(first_link()), 0]  # the other row is
    assert e.log.counters()["slots_written"] == 5 + 1


def test_write_slot_past_the_buffer_advances_the_chain(xp, device):
    e = env(xp, device)
    e.plan([1], [0], [3])
    e.write([11, 12, 13], [0, 1, 2], [ROW1[0], N + 5, ROW1[2]])
    lk = links([11, 12, 13])
    assert e.rows() == [vrow(tag=W, slot=N + 5, position=1, stored_token=12, stored_link=lk[1], expected_link=lk[1],
                             bits=F.SLOT_OUT_OF_RANGE, batch_row=0, expected_position=1)]
    recs = e.records()
    assert recs[ROW1[2]].tolist() == [13, 2, s64(lk[2]), 0]
    assert recs[ROW1[0]].tolist() == [11, 0, s64(lk[0]), 0]
    assert e.log.counters()["slots_written"] == 2


def test_write_inputs_shorter_than_the_plan(xp, device):
    e = env(xp, device)
    e.plan([1, 2], [0, 0], [3, 2])
    e.write([1, 2, 3, 4], [0, 1, 2, 0], ROW1[:3] + [ROW2[0]])  # row 1 needs tokens [3, 5)
    assert e.rows() == [vrow(tag=W, slot=-1, bits=F.INPUT_OUT_OF_RANGE, batch_row=1)]
    recs = e.records()
    check_chain(recs, ROW1, [1, 2, 3], 3)
    assert (recs[ROW2[0]] == 0).all()
    e.log.clear()
    # expected inputs count toward the length available
    e.write([1, 2, 3, 4, 5], [0, 1, 2, 0, 1], ROW1[:3] + ROW2[:2], expected_inputs=(arr(xp, [1, 2]), None))
    assert e.rows() == sorted([vrow(tag=W, slot=-1, bits=F.INPUT_OUT_OF_RANGE, batch_row=r) for r in (0, 1)])


# --- sampled fingerprint verification ----------------------------------------------------
PERIOD = 4


def test_sampler_finds_corruption_on_its_phase(xp, device):
    pools = hand_pools(np.random.default_rng(3))
    kv, srcs = kv_sources(xp, pools)
    e = env(xp, device)
    e.plan([1], [0], [8])
    e.write(TOK1[:8], range(8), ROW1[:8], real_kv=srcs, real_kv_mode=RealKvMode.PARTIAL)
    e.plan([1], [8], [0])
    slot = ROW1[6]  # 40: phase 0
    kv[0][slot, 0] = int(host(kv[0][slot, 0])) ^ 1
    sampler = kc.FingerprintSampler.allocate(period=PERIOD, device=device)
    sampler.state[0] = 5  # phase 1 first
    found = []
    for k in range(PERIOD):
        e.log.clear()
        e.verify(real_kv=srcs, real_kv_mode=RealKvMode.PARTIAL, sample=sampler)
        found.append([(r[1], r[7]) for r in e.rows()])
        assert host(sampler.state).tolist() == [6 + k, 0]
    # phases 1, 2, 3, 0: only the replay with phase slot % 4 == 0 sees it
    assert found == [[], [], [], [(slot, int(F.REAL_KV))]]


def test_sampler_covers_every_slot_over_a_period(xp, device):
    pools = hand_pools(np.random.default_rng(4))
    kv, srcs = kv_sources(xp, pools)
    e = env(xp, device)
    e.plan([1], [0], [16])
    e.write(TOK1, range(16), ROW1, real_kv=srcs, real_kv_mode=RealKvMode.ALL)
    e.plan([1], [16], [0])
    for s in ROW1:
        kv[0][s, 17] = int(host(kv[0][s, 17])) ^ 0xFF
    e.canary.records[ROW1[3], 1] = 1000  # a position fault is found on every replay
    sampler = kc.FingerprintSampler.allocate(period=PERIOD, device=device)
    seen = []
    for k in range(PERIOD):
        e.log.clear()
        e.verify(real_kv=srcs, real_kv_mode=RealKvMode.ALL, sample=sampler)
        rows = e.rows()
        kv_slots = sorted(r[1] for r in rows if r[7] & F.REAL_KV)
        assert all(s % PERIOD == k for s in kv_slots)
        assert ROW1[3] in [r[1] for r in rows if r[7] & F.POSITION]
        seen += kv_slots
    assert sorted(seen) == sorted(ROW1)


def test_sampler_advances_on_empty_and_disabled_plans(xp, device):
    pools = hand_pools(np.random.default_rng(5))
    _, srcs = kv_sources(xp, pools)
    e = env(xp, device, capacity=2)
    sampler = kc.FingerprintSampler.allocate(period=3, device=device)
    e.plan([0], [0], [0])  # no entries
    e.verify(real_kv=srcs, real_kv_mode=RealKvMode.PARTIAL, sample=sampler)
    e.plan([1], [5], [0])  # overflow: enable 0
    assert e.scalars()["enable"] == 0
    e.verify(real_kv=srcs, real_kv_mode=RealKvMode.PARTIAL, sample=sampler)
    assert host(sampler.state).tolist() == [2, 0]
    assert sampler.phase() == 2


# --- the ring and the counters ------------------------------------------------------------
def drain(log):
    """Everything poll() hands out by now: on CUDA a poll returns what the previous poll's copy found."""
    return [v.tag for v in log.poll() + log.poll()]


def test_ring_overflow_order_poll_clear(xp, device):
    e = env(xp, device, log_capacity=3)
    prefill(e, 1, 2, ROW1, TOK1)
    e.canary.records[ROW1[1], 1] = 50  # one POSITION violation per verify
    e.plan([1], [2], [0])
    assert drain(e.log) == []
    e.verify(tag=11)
    e.verify(tag=12)
    assert drain(e.log) == [11, 12]
    e.verify(tag=13)
    assert drain(e.log) == [13]  # new rows only
    e.verify(tag=14)
    e.verify(tag=15)
    assert e.log.count == 5 and e.log.dropped == 2
    got = e.log.read()
    assert [v.tag for v in got] == [11, 12, 13]  # later rows dropped, earlier ones kept
    assert [v.tag for v in e.log.read()] == [11, 12, 13]  # read() consumes nothing
    assert all(v.slot == ROW1[1] and v.reasons == F.POSITION and v.position == 50 for v in got)
    assert drain(e.log) == []  # dropped rows never show up
    e.log.clear()
    assert e.log.count == 0 and e.log.read() == [] and e.log.dropped == 0
    e.verify(tag=21)
    assert [v.tag for v in e.log.read()] == [21]
    assert drain(e.log) == [21]


def test_poll_hands_out_a_burst_beyond_its_copy_window_once_in_order(xp, device):
    # 700 unstamped entries: 700 rows in one verify, more than a poll's copy holds.
    n = 700
    table = np.zeros((2, n), dtype=np.int32)
    table[1] = np.arange(1, n + 1)
    e = Env(xp, device, num_slots=n + 1, capacity=n, log_capacity=2 * n, table=table)
    e.plan([1], [n], [0])
    e.verify(tag=31)
    got = e.log.poll() + e.log.poll()
    assert len(got) == n and e.log.count == n
    assert [(v.tag, v.slot) for v in got] == [(v.tag, v.slot) for v in e.log.read()]  # ring order, each once
    e.verify(tag=32)
    assert [v.tag for v in e.log.poll() + e.log.poll()] == [32] * n
    assert e.log.poll() + e.log.poll() == []


def test_take_copied_hands_out_rows_from_a_callers_copy_and_reads_a_burst(xp, device):
    e = env(xp, device, log_capacity=8)
    prefill(e, 1, 2, ROW1, TOK1)
    e.canary.records[ROW1[1], 1] = 50
    e.plan([1], [2], [0])
    for tag in (51, 52, 53, 54, 55):
        e.verify(tag=tag)
    assert e.log.copy_window() == (0, 8)  # the log is shorter than a poll's window
    rows = host(e.log.ring)
    got = e.log.take_copied(5, rows[0:2], 0)  # a copy of two rows: three more are read from the ring
    assert [v.tag for v in got] == [51, 52, 53, 54, 55]
    assert e.log.copy_window() == (5, 8)
    e.verify(tag=56)
    assert [v.tag for v in e.log.take_copied(6, host(e.log.ring)[5:8], 5)] == [56]
    assert e.log.take_copied(6, host(e.log.ring)[6:8], 6) == []


def test_poll_queue_next_false_reads_the_copy_an_earlier_poll_queued(xp, device):
    e = env(xp, device)
    prefill(e, 1, 2, ROW1, TOK1)
    e.canary.records[ROW1[1], 1] = 50
    e.plan([1], [2], [0])
    e.verify(tag=41)
    first = e.log.poll()  # on CUDA: queues the copy after the verify, nothing was queued before
    if device != "cpu":
        assert first == []
        xp.cuda.Device().synchronize()  # what an engine's own sync does
    got = first + e.log.poll(queue_next=False)
    assert [v.tag for v in got] == [41]
    assert e.log.poll(queue_next=False) == []  # nothing queued: nothing more to read
    e.verify(tag=42)
    assert [v.tag for v in e.log.poll() + e.log.poll()] == [42]


def test_counters(xp, device):
    e = env(xp, device)
    zero = dict(kernel_runs=0, slots_checked=0, slots_written=0, verifies_skipped=0, writes_skipped=0,
                tokens_skipped=0)
    e.plan([1, 2], [0, 0], [4, 3])
    assert e.log.counters() == zero  # plan counts nothing
    e.write(TOK1[:4] + TOK2[:3], [0, 1, 2, 3, 0, 1, 2], ROW1[:4] + [ROW2[0], -1, N + 1])
    assert e.log.counters() == dict(zero, kernel_runs=1, slots_written=5, tokens_skipped=1)
    table = TABLE.copy()
    table[1, 1] = 0
    e.plan([1, 2], [4, 1], [0, 0], req_to_token=arr(xp, table))
    e.verify()
    # slot 0 is checked (and reported): a live row read it
    assert e.log.counters() == dict(zero, kernel_runs=2, slots_checked=5, slots_written=5, tokens_skipped=1)
    e.log.reset_counters()
    assert e.log.counters() == zero


def test_violation_str_is_one_actionable_line(two_requests):
    e = two_requests
    e.canary.records[ROW1[2], 0] = 4242
    e.verify(check_tokens=True, tag=kc.LaunchTag.VERIFY_SWA)
    v = next(v for v in e.log.read() if v.slot == ROW1[2])
    s = str(v)
    assert "\n" not in s
    for part in ("verify_swa", "batch row 1", f"slot {ROW1[2]}", "position 2", f"token {TOK1[2]}", "token 4242",
                 "expected", "found", "token"):
        assert part in s, (part, s)
    w = kc.Violation(tag=99, slot=7, position=3, stored_token=1, expected_token=2, stored_link=-1, expected_link=5,
                     reasons=F.CHAIN | F.POSITION, batch_row=4, expected_position=2)
    s = str(w)
    assert "\n" not in s and "tag 99" in s and "chain" in s and "position" in s and "batch row 4" in s
    assert "0xffffffffffffffff" in s and "slot 7" in s


# --- scatter_expected_tokens ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_scatter_expected_tokens(xp, device, dtype):
    table = arr(xp, np.full((5, 4), -9), dtype)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    rp = [1, 0, 3, 2, 7, -1, 4, 4]
    offsets = [0, 2, 3, 5, 11, 11, 12, 12, 13]
    kc.scatter_expected_tokens(table, tokens=arr(xp, tokens), offsets=arr(xp, offsets), req_pool_indices=arr(xp, rp))
    got = host(table)
    want = np.full((5, 4), -9)
    want[1, :2] = [1, 2]  # row 0: span [0, 2)
    # row 1: padding; row 2 -> rp 3, span [3, 5)
    want[3, :2] = [4, 5]
    want[2, :4] = [6, 7, 8, 9]  # row 3 -> rp 2: span [5, 11) truncated to the width 4
    # row 4: rp 7 outside the table; row 5: rp -1; row 6: rp 4 span [12, 12) empty; row 7: span past tokens
    assert got.tolist() == want.tolist()
