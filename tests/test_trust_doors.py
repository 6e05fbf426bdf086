"""What an op reads stays what was validated, and no input kind or size slips past the doors.

A launch reads the arrays its objects held when the call was validated: the objects
cannot be given other arrays, their arrays cannot be reshaped, resized or made
read-only unnoticed, no op reads what it writes, and inputs come in zero copy or
not at all. NumPy backend; tests/gpu/test_trust_doors_gpu.py runs the CuPy variants.
"""
import pickle
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.format import VIOLATION_WORDS


def raises(exc, *names):
    """pytest.raises for a ``kvcanary:`` message that names every one of ``names``."""
    pattern = r"^kvcanary: " + "".join(f"(?=.*{re.escape(n)})" for n in names)
    return pytest.raises(exc, match=re.compile(pattern, re.S))


class Step:
    """The README's objects and one request (row 1 of the table) of six cached slots, on the
    device of ``xp`` (NumPy: the CPU; CuPy: CUDA, for tests/gpu/test_trust_doors_gpu.py)."""

    def __init__(self, xp=np, num_slots=64):
        self.xp = xp
        device = "cpu" if xp is np else "cuda"
        self.canary = kc.CanaryBuffer.allocate(num_slots=num_slots, device=device)
        self.vp = kc.VerifyPlan.allocate(capacity=128, max_batch=4, device=device)
        self.wp = kc.WritePlan.allocate(max_batch=4, device=device)
        self.log = kc.ViolationLog.allocate(capacity=16, device=device)
        table = np.zeros((4, 16), dtype=np.int32)
        table[1, :6] = [9, 4, 17, 30, 2, 11]
        self.table = xp.asarray(table)
        self.rows = dict(req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([0]), extend_lens=xp.asarray([4]))
        self.tokens = dict(input_ids=xp.asarray([1, 2, 3, 4]), positions=xp.arange(4),
                           out_cache_loc=xp.asarray(table[1, :4].astype(np.int64)))

    def plan(self, **kw):
        kc.plan(self.vp, self.wp, **{"req_to_token": self.table, **self.rows, **kw})

    def verify(self, **kw):
        kc.verify(self.canary, self.vp, **{"log": self.log, "tag": kc.LaunchTag.VERIFY, **kw})

    def write(self, **kw):
        kc.write(self.canary, self.wp, **{"log": self.log, "tag": kc.LaunchTag.WRITE, **self.tokens, **kw})

    def prefill_then_decode(self):
        """Stamp four tokens, then plan the decode step that reads them."""
        self.plan()
        self.verify()
        self.write()
        xp = self.xp
        self.rows = dict(req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([4]), extend_lens=xp.asarray([1]))
        self.plan()



# Every door holds on both CPU backends: the compiled one checks no bounds, so what is refused
# here must never reach it.
pytestmark = pytest.mark.usefixtures("cpu_backend")

# --- 1. fields fixed for the object's life -------------------------------------------------
def _objects():
    s = Step()
    swa = kc.SwaWindow(4, np.arange(64))
    expected = kc.ExpectedTokens(np.zeros((4, 16), np.int64), np.zeros(4, np.int64))
    sampler = kc.FingerprintSampler.allocate(period=2)
    src = kc.RealKvSource(np.zeros((64, 16), np.uint8), bytes_per_token=16)
    return dict(log=s.log, vp=s.vp, wp=s.wp, canary=s.canary, swa=swa, expected=expected, sampler=sampler,
                src=src)


