"""The bench's PyTorch baseline (``bench/torch_baseline.py``) computes the same bytes as the NumPy reference.

Run on CPU torch tensors: plan entries, offsets, seeds and scalars; records after a
write; violation rings (row for row, in order) and counters after verify and write,
on random inputs with bad data mixed in and on a populated pool with corruption,
once per chain kind (``"scan"`` and ``"sglang"``).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcanary_cupy as kc
from kvcanary_cupy import format as fmt

from bench import torch_baseline as tb

torch = pytest.importorskip("torch")

POISON = -7
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHAINS = pytest.mark.parametrize("chain", fmt.CHAINS)


def T(a):
    return torch.from_numpy(np.array(a, copy=True))


def N_(t):
    return t.numpy()


# --- hashes --------------------------------------------------------------------
def test_splitmix64_matches_format_on_edges_and_random():
    rng = np.random.default_rng(1)
    edges = np.array([0, 1, -1, 2**63 - 1, -(2**63), 0x5692161D100B05E5, fmt.ANCHOR - 2**64], dtype=np.int64)
    x = np.concatenate([edges, rng.integers(-(2**63), 2**63 - 1, size=5000, dtype=np.int64)])
    got = N_(tb.splitmix64(T(x)))
    assert np.array_equal(got.view(np.uint64), fmt.splitmix64(x.view(np.uint64)))
    assert int(N_(tb.splitmix64(T([fmt.ANCHOR - 2**64])))[0]) & (2**64 - 1) == fmt.ANCHOR_HASH
    a, b, c = (rng.integers(-(2**63), 2**63 - 1, size=777, dtype=np.int64) for _ in range(3))
    assert np.array_equal(N_(tb.mix3(T(a), T(b), T(c))).view(np.uint64), fmt.mix3(a.view(np.uint64), b, c))


def test_scan_chain_arithmetic_matches_format_on_edges_and_random():
    rng = np.random.default_rng(2)
    p = fmt.P61
    edges = np.array([0, 1, p - 1, p - 2, 2, fmt.SCAN_MUL, fmt.SCAN_ANCHOR, (1 << 32) - 1, 1 << 32], dtype=np.int64)
    a = np.concatenate([edges, edges[::-1], rng.integers(0, p, size=5000, dtype=np.int64)])
    b = np.concatenate([edges, edges, rng.integers(0, p, size=5000, dtype=np.int64)])
    got = N_(tb.mulmod61(T(a), T(b))).view(np.uint64)
    assert np.array_equal(got, fmt.mulmod61(a.view(np.uint64), b.view(np.uint64)))
    assert np.array_equal(got, np.array([int(x) * int(y) % p for x, y in zip(a, b)], dtype=np.uint64))
    words = np.concatenate([np.array([0, -1, p, p - 1, p + 1, -(2**63), 2**63 - 1], dtype=np.int64),
                            rng.integers(-(2**63), 2**63 - 1, size=5000, dtype=np.int64)])
    assert np.array_equal(N_(tb.reduce61(T(words))).view(np.uint64), words.view(np.uint64) % np.uint64(p))
    tok, pos = words, np.roll(words, 1)
    assert np.array_equal(N_(tb.scan_term(T(tok), T(pos))).view(np.uint64), fmt.scan_term(tok, pos))
    assert int(N_(tb.scan_term(T([101]), T([0])))[0]) == 0x0D22AFD540D59970  # DESIGN §3.1's check values
    assert int(N_(tb.scan_term(T([-1]), T([-1])))[0]) == 0x16BDF7544574C9D1


@CHAINS
def test_next_link_matches_format(chain):
    rng = np.random.default_rng(4)
    rec = rng.integers(-(2**63), 2**63 - 1, size=(3000, 4), dtype=np.int64)
    rec[:5] = fmt.make_records([101, 202, 303, 404, 505], np.arange(5), chain=chain)
    got = N_(tb.next_link(T(rec[:, fmt.FIELD_LINK]), T(rec[:, fmt.FIELD_TOKEN]), T(rec[:, fmt.FIELD_POSITION]),
                          chain)).view(np.uint64)
    assert np.array_equal(got, fmt.next_link(rec, chain=chain))
    assert tb.first_link(chain) & (2**64 - 1) == fmt.first_link(chain)
    with pytest.raises(ValueError, match="kvcanary: chain"):
        tb.verify(T(rec), tb.TorchVerifyPlan.allocate(capacity=1, max_batch=1), log=tb.TorchLog.allocate(capacity=1),
                  tag=1, chain="v3")


def test_splitmix64_leaves_its_input_alone():
    x = T(np.array([-1, 3, 1 << 40], dtype=np.int64))
    before = x.clone()
    tb.splitmix64(x)
    assert torch.equal(x, before)


# --- random inputs -------------------------------------------------------------
def _random_table(rng, nreq, cols, num_values, bad_rate):
    """Slot table values in [1, num_values) with a few negatives."""
    t = rng.integers(1, max(num_values, 2), size=(nreq, cols)).astype(rng.choice([np.int32, np.int64]))
    t[rng.random(t.shape) < bad_rate] = -rng.integers(1, 5)
    return t


def _random_plan_inputs(rng):
    page = int(rng.choice([1, 1, 2, 4]))
    num_slots = page * int(rng.integers(16, 80))
    nreq = int(rng.integers(1, 7))
    cols = int(rng.integers(0, 10))
    width = cols * page
    bs = int(rng.integers(1, 7))
    use_swa = bool(rng.random() < 0.4)
    lut = None
    if use_swa:
        lut_len = int(rng.integers(1, num_slots + 8))
        lut = rng.integers(1, num_slots, size=lut_len).astype(rng.choice([np.int32, np.int64]))
        lut[rng.random(lut_len) < 0.05] = -1
    table_vals = (num_slots // page) if not use_swa else max(lut.shape[0] // page + 2, 2)
    table = _random_table(rng, nreq, cols, table_vals, 0.03)
    rp = rng.integers(0, nreq + 1, size=bs)
    rp[rng.random(bs) < 0.1] = -1
    P = rng.integers(0, width + 2, size=bs)
    E = rng.integers(0, 4, size=bs)
    P[rng.random(bs) < 0.05] = -1
    E[rng.random(bs) < 0.05] = -2
    idt = rng.choice([np.int32, np.int64])
    d = dict(page=page, num_slots=num_slots, table=table, rp=rp.astype(idt), P=P.astype(idt), E=E.astype(idt),
             swa_size=int(rng.integers(1, 6)) if use_swa else None, lut=lut, expected=None)
    if rng.random() < 0.5:
        ew = int(rng.integers(0, width + 3))
        etab = rng.integers(0, 50, size=(int(rng.integers(1, nreq + 2)), ew)).astype(np.int64)
        d["expected"] = (etab, rng.integers(-1, width + 3, size=bs + int(rng.integers(0, 3))), int(rng.choice([0, 1])))
    return d


def _both_plans(rng, d, capacity=None):
    bs = d["rp"].shape[0]
    mb = bs + int(rng.integers(0, 3))
    if capacity is None:
        capacity = int(rng.integers(0, 40))
    vp = kc.VerifyPlan.allocate(capacity=capacity, max_batch=mb)
    wp = kc.WritePlan.allocate(max_batch=mb)
    for a in (vp.slot_indices, vp.prev_slot_indices, vp.expected_positions, vp.expected_tokens, vp.offsets,
              wp.offsets, wp.seed_slots):
        a.fill(POISON)
    vp.input_errors[0] = 3  # cumulative: both sides must add to it
    wp.input_errors[0] = 5
    tvp = tb.TorchVerifyPlan(**{f: T(getattr(vp, f)) for f in kc.VerifyPlan.ENTRY_FIELDS + kc.VerifyPlan.SCALAR_FIELDS
                                + ("offsets",)})
    twp = tb.TorchWritePlan(offsets=T(wp.offsets), seed_slots=T(wp.seed_slots), num_rows=T(wp.num_rows),
                            input_errors=T(wp.input_errors), position_check=T(wp.position_check))
    return vp, wp, tvp, twp


def _run_plans(d, vp, wp, tvp, twp):
    table_kw = dict(req_to_token=d["table"]) if d["page"] == 1 and rng_bool(d) else \
        dict(block_table=d["table"], page_size=d["page"])
    swa = kc.SwaWindow(d["swa_size"], d["lut"]) if d["swa_size"] is not None else None
    expected = kc.ExpectedTokens(*d["expected"]) if d["expected"] is not None else None
    kc.plan(vp, wp, req_pool_indices=d["rp"], prefix_lens=d["P"], extend_lens=d["E"], swa=swa, expected=expected,
            **table_kw)
    ex = d["expected"]
    tb.plan(tvp, twp, req_pool_indices=T(d["rp"]), prefix_lens=T(d["P"]), extend_lens=T(d["E"]), table=T(d["table"]),
            page_size=d["page"], swa_size=d["swa_size"], lut=None if d["lut"] is None else T(d["lut"]),
            expected_table=None if ex is None else T(ex[0]), valid_lens=None if ex is None else T(ex[1]),
            expected_offset=0 if ex is None else ex[2])


def rng_bool(d):
    return d["table"].shape[1] % 2 == 0  # both spellings of a page-1 table get exercised


def _assert_plans_equal(vp, wp, tvp, twp):
    for f in kc.VerifyPlan.ENTRY_FIELDS + kc.VerifyPlan.SCALAR_FIELDS + ("offsets",):
        assert np.array_equal(getattr(vp, f), N_(getattr(tvp, f))), f
    assert np.array_equal(wp.offsets, N_(twp.offsets))
    assert np.array_equal(wp.seed_slots, N_(twp.seed_slots))
    assert np.array_equal(wp.num_rows, N_(twp.num_rows))
    assert np.array_equal(wp.input_errors, N_(twp.input_errors))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_plan_matches_reference_on_random_inputs(seed):
    rng = np.random.default_rng(seed)
    d = _random_plan_inputs(rng)
    vp, wp, tvp, twp = _both_plans(rng, d)
    _run_plans(d, vp, wp, tvp, twp)
    _assert_plans_equal(vp, wp, tvp, twp)


def test_plan_matches_reference_with_dropped_rows_and_overflow():
    rng = np.random.default_rng(7)
    seen_errors = seen_overflow = seen_entries = False
    for _ in range(200):
        d = _random_plan_inputs(rng)
        vp, wp, tvp, twp = _both_plans(rng, d)
        _run_plans(d, vp, wp, tvp, twp)
        _assert_plans_equal(vp, wp, tvp, twp)
        s = vp.host_scalars()
        seen_errors |= s["input_errors"] > 3
        seen_overflow |= s["enable"] == 0
        seen_entries |= s["enable"] == 1 and s["num_valid"] > 3
    assert seen_errors and seen_overflow and seen_entries  # the generator reaches every branch


# --- sources, records ----------------------------------------------------------
def _sources(rng, num_slots, page):
    """1-2 NumPy sources (random bytes) and their torch twins."""
    srcs = []
    for _ in range(int(rng.integers(1, 3))):
        bpt = 16 * int(rng.integers(1, 4))
        rb = 16 * int(rng.integers(1, bpt // 16 + 1))
        layers = int(rng.integers(1, 4))
        data = rng.integers(0, 256, size=(layers, num_slots * bpt), dtype=np.uint8)
        srcs.append(kc.RealKvSource(data, page_size=page, bytes_per_token=bpt, read_bytes=rb, layer_axis=True))
    return srcs, [tb.TorchKvSource.from_source(s) for s in srcs]


def test_fingerprints_match_reference():
    from kvcanary_cupy.backends import reference  # noqa: PLC0415

    rng = np.random.default_rng(3)
    for mode in (kc.RealKvMode.NONE, kc.RealKvMode.PARTIAL, kc.RealKvMode.ALL):
        srcs, tsrcs = _sources(rng, 64, 2)
        slots = rng.integers(0, 64, size=300).astype(np.int64)
        want = reference.fingerprints(srcs, mode, slots)
        got = N_(tb.fingerprints(tsrcs, int(mode), T(slots)))
        assert np.array_equal(got.view(np.uint64), want)
        assert mode == kc.RealKvMode.NONE or np.count_nonzero(want) > 250


def _random_records(rng, num_slots, srcs, mode, chain):
    """Chained sequences (of kind ``chain``) with correct fingerprints, then random damage."""
    from kvcanary_cupy.backends import reference  # noqa: PLC0415

    rec = np.zeros((num_slots, 4), dtype=np.int64)
    perm = rng.permutation(np.arange(1, num_slots))
    i = 0
    while i < perm.shape[0]:
        n = int(rng.integers(1, 12))
        s = perm[i:i + n]
        rec[s] = fmt.make_records(rng.integers(0, 100, size=s.shape[0]), np.arange(s.shape[0]), chain=chain)
        i += n
    rec[:, 3] = reference.fingerprints(srcs, mode, np.arange(num_slots)).view(np.int64)
    damage = rng.random(num_slots) < 0.1
    col = rng.integers(0, 4, size=num_slots)
    rec[damage, col[damage]] ^= rng.integers(1, 1 << 20, size=int(damage.sum()))
    return rec


def _logs(rng):
    cap = int(rng.choice([3, 8, 4096]))  # small rings overflow: the kept rows must agree too
    log = kc.ViolationLog.allocate(capacity=cap)
    log.ring.fill(POISON)
    log.counter_array[:] = np.arange(4, 4 + log.counter_array.shape[0])
    tlog = tb.TorchLog(ring=T(log.ring), head=T(log.head), counters=T(log.counter_array))
    return log, tlog


def _assert_logs_equal(log, tlog):
    assert np.array_equal(log.head, N_(tlog.head))
    assert np.array_equal(log.counter_array, N_(tlog.counters))
    assert np.array_equal(log.ring, N_(tlog.ring))  # row for row: the baseline keeps the reference's order


# --- verify --------------------------------------------------------------------
def _verify_case(rng, handmade: bool, chain: str):
    page = int(rng.choice([1, 2]))
    num_slots = page * int(rng.integers(16, 64))
    mode = kc.RealKvMode(int(rng.integers(0, 3)))
    srcs, tsrcs = _sources(rng, num_slots, page) if rng.random() < 0.7 else ([], [])
    rec = _random_records(rng, num_slots, srcs, mode, chain)
    if handmade:
        n = int(rng.integers(0, 60))
        bs = int(rng.integers(1, 5))
        vp = kc.VerifyPlan.allocate(capacity=n + int(rng.integers(0, 4)), max_batch=bs)
        vp.slot_indices.fill(POISON)
        vp.slot_indices[:n] = rng.integers(-2, num_slots + 3, size=n)
        vp.prev_slot_indices[:n] = rng.integers(-3, num_slots + 3, size=n)
        vp.expected_positions[:n] = rng.integers(-1, 12, size=n)
        vp.expected_tokens[:n] = rng.integers(-1, 100, size=n)
        vp.offsets[:] = np.sort(rng.integers(0, n + 1, size=bs + 1))
        vp.offsets[0] = 0
        vp.num_valid[0] = n
        vp.enable[0] = int(rng.random() < 0.9)
    else:
        d = _random_plan_inputs(rng)
        d["table"] = np.abs(d["table"]) % num_slots
        vp = kc.VerifyPlan.allocate(capacity=64, max_batch=d["rp"].shape[0])
        kc.plan(vp, None, req_pool_indices=d["rp"], prefix_lens=d["P"], extend_lens=d["E"],
                block_table=d["table"], page_size=1)
    tvp = tb.TorchVerifyPlan(**{f: T(getattr(vp, f)) for f in kc.VerifyPlan.ENTRY_FIELDS + kc.VerifyPlan.SCALAR_FIELDS
                                + ("offsets",)})
    return num_slots, mode, srcs, tsrcs, rec, vp, tvp


@CHAINS
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), handmade=st.booleans())
def test_verify_matches_reference_on_random_inputs(chain, seed, handmade):
    rng = np.random.default_rng(seed)
    num_slots, mode, srcs, tsrcs, rec, vp, tvp = _verify_case(rng, handmade, chain)
    canary = kc.CanaryBuffer(rec.copy(), chain)
    trec = T(rec)
    log, tlog = _logs(rng)
    check_tokens = bool(rng.random() < 0.5)
    sampler = kc.FingerprintSampler.allocate(period=int(rng.integers(1, 4))) if rng.random() < 0.3 else None
    if sampler is not None:
        sampler.state[0] = int(rng.integers(0, 9))
    effective = bool(srcs) and mode != kc.RealKvMode.NONE
    tsample = (sampler.period, T(sampler.state)) if sampler is not None and effective else None
    tag = int(rng.integers(1, 9))
    kc.verify(canary, vp, log=log, tag=tag, real_kv=srcs, real_kv_mode=mode, check_tokens=check_tokens, sample=sampler)
    tb.verify(trec, tvp, log=tlog, tag=tag, sources=tsrcs if effective else (), mode=int(mode) if effective else 0,
              check_tokens=check_tokens, sample=tsample, chain=chain)
    _assert_logs_equal(log, tlog)
    assert np.array_equal(canary.records, N_(trec))  # verify writes nothing
    if tsample is not None:
        assert np.array_equal(sampler.state, N_(tsample[1]))


# --- write ---------------------------------------------------------------------
def _write_case(rng, chain):
    page = int(rng.choice([1, 2]))
    num_slots = page * int(rng.integers(24, 64))
    mode = kc.RealKvMode(int(rng.integers(0, 3)))
    srcs, tsrcs = _sources(rng, num_slots, page) if rng.random() < 0.7 else ([], [])
    rec = _random_records(rng, num_slots, srcs, mode, chain)
    bs = int(rng.integers(1, 6))
    wp = kc.WritePlan.allocate(max_batch=bs + int(rng.integers(0, 2)))
    lens = rng.integers(0, 7, size=bs)
    wp.offsets[: bs + 1] = np.concatenate([[0], np.cumsum(lens)])
    wp.offsets[bs + 1:] = wp.offsets[bs]
    total = int(wp.offsets[bs])
    if rng.random() < 0.2:  # a span outside the inputs
        wp.offsets[int(rng.integers(0, bs + 1))] += int(rng.choice([-50, 50]))
    wp.seed_slots[:bs] = np.where(rng.random(bs) < 0.3, -1, rng.integers(1, num_slots, size=bs))
    if rng.random() < 0.2:
        wp.seed_slots[int(rng.integers(0, bs))] = int(rng.choice([-3, num_slots, num_slots + 9]))
    wp.num_rows[0] = int(rng.choice([bs, bs, bs, bs, bs, bs, 0, wp.max_batch + 3]))  # forged counts too
    wp.position_check[0] = int(rng.random() < 0.7)
    n_in = total + int(rng.integers(-1, 3)) if total else int(rng.integers(0, 3))
    n_in = max(n_in, 0)
    # Unique slots: which of two writes to one slot lands is not defined on a GPU either.
    loc = rng.permutation(np.arange(1, num_slots + 12))[:n_in].astype(np.int64)
    loc[rng.random(n_in) < 0.15] = -1
    pos = np.arange(n_in, dtype=np.int64) + int(rng.integers(0, 5))
    jitter = rng.random(n_in) < 0.15
    pos[jitter] += rng.integers(-2, 3, size=int(jitter.sum()))
    ids = rng.integers(0, 100, size=n_in)
    idt = rng.choice([np.int32, np.int64])
    exp = None
    if rng.random() < 0.5:
        et = np.where(rng.random(n_in) < 0.8, ids, rng.integers(-1, 100, size=n_in))
        ep = np.where(rng.random(n_in) < 0.8, pos, rng.integers(-1, 30, size=n_in))
        exp = (et.astype(idt) if rng.random() < 0.8 else None, ep.astype(idt) if rng.random() < 0.8 else None)
    return num_slots, mode, srcs, tsrcs, rec, wp, ids.astype(idt), pos.astype(idt), loc.astype(idt), exp


@CHAINS
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_write_matches_reference_on_random_inputs(chain, seed):
    rng = np.random.default_rng(seed)
    num_slots, mode, srcs, tsrcs, rec, wp, ids, pos, loc, exp = _write_case(rng, chain)
    canary = kc.CanaryBuffer(rec.copy(), chain)
    trec = T(rec)
    log, tlog = _logs(rng)
    twp = tb.TorchWritePlan(offsets=T(wp.offsets), seed_slots=T(wp.seed_slots), num_rows=T(wp.num_rows),
                            input_errors=T(wp.input_errors), position_check=T(wp.position_check))
    effective = bool(srcs) and mode != kc.RealKvMode.NONE
    tag = int(rng.integers(1, 9))
    kc.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc, log=log, tag=tag, real_kv=srcs,
             real_kv_mode=mode, expected_inputs=exp)
    tb.write(trec, twp, input_ids=T(ids), positions=T(pos), out_cache_loc=T(loc), log=tlog, tag=tag,
             sources=tsrcs if effective else (), mode=int(mode) if effective else 0,
             expected_tokens=None if exp is None or exp[0] is None else T(exp[0]),
             expected_positions=None if exp is None or exp[1] is None else T(exp[1]), chain=chain)
    assert np.array_equal(canary.records, N_(trec))
    _assert_logs_equal(log, tlog)


@CHAINS
def test_long_rows_with_skips_match_reference(chain):
    """Rows of a few hundred tokens (nine levels of the scan), uneven lengths, skipped tokens, seeds."""
    rng = np.random.default_rng(9)
    num_slots, lens = 4096, np.array([300, 0, 1, 257, 129])
    bs, total = lens.shape[0], int(lens.sum())
    rec = _random_records(rng, num_slots, [], kc.RealKvMode.NONE, chain)
    wp = kc.WritePlan.allocate(max_batch=bs)
    wp.offsets[:] = np.concatenate([[0], np.cumsum(lens)])
    wp.seed_slots[:] = [-1, -1, 17, 33, -1]
    wp.num_rows[0] = bs
    loc = rng.permutation(np.arange(100, num_slots))[:total].astype(np.int64)
    loc[rng.random(total) < 0.05] = -1
    pos = np.concatenate([np.arange(n) + rec[s, fmt.FIELD_POSITION] + 1 if s >= 0 else np.arange(n)
                          for n, s in zip(lens, wp.seed_slots)]).astype(np.int64)
    ids = rng.integers(0, 1000, size=total)
    canary = kc.CanaryBuffer(rec.copy(), chain)
    trec = T(rec)
    log, tlog = _logs(rng)
    twp = tb.TorchWritePlan(offsets=T(wp.offsets), seed_slots=T(wp.seed_slots), num_rows=T(wp.num_rows),
                            input_errors=T(wp.input_errors), position_check=T(wp.position_check))
    kc.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc, log=log, tag=2)
    tb.write(trec, twp, input_ids=T(ids), positions=T(pos), out_cache_loc=T(loc), log=tlog, tag=2, chain=chain)
    assert np.array_equal(canary.records, N_(trec))
    _assert_logs_equal(log, tlog)
    assert int(log.counters()["slots_written"]) >= 0.9 * total


# --- a populated pool, then corruption -----------------------------------------
@CHAINS
@pytest.mark.parametrize("mode", list(kc.RealKvMode))
@pytest.mark.parametrize("swa", [False, True])
def test_step_on_a_populated_pool_then_corruption(mode, swa, chain):
    """Fill a pool through write, check it clean, corrupt records / bytes / table, check again."""
    rng = np.random.default_rng(11 + int(mode) + 10 * swa)
    bs, P, E, num_slots = 6, 40, 3, 1024
    width = P + E
    slots = rng.permutation(np.arange(1, num_slots))[: bs * width]
    table = np.zeros((bs + 1, width), dtype=np.int32)
    table[1:] = slots.reshape(bs, width)
    lut = None
    if swa:
        lut = np.zeros(num_slots, dtype=np.int32)
        lut[1:] = rng.permutation(np.arange(1, num_slots))
    kv = rng.integers(0, 256, size=(2, num_slots, 32), dtype=np.uint8)
    src = kc.RealKvSource(kv, bytes_per_token=32, layer_axis=True)
    tsrc = tb.TorchKvSource.from_source(src)
    effective = mode != kc.RealKvMode.NONE
    canary = kc.CanaryBuffer.allocate(num_slots=num_slots, chain=chain)
    log = kc.ViolationLog.allocate(capacity=512)
    rpi = np.arange(1, bs + 1, dtype=np.int64)

    fill = kc.WritePlan.allocate(max_batch=bs)
    kc.plan(None, fill, req_pool_indices=rpi, prefix_lens=np.zeros(bs, np.int64),
            extend_lens=np.full(bs, P, np.int64), req_to_token=table)
    loc = table[1:, :P].reshape(-1).astype(np.int64)
    loc = lut[loc].astype(np.int64) if swa else loc
    kc.write(canary, fill, input_ids=rng.integers(0, 1000, size=bs * P), positions=np.tile(np.arange(P), bs),
             out_cache_loc=loc, log=log, tag=kc.LaunchTag.SWEEP, real_kv=[src], real_kv_mode=mode)
    assert log.count == 0

    # Corruption: a record's token / link, a KV byte, a table entry, a stray write.
    # Every one lies inside the window [P - 17, P) so the SWA variant sees it too.
    r = canary.records
    r[loc[25], fmt.FIELD_TOKEN] += 1
    r[loc[P + 27], fmt.FIELD_LINK] ^= 0x40
    kv[1, loc[2 * P + 29], 3] ^= 0xFF
    table[4, 31] = table[5, 12]
    r[loc[3 * P + 33], fmt.FIELD_POSITION] = 999

    win = kc.SwaWindow(17, lut) if swa else None
    vp = kc.VerifyPlan.allocate(capacity=bs * P, max_batch=bs)
    wp = kc.WritePlan.allocate(max_batch=bs)
    tvp = tb.TorchVerifyPlan.allocate(capacity=bs * P, max_batch=bs)
    twp = tb.TorchWritePlan.allocate(max_batch=bs)
    args = dict(req_pool_indices=rpi, prefix_lens=np.full(bs, P, np.int64), extend_lens=np.full(bs, E, np.int64))
    kc.plan(vp, wp, req_to_token=table, swa=win, **args)
    tb.plan(tvp, twp, table=T(table), swa_size=17 if swa else None, lut=T(lut) if swa else None,
            **{k: T(v) for k, v in args.items()})
    n = int(vp.num_valid[0])
    for f in kc.VerifyPlan.ENTRY_FIELDS:
        assert np.array_equal(getattr(vp, f)[:n], N_(getattr(tvp, f))[:n]), f
    assert np.array_equal(wp.seed_slots, N_(twp.seed_slots))

    trec = T(canary.records)
    tlog = tb.TorchLog(ring=T(log.ring), head=T(log.head), counters=T(log.counter_array))
    kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY, real_kv=[src], real_kv_mode=mode)
    tb.verify(trec, tvp, log=tlog, tag=int(kc.LaunchTag.VERIFY), sources=[tsrc] if effective else (),
              mode=int(mode), chain=chain)
    assert log.count >= 4  # the corruption is seen...
    _assert_logs_equal(log, tlog)  # ...and seen the same way

    step_loc = table[1:, P:].reshape(-1).astype(np.int64)
    step_loc = lut[step_loc].astype(np.int64) if swa else step_loc
    ids = rng.integers(0, 1000, size=bs * E)
    pos = np.tile(np.arange(P, P + E), bs)
    kc.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=step_loc, log=log, tag=kc.LaunchTag.WRITE,
             real_kv=[src], real_kv_mode=mode)
    tb.write(trec, twp, input_ids=T(ids), positions=T(pos), out_cache_loc=T(step_loc), log=tlog,
             tag=int(kc.LaunchTag.WRITE), sources=[tsrc] if effective else (), mode=int(mode), chain=chain)
    assert np.array_equal(canary.records, N_(trec))
    _assert_logs_equal(log, tlog)
