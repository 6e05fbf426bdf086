"""What a poll's copy says beyond violation rows: the plans' counters, and what is done about them.

Every poll reads, with the ring's rows, each group's plan scalars and the log's counters.
:class:`PlanCounters` hands what is new in them to the :class:`~.policy.Reporter` as
warnings (writes that stamped nothing, verify plans that overflowed, live rows dropped for
out-of-range plan input, the latest plan's first one named with its request) and grows a
verify plan that overflowed, where that is safe.
"""
from __future__ import annotations

from .. import runtime
from .lifetime import Keepalive
from .policy import Reporter
from .requests import RequestMap


class PlanCounters:
    """A monitor's poll report on its plans.

    Args:
        groups: the monitor's groups.
        reporter: the monitor's :class:`~.policy.Reporter` (each event warned about once).
        requests: the monitor's :class:`~.requests.RequestMap` (a batch row's request, and
            whether a CUDA graph captured the plans).
        keepalive: holds a grown plan's old arrays for the step in flight.
        device: the monitor's device.
        grow_on_overflow: grow a verify plan that overflowed (see :class:`KvCanary`).
        page_size: the slot table's page size (how a dropped row's table entry is described).
    """

    def __init__(self, *, groups, reporter: Reporter, requests: RequestMap, keepalive: Keepalive, device: str,
                 grow_on_overflow: bool, page_size: int):
        self.groups, self._reporter, self._requests, self._keepalive = groups, reporter, requests, keepalive
        self.device, self.grow_on_overflow, self.page_size = device, grow_on_overflow, page_size

    def report(self, group_scalars, counters, ptr, upto_seq: int, replay_now: int) -> None:
        """Warn about what a poll's copy shows beyond violations; grow overflowed plans. The
        copy's plans are those of the newest step up to sequence ``upto_seq``."""
        self._reporter.writes_skipped(counters)
        for g, sc in zip(self.groups, group_scalars):
            c = g.counts(sc)
            if self._reporter.new_overflows(g.name, c["overflows"]) > 0:
                cap = g.vp.capacity
                action = self.after_overflow(g, c["max_requested"], ptr)
                self._reporter.overflowed(g.name, c["overflows"], max_requested=c["max_requested"], capacity=cap,
                                          action=action)
            first = c["first_input_error"]
            request = None if first is None else self._requests.step_request(first["batch_row"], upto_seq,
                                                                            replay_now)
            self._reporter.input_errors(g.name, c["input_errors"], c["rows_unstamped"], first=first,
                                        request=request, page_size=self.page_size)

    def after_overflow(self, g, max_requested: int, ptr) -> str:
        """Grow ``g``'s verify plan to hold ``max_requested`` entries where that is safe; says what was done."""
        if not self.grow_on_overflow:
            return "not grown (grow_on_overflow=False)"
        if self._requests.captured:
            return "not grown: a CUDA graph captured the plan (use verify_capacity='max')"
        if runtime.is_capturing(self.device, ptr) or max_requested <= g.vp.capacity:
            return "not grown now"
        self._keepalive.hold(g.vp)  # the step in flight may still read the old entries
        return f"grown to {g.grow(max_requested)}"
