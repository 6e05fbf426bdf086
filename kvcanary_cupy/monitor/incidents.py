"""Incidents: the violation rows of one piece of damage, folded into one report.

A check that finds damage finds it again at every step that reads the damaged slot,
until the request that reads it ends: a freed block overwritten while a request still
reads it yields the same CHAIN row at the same slot at every step. An operator wants
one report for that, not one per step. :class:`IncidentFolder` folds the rows of a
monitor's polls into :class:`Incident` objects and says which ones are new.

The folding key of a row of group ``group``:

- a slot row (every tag but ``LaunchTag.TP_AGREE``): ``(request, group, slot, reasons)``.
  Without a request id (``request`` None) the key is ``(None, group, slot, reasons)``:
  the batch row is not part of it. A batch row is the row's index in one step's
  batch, not an identity: it shifts whenever a request before it joins or leaves the
  batch, so keying on it would report the same damage again at every reordering,
  while the slot is where the damage is. The price: two requests without ids that
  read the same damaged slot (a shared prefix) make one incident, not two.
- a row of the tensor-parallel agreement (``LaunchTag.TP_AGREE``): ``(group, rank,
  reasons)``, in a key space of its own, so it never folds with a slot row (its slot
  and batch row are -1). ``rank`` is the divergent rank of a RANK_DIVERGENCE row
  (:attr:`Violation.rank`), None for the group notice (no reason bits).

Example::

    >>> from kvcanary_cupy import FailReason, LaunchTag, Violation
    >>> from kvcanary_cupy.monitor.incidents import IncidentFolder
    >>> row = Violation(tag=int(LaunchTag.VERIFY), slot=30, position=4, stored_token=7, expected_token=7,
    ...                 stored_link=1, expected_link=2, reasons=FailReason.CHAIN, batch_row=0,
    ...                 expected_position=4, request="r1")
    >>> folder = IncidentFolder()
    >>> [i.count for i in folder.fold([("main", row)], step=12)]  # new: reported
    [1]
    >>> folder.fold([("main", row)], step=13)                      # the same damage again: folded
    []
    >>> folder.incidents[0].count, folder.incidents[0].last_step, folder.raw_rows
    (2, 13, 2)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Iterable, Sequence

from ..format import FailReason, LaunchTag
from ..scalars import check_int
from ..violations import Violation

_SLOT = "slot"  # the two key spaces: slot rows and tensor-parallel agreement rows
_AGREEMENT = "tp_agree"


def _request_key(request) -> Hashable:
    """``request`` as a dict key. Request ids come from the engine and are usually ints or
    strings; an unhashable one (a list, a dict) must not crash the monitor's poll, so it
    is keyed by its type and repr."""
    try:
        hash(request)
    except TypeError:
        return ("unhashable", type(request).__qualname__, repr(request))
    return request


def request_of(violation: Violation):
    """The request id a row names: its ``request``, or that request's ``request_id`` where the
    request is an adapter's tag of it (a tag also names the step that found the row, which
    must not split one piece of damage into one incident per step)."""
    return getattr(violation.request, "request_id", violation.request)


def incident_key(group: str, violation: Violation) -> tuple:
    """The key that folds the rows of one incident (see the module's docstring).

    Args:
        group (str): The name of the watched pool the row came from (``"main"``, ``"swa"``, ...).
        violation (Violation): One decoded row, ``request`` set when the engine passed ids.

    Returns:
        tuple: A hashable key; rows with equal keys are one incident.

    Example::

        >>> from dataclasses import replace
        >>> from kvcanary_cupy import FailReason, Violation
        >>> from kvcanary_cupy.monitor.incidents import incident_key
        >>> a = Violation(tag=1, slot=30, position=4, stored_token=7, expected_token=7, stored_link=1,
        ...               expected_link=2, reasons=FailReason.CHAIN, batch_row=0, expected_position=4)
        >>> incident_key("main", a) == incident_key("main", replace(a, batch_row=3))  # batch row: not in it
        True
    """
    reasons = int(violation.reasons)
    if violation.tag == LaunchTag.TP_AGREE:
        return (_AGREEMENT, group, violation.rank, reasons)
    return (_SLOT, _request_key(request_of(violation)), group, int(violation.slot), reasons)


@dataclass(frozen=True)
class Incident:
    """One piece of damage: the rows that share a folding key (:func:`incident_key`).

    Attributes:
        request (object or None): The request id of the rows (None: the engine passed no
            ids, or a tensor-parallel agreement row).
        group (str): The watched pool the rows came from (``"main"``, ``"swa"``, ...).
        slot (int): The KV slot of the rows (-1 for a tensor-parallel agreement row).
        reasons (FailReason): The reason bits the rows share.
        first_step (int): The monitor step of the poll that first returned a row of it.
        last_step (int): The latest monitor step at which a row of it was folded.
        count (int): Raw rows folded into it so far.
        violation (Violation): The first row, as the poll returned it.

    ``str(incident)`` is one line: the first row's own line, then the group and how
    often the damage was seen, e.g. ``... [group main, first seen at step 12, 7 rows to
    step 18]``.

    Example::

        >>> from kvcanary_cupy import FailReason, Violation
        >>> from kvcanary_cupy.monitor.incidents import Incident
        >>> v = Violation(tag=1, slot=30, position=4, stored_token=7, expected_token=7, stored_link=1,
        ...               expected_link=2, reasons=FailReason.CHAIN, batch_row=0, expected_position=4)
        >>> Incident(request=None, group="main", slot=30, reasons=FailReason.CHAIN, first_step=12,
        ...          last_step=18, count=7, violation=v).where()
        'group main, first seen at step 12, 7 rows to step 18'
    """

    request: object
    group: str
    slot: int
    reasons: FailReason
    first_step: int
    last_step: int
    count: int
    violation: Violation

    def __getattr__(self, name: str):
        # Reads like the row it began with (tag, batch_row, position, links, ...), so a policy
        # written for Violation lists takes incidents as they are.
        if name.startswith("__") or name == "violation":
            raise AttributeError(name)
        return getattr(self.violation, name)

    @property
    def key(self) -> tuple:
        """The folding key of its rows (:func:`incident_key`)."""
        return incident_key(self.group, self.violation)

    @property
    def is_agreement(self) -> bool:
        """True for an incident of the tensor-parallel agreement (tag ``LaunchTag.TP_AGREE``)."""
        return self.violation.tag == LaunchTag.TP_AGREE

    def where(self) -> str:
        """The part of ``str(self)`` after the row's own line: group, first step, rows, last step."""
        seen = f"group {self.group}, first seen at step {self.first_step}"
        if self.count == 1:
            return seen + ", 1 row"
        return seen + f", {self.count} rows to step {self.last_step}"

    def __str__(self) -> str:
        return f"{self.violation} [{self.where()}]"


class IncidentFolder:
    """Folds the rows of a monitor's polls into incidents and reports only the new ones.

    The folder keeps one :class:`Incident` per folding key (:func:`incident_key`) until
    :meth:`forget`, :meth:`forget_slots` or :meth:`clear` drops it; a row whose key it
    holds bumps that incident's ``count`` and ``last_step`` and is not reported again.
    Incidents are immutable: a bump replaces the incident in the table, so an incident a
    caller kept stays as it was returned.

    A long-running engine should :meth:`forget` each finished request: its incidents go,
    so that a later fault in a reused slot is reported again, and the table stays as
    small as the set of live damage.

    Example::

        >>> from kvcanary_cupy import FailReason, Violation
        >>> from kvcanary_cupy.monitor.incidents import IncidentFolder
        >>> def row(slot, request):
        ...     return Violation(tag=1, slot=slot, position=4, stored_token=7, expected_token=7, stored_link=1,
        ...                      expected_link=2, reasons=FailReason.CHAIN, batch_row=0, expected_position=4,
        ...                      request=request)
        >>> folder = IncidentFolder()
        >>> len(folder.fold([("main", row(30, "r1")), ("main", row(31, "r1"))], step=5))
        2
        >>> folder.fold([("main", row(30, "r1"))], step=6), folder.raw_rows
        ([], 3)
        >>> len(folder.forget("r1"))                             # r1 finished
        2
        >>> len(folder.fold([("main", row(30, "r2"))], step=7))  # the slot reused by r2: new
        1
    """

    def __init__(self):
        self._table: dict[tuple, Incident] = {}  # insertion order is first-seen order
        self._raw_rows = 0

    @property
    def incidents(self) -> list[Incident]:
        """Every incident held, in first-seen order, each as of its latest row."""
        return list(self._table.values())

    @property
    def raw_rows(self) -> int:
        """Rows folded since construction or the last :meth:`clear` (forgotten ones included)."""
        return self._raw_rows

    def __len__(self) -> int:
        return len(self._table)

    def fold(self, rows: Sequence[tuple[str, Violation]], *, step: int) -> list[Incident]:
        """Fold one poll's rows; return the incidents first seen in this call.

        Args:
            rows (list of (str, Violation)): The poll's rows, each with the name of the
                group (watched pool) it came from, in the order the poll returned them.
            step (int): The monitor step of the poll (an integer; ``first_step`` /
                ``last_step`` of the incidents).

        Returns:
            list[Incident]: The incidents whose key this folder did not hold before the
            call, in first-seen order, each as of the end of the call (its ``count``
            includes every row of this call). Empty when nothing new happened.

        Example::

            >>> from kvcanary_cupy import FailReason, Violation
            >>> from kvcanary_cupy.monitor.incidents import IncidentFolder
            >>> v = Violation(tag=1, slot=3, position=0, stored_token=1, expected_token=2, stored_link=0,
            ...               expected_link=0, reasons=FailReason.TOKEN, batch_row=0, expected_position=0)
            >>> [i.count for i in IncidentFolder().fold([("main", v), ("main", v)], step=1)]
            [2]
        """
        step = check_int(step, "step")
        if not rows:
            return []  # a clean step: nothing to look at
        new: list[tuple] = []
        table = self._table
        for i, item in enumerate(rows):
            group, violation = _check_row(item, i)
            key = incident_key(group, violation)
            known = table.get(key)
            if known is None:
                table[key] = Incident(request=request_of(violation), group=group, slot=int(violation.slot),
                                      reasons=violation.reasons, first_step=step, last_step=step, count=1,
                                      violation=violation)
                new.append(key)
            else:
                table[key] = replace(known, count=known.count + 1, last_step=max(known.last_step, step))
            self._raw_rows += 1
        return [table[k] for k in new]

    def forget(self, request) -> list[Incident]:
        """Drop the slot incidents of ``request`` (a finished request): a later row of the same
        request, group, slot and reasons is then a new incident.

        Args:
            request (object or None): A request id as the rows carry it. None drops every
                slot incident without a request id (for an engine that passes none; see
                also :meth:`forget_slots`). Agreement incidents are never dropped here.

        Returns:
            list[Incident]: The incidents dropped, each as of its latest row (for
            :meth:`EventSink.emit_end`, which records their final counts).
        """
        rkey = _request_key(request)
        return self._drop([k for k in self._table if k[0] == _SLOT and k[1] == rkey])

    def forget_slots(self, slots: Iterable[int], *, group: str | None = None) -> list[Incident]:
        """Drop the slot incidents at ``slots`` (freed slots), whatever their request: for an
        engine without request ids, whose slots are the only identity an incident has.

        Args:
            slots (iterable of int): KV slots.
            group (str or None): Only incidents of this group; None: every group.

        Returns:
            list[Incident]: The incidents dropped, each as of its latest row.
        """
        wanted = {check_int(s, "slots") for s in slots}
        return self._drop([k for k in self._table
                           if k[0] == _SLOT and k[3] in wanted and (group is None or k[2] == group)])

    def expire(self, *, step: int, quiet: int) -> list[Incident]:
        """Drop the slot incidents whose latest row is more than ``quiet`` steps before ``step``:
        damage no step has read since is over (its request ended, or its slots were written
        again), so a later row there is a new incident. Without it an engine that passes no
        request ids would fold a fault in a reused slot into the old one and never report it.

        Args:
            step (int): The monitor step now.
            quiet (int): Steps without a row after which an incident ends (>= 1).

        Returns:
            list[Incident]: The incidents dropped, each as of its latest row.
        """
        if not self._table:
            return []
        last = check_int(step, "step") - check_int(quiet, "quiet", minimum=1)
        return self._drop([k for k, inc in self._table.items() if k[0] == _SLOT and inc.last_step < last])

    def _drop(self, keys: list) -> list[Incident]:
        return [self._table.pop(k) for k in keys]

    def clear(self) -> None:
        """Drop every incident and zero :attr:`raw_rows`."""
        self._table.clear()
        self._raw_rows = 0


def _check_row(item, i: int) -> tuple[str, Violation]:
    try:
        group, violation = item
    except (TypeError, ValueError):
        raise TypeError(f"kvcanary: rows: item {i}: expected a (group, Violation) pair, "
                        f"got {type(item).__name__} {item!r}") from None
    if not isinstance(group, str):
        raise TypeError(f"kvcanary: rows: item {i}: expected the group's name (a str), "
                        f"got {type(group).__name__} {group!r}")
    if not isinstance(violation, Violation):
        raise TypeError(f"kvcanary: rows: item {i}: expected a Violation, got {type(violation).__name__}")
    return group, violation
