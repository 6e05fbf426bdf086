"""Where incidents go besides the policy: a JSON-lines event stream and Prometheus counters.

- :class:`EventSink`: one JSON object per new :class:`~kvcanary_cupy.monitor.incidents.Incident`,
  appended to a file or handed to a callable. ``python -m kvcanary_cupy report FILE``
  summarizes such a file.
- :class:`Metrics`: ``prometheus_client`` counters of rows, incidents and the monitor's
  work counters (``pip install 'kvcanary_cupy[metrics]'``). ``prometheus_client`` is
  imported when a :class:`Metrics` is made, never by ``import kvcanary_cupy``.

Both cost nothing at a clean step: with no new incident and no row they write nothing
and touch no file.

Reason names, in events and in the ``reason`` label, are the lowercase names of
:class:`~kvcanary_cupy.FailReason` bits (``"chain"``, ``"token"``, ...), as
``str(violation)`` prints them; a row without reason bits (the tensor-parallel group
notice) is ``"none"``.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import weakref
from typing import Callable, Iterable, Sequence

from ..format import VIOLATION_COLUMNS, FailReason
from ..report import output_path_problem
from ..scalars import check_int
from ..violations import Violation

# The monitor's cumulative counters Metrics mirrors: key in observe()'s ``counters`` -> counter name.
COUNTER_METRICS = {
    "slots_checked": ("kvcanary_slots_checked_total", "Canary records verified."),
    "slots_written": ("kvcanary_slots_written_total", "Canary records stamped."),
    "verifies_skipped": ("kvcanary_verifies_skipped_total",
                         "Verify runs that checked nothing because their plan was not enabled."),
    "writes_skipped": ("kvcanary_writes_skipped_total", "Write runs whose write plan was never planned."),
    "dropped": ("kvcanary_dropped_total", "Violation rows that did not fit in the ring."),
    "steps": ("kvcanary_steps_total", "Monitor steps."),
}
VIOLATIONS_METRIC = "kvcanary_violations_total"
INCIDENTS_METRIC = "kvcanary_incidents_total"
METRICS_MISSING = "kvcanary: metrics=True needs prometheus_client: pip install 'kvcanary_cupy[metrics]'"


def reason_names(reasons: FailReason) -> list[str]:
    """The lowercase names of the bits set in ``reasons`` (``["none"]`` when none is).

    Example::

        >>> from kvcanary_cupy import FailReason
        >>> from kvcanary_cupy.monitor.events import reason_names
        >>> reason_names(FailReason.CHAIN | FailReason.TOKEN), reason_names(FailReason.NONE)
        (['chain', 'token'], ['none'])
    """
    names = [m.name.lower() for m in FailReason if m and m in reasons]
    return names or ["none"]


def json_request(request):
    """``request`` as a JSON value: None, bools and strings as they are, integers (NumPy's
    too) as ints, finite reals as floats, anything else as ``str(request)``."""
    if request is None or isinstance(request, (bool, str)):
        return request
    if isinstance(request, numbers.Integral):
        return int(request)
    if isinstance(request, numbers.Real) and math.isfinite(float(request)):
        return float(request)
    return str(request)


def incident_event(incident, *, step: int, event: str = "incident") -> dict:
    """The event :meth:`EventSink.emit` (or :meth:`EventSink.emit_end`) writes for one incident.

    Args:
        incident (Incident): A new incident (:meth:`IncidentFolder.fold`), or for
            ``event="incident_end"`` one dropped by :meth:`IncidentFolder.forget`.
        step (int): The monitor step of the poll that reports it.
        event (str): ``"incident"`` (new) or ``"incident_end"`` (its final counts).

    Returns:
        dict: ``{"event", "step", "request", "group", "slot", "position", "reasons":
        [names], "count", "first_step", "last_step", "row": {column: int}, "message"}``;
        ``row`` holds the first row's columns by name (``format.VIOLATION_COLUMNS``).
    """
    v: Violation = incident.violation
    return {
        "event": event,
        "step": step,
        "request": json_request(incident.request),
        "group": incident.group,
        "slot": int(incident.slot),
        "position": int(v.position),
        "reasons": reason_names(incident.reasons),
        "count": int(incident.count),
        "first_step": int(incident.first_step),
        "last_step": int(incident.last_step),
        "row": dict(zip(VIOLATION_COLUMNS, (int(x) for x in v.as_row()))),
        "message": str(incident),
    }


class EventSink:
    """Writes one JSON object per new incident, to a JSON-lines file or to a callable.

    :meth:`emit` writes an ``"incident"`` event when an incident is new; :meth:`emit_end`,
    optional, an ``"incident_end"`` event with its final row count and last step when it
    ends (its request finished). ``python -m kvcanary_cupy report`` reads both.

    Args:
        target (str, os.PathLike or callable): A path: events are appended to that file,
            one JSON object per line (UTF-8). The file's folder must exist when the sink
            is made; the file is created on the first event. A callable: called with
            each event's dict, in :meth:`emit`.

    A file is opened in append mode only when :meth:`flush` has lines to write, and
    closed again right after: no descriptor is held between incidents, and a log
    rotated away (renamed) is followed by a new file at the path. Lines wait in memory
    between :meth:`emit` and :meth:`flush` (the monitor flushes once per poll);
    :meth:`close` flushes too.

    Example::

        >>> import json, os, tempfile
        >>> from kvcanary_cupy import FailReason, Violation
        >>> from kvcanary_cupy.monitor.events import EventSink
        >>> from kvcanary_cupy.monitor.incidents import IncidentFolder
        >>> v = Violation(tag=1, slot=30, position=4, stored_token=7, expected_token=7, stored_link=1,
        ...               expected_link=2, reasons=FailReason.CHAIN, batch_row=0, expected_position=4,
        ...               request="r1")
        >>> path = os.path.join(tempfile.mkdtemp(), "events.jsonl")
        >>> with EventSink(path) as sink:
        ...     sink.emit(IncidentFolder().fold([("main", v)], step=12), step=12)
        ...     sink.flush()
        1
        >>> event = json.loads(open(path).readline())
        >>> event["request"], event["slot"], event["reasons"], event["row"]["stored_link"]
        ('r1', 30, ['chain'], 1)
    """

    def __init__(self, target):
        self._callback: Callable[[dict], object] | None = None
        self._path: str | None = None
        if isinstance(target, (str, os.PathLike)):
            path = os.fspath(target)
            if isinstance(path, bytes):
                path = os.fsdecode(path)
            problem = output_path_problem(path)
            if problem:
                raise ValueError(f"kvcanary: events: target {path!r}: {problem}; expected the path of a file in "
                                 "an existing, writable folder")
            self._path = os.path.abspath(path)  # a later chdir of the engine must not move the log
        elif callable(target):
            self._callback = target
        else:
            raise TypeError(f"kvcanary: events: target: expected a path (str or os.PathLike) or a callable, "
                            f"got {type(target).__name__} {target!r}")
        self._pending: list[str] = []
        self._closed = False

    @property
    def path(self) -> str | None:
        """The file events go to, as an absolute path (None for a callable target)."""
        return self._path

    @property
    def closed(self) -> bool:
        return self._closed

    def emit(self, incidents: Sequence, *, step: int) -> int:
        """Write one ``"incident"`` event per incident (each new: :meth:`IncidentFolder.fold`'s result).

        Args:
            incidents (list of Incident): The new incidents of a poll; empty: nothing is done.
            step (int): The monitor step of the poll.

        Returns:
            int: The number of events written (to the callable) or queued for :meth:`flush`.
        """
        return self._write(incidents, step, "incident")

    def emit_end(self, incidents: Sequence, *, step: int) -> int:
        """Write one ``"incident_end"`` event per incident that ends: its final ``count`` and
        ``last_step``, which the ``"incident"`` event written when it was new cannot know.

        Args:
            incidents (list of Incident): Incidents that end, e.g. those
                :meth:`IncidentFolder.forget` returns for a finished request, or every
                incident of a monitor that shuts down; empty: nothing is done.
            step (int): The monitor step at which they end.

        Returns:
            int: The number of events written or queued.
        """
        return self._write(incidents, step, "incident_end")

    def _write(self, incidents: Sequence, step: int, kind: str) -> int:
        if not incidents:
            return 0
        step = check_int(step, "step")
        if self._closed:
            raise ValueError("kvcanary: events: the sink is closed; make a new EventSink")
        events = [incident_event(i, step=step, event=kind) for i in incidents]
        if self._callback is not None:
            for e in events:
                self._callback(e)
        else:
            # allow_nan=False: every line stays valid JSON for other readers (json_request keeps
            # non-finite floats out; this makes sure nothing else slips through).
            self._pending.extend(json.dumps(e, allow_nan=False) + "\n" for e in events)
        return len(events)

    def flush(self) -> None:
        """Append the lines emitted since the last flush to the file (nothing to do for a
        callable, or when nothing was emitted)."""
        if not self._pending:
            return
        lines, self._pending = self._pending, []
        try:
            with open(self._path, "a", encoding="utf-8", newline="\n") as f:
                f.writelines(lines)
        except OSError as e:
            self._pending = lines + self._pending  # kept for the next flush: events are not lost to a hiccup
            raise OSError(f"kvcanary: events: cannot append to {self._path!r}: {e.strerror or e}") from e

    def close(self) -> None:
        """Flush, then refuse further events. Closing twice is harmless."""
        if self._closed:
            return
        self.flush()
        self._closed = True

    def __enter__(self) -> "EventSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        target = self._path if self._path is not None else self._callback
        return f"EventSink({target!r})"


# One set of collectors per registry: prometheus refuses a second counter of a name in a
# registry ("Duplicated timeseries"), and two monitors of a process must add to the same
# series. Weak keys: a registry dropped by its owner takes its collectors along.
_COLLECTORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _collectors(prometheus_client, registry) -> dict:
    try:
        found = _COLLECTORS.get(registry)
    except TypeError:  # a registry that takes no weak reference: no cache, lookups below still share
        found = None
    if found is not None:
        return found
    counter = prometheus_client.Counter
    made = {
        "violations": _counter(counter, registry, VIOLATIONS_METRIC,
                               "Violation rows polled, one per row and reason bit.", ("reason", "group")),
        "incidents": _counter(counter, registry, INCIDENTS_METRIC,
                              "Incidents (rows of one piece of damage folded into one), one per reason bit.",
                              ("reason", "group")),
    }
    for key, (name, doc) in COUNTER_METRICS.items():
        made[key] = _counter(counter, registry, name, doc, ())
    try:
        _COLLECTORS[registry] = made
    except TypeError:
        pass
    return made


def _counter(counter_cls, registry, name: str, doc: str, labels: tuple):
    try:
        return counter_cls(name, doc, labelnames=labels, registry=registry)
    except ValueError:
        # Registered already, by a copy of this module (a reload) or by a Metrics of another
        # process-wide cache: take the collector the registry holds, if it is ours to share.
        existing = getattr(registry, "_names_to_collectors", {}).get(name)
        if isinstance(existing, counter_cls) and tuple(getattr(existing, "_labelnames", ())) == labels:
            return existing
        raise ValueError(f"kvcanary: registry: it already holds a metric named {name!r} that is not "
                         f"kvcanary's counter (labels {labels}); pass another registry") from None


class Metrics:
    """Prometheus counters of a monitor's rows, incidents and work.

    Args:
        registry (prometheus_client.CollectorRegistry or None): Where the counters live;
            None: ``prometheus_client.REGISTRY``, the default one its HTTP server exposes.
            The counters are made once per registry: every :class:`Metrics` on one
            registry (two monitors of a process) adds to the same series.

    Counters: ``kvcanary_violations_total`` and ``kvcanary_incidents_total`` (labels
    ``reason``, ``group``), and ``kvcanary_slots_checked_total``,
    ``kvcanary_slots_written_total``, ``kvcanary_verifies_skipped_total``,
    ``kvcanary_writes_skipped_total``, ``kvcanary_dropped_total``, ``kvcanary_steps_total``.

    Raises:
        ImportError: ``prometheus_client`` is not installed.

    Example::

        >>> import prometheus_client
        >>> from kvcanary_cupy.monitor.events import Metrics
        >>> registry = prometheus_client.CollectorRegistry()
        >>> m = Metrics(registry)
        >>> m.observe([], [], counters={"steps": 3, "slots_checked": 40})
        >>> m.observe([], [], counters={"steps": 5, "slots_checked": 40})
        >>> registry.get_sample_value("kvcanary_steps_total")
        5.0
    """

    def __init__(self, registry=None):
        try:
            import prometheus_client  # noqa: PLC0415  (only for a monitor that asks for metrics)
        except ImportError as e:
            raise ImportError(METRICS_MISSING) from e
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self._c = _collectors(prometheus_client, self.registry)
        self._last = dict.fromkeys(COUNTER_METRICS, 0)  # this object's previous totals

    def observe(self, rows: Iterable, incidents: Iterable, *, counters: dict | None = None) -> None:
        """Count one poll.

        Args:
            rows (list of (str, Violation)): The poll's rows with their group's name: one
                increment of ``kvcanary_violations_total`` per row and reason bit.
            incidents (list of Incident): The poll's new incidents: one increment of
                ``kvcanary_incidents_total`` per incident and reason bit.
            counters (dict or None): The monitor's cumulative totals, keys among
                ``slots_checked``, ``slots_written``, ``verifies_skipped``,
                ``writes_skipped``, ``dropped``, ``steps`` (other keys are ignored, so a
                whole ``KvCanary.stats()`` may be passed; a missing key leaves its counter
                alone). Each counter goes up by the difference to this object's previous
                observe; a total below the previous one (the monitor's counters were
                reset) counts as starting again from 0. None: no totals this time.
        """
        violations = self._c["violations"]
        for group, v in rows:
            for name in reason_names(v.reasons):
                violations.labels(reason=name, group=group).inc()
        incidents_c = self._c["incidents"]
        for inc in incidents:
            for name in reason_names(inc.reasons):
                incidents_c.labels(reason=name, group=inc.group).inc()
        if not counters:
            return
        for key in COUNTER_METRICS:
            if key not in counters:
                continue
            now = check_int(counters[key], f"counters[{key!r}]", minimum=0)
            before = self._last[key]
            delta = now - before if now >= before else now
            if delta:
                self._c[key].inc(delta)
            self._last[key] = now
