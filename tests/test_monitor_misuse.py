"""KvCanary refuses misuse with ``kvcanary:`` errors and changes nothing when it does."""
import re

import numpy as np
import pytest

import kvcanary_cupy as kc


def raises(exc, *names):
    pattern = r"^kvcanary: " + "".join(f"(?=.*{re.escape(n)})" for n in names)
    return pytest.raises(exc, match=re.compile(pattern, re.S))


def monitor(xp, **kw):
    r2t = xp.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))  # row r, position p -> slot 16 r + p
    return kc.KvCanary(**{"num_slots": 64, "req_to_token": r2t, "max_batch": 2,
                          "device": "cpu" if xp is np else "cuda", "policy": lambda found: None, **kw})


def a(xp, *v):
    return xp.asarray(np.array(v, dtype=np.int64))


@pytest.mark.parametrize("kw, name, exc", [
    (dict(num_slots=64.0), "num_slots", TypeError),
    (dict(max_batch="2"), "max_batch", TypeError),
    (dict(max_batch=0), "max_batch", ValueError),
    (dict(ring_capacity=None), "ring_capacity", TypeError),
    (dict(verify_after="yes"), "verify_after", TypeError),
    (dict(grow_on_overflow=1), "grow_on_overflow", TypeError),
    (dict(draft="no"), "draft", TypeError),
    (dict(token_offset=-3), "token_offset", ValueError),
    (dict(fingerprint_sample_period=2.5), "fingerprint_sample_period", TypeError),
    (dict(history=0), "history", ValueError),
    (dict(max_tokens=1.5), "max_tokens", TypeError),
    (dict(sweep_budget=0), "sweep_budget", ValueError),
    (dict(real_kv_mode=True), "real_kv_mode", ValueError),
    (dict(verify_capacity=True), "verify_capacity", ValueError),
    (dict(chain="v2"), "chain", ValueError),
    (dict(chain=None), "chain", ValueError),
    (dict(swa=kc.SwaGroup(window=2.5, lut=np.arange(64), num_slots=64)), "swa.window", TypeError),
    (dict(swa=kc.SwaGroup(window=4, lut=np.arange(64), num_slots="64")), "swa.num_slots", TypeError),
])
def test_constructor_arguments_are_checked(xp, kw, name, exc):
    if "swa" in kw:
        kw["swa"] = kc.SwaGroup(window=kw["swa"].window, lut=xp.asarray(kw["swa"].lut), num_slots=kw["swa"].num_slots)
    with raises(exc, name):
        monitor(xp, **kw)


def test_before_forward_twice_is_an_error_and_abort_step_recovers(xp):
    mon = monitor(xp)
    mon.before_forward(a(xp, 1), a(xp, 0), a(xp, 2))
    with raises(ValueError, "before_forward", "after_forward", "abort_step"):
        mon.before_forward(a(xp, 1), a(xp, 0), a(xp, 2))
    assert mon.stats()["steps"] == 1  # the refused call counted nothing
    mon.abort_step()
    mon.before_forward(a(xp, 1), a(xp, 0), a(xp, 2))
    mon.after_forward(a(xp, 7, 8), a(xp, 0, 1), a(xp, 16, 17))
    s = mon.stats()
    assert (s["steps"], s["aborted_steps"], s["slots_written"]) == (2, 1, 2)
    with raises(ValueError, "abort_step"):
        mon.abort_step()


def test_a_bound_buffer_shorter_than_the_batch_is_an_error(xp):
    mon = monitor(xp, max_batch=8)
    mon.bind_inputs(req_pool_indices=a(xp, 1), prefix_lens=a(xp, 0), extend_lens=a(xp, 1))
    with raises(ValueError, "req_pool_indices", "5", "1"):
        mon.before_forward(batch_size=5)
    mon.before_forward(batch_size=1)
    mon.bind_inputs(input_ids=a(xp, 7), positions=a(xp, 0), out_cache_loc=a(xp, 16))
    with raises(ValueError, "input_ids", "3"):
        mon.after_forward(num_tokens=3)
    with raises(TypeError, "num_tokens"):
        mon.after_forward(num_tokens=1.0)
    mon.after_forward(num_tokens=1)
    assert mon.stats()["slots_written"] == 1
    with raises(TypeError, "batch_size"):
        mon.before_forward(batch_size=True)


