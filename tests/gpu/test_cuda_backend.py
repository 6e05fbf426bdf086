"""The CUDA backend at sizes the fuzz does not reach.

Parity against the NumPy reference for: a batch wider than one block's scan
(multi-pass row scan), a 16K-token prefill row with 256 B/token of real KV over
several layered sources (the fingerprints must be spread over the grid), page
arithmetic past int64 and the skip counters. Host time per op and verify
throughput are measured by ``python -m bench.selfcheck``.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvMode

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
        (1 << 30, [[0, 0], [1, 0], [2, 0], [0, 1]]),  # 2 pages of 2**30: the widest row a table may have
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
        for f in kc.VerifyPlan.SCALAR_FIELDS + ("offsets",):
            assert np.array_equal(_host(getattr(dv, f)), _host(getattr(rv, f))), (page, f)
        n = int(_host(rv.num_valid)[0])  # the entries are defined up to num_valid
        for f in kc.VerifyPlan.ENTRY_FIELDS:
            assert np.array_equal(_host(getattr(dv, f))[:n], _host(getattr(rv, f))[:n]), (page, f)
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
