"""Host µs of KvCanary.before_forward + after_forward with bound buffers.

A decode step of 64 rows over a token-level table, real-KV ALL over one 256 B/token
source; the engine's per-step buffers are bound once, so a step pays no DLPack import.
Prints the median host time per step over many steps (the device is synchronized only
every 64 steps, so the queue never throttles the host), and beside it the same step's
ops called directly (plan_and_verify + write, the arguments built once) and the same
two ops prepared once (``kc.prepare``: the launches alone). The monitor's step over
the prepared ops is what the monitor itself costs.

    python -m bench.monitor_host_overhead                  (from the top of a checkout, on a GPU)
    python -m bench.monitor_host_overhead --request-ids    (each step names its requests)
    python -m bench.monitor_host_overhead --device cpu     (no GPU: the monitor's own Python)

``--device cpu`` runs the same step on the NumPy backend with every op's prepared launch
replaced by a no-op, at small sizes: what is left is the host work of the monitor and
of the ops' argument handling, the part a GPU's launches come on top of. Its figures are
this machine's Python, not an H200 host's.
"""
import argparse
import statistics
import sys
import time

import numpy as np

import kvcanary_cupy as kc

BATCH, PREFIX, SLOTS, BPT = 64, 1024, 1 << 20, 256


def _noop_launches() -> None:
    """Every op's prepared launch does nothing (validation and the memo are kept)."""
    from kvcanary_cupy import ops  # noqa: PLC0415

    class Noop:
        def __getattr__(self, name):
            if name.startswith("prepare_"):
                return lambda *a, **k: (lambda stream: None)
            raise AttributeError(name)
    ops.backend_for = lambda device: Noop()