def test_a_row_bound_is_checked_before_anything_is_stamped(xp):
    mon = monitor(xp)
    mon.before_forward(a(xp, 1), a(xp, 0), a(xp, 2))
    for bad, exc in ((1.5, TypeError), (True, TypeError), (-2, ValueError)):
        with raises(exc, "max_row_tokens"):
            mon.after_forward(a(xp, 7, 8), a(xp, 0, 1), a(xp, 16, 17), max_row_tokens=bad)
    assert mon.stats()["slots_written"] == 0  # the step stays open: the call is repeated, fixed
    mon.after_forward(a(xp, 7, 8), a(xp, 0, 1), a(xp, 16, 17), max_row_tokens=1)  # a row breaks it: same bytes
    assert mon.stats()["slots_written"] == 2
    mon.before_forward(a(xp, 1), a(xp, 2), a(xp, 1))
    mon.after_forward(a(xp, 9), a(xp, 2), a(xp, 18), max_row_tokens=1)
    assert mon.stats()["slots_checked"] == 2 and mon.log.count == 0


def test_a_row_bound_goes_with_the_write_inputs(xp):
    stamped = monitor(xp, stamp_before_forward=True)
    stamped.before_forward(a(xp, 1), a(xp, 0), a(xp, 1), input_ids=a(xp, 7), positions=a(xp, 0),
                           out_cache_loc=a(xp, 16), max_row_tokens=1)
    with raises(ValueError, "after_forward", "stamp_before_forward"):
        stamped.after_forward(max_row_tokens=1)
    stamped.after_forward()
    plain = monitor(xp)
    with raises(ValueError, "max_row_tokens", "after_forward"):
        plain.before_forward(a(xp, 1), a(xp, 0), a(xp, 1), max_row_tokens=1)
    assert stamped.stats()["slots_written"] == 1 and plain.stats()["steps"] == 0


def test_request_ids_must_name_every_row(xp):
    mon = monitor(xp)
    with raises(ValueError, "request_ids", "2"):
        mon.before_forward(a(xp, 1, 2), a(xp, 0, 0), a(xp, 1, 1), request_ids=["only one"])


def test_after_forward_validates_every_group_before_writing(xp):
    """A float swa_out_cache_loc is refused before the full pool's records change."""
    dev = "cpu" if xp is np else "cuda"
    r2t = xp.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))
    mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=1, device=dev, policy=lambda found: None,
                      swa=kc.SwaGroup(window=4, lut=xp.arange(64), num_slots=64))
    mon.before_forward(a(xp, 1), a(xp, 0), a(xp, 2))
    before = mon.canary.host_records(), mon.swa_canary.host_records(), mon.log.counters()
    with raises(TypeError, "swa_out_cache_loc"):
        mon.after_forward(a(xp, 7, 8), a(xp, 0, 1), a(xp, 16, 17), swa_out_cache_loc=xp.asarray([16.0, 17.0]))
    after = mon.canary.host_records(), mon.swa_canary.host_records(), mon.log.counters()
    assert (before[0] == after[0]).all() and (before[1] == after[1]).all() and before[2] == after[2]
    # The step is still open: the corrected call goes through.
    mon.after_forward(a(xp, 7, 8), a(xp, 0, 1), a(xp, 16, 17), swa_out_cache_loc=a(xp, 16, 17))
    assert mon.stats()["slots_written"] == 4


def test_rebind_refuses_a_bare_array_for_sources(xp):
    mon = monitor(xp)
    with raises(TypeError, "real_kv", "RealKvSource"):
        mon.rebind(real_kv=xp.zeros((64, 16), dtype=xp.uint8))


def test_overflow_warning_names_the_skipped_verify_counter():
    r2t = np.arange(64, dtype=np.int32).reshape(4, 16)
    mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, verify_capacity=2, grow_on_overflow=False,
                      policy=lambda found: None)
    mon.before_forward(np.array([1]), np.array([0]), np.array([4]))
    mon.after_forward(np.array([1, 2, 3, 4]), np.arange(4), np.arange(16, 20))
    mon.before_forward(np.array([1]), np.array([4]), np.array([0]))
    mon.after_forward(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    with pytest.warns(kc.KvCanaryWarning, match=r"verifies_skipped"):
        mon.poll()
    assert mon.stats()["verifies_skipped"] == 1
