"""Every public door refuses an inconsistent object; nothing is silently wrong.

Each case here was once accepted and handled wrongly (or raised something other
than a ``kvcanary:`` error). Runs on NumPy, and on CuPy where a GPU is visible.
"""
import re
import warnings

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.format import VIOLATION_WORDS
from kvcanary_cupy import runtime
from tests.workloads import host


def raises(exc, *names):
    """pytest.raises for a ``kvcanary:`` message that names every one of ``names``."""
    pattern = r"^kvcanary: " + "".join(f"(?=.*{re.escape(n)})" for n in names)
    return pytest.raises(exc, match=re.compile(pattern, re.S))


def vp_fields(xp, cap=8, mb=2):
    """The arrays of a consistent VerifyPlan, by keyword."""
    z = lambda n, v=0: xp.full((n,), v, dtype=xp.int64)  # noqa: E731
    return dict(slot_indices=z(cap, -1), prev_slot_indices=z(cap, -1), expected_positions=z(cap, -1),
                expected_tokens=z(cap, -1), offsets=z(mb + 1), num_valid=z(1), enable=z(1), requested=z(1),
                input_errors=z(1), overflows=z(1), max_requested=z(1))


# --- 1. every door checks -------------------------------------------------------------------
@pytest.mark.parametrize("door", ["constructor", "from_buffers"])
def test_verify_plan_refuses_a_short_field_through_every_door(xp, door):
    f = vp_fields(xp, cap=2048)
    f["prev_slot_indices"] = xp.full((16,), -1, dtype=xp.int64)  # the kernels would run past it
    make = kc.VerifyPlan if door == "constructor" else kc.VerifyPlan.from_buffers
    with raises(ValueError, "VerifyPlan", "prev_slot_indices", "16", "2048"):
        make(**f)


@pytest.mark.parametrize("door", ["constructor", "from_buffers"])
@pytest.mark.parametrize("a, b", [("num_valid", "enable"), ("slot_indices", "prev_slot_indices")])
def test_verify_plan_refuses_one_array_for_two_fields(xp, door, a, b):
    f = vp_fields(xp)
    f[b] = f[a]
    make = kc.VerifyPlan if door == "constructor" else kc.VerifyPlan.from_buffers
    with raises(ValueError, a, b, "share memory"):
        make(**f)


def test_overlap_is_found_by_address_not_identity(xp):
    backing = xp.zeros(20, dtype=xp.int64)
    f = vp_fields(xp)
    f["slot_indices"], f["prev_slot_indices"] = backing[0:8], backing[4:12]  # two views, one buffer
    with raises(ValueError, "slot_indices", "prev_slot_indices"):
        kc.VerifyPlan(**f)
    f["prev_slot_indices"] = backing[8:16]  # adjacent, not overlapping: fine
    assert kc.VerifyPlan(**f).capacity == 8
    ring = xp.zeros((5, VIOLATION_WORDS), dtype=xp.int64)
    with raises(ValueError, "ViolationLog", "ring", "head"):
        kc.ViolationLog(ring, ring[4, -1:], xp.zeros(6, dtype=xp.int64))
    w = xp.zeros(12, dtype=xp.int64)
    with raises(ValueError, "WritePlan", "offsets", "seed_slots"):
        kc.WritePlan(offsets=w[0:3], seed_slots=w[2:4], num_rows=w[5:6], input_errors=w[6:7],
                     position_check=w[7:8])


def test_write_plan_constructor_checks_like_from_buffers(xp):
    z = lambda n: xp.zeros((n,), dtype=xp.int64)  # noqa: E731
    with raises(ValueError, "WritePlan", "offsets", "expected 5"):
        kc.WritePlan(offsets=z(3), seed_slots=z(4), num_rows=z(1), input_errors=z(1), position_check=z(1))
    with raises(TypeError, "WritePlan.seed_slots", "int64"):
        kc.WritePlan(offsets=z(5), seed_slots=xp.zeros(4, dtype=xp.int32), num_rows=z(1), input_errors=z(1),
                     position_check=z(1))


def test_plans_refuse_strided_fields(xp):
    f = vp_fields(xp)
    f["expected_tokens"] = xp.zeros(16, dtype=xp.int64)[::2]  # the kernels index it as packed
    with raises(ValueError, "expected_tokens", "C-contiguous"):
        kc.VerifyPlan(**f)


