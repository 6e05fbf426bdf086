"""``python -m bench.selfcheck``: two quick measurements on a GPU, each with a loose check.

Host microseconds per op, through the public API with buffers allocated once,
against a bare ``cupy.RawKernel`` launch; the GPU is held busy by a spin kernel
meanwhile, so the launches only queue and the time is the host's alone. Check:
``verify`` costs under 3x a bare launch + 5 us (catches per-call argument packing
coming back).

Verify over 1M entries with real KV NONE / PARTIAL / ALL at 256 B/token: its
effective bandwidth (plan entries + records + KV bytes) beside a device-to-device
copy, and the write of those 1M tokens in 1024 rows. Check: the records written
verify clean (no violation, slots checked).

Exit status 0 when both checks hold, 1 when one fails, 2 without a CUDA device.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

DESCRIPTION = ("Host time per op against a bare kernel launch, and verify bandwidth at 1M entries against a "
               "device-to-device copy, on one GPU; prints both and checks each loosely (exit 1 when a check "
               "fails).")


def _host_us(cp, fn, spin, calls: int, reps: int = 5) -> float:
    """Host microseconds per call of ``fn`` (best of ``reps`` x ``calls``), the GPU held busy by
    ``spin`` so the launches only queue."""
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


def host_overhead(cp, calls: int = 300) -> dict:
    """``{call: host us}`` of a bare launch and of plan / verify / write / scatter_expected_tokens."""
    import kvcanary_cupy as kc  # noqa: PLC0415

    from . import probes  # noqa: PLC0415

    mod = probes.module(cp)
    spin, empty = mod.get_function("kvc::bench_spin"), mod.get_function("kvc::bench_empty")
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
    return {
        "bare RawKernel launch": _host_us(cp, lambda: empty((1,), (32,), ()), spin, calls),
        "plan": _host_us(cp, lambda: kc.plan(vp, wp, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext,
                                             req_to_token=table), spin, max(1, calls * 2 // 3)),
        "verify": _host_us(cp, lambda: kc.verify(canary, vp, log=log, tag=1), spin, calls),
        "write": _host_us(cp, lambda: kc.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc,
                                               log=log, tag=2), spin, calls),
        "scatter_expected_tokens": _host_us(cp, lambda: kc.scatter_expected_tokens(
            et, tokens=ids, offsets=offs, req_pool_indices=rpi), spin, calls),
    }


def verify_throughput(cp) -> dict:
    """Verify over 1M entries per real-KV mode (us, GB/s), the copy bandwidth, the writes, the log's state."""
    import kvcanary_cupy as kc  # noqa: PLC0415
    from kvcanary_cupy import RealKvMode  # noqa: PLC0415

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

    modes = (RealKvMode.NONE, RealKvMode.PARTIAL, RealKvMode.ALL)
    canaries, w_us = {}, {}
    for mode in modes:
        canaries[mode] = c = kc.CanaryBuffer.allocate(num_slots=N, device="cuda")
        w_us[mode.name] = timed(lambda: kc.write(c, wp, input_ids=positions, positions=positions,
                                                 out_cache_loc=table[1:].ravel(), log=log, tag=2, real_kv=[src],
                                                 real_kv_mode=mode), reps=3)
    kc.plan(vp, wp, req_pool_indices=rpi, prefix_lens=cp.full(rows, per), extend_lens=cp.zeros(rows, dtype=cp.int64),
            req_to_token=table)
    planned = vp.host_scalars()["num_valid"]
    verify = {}
    for mode in modes:
        kv = {RealKvMode.NONE: 0, RealKvMode.PARTIAL: 16, RealKvMode.ALL: bpt}[mode]
        us = timed(lambda: kc.verify(canaries[mode], vp, log=log, tag=1, real_kv=[src], real_kv_mode=mode))
        verify[mode.name] = (us, n * (32 + 64 + kv) / us / 1e3)
    copy_bytes = 512 << 20
    a, b = cp.empty(copy_bytes, dtype=cp.uint8), cp.empty(copy_bytes, dtype=cp.uint8)
    c_us = timed(lambda: b.__setitem__(slice(None), a))
    return {"entries": n, "rows": rows, "planned": planned, "verify": verify, "write_us": w_us,
            "copy_gbs": 2 * copy_bytes / c_us / 1e3, "violations": log.count,
            "first_violations": log.read()[:3] if log.count else [],
            "slots_checked": int(log.counters()["slots_checked"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.selfcheck", description=DESCRIPTION)
    ap.add_argument("--calls", type=int, default=300, metavar="N",
                    help="calls per host-time sample (default %(default)s; best of 5 samples)")
    args = ap.parse_args(argv)
    if args.calls < 1:
        raise SystemExit(f"kvcanary: --calls: expected >= 1, got {args.calls}")
    from .platforms import NoCudaDevice, cuda_device_count  # noqa: PLC0415

    try:
        cuda_device_count()
    except NoCudaDevice as e:
        print(f"kvcanary: bench.selfcheck: {e}; these measurements need a GPU", file=sys.stderr)
        return 2
    import cupy as cp  # noqa: PLC0415

    failed = []
    host = host_overhead(cp, args.calls)
    bare = host["bare RawKernel launch"]
    print(f"host microseconds per call (GPU kept busy; best of 5 x {args.calls} calls):")
    for k, v in host.items():
        print(f"  {k:34s} {v:7.2f} us  ({v / bare:4.2f}x bare)")
    if not host["verify"] < 3 * bare + 5:
        failed.append(f"verify costs {host['verify']:.2f} us of host time, over 3x a bare launch + 5 us")

    t = verify_throughput(cp)
    print(f"verify over {t['entries']} entries (plan 32 B + 2 records 64 B + KV bytes per entry):")
    for k, (us, gbs) in t["verify"].items():
        print(f"  {k:8s} {us:9.1f} us  {gbs:8.1f} GB/s")
    print(f"  device-to-device copy: {t['copy_gbs']:.1f} GB/s (read + write)")
    for k, us in t["write_us"].items():
        print(f"  write of {t['entries']} tokens in {t['rows']} rows, {k}: {us:.1f} us")
    if t["planned"] != t["entries"]:
        failed.append(f"the verify plan holds {t['planned']} entries, expected {t['entries']}")
    if t["violations"]:
        failed.append(f"{t['violations']} violations on clean records, first: {t['first_violations']}")
    if not t["slots_checked"] > 0:
        failed.append("verify checked no slot")
    for f in failed:
        print(f"FAIL: {f}")
    print("selfcheck: " + ("FAIL" if failed else "PASS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
