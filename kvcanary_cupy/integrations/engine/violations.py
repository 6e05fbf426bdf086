"""Violations in the engine's terms, and what the watch does with them.

A monitor's row names a batch row and a canary slot; the adapter hands each
step's request ids to the monitors as :class:`RequestTag` s, so every row comes
back naming the engine's ``request_id`` and the step that found it, and turns it
into an :class:`EngineViolation`: request, position, layer group, reasons, the
engine's cache row.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import NamedTuple

from ...format import FailReason, LaunchTag
from ...violations import Violation

logger = logging.getLogger("kvcanary")


class RequestTag(NamedTuple):
    """What a monitor reports as a violation's request: the engine's request id and the
    adapter's step number (the step whose launch found it)."""

    request_id: object
    step: int


def request_tags(request_ids: list, step: int) -> list:
    """``[RequestTag(rid, step) for rid in request_ids]``, built without a Python loop: what
    ``RequestTag(rid, step)`` does, without its Python-level ``__new__`` (a step tags every request).

    Example::

        >>> request_tags(["a", "b"], 3)
        [RequestTag(request_id='a', step=3), RequestTag(request_id='b', step=3)]
    """
    return list(map(tuple.__new__, itertools.repeat(RequestTag), zip(request_ids, itertools.repeat(step))))


@dataclasses.dataclass(frozen=True)
class EngineViolation:
    """A violation in the engine's terms. ``str(v)`` is one line an operator can act on.

    Attributes:
        request_id: the engine's request id (None when the row could not be mapped).
        position: the position the step read (or wrote) in that request.
        group: the layer group's index in the engine's cache.
        group_type: ``"full_attention"`` or ``"sliding_attention"``.
        layers: the model layers of the group.
        reasons: :class:`~kvcanary_cupy.FailReason` bits.
        step: the watch's step number whose launch found it (1 = the first step the
            watch saw; None when unknown).
        engine_row: the engine cache row (``block * block_size + offset``) checked, -1
            when the slot lies outside the engine's cache.
        launch: the launch that found it: ``"verify"``, ``"write"``, ``"verify_after"``, ``"sweep"``.
        violation: the monitor's :class:`~kvcanary_cupy.Violation` row.

    Example::

        >>> from kvcanary_cupy import Violation, FailReason
        >>> row = Violation(tag=1, slot=20, position=7, stored_token=5, expected_token=9, stored_link=0,
        ...                 expected_link=0, reasons=FailReason.TOKEN, batch_row=0, expected_position=3,
        ...                 request=RequestTag("req_2", 4))
        >>> v = EngineViolation.from_row(row, group=0, group_type="full_attention", layers=(0, 1), shift=16)
        >>> v.request_id, v.position, v.engine_row, v.step
        ('req_2', 3, 4, 4)
    """

    request_id: object
    position: int
    group: int
    group_type: str
    layers: tuple
    reasons: FailReason
    step: int | None
    engine_row: int
    launch: str
    violation: Violation = dataclasses.field(repr=False)

    @classmethod
    def from_row(cls, v: Violation, *, group: int, group_type: str, layers: tuple, shift: int,
                 engine_rows: int | None = None) -> "EngineViolation":
        tag = v.request if isinstance(v.request, RequestTag) else None
        row = v.slot - shift
        if row < 0 or (engine_rows is not None and row >= engine_rows):
            row = -1
        try:
            launch = LaunchTag(v.tag).name.lower()
        except ValueError:
            launch = f"tag {v.tag}"
        return cls(request_id=tag.request_id if tag else v.request, step=tag.step if tag else None,
                   position=v.expected_position if v.expected_position >= 0 else v.position, group=group,
                   group_type=group_type, layers=tuple(layers), reasons=v.reasons, engine_row=row, launch=launch,
                   violation=v)

    def __str__(self) -> str:
        v = self.violation
        what = f"expected token {'-1 (not checked)' if v.expected_token == -1 else v.expected_token} position " \
               f"{v.expected_position}, found token {v.stored_token} position {v.position}"
        where = f"engine cache row {self.engine_row}" if self.engine_row >= 0 else f"canary slot {v.slot}"
        return (f"kvcanary violation [{self.reasons.describe()}] request {self.request_id!r} position {self.position}, "
                f"layer group {self.group} ({self.group_type}, layers {', '.join(map(str, self.layers))}), {where}, "
                f"found by {self.launch} at step {self.step}: {what}")


def cancel_message(found: list) -> str:
    """The error a cancelled request's output carries."""
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"kvcanary: request {found[0].request_id!r} cancelled: its KV cache failed the canary: {found[0]}{more}"


def log_all(found: list) -> None:
    for v in found:
        logger.error("%s", v)