def test_read_only_arrays_are_refused_where_the_library_writes():
    def ro(a):
        a.setflags(write=False)
        return a

    f = vp_fields(np)
    f["num_valid"] = ro(f["num_valid"])
    with raises(ValueError, "VerifyPlan.num_valid", "writable"):
        kc.VerifyPlan(**f)
    with raises(ValueError, "records", "writable"):
        kc.CanaryBuffer(ro(np.zeros((8, 4), np.int64)))
    with raises(ValueError, "ring", "writable"):
        kc.ViolationLog(ro(np.zeros((4, VIOLATION_WORDS), np.int64)), np.zeros(1, np.int64), np.zeros(6, np.int64))
    with raises(ValueError, "state", "writable"):
        kc.FingerprintSampler(3, ro(np.zeros(2, np.int64)))


def test_zero_d_arrays_are_a_kvcanary_error(xp):
    f = vp_fields(xp)
    f["slot_indices"] = xp.asarray(np.int64(3))
    with raises(ValueError, "slot_indices", "1-D"):
        kc.VerifyPlan.from_buffers(**f)


def test_a_plan_and_a_write_plan_sharing_memory_are_refused_at_the_call(xp):
    vp = kc.VerifyPlan.allocate(capacity=4, max_batch=2, device="cpu" if xp is np else "cuda")
    wp = kc.WritePlan.from_buffers(offsets=vp.offsets, seed_slots=xp.zeros(2, dtype=xp.int64),
                                   num_rows=xp.zeros(1, dtype=xp.int64))
    with raises(ValueError, "plan", "verify_plan.offsets", "write_plan.offsets"):
        kc.plan(vp, wp, req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([0]),
                extend_lens=xp.asarray([1]), req_to_token=xp.zeros((2, 4), dtype=xp.int32))


def test_a_log_inside_the_canary_is_refused_at_the_call(xp):
    records = xp.zeros((16, 4), dtype=xp.int64)
    canary = kc.CanaryBuffer(records)
    ring = records.reshape(-1)[8:8 + 3 * VIOLATION_WORDS].reshape(3, VIOLATION_WORDS)
    log = kc.ViolationLog(ring, xp.zeros(1, dtype=xp.int64),
                          xp.zeros(6, dtype=xp.int64))
    vp = kc.VerifyPlan.allocate(capacity=4, max_batch=1, device=canary.device)
    with raises(ValueError, "verify", "canary.records", "log.ring"):
        kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY)


# --- 3. no silent coercion ------------------------------------------------------------------
@pytest.mark.parametrize("call, name, exc", [
    (lambda: kc.CanaryBuffer.allocate(num_slots=2.9), "num_slots", TypeError),
    (lambda: kc.CanaryBuffer.allocate(num_slots=None), "num_slots", TypeError),
    (lambda: kc.CanaryBuffer.allocate(num_slots=True), "num_slots", TypeError),
    (lambda: kc.VerifyPlan.allocate(capacity="lots", max_batch=2), "capacity", TypeError),
    (lambda: kc.VerifyPlan.allocate(capacity=4, max_batch=2.0), "max_batch", TypeError),
    (lambda: kc.WritePlan.allocate(max_batch="2"), "max_batch", TypeError),
    (lambda: kc.ViolationLog.allocate(capacity=3.5), "capacity", TypeError),
    (lambda: kc.FingerprintSampler.allocate(period=1.5), "period", TypeError),
    (lambda: kc.SwaWindow(2.7, np.arange(4)), "SwaWindow.size", TypeError),
    (lambda: kc.ExpectedTokens(np.zeros((2, 4), np.int64), np.zeros(2, np.int64), offset=-3),
     "ExpectedTokens.offset", ValueError),
    (lambda: kc.ExpectedTokens(np.zeros((2, 4), np.int64), np.zeros(2, np.int64), offset=1.0),
     "ExpectedTokens.offset", TypeError),
    (lambda: kc.RealKvSource(np.zeros((8, 16), np.uint8), page_size=2.5, bytes_per_token=16), "page_size",
     TypeError),
    (lambda: kc.RealKvSource(np.zeros((8, 16), np.uint8), bytes_per_token=16.0), "bytes_per_token", TypeError),
    (lambda: kc.RealKvSource(np.zeros((2, 8, 16), np.uint8), bytes_per_token=16, layer_axis="yes"), "layer_axis",
     TypeError),
])
def test_sizes_take_integers_and_switches_take_bools(call, name, exc):
    with raises(exc, name):
        call()


