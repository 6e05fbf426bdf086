"""The library's objects own their capacities; host-side misuse raises ``kvcanary:`` errors.

Each misuse raises ValueError / TypeError whose message starts with ``kvcanary:``
and names the argument at fault.
"""
import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.format import VIOLATION_WORDS
from kvcanary_cupy import RealKvMode
from tests.workloads import arr, host

TABLE = np.arange(48, dtype=np.int64).reshape(3, 16)
TABLE[0] = 0


def raises(exc, *names):
    """pytest.raises for a ``kvcanary:`` message that names every one of ``names``."""
    pattern = r"^kvcanary: " + "".join(f"(?=.*{re.escape(n)})" for n in names)
    return pytest.raises(exc, match=re.compile(pattern, re.S))


# --- allocation --------------------------------------------------------------------------
def test_allocate_owns_its_arrays(xp, device):
    vp = kc.VerifyPlan.allocate(capacity=10, max_batch=3, device=device)
    assert (vp.capacity, vp.max_batch) == (10, 3)
    assert vp.device.startswith(device)
    for f in kc.VerifyPlan.ENTRY_FIELDS:
        a = getattr(vp, f)
        assert a.shape == (10,) and a.dtype == np.int64 and isinstance(a, xp.ndarray)
    assert vp.offsets.shape == (4,)
    for f in kc.VerifyPlan.SCALAR_FIELDS:
        assert getattr(vp, f).shape == (1,)
    assert vp.host_scalars() == dict(num_valid=0, enable=0, requested=0, input_errors=0, overflows=0, max_requested=0)
    wp = kc.WritePlan.allocate(max_batch=3, device=device)
    assert wp.max_batch == 3 and wp.offsets.shape == (4,) and host(wp.seed_slots).tolist() == [-1] * 3
    assert int(host(wp.position_check)[0]) == 1 and int(host(wp.num_rows)[0]) == -1  # never planned
    log = kc.ViolationLog.allocate(capacity=5, device=device)
    assert log.capacity == 5 and log.ring.shape == (5, VIOLATION_WORDS) and log.count == 0
    assert log.counters() == dict(kernel_runs=0, slots_checked=0, slots_written=0, verifies_skipped=0,
                                  writes_skipped=0, tokens_skipped=0)
    canary = kc.CanaryBuffer.allocate(num_slots=9, device=device)
    assert canary.num_slots == 9 and canary.records.shape == (9, 4) and (host(canary.records) == 0).all()
    sampler = kc.FingerprintSampler.allocate(period=3, device=device)
    assert host(sampler.state).tolist() == [0, 0] and sampler.phase() == 0


@pytest.mark.parametrize("make, name", [
    (lambda d: kc.VerifyPlan.allocate(capacity=-1, max_batch=2, device=d), "capacity"),
    (lambda d: kc.VerifyPlan.allocate(capacity=4, max_batch=0, device=d), "max_batch"),
    (lambda d: kc.WritePlan.allocate(max_batch=0, device=d), "max_batch"),
    (lambda d: kc.ViolationLog.allocate(capacity=0, device=d), "capacity"),
    (lambda d: kc.CanaryBuffer.allocate(num_slots=0, device=d), "num_slots"),
    (lambda d: kc.FingerprintSampler.allocate(period=0, device=d), "period"),
    (lambda d: kc.VerifyPlan.allocate(capacity=4, max_batch=2, device="tpu"), "device"),
])
def test_allocate_rejects_bad_sizes(device, make, name):
    with raises(ValueError, name):
        make(device)


def test_option_objects_reject_misuse(xp):
    with raises(ValueError, "SwaWindow.size"):
        kc.SwaWindow(0, arr(xp, [0, 1]))
    with raises(TypeError, "SwaWindow.lut"):
        kc.SwaWindow(4, arr(xp, [0.0, 1.0], np.float32))
    with raises(ValueError, "ExpectedTokens.table"):
        kc.ExpectedTokens(arr(xp, [1, 2]), arr(xp, [1]))
    with raises(ValueError, "ExpectedTokens.valid_lens"):
        kc.ExpectedTokens(arr(xp, [[1, 2]]), arr(xp, [[1]]))
    with raises(ValueError, "records"):
        kc.CanaryBuffer(arr(xp, np.zeros((4, 3))))
    kv = xp.zeros((8, 32), dtype=xp.uint8)
    with raises(ValueError, "bytes_per_token"):
        kc.RealKvSource(kv, bytes_per_token=24)
    with raises(ValueError, "bytes_per_token"):
        kc.RealKvSource(kv)
    with raises(ValueError, "read_bytes"):
        kc.RealKvSource(kv, bytes_per_token=32, read_bytes=48)
    with raises(ValueError, "page_size"):
        kc.RealKvSource(kv, page_size=0, bytes_per_token=32)
    with raises(ValueError, "tensor"):
        kc.RealKvSource(xp.zeros((3, 32), dtype=xp.uint8), page_size=2, bytes_per_token=32)
    with raises(ValueError, "tensor"):
        kc.RealKvSource(kv[:, :16], bytes_per_token=16)  # not contiguous


