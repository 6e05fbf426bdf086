"""Work that silently does nothing shows in the log's counters, and the reference plan
stays bounded in memory whatever a batch asks for.

Counters, counted on the device without a host sync:
    verifies_skipped: verify runs whose plan is not enabled (it overflowed its
        capacity, or was never planned);
    writes_skipped: write runs whose write plan was never planned (num_rows < 0);
    tokens_skipped: tokens of live write rows parked on a negative out_cache_loc.
Every test takes the ``xp`` / ``device`` fixtures, so the same known answers are
checked on the CUDA backend where a GPU is visible.
"""
import tracemalloc

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from tests.workloads import Env, host

N = 64
ROW1 = [5, 9, 2, 30, 17, 8, 40, 41, 3, 22, 60, 33, 12, 13, 14, 15]
ROW2 = [50, 51, 52, 7, 6, 4, 19, 20, 21, 23, 24, 25, 26, 27, 28, 29]
TABLE = np.array([[0] * 16, ROW1, ROW2], dtype=np.int64)
ZERO = dict(kernel_runs=0, slots_checked=0, slots_written=0, verifies_skipped=0, writes_skipped=0, tokens_skipped=0)


def counters(**changed):
    return {**ZERO, **changed}


def test_counter_names_in_order():
    log = kc.ViolationLog.allocate(capacity=4)
    assert list(log.counters()) == ["kernel_runs", "slots_checked", "slots_written", "verifies_skipped",
                                    "writes_skipped", "tokens_skipped"]
    assert log.counters() == ZERO


def test_verify_of_a_plan_that_is_not_enabled_is_counted(xp, device):
    e = Env(xp, device, capacity=4, table=TABLE)
    e.verify()  # never planned
    assert e.log.counters() == counters(kernel_runs=1, verifies_skipped=1)
    e.plan([1], [0], [4])
    e.write([7, 8, 9, 10], [0, 1, 2, 3], ROW1[:4])
    e.plan([1, 2], [4, 1], [0, 0])  # 5 entries > capacity 4: overflow
    assert e.scalars()["enable"] == 0
    e.verify()
    assert e.log.counters() == counters(kernel_runs=3, slots_written=4, verifies_skipped=2)
    e.plan([1], [4], [0])
    e.verify()
    assert e.log.counters() == counters(kernel_runs=4, slots_checked=4, slots_written=4, verifies_skipped=2)
    assert e.log.count == 0
    e.vp.enable.fill(7)  # anything but 1 disables
    e.verify()
    assert e.log.counters()["verifies_skipped"] == 3 and e.log.count == 0


def test_sampled_verify_of_a_disabled_plan_is_counted(xp, device):
    e = Env(xp, device, capacity=4, table=TABLE)
    sampler = kc.FingerprintSampler.allocate(period=3, device=device)
    pool = xp.zeros((N, 16), dtype=np.uint8)
    e.verify(real_kv=kc.RealKvSource(pool, bytes_per_token=16), real_kv_mode=kc.RealKvMode.ALL, sample=sampler)
    assert e.log.counters() == counters(kernel_runs=1, verifies_skipped=1)
    assert sampler.phase() == 1  # the phase still advances


def test_write_with_a_never_planned_plan_is_counted(xp, device):
    e = Env(xp, device, table=TABLE)
    assert int(host(e.wp.num_rows)[0]) == -1  # a new write plan was never planned
    e.write([7, 8], [0, 1], ROW1[:2])
    assert e.log.counters() == counters(kernel_runs=1, writes_skipped=1)
    assert (e.records() == 0).all() and e.log.count == 0
    e.plan([1], [0], [2])
    e.wp.num_rows.fill(-1)  # as never planned
    e.write([7, 8], [0, 1], ROW1[:2])
    assert e.log.counters() == counters(kernel_runs=2, writes_skipped=2)
    assert (e.records() == 0).all()
    e.plan([1], [0], [2])
    e.write([7, 8], [0, 1], ROW1[:2])
    assert e.log.counters() == counters(kernel_runs=3, slots_written=2, writes_skipped=2)
    e.plan([1], [0], [2], verify_plan=False)
    e.wp.num_rows.fill(0)  # an empty batch was planned: nothing to write, nothing skipped
    e.write([7, 8], [0, 1], ROW1[:2])
    assert e.log.counters() == counters(kernel_runs=4, slots_written=2, writes_skipped=2)