def test_numpy_integers_are_sizes():
    assert kc.CanaryBuffer.allocate(num_slots=np.int32(5)).num_slots == 5
    assert kc.VerifyPlan.allocate(capacity=np.int64(3), max_batch=np.uint8(2)).capacity == 3
    assert kc.ExpectedTokens(np.zeros((2, 4), np.int64), np.zeros(2, np.int64), offset=np.int64(1)).offset == 1


class Step:
    """One request of three tokens in slots 1..3, stamped; ops keyword sets for the cases below."""

    def __init__(self, xp):
        dev = "cpu" if xp is np else "cuda"
        self.xp = xp
        self.canary = kc.CanaryBuffer.allocate(num_slots=16, device=dev)
        self.vp = kc.VerifyPlan.allocate(capacity=8, max_batch=2, device=dev)
        self.wp = kc.WritePlan.allocate(max_batch=2, device=dev)
        self.log = kc.ViolationLog.allocate(capacity=8, device=dev)
        self.table = xp.asarray(np.array([[0] * 4, [1, 2, 3, 4]], np.int32))
        self.rows = dict(req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([0]), extend_lens=xp.asarray([3]))
        kc.plan(self.vp, self.wp, req_to_token=self.table, **self.rows)
        self.inputs = dict(input_ids=xp.asarray([7, 8, 9]), positions=xp.asarray([0, 1, 2]),
                           out_cache_loc=xp.asarray([1, 2, 3]))
        kc.write(self.canary, self.wp, log=self.log, tag=kc.LaunchTag.WRITE, **self.inputs)

    def plan(self, **kw):
        kc.plan(self.vp, self.wp, **{"req_to_token": self.table, **self.rows, **kw})

    def verify(self, **kw):
        kc.verify(self.canary, self.vp, log=self.log, **{"tag": kc.LaunchTag.VERIFY, **kw})


@pytest.mark.parametrize("kw, name, exc", [
    (dict(block_table=True, page_size=2.5), "page_size", TypeError),
    (dict(block_table=True, page_size=True), "page_size", TypeError),
    (dict(block_table=True, page_size=2 ** 63), "page_size", ValueError),
    (dict(page_size=1.0), "page_size", TypeError),
])
def test_plan_page_size_is_an_integer(xp, kw, name, exc):
    s = Step(xp)
    if kw.pop("block_table", False):
        kw = dict(kw, block_table=s.table, req_to_token=None)
    with raises(exc, name):
        s.plan(**kw)


def test_plan_with_a_page_size_past_any_pool_is_refused_and_the_largest_is_data(xp):
    s = Step(xp)
    pages = xp.asarray(np.array([[0] * 4, [2, 3, 4, 5]], np.int32))
    with raises(ValueError, "page_size", "2**31"):  # 4 pages of 2**62 slots: no pool has such rows
        s.plan(block_table=pages, req_to_token=None, page_size=2 ** 62, prefix_lens=xp.asarray([1]))
    # 4 pages of 2**29 slots span 2**31 positions, the most a row may: a prefix past them is data
    s.plan(block_table=pages, req_to_token=None, page_size=2 ** 29, prefix_lens=xp.asarray([2 ** 31 + 1]))
    assert s.vp.host_scalars()["input_errors"] == 1


@pytest.mark.parametrize("bad", ["no", 1, None, np.float64(1.0)])
def test_check_tokens_takes_a_bool(xp, bad):
    s = Step(xp)
    s.plan()
    with raises(TypeError, "check_tokens"):
        s.verify(check_tokens=bad)


def test_a_bool_does_not_reuse_a_call_made_for_an_int(xp):
    s = Step(xp)
    s.plan()
    s.verify(tag=1)
    with raises(TypeError, "tag"):
        s.verify(tag=True)
    s.verify(check_tokens=False)
    with raises(TypeError, "check_tokens"):
        s.verify(check_tokens=0)