def _timed(fns, steps: int, sync) -> list[list[int]]:
    """Host ns of each of ``fns`` per step, the calls interleaved so that both see the same
    machine (a busy host slows both alike, and their difference stays)."""
    samples = [[] for _ in fns]
    for i in range(steps):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t0)
        if i % 64 == 63:
            sync()
    sync()
    return [s[steps // 10:] for s in samples]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.monitor_host_overhead",
                                 description="Host time of the monitor's eager step with bound buffers, and of "
                                             "the same ops called directly.")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default): the real step; cpu: the NumPy backend with no-op launches (the "
                         "monitor's own Python)")
    ap.add_argument("--request-ids", action="store_true", help="each step names its batch rows' requests")
    ap.add_argument("--steps", type=int, default=2000, help="steps timed (default 2000)")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:
        _noop_launches()
        xp, slots, prefix, bpt = np, 1 << 14, 64, 32
        sync = lambda: None  # noqa: E731
    else:
        from .platforms import NoCudaDevice, cuda_device_count  # noqa: PLC0415

        try:
            cuda_device_count()
        except NoCudaDevice as e:
            print(f"kvcanary: bench.monitor_host_overhead: {e}; --device cuda (the default) needs CuPy and a CUDA "
                  "device: run with --device cpu for the monitor's own Python on the NumPy backend", file=sys.stderr)
            return 2
        import cupy as xp  # noqa: PLC0415

        slots, prefix, bpt = SLOTS, PREFIX, BPT
        sync = xp.cuda.get_current_stream().synchronize
    rng = np.random.default_rng(0)
    width = prefix + 64
    table = np.zeros((BATCH + 1, width), np.int32)
    table[1:] = rng.permutation(np.arange(1, slots))[: BATCH * width].reshape(BATCH, width)
    kv = xp.asarray(rng.integers(0, 255, (slots, bpt), dtype=np.uint8))
    sources = [kc.RealKvSource(kv, page_size=1, bytes_per_token=bpt)]
    mon = kc.KvCanary(num_slots=slots, req_to_token=xp.asarray(table), max_batch=BATCH, device=args.device,
                      real_kv=sources, real_kv_mode=kc.RealKvMode.ALL, policy=lambda found: None)
    rpi = xp.arange(1, BATCH + 1, dtype=xp.int64)
    pre, ext = xp.zeros(BATCH, xp.int64), xp.full(BATCH, prefix, xp.int64)
    ids = xp.asarray(rng.integers(0, 32000, BATCH * prefix))
    pos = xp.tile(xp.arange(prefix), BATCH)
    loc = xp.asarray(table[1:, :prefix].reshape(-1).astype(np.int64))
    mon.before_forward(rpi, pre, ext)  # prefill the prefixes once
    mon.after_forward(ids, pos, loc)

    d_ids, d_pos, d_loc = xp.zeros(BATCH, xp.int64), xp.zeros(BATCH, xp.int64), xp.zeros(BATCH, xp.int64)
    d_pre, d_ext = xp.full(BATCH, prefix, xp.int64), xp.ones(BATCH, xp.int64)
    d_loc[:] = xp.asarray(table[1:, prefix].astype(np.int64))
    d_pos[:] = prefix
    mon.bind_inputs(req_pool_indices=rpi, prefix_lens=d_pre, extend_lens=d_ext, input_ids=d_ids,
                    positions=d_pos, out_cache_loc=d_loc)
    names = [f"r{i}" for i in range(BATCH)] if args.request_ids else None

    def monitor_step():
        mon.before_forward(request_ids=names)
        mon.after_forward()

    # The same ops, called directly on buffers of their own (no request mapping, no stats).
    canary = kc.CanaryBuffer.allocate(num_slots=slots, device=args.device)
    vp = kc.VerifyPlan.allocate(capacity=mon.verify_plan.capacity, max_batch=BATCH, device=args.device)
    wp = kc.WritePlan.allocate(max_batch=BATCH, device=args.device)
    log = kc.ViolationLog.allocate(capacity=4096, device=args.device)
    t = mon.table
    mode = kc.RealKvMode.ALL
    kc.plan(None, wp, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, req_to_token=t)  # its prefixes too,
    kc.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc, log=log, tag=kc.LaunchTag.WRITE,
             real_kv=sources, real_kv_mode=mode)  # so its verify, like the monitor's, finds nothing

    def direct_step():
        kc.plan_and_verify(vp, wp, canary, req_pool_indices=rpi, prefix_lens=d_pre, extend_lens=d_ext,
                           req_to_token=t, log=log, tag=kc.LaunchTag.VERIFY, real_kv=sources, real_kv_mode=mode)
        kc.write(canary, wp, input_ids=d_ids, positions=d_pos, out_cache_loc=d_loc, log=log, tag=kc.LaunchTag.WRITE,
                 real_kv=sources, real_kv_mode=mode)

    prepared = [kc.prepare(kc.plan_and_verify, vp, wp, canary, req_pool_indices=rpi, prefix_lens=d_pre,
                           extend_lens=d_ext, req_to_token=t, log=log, tag=kc.LaunchTag.VERIFY, real_kv=sources,
                           real_kv_mode=mode),
                kc.prepare(kc.write, canary, wp, input_ids=d_ids, positions=d_pos, out_cache_loc=d_loc, log=log,
                           tag=kc.LaunchTag.WRITE, real_kv=sources, real_kv_mode=mode)]

    def prepared_step():
        for launch in prepared:
            launch()

    fns = (monitor_step, direct_step, prepared_step)
    for fn in fns:  # prepare every launch before timing
        for _ in range(50):
            fn()
    mon_ns, raw_ns, prep_ns = _timed(fns, args.steps, sync)
    us, raw, prep = (statistics.median(x) / 1e3 for x in (mon_ns, raw_ns, prep_ns))
    extra = statistics.median(m - p for m, p in zip(mon_ns, prep_ns)) / 1e3
    what = ("NumPy backend, no-op launches: the host's Python only" if cpu else
            f"decode batch {BATCH}, prefix {prefix}, real-KV ALL, bound buffers")
    print(f"monitor host overhead: before_forward + after_forward = {us:.1f} us per step "
          f"(median of {len(mon_ns)}; {what}{', request ids' if names else ''})")
    print(f"the same ops called directly (plan_and_verify + write): {raw:.1f} us per step; prepared once "
          f"(kc.prepare): {prep:.1f} us; the monitor adds {extra:.1f} us to the prepared ops "
          "(median of the step-by-step differences)")
    print("violations:", len(mon.poll()) + len(mon.poll()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