def test_tokens_on_negative_slots_of_live_rows_are_counted(xp, device):
    e = Env(xp, device, table=TABLE)
    e.plan([1, 2, 0], [0, 0, 0], [3, 2, 5])
    ids, pos = [1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 0, 1, 0, 0]
    loc = [ROW1[0], -1, -7, -1, ROW2[1], -1, -1]  # the last two belong to no row (padding)
    e.write(ids, pos, loc)
    assert e.log.counters() == counters(kernel_runs=1, slots_written=2, tokens_skipped=3)
    e.wp.seed_slots[1:2] = N + 5  # row 1 is not live now (its seed is out of range)
    e.write(ids, pos, loc)
    assert e.log.counters() == counters(kernel_runs=2, slots_written=3, tokens_skipped=5)
    assert [(v.batch_row, v.reasons) for v in e.log.read()] == [(1, F.SLOT_OUT_OF_RANGE)]


def test_plan_memory_stays_bounded_when_the_batch_overflows():
    """256 rows x 131072 positions against a capacity of 1024: the plan decides
    validity and counts in bounded chunks and builds no entry, so its peak memory does
    not grow with the 33554432 entries the batch asks for."""
    bs, n = 256, 131072
    table = np.arange(1, (bs + 1) * n + 1, dtype=np.int32).reshape(bs + 1, n)
    vp = kc.VerifyPlan.allocate(capacity=1024, max_batch=bs)
    wp = kc.WritePlan.allocate(max_batch=bs)
    rp = np.arange(1, bs + 1, dtype=np.int64)
    P = np.full(bs, n, dtype=np.int64)
    E = np.zeros(bs, dtype=np.int64)
    tracemalloc.start()
    try:
        kc.plan(vp, wp, req_pool_indices=rp, prefix_lens=P, extend_lens=E, req_to_token=table)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert vp.host_scalars() == dict(num_valid=1024, enable=0, requested=33554432, input_errors=0, overflows=1,
                                     max_requested=33554432)
    assert vp.offsets.tolist() == [n * r for r in range(bs + 1)]
    assert (vp.slot_indices == -1).all()  # overflowed: no entry written
    assert wp.seed_slots.tolist() == [-1] * bs and int(wp.num_rows[0]) == bs


def test_plan_of_one_long_row_fills_entries_in_chunks():
    """One row longer than a chunk, with a window and a LUT: every entry as the table says."""
    n = 600_000
    rng = np.random.default_rng(3)
    table = np.zeros((2, n + 1), dtype=np.int64)
    table[1] = 1 + rng.permutation(n + 1)
    lut = np.arange(n + 2, dtype=np.int64)[::-1].copy()
    vp = kc.VerifyPlan.allocate(capacity=n, max_batch=2)
    wp = kc.WritePlan.allocate(max_batch=2)
    kc.plan(vp, wp, req_pool_indices=np.array([1, 0]), prefix_lens=np.array([n, 0]), extend_lens=np.array([1, 0]),
            req_to_token=table, swa=kc.SwaWindow(n - 5, lut))
    assert vp.host_scalars() == dict(num_valid=n - 5, enable=1, requested=n - 5, input_errors=0, overflows=0,
                                     max_requested=n - 5)
    slots = lut[table[1, :n]]
    ent = vp.host_entries()
    assert np.array_equal(ent["slot_indices"], slots[5:])
    assert np.array_equal(ent["prev_slot_indices"], slots[4:-1])
    assert np.array_equal(ent["expected_positions"], np.arange(5, n))
    assert wp.seed_slots.tolist() == [slots[-1], kc.SEED_SKIP]  # row 1 is padding
