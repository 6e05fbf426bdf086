"""``python -m kvcanary_cupy report EVENTS.jsonl [--plot FILE.png]``: what an events file says.

An :class:`~kvcanary_cupy.monitor.events.EventSink` appends one JSON object per new
incident to a file (``"incident"``), and, when the monitor tells it, one per incident
that ends with its final row count and last step (``"incident_end"``). After an
incident a person wants to know which requests were hit, where, why and since when;
:func:`summarize` and :func:`format_report` say it per request, per reason and in
total, and :func:`plot_timeline` draws new incidents per step by reason (matplotlib,
``pip install 'kvcanary_cupy[plot]'``; imported only for a plot).

A line that is not valid JSON (a line cut short by a crash, a stray write) is counted
and named in the report, never fatal; a valid JSON line that is no incident event
(another kind of event, or one lacking a field) is counted as skipped.

An incident without an ``"incident_end"`` event (still open when the file ends, or a
monitor that writes none) counts the rows and last step known when it was reported:
the sink writes it once, so the rows found again at later steps are not in the file.

Example::

    >>> import json, os, tempfile
    >>> from kvcanary_cupy.report import format_report, read_events, summarize
    >>> path = os.path.join(tempfile.mkdtemp(), "events.jsonl")
    >>> event = {"event": "incident", "step": 12, "request": "r1", "group": "main", "slot": 30,
    ...          "position": 4, "reasons": ["chain"], "count": 1, "first_step": 12}
    >>> end = {**event, "event": "incident_end", "step": 18, "count": 7, "last_step": 18}
    >>> with open(path, "w") as f:
    ...     _ = f.write(json.dumps(event) + "\\n" + "{not json\\n" + json.dumps(end) + "\\n")
    >>> s = summarize(read_events(path))
    >>> s.incidents, s.rows, s.invalid_lines, s.requests[0].last_step, s.requests[0].slots
    (1, 7, [2], 18, [30])
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from .cli import CliParser, output_path_problem

MODULE_PROG = "python -m kvcanary_cupy report"
DESCRIPTION = ("Summarize an events file that kvcanary's EventSink wrote (one JSON object per new incident, and "
               "per incident that ended): per request its first and last step, slots, reasons, incidents and "
               "rows, then per reason and in total. Lines that are not valid JSON are counted and named. Exits 0 "
               "on success, 2 on misuse, 1 when the file cannot be read.")
PLOT_MISSING = "pip install 'kvcanary_cupy[plot]'"
EVENT_KINDS = ("incident", "incident_end")
NO_REQUEST = "(none)"  # how a request-less incident (no ids, or a tensor-parallel agreement row) is listed
MAX_SLOTS_SHOWN = 8  # slots listed per request before "+N more"
MAX_LINES_NAMED = 5  # invalid line numbers named before "..."


@dataclass
class EventFile:
    """The lines of an events file, sorted out.

    Attributes:
        path (str): The file read.
        events (list of dict): The incident events (``"incident"`` and ``"incident_end"``),
            in file order.
        lines (int): Lines read that are not blank.
        invalid_lines (list of int): Line numbers (1-based) that are not valid JSON.
        skipped (int): Valid JSON lines that are not a well-formed incident event.
    """

    path: str
    events: list = field(default_factory=list)
    lines: int = 0
    invalid_lines: list = field(default_factory=list)
    skipped: int = 0


@dataclass
class IncidentRecord:
    """One incident as the file tells it: its ``"incident"`` event, updated by its
    ``"incident_end"`` event when there is one.

    Attributes:
        request (object): The request id (a JSON value), or None.
        group (str): Its group.
        slot (int): Its slot (-1: a tensor-parallel agreement incident).
        reasons (list of str): Its reason names.
        first_step (int): The step its first row was seen at.
        reported_step (int): The step of the poll that reported it as new.
        last_step (int): The latest step the file knows a row of it at.
        rows (int): The rows the file knows were folded into it.
        ended (bool): An ``"incident_end"`` event gave its final counts.
    """

    request: object
    group: str
    slot: int
    reasons: list
    first_step: int
    reported_step: int
    last_step: int
    rows: int
    ended: bool = False


@dataclass
class RequestSummary:
    """The incidents of one request (or of none: ``request`` None).

    Attributes:
        request (object): The request id as the file holds it (a JSON value), or None.
        groups (list of str): The groups its incidents came from, first seen first.
        first_step (int): The earliest step a row of it was seen at.
        last_step (int): The latest step the file knows a row of it at.
        slots (list of int): The slots of its incidents, sorted (agreement rows name none).
        reasons (list of str): The reason names of its incidents, first seen first.
        incidents (int): Its incidents.
        rows (int): The rows folded into them, as far as the file knows.
    """

    request: object
    groups: list
    first_step: int
    last_step: int
    slots: list
    reasons: list
    incidents: int = 0
    rows: int = 0


@dataclass
class Summary:
    """What an events file says (:func:`summarize`).

    Attributes:
        path (str): The file read.
        incident_records (list of IncidentRecord): Every incident, in file order.
        requests (list of RequestSummary): Per request, by first step.
        reasons (dict): Reason name -> ``{"incidents": int, "rows": int}`` (an incident with
            two reasons counts under each), most incidents first.
        incidents (int), rows (int): Totals.
        open (int): Incidents without an ``"incident_end"`` event.
        first_step (int or None), last_step (int or None): The steps the incidents span.
        lines (int): Lines read that are not blank.
        invalid_lines (list of int): Line numbers that are not valid JSON.
        skipped (int): Valid JSON lines that are no incident event.
    """

    path: str
    incident_records: list
    requests: list
    reasons: dict
    incidents: int
    rows: int
    open: int
    first_step: int | None
    last_step: int | None
    lines: int
    invalid_lines: list
    skipped: int


def read_events(path) -> EventFile:
    """Read an events file; bad lines are counted, not raised.

    Args:
        path (str or os.PathLike): A JSON-lines file, as :class:`EventSink` writes it.

    Returns:
        EventFile: Its incident events and what else it held.

    Raises:
        OSError: The file cannot be opened or read.
    """
    out = EventFile(path=os.fspath(path))
    # Bytes, decoded line by line: a line with bytes that are not UTF-8 is one invalid line,
    # not a decode error that loses the whole file.
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            text = raw.decode("utf-8", errors="replace").strip()
            if not text:
                continue
            out.lines += 1
            try:
                obj = json.loads(text)
            except ValueError:
                out.invalid_lines.append(number)
                continue
            if _is_incident_event(obj):
                out.events.append(obj)
            else:
                out.skipped += 1
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_incident_event(obj) -> bool:
    return (isinstance(obj, dict) and obj.get("event") in EVENT_KINDS
            and all(_is_int(obj.get(k)) for k in ("step", "first_step", "count", "slot"))
            and _is_int(obj.get("last_step", 0))
            and isinstance(obj.get("group"), str)
            and isinstance(obj.get("reasons"), list) and all(isinstance(r, str) for r in obj["reasons"]))


def _json_key(value) -> str:
    # 1 and "1" are different requests; json.dumps keeps them apart and hashes lists and dicts.
    return json.dumps(value, sort_keys=True)


def incident_records(events: EventFile) -> list[IncidentRecord]:
    """The incidents of an events file, each ``"incident"`` event merged with its
    ``"incident_end"`` (same request, group, slot, reasons and first step).

    Args:
        events (EventFile): What :func:`read_events` returned.

    Returns:
        list[IncidentRecord]: In file order (an end without its start, from a file that
        begins mid-run, counts as an incident of its own).
    """
    table: dict[tuple, IncidentRecord] = {}
    for e in events.events:
        reasons = list(e["reasons"]) or ["none"]
        key = (_json_key(e.get("request")), e["group"], e["slot"], tuple(reasons), e["first_step"])
        last = max(e["step"] if e["event"] == "incident" else e["first_step"], e.get("last_step", e["first_step"]))
        rec = table.get(key)
        if rec is None:
            rec = table[key] = IncidentRecord(request=e.get("request"), group=e["group"], slot=e["slot"],
                                              reasons=reasons, first_step=e["first_step"], reported_step=e["step"],
                                              last_step=last, rows=e["count"])
        else:
            rec.last_step, rec.rows = max(rec.last_step, last), max(rec.rows, e["count"])
        if e["event"] == "incident_end":
            rec.ended = True
    return list(table.values())


def summarize(events: EventFile) -> Summary:
    """Per request, per reason and in total (see :class:`Summary`).

    Args:
        events (EventFile): What :func:`read_events` returned.

    Returns:
        Summary: The summary :func:`format_report` prints.
    """
    records = incident_records(events)
    per: dict[str, RequestSummary] = {}
    reasons: dict[str, dict] = {}
    for rec in records:
        key = _json_key(rec.request)
        r = per.get(key)
        if r is None:
            r = per[key] = RequestSummary(request=rec.request, groups=[], first_step=rec.first_step,
                                          last_step=rec.last_step, slots=[], reasons=[])
        r.first_step, r.last_step = min(r.first_step, rec.first_step), max(r.last_step, rec.last_step)
        r.incidents += 1
        r.rows += rec.rows
        if rec.group not in r.groups:
            r.groups.append(rec.group)
        if rec.slot >= 0 and rec.slot not in r.slots:
            r.slots.append(rec.slot)
        for name in rec.reasons:
            if name not in r.reasons:
                r.reasons.append(name)
            tally = reasons.setdefault(name, {"incidents": 0, "rows": 0})
            tally["incidents"] += 1
            tally["rows"] += rec.rows
    requests = sorted(per.values(), key=lambda r: r.first_step)  # stable: file order breaks ties
    for r in requests:
        r.slots.sort()
    return Summary(path=events.path, incident_records=records, requests=requests,
                   reasons=dict(sorted(reasons.items(), key=lambda kv: -kv[1]["incidents"])),
                   incidents=len(records), rows=sum(r.rows for r in records),
                   open=sum(not r.ended for r in records),
                   first_step=min((r.first_step for r in records), default=None),
                   last_step=max((r.last_step for r in records), default=None),
                   lines=events.lines, invalid_lines=list(events.invalid_lines), skipped=events.skipped)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return ["  " + "  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *rows]]


def _show_request(request) -> str:
    return NO_REQUEST if request is None else json.dumps(request, sort_keys=True)


def _show_slots(slots: list) -> str:
    if not slots:
        return "-"
    shown = ", ".join(str(s) for s in slots[:MAX_SLOTS_SHOWN])
    return shown + (f" (+{len(slots) - MAX_SLOTS_SHOWN} more)" if len(slots) > MAX_SLOTS_SHOWN else "")


def format_report(summary: Summary) -> str:
    """The report a person reads, as text (several lines, ending with a newline).

    Args:
        summary (Summary): What :func:`summarize` returned.

    Returns:
        str: A headline with the totals, the lines that could not be read, then a table
        per request and one per reason.
    """
    out = [f"kvcanary report: {summary.path}"]
    if summary.incidents:
        out.append(f"{_plural(summary.incidents, 'incident')} ({_plural(summary.rows, 'row')}) in "
                   f"{_plural(len(summary.requests), 'request')}, steps {summary.first_step} to {summary.last_step}")
        if summary.open:
            out.append(f"still open: {summary.open} (no incident_end event: rows and last step as known when "
                       "reported)")
    else:
        out.append(f"no incidents ({_plural(summary.lines, 'line')} read)")
    if summary.invalid_lines:
        named = ", ".join(str(n) for n in summary.invalid_lines[:MAX_LINES_NAMED])
        more = ", ..." if len(summary.invalid_lines) > MAX_LINES_NAMED else ""
        which = "line" if len(summary.invalid_lines) == 1 else "lines"
        out.append(f"not valid JSON: {_plural(len(summary.invalid_lines), 'line')} ({which} {named}{more})")
    if summary.skipped:
        out.append(f"skipped: {_plural(summary.skipped, 'line')} of valid JSON that is no incident event")
    if not summary.incidents:
        return "\n".join(out) + "\n"
    out += ["", "per request:"]
    out += _table(["request", "groups", "first step", "last step", "incidents", "rows", "reasons", "slots"],
                  [[_show_request(r.request), ",".join(r.groups), str(r.first_step), str(r.last_step),
                    str(r.incidents), str(r.rows), "+".join(r.reasons), _show_slots(r.slots)]
                   for r in summary.requests])
    out += ["", "per reason:"]
    out += _table(["reason", "incidents", "rows"],
                  [[name, str(t["incidents"]), str(t["rows"])] for name, t in summary.reasons.items()])
    return "\n".join(out) + "\n"


def load_matplotlib():
    """matplotlib's Figure and Agg canvas (no pyplot, no global backend switch).

    Raises:
        ImportError: ``kvcanary: report: --plot needs matplotlib: pip install 'kvcanary_cupy[plot]'``.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"kvcanary: report: --plot needs matplotlib: {PLOT_MISSING}") from e
    return Figure, FigureCanvasAgg


