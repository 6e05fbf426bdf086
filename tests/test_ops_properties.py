"""Property tests: random workloads verify clean, every single fault is caught, and the
ops agree with scalar models written from the semantics alone.

The models below loop over rows and tokens in plain Python; they share nothing with
the vectorized backends. Every test takes the ``xp`` / ``device`` fixtures, so the
same properties run against the CUDA backend where a GPU is visible.
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from kvcanary_cupy import RealKvMode
from tests.workloads import (
    Runner,
    arr,
    chain,
    chain_of,
    fingerprint_of,
    host,
    kv_sources,
    make_kv_pools,
    make_workload,
    nxt,
    first_link,
    s64,
)

pytestmark = pytest.mark.usefixtures("chain_kind")

FIXTURES = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# KVCANARY_EXAMPLES_SCALE shrinks every example count, for runs under slow tools
# (compute-sanitizer); every strategy still covers every feature.
SCALE = float(os.environ.get("KVCANARY_EXAMPLES_SCALE", "1"))


def examples(n: int) -> int:
    return max(10, int(n * SCALE))
seeds = st.integers(0, 2**32 - 1)


def workload_strategy():
    return st.fixed_dictionaries(dict(
        seed=seeds,
        page_size=st.sampled_from([1, 2, 4, 16]),
        swa_size=st.sampled_from([None, None, 1, 3, 8]),
        table=st.sampled_from(["token", "block"]),
        mode=st.sampled_from(list(RealKvMode)),
        index_dtype=st.sampled_from([np.int32, np.int64]),
        share_prob=st.sampled_from([0.0, 0.5, 1.0]),
    ))


def run_clean(xp, device, p):
    rng = np.random.default_rng(p["seed"])
    wl = make_workload(rng, num_requests=int(rng.integers(1, 9)), max_len=int(rng.integers(2, 72)),
                       page_size=p["page_size"], swa_size=p["swa_size"], share_prob=p["share_prob"],
                       index_dtype=p["index_dtype"])
    pools = make_kv_pools(rng, wl.num_slots)
    kv, srcs = kv_sources(xp, pools)
    run = Runner(xp, device, wl, table=p["table"], sources=tuple(srcs), mode=p["mode"]).run()
    return rng, wl, pools, kv, run


# --- clean workloads ------------------------------------------------------------------
@settings(max_examples=examples(200), **FIXTURES)
@given(p=workload_strategy())
def test_random_workloads_verify_clean(xp, device, p):
    rng, wl, pools, kv, run = run_clean(xp, device, p)
    assert run.log.read() == []
    assert run.log.count == 0
    assert int(host(run.vp.input_errors)[0]) == 0 and int(host(run.wp.input_errors)[0]) == 0
    c = run.log.counters()
    assert c["kernel_runs"] == run.kernel_runs
    assert c["slots_written"] == run.tokens_written
    # the final sweep planned exactly the entries the tables imply
    want = wl.expected_entries(wl.final_step())
    ent = run.vp.host_entries()
    assert ent["slot_indices"].tolist() == [w[1] for w in want]
    assert ent["prev_slot_indices"].tolist() == [w[2] for w in want]
    assert ent["expected_positions"].tolist() == [w[3] for w in want]
    assert ent["expected_tokens"].tolist() == [w[4] for w in want]
    # every record equals the scalar chain oracle
    recs = host(run.canary.records)
    for r in range(1, wl.lengths.shape[0]):
        L = int(wl.lengths[r])
        slots = wl.canary_slots(wl.req_to_token[r, :L])
        lk = chain_of(wl.tokens[r, :L], range(L))
        for pos in range(L):
            s = int(slots[pos])
            assert recs[s].tolist() == [int(wl.tokens[r, pos]), pos, s64(lk[pos]),
                                        s64(fingerprint_of(pools, p["mode"], s))], (r, pos)


# --- every single fault is caught -----------------------------------------------------------
FIELDS = {"token": (0, F.TOKEN), "position": (1, F.POSITION), "link": (2, F.CHAIN), "fingerprint": (3, F.REAL_KV)}


@settings(max_examples=examples(200), **FIXTURES)
@given(p=workload_strategy(), what=st.sampled_from(["token", "position", "link", "fingerprint", "kv"]),
       delta=st.integers(1, 2**63 - 1))
def test_any_single_fault_is_detected(xp, device, p, what, delta):
    if what == "kv" and p["mode"] == RealKvMode.NONE:
        p = dict(p, mode=RealKvMode.ALL)
    rng, wl, pools, kv, run = run_clean(xp, device, p)
    ent = run.vp.host_entries()
    i = int(rng.integers(0, ent["slot_indices"].shape[0]))
    s = int(ent["slot_indices"][i])
    successors = {int(x) for x in ent["slot_indices"][ent["prev_slot_indices"] == s]}
    if what == "kv":
        k = int(rng.integers(0, len(pools)))
        pool = pools[k]
        eff = 16 if p["mode"] == RealKvMode.PARTIAL else pool.read_bytes
        layer = int(rng.integers(0, pool.layers.shape[0]))
        row, col = divmod(s, pool.page_size)
        b = col * pool.bytes_per_token + int(rng.integers(0, eff))
        idx = (layer, row, b) if pool.layer_axis else (row, b)
        kv[k][idx] = int(host(kv[k][idx])) ^ (1 + delta % 255)
        want = {s: int(F.REAL_KV)}
    else:
        field, bit = FIELDS[what]
        old = int(host(run.canary.records[s, field]))
        run.canary.records[s, field] = s64(old ^ delta)
        want = {s: int(bit)}
        if what != "fingerprint":
            want.update({q: int(F.CHAIN) for q in successors})
    run.log.clear()
    run.verify(tag=kc.LaunchTag.SWEEP)
    got = {}
    for v in run.log.read():
        got.setdefault(v.slot, set()).add(int(v.reasons))
    assert {q: b for q, bs in got.items() for b in bs} == want
    assert all(len(bs) == 1 for bs in got.values())


# --- plan against a scalar model ----------------------------------------------------------------
def model_plan(rp, P, E, table, page, swa_size, lut, exp, cap, max_batch):
    """Plan one batch row by row, straight from the semantics."""
    nreq, tw = table.shape
    width = tw * page

    def T(r, pos):
        v = int(table[r, pos // page])
        if v < 0:
            return None
        s = v * page + pos % page
        if lut is not None:
            if s >= lut.shape[0] or int(lut[s]) < 0:
                return None
            s = int(lut[s])
        return s

    entries, counts, W, seed, errors, unstamped = [], [], [], [], 0, 0
    layout_known = True  # every row so far had a length that can be its span of the step's tokens
    for r in range(len(rp)):
        q, p, e = int(rp[r]), int(P[r]), int(E[r])
        row, sd, ok = [], -1, q != 0
        if q != 0:
            ok = (0 < q < nreq and 0 <= p <= width and 0 <= e <= width - p
                  and (exp is None or q < exp[0].shape[0]))
            if ok:
                start = max(0, p - swa_size) if swa_size else 0
                for pos in range(start, p):
                    s, prev = T(q, pos), (T(q, pos - 1) if pos > 0 else -1)
                    if s is None or prev is None:
                        ok = False
                        break
                    tok = -1
                    if exp is not None:
                        k = pos + exp[2]
                        if 0 <= k < min(int(exp[1][r]), exp[0].shape[1]):
                            tok = int(exp[0][q, k])
                    row.append((s, prev, pos, tok))
                if ok and p > 0 and e > 0:
                    sd = T(q, p - 1)
                    ok = sd is not None
            if not ok:
                errors += 1
        if not ok:
            row = []
        stamps = ok and layout_known
        if q != 0 and not stamps:
            unstamped += 1
        entries += row
        counts.append(len(row))
        known = 0 <= e <= width
        W.append(e if known else 0)  # the row's span, kept whether or not it stamps
        layout_known &= known
        seed.append(sd if stamps else kc.SEED_SKIP)
    total = len(entries)
    offs = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
    woffs = np.concatenate([[0], np.cumsum(W, dtype=np.int64)]).tolist()
    return dict(entries=entries, total=total, errors=errors, unstamped=unstamped,
                offsets=offs + [total] * (max_batch - len(rp)),
                w_offsets=woffs + [woffs[-1]] * (max_batch - len(rp)),
                seeds=seed + [-1] * (max_batch - len(rp)),
                num_valid=min(total, cap), enable=int(total <= cap))


@settings(max_examples=examples(400), **FIXTURES)
@given(seed=seeds, page=st.sampled_from([1, 2, 4]), use_swa=st.booleans(), use_exp=st.booleans(),
       dtype=st.sampled_from([np.int32, np.int64]), block=st.booleans())
def test_plan_matches_scalar_model(xp, device, seed, page, use_swa, use_exp, dtype, block):
    rng = np.random.default_rng(seed)
    nreq, tw = int(rng.integers(2, 7)), int(rng.integers(1, 7))
    page = page if block else 1
    width = tw * page
    table = rng.integers(-2, 30, size=(nreq, tw))
    table = np.where(rng.random(table.shape) < 0.95, np.abs(table), table)  # mostly readable
    max_batch = int(rng.integers(1, 7))
    bs = int(rng.integers(1, max_batch + 1)) if rng.random() < 0.9 else 0
    # most rows well formed, the rest garbage of every kind
    rp = rng.integers(1, max(2, nreq), size=bs)
    P = rng.integers(0, width + 1, size=bs)
    E = np.array([rng.integers(0, width - p + 1) for p in P], dtype=np.int64)
    junk = rng.random(bs) < 0.3
    rp[junk] = rng.integers(-1, nreq + 2, size=int(junk.sum()))
    P[junk] = rng.integers(-2, width + 3, size=int(junk.sum()))
    E[junk] = rng.integers(-2, width + 3, size=int(junk.sum()))
    rp[rng.random(bs) < 0.2] = 0
    swa_size, lut = None, None
    if use_swa:
        swa_size = int(rng.integers(1, 8))
        n_lut = 30 * page + page if rng.random() < 0.8 else int(rng.integers(1, 30 * page + 4))
        lut = rng.integers(0, 50, size=n_lut)
        lut[rng.random(n_lut) < 0.03] = -1
    exp = None
    if use_exp:
        rows = nreq if rng.random() < 0.8 else int(rng.integers(0, nreq + 2))
        exp = (rng.integers(-1, 1000, size=(rows, int(rng.integers(0, 9)))),
               rng.integers(-1, 12, size=bs), int(rng.integers(0, 2)))
    cap = int(rng.integers(0, 30))
    want = model_plan(rp, P, E, table, page, swa_size, lut, exp, cap, max_batch)

    vp = kc.VerifyPlan.allocate(capacity=cap, max_batch=max_batch, device=device)
    wp = kc.WritePlan.allocate(max_batch=max_batch, device=device)
    for a in (vp.slot_indices, vp.prev_slot_indices, vp.expected_positions, vp.expected_tokens, vp.offsets,
              wp.offsets, wp.seed_slots):
        a.fill(-555)
    prior = int(rng.integers(0, 5))
    vp.input_errors.fill(prior)
    wp.input_errors.fill(prior + 1)
    tkw = (dict(block_table=arr(xp, table, dtype), page_size=page) if block
           else dict(req_to_token=arr(xp, table, dtype)))
    kc.plan(vp, wp, req_pool_indices=arr(xp, rp, dtype), prefix_lens=arr(xp, P, dtype), extend_lens=arr(xp, E, dtype),
            swa=kc.SwaWindow(swa_size, arr(xp, lut, dtype)) if use_swa else None,
            expected=kc.ExpectedTokens(arr(xp, exp[0], dtype), arr(xp, exp[1], dtype), exp[2]) if use_exp else None,
            **tkw)

    sc = vp.host_scalars()
    assert sc == dict(num_valid=want["num_valid"], enable=want["enable"], requested=want["total"],
                      input_errors=prior + want["errors"], overflows=1 - want["enable"], max_requested=want["total"])
    offs = host(vp.offsets)
    assert offs.tolist() == want["offsets"]
    # invariants, stated on their own
    assert offs[0] == 0 and (np.diff(offs) >= 0).all() and offs[-1] == sc["requested"]
    assert sc["num_valid"] == min(sc["requested"], cap) and sc["enable"] == int(sc["requested"] <= cap)
    ent = {f: host(getattr(vp, f)) for f in kc.VerifyPlan.ENTRY_FIELDS}
    if want["enable"]:
        got = list(zip(*(ent[f][:want["total"]].tolist() for f in kc.VerifyPlan.ENTRY_FIELDS)))
        assert got == want["entries"]  # entries past the total are not defined
    else:
        for f in kc.VerifyPlan.ENTRY_FIELDS:
            assert (ent[f] == -555).all()
    seeds_got = host(wp.seed_slots)
    assert host(wp.offsets).tolist() == want["w_offsets"]
    assert seeds_got.tolist() == want["seeds"]
    assert int(host(wp.num_rows)[0]) == bs
    assert int(host(wp.input_errors)[0]) == prior + 1 + want["unstamped"]
    assert all(seeds_got[r] == kc.SEED_SKIP for r in range(bs) if rp[r] == 0)
    for r in range(bs):  # a seed is the table's slot at P - 1, after the LUT
        if seeds_got[r] >= 0:
            v = int(table[rp[r], (P[r] - 1) // page]) * page + (P[r] - 1) % page
            assert seeds_got[r] == (v if lut is None else lut[v])


# --- write against a scalar model ----------------------------------------------------------------
def model_write(recs, offsets, seeds, num_rows, ids, pos, loc, exp_tok, exp_pos, check, tag, pools, mode):
    """Returns (records after, violation rows, records stored, tokens skipped on a negative
    slot); ``recs`` is not changed."""
    out, rows, written, skipped = recs.copy(), [], 0, 0
    N = recs.shape[0]
    avail = min(len(a) for a in (ids, pos, loc, exp_tok, exp_pos) if a is not None)
    for r in range(max(0, min(num_rows, len(seeds)))):
        a, b = int(offsets[r]), int(offsets[r + 1])
        if int(seeds[r]) == kc.SEED_SKIP:  # the plan skipped the row: nothing stamped, nothing reported
            continue
        # A write row's detail: no predecessor slot, the position its token follows, no
        # fingerprints, the token's index, the row's span and the tokens the arrays hold.
        span = (a, b, avail)
        if a < 0 or b > avail or b < a:
            rows.append((tag, -1, -1, -1, -1, 0, 0, int(F.INPUT_OUT_OF_RANGE), r, -1, -1, -1, 0, 0, -1) + span)
            continue
        sd = int(seeds[r])
        if sd < -1 or sd >= N:
            rows.append((tag, sd, -1, -1, -1, 0, 0, int(F.SLOT_OUT_OF_RANGE), r, -1, -1, -1, 0, 0, -1) + span)
            continue
        if sd == -1:
            running, prev = first_link(), None
        else:
            t0, p0, l0 = (int(x) for x in recs[sd, :3])
            running, prev = nxt(l0, t0, p0), p0
        for i in range(a, b):
            s, t, p = int(loc[i]), int(ids[i]), int(pos[i])
            if s < 0:
                skipped += 1
                continue
            bits, epos = 0, -1
            etok = int(exp_tok[i]) if exp_tok is not None else -1
            if check and prev is not None:
                epos = s64(prev + 1)  # wraps as the kernel stores it; no position follows the largest
                if p != prev + 1:
                    bits |= F.WRITE_POSITION
            if etok != -1 and etok != t:
                bits |= F.WRITE_TOKEN
            if exp_pos is not None and int(exp_pos[i]) != -1:
                epos = int(exp_pos[i])
                if epos != p:
                    bits |= F.WRITE_POSITION
            if s >= N:
                bits |= F.SLOT_OUT_OF_RANGE
            else:
                out[s] = [t, p, s64(running), s64(fingerprint_of(pools, mode, s))]
                written += 1
            if bits:
                rows.append((tag, s, p, t, etok, s64(running), s64(running), int(bits), r, epos,
                             -1, -1 if prev is None else prev, 0, 0, i) + span)
            running, prev = nxt(running, t, p), p
    return out, rows, written, skipped


@settings(max_examples=examples(300), **FIXTURES)
@given(seed=seeds, check=st.booleans(), with_exp=st.sampled_from(["none", "tok", "pos", "both"]),
       mode=st.sampled_from(list(RealKvMode)), dtype=st.sampled_from([np.int32, np.int64]))
def test_write_matches_scalar_model(xp, device, seed, check, with_exp, mode, dtype):
    rng = np.random.default_rng(seed)
    N = int(rng.integers(8, 40))
    pools = make_kv_pools(rng, N)
    kv, srcs = kv_sources(xp, pools)
    recs = rng.integers(-(2**63), 2**63 - 1, size=(N, 4), dtype=np.int64)
    recs[:, 1] = rng.integers(-1, 20, size=N)
    max_batch = int(rng.integers(1, 6))
    nrows = int(rng.integers(0, max_batch + 1))
    lens = rng.integers(0, 6, size=nrows)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    total = int(offsets[-1])
    # distinct write slots, disjoint from the seeds, so the result cannot depend on thread order
    perm = rng.permutation(np.arange(1, N))
    nseed = min(nrows, N // 3)
    seed_pool, write_pool = perm[:nseed], perm[nseed:]
    seeds_ = np.full(max_batch, -1, dtype=np.int64)
    for r in range(nrows):
        u = rng.random()
        seeds_[r] = (seed_pool[r] if r < nseed and u < 0.6 else
                     rng.choice([-1, -3, N, N + 7]) if u > 0.85 else -1)
    loc = np.full(total + 3, 0, dtype=np.int64)
    m = min(total, len(write_pool))
    loc[:m] = rng.permutation(write_pool)[:m]
    loc[m:total] = N + rng.integers(0, 5, size=total - m)  # repeats would race on a GPU: only past the buffer
    loc[:total][rng.random(total) < 0.15] = -1
    loc[:total][rng.random(total) < 0.1] = N + 2
    ids = rng.integers(0, 100, size=total + 3)
    posn = np.concatenate([np.arange(n) + rng.integers(0, 20) for n in lens] + [np.zeros(3, np.int64)]).astype(np.int64)
    posn[rng.random(posn.shape[0]) < 0.1] += 1
    exp_tok = np.where(rng.random(total + 3) < 0.8, ids, rng.integers(-1, 100, size=total + 3)) \
        if with_exp in ("tok", "both") else None
    exp_pos = np.where(rng.random(total + 3) < 0.8, posn, rng.integers(-1, 30, size=total + 3)) \
        if with_exp in ("pos", "both") else None
    # forged spans now and then, on the last row: moving an inner boundary would make two rows
    # share a token (and its slot), whose record then depends on GPU thread order
    if nrows and rng.random() < 0.3:
        r = nrows - 1
        offsets[r + 1] = rng.choice([offsets[r] - 1, total + 9])
    avail_cut = int(rng.integers(0, 3)) if rng.random() < 0.2 else None
    if avail_cut is not None:
        ids = ids[:max(0, total - avail_cut)]
    wrow = np.full(max_batch + 1, offsets[-1], dtype=np.int64)
    wrow[:nrows + 1] = offsets
    want_recs, want_rows, want_written, want_skipped = model_write(recs, wrow, seeds_, nrows, ids, posn, loc, exp_tok, exp_pos,
                                                     check, 9, pools, mode)

    canary = kc.CanaryBuffer(arr(xp, recs), chain())
    log = kc.ViolationLog.allocate(capacity=256, device=device)
    wp = kc.WritePlan.allocate(max_batch=max_batch, device=device)
    wp.offsets[...] = arr(xp, wrow)
    wp.seed_slots[...] = arr(xp, seeds_)
    wp.num_rows.fill(nrows)
    wp.set_position_check(check)
    ei = None
    if exp_tok is not None or exp_pos is not None:
        ei = tuple(None if a is None else arr(xp, a, dtype) for a in (exp_tok, exp_pos))
    kc.write(canary, wp, input_ids=arr(xp, ids, dtype), positions=arr(xp, posn, dtype),
             out_cache_loc=arr(xp, loc, dtype), log=log, tag=9, real_kv=srcs, real_kv_mode=mode, expected_inputs=ei)
    assert host(canary.records).tolist() == want_recs.tolist()
    assert sorted(v.as_row() for v in log.read()) == sorted(want_rows)
    assert log.counters() == dict(kernel_runs=1, slots_checked=0, slots_written=want_written, verifies_skipped=0,
                                  writes_skipped=0, tokens_skipped=want_skipped)


# --- verify against a scalar model ---------------------------------------------------------------
def model_verify(recs, slot, prev, epos, etok, offsets, n, check_tokens, tag, pools, mode, phase, period):
    N = recs.shape[0]
    rows, checked = [], 0

    def row_of(i):
        return max(r for r in range(len(offsets)) if offsets[r] <= i)

    no_write = (-1, -1, -1, -1)  # a verify row's write columns
    for i in range(n):
        s, q = int(slot[i]), int(prev[i])
        checked += 1
        # The position the predecessor record holds, when it lies in the canary past slot 0.
        q_pos = int(recs[q, 1]) if 0 < q < N else -1
        if s == 0:  # a live row reads the reserved slot: reported, its record never read
            rows.append((tag, 0, -1, -1, int(etok[i]), 0, 0, int(F.RESERVED_SLOT), row_of(i), int(epos[i]),
                         q, q_pos, 0, 0) + no_write)
            continue
        if not (0 <= s < N) or not (-1 <= q < N):
            rows.append((tag, s, -1, -1, int(etok[i]), 0, 0, int(F.SLOT_OUT_OF_RANGE), row_of(i), int(epos[i]),
                         q, q_pos, 0, 0) + no_write)
            continue
        t, p, lk, fp = (int(x) for x in recs[s])
        if q == -1:
            want = first_link()
        elif q == 0:
            want = lk & ((1 << 64) - 1)
        else:
            want = nxt(int(recs[q, 2]), int(recs[q, 0]), int(recs[q, 1]))
        bits = 0
        if lk & ((1 << 64) - 1) != want:
            bits |= F.CHAIN
        if p != int(epos[i]):
            bits |= F.POSITION
        if check_tokens and int(etok[i]) != -1 and int(etok[i]) != t:
            bits |= F.TOKEN
        live_fp = fp  # the stored fingerprint stands where this check computes none
        if phase is None or s % period == phase:
            live_fp = s64(fingerprint_of(pools, mode, s))
            if fp != live_fp:
                bits |= F.REAL_KV
        if bits:
            rows.append((tag, s, p, t, int(etok[i]), lk, s64(want), int(bits), row_of(i), int(epos[i]),
                         q, q_pos, fp, live_fp) + no_write)
    return rows, checked


@settings(max_examples=examples(300), **FIXTURES)
@given(seed=seeds, check_tokens=st.booleans(), mode=st.sampled_from(list(RealKvMode)), sampled=st.booleans())
def test_verify_matches_scalar_model(xp, device, seed, check_tokens, mode, sampled):
    rng = np.random.default_rng(seed)
    N = int(rng.integers(8, 40))
    pools = make_kv_pools(rng, N)
    kv, srcs = kv_sources(xp, pools)
    recs = np.zeros((N, 4), dtype=np.int64)
    # a few chained sequences in random slots, then faults sprinkled over records and entries
    perm = rng.permutation(np.arange(1, N))
    slot_l, prev_l, pos_l, tok_l, counts = [], [], [], [], []
    at = 0
    for _ in range(int(rng.integers(1, 5))):
        n = int(rng.integers(0, max(1, (N - 1) // 4)))
        ss = perm[at:at + n]
        at += n
        toks = rng.integers(0, 1000, size=len(ss))
        lk = chain_of(toks, range(len(ss)))
        for j, s in enumerate(ss):
            recs[s] = [toks[j], j, s64(lk[j]), s64(fingerprint_of(pools, mode, int(s)))]
        slot_l += ss.tolist()
        prev_l += ([-1] + ss[:-1].tolist())[:len(ss)]
        pos_l += list(range(len(ss)))
        tok_l += toks.tolist()
        counts.append(len(ss))
    cap = len(slot_l) + int(rng.integers(0, 3))
    pad = cap - len(slot_l)  # entries past num_valid: never looked at
    slot_a, prev_a = np.array(slot_l + [0] * pad, np.int64), np.array(prev_l + [0] * pad, np.int64)
    pos_a, tok_a = np.array(pos_l + [0] * pad, np.int64), np.array(tok_l + [-1] * pad, np.int64)
    tok_a[rng.random(cap) < 0.2] = -1
    for _ in range(int(rng.integers(0, 4))):
        s = int(rng.integers(0, N))
        recs[s, int(rng.integers(0, 4))] ^= int(rng.integers(1, 1 << 40))
    for a, lo, hi in ((slot_a, -3, N + 3), (prev_a, -3, N + 3), (pos_a, -1, 9), (tok_a, -1, 1000)):
        m = rng.random(cap) < 0.05
        a[m] = rng.integers(lo, hi, size=int(m.sum()))
    if rng.random() < 0.3 and mode != RealKvMode.NONE:
        k = int(rng.integers(0, len(pools)))
        pools[k].data.reshape(-1)[int(rng.integers(0, pools[k].data.size))] ^= 0x10
        kv, srcs = kv_sources(xp, pools)
    max_batch = len(counts) + int(rng.integers(0, 3))
    offsets = np.concatenate([[0], np.cumsum(counts)] + [[len(slot_l)]] * (max_batch - len(counts))).astype(np.int64)
    n = len(slot_l) if rng.random() < 0.8 else int(rng.integers(0, len(slot_l) + 1))
    period = int(rng.integers(1, 5))
    state0 = int(rng.integers(0, 10))
    phase = state0 % period if sampled else None
    want_rows, want_checked = model_verify(recs, slot_a, prev_a, pos_a, tok_a, offsets, n, check_tokens, 3, pools,
                                           mode, phase if srcs and mode != RealKvMode.NONE else None, period)

    canary = kc.CanaryBuffer(arr(xp, recs), chain())
    log = kc.ViolationLog.allocate(capacity=512, device=device)
    vp = kc.VerifyPlan.from_buffers(slot_indices=arr(xp, slot_a), prev_slot_indices=arr(xp, prev_a),
                                    expected_positions=arr(xp, pos_a), expected_tokens=arr(xp, tok_a),
                                    offsets=arr(xp, offsets), num_valid=arr(xp, [n]), enable=arr(xp, [1]),
                                    requested=arr(xp, [n]), input_errors=arr(xp, [0]))
    sampler = None
    if sampled:
        sampler = kc.FingerprintSampler.allocate(period=period, device=device)
        sampler.state[0] = state0
    kc.verify(canary, vp, log=log, tag=3, real_kv=srcs, real_kv_mode=mode, check_tokens=check_tokens, sample=sampler)
    assert sorted(v.as_row() for v in log.read()) == sorted(want_rows)
    assert log.counters() == dict(kernel_runs=1, slots_checked=want_checked, slots_written=0, verifies_skipped=0,
                                  writes_skipped=0, tokens_skipped=0)
    assert host(canary.records).tolist() == recs.tolist()  # verify never writes records
    if sampled:
        assert host(sampler.state).tolist() == [state0 + (1 if mode != RealKvMode.NONE else 0), 0]


# --- scatter_expected_tokens against a scalar model ---------------------------------------------
@settings(max_examples=examples(200), **FIXTURES)
@given(seed=seeds, dtype=st.sampled_from([np.int32, np.int64]))
def test_scatter_matches_scalar_model(xp, device, seed, dtype):
    rng = np.random.default_rng(seed)
    nreq, width, ntok = int(rng.integers(1, 6)), int(rng.integers(1, 8)), int(rng.integers(0, 30))
    bs = int(rng.integers(0, 6))
    rp = rng.permutation(np.arange(-1, nreq + 2))[:bs]  # distinct rows: a GPU scatter of duplicates races
    bs = rp.shape[0]
    cuts = np.sort(rng.integers(0, ntok + 1, size=bs + 1))
    m = rng.random(bs + 1) < 0.15
    cuts[m] = rng.integers(-3, ntok + 4, size=int(m.sum()))
    tokens = rng.integers(-5, 1000, size=ntok)
    table = rng.integers(-9, 0, size=(nreq, width))
    want = table.copy()
    for r in range(bs):
        a, b = int(cuts[r]), int(cuts[r + 1])
        if 0 < rp[r] < nreq and 0 <= a < b <= ntok:
            n = min(b - a, width)
            want[rp[r], :n] = tokens[a:a + n]
    t = arr(xp, table, dtype)
    kc.scatter_expected_tokens(t, tokens=arr(xp, tokens, dtype), offsets=arr(xp, cuts, dtype),
                               req_pool_indices=arr(xp, rp, dtype))
    assert host(t).tolist() == want.tolist()