@pytest.mark.parametrize("obj, field, cls", [
    ("log", "ring", "ViolationLog"), ("log", "head", "ViolationLog"), ("log", "counter_array", "ViolationLog"),
    ("vp", "slot_indices", "VerifyPlan"), ("vp", "num_valid", "VerifyPlan"), ("vp", "launches", "VerifyPlan"),
    ("wp", "seed_slots", "WritePlan"), ("wp", "position_check", "WritePlan"),
    ("canary", "records", "CanaryBuffer"), ("canary", "chain", "CanaryBuffer"),
    ("swa", "lut", "SwaWindow"), ("swa", "size", "SwaWindow"),
    ("expected", "table", "ExpectedTokens"), ("expected", "offset", "ExpectedTokens"),
    ("sampler", "state", "FingerprintSampler"), ("sampler", "period", "FingerprintSampler"),
    ("src", "data", "RealKvSource"), ("src", "page_size", "RealKvSource"), ("src", "layer_bytes", "RealKvSource"),
])
def test_fields_cannot_be_reassigned_or_deleted(obj, field, cls):
    o = _objects()[obj]
    before = getattr(o, field)
    with raises(TypeError, f"{cls}.{field}", "fixed for the object's life", f"make a new {cls}"):
        setattr(o, field, before)
    with raises(TypeError, f"{cls}.{field}", "fixed"):
        delattr(o, field)
    with raises(TypeError, f"{cls}.extra", "fixed"):
        o.extra = 1
    assert getattr(o, field) is before


def test_a_log_keeps_its_ring_so_every_row_reads_back():
    s = Step()
    s.prefill_then_decode()
    other = np.zeros((16, VIOLATION_WORDS), np.int64)
    with raises(TypeError, "ViolationLog.ring"):
        s.log.ring = other
    s.canary.records[17, 0] = 999  # the next verify finds slot 17's successor's chain broken
    kc.verify(s.canary, s.vp, log=s.log, tag=2 ** 40)
    (v,) = s.log.read()
    assert v.tag == 2 ** 40 and v.slot == 30 and not other.any()


def test_a_real_kv_source_keeps_its_pool():
    s = Step()
    pool = np.zeros((64, 16), np.uint8)
    src = kc.RealKvSource(pool, bytes_per_token=16)
    with raises(TypeError, "RealKvSource.data"):
        src.data = np.zeros((1, 16), np.uint8)  # a smaller pool: the write would read past it
    s.plan()
    s.write(real_kv=src, real_kv_mode=kc.RealKvMode.ALL)
    assert s.log.count == 0 and s.log.counters()["slots_written"] == 4


