"""``python -m kvcanary_cupy report EVENTS.jsonl [--plot FILE.png]``: the summary of an events file,
its plot, and its errors, as a user meets them (subprocesses)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcanary_cupy import FailReason, LaunchTag, Violation
from kvcanary_cupy.monitor.events import EventSink
from kvcanary_cupy.monitor.incidents import IncidentFolder
from kvcanary_cupy.report import read_events, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = [sys.executable, "-m", "kvcanary_cupy"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def env(extra_path: str | None = None) -> dict:
    path = os.pathsep.join(p for p in (extra_path, ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run(*args, cwd, environ=None):
    return subprocess.run([*MODULE, *args], capture_output=True, text=True, cwd=cwd, env=environ or env(),
                          timeout=120)


def incident(step, request, slot, reasons, count=1, *, group="main", first_step=None, event="incident", **extra):
    return {"event": event, "step": step, "request": request, "group": group, "slot": slot, "position": 4,
            "reasons": reasons, "count": count, "first_step": step if first_step is None else first_step,
            "row": {}, "message": "m", **extra}


@pytest.fixture
def events_file(tmp_path):
    """Incidents of r1 (two slots, one of them ended with its final counts), of request 7, of no
    request, one in the SWA pool; a line cut short, a line of another event, a blank line."""
    lines = [
        json.dumps(incident(12, "r1", 30, ["chain"], 1)),
        json.dumps(incident(12, "r1", 31, ["chain", "token"], 2)),
        '{"event": "incident", "step": 13, "requ',  # cut short
        json.dumps(incident(15, 7, 44, ["position"], 1, group="swa")),
        "",
        json.dumps({"event": "heartbeat", "step": 16}),
        json.dumps(incident(20, None, 9, ["real_kv"], 3)),
        json.dumps(incident(25, "r1", 30, ["chain"], 9, first_step=12, last_step=24, event="incident_end")),
        "not json at all",
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_summary_per_request_per_reason_and_totals(events_file):
    s = summarize(read_events(events_file))
    assert (s.incidents, s.rows, s.open, s.first_step, s.last_step) == (4, 15, 3, 12, 24)
    assert s.invalid_lines == [3, 9] and s.skipped == 1 and s.lines == 8
    r1, r7, nobody = s.requests
    assert (r1.request, r1.first_step, r1.last_step, r1.slots, r1.incidents, r1.rows) == ("r1", 12, 24, [30, 31], 2, 11)
    assert r1.reasons == ["chain", "token"] and r1.groups == ["main"]
    assert (r7.request, r7.groups, r7.slots, r7.rows) == (7, ["swa"], [44], 1)
    assert (nobody.request, nobody.first_step, nobody.reasons) == (None, 20, ["real_kv"])
    assert s.reasons == {"chain": {"incidents": 2, "rows": 11}, "token": {"incidents": 1, "rows": 2},
                         "position": {"incidents": 1, "rows": 1}, "real_kv": {"incidents": 1, "rows": 3}}


def test_the_report_command_prints_it(events_file, tmp_path):
    out = run("report", str(events_file), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    text = out.stdout
    assert text.startswith(f"kvcanary report: {events_file}\n")
    assert "4 incidents (15 rows) in 3 requests, steps 12 to 24" in text
    assert "still open: 3" in text
    assert "not valid JSON: 2 lines (lines 3, 9)" in text
    assert "skipped: 1 line" in text
    request_rows = text.split("per request:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert request_rows[0].split() == ["request", "groups", "first", "step", "last", "step", "incidents", "rows",
                                       "reasons", "slots"]
    assert request_rows[1].split() == ['"r1"', "main", "12", "24", "2", "11", "chain+token", "30,", "31"]
    assert request_rows[2].split() == ["7", "swa", "15", "15", "1", "1", "position", "44"]
    assert request_rows[3].split() == ["(none)", "main", "20", "20", "1", "3", "real_kv", "9"]
    reason_rows = text.split("per reason:\n", 1)[1].splitlines()
    assert [r.split() for r in reason_rows] == [["reason", "incidents", "rows"], ["chain", "2", "11"],
                                                ["token", "1", "2"], ["position", "1", "1"], ["real_kv", "1", "3"]]


def test_an_empty_or_unreadable_looking_file_is_a_report_not_a_crash(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = run("report", str(empty), cwd=tmp_path)
    assert out.returncode == 0 and "no incidents (0 lines read)" in out.stdout, out.stderr
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\xff\xfe\x00 binary\n[1, 2]\n")
    out = run("report", str(garbage), cwd=tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "not valid JSON: 1 line (line 1)" in out.stdout and "skipped: 1 line" in out.stdout


def test_a_file_the_sink_wrote_reads_back(tmp_path):
    path = tmp_path / "events.jsonl"
    folder = IncidentFolder()
    divergence = Violation(tag=int(LaunchTag.TP_AGREE), slot=-1, position=2, stored_token=1, expected_token=0,
                           stored_link=1, expected_link=2, reasons=FailReason.RANK_DIVERGENCE, batch_row=-1,
                           expected_position=1)
    with EventSink(path) as sink:
        for step in range(1, 6):
            rows = [("main", Violation(tag=1, slot=30, position=4, stored_token=7, expected_token=7, stored_link=1,
                                       expected_link=2, reasons=FailReason.CHAIN, batch_row=0, expected_position=4,
                                       request=("req", 1)))]
            rows += [("main", divergence)] if step == 3 else []
            sink.emit(folder.fold(rows, step=step), step=step)
            sink.flush()
        sink.emit_end(folder.forget(("req", 1)), step=6)
    s = summarize(read_events(path))
    assert (s.incidents, s.rows, s.open, s.invalid_lines) == (2, 6, 1, [])
    req, nobody = s.requests
    assert (req.request, req.first_step, req.last_step, req.slots, req.rows) == ("('req', 1)", 1, 5, [30], 5)
    assert (nobody.request, nobody.slots, nobody.reasons) == (None, [], ["rank_divergence"])


def test_plot_writes_a_png(events_file, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    out = run("report", str(events_file), "--plot", str(png), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"plot: {png}" in out.stdout
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = run("report", str(empty), "--plot", str(tmp_path / "empty.png"), cwd=tmp_path)
    assert out.returncode == 0 and (tmp_path / "empty.png").read_bytes().startswith(PNG_SIGNATURE), out.stderr


def assert_one_line_error(out, code: int, *needles: str, usage: bool):
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    first, *rest = out.stderr.splitlines()
    assert first.startswith("kvcanary: report: "), first
    assert all(n in first for n in needles), first
    if usage:
        assert rest and rest[0].startswith("usage: python -m kvcanary_cupy report"), out.stderr
    else:
        assert rest == [], out.stderr


@pytest.mark.parametrize("args, needle", [((), "EVENTS.jsonl"), (("--bogus", "x.jsonl"), "--bogus"),
                                          (("a.jsonl", "stray"), "stray"), (("a.jsonl", "--plot"), "--plot")])
def test_misuse_exits_2_with_one_line_and_the_usage(tmp_path, args, needle):
    assert_one_line_error(run("report", *args, cwd=tmp_path), 2, needle, usage=True)


def test_a_missing_or_unreadable_file_exits_1(tmp_path):
    assert_one_line_error(run("report", "missing.jsonl", cwd=tmp_path), 1, "'missing.jsonl'", "cannot read",
                          usage=False)
    assert_one_line_error(run("report", str(tmp_path), cwd=tmp_path), 1, "cannot read", usage=False)


def test_the_plot_path_is_checked_before_any_work(events_file, tmp_path):
    bad = tmp_path / "no" / "such" / "plot.png"
    out = run("report", "missing.jsonl", "--plot", str(bad), cwd=tmp_path)  # the path wins over the missing file
    assert_one_line_error(out, 2, "--plot", "does not exist", usage=False)
    assert_one_line_error(run("report", str(events_file), "--plot", str(tmp_path), cwd=tmp_path), 2,
                          "that is a folder", usage=False)


def test_plot_without_matplotlib_says_what_to_install(events_file, tmp_path):
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    out = run("report", str(events_file), "--plot", str(tmp_path / "p.png"), cwd=tmp_path,
              environ=env(str(tmp_path / "fake")))
    assert_one_line_error(out, 2, "--plot needs matplotlib", "pip install 'kvcanary_cupy[plot]'", usage=False)
    assert not (tmp_path / "p.png").exists()
    out = run("report", str(events_file), cwd=tmp_path, environ=env(str(tmp_path / "fake")))
    assert out.returncode == 0, out.stderr  # the text report needs no matplotlib


def test_report_is_a_command_of_the_program(tmp_path):
    out = run("--help", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m kvcanary_cupy {selftest,info,report}")
    assert "  report " in out.stdout
    out = run("report", "--help", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m kvcanary_cupy report")
    assert "--plot FILE.png" in out.stdout
    out = run("reprot", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.splitlines()[0].endswith("expected selftest, info, report or --version")


def test_report_of_a_real_selftest_run(tmp_path):
    """Events made by the selftest's fault injections: the report names every injection's
    requests and reasons, and the plot is a PNG."""
    events, png = tmp_path / "events.jsonl", tmp_path / "incidents.png"
    run = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "selftest", "--backend", "numpy", "--chain", "scan",
                          "--steps", "40", "--injections", "1", "--quiet", "--events", str(events)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    assert {e["event"] for e in lines} == {"incident", "incident_end"}
    out = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "report", str(events), "--plot", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for fault in ("TableRepoint", "FreeWhileRead", "KvFlipActive", "PositionOffByOne"):
        assert f"scan:{fault}:" in out.stdout, fault
    assert "still open" not in out.stdout  # every injection's monitors closed their incidents
    for reason in ("chain", "token", "real_kv", "write_position"):
        assert reason in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