# --- from_buffers ------------------------------------------------------------------------
def _vp_buffers(xp, cap=6, mb=3, **override):
    b = {f: xp.full(cap, -1, dtype=xp.int64) for f in kc.VerifyPlan.ENTRY_FIELDS}
    b["offsets"] = xp.zeros(mb + 1, dtype=xp.int64)
    b.update({f: xp.zeros(1, dtype=xp.int64) for f in kc.VerifyPlan.SCALAR_FIELDS})
    b.update(override)
    return b


def test_verify_plan_from_buffers_is_zero_copy(xp, device):
    bufs = _vp_buffers(xp)
    vp = kc.VerifyPlan.from_buffers(**bufs)
    assert (vp.capacity, vp.max_batch) == (6, 3)
    kc.plan(vp, None, req_pool_indices=arr(xp, [1, 2]), prefix_lens=arr(xp, [2, 3]), extend_lens=arr(xp, [1, 0]),
            req_to_token=arr(xp, TABLE))
    assert host(bufs["slot_indices"])[:5].tolist() == [16, 17, 32, 33, 34]  # landed in the caller's arrays
    assert host(bufs["offsets"]).tolist() == [0, 2, 5, 5]
    assert int(host(bufs["num_valid"])[0]) == 5 and int(host(bufs["enable"])[0]) == 1


def test_verify_plan_from_buffers_names_every_disagreeing_field(xp):
    bufs = _vp_buffers(xp, cap=8, expected_positions=xp.zeros(7, dtype=xp.int64),
                       expected_tokens=xp.zeros(9, dtype=xp.int64), num_valid=xp.zeros(2, dtype=xp.int64),
                       input_errors=xp.zeros(0, dtype=xp.int64))
    with pytest.raises(ValueError) as ei:
        kc.VerifyPlan.from_buffers(**bufs)
    msg = str(ei.value)
    assert msg.startswith("kvcanary: VerifyPlan")
    for part in ("expected_positions has length 7, expected 8", "expected_tokens has length 9, expected 8",
                 "num_valid has length 2, expected 1", "input_errors has length 0, expected 1"):
        assert part in msg, msg
    for ok in ("prev_slot_indices", "enable", "requested"):
        assert ok not in msg
    with raises(ValueError, "offsets", "max_batch"):
        kc.VerifyPlan.from_buffers(**_vp_buffers(xp, offsets=xp.zeros(1, dtype=xp.int64)))
    with raises(TypeError, "VerifyPlan.prev_slot_indices", "int64"):
        kc.VerifyPlan.from_buffers(**_vp_buffers(xp, prev_slot_indices=xp.zeros(6, dtype=xp.int32)))
    with raises(ValueError, "VerifyPlan.enable", "1-D"):
        kc.VerifyPlan.from_buffers(**_vp_buffers(xp, enable=xp.zeros((1, 1), dtype=xp.int64)))


def test_write_plan_from_buffers(xp, device):
    offs, seeds, nrows = xp.zeros(4, dtype=xp.int64), xp.zeros(3, dtype=xp.int64), xp.zeros(1, dtype=xp.int64)
    wp = kc.WritePlan.from_buffers(offsets=offs, seed_slots=seeds, num_rows=nrows)
    assert wp.max_batch == 3
    assert int(host(wp.position_check)[0]) == 1 and int(host(wp.input_errors)[0]) == 0  # allocated beside
    kc.plan(None, wp, req_pool_indices=arr(xp, [2, 1]), prefix_lens=arr(xp, [3, 0]), extend_lens=arr(xp, [2, 4]),
            req_to_token=arr(xp, TABLE))
    assert host(offs).tolist() == [0, 2, 6, 6] and host(seeds).tolist() == [34, -1, -1]
    assert int(host(nrows)[0]) == 2
    with pytest.raises(ValueError) as ei:
        kc.WritePlan.from_buffers(offsets=xp.zeros(4, dtype=xp.int64), seed_slots=xp.zeros(4, dtype=xp.int64),
                                  num_rows=xp.zeros(2, dtype=xp.int64), position_check=xp.zeros(3, dtype=xp.int64))
    msg = str(ei.value)
    assert msg.startswith("kvcanary: WritePlan")
    for part in ("offsets has length 4, expected 5", "num_rows has length 2, expected 1",
                 "position_check has length 3, expected 1"):
        assert part in msg, msg
    with raises(ValueError, "seed_slots", "max_batch"):
        kc.WritePlan.from_buffers(offsets=xp.zeros(1, dtype=xp.int64), seed_slots=xp.zeros(0, dtype=xp.int64),
                                  num_rows=xp.zeros(1, dtype=xp.int64))


