"""A pool that is itself a sliding window's ring (KvCanary(window=)): a step reads only its
window, and verify_after checks the window the step leaves, not the positions its own
writes legitimately replaced."""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc

A = np.array
RING = 4  # the request keeps positions p in slot 10 + p % RING
WINDOW = RING - 1  # a step reads the RING - 1 positions before it, then writes over the oldest


def ring_monitor(**kw):
    r2t = np.zeros((2, 32), np.int32)
    r2t[1] = 10 + np.arange(32) % RING  # every position to its ring slot (outside the window: never read)
    exp = np.full((2, 32), -1, np.int64)
    m = kc.KvCanary(num_slots=16, req_to_token=r2t, max_batch=1, window=WINDOW, expected_tokens=exp,
                    policy=lambda found: None, **kw)
    return r2t, exp, m


def step(m, exp, prefix: int, n: int, corrupt=None):
    """Request row 1 writes positions ``prefix .. prefix + n - 1`` (token 100 + position) into its ring;
    ``corrupt(m)`` runs between the verify and the write, as a stray write during the forward would."""
    pos = np.arange(prefix, prefix + n)
    exp[1, pos] = 100 + pos
    m.before_forward(A([1]), A([prefix]), A([n]), request_ids=["r"])
    if corrupt is not None:
        corrupt(m)
    m.after_forward(100 + pos, pos, 10 + pos % RING)
    return m.poll()


@pytest.mark.parametrize("verify_after", [False, True])
def test_a_ring_is_clean_step_after_step(verify_after):
    _, exp, m = ring_monitor(verify_after=verify_after)
    assert step(m, exp, 0, 4) == []
    for p in range(4, 12):
        assert step(m, exp, p, 1) == []
    assert step(m, exp, 12, 2) == [] and step(m, exp, 14, 1) == []  # a chunk of two, then decode again
    s = m.stats()
    assert s["logged"] == 0 and s["input_errors"] == 0 and s["verifies_skipped"] == 0
    # A full window (3 records) per step but the prefill's, and after every write (the prefill's too).
    assert s["slots_checked"] == 10 * WINDOW + (11 * WINDOW if verify_after else 0)


def test_verify_after_catches_a_window_record_changed_during_the_forward():
    _, exp, m = ring_monitor(verify_after=True)
    step(m, exp, 0, 4)
    step(m, exp, 4, 1)

    def stray_write(mon):
        mon.canary.records[10 + 3 % RING, 1] = 99  # position 3's record: read by this step, kept by it

    found = step(m, exp, 5, 1, corrupt=stray_write)  # the record, and the link of its successor
    assert [(v.tag, v.request, v.slot, v.expected_position, v.reasons) for v in found] == [
        (kc.LaunchTag.VERIFY_AFTER, "r", 10 + 3 % RING, 3, kc.FailReason.POSITION),
        (kc.LaunchTag.VERIFY_AFTER, "r", 10 + 4 % RING, 4, kc.FailReason.CHAIN)]


def test_a_ring_slot_rewritten_before_the_step_is_caught_by_its_verify():
    _, exp, m = ring_monitor()
    step(m, exp, 0, 4)
    m.canary.records[10 + 2 % RING, 0] = 7  # position 2's token, before the step that reads it
    found = step(m, exp, 4, 1)  # the record, and the link of its successor
    assert [(v.tag, v.slot, v.reasons) for v in found] == [(kc.LaunchTag.VERIFY, 12, kc.FailReason.TOKEN),
                                                           (kc.LaunchTag.VERIFY, 13, kc.FailReason.CHAIN)]


def test_window_misuse_is_refused():
    r2t = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match="^kvcanary: window: "):
        kc.KvCanary(num_slots=16, req_to_token=r2t, max_batch=1, window=0)
    swa = kc.SwaGroup(window=4, lut=np.zeros(16, np.int32), num_slots=8)
    with pytest.raises(ValueError, match="^kvcanary: window: "):
        kc.KvCanary(num_slots=16, req_to_token=r2t, max_batch=1, window=3, swa=swa)
