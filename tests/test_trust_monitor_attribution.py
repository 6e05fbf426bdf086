"""Violation rows name the request whose step found them: after the log is cleared by hand,
around a sweep that runs inside an open step, and with several threads at one monitor (which
the monitor refuses, clearly, rather than mix their steps)."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import kvcanary_cupy as kc

A = np.array


def monitor(**kw):
    """Rows 1..3 of a 4 x 16 table; row r, position p -> slot 16 r + p."""
    r2t = np.arange(64, dtype=np.int32).reshape(4, 16)
    return r2t, kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy=lambda found: None, **kw)


def prefill_a_b(m):
    """A (row 1) prefills 3 tokens, B (row 2) 2: clean."""
    m.before_forward(A([1, 2]), A([0, 0]), A([3, 2]), request_ids=["A", "B"])
    m.after_forward(A([1, 2, 3, 7, 8]), A([0, 1, 2, 0, 1]), A([16, 17, 18, 32, 33]))


def named(found) -> set:
    return {(v.request, v.slot) for v in found}


def test_rows_after_a_log_clear_name_their_requests():
    r2t, m = monitor()
    prefill_a_b(m)
    r2t[1, :2] = [45, 46]  # A reads two slots nobody stamped: three rows, polled
    m.before_forward(A([1, 2]), A([3, 2]), A([1, 1]), request_ids=["A", "B"])
    m.after_forward(A([4, 9]), A([3, 2]), A([19, 34]))
    assert named(m.poll()) == {("A", 45), ("A", 46), ("A", 18)}
    r2t[1, :2] = [16, 17]
    m.log.clear()
    r2t[2, 0] = 47  # now B's first slot: found by the next step (B's rows 47 and its successor 33)
    m.before_forward(A([1, 2]), A([4, 3]), A([1, 1]), request_ids=["A", "B"])
    m.after_forward(A([5, 10]), A([4, 3]), A([20, 35]))
    r2t[2, 0] = 32
    r2t[1, 2] = 48  # then A's third (rows 48 and its successor 19), the batch in the other order
    m.before_forward(A([2, 1]), A([4, 5]), A([1, 1]), request_ids=["B", "A"])
    m.after_forward(A([11, 6]), A([4, 5]), A([36, 21]))
    assert named(m.poll()) == {("B", 47), ("B", 33), ("A", 48), ("A", 19)}
    assert named(m.read()) == {("B", 47), ("B", 33), ("A", 48), ("A", 19)}


def test_a_clear_inside_an_open_step_keeps_its_later_rows_named():
    r2t, m = monitor()
    prefill_a_b(m)
    r2t[1, 0] = 45
    m.before_forward(A([2, 1]), A([2, 3]), A([1, 1]), request_ids=["B", "A"])  # A's two rows, not polled
    m.after_forward(A([9, 4]), A([2, 3]), A([34, 19]))
    r2t[1, 0] = 16
    m.before_forward(A([1, 2]), A([4, 3]), A([1, 1]), request_ids=["A", "B"])
    m.log.clear()
    m.after_forward(A([5, 10]), A([4, 7]), A([20, 35]))  # B's position jumps: a write row, after the clear
    found = m.poll()
    assert [(v.request, v.slot, v.reasons) for v in found] == [("B", 35, kc.FailReason.WRITE_POSITION)]


def test_the_monitors_log_hands_its_rows_out_through_the_monitor():
    r2t, m = monitor()
    prefill_a_b(m)
    with pytest.raises(RuntimeError, match=r"^kvcanary: log\.poll: .*monitor's poll\(\)"):
        m.log.poll()
    with pytest.raises(RuntimeError, match=r"^kvcanary: log\.take_copied: .*monitor's poll\(\)"):
        m.log.take_copied(m.log.count, m.log.rows(), 0)
    r2t[1, 0] = 45  # the rows stay the monitor's to hand out, named
    m.before_forward(A([1]), A([3]), A([1]), request_ids=["A"])
    m.after_forward(A([4]), A([3]), A([19]))
    assert named(m.poll()) == {("A", 45), ("A", 17)} and len(m.log.read()) == 2


@pytest.mark.parametrize("ids", [["A", "B"], None], ids=["named", "unnamed"])
def test_a_sweep_inside_an_open_step_keeps_the_steps_rows_its_own(ids):
    r2t, m = monitor()
    m.before_forward(A([1, 2]), A([0, 0]), A([3, 2]), request_ids=ids)
    chains = [kc.SweepChain(A([40]), 0, -1, key="n0"), kc.SweepChain(A([41]), 0, -1, key="n1")]
    assert m.sweep(chains) == 2  # never stamped: a row each
    m.after_forward(A([1, 2, 3, 7, 8]), A([0, 1, 2, 0, 5]), A([16, 17, 18, 32, 33]))  # B's position jumps
    found = m.poll()
    assert [(v.request, v.slot) for v in found if v.tag == kc.LaunchTag.SWEEP] == [("n0", 40), ("n1", 41)]
    write = [(v.request, v.slot, v.reasons) for v in found if v.tag == kc.LaunchTag.WRITE]
    assert write == [(None if ids is None else "B", 33, kc.FailReason.WRITE_POSITION)]


def in_thread(fn):
    """``fn()`` in a new thread; returns what it returned or the exception it raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed back to the test)
            out["error"] = e

    t = threading.Thread(target=run, name="other")
    t.start()
    t.join()
    return out.get("error", out.get("value"))