# --- no capacity arguments --------------------------------------------------------------------
@pytest.mark.parametrize("kw", ["capacity", "verify_capacity"])
def test_ops_reject_capacity_keywords(xp, device, kw):
    vp = kc.VerifyPlan.allocate(capacity=8, max_batch=2, device=device)
    wp = kc.WritePlan.allocate(max_batch=2, device=device)
    canary = kc.CanaryBuffer.allocate(num_slots=8, device=device)
    log = kc.ViolationLog.allocate(capacity=4, device=device)
    one = arr(xp, [1])
    with raises(TypeError, f"plan() takes no {kw}", "allocate the plan"):
        kc.plan(vp, wp, req_pool_indices=one, prefix_lens=one, extend_lens=one, req_to_token=arr(xp, TABLE),
                **{kw: 8})
    with raises(TypeError, f"verify() takes no {kw}"):
        kc.verify(canary, vp, log=log, tag=1, **{kw: 8})
    with raises(TypeError, f"write() takes no {kw}"):
        kc.write(canary, wp, input_ids=one, positions=one, out_cache_loc=one, log=log, tag=1, **{kw: 8})
    with raises(TypeError, "plan()", "unexpected keyword argument 'tabel'"):
        kc.plan(vp, wp, req_pool_indices=one, prefix_lens=one, extend_lens=one, req_to_token=arr(xp, TABLE), tabel=1)


# --- misuse of the ops -------------------------------------------------------------------------
class Objs:
    def __init__(self, xp, device, num_slots=48, max_batch=2):
        self.xp = xp
        self.vp = kc.VerifyPlan.allocate(capacity=64, max_batch=max_batch, device=device)
        self.wp = kc.WritePlan.allocate(max_batch=max_batch, device=device)
        self.canary = kc.CanaryBuffer.allocate(num_slots=num_slots, device=device)
        self.log = kc.ViolationLog.allocate(capacity=8, device=device)

    def plan(self, **kw):
        xp = self.xp
        a = dict(req_pool_indices=arr(xp, [1, 2]), prefix_lens=arr(xp, [2, 3]), extend_lens=arr(xp, [1, 1]),
                 req_to_token=arr(xp, TABLE))
        vp, wp = kw.pop("vp", self.vp), kw.pop("wp", self.wp)
        a.update(kw)
        a = {k: v for k, v in a.items() if v is not None}
        kc.plan(vp, wp, **a)

    def write(self, **kw):
        xp = self.xp
        a = dict(input_ids=arr(xp, [5, 6]), positions=arr(xp, [2, 3]), out_cache_loc=arr(xp, [18, 35]), log=self.log,
                 tag=2)
        canary, wp = kw.pop("canary", self.canary), kw.pop("wp", self.wp)
        a.update(kw)
        kc.write(canary, wp, **a)

    def verify(self, **kw):
        a = dict(log=self.log, tag=1)
        canary, vp = kw.pop("canary", self.canary), kw.pop("vp", self.vp)
        a.update(kw)
        kc.verify(canary, vp, **a)


def test_the_happy_path_of_the_misuse_fixture(xp, device):
    o = Objs(xp, device)
    o.plan()
    o.verify()
    o.write()
    assert o.log.counters()["kernel_runs"] == 2


@pytest.mark.parametrize("name, bad", [
    ("req_pool_indices", lambda xp: arr(xp, [1.0, 2.0], np.float32)),
    ("prefix_lens", lambda xp: arr(xp, [2, 3], np.int16)),
    ("extend_lens", lambda xp: arr(xp, [1, 1], np.uint64)),
    ("req_to_token", lambda xp: arr(xp, TABLE, np.float64)),
])
def test_plan_wrong_dtype(xp, device, name, bad):
    with raises(TypeError, name, "int32 or int64"):
        Objs(xp, device).plan(**{name: bad(xp)})


