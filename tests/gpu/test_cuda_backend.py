"""The CUDA backend at sizes the fuzz does not reach, plus its measurements.

Parity against the NumPy reference for: a batch wider than one block's scan
(multi-pass row scan), a 16K-token prefill row with 256 B/token of real KV over
several layered sources (the fingerprints must be spread over the grid), and
the fingerprint helper. Then two measurements, printed: host microseconds per
op with bound (pre-imported) CuPy buffers against a bare empty
``cupy.RawKernel`` launch, and verify throughput against the memory floor.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvMode
from kvcanary_cupy.backends import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _rows(log):
    return sorted(tuple(int(x) for x in r) for r in log.rows())


def _both(fn):
    """Run fn(device) on 'cpu' and 'cuda', return both results."""
    return fn("cpu"), fn("cuda")


def test_wide_batch_scans_across_many_rows(cp):
    rng = np.random.default_rng(5)
    bs, width = 5000, 40
    nreq = bs + 1
    table = rng.permutation(np.arange(1, nreq * width + 1)).reshape(nreq, width).astype(np.int32)
    rpi = rng.permutation(np.arange(1, nreq))[:bs]
    rpi[rng.random(bs) < 0.1] = 0
    P = rng.integers(0, 30, size=bs)
    E = rng.integers(0, 5, size=bs)
    P[7] = width + 3  # one row out of range

    def run(device):
        xp = np if device == "cpu" else cp
        vp = kc.VerifyPlan.allocate(capacity=int(P.sum()), max_batch=bs + 100, device=device)
        wp = kc.WritePlan.allocate(max_batch=bs + 100, device=device)
        kc.plan(vp, wp, req_pool_indices=xp.asarray(rpi), prefix_lens=xp.asarray(P), extend_lens=xp.asarray(E),
                req_to_token=xp.asarray(table))
        return vp, wp

    (rv, rw), (dv, dw) = _both(run)
    for f in kc.VerifyPlan.ENTRY_FIELDS + kc.VerifyPlan.SCALAR_FIELDS + ("offsets",):
        assert np.array_equal(_host(getattr(dv, f)), _host(getattr(rv, f))), f
    for f in ("offsets", "seed_slots", "num_rows", "input_errors"):
        assert np.array_equal(_host(getattr(dw, f)), _host(getattr(rw, f))), f
    assert int(_host(rv.input_errors)[0]) == 1


def test_long_prefill_row_with_layered_sources(cp):
    """One 16K-token row, 256 B/token, 3 sources x 4 layers: records, then a clean
    verify and one with a corrupted KV byte, on both backends."""
    rng = np.random.default_rng(11)
    n, N, bpt = 16384, 16384 + 64, 256
    slots = rng.permutation(np.arange(1, N))[:n]
    table = np.zeros((2, n + 8), dtype=np.int64)
    table[1, :n] = slots
    ids = rng.integers(0, 1 << 20, size=n)
    pools = [rng.integers(0, 256, size=(4, N * bpt), dtype=np.uint8) for _ in range(3)]

    def run(device):
        xp = np if device == "cpu" else cp
        srcs = [kc.RealKvSource(xp.array(p, copy=True), page_size=1, bytes_per_token=bpt, layer_axis=True)
                for p in pools]  # each backend corrupts its own copy below
        canary = kc.CanaryBuffer.allocate(num_slots=N, device=device)
        log = kc.ViolationLog.allocate(capacity=64, device=device)
        vp = kc.VerifyPlan.allocate(capacity=n, max_batch=1, device=device)
        wp = kc.WritePlan.allocate(max_batch=1, device=device)
        t = xp.asarray(table)
        kc.plan(vp, wp, req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([0]), extend_lens=xp.asarray([n]),
                req_to_token=t)
        kc.write(canary, wp, input_ids=xp.asarray(ids), positions=xp.arange(n), out_cache_loc=xp.asarray(slots),
                 log=log, tag=kc.LaunchTag.WRITE, real_kv=srcs, real_kv_mode=RealKvMode.ALL)
        kc.plan(vp, wp, req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([n]), extend_lens=xp.asarray([0]),
                req_to_token=t)
        kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY, real_kv=srcs, real_kv_mode=RealKvMode.ALL)
        clean = log.count
        srcs[1].data[2, int(slots[1234]) * bpt + 77] ^= 1
        kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY, real_kv=srcs, real_kv_mode=RealKvMode.ALL)
        return canary.host_records(), clean, _rows(log), log.counters()

    (rr, rc, rrows, rcnt), (dr, dc, drows, dcnt) = _both(run)
    assert np.array_equal(dr, rr)
    assert rc == dc == 0
    assert drows == rrows and len(drows) == 1 and drows[0][1] == int(slots[1234])
    assert dcnt == rcnt


def test_page_arithmetic_past_int64_matches_reference(cp):
    """Block-table entries whose slot (v * page + offset) does not fit int64, some of
    which wrap onto small valid slots, and a page size whose table width saturates:
    every such row is dropped and counted, on both backends alike."""
    I64_MAX = (1 << 63) - 1
    cases = [
        (8, [[0, 0], [1 << 61, 1], [3, 4], [(1 << 60) - 1, 0]]),  # 2**61 * 8 wraps to 0
        (4, [[0, 0], [(1 << 62) + 1, 2], [5, (1 << 62) + 3], [7, 8]]),  # wraps to 4.., 12..
        (3, [[0, 0], [(I64_MAX - 1) // 3, 0], [(I64_MAX - 1) // 3 + 1, 0], [1, 2]]),  # the int64 limit
        (1 << 62, [[0, 0], [1, 0], [2, 0], [0, 1]]),  # 2 pages of 2**62: width 2**63 saturates
    ]
    for page, bt in cases:
        bt = np.array(bt, dtype=np.int64)
        rpi = np.array([1, 2, 3, 1, 2, 3, 0])
        P = np.array([2, 2, 2, 3, 1, 1, 5])
        E = np.array([1, 1, 0, 0, I64_MAX - 1, 1, 1])

        def run(device):
            xp = np if device == "cpu" else cp
            vp = kc.VerifyPlan.allocate(capacity=32, max_batch=8, device=device)
            wp = kc.WritePlan.allocate(max_batch=8, device=device)
            for swa in (None, kc.SwaWindow(1, xp.arange(64))):
                kc.plan(vp, wp, req_pool_indices=xp.asarray(rpi), prefix_lens=xp.asarray(P),
                        extend_lens=xp.asarray(E), block_table=xp.asarray(bt), page_size=page, swa=swa)
            return vp, wp

        (rv, rw), (dv, dw) = _both(run)
        for f in kc.VerifyPlan.ENTRY_FIELDS + kc.VerifyPlan.SCALAR_FIELDS + ("offsets",):
            assert np.array_equal(_host(getattr(dv, f)), _host(getattr(rv, f))), (page, f)
        for f in ("offsets", "seed_slots", "num_rows", "input_errors"):
            assert np.array_equal(_host(getattr(dw, f)), _host(getattr(rw, f))), (page, f)
        assert int(_host(rv.input_errors)[0]) > 0, page


def test_skip_counters_match_reference(cp):
    """verifies_skipped, writes_skipped and tokens_skipped on both backends: a verify
    of a never-planned and of an overflowed plan, a write with a never-planned plan,
    and a write whose rows (one of them spanning several warps) park tokens on
    negative slots, some inside rows that are not live."""
    rng = np.random.default_rng(2)
    N = 4096
    table = np.zeros((5, 400), dtype=np.int64)
    table[1:] = (1 + rng.permutation(N - 1)[: 4 * 400]).reshape(4, 400)
    E = np.array([300, 5, 0, 77])
    loc = np.concatenate([table[r + 1, :E[r]] for r in range(4)])
    loc[rng.random(loc.shape[0]) < 0.3] = -1
    loc = np.concatenate([loc, [-1, -1, -3]])  # padding tokens past the last row
    ids = rng.integers(0, 1000, size=loc.shape[0])
    pos = np.concatenate([np.arange(e) for e in E] + [np.zeros(3, dtype=np.int64)])

    def run(device):
        xp = np if device == "cpu" else cp
        canary = kc.CanaryBuffer.allocate(num_slots=N, device=device)
        log = kc.ViolationLog.allocate(capacity=4096, device=device)  # every row kept: GPU order varies
        vp = kc.VerifyPlan.allocate(capacity=100, max_batch=4, device=device)
        wp = kc.WritePlan.allocate(max_batch=4, device=device)
        w = dict(input_ids=xp.asarray(ids), positions=xp.asarray(pos), out_cache_loc=xp.asarray(loc), log=log,
                 tag=kc.LaunchTag.WRITE)
        kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY)  # never planned
        kc.write(canary, wp, **w)  # never planned
        t = xp.asarray(table)
        kc.plan(vp, wp, req_pool_indices=xp.arange(1, 5), prefix_lens=xp.zeros(4, dtype=np.int64),
                extend_lens=xp.asarray(E), req_to_token=t)
        kc.write(canary, wp, **w)
        wp.seed_slots[3:4] = N + 1  # row 3 is no longer live: its skipped tokens do not count
        kc.write(canary, wp, **w)
        kc.plan(vp, wp, req_pool_indices=xp.arange(1, 5), prefix_lens=xp.asarray(E),
                extend_lens=xp.zeros(4, dtype=np.int64), req_to_token=t)  # 382 entries > 100: overflow
        kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY)
        return canary.host_records(), _rows(log), log.counters()

    (rr, rrows, rc), (dr, drows, dc) = _both(run)
    assert np.array_equal(dr, rr)
    assert drows == rrows
    assert dc == rc
    skipped = int((loc[: E.sum()] < 0).sum())
    assert rc["verifies_skipped"] == 2 and rc["writes_skipped"] == 1
    assert rc["tokens_skipped"] == 2 * skipped - int((loc[E[:3].sum(): E.sum()] < 0).sum())


def test_fingerprint_helper_matches_reference(cp):
    rng = np.random.default_rng(3)
    N = 300
    pools = [(rng.integers(0, 256, size=(L, N * b), dtype=np.uint8), b, r) for L, b, r in ((1, 32, 32), (3, 64, 48))]
    slots = rng.integers(0, N, size=257)
    for mode in (RealKvMode.PARTIAL, RealKvMode.ALL):
        ref = reference.fingerprints([kc.RealKvSource(p, 1, b, r, layer_axis=True) for p, b, r in pools], mode, slots)
        from kvcanary_cupy.backends import cuda  # noqa: PLC0415

        got = cuda.fingerprints([kc.RealKvSource(cp.asarray(p), 1, b, r, layer_axis=True) for p, b, r in pools],
                                mode, cp.asarray(slots))
        assert np.array_equal(got.get(), ref)


# --- measurements ------------------------------------------------------------------
_SPIN = r"""
extern "C" __global__ void kvc_spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < (unsigned long long)ns);
}
extern "C" __global__ void kvc_empty() {}
"""


def _host_us(cp, fn, spin, calls=300, reps=5):
    """Host microseconds per call, with the GPU held busy by a spin kernel so the
    launches only queue (the time is the host's, not the GPU's)."""
    fn()
    cp.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(reps):
        spin((1,), (1,), (np.int64(50_000_000),))
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        cp.cuda.Device().synchronize()
    return best


def test_host_overhead_per_op(cp, capsys):
    from kvcanary_cupy.backends import cuda  # noqa: PLC0415

    mod = cp.RawModule(code=_SPIN)
    spin, empty = mod.get_function("kvc_spin"), mod.get_function("kvc_empty")
    rng = np.random.default_rng(0)
    bs, N = 64, 8192
    table = cp.asarray(rng.permutation(np.arange(1, N)).astype(np.int64)[: 65 * 100].reshape(65, 100))
    rpi, pre, ext = cp.arange(1, bs + 1), cp.full(bs, 50), cp.ones(bs, dtype=cp.int64)
    canary = kc.CanaryBuffer.allocate(num_slots=N, device="cuda")
    log = kc.ViolationLog.allocate(capacity=1024, device="cuda")
    vp = kc.VerifyPlan.allocate(capacity=bs * 50, max_batch=bs, device="cuda")
    wp = kc.WritePlan.allocate(max_batch=bs, device="cuda")
    ids, pos, loc = cp.arange(bs), cp.full(bs, 50), table[1:, 50].copy()
    offs = cp.arange(bs + 1)
    et = cp.zeros((65, 100), dtype=cp.int64)
    NONE = RealKvMode.NONE
    s = cp.cuda.get_current_stream().ptr
    res = {
        "bare RawKernel launch": _host_us(cp, lambda: empty((1,), (32,), ()), spin),
        "backend.verify": _host_us(cp, lambda: cuda.verify(canary, vp, log=log, tag=1, sources=(), mode=NONE,
                                                           check_tokens=False, sample=None, stream=s), spin),
        "backend.write": _host_us(cp, lambda: cuda.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc,
                                                         log=log, tag=2, sources=(), mode=NONE, expected_tokens=None,
                                                         expected_positions=None, stream=s), spin),
        "backend.plan (2 kernels)": _host_us(cp, lambda: cuda.plan(vp, wp, req_pool_indices=rpi, prefix_lens=pre,
                                                                   extend_lens=ext, table=table, page_size=1, swa=None,
                                                                   expected=None, stream=s), spin, calls=200),
        "backend.scatter_expected_tokens": _host_us(cp, lambda: cuda.scatter_expected_tokens(
            et, tokens=ids, offsets=offs, req_pool_indices=rpi, stream=s), spin),
        "ops.verify": _host_us(cp, lambda: kc.verify(canary, vp, log=log, tag=1), spin),
        "ops.write": _host_us(cp, lambda: kc.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc,
                                                   log=log, tag=2), spin),
        "ops.plan": _host_us(cp, lambda: kc.plan(vp, wp, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext,
                                                 req_to_token=table), spin, calls=200),
    }
    bare = res["bare RawKernel launch"]
    with capsys.disabled():
        print("\nhost microseconds per call (GPU kept busy; best of 5 x 300 calls):")
        for k, v in res.items():
            print(f"  {k:34s} {v:7.2f} us  ({v / bare:4.2f}x bare)")
    assert res["backend.verify"] < 3 * bare + 5  # loose: catches a regression to per-call packing


def test_verify_throughput(cp, capsys):
    """Verify over >= 1M entries with real-KV ALL at 256 B/token: effective bandwidth
    (plan entries + records + KV bytes) against a device-to-device copy."""
    rng = np.random.default_rng(1)
    n, bpt = 1 << 20, 256
    N = n + 1
    slots = cp.asarray(rng.permutation(np.arange(1, N)))
    pool = cp.asarray(rng.integers(0, 256, size=(N * bpt,), dtype=np.uint8))
    src = kc.RealKvSource(pool, page_size=1, bytes_per_token=bpt)
    log = kc.ViolationLog.allocate(capacity=16, device="cuda")
    rows, per = 1024, n // 1024
    table = cp.zeros((rows + 1, per), dtype=cp.int64)
    table[1:] = slots.reshape(rows, per)
    vp = kc.VerifyPlan.allocate(capacity=n, max_batch=rows, device="cuda")
    wp = kc.WritePlan.allocate(max_batch=rows, device="cuda")
    rpi = cp.arange(1, rows + 1)
    kc.plan(vp, wp, req_pool_indices=rpi, prefix_lens=cp.zeros(rows, dtype=cp.int64),
            extend_lens=cp.full(rows, per), req_to_token=table)
    positions = cp.tile(cp.arange(per), rows)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()

    def timed(fn, reps=10):
        fn()
        ev0.record()
        for _ in range(reps):
            fn()
        ev1.record()
        ev1.synchronize()
        return cp.cuda.get_elapsed_time(ev0, ev1) / reps * 1e3  # us

    canaries, w_us = {}, {}
    for mode in (RealKvMode.NONE, RealKvMode.PARTIAL, RealKvMode.ALL):
        canaries[mode] = c = kc.CanaryBuffer.allocate(num_slots=N, device="cuda")
        w_us[mode] = timed(lambda: kc.write(c, wp, input_ids=positions, positions=positions,
                                            out_cache_loc=table[1:].ravel(), log=log, tag=2, real_kv=[src],
                                            real_kv_mode=mode), reps=3)
    kc.plan(vp, wp, req_pool_indices=rpi, prefix_lens=cp.full(rows, per), extend_lens=cp.zeros(rows, dtype=cp.int64),
            req_to_token=table)
    assert vp.host_scalars()["num_valid"] == n
    out = {}
    for mode in (RealKvMode.NONE, RealKvMode.PARTIAL, RealKvMode.ALL):
        kv = {RealKvMode.NONE: 0, RealKvMode.PARTIAL: 16, RealKvMode.ALL: bpt}[mode]
        us = timed(lambda: kc.verify(canaries[mode], vp, log=log, tag=1, real_kv=[src], real_kv_mode=mode))
        out[mode.name] = (us, n * (32 + 64 + kv) / us / 1e3)
    assert log.count == 0, log.read()[:3]  # every record verified clean
    copy_bytes = 512 << 20
    a, b = cp.empty(copy_bytes, dtype=cp.uint8), cp.empty(copy_bytes, dtype=cp.uint8)
    c_us = timed(lambda: b.__setitem__(slice(None), a))
    copy_gbs = 2 * copy_bytes / c_us / 1e3
    with capsys.disabled():
        print(f"\nverify over {n} entries (plan 32 B + 2 records 64 B + KV bytes per entry):")
        for k, (us, gbs) in out.items():
            print(f"  {k:8s} {us:9.1f} us  {gbs:8.1f} GB/s")
        print(f"  device-to-device copy: {copy_gbs:.1f} GB/s (read + write)")
        for k, us in w_us.items():
            print(f"  write of {n} tokens in {rows} rows, {k.name}: {us:.1f} us")
    assert log.counters()["slots_checked"] > 0