def plot_timeline(events: EventFile, path) -> None:
    """Draw new incidents per step (the step of the poll that reported each), stacked by
    reason, into a PNG file.

    Args:
        events (EventFile): What :func:`read_events` returned.
        path (str or os.PathLike): The PNG file to write (replaced if it exists).

    Raises:
        ImportError: matplotlib is not installed (the message says what to install).
        OSError: The file cannot be written.
    """
    Figure, FigureCanvasAgg = load_matplotlib()
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    per_step: dict[str, dict[int, int]] = {}
    for rec in incident_records(events):
        for name in rec.reasons:
            steps = per_step.setdefault(name, {})
            steps[rec.reported_step] = steps.get(rec.reported_step, 0) + 1
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    all_steps = sorted({s for steps in per_step.values() for s in steps})
    if all_steps:
        bottom = dict.fromkeys(all_steps, 0)
        for name in sorted(per_step, key=lambda n: -sum(per_step[n].values())):
            heights = [per_step[name].get(s, 0) for s in all_steps]
            ax.bar(all_steps, heights, bottom=[bottom[s] for s in all_steps], label=name, width=0.9)
            for s, h in zip(all_steps, heights):
                bottom[s] += h
        ax.set_ylim(0, 1.08 * max(bottom.values()))  # the stacks' tops, not the first bar's
        ax.legend(title="reason", loc="upper right")
    else:
        ax.text(0.5, 0.5, "no incidents", ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("monitor step")
    ax.set_ylabel("new incidents per reason")  # one with two reasons counts under each
    ax.set_title(f"kvcanary incidents: {os.path.basename(events.path)}")
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")


def main(argv=None, prog: str = MODULE_PROG) -> int:
    """Run the ``report`` command; returns the exit status (0 done, 2 misuse, 1 unreadable file).

    Args:
        argv (list of str or None): The arguments after ``report`` (None: ``sys.argv[1:]``).
        prog (str): The program name usage lines show.

    Example::

        >>> from kvcanary_cupy.report import main
        >>> main(["/nonexistent/events.jsonl"])  # doctest: +SKIP
        1
    """
    ap = CliParser(prog=prog, command="report", description=DESCRIPTION, usage="%(prog)s [-h] [--plot FILE.png] EVENTS.jsonl")
    # Optional to argparse, required here: so that an unknown option is named before a missing file.
    ap.add_argument("events", metavar="EVENTS.jsonl", nargs="?",
                    help="the events file (JSON lines) an EventSink wrote")
    ap.add_argument("--plot", metavar="FILE.png",
                    help="also draw new incidents per step by reason into this PNG file (needs matplotlib: "
                         f"{PLOT_MISSING})")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.events is None:
        ap.error("the following arguments are required: EVENTS.jsonl")
    if args.plot is not None:
        problem = output_path_problem(args.plot)
        if problem:
            print(f"kvcanary: report: --plot {args.plot!r}: {problem}; expected the path of a file in an existing, "
                  "writable folder (checked before reading the events)", file=sys.stderr)
            return 2
        try:
            load_matplotlib()
        except ImportError as e:
            print(str(e), file=sys.stderr)
            return 2
    try:
        events = read_events(args.events)
    except OSError as e:
        print(f"kvcanary: report: EVENTS.jsonl {args.events!r}: cannot read it ({e.strerror or e})", file=sys.stderr)
        return 1
    print(format_report(summarize(events)), end="")
    if args.plot is not None:
        try:
            plot_timeline(events, args.plot)
        except OSError as e:
            print(f"kvcanary: report: --plot {args.plot!r}: cannot write it ({e.strerror or e})", file=sys.stderr)
            return 1
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(prog=MODULE_PROG))