@pytest.mark.parametrize("name, bad, what", [
    ("prefix_lens", lambda xp: arr(xp, [[2, 3]]), "1-D"),
    ("req_pool_indices", lambda xp: arr(xp, [[1], [2]]), "1-D"),
    ("req_to_token", lambda xp: arr(xp, TABLE[1]), "2-D"),
    ("extend_lens", lambda xp: arr(xp, [1, 1, 1, 1])[::2], "C-contiguous"),
    ("req_to_token", lambda xp: arr(xp, np.zeros((16, 3))).T, "C-contiguous"),
    ("prefix_lens", lambda xp: arr(xp, [2]), "length >= 2"),
])
def test_plan_shape_and_layout(xp, device, name, bad, what):
    with raises(ValueError, name, what):
        Objs(xp, device).plan(**{name: bad(xp)})


def test_plan_table_arguments(xp, device):
    o = Objs(xp, device)
    with raises(ValueError, "req_to_token", "block_table"):
        o.plan(req_to_token=None)
    with raises(ValueError, "req_to_token", "block_table"):
        o.plan(block_table=arr(xp, TABLE), page_size=1)
    with raises(ValueError, "page_size", "block_table"):
        o.plan(page_size=16)
    with raises(ValueError, "page_size"):
        o.plan(req_to_token=None, block_table=arr(xp, TABLE))
    with raises(ValueError, "page_size"):
        o.plan(req_to_token=None, block_table=arr(xp, TABLE), page_size=0)
    with raises(ValueError, "verify_plan", "write_plan"):
        o.plan(vp=None, wp=None)
    with raises(TypeError, "verify_plan", "VerifyPlan"):
        o.plan(vp=o.wp)
    with raises(TypeError, "write_plan", "WritePlan"):
        o.plan(wp=o.vp)
    with raises(TypeError, "swa", "SwaWindow"):
        o.plan(swa=4)
    with raises(TypeError, "expected", "ExpectedTokens"):
        o.plan(expected=arr(xp, TABLE))
    exp = kc.ExpectedTokens(arr(xp, TABLE), arr(xp, [3, 3]))
    with raises(ValueError, "expected", "verify_plan"):
        o.plan(vp=None, expected=exp)
    with raises(ValueError, "expected.valid_lens", "length >= 2"):
        o.plan(expected=kc.ExpectedTokens(arr(xp, TABLE), arr(xp, [3])))


def test_plan_batch_larger_than_max_batch(xp, device):
    o = Objs(xp, device, max_batch=2)
    three = arr(xp, [1, 2, 0])
    with raises(ValueError, "req_pool_indices", "3 rows", "verify_plan.max_batch = 2"):
        o.plan(req_pool_indices=three, prefix_lens=three, extend_lens=three)
    wide = kc.VerifyPlan.allocate(capacity=8, max_batch=4, device=device)
    with raises(ValueError, "req_pool_indices", "write_plan.max_batch = 2"):
        o.plan(vp=wide, req_pool_indices=three, prefix_lens=three, extend_lens=three)


@pytest.mark.parametrize("name, bad, exc, what", [
    ("input_ids", lambda xp: arr(xp, [5, 6], np.int16), TypeError, "int32 or int64"),
    ("positions", lambda xp: arr(xp, [[2, 3]]), ValueError, "1-D"),
    ("out_cache_loc", lambda xp: arr(xp, [18, 0, 35, 0])[::2], ValueError, "C-contiguous"),
    ("log", lambda xp: None, TypeError, "ViolationLog"),
    ("expected_inputs", lambda xp: arr(xp, [5, 6]), TypeError, "pair"),
    ("expected_inputs[1]", lambda xp: (None, arr(xp, [2.0, 3.0], np.float32)), TypeError, "int32 or int64"),
    ("real_kv[0]", lambda xp: ["not a source"], TypeError, "RealKvSource"),
    ("real_kv_mode", lambda xp: 7, ValueError, "NONE, PARTIAL or ALL"),
    ("canary", lambda xp: arr(xp, np.zeros((48, 4))), TypeError, "CanaryBuffer"),
    ("write_plan", lambda xp: "plan", TypeError, "WritePlan"),
])
def test_write_misuse(xp, device, name, bad, exc, what):
    o = Objs(xp, device)
    key = {"expected_inputs[1]": "expected_inputs", "real_kv[0]": "real_kv", "write_plan": "wp"}.get(name, name)
    with raises(exc, name, what):
        o.write(**{key: bad(xp)})