@pytest.mark.parametrize("mode", [True, 1.0, "ALL", 7])
def test_real_kv_mode_is_a_mode(xp, mode):
    s = Step(xp)
    s.plan()
    with raises(ValueError, "real_kv_mode"):
        s.verify(real_kv_mode=mode)


# --- 4. tags --------------------------------------------------------------------------------
@pytest.mark.parametrize("tag, exc", [(None, TypeError), ("VERIFY", TypeError), (2 ** 64, ValueError),
                                      (2 ** 63, ValueError), (-(2 ** 63) - 1, ValueError), (1.0, TypeError)])
def test_tags_are_checked_at_the_call(xp, tag, exc):
    s = Step(xp)
    s.plan()
    with raises(exc, "tag"):
        s.verify(tag=tag)
    with raises(exc, "tag"):
        kc.write(s.canary, s.wp, log=s.log, tag=tag, **s.inputs)
    assert s.log.count == 0


@pytest.mark.parametrize("bound, exc", [(True, TypeError), (1.0, TypeError), ("1", TypeError), (-1, ValueError)])
def test_a_write_row_bound_is_a_count(xp, bound, exc):
    s = Step(xp)
    s.plan()
    before = host(s.canary.records).copy()
    with raises(exc, "max_row_tokens"):
        kc.write(s.canary, s.wp, log=s.log, tag=kc.LaunchTag.WRITE, max_row_tokens=bound, **s.inputs)
    assert np.array_equal(host(s.canary.records), before) and s.log.count == 0


def test_a_write_row_bound_the_rows_break_stamps_the_same_records(xp):
    # Three tokens in one row under a bound of 1 (and of 0): a route choice, never other bytes.
    want = None
    for bound in (None, 1, 0, 3, 2 ** 63 - 1):  # the largest int64 bound is taken as it is
        s = Step(xp)
        s.canary.records[1:4] = 0
        s.plan()
        kc.write(s.canary, s.wp, log=s.log, tag=kc.LaunchTag.WRITE, max_row_tokens=bound, **s.inputs)
        got = host(s.canary.records).copy()
        assert s.log.count == 0 and s.log.counters()["slots_written"] == 6  # the Step's own write, then this
        assert got[1:4, :2].tolist() == [[7, 0], [8, 1], [9, 2]]
        if want is None:
            want = got
        assert np.array_equal(got, want), bound


def test_extreme_tags_round_trip(xp):
    s = Step(xp)
    s.plan(prefix_lens=xp.asarray([3]), extend_lens=xp.asarray([0]))
    s.canary.records[2, 0] = 99  # the successor's chain breaks
    for tag in (2 ** 63 - 1, -(2 ** 63), np.int64(-5)):
        s.verify(tag=tag)
    assert [v.tag for v in s.log.read()] == [2 ** 63 - 1, -(2 ** 63), -5]


# --- 5. work that does nothing shows --------------------------------------------------------
def test_never_planned_plans_are_counted(xp):
    s = Step(xp)
    dev = s.canary.device
    fresh_vp = kc.VerifyPlan.allocate(capacity=8, max_batch=2, device=dev)
    fresh_wp = kc.WritePlan.allocate(max_batch=2, device=dev)
    before = s.log.counters()
    kc.verify(s.canary, fresh_vp, log=s.log, tag=kc.LaunchTag.VERIFY)
    kc.write(s.canary, fresh_wp, log=s.log, tag=kc.LaunchTag.WRITE, **s.inputs)
    after = s.log.counters()
    assert after["verifies_skipped"] - before["verifies_skipped"] == 1
    assert after["writes_skipped"] - before["writes_skipped"] == 1
    assert after["slots_written"] == before["slots_written"]


def test_an_overflowing_or_empty_capacity_plan_counts_its_skipped_verify(xp):
    s = Step(xp)
    empty = kc.VerifyPlan.allocate(capacity=0, max_batch=2, device=s.canary.device)
    kc.plan(empty, None, req_to_token=s.table, req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([3]),
            extend_lens=xp.asarray([1]))
    s.canary.records[2, 0] = 99  # would be a violation, were anything verified
    kc.verify(s.canary, empty, log=s.log, tag=kc.LaunchTag.VERIFY)
    c = s.log.counters()
    assert c["verifies_skipped"] == 1 and c["slots_checked"] == 0 and s.log.count == 0
    assert empty.host_scalars()["requested"] == 3  # what the plan would have needed


