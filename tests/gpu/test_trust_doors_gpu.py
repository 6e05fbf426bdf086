"""The CUDA half of tests/test_trust_doors.py: fixed fields, arrays changed in place, inputs
inside outputs, refused sizes and pickling, with CuPy arrays on the device."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.format import VIOLATION_WORDS
from tests.test_trust_doors import Step, raises

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


def test_fields_are_fixed_and_rows_reach_the_ring_the_launch_was_prepared_with(cp):
    s = Step(cp)
    s.prefill_then_decode()
    s.verify(tag=2 ** 40)  # prepared before the refused reassignment below
    other = cp.zeros((16, VIOLATION_WORDS), dtype=cp.int64)
    with raises(TypeError, "ViolationLog.ring", "fixed for the object's life"):
        s.log.ring = other
    for obj, field in ((s.vp, "slot_indices"), (s.wp, "offsets"), (s.canary, "records")):
        with raises(TypeError, f"{type(obj).__name__}.{field}", "fixed"):
            setattr(obj, field, getattr(obj, field))
    src = kc.RealKvSource(cp.zeros((64, 16), dtype=cp.uint8), bytes_per_token=16)
    with raises(TypeError, "RealKvSource.data", "fixed"):
        src.data = cp.zeros((1, 16), dtype=cp.uint8)  # a smaller pool: the kernel would read freed memory
    s.canary.records[17, 0] = 999
    s.verify(tag=2 ** 40)
    (v,) = s.log.read()
    assert v.tag == 2 ** 40 and v.slot == 30 and not bool(other.any())
    s.write(input_ids=cp.asarray([5]), positions=cp.asarray([4]), out_cache_loc=cp.asarray([2]), real_kv=src,
            real_kv_mode=kc.RealKvMode.ALL)
    assert s.log.counters()["slots_written"] == 5


def test_a_held_array_reshaped_in_place_is_refused_at_the_next_validated_call(cp):
    s = Step(cp)
    s.prefill_then_decode()
    s.verify()
    s.vp.slot_indices.shape = (2, 64)
    with raises(ValueError, "VerifyPlan.slot_indices", "changed in place", "(128,)", "(2, 64)"):
        s.verify(tag=7)
    with raises(ValueError, "VerifyPlan.slot_indices", "changed in place"):
        s.plan(prefix_lens=cp.asarray([4]))
    s.vp.slot_indices.shape = (128,)
    s.verify(tag=7)
    s.log.ring.shape = (16 * VIOLATION_WORDS,)
    with raises(ValueError, "ViolationLog.ring", "changed in place"):
        s.write(input_ids=cp.asarray([5]), positions=cp.asarray([4]), out_cache_loc=cp.asarray([2]))
    assert s.log.counters()["slots_written"] == 4


def test_allocate_refuses_given_device_arrays_before_zeroing_them(cp):
    head, counters = cp.asarray([5]), cp.arange(1, 7)
    with raises(ValueError, "counters", "6"):
        kc.ViolationLog.allocate(capacity=4, device="cuda", head=head, counters=counters[:5])
    assert int(head[0]) == 5
    with raises(ValueError, "head", "counters", "share memory"):
        kc.ViolationLog.allocate(capacity=4, device="cuda", head=counters[5:6], counters=counters)
    assert counters.tolist() == [1, 2, 3, 4, 5, 6]


def test_no_op_reads_what_it_writes(cp):
    s = Step(cp)
    with raises(ValueError, "plan", "req_to_token", "verify_plan.slot_indices"):
        s.plan(req_to_token=s.vp.slot_indices.reshape(8, 16))
    with raises(ValueError, "plan", "prefix_lens", "write_plan.offsets"):
        s.plan(prefix_lens=s.wp.offsets[:1])
    s.plan()
    with raises(ValueError, "write", "out_cache_loc", "canary.records"):
        s.write(out_cache_loc=s.canary.records.reshape(-1)[:4])
    vp = kc.VerifyPlan.from_buffers(**{f: getattr(s.vp, f) for f in kc.VerifyPlan.FIELDS if f != "slot_indices"},
                                    slot_indices=s.log.ring.reshape(-1)[:128])
    with raises(ValueError, "verify", "verify_plan.slot_indices", "log.ring"):
        kc.verify(s.canary, vp, log=s.log, tag=kc.LaunchTag.VERIFY)
    with raises(ValueError, "plan_verify_write", "positions", "verify_plan.offsets"):
        kc.plan_verify_write(s.vp, s.wp, s.canary, **s.rows, req_to_token=s.table, log=s.log, tag=1, write_tag=2,
                             **dict(s.tokens, positions=s.vp.offsets[:4]))
    table = cp.zeros((4, 8), dtype=cp.int64)
    with raises(ValueError, "scatter_expected_tokens", "tokens", "table"):
        kc.scatter_expected_tokens(table, tokens=table[2], offsets=cp.asarray([0, 3]),
                                   req_pool_indices=cp.asarray([1]))
    assert s.log.counters()["kernel_runs"] == 0 and not bool(table.any())


def test_refused_kinds_and_sizes_on_the_device(cp):
    s = Step(cp)
    with raises(ValueError, "SwaWindow.lut", "at least one"):
        kc.SwaWindow(4, cp.zeros(0, dtype=cp.int64))
    pages = cp.asarray([[0], [1]], dtype=cp.int32)
    with raises(ValueError, "page_size", "2**31"):
        s.plan(req_to_token=None, block_table=pages, page_size=2 ** 40, prefix_lens=cp.asarray([2 ** 36]))
    with raises(ValueError, "page_size", "num_slots"):
        kc.plan_and_verify(s.vp, s.wp, s.canary, **s.rows, block_table=pages, page_size=65, log=s.log, tag=1)
    assert s.log.counters()["kernel_runs"] == 0


def test_device_objects_pickle_as_fresh_objects_after_an_op_call(cp):
    s = Step(cp)
    s.prefill_then_decode()
    s.canary.records[17, 0] = 999
    s.verify()
    copies = [pickle.loads(pickle.dumps(o)) for o in (s.vp, s.wp, s.canary, s.log)]
    for orig, c in zip((s.vp, s.wp, s.canary, s.log), copies):
        assert type(c) is type(orig) and c.device == orig.device
    vp, wp, canary, log = copies
    assert len(vp.launches) == len(canary.launches) == 0
    assert np.array_equal(canary.host_records(), s.canary.host_records())
    assert log.read() == s.log.read() and log.count == 1
    assert canary.records.data.ptr != s.canary.records.data.ptr
    rows = dict(req_to_token=s.table, **s.rows)
    for objs in ((s.vp, s.wp, s.canary, s.log), (vp, wp, canary, log)):
        kc.plan_and_verify(*objs[:3], **rows, log=objs[3], tag=kc.LaunchTag.VERIFY)
    assert sorted(v.as_row() for v in log.read()) == sorted(v.as_row() for v in s.log.read())
    assert log.counters() == s.log.counters()
