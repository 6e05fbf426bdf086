"""Host µs of KvCanary.before_forward + after_forward with bound buffers (GPU).

A decode step of 64 rows over a token-level table, real-KV ALL over one 256 B/token
source; the engine's per-step buffers are bound once, so a step pays no DLPack import.
Prints the median host time per step over many steps (the device is synchronized only
every 64 steps, so the queue never throttles the host).

    python -m bench.monitor_host_overhead    (from the top of a checkout)
"""
import statistics
import time

import cupy as cp
import numpy as np

import kvcanary_cupy as kc

BATCH, PREFIX, SLOTS, BPT = 64, 1024, 1 << 20, 256


def main() -> None:
    rng = np.random.default_rng(0)
    width = PREFIX + 64
    table = np.zeros((BATCH + 1, width), np.int32)
    table[1:] = rng.permutation(np.arange(1, SLOTS))[: BATCH * width].reshape(BATCH, width)
    kv = cp.asarray(rng.integers(0, 255, (SLOTS, BPT), dtype=np.uint8))
    mon = kc.KvCanary(num_slots=SLOTS, req_to_token=cp.asarray(table), max_batch=BATCH, device="cuda",
                      real_kv=[kc.RealKvSource(kv, page_size=1, bytes_per_token=BPT)],
                      real_kv_mode=kc.RealKvMode.ALL, policy=lambda found: None)
    rpi = cp.arange(1, BATCH + 1, dtype=cp.int64)
    pre, ext = cp.zeros(BATCH, cp.int64), cp.full(BATCH, PREFIX, cp.int64)
    ids = cp.asarray(rng.integers(0, 32000, BATCH * PREFIX))
    pos = cp.tile(cp.arange(PREFIX), BATCH)
    loc = cp.asarray(table[1:, :PREFIX].reshape(-1).astype(np.int64))
    mon.before_forward(rpi, pre, ext)  # prefill the prefixes once
    mon.after_forward(ids, pos, loc)

    d_ids, d_pos, d_loc = cp.zeros(BATCH, cp.int64), cp.zeros(BATCH, cp.int64), cp.zeros(BATCH, cp.int64)
    d_pre, d_ext = cp.full(BATCH, PREFIX, cp.int64), cp.ones(BATCH, cp.int64)
    d_loc[:] = cp.asarray(table[1:, PREFIX].astype(np.int64))
    d_pos[:] = PREFIX
    mon.bind_inputs(req_pool_indices=rpi, prefix_lens=d_pre, extend_lens=d_ext, input_ids=d_ids,
                    positions=d_pos, out_cache_loc=d_loc)
    stream = cp.cuda.get_current_stream()
    samples = []
    for i in range(2000):
        t0 = time.perf_counter_ns()
        mon.before_forward()
        mon.after_forward()
        samples.append(time.perf_counter_ns() - t0)
        if i % 64 == 63:
            stream.synchronize()
    stream.synchronize()
    us = statistics.median(samples[200:]) / 1e3
    print(f"monitor host overhead: before_forward + after_forward = {us:.1f} us per step "
          f"(median of {len(samples) - 200}; decode batch {BATCH}, prefix {PREFIX}, real-KV ALL, bound buffers)")
    print("violations:", len(mon.poll()) + len(mon.poll()))


if __name__ == "__main__":
    main()
