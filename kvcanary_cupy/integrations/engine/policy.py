"""What an adapter does with the violations its monitors found: the engine-neutral policies.

A damaged slot is found again at every step that reads it: the policy sees the
first row of each (request, layer group, slot, reasons) once; rows no request
claims are handed over every time. ``"log"`` writes each to the ``kvcanary``
logger, ``"raise"`` raises :class:`~kvcanary_cupy.KvCanaryError`, ``"cancel"``
logs and hands each affected request's rows to the engine's cancel, and a
callable gets the list.
"""
from __future__ import annotations

from typing import Callable

from ...monitor.policy import KvCanaryError
from .violations import log_all


class IncidentPolicy:
    """Dedupe a step's violations into new incidents and apply the policy to them.

    Args:
        policy: ``"log"``, ``"raise"``, ``"cancel"`` or a callable taking the list of new
            violations (objects with ``request_id``, ``group``, ``reasons`` and
            ``violation.slot``, e.g. :class:`~kvcanary_cupy.integrations.engine.violations.EngineViolation`).

    Example::

        >>> from kvcanary_cupy import FailReason, Violation
        >>> from kvcanary_cupy.integrations.engine.violations import EngineViolation, RequestTag
        >>> row = Violation(tag=1, slot=20, position=7, stored_token=5, expected_token=9, stored_link=0,
        ...                 expected_link=0, reasons=FailReason.TOKEN, batch_row=0, expected_position=3,
        ...                 request=RequestTag("r", 4))
        >>> v = EngineViolation.from_row(row, group=0, group_type="full_attention", layers=(0,), shift=0)
        >>> cancelled = []
        >>> p = IncidentPolicy("cancel")
        >>> p.new([v, v]) == [v], p.new([v])
        (True, [])
        >>> p.apply([v], cancel=lambda rid, vs: cancelled.append(rid))  # logs, then cancels
        >>> cancelled
        ['r']
    """

    def __init__(self, policy):
        self.policy = policy
        self._seen: set = set()  # (request id, group, slot, reasons) the policy has seen

    def new(self, found: list) -> list:
        """The violations of ``found`` that open an incident (all rows no request claims)."""
        out = []
        for v in found:
            key = (v.request_id, v.group, v.violation.slot, int(v.reasons))
            if v.request_id is None or key not in self._seen:
                self._seen.add(key)
                out.append(v)
        return out

    def forget_request(self, request_id) -> None:
        """A request ended: damage found later at its slots (a reused id) opens new incidents."""
        self._seen = {k for k in self._seen if k[0] != request_id}

    def apply(self, found: list, *, cancel: Callable | None = None) -> None:
        """Apply the policy to new incidents ``found``; ``cancel(request_id, violations)`` is the
        engine's per-request cancel (``"cancel"`` only). ``"raise"`` raises :class:`KvCanaryError`."""
        if not found:
            return
        policy = self.policy
        if policy == "log":
            log_all(found)
        elif policy == "raise":
            raise KvCanaryError(found)
        elif policy == "cancel":
            log_all(found)
            for rid, vs in by_request(found).items():
                if rid is not None and cancel is not None:
                    cancel(rid, vs)
        else:
            policy(found)


def by_request(found: list) -> dict:
    """``{request_id: [violations]}`` in the order the requests first appear."""
    out: dict = {}
    for v in found:
        out.setdefault(v.request_id, []).append(v)
    return out
