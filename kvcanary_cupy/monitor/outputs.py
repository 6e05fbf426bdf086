"""What a monitor's poll hands on beyond its rows: incidents, events and metrics.

A damaged slot is found again at every step that reads it. :class:`Outputs` folds a
poll's rows into incidents (:mod:`~kvcanary_cupy.monitor.incidents`), hands the new ones
to the event sink and the policy, ends incidents no step has seen for a while, and keeps
the Prometheus counters (:mod:`~kvcanary_cupy.monitor.events`). A clean step with no
open incident costs a couple of attribute reads; nothing here touches the device.
"""
from __future__ import annotations

from ..format import COUNTER_NAMES, LaunchTag
from ..scalars import check_int
from .events import EventSink, Metrics
from .incidents import Incident, IncidentFolder

_SWA_TAGS = frozenset((int(LaunchTag.VERIFY_SWA), int(LaunchTag.WRITE_SWA)))


class Outputs:
    """A monitor's incidents, event sink and metrics.

    Args:
        events: None, a path (str or os.PathLike: JSON lines appended, see
            :class:`EventSink`) or a callable taking one event dict.
        metrics: False, True (counters in prometheus_client's default registry) or a
            ``prometheus_client.CollectorRegistry``.
        quiet_steps: steps without a row after which an incident ends (an
            ``incident_end`` event); a later row at its slot is then a new incident.
        name: a label for the monitor's groups in events and metrics (``"name.main"``);
            "" for none.
    """

    def __init__(self, *, events=None, metrics=False, quiet_steps: int = 64, name: str = ""):
        self.folder = IncidentFolder()
        self.sink = None if events is None else EventSink(events)
        if metrics is True:
            self.metrics = Metrics()
        elif metrics is False or metrics is None:
            self.metrics = None
        else:
            self.metrics = Metrics(metrics)
        self.quiet_steps = check_int(quiet_steps, "incident_quiet_steps", minimum=1)
        if not isinstance(name, str):
            raise TypeError(f"kvcanary: name: expected a str, got {type(name).__name__}")
        self._prefix = f"{name}." if name else ""
        self.incidents = 0  # incidents opened so far

    def group_of(self, violation) -> str:
        """The name of the group (watched pool) whose launch logged ``violation``."""
        return self._prefix + ("swa" if violation.tag in _SWA_TAGS else "main")

    def take(self, rows: list, *, step: int, counters=None, dropped: int = 0) -> list[Incident]:
        """One poll's rows (mapped :class:`~kvcanary_cupy.Violation` s): the incidents they
        open, after the events and metrics saw them. ``counters``: the log's counter array as
        the poll copied it, ``dropped``: rows past the ring so far (for the metrics)."""
        grouped = [(self.group_of(v), v) for v in rows] if rows else []
        new = self.folder.fold(grouped, step=step) if grouped else []
        ended = self.folder.expire(step=step, quiet=self.quiet_steps) if len(self.folder) else []
        self.incidents += len(new)
        if self.sink is not None and (new or ended):
            self.sink.emit(new, step=step)
            self.sink.emit_end(ended, step=step)
            self.sink.flush()
        if self.metrics is not None:
            totals = None
            if counters is not None:
                totals = {k: int(counters[COUNTER_NAMES.index(k)]) for k in
                          ("slots_checked", "slots_written", "verifies_skipped", "writes_skipped")}
                totals.update(dropped=int(dropped), steps=int(step))
            self.metrics.observe(grouped, new, counters=totals)
        return new

    def end_request(self, request, *, step: int) -> list[Incident]:
        """Close the incidents of a finished request (its slots may be reused)."""
        ended = self.folder.forget(request)
        if self.sink is not None and ended:
            self.sink.emit_end(ended, step=step)
            self.sink.flush()
        return ended

    def close(self, *, step: int) -> None:
        """End every open incident (an ``incident_end`` event each) and close the sink."""
        if self.sink is None or self.sink.closed:
            return
        ended = self.folder.incidents
        self.folder.clear()
        self.sink.emit_end(ended, step=step)
        self.sink.close()
