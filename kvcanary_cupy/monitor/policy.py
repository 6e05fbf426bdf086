"""What the monitor does with what it finds.

The violation policy (log, raise or a callable), the error and warning types an
engine catches, the operator-facing warnings for conditions that are not
violations (plan overflow, out-of-range plan input, writes that stamped
nothing), each reported once, and the layout of :meth:`KvCanary.stats`.
"""
from __future__ import annotations

import logging
import sys
import warnings
from typing import Callable

from .. import runtime
from ..format import COUNTER_NAMES
from ..plans import describe_input_error
from ..violations import Violation

logger = logging.getLogger("kvcanary")

_PACKAGE = __name__.rpartition(".")[0]


class KvCanaryError(RuntimeError):
    """Raised by :meth:`KvCanary.poll` under ``policy="raise"``; ``.violations`` holds the rows."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        head = str(self.violations[0]) if self.violations else "no rows"
        more = f" (and {len(self.violations) - 1} more)" if len(self.violations) > 1 else ""
        super().__init__(f"{head}{more}")


class KvCanaryWarning(UserWarning):
    """Plan overflow or out-of-range plan input, reported by the monitor."""


def check_policy(policy):
    """``"log"``, ``"raise"`` or a callable taking the list of :class:`Violation`."""
    if policy in ("log", "raise") or callable(policy):
        return policy
    raise ValueError(f"kvcanary: policy: expected 'log', 'raise' or a callable, got {policy!r}")


def apply_policy(policy: str | Callable, found: list[Violation]) -> None:
    """Hand a poll's violations to the policy."""
    if policy == "log":
        for v in found:
            logger.error("%s", v)
    elif policy == "raise":
        raise KvCanaryError(found)
    else:
        policy(found)


