"""EventSink (JSON lines to a file or a callable) and Metrics (prometheus_client counters)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvcanary_cupy import FailReason, LaunchTag, Violation
from kvcanary_cupy.format import VIOLATION_COLUMNS
from kvcanary_cupy.monitor.events import EventSink, Metrics
from kvcanary_cupy.monitor.incidents import IncidentFolder

prometheus_client = pytest.importorskip("prometheus_client")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVENT_KEYS = {"event", "step", "request", "group", "slot", "position", "reasons", "count", "first_step", "row",
              "message"}


def row(slot=30, request="r1", reasons=FailReason.CHAIN, *, position=4):
    return Violation(tag=int(LaunchTag.VERIFY), slot=slot, position=position, stored_token=7, expected_token=8,
                     stored_link=-5, expected_link=2, reasons=reasons, batch_row=1, expected_position=position,
                     request=request)


def lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_a_file_gets_one_json_line_per_new_incident(tmp_path):
    path = tmp_path / "events.jsonl"
    folder, sink = IncidentFolder(), EventSink(path)
    assert sink.path == str(path)
    reported = []
    for step in range(10, 15):  # the same two damaged slots every step, a third from step 13
        rows = [("main", row()), ("main", row(31, reasons=FailReason.CHAIN | FailReason.TOKEN))]
        rows += [("swa", row(5, None))] if step >= 13 else []
        new = folder.fold(rows, step=step)
        reported += new
        assert sink.emit(new, step=step) == len(new)
        sink.flush()
        assert len(lines(path)) == (2 if step < 13 else 3)  # flushed each poll, nothing for repeats
    events = lines(path)
    assert all(EVENT_KEYS <= set(e) for e in events)
    first, second, third = events
    assert first["event"] == "incident" and first["step"] == 10 and first["first_step"] == 10
    assert (first["request"], first["group"], first["slot"], first["position"]) == ("r1", "main", 30, 4)
    assert first["reasons"] == ["chain"] and second["reasons"] == ["chain", "token"]
    assert first["count"] == 1
    assert first["row"] == dict(zip(VIOLATION_COLUMNS, row().as_row()))
    assert first["row"]["stored_link"] == -5 and first["row"]["fail_bits"] == int(FailReason.CHAIN)
    assert [e["message"] for e in events] == [str(i) for i in reported]
    assert first["message"].startswith(str(row())) and "first seen at step 10" in first["message"]
    assert (third["request"], third["group"], third["step"]) == (None, "swa", 13)
    sink.close()
    assert sink.closed
    with pytest.raises(ValueError, match="kvcanary: events: the sink is closed"):
        sink.emit(folder.incidents, step=20)


def test_a_clean_step_touches_no_file_and_an_existing_file_is_appended_to(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = EventSink(str(path))
    assert sink.emit([], step=1) == 0
    sink.flush()
    assert not path.exists()  # nothing new: nothing written, not even an empty file
    path.write_text('{"event": "earlier"}\n')
    sink.emit(IncidentFolder().fold([("main", row())], step=2), step=2)
    assert path.read_text() == '{"event": "earlier"}\n'  # queued until the poll's flush
    sink.flush()
    assert [e["event"] for e in lines(path)] == ["earlier", "incident"]
    sink.close()
    sink.close()  # twice is harmless


def test_a_callable_gets_one_dict_per_new_incident():
    got = []
    sink = EventSink(got.append)
    folder = IncidentFolder()
    sink.emit(folder.fold([("main", row()), ("main", row(31))], step=3), step=3)
    sink.emit(folder.fold([("main", row()), ("main", row(31))], step=4), step=4)
    sink.flush()
    assert [(e["slot"], e["step"]) for e in got] == [(30, 3), (31, 3)]
    assert all(EVENT_KEYS <= set(e) for e in got)
    assert json.loads(json.dumps(got[0])) == got[0]  # every value a JSON value


def test_incident_end_records_the_final_counts():
    got = []
    sink, folder = EventSink(got.append), IncidentFolder()
    for step in range(3):
        sink.emit(folder.fold([("main", row())], step=step), step=step)
    assert sink.emit_end(folder.forget("r1"), step=5) == 1
    assert [(e["event"], e["count"], e["first_step"], e["last_step"], e["step"]) for e in got] == [
        ("incident", 1, 0, 0, 0), ("incident_end", 3, 0, 2, 5)]
    assert sink.emit_end([], step=6) == 0


@pytest.mark.parametrize("request_id, written", [
    ("r1", "r1"), (7, 7), (np.int64(7), 7), (None, None), (2.5, 2.5), (float("nan"), "nan"),
    (("a", 1), "('a', 1)"), (b"id", "b'id'"),
])
def test_request_ids_that_are_not_json_types_are_written_as_str(tmp_path, request_id, written):
    path = tmp_path / "events.jsonl"
    with EventSink(path) as sink:
        sink.emit(IncidentFolder().fold([("main", row(request=request_id))], step=1), step=1)
    (event,) = lines(path)  # close() flushed
    assert event["request"] == written and type(event["request"]) is type(written)


def test_a_bad_target_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"^kvcanary: events: target .*does not exist"):
        EventSink(tmp_path / "no" / "such" / "events.jsonl")
    with pytest.raises(ValueError, match=r"^kvcanary: events: target .*that is a folder"):
        EventSink(tmp_path)
    with pytest.raises(TypeError, match=r"^kvcanary: events: target: expected a path"):
        EventSink(42)


# --- Metrics ---------------------------------------------------------------------------
def value(registry, name, **labels):
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_metrics_count_rows_and_incidents_by_reason_and_group():
    registry = prometheus_client.CollectorRegistry()
    m, folder = Metrics(registry), IncidentFolder()
    rows = [("main", row()), ("main", row(31, reasons=FailReason.CHAIN | FailReason.TOKEN)), ("swa", row(5))]
    m.observe(rows, folder.fold(rows, step=1), counters=None)
    m.observe(rows, folder.fold(rows, step=2), counters=None)  # repeats: rows count, incidents do not
    assert value(registry, "kvcanary_violations_total", reason="chain", group="main") == 4
    assert value(registry, "kvcanary_violations_total", reason="token", group="main") == 2
    assert value(registry, "kvcanary_violations_total", reason="chain", group="swa") == 2
    assert value(registry, "kvcanary_incidents_total", reason="chain", group="main") == 2
    assert value(registry, "kvcanary_incidents_total", reason="token", group="main") == 1
    assert value(registry, "kvcanary_incidents_total", reason="chain", group="swa") == 1
    notice = Violation.group_notice(other_rows=2, unheld_divergences=0, agreement_step=1)
    m.observe([("main", notice)], [], counters=None)
    assert value(registry, "kvcanary_violations_total", reason="none", group="main") == 1


def test_metrics_counters_go_up_by_the_difference_to_the_previous_observe():
    registry = prometheus_client.CollectorRegistry()
    m = Metrics(registry)
    m.observe([], [], counters={"slots_checked": 100, "slots_written": 10, "verifies_skipped": 0,
                                "writes_skipped": 1, "dropped": 0, "steps": 2})
    m.observe([], [], counters={"slots_checked": 150, "slots_written": 10, "verifies_skipped": 0,
                                "writes_skipped": 1, "dropped": 3, "steps": 3, "chain": "scan"})  # extra keys ignored
    assert value(registry, "kvcanary_slots_checked_total") == 150
    assert value(registry, "kvcanary_slots_written_total") == 10
    assert value(registry, "kvcanary_writes_skipped_total") == 1
    assert value(registry, "kvcanary_dropped_total") == 3
    assert value(registry, "kvcanary_steps_total") == 3
    m.observe([], [], counters={"steps": 4})  # a missing key leaves its counter alone
    m.observe([], [], counters={"steps": 1})  # the monitor's counters restarted: 1 more step
    assert value(registry, "kvcanary_steps_total") == 5 and value(registry, "kvcanary_slots_checked_total") == 150
    with pytest.raises(TypeError, match=r"kvcanary: counters\['steps'\]"):
        m.observe([], [], counters={"steps": 2.5})


def test_two_metrics_on_one_registry_share_the_series():
    registry = prometheus_client.CollectorRegistry()
    a, b = Metrics(registry), Metrics(registry)  # two monitors of one process: no "Duplicated timeseries"
    a.observe([("main", row())], [], counters={"steps": 10})
    b.observe([("main", row())], [], counters={"steps": 4})
    a.observe([], [], counters={"steps": 11})
    assert value(registry, "kvcanary_steps_total") == 15  # each adds its own differences
    assert value(registry, "kvcanary_violations_total", reason="chain", group="main") == 2
    other = prometheus_client.CollectorRegistry()
    Metrics(other).observe([], [], counters={"steps": 1})
    assert value(other, "kvcanary_steps_total") == 1 and value(registry, "kvcanary_steps_total") == 15


def test_metrics_use_the_default_registry_when_none_is_given():
    m = Metrics()
    before = value(prometheus_client.REGISTRY, "kvcanary_steps_total")
    m.observe([], [], counters={"steps": 2})
    assert m.registry is prometheus_client.REGISTRY
    assert value(prometheus_client.REGISTRY, "kvcanary_steps_total") == before + 2
    Metrics()  # a second one on the default registry is fine too


def test_metrics_without_prometheus_client_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    with pytest.raises(ImportError) as e:
        Metrics()
    assert str(e.value) == "kvcanary: metrics=True needs prometheus_client: pip install 'kvcanary_cupy[metrics]'"


def test_importing_the_package_and_these_modules_pulls_in_neither_prometheus_nor_matplotlib():
    code = ("import sys, kvcanary_cupy, kvcanary_cupy.monitor.events, kvcanary_cupy.monitor.incidents, "
            "kvcanary_cupy.report, kvcanary_cupy.__main__;"
            "bad = [m for m in ('prometheus_client', 'matplotlib') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
