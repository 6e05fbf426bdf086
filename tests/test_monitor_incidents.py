"""One piece of damage, one report: the monitor folds the rows a damaged slot yields at every
step into one incident, which the policy, the event file and the metrics see once."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F

A = np.array


def damaged(steps, **kw):
    """Request "a" holds 2 tokens; its table then sends position 1 to a slot nobody stamped, and
    ``steps`` decode steps read it: slot 40 (CHAIN + POSITION at every step), and the first
    step's token, stamped after slot 40's record (WRITE_POSITION once). Returns the monitor,
    the policy's calls and poll's rows."""
    calls, rows = [], []
    table = np.arange(64, dtype=np.int32).reshape(4, 16)
    kw.setdefault("policy", calls.append)
    m = kc.KvCanary(num_slots=64, req_to_token=table, max_batch=2, **kw)
    m.before_forward(A([1]), A([0]), A([2]), request_ids=["a"])
    m.after_forward(A([7, 8]), A([0, 1]), A([16, 17]))
    table[1, 1] = 40
    for k in range(steps):
        m.before_forward(A([1]), A([2 + k]), A([1]), request_ids=["a"])
        m.after_forward(A([9 + k]), A([2 + k]), A([18 + k]))
        rows += m.poll()
    return m, calls, rows


def test_the_policy_sees_one_incident_for_the_rows_of_every_step():
    m, calls, rows = damaged(5)
    assert [v.slot for v in rows] == [40, 18, 40, 40, 40, 40]  # poll: every row
    assert len(calls) == 1 and [i.slot for i in calls[0]] == [40, 18]
    inc = calls[0][0]
    assert (inc.request, inc.slot, inc.reasons, inc.first_step) == ("a", 40, F.CHAIN | F.POSITION, 2)
    assert inc.batch_row == 0 and inc.expected_position == 1  # reads like its first row
    assert "first seen at step 2" in str(inc) and "\n" not in str(inc)
    s = m.stats()
    assert (s["incidents"], s["violations"]) == (2, 6)


def test_raise_fires_once_per_incident():
    with pytest.raises(kc.KvCanaryError, match="slot 40"):
        damaged(1, policy="raise")


def test_an_incident_ends_when_no_step_reads_it_and_opens_again():
    m, calls, _ = damaged(2, incident_quiet_steps=2)
    table = m.table
    for k in range(3):  # three steps of another request: "a" is not read
        m.before_forward(A([2]), A([k]), A([1]), request_ids=["b"])
        m.after_forward(A([5]), A([k]), A([32 + k]))
        m.poll()
    m.before_forward(A([1]), A([4]), A([1]), request_ids=["a"])
    m.after_forward(A([20]), A([4]), A([20]))
    m.poll()
    assert [[i.slot for i in c] for c in calls] == [[40, 18], [40]]  # read again after a quiet spell
    assert table[1, 1] == 40


def test_events_file_holds_one_line_per_incident_and_its_end(tmp_path):
    path = tmp_path / "events.jsonl"
    m, _, _ = damaged(4, events=str(path))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(e["event"], e["slot"]) for e in lines] == [("incident", 40), ("incident", 18)]
    e = lines[0]
    assert (e["request"], e["slot"], e["group"], e["reasons"], e["first_step"]) == ("a", 40, "main",
                                                                                    ["chain", "position"], 2)
    assert e["row"]["slot"] == 40 and "slot 40" in e["message"]
    m.end_request("a")
    ends = [json.loads(x) for x in path.read_text().splitlines()[2:]]
    assert [(e["event"], e["slot"], e["count"], e["last_step"]) for e in ends] == [("incident_end", 40, 4, 5),
                                                                                  ("incident_end", 18, 1, 2)]
    out = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "report", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "40" in out.stdout and "chain" in out.stdout and "write_position" in out.stdout


def test_events_to_a_callable_and_a_named_monitor():
    got = []
    damaged(3, events=got.append, name="pool1")
    assert [(e["event"], e["group"]) for e in got] == [("incident", "pool1.main")] * 2


def test_metrics_count_rows_incidents_and_work():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    m, _, rows = damaged(3, metrics=registry)
    m.poll()
    get = registry.get_sample_value
    assert get("kvcanary_violations_total", {"reason": "chain", "group": "main"}) == sum(
        F.CHAIN in v.reasons for v in rows)
    assert get("kvcanary_incidents_total", {"reason": "chain", "group": "main"}) == 1
    s = m.stats()
    assert get("kvcanary_steps_total") == s["steps"]
    assert get("kvcanary_slots_checked_total") == s["slots_checked"]
    assert get("kvcanary_slots_written_total") == s["slots_written"]


def test_a_clean_monitor_writes_no_event(tmp_path):
    path = tmp_path / "events.jsonl"
    m = kc.KvCanary(num_slots=64, req_to_token=np.arange(64, dtype=np.int32).reshape(4, 16), max_batch=1,
                    events=str(path))
    m.before_forward(A([1]), A([0]), A([2]), request_ids=["a"])
    m.after_forward(A([7, 8]), A([0, 1]), A([16, 17]))
    m.poll()
    assert not path.exists() and m.stats()["incidents"] == 0
    m.close()


def test_bad_outputs_options_are_refused(tmp_path):
    t = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="kvcanary: events"):
        kc.KvCanary(num_slots=8, req_to_token=t, max_batch=1, events=str(tmp_path / "no" / "such" / "x.jsonl"))
    with pytest.raises(ValueError, match="kvcanary: incident_quiet_steps"):
        kc.KvCanary(num_slots=8, req_to_token=t, max_batch=1, incident_quiet_steps=0)
    with pytest.raises(TypeError, match="kvcanary: name"):
        kc.KvCanary(num_slots=8, req_to_token=t, max_batch=1, name=3)


def test_rows_dropped_from_a_full_ring_are_warned_about():
    with pytest.warns(kc.KvCanaryWarning, match=r"violation row\(s\) were dropped: the ring of 1 rows was full"):
        m, _, rows = damaged(3, ring_capacity=1)
    assert m.stats()["dropped"] > 0 and len(rows) == 1