def warn(msg: str) -> None:
    """Log ``msg`` and warn with it (a :class:`KvCanaryWarning` pointing at the engine's call)."""
    logger.warning("%s", msg)
    warnings.warn(msg, KvCanaryWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this package, seen from :func:`warn`."""
    level, frame = 2, sys._getframe(2)  # 2: the caller of warn()
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


class Reporter:
    """Turns the counters a poll reads into warnings, each new event once.

    The device counters are cumulative; the reporter remembers, per group, how many
    overflows and input errors it has already reported, and how many skipped writes.
    """

    def __init__(self, groups):
        self._groups = tuple(groups)
        self.reset()

    def reset(self) -> None:
        """Forget what was reported (the device counters were zeroed too)."""
        self._seen = {g: {"overflows": 0, "input_errors": 0, "rows_unstamped": 0} for g in self._groups}
        self._writes_skipped = 0
        self._dropped = 0

    def dropped(self, dropped: int, capacity: int) -> None:
        """Warn about violation rows that did not fit the ring (``dropped``: cumulative)."""
        if dropped < self._dropped:  # the log was cleared: counting starts again
            self._dropped = 0
        if dropped > self._dropped:
            warn(f"kvcanary: {dropped - self._dropped} violation row(s) were dropped: the ring of {capacity} rows "
                 f"was full (stats()['dropped']; a larger ring_capacity, or polling every step, keeps them)")
            self._dropped = dropped

    def writes_skipped(self, counters) -> None:
        """Warn about writes whose plan was never planned, from the log's counter array."""
        skipped = int(counters[COUNTER_NAMES.index("writes_skipped")])
        if skipped > self._writes_skipped:
            warn(f"kvcanary: {skipped - self._writes_skipped} write(s) stamped nothing because their "
                 "write plan was never planned (stats()['writes_skipped'])")
            self._writes_skipped = skipped

    def new_overflows(self, group: str, overflows: int) -> int:
        """Overflows counted on the device but not reported yet."""
        return overflows - self._seen[group]["overflows"]

    def overflowed(self, group: str, overflows: int, *, max_requested: int, capacity: int, action: str) -> None:
        """Report the overflows found by a poll (the steps were not verified) and what was done."""
        warn(f"kvcanary: verify plan of group '{group}' overflowed in "
             f"{self.new_overflows(group, overflows)} step(s) (largest request "
             f"{max_requested} entries, capacity {capacity}); those steps were not verified "
             f"(stats()['verifies_skipped']); {action}")
        self._seen[group]["overflows"] = overflows

    def repaired(self, group: str, requested: int, capacity: int, grown: int) -> None:
        """Report an overflow repaired in the step that hit it (CPU: grown and planned again)."""
        warn(f"kvcanary: verify plan of group '{group}' overflowed: a step asked for {requested} entries, "
             f"capacity {capacity}; grown to {grown} and planned again")
        self._seen[group]["overflows"] += 1

    def input_errors(self, group: str, count: int, unstamped: int, *, first: dict | None = None, request=None,
                     page_size: int = 1) -> None:
        """Warn about batch rows dropped for out-of-range plan input (``count``: not verified,
        ``unstamped``: not stamped, both cumulative); ``first``: where the latest plan's first
        dropped row went wrong (:meth:`~kvcanary_cupy.VerifyPlan.host_first_input_error`),
        ``request`` its request id when known."""
        seen = self._seen[group]
        new, new_unstamped = count - seen["input_errors"], unstamped - seen["rows_unstamped"]
        if new > 0 or new_unstamped > 0:
            text = f"kvcanary: group '{group}': "
            if new > 0:
                text += (f"{new} live batch row(s) had out-of-range plan input (request row, lengths or a "
                         f"table/LUT entry) and were not verified (stats()['input_errors']); ")
                if first is not None:
                    text += f"in the latest step, {describe_input_error(first, request=request, page_size=page_size)}; "
            if new_unstamped > 0:
                text += (f"{new_unstamped} live batch row(s) stamped nothing: their own input was out of range, "
                         f"or they came after a row whose extend length is no span of the step's tokens "
                         f"(stats()['rows_unstamped'])")
            warn(text.rstrip("; "))
            seen["input_errors"], seen["rows_unstamped"] = count, unstamped


AGREEMENT_STATS = ("group_violations", "divergences", "agreement_steps")


def group_stats(groups, scalars) -> dict:
    """Per group, by name, from a host copy of each group's scalars (``scalars``, in the
    groups' order): ``capacity``, ``max_requested``, ``overflows``, ``input_errors``,
    ``rows_unstamped`` (see :meth:`KvCanary.stats`)."""
    per = {}
    for g, sc in zip(groups, scalars):
        c = g.counts(sc)
        per[g.name] = {"capacity": g.vp.capacity, "max_requested": c["max_requested"],
                       "overflows": c["overflows"], "input_errors": c["input_errors"],
                       "rows_unstamped": c["rows_unstamped"]}
    return per


def stats_dict(*, steps: int, aborted: int, violations: int, log, groups: dict, sweeps: int,
               sweep_entries: int, agreement: dict | None = None, chain: str, record_errors=None,
               incidents: int = 0) -> dict:
    """The dict :meth:`KvCanary.stats` returns; ``groups`` maps each group's name to its
    ``capacity``, ``max_requested``, ``overflows``, ``input_errors`` and ``rows_unstamped`` (see
    :func:`group_stats`); ``agreement`` holds the tensor-parallel counters (None: no process
    group, all 0); ``chain`` is the monitor's chain kind; ``record_errors`` the device scalar of
    the rows ``record_tokens`` skipped (None: it never ran); ``incidents``: opened so far."""
    agreement = agreement if agreement is not None else dict.fromkeys(AGREEMENT_STATS, 0)
    out = {"steps": steps, "aborted_steps": aborted, "violations": violations, "logged": log.count,
           "dropped": log.dropped,
           "overflows": sum(p["overflows"] for p in groups.values()),
           "input_errors": sum(p["input_errors"] for p in groups.values()),
           "rows_unstamped": sum(p["rows_unstamped"] for p in groups.values()),
           **log.counters(), "sweeps": sweeps, "sweep_entries": sweep_entries,
           **{k: agreement[k] for k in AGREEMENT_STATS}, "chain": chain, "groups": groups}
    out["tokens_unrecorded_rows"] = 0 if record_errors is None else int(runtime.to_host(record_errors)[0])
    out["incidents"] = incidents
    return out