# --- 2. held arrays changed in place ----------------------------------------------------------
def _resize(a):
    a.resize((a.shape[0] // 2,) + a.shape[1:], refcheck=False)


def _reshape(a):
    """``a.shape = ...`` in place: deprecated in NumPy 2.5, so still possible for a caller."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            a.shape = (1, -1) if a.ndim == 1 else (-1,)
        except AttributeError:
            pytest.skip("this NumPy cannot change an array's shape in place any more")


def _read_only(a):
    a.flags.writeable = False


@pytest.mark.parametrize("change", [_resize, _reshape, _read_only])
@pytest.mark.parametrize("where, field", [
    ("vp", "slot_indices"), ("vp", "offsets"), ("wp", "seed_slots"), ("canary", "records"), ("log", "ring"),
    ("log", "counter_array"),
])
def test_a_held_array_changed_after_a_call_is_refused_before_the_next_launch(change, where, field):
    s = Step()
    s.prefill_then_decode()
    s.verify()
    decode = dict(input_ids=np.array([5]), positions=np.array([4]), out_cache_loc=np.array([2]))
    s.write(**decode)
    records, ring, counters = s.canary.records.copy(), s.log.ring.copy(), s.log.counters()
    obj = {"vp": s.vp, "wp": s.wp, "canary": s.canary, "log": s.log}[where]
    cls = type(obj).__name__
    change(getattr(obj, field))
    memoised = {"vp": [s.plan, s.verify], "wp": [s.plan, lambda: s.write(**decode)],
                "canary": [s.verify, lambda: s.write(**decode)], "log": [s.verify, lambda: s.write(**decode)]}
    validated = {"vp": lambda: s.verify(tag=7), "wp": lambda: s.write(**dict(decode, positions=np.array([4]))),
                 "canary": lambda: s.verify(tag=7), "log": lambda: s.verify(tag=7)}
    for call in memoised[where] + [validated[where]]:
        with raises(ValueError, f"{cls}.{field}", "changed in place"):
            call()
    if where != "canary":
        assert np.array_equal(s.canary.records, records)
    if where != "log":
        assert np.array_equal(s.log.ring, ring) and s.log.counters() == counters


def test_a_prepared_op_checks_its_arrays_before_each_launch():
    s = Step()
    s.plan()
    write = kc.prepare(kc.write, s.canary, s.wp, log=s.log, tag=kc.LaunchTag.WRITE, **s.tokens)
    write()
    assert s.log.counters()["slots_written"] == 4
    s.canary.records.flags.writeable = False
    with raises(ValueError, "CanaryBuffer.records", "changed in place", "read-only"):
        write()
    s.canary.records.flags.writeable = True
    write()
    assert s.log.counters()["slots_written"] == 8
    ids = s.tokens["input_ids"]
    ids.resize(8, refcheck=False)
    with raises(ValueError, "input_ids", "changed in place", "(4,)", "(8,)"):
        write()


def test_host_writes_check_the_arrays_too():
    s = Step()
    s.log.head.flags.writeable = False
    with raises(ValueError, "ViolationLog.head", "changed in place", "read-only"):
        s.log.clear()
    s.log.counter_array.resize(3, refcheck=False)
    with raises(ValueError, "ViolationLog", "changed in place"):
        s.log.reset_counters()
    s.wp.position_check.flags.writeable = False
    with raises(ValueError, "WritePlan.position_check", "read-only"):
        s.wp.set_position_check(False)


def test_an_option_array_changed_in_place_is_refused():
    s = Step()
    lut = np.arange(64)
    swa = kc.SwaWindow(2, lut)
    s.rows["prefix_lens"] = np.array([4])
    s.plan(swa=swa)
    lut.resize((32,), refcheck=False)
    with raises(ValueError, "SwaWindow.lut", "changed in place"):
        s.plan(swa=swa)


# --- 3. allocate validates what it is given before writing it -----------------------------
def test_allocate_refuses_given_arrays_before_zeroing_them():
    head, counters = np.array([5], np.int64), np.arange(1, 7, dtype=np.int64)
    with raises(ValueError, "counters", "6"):
        kc.ViolationLog.allocate(capacity=4, head=head, counters=counters[:5])
    assert head[0] == 5
    block = np.arange(1, 8, dtype=np.int64)  # head overlapping the counters
    with raises(ValueError, "head", "counters", "share memory"):
        kc.ViolationLog.allocate(capacity=4, head=block[5:6], counters=block[:6])
    assert block.tolist() == [1, 2, 3, 4, 5, 6, 7]
    with raises(TypeError, "counters", "int64"):
        kc.ViolationLog.allocate(capacity=4, head=head, counters=np.zeros(6, np.int32))
    assert head[0] == 5
    log = kc.ViolationLog.allocate(capacity=4, head=head, counters=counters)
    assert log.head is head and head[0] == 0 and not counters.any()


# --- 4. no op reads what it writes ---------------------------------------------------------
def test_plan_refuses_a_table_inside_its_own_outputs():
    s = Step()
    table = s.vp.slot_indices.reshape(8, 16)  # the plan's own entries as the slot table
    with raises(ValueError, "plan", "req_to_token", "verify_plan.slot_indices", "writes"):
        s.plan(req_to_token=table)
    with raises(ValueError, "plan", "block_table", "verify_plan.slot_indices"):
        s.plan(req_to_token=None, block_table=table, page_size=4)
    with raises(ValueError, "plan", "prefix_lens", "write_plan.offsets"):
        s.plan(prefix_lens=s.wp.offsets[:1])
    with raises(ValueError, "plan", "extend_lens", "write_plan.seed_slots"):
        kc.plan(None, s.wp, req_to_token=s.table, **dict(s.rows, extend_lens=s.wp.seed_slots[1:2]))
    with raises(ValueError, "plan", "swa.lut", "verify_plan.expected_tokens"):
        s.plan(swa=kc.SwaWindow(2, s.vp.expected_tokens))
    exp = kc.ExpectedTokens(s.table, s.vp.offsets)
    with raises(ValueError, "plan", "expected.valid_lens", "verify_plan.offsets"):
        s.plan(expected=exp)
    assert s.vp.host_scalars()["enable"] == 0  # nothing was planned
    same = np.array([3])
    s.plan(prefix_lens=same, extend_lens=same)  # inputs may share memory with each other
    assert s.vp.host_scalars()["num_valid"] == 3


def test_write_and_verify_refuse_inputs_inside_their_outputs():
    s = Step()
    s.plan()
    flat = s.canary.records.reshape(-1)
    with raises(ValueError, "write", "out_cache_loc", "canary.records"):
        s.write(out_cache_loc=flat[:4])
    with raises(ValueError, "write", "input_ids", "log.counters"):
        s.write(input_ids=s.log.counter_array[:4])
    with raises(ValueError, "write", "expected_inputs[1]", "log.ring"):
        s.write(expected_inputs=(None, s.log.ring.reshape(-1)[:4]))
    ring_bytes = kc.RealKvSource(s.log.ring, bytes_per_token=16)  # 80 slots of the log's own ring
    with raises(ValueError, "write", "real_kv[0]", "log.ring"):
        s.write(real_kv=ring_bytes, real_kv_mode=kc.RealKvMode.ALL)
    assert s.log.counters()["kernel_runs"] == 0
    vp = kc.VerifyPlan.from_buffers(**{f: getattr(s.vp, f) for f in kc.VerifyPlan.FIELDS if f != "slot_indices"},
                                    slot_indices=s.log.ring.reshape(-1)[:128])
    with raises(ValueError, "verify", "verify_plan.slot_indices", "log.ring"):
        kc.verify(s.canary, vp, log=s.log, tag=kc.LaunchTag.VERIFY)
    with raises(ValueError, "verify", "real_kv[0]", "log.ring"):
        s.verify(real_kv=ring_bytes, real_kv_mode=kc.RealKvMode.ALL)
    sampler = kc.FingerprintSampler(2, np.zeros(2, np.int64))
    src = kc.RealKvSource(sampler.state.view(np.uint8), bytes_per_token=16)
    with raises(ValueError, "verify", "real_kv[0]", "sample.state"):
        kc.verify(kc.CanaryBuffer.allocate(num_slots=1), s.vp, log=s.log, tag=1, real_kv=src,
                  real_kv_mode=kc.RealKvMode.ALL, sample=sampler)
    assert s.log.counters()["kernel_runs"] == 0


def test_fused_ops_and_scatter_refuse_inputs_inside_their_outputs():
    s = Step()
    step = dict(req_to_token=s.table, log=s.log, tag=kc.LaunchTag.VERIFY)
    with raises(ValueError, "plan_and_verify", "req_pool_indices", "log.counters"):
        kc.plan_and_verify(s.vp, s.wp, s.canary, **dict(s.rows, req_pool_indices=s.log.counter_array[:1]), **step)
    with raises(ValueError, "plan_and_verify", "req_to_token", "write_plan.seed_slots"):
        kc.plan_and_verify(s.vp, s.wp, s.canary, **s.rows, **dict(step, req_to_token=s.wp.seed_slots.reshape(2, 2)))
    digest = np.zeros(1, np.int64)
    with raises(ValueError, "plan_and_verify", "prefix_lens", "digest"):
        kc.plan_and_verify(s.vp, s.wp, s.canary, **dict(s.rows, prefix_lens=digest), **step, digest=digest)
    with raises(ValueError, "plan_verify_write", "positions", "verify_plan.offsets"):
        kc.plan_verify_write(s.vp, s.wp, s.canary, **s.rows, **step, write_tag=kc.LaunchTag.WRITE,
                             **dict(s.tokens, positions=s.vp.offsets[:4]))
    with raises(ValueError, "plan_verify_write", "req_to_token", "canary.records"):
        kc.plan_verify_write(s.vp, s.wp, s.canary, **s.rows, **dict(step, req_to_token=s.canary.records),
                             write_tag=kc.LaunchTag.WRITE, **s.tokens)
    with raises(ValueError, "plan_verify_write", "out_cache_loc", "canary.records"):
        kc.plan_verify_write(s.vp, s.wp, s.canary, **s.rows, **step, write_tag=kc.LaunchTag.WRITE,
                             **dict(s.tokens, out_cache_loc=s.canary.records.reshape(-1)[4:8]))
    assert s.log.counters()["kernel_runs"] == 0 and s.vp.host_scalars()["enable"] == 0
    table = np.zeros((4, 8), np.int64)
    with raises(ValueError, "scatter_expected_tokens", "tokens", "table"):
        kc.scatter_expected_tokens(table, tokens=table[2], offsets=np.array([0, 3]), req_pool_indices=np.array([1]))
    with raises(ValueError, "scatter_expected_tokens", "offsets", "table"):
        kc.scatter_expected_tokens(table, tokens=np.arange(3), offsets=table[3, :2], req_pool_indices=np.array([1]))
    assert not table.any()
    # the step's slots may be a view of its own table: both are only read
    kc.plan_verify_write(s.vp, s.wp, s.canary, **s.rows, **step, write_tag=kc.LaunchTag.WRITE,
                         **dict(s.tokens, out_cache_loc=s.table[1, :4]))
    assert s.log.counters()["slots_written"] == 4


# --- 5. input kinds that are refused --------------------------------------------------------
def test_an_empty_swa_lut_is_refused():
    with raises(ValueError, "SwaWindow.lut", "at least one"):
        kc.SwaWindow(4, np.zeros(0, np.int64))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix itself
def test_numpy_subclasses_are_refused():
    s = Step()
    with raises(TypeError, "req_to_token", "matrix", "np.asarray"):
        s.plan(req_to_token=np.matrix(s.table))
    masked = np.ma.MaskedArray([1], mask=[True])
    with raises(TypeError, "req_pool_indices", "MaskedArray", "mask"):
        s.plan(req_pool_indices=masked)
    with raises(TypeError, "input_ids", "MaskedArray"):
        s.write(input_ids=np.ma.MaskedArray([1, 2, 3, 4]))
    with raises(TypeError, "ExpectedTokens.valid_lens", "MaskedArray"):
        kc.ExpectedTokens(s.table, np.ma.MaskedArray([4]))
    assert s.vp.host_scalars()["enable"] == 0


class OnlyArray:
    """An array-like that NumPy can only convert, by calling ``__array__`` (a copy)."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return np.array(self.a, dtype=dtype)


class Interface:
    """An array-like that exposes its memory through ``__array_interface__``."""

    def __init__(self, a):
        self.a = a
        self.__array_interface__ = a.__array_interface__


def test_an_array_like_without_dlpack_is_refused_unless_it_exposes_its_memory():
    s = Step()
    rpi = np.array([1])
    with raises(TypeError, "req_pool_indices", "__array__", "__dlpack__"):
        s.plan(req_pool_indices=OnlyArray(rpi))
    with raises(TypeError, "SwaWindow.lut", "__dlpack__"):
        kc.SwaWindow(4, OnlyArray(np.arange(64)))
    pre = np.array([3])
    s.plan(prefix_lens=Interface(pre))  # zero copy: the caller's array itself is read
    assert s.vp.host_scalars()["num_valid"] == 3
    pre[0] = 5
    s.plan(prefix_lens=Interface(pre))
    assert s.vp.host_scalars()["num_valid"] == 5


# --- 7. pickling ----------------------------------------------------------------------------
def test_objects_pickle_as_fresh_objects_before_and_after_an_op_call():
    s = Step()
    names = {"vp": kc.VerifyPlan.FIELDS, "wp": kc.WritePlan.FIELDS, "canary": ("records",),
             "log": ("ring", "head", "counter_array")}
    fresh = {name: pickle.loads(pickle.dumps(getattr(s, name))) for name in names}
    assert fresh["vp"].host_scalars()["enable"] == 0 and fresh["log"].count == 0
    s.prefill_then_decode()
    s.canary.records[17, 0] = 999  # one violation, polled before the copy
    s.verify()
    assert len(s.log.poll()) == 1
    s.write(input_ids=np.array([5]), positions=np.array([4]), out_cache_loc=np.array([2]))
    copies = {name: pickle.loads(pickle.dumps(getattr(s, name))) for name in names}
    for name, c in copies.items():
        orig = getattr(s, name)
        assert type(c) is type(orig)
        if name != "log":
            assert len(c.launches) == 0
        for f in names[name]:
            a, b = getattr(orig, f), getattr(c, f)
            assert np.array_equal(a, b) and not np.shares_memory(a, b)
        with raises(TypeError, type(c).__name__, "fixed"):
            c.extra = 1
    assert copies["canary"].chain == s.canary.chain
    log = copies["log"]
    assert log.poll() == [] and log.read() == s.log.read() and log.count == 1
    # the copies run the next step exactly as the originals do
    c = copies
    rows = dict(req_to_token=s.table, **s.rows)
    for vp, wp, canary, log in ((s.vp, s.wp, s.canary, s.log), (c["vp"], c["wp"], c["canary"], c["log"])):
        kc.plan_and_verify(vp, wp, canary, **rows, log=log, tag=kc.LaunchTag.VERIFY)
    assert np.array_equal(c["log"].ring, s.log.ring) and c["log"].counters() == s.log.counters()
    assert s.log.count == 2
    _option_objects_and_sources_pickle(s)


def _option_objects_and_sources_pickle(s):
    sampler = kc.FingerprintSampler.allocate(period=3)
    kc.verify(s.canary, s.vp, log=s.log, tag=1, sample=sampler, real_kv=kc.RealKvSource(
        np.zeros((64, 16), np.uint8), bytes_per_token=16), real_kv_mode=kc.RealKvMode.ALL)
    back = pickle.loads(pickle.dumps(sampler))
    assert back.period == 3 and back.state.tolist() == sampler.state.tolist() == [1, 0]
    swa = pickle.loads(pickle.dumps(kc.SwaWindow(2, np.arange(8))))
    assert swa.size == 2 and swa.lut.tolist() == list(range(8))
    exp = pickle.loads(pickle.dumps(kc.ExpectedTokens(s.table, np.array([4]), 1)))
    assert exp.offset == 1 and np.array_equal(exp.table, s.table)
    pool = np.arange(2 * 64 * 32, dtype=np.uint8).reshape(2, 64, 32)
    src = kc.RealKvSource(pool, page_size=4, bytes_per_token=32, read_bytes=16, layer_axis=True)
    back = pickle.loads(pickle.dumps(src))
    assert repr(back) == repr(src) and np.array_equal(back.data, src.data)
    with raises(TypeError, "RealKvSource.data", "fixed"):
        back.data = src.data


# --- 8. sizes no pool can have ---------------------------------------------------------------
def test_a_page_size_past_any_pool_is_refused():
    s = Step()
    pages = np.array([[0], [1]], np.int32)
    with raises(ValueError, "page_size", str(2 ** 40), "2**31"):
        s.plan(req_to_token=None, block_table=pages, page_size=2 ** 40, prefix_lens=np.array([2 ** 36]))
    wide = np.zeros((2, 4), np.int32)
    with raises(ValueError, "page_size", "2**31"):
        s.plan(req_to_token=None, block_table=wide, page_size=2 ** 30 + 1)
    s.plan(req_to_token=None, block_table=wide, page_size=2 ** 29)  # 2**31 positions: the bound itself
    assert s.vp.host_scalars()["input_errors"] == 0
    step = dict(req_to_token=None, block_table=pages, log=s.log, tag=kc.LaunchTag.VERIFY, **s.rows)
    with raises(ValueError, "page_size", "65", "num_slots", "64"):
        kc.plan_and_verify(s.vp, s.wp, s.canary, page_size=65, **step)
    with raises(ValueError, "page_size", "num_slots"):
        kc.plan_verify_write(s.vp, s.wp, s.canary, page_size=128, write_tag=kc.LaunchTag.WRITE, **step,
                             **s.tokens)
    kc.plan_and_verify(s.vp, s.wp, s.canary, page_size=64, **step)
    assert s.log.counters()["kernel_runs"] == 1


def test_a_monitor_over_a_page_size_past_any_pool_is_refused_at_once():
    code = ("import numpy as np, kvcanary_cupy as kc\n"
            "try:\n"
            "    kc.KvCanary(num_slots=64, block_table=np.zeros((2, 1), np.int32), page_size=2**40, max_batch=1,\n"
            "                verify_capacity='max')\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("kvcanary: page_size") and "num_slots" in out.stdout, out.stdout + out.stderr