def test_real_kv_source_smaller_than_the_canary(xp, device):
    o = Objs(xp, device, num_slots=48)
    small = kc.RealKvSource(xp.zeros((40, 16), dtype=xp.uint8), bytes_per_token=16)
    big = kc.RealKvSource(xp.zeros((48, 16), dtype=xp.uint8), bytes_per_token=16)
    with raises(ValueError, "real_kv[1]", "40 slots", "48"):
        o.write(real_kv=[big, small], real_kv_mode=RealKvMode.ALL)
    with raises(ValueError, "real_kv[0]", "40 slots"):
        o.verify(real_kv=small, real_kv_mode=RealKvMode.PARTIAL)
    o.verify(real_kv=big, real_kv_mode=RealKvMode.PARTIAL)  # fits: no error


def test_verify_misuse(xp, device):
    o = Objs(xp, device)
    with raises(TypeError, "verify_plan", "VerifyPlan"):
        o.verify(vp=o.wp)
    with raises(TypeError, "sample", "FingerprintSampler"):
        o.verify(sample=3)
    with raises(ValueError, "real_kv_mode"):
        o.verify(real_kv_mode="sometimes")
    with raises(TypeError, "log", "ViolationLog"):
        o.verify(log=o.vp)


def test_scatter_misuse(xp, device):
    table = xp.zeros((3, 4), dtype=xp.int64)
    ok = dict(tokens=arr(xp, [1, 2]), offsets=arr(xp, [0, 2]), req_pool_indices=arr(xp, [1]))
    with raises(ValueError, "offsets", "length >= 2"):
        kc.scatter_expected_tokens(table, **dict(ok, offsets=arr(xp, [0])))
    with raises(TypeError, "tokens", "int32 or int64"):
        kc.scatter_expected_tokens(table, **dict(ok, tokens=arr(xp, [1, 2], np.float32)))
    with raises(ValueError, "table", "2-D"):
        kc.scatter_expected_tokens(table[0], **ok)
    if xp is np:
        ro = np.zeros((3, 4), dtype=np.int64)
        ro.setflags(write=False)
        with raises(ValueError, "table", "writable"):
            kc.scatter_expected_tokens(ro, **ok)
    with raises(TypeError, "scatter_expected_tokens()", "capacity"):
        kc.scatter_expected_tokens(table, capacity=3, **ok)


# --- objects on different devices ---------------------------------------------------------------
def elsewhere(obj, device):
    """``obj`` claiming to live on ``device`` (a second device without needing one)."""
    spoof = type("Elsewhere" + type(obj).__name__, (type(obj),),
                 {"__slots__": (), "device": property(lambda self: device)})
    clone = object.__new__(spoof)
    for k in getattr(obj, "__slots__", ()) or ():
        if k != "__weakref__":
            object.__setattr__(clone, k, getattr(obj, k))
    if hasattr(obj, "__dict__"):
        clone.__dict__.update(obj.__dict__)
    return clone


def test_objects_on_different_devices(xp, device):
    o = Objs(xp, device)
    other = "cuda:7" if device == "cpu" else "cpu"
    here = o.canary.device
    with raises(ValueError, "write_plan", other, here):
        o.plan(wp=elsewhere(o.wp, other))
    with raises(ValueError, "write_plan", other):
        o.write(wp=elsewhere(o.wp, other))
    with raises(ValueError, "log", other):
        o.write(log=elsewhere(o.log, other))
    with raises(ValueError, "verify_plan", other):
        o.verify(vp=elsewhere(o.vp, other))
    with raises(ValueError, "log", other):
        o.verify(log=elsewhere(o.log, other))
    with raises(ValueError, "sample", other):
        o.verify(sample=elsewhere(kc.FingerprintSampler.allocate(period=2, device=device), other))
    src = kc.RealKvSource(xp.zeros((48, 16), dtype=xp.uint8), bytes_per_token=16)
    with raises(ValueError, "real_kv[0]", other):
        o.verify(real_kv=[elsewhere(src, other)], real_kv_mode=RealKvMode.PARTIAL)


def test_arrays_on_another_device(xp, device):
    if device == "cpu":
        pytest.skip("needs a CUDA device: host arrays passed to device-resident objects")
    o = Objs(xp, device)
    with raises(ValueError, "req_to_token", "cpu"):
        o.plan(req_to_token=TABLE)
    with raises(ValueError, "input_ids", "cpu"):
        o.write(input_ids=np.array([5, 6]))