def test_a_second_thread_entering_an_open_step_is_refused():
    r2t, m = monitor()
    prefill_a_b(m)
    m.before_forward(A([1, 2]), A([3, 2]), A([1, 1]), request_ids=["A", "B"])  # this thread's step is open
    calls = {
        "before_forward": lambda: m.before_forward(A([3]), A([0]), A([1]), request_ids=["C"]),
        "after_forward": lambda: m.after_forward(A([4, 9]), A([3, 2]), A([19, 34])),
        "abort_step": m.abort_step,
        "poll": m.poll,
        "sweep": lambda: m.sweep([kc.SweepChain(A([40]), 0, -1, key="node")]),
        "import_slots": lambda: m.import_slots([50], m.canary.records[16:17].copy()),
        "read": m.read,
    }
    for name, call in calls.items():
        err = in_thread(call)
        assert isinstance(err, RuntimeError) and str(err).startswith(f"kvcanary: {name}: called from thread "
                                                                     "'other' while the step"), (name, err)
    clear = in_thread(m.log.clear)
    assert isinstance(clear, RuntimeError) and str(clear).startswith("kvcanary: ")
    assert in_thread(lambda: m.stats()["steps"]) == 2  # stats are read from any thread
    m.after_forward(A([4, 9]), A([3, 2]), A([19, 34]))  # nothing the refused calls did shows
    assert m.poll() == [] and m.stats()["logged"] == 0
    assert in_thread(lambda: (m.before_forward(A([3]), A([0]), A([1]), request_ids=["C"]),
                              m.after_forward(A([5]), A([0]), A([48])), m.poll())) == (None, None, [])


def test_threads_stepping_one_monitor_take_turns_or_are_refused():
    # Three threads, a request each, every call retried while the monitor refuses it: the steps
    # that run are whole, so the healthy requests stay clean.
    r2t, m = monitor(history=4)
    refused, other = [], []

    def retry(call):
        while True:
            try:
                return call()
            except RuntimeError as e:
                assert str(e).startswith("kvcanary: ")
                refused.append(e)

    def run(row):
        try:
            for p in range(12):
                retry(lambda: m.before_forward(A([row]), A([p]), A([1]), request_ids=[f"r{row}"]))
                m.after_forward(A([100 * row + p]), A([p]), A([16 * row + p]))  # its own step: never refused
                assert retry(m.poll) == []
        except BaseException as e:  # noqa: BLE001
            other.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=run, args=(row,)) for row in (1, 2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert other == []
    stats = m.stats()
    assert stats["steps"] == 36 and stats["logged"] == 0 and stats["slots_written"] == 36
    assert stats["slots_checked"] == 3 * sum(range(12))