def test_negative_out_cache_loc_is_counted(xp):
    s = Step(xp)
    s.rows = dict(req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([3]), extend_lens=xp.asarray([1]))
    s.plan()
    kc.write(s.canary, s.wp, log=s.log, tag=kc.LaunchTag.WRITE, input_ids=xp.asarray([5]),
             positions=xp.asarray([3]), out_cache_loc=xp.asarray([-1]))
    assert s.log.counters()["tokens_skipped"] == 1


# --- 6. validated once stays valid ----------------------------------------------------------
def set_dtype(a, dtype):
    """``a.dtype = dtype`` in place: deprecated in NumPy 2.5, so still possible for a caller."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            a.dtype = dtype
        except AttributeError:
            pytest.skip("this NumPy cannot change an array's dtype in place any more")


def test_changing_shape_in_place_is_validated_again():
    s = Step(np)
    s.plan()
    rpi = np.array([1, 1], dtype=np.int64)
    s.plan(req_pool_indices=rpi, prefix_lens=np.array([3, 3]), extend_lens=np.array([0, 0]))
    rpi.shape = (2, 1)
    with raises(ValueError, "req_pool_indices", "1-D"):
        s.plan(req_pool_indices=rpi, prefix_lens=np.array([3, 3]), extend_lens=np.array([0, 0]))


def test_changing_dtype_in_place_is_validated_again():
    s = Step(np)
    loc = np.array([4], dtype=np.int64)
    s.rows = dict(req_pool_indices=np.array([1]), prefix_lens=np.array([3]), extend_lens=np.array([1]))
    s.plan()
    args = dict(input_ids=np.array([5]), positions=np.array([3]), out_cache_loc=loc)
    kc.write(s.canary, s.wp, log=s.log, tag=kc.LaunchTag.WRITE, **args)
    set_dtype(loc, np.float64)
    with raises(TypeError, "out_cache_loc", "int"):
        kc.write(s.canary, s.wp, log=s.log, tag=kc.LaunchTag.WRITE, **args)
    table = s.table.copy()
    s.plan(req_to_token=table)
    set_dtype(table, np.float32)
    with raises(TypeError, "req_to_token"):
        s.plan(req_to_token=table)


# --- 11. stray exception types --------------------------------------------------------------
def test_a_bare_array_for_real_kv_says_what_to_pass(xp):
    s = Step(xp)
    s.plan()
    with raises(TypeError, "real_kv", "RealKvSource"):
        s.verify(real_kv=xp.zeros((16, 16), dtype=xp.uint8), real_kv_mode=kc.RealKvMode.ALL)
    with raises(TypeError, "real_kv", "RealKvSource"):
        kc.KvCanary(num_slots=16, req_to_token=s.table, max_batch=1, device=s.canary.device,
                    real_kv=xp.zeros((16, 16), dtype=xp.uint8))


def test_cuda_without_cupy_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ModuleNotFoundError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    for call in (lambda: kc.CanaryBuffer.allocate(num_slots=4, device="cuda"),
                 lambda: kc.KvCanary(num_slots=4, req_to_token=np.zeros((2, 2), np.int32), max_batch=1,
                                     device="cuda:0")):
        with raises(ValueError, "device", "cuda13", "device='cpu'"):
            call()


def test_cuda_without_a_working_device_says_what_to_pass(monkeypatch):
    import sys
    import types

    class CUDARuntimeError(RuntimeError):
        pass

    def no_device():
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    cuda_rt = types.SimpleNamespace(getDeviceCount=no_device, getDevice=no_device)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=cuda_rt))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with raises(ValueError, "device", "cudaErrorNoDevice", "device='cpu'"):
        runtime.parse_device("cuda")
    cuda_rt.getDeviceCount = lambda: 1
    with raises(ValueError, "device", "cuda:3", "1 CUDA device"):
        runtime.parse_device("cuda:3")


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:-1", 3])
def test_device_strings_are_checked(device):
    with raises(ValueError, "device"):
        kc.CanaryBuffer.allocate(num_slots=4, device=device)
