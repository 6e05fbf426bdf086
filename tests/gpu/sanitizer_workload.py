"""Out-of-range data through every CUDA op, for ``compute-sanitizer --tool memcheck``.

Run by ``test_sanitizer.py`` (not collected itself). CuPy's memory pool is
turned off so every array is its own allocation and memcheck sees any access
past its end. Exits non-zero if the backend disagrees with the reference.
"""
from __future__ import annotations

import sys

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.backends import cuda, reference
from tests.gpu import (
    test_parity_fuzz as fz,  # run with the repository root on PYTHONPATH
)


def run(prepare, *args, **kwargs):
    """A backend's op, prepared and launched on the default stream (no ops-level checks:
    the cases here hand the kernels what validation would refuse)."""
    prepare(*args, stream=0, **kwargs)(0)


def extremes(sides):
    """Hand-made worst cases: empty batch, zero-width table, empty LUT, zero capacity,
    huge lengths and indices, corrupted plan scalars, spans past every input."""
    for dev, xp, be in sides:
        out = []
        vp = kc.VerifyPlan.allocate(capacity=0, max_batch=3, device=dev)
        wp = kc.WritePlan.allocate(max_batch=3, device=dev)
        e = xp.zeros(0, dtype=xp.int64)
        run(be.prepare_plan, vp, wp, req_pool_indices=e, prefix_lens=e, extend_lens=e, table=xp.zeros((2, 0), xp.int32),
                page_size=1, swa=None, expected=None)
        out.append((vp.host_scalars(), kc.runtime.to_host(wp.offsets).tolist()))
        big = 1 << 62
        rpi = xp.asarray([1, 1 << 40, -3, 2, 1])
        pre = xp.asarray([big, 1, 1, 3, 2])
        ext = xp.asarray([big, 1, 1, big, 1])
        vp = kc.VerifyPlan.allocate(capacity=4, max_batch=5, device=dev)
        wp = kc.WritePlan.allocate(max_batch=5, device=dev)
        lut = kc.SwaWindow(2, xp.full(1, -1, dtype=xp.int64))  # every LUT entry unreadable
        et = kc.ExpectedTokens(xp.zeros((0, 3), xp.int64), xp.asarray([9, 9, 9, 9, 9]), 1)
        table = xp.asarray([[0, 0, 0], [5, 6, 7], [1 << 61, 3, 4]])
        for swa, exp, page in ((None, None, 1), (lut, None, 1), (None, et, 1), (None, None, 4)):
            run(be.prepare_plan, vp, wp, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, table=table, page_size=page,
                    swa=swa, expected=exp)
            out.append((vp.host_scalars(), kc.runtime.to_host(wp.seed_slots).tolist()))
        canary = kc.CanaryBuffer.allocate(num_slots=8, device=dev)
        log = kc.ViolationLog.allocate(capacity=2, device=dev)
        wp.num_rows.fill(1 << 40)  # clamped to max_batch
        wp.offsets[:] = xp.asarray([-4, 0, 2, 3, 1 << 50, 1 << 60])
        wp.seed_slots[:] = xp.asarray([-1, 7, 8, -9, 3])
        tok = xp.asarray([1, 2, 3], dtype=xp.int32)
        run(be.prepare_write, canary, wp, input_ids=tok, positions=tok, out_cache_loc=xp.asarray([9, -1, 7]), log=log, tag=2,
                 sources=(), mode=kc.RealKvMode.NONE, expected_tokens=None, expected_positions=None)
        vp.num_valid.fill(1 << 40)
        vp.enable.fill(1)
        vp.slot_indices[:] = xp.asarray([8, -1, 3, 0])
        vp.prev_slot_indices[:] = xp.asarray([0, 9, -2, 5])
        pool = xp.zeros(8 * 16, dtype=xp.uint8)
        src = kc.RealKvSource(pool, page_size=1, bytes_per_token=16)
        samp = kc.FingerprintSampler.allocate(period=3, device=dev)
        run(be.prepare_verify, canary, vp, log=log, tag=1, sources=(src,), mode=kc.RealKvMode.ALL, check_tokens=True, sample=samp)
        out.append((log.count, log.counters(), canary.host_records().tolist(), kc.runtime.to_host(samp.state).tolist()))
        t = xp.zeros((3, 2), dtype=xp.int32)
        run(be.prepare_scatter, t, tokens=xp.arange(5), offsets=xp.asarray([0, 4, 9, -1, 2]),
                                   req_pool_indices=xp.asarray([1, 2, 7, 2]))
        out.append(kc.runtime.to_host(t).tolist())
        yield out


def main() -> int:
    import cupy  # noqa: PLC0415  (imported here: pytest's doctest collection imports this file)

    cupy.cuda.set_allocator(None)  # every array its own allocation: memcheck sees any overrun
    cupy.cuda.set_pinned_memory_allocator(None)
    ref, dev = list(extremes((("cpu", np, reference), ("cuda", cupy, cuda))))
    if ref != dev:
        print("extremes differ:\n", ref, "\n", dev)
        return 1
    fails = fz.run_fuzz(fz.cpu_side(), fz.cuda_side(), int(sys.argv[1]) if len(sys.argv) > 1 else 25, 77, 0.3)
    print("\n".join(fails))
    cupy.cuda.Device().synchronize()
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
