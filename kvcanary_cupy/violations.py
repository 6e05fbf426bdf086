"""ViolationLog (the device-side ring and counters) and Violation (one decoded row)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import arrays, runtime, scalars
from .format import (COUNTER_NAMES, NUM_COUNTERS, VIOLATION_COLUMNS, VIOLATION_WORDS, FailReason,
                     LaunchTag)
from .runtime import HostReader, on_stream

# Ring rows a poll's copy holds beyond the rows already returned (a clean step logs none;
# a burst beyond them is read at once). The copy runs on the step's stream every step: 128
# rows of 18 words are 18 KiB, less than the 256 rows of SGLang's 10 words it replaced.
POLL_WINDOW = 128


@dataclass(frozen=True)
class Violation:
    """One violation row, decoded. ``str(v)`` is one line an operator can act on.

    Rows of the tensor-parallel agreement (tag ``LaunchTag.TP_AGREE``) name ranks,
    not a slot: a RANK_DIVERGENCE row keeps the divergent rank in ``stored_token``,
    the majority's lowest rank in ``expected_token``, the agreement round in
    ``position``, the ranks agreeing with it in ``expected_position`` and both
    digests in the link columns (``format.DIVERGENCE_COLUMNS``); :attr:`rank`,
    :attr:`reference_rank` and :attr:`agreement_step` read them.
    """

    tag: int
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_link: int
    expected_link: int
    reasons: FailReason
    batch_row: int
    expected_position: int
    # What points at the damage (format.VIOLATION_COLUMNS 10..17; a column a row does not
    # use holds -1, a fingerprint 0). A verify row: the predecessor record's slot and the
    # position it holds, the record's fingerprint and the live K/V bytes'.
    prev_slot: int = -1
    prev_position: int = -1
    stored_fingerprint: int = 0
    expected_fingerprint: int = 0
    # A write row: the token's index in the step's token arrays, its row's span there, and
    # how many tokens those arrays hold.
    token_index: int = -1
    span_start: int = -1
    span_end: int = -1
    tokens_given: int = -1
    request: object = field(default=None, compare=False)  # the caller's request id, when mapped

    @classmethod
    def from_row(cls, row) -> "Violation":
        v = [int(x) for x in row]
        kw = dict(zip(VIOLATION_COLUMNS, v))
        kw["reasons"] = FailReason(kw.pop("fail_bits") & 0xFFFFFFFF)
        return cls(**kw)

    def as_row(self) -> tuple:
        """The ring row this violation was decoded from (without the request id)."""
        return tuple(int(self.reasons) if name == "fail_bits" else getattr(self, name) for name in VIOLATION_COLUMNS)

    # --- tensor-parallel agreement rows (tag TP_AGREE; format.DIVERGENCE_COLUMNS) ----
    @property
    def rank(self) -> int | None:
        """The rank a RANK_DIVERGENCE row names (its plan differs from the majority's), read
        from column ``stored_token``; None for every other row."""
        return self.stored_token if FailReason.RANK_DIVERGENCE in self.reasons else None

    @property
    def reference_rank(self) -> int | None:
        """The lowest rank holding the majority's digest (column ``expected_token``) of a
        RANK_DIVERGENCE row; None for every other row."""
        return self.expected_token if FailReason.RANK_DIVERGENCE in self.reasons else None

    @property
    def agreement_step(self) -> int | None:
        """The agreement round a TP_AGREE row belongs to (column ``position``; the same on
        every rank of the group); None for every other row."""
        return self.position if self.tag == LaunchTag.TP_AGREE else None

    @property
    def other_ranks_rows(self) -> int | None:
        """For the group notice a rank's poll returns when other ranks of its process group
        logged violations and it logged none (tag TP_AGREE, no reason bits): how many rows
        they logged (column ``stored_token``); None for every other row."""
        return self.stored_token if self.tag == LaunchTag.TP_AGREE and not self.reasons else None

    @classmethod
    def group_notice(cls, *, other_rows: int, unheld_divergences: int, agreement_step: int) -> "Violation":
        """The row a poll returns on a rank that logged nothing while its group did (see
        :attr:`other_ranks_rows`); never stored in a ring."""
        return cls(tag=int(LaunchTag.TP_AGREE), slot=-1, position=agreement_step, stored_token=other_rows,
                   expected_token=unheld_divergences, stored_link=0, expected_link=0, reasons=FailReason.NONE,
                   batch_row=-1, expected_position=-1)

    def _agreement_str(self) -> str | None:
        if self.tag != LaunchTag.TP_AGREE:
            return None
        head = f"kvcanary violation [{self.reasons.describe() if self.reasons else 'group'}] in tp_agree, " \
               f"agreement step {self.position}: "
        if FailReason.RANK_DIVERGENCE in self.reasons:
            ref = self.expected_token
            return (head + f"rank {self.stored_token}'s plan differs from rank {ref}'s (digest "
                    f"{self.stored_link & 0xFFFFFFFFFFFFFFFF:#018x}, rank {ref}'s "
                    f"{self.expected_link & 0xFFFFFFFFFFFFFFFF:#018x}; {self.expected_position} rank(s) hold "
                    f"rank {ref}'s)")
        if not self.reasons:
            text = (f"other ranks of the process group logged {self.stored_token} violation row(s) since the "
                    "previous poll and this rank logged none (read those ranks' logs)")
            if self.expected_token > 0:
                text += f"; {self.expected_token} rank-divergence row(s) did not fit this rank's ring"
            return head + text
        return None

    def __str__(self) -> str:
        agreement = self._agreement_str()
        if agreement is not None:
            return agreement
        try:
            launch = LaunchTag(self.tag).name.lower()
        except ValueError:
            launch = f"tag {self.tag}"
        who = f"request {self.request!r} (batch row {self.batch_row})" if self.request is not None \
            else f"batch row {self.batch_row}"
        head = f"kvcanary violation [{self.reasons.describe()}] in {launch}, {who}"
        span = f"span [{self.span_start}, {self.span_end})"
        if self.reasons == FailReason.INPUT_OUT_OF_RANGE:
            return (head + f": the row's {span} of the step's token arrays (the sum of the extend lengths up "
                    f"to it) ends past those arrays, which hold {self.tokens_given} token(s) (input_ids, "
                    "positions, out_cache_loc and the expected inputs: the shortest); nothing of the row was "
                    "stamped")
        if self.reasons == FailReason.RESERVED_SLOT:
            return (head + f": the slot table maps position {self.expected_position} to slot 0, the reserved "
                    "padding slot (a freed or never-filled entry of a live request)")
        if self.token_index < 0 and self.span_start != -1 and FailReason.SLOT_OUT_OF_RANGE in self.reasons:
            return (head + f": the row's chain seed, slot {self.slot}, lies outside the canary; nothing of its "
                    f"{span} was stamped")
        text = (f"{head}, slot {self.slot}: "
                f"expected token {'-1 (not checked)' if self.expected_token == -1 else self.expected_token} "
                f"position {self.expected_position} "
                f"link {self.expected_link & 0xFFFFFFFFFFFFFFFF:#018x}; found token {self.stored_token} "
                f"position {self.position} link {self.stored_link & 0xFFFFFFFFFFFFFFFF:#018x}")
        return text + "".join(self._details())

    def _details(self):
        """The clauses that point at the damage, each for the reasons that need it."""
        if self.token_index >= 0:  # a write's token
            yield f"; token {self.token_index} of the step's token arrays, in the row's span [{self.span_start}, " \
                  f"{self.span_end})"
            if FailReason.WRITE_POSITION in self.reasons:
                yield (f"; it follows position {self.prev_position}" if self.prev_position != -1
                       else "; it follows no stored token")
            return
        if FailReason.CHAIN in self.reasons:
            if self.prev_slot == -1:
                yield "; the first record of its sequence: its link must be the anchor"
            else:
                held = (f"holds position {self.prev_position}" if self.prev_position != -1
                        else "was not read")
                yield (f"; its predecessor, slot {self.prev_slot} (expected position {self.expected_position - 1}), "
                       f"{held}: that record or this one is damaged")
        if FailReason.REAL_KV in self.reasons:
            yield (f"; real-KV fingerprint stored {self.stored_fingerprint & 0xFFFFFFFFFFFFFFFF:#018x}, the slot's "
                   f"K/V bytes now hash to {self.expected_fingerprint & 0xFFFFFFFFFFFFFFFF:#018x}")
        if FailReason.SLOT_OUT_OF_RANGE in self.reasons and self.prev_slot != -1:
            yield f"; predecessor slot {self.prev_slot}"


class ViolationLog:
    """A device-side ring of violation rows plus counters, shared by any number of ops.

    Arrays (int64; NumPy on ``"cpu"``, CuPy on CUDA):
        ring: ``[capacity, 18]`` rows, the columns of ``format.VIOLATION_COLUMNS``:
            ``[tag, slot, position, stored_token, expected_token, stored_link,
            expected_link, fail_bits, batch_row, expected_position]`` (SGLang's rows),
            then ``[prev_slot, prev_position, stored_fingerprint, expected_fingerprint,
            token_index, span_start, span_end, tokens_given]`` (see :class:`Violation`). The ring fills once: rows past ``capacity`` are
            dropped and counted, never overwrite earlier rows.
        head: ``[1]`` append index; keeps counting past the capacity.
        counter_array: ``[6]`` (see :meth:`counters`): kernel runs, slots checked,
            slots written, verifies skipped, writes skipped, tokens skipped.

    The arrays, and their layouts, are fixed for the log's life: a launch prepared with
    it appends at the addresses it validated. A pickled log comes back as a new log over
    copies of the arrays, its poll position kept.

    Example::

        >>> log = ViolationLog.allocate(capacity=256, device="cpu")
        >>> log.count, log.read()
        (0, [])
    """

    def __init__(self, ring, head, counters):
        # The kernels append rows and bump counters at raw addresses: every array must be
        # writable, packed, on one device, of its exact length, and apart from the others.
        ring = arrays.as_array(ring, "ring", dtypes=arrays.INT64, ndim=2, writable=True)
        if ring.shape[1] != VIOLATION_WORDS or ring.shape[0] < 1:
            raise ValueError(f"kvcanary: ring: expected shape [capacity >= 1, {VIOLATION_WORDS}], "
                             f"got {tuple(ring.shape)}")
        dev = runtime.device_of(ring)
        head = arrays.as_array(head, "head", dtypes=arrays.INT64, ndim=1, device=dev, writable=True)
        counters = arrays.as_array(counters, "counters", dtypes=arrays.INT64, ndim=1, device=dev, writable=True)
        if head.shape[0] != 1 or counters.shape[0] != NUM_COUNTERS:
            raise ValueError(f"kvcanary: ViolationLog: head has length {head.shape[0]}, expected 1; "
                             f"counters has length {counters.shape[0]}, expected {NUM_COUNTERS}")
        fields = {"ring": ring, "head": head, "counter_array": counters}
        arrays.check_disjoint("ViolationLog", {"ring": ring, "head": head, "counters": counters})
        for name, a in fields.items():
            object.__setattr__(self, name, a)
        arrays.hold(self, "ViolationLog", fields)
        self._polled = 0  # rows already handed out by poll()
        self._reader = None  # HostReader of (head, ring), made on the first poll
        self._window_start = 0  # the first ring row the queued copy holds

    @classmethod
    def allocate(cls, *, capacity: int, device: str = "cpu", head=None, counters=None) -> "ViolationLog":
        """A zeroed log of ``capacity`` rows. ``head`` / ``counters``: optional int64 ``[1]`` /
        ``[6]`` arrays on ``device`` to use (zeroed here, once every check has passed: a refused
        array is left as it was), e.g. a word of a buffer a collective sends, so that the head
        travels without a copy, or views of a block polled in one copy."""
        capacity = scalars.check_int(capacity, "capacity", minimum=1)
        ring = runtime.empty((capacity, VIOLATION_WORDS), np.int64, device, fill=0)
        dev = runtime.device_of(ring)  # "cuda" named as the arrays name it: "cuda:N"

        def given_or_new(a, name, n):
            if a is None:
                return runtime.empty((n,), np.int64, dev, fill=0)
            return arrays.as_array(a, name, dtypes=arrays.INT64, ndim=1, device=dev, writable=True)

        log = cls(ring, given_or_new(head, "head", 1), given_or_new(counters, "counters", NUM_COUNTERS))
        for given, a in ((head, log.head), (counters, log.counter_array)):
            if given is not None:
                a.fill(0)
        return log

    @classmethod
    def from_buffers(cls, *, ring, head, counters) -> "ViolationLog":
        """Wrap caller-owned int64 arrays (``[capacity, 18]``, ``[1]``, ``[6]``) after the
        constructor's checks."""
        return cls(ring, head, counters)

    def __reduce__(self):
        # A new log made by the constructor; the poll reader (host staging) is not carried.
        return _log_of, (self.ring, self.head, self.counter_array, self._polled)

    @property
    def capacity(self) -> int:
        return int(self.ring.shape[0])

    @property
    def device(self) -> str:
        return runtime.device_of(self.ring)

    @property
    def count(self) -> int:
        """Violations appended since allocation or the last clear(), dropped ones included."""
        return int(runtime.to_host(self.head)[0])

    @property
    def dropped(self) -> int:
        """Violations that did not fit in the ring."""
        return max(0, self.count - self.capacity)

    def counters(self) -> dict:
        """The counters, as ints (synchronizes):

        - ``kernel_runs``: write and verify launches;
        - ``slots_checked``, ``slots_written``: records verified and stamped;
        - ``verifies_skipped``: verify runs that checked nothing because their plan was
          not enabled (it overflowed its capacity, or was never planned);
        - ``writes_skipped``: write runs whose write plan was never planned;
        - ``tokens_skipped``: tokens a write did not stamp because their
          ``out_cache_loc`` was negative (by design: padding, or dropped drafts).
        """
        c = runtime.to_host(self.counter_array)
        return {name: int(c[i]) for i, name in enumerate(COUNTER_NAMES)}

    def rows(self) -> np.ndarray:
        """Every row held, in ring order, as an int64 NumPy array (synchronizes)."""
        n = min(self.count, self.capacity)
        return np.array(runtime.to_host(self.ring[:n]))

    def read(self) -> list[Violation]:
        """Every row held, decoded, in ring order; consumes nothing (synchronizes)."""
        return [Violation.from_row(r) for r in self.rows()]

    def poll(self, stream=None, *, queue_next: bool = True) -> list[Violation]:
        """The rows appended since the previous poll, without stalling the stream.

        On CUDA the rows are those a pinned copy, queued by the previous poll, found one
        step earlier; this call waits only for that copy (long done in a running
        engine) and queues the next one on ``stream`` (none with ``queue_next=False``:
        for a caller that polls right after its launches, then again, with
        ``queue_next=False``, after its own synchronization). The copy holds the head and
        the next ``POLL_WINDOW`` rows of the ring; rows beyond them, a burst, are read at
        once (synchronizing). On the CPU it reads directly.
        """
        if self._reader is None:
            self._reader = HostReader(self.device, [self.head, self.ring])
        if isinstance(self.ring, np.ndarray):
            start, stop = self.copy_window()
            head, ring = self._reader.take(rows=[None, (start, stop)])
            return self.take_copied(int(head[0]), ring, start)
        staged = self._reader.take()
        out = [] if staged is None else self.take_copied(int(staged[0][0]), staged[1], self._window_start)
        if queue_next:
            self._window_start, stop = self.copy_window()
            self._reader.queue(runtime.resolve_stream(stream, ()), rows=[None, (self._window_start, stop)])
        return out

    def copy_window(self) -> tuple[int, int]:
        """``(start, stop)``: the ring rows a poll's copy holds, the next ``POLL_WINDOW`` after
        those handed out (for a caller that copies the head and the ring itself, with its own
        scalars, and hands the copy to :meth:`take_copied`)."""
        return self._polled, min(self._polled + POLL_WINDOW, self.capacity)

    def take_copied(self, head: int, rows: np.ndarray, start: int) -> list[Violation]:
        """The rows appended since the last poll, from the head's value and ring rows ``start ..``
        as one copy found them (rows past them, a burst, are read now: synchronizing); marks
        them handed out, as :meth:`poll` does."""
        end = min(head, self.capacity)
        if end <= self._polled:  # nothing new (every clean step's poll)
            return []
        stop = min(end, start + len(rows))
        got = rows[max(0, self._polled - start):max(0, stop - start)]
        if end > stop:
            got = np.concatenate([got, runtime.to_host(self.ring[max(stop, self._polled):end])])
        out = [Violation.from_row(r) for r in got]
        self._polled += len(out)
        return out

    def clear(self, stream=None) -> None:
        """Empty the ring (stream-ordered on CUDA). Counters keep counting."""
        self._held.check()
        if isinstance(self.ring, np.ndarray):
            self.head[0] = 0
        else:
            with _on_stream(self.device, stream):
                self.head.fill(0)
        self._polled = 0
        if self._reader is not None:
            self._reader.reset()

    def reset_counters(self, stream=None) -> None:
        self._held.check()
        if isinstance(self.counter_array, np.ndarray):
            self.counter_array[:] = 0
        else:
            with _on_stream(self.device, stream):
                self.counter_array.fill(0)


arrays.fix_attributes(ViolationLog, "make a new ViolationLog (ViolationLog.allocate or ViolationLog.from_buffers)",
                      mutable=frozenset({"_polled", "_reader", "_window_start"}))


def _log_of(ring, head, counters, polled: int) -> ViolationLog:
    """A log over ``ring``, ``head``, ``counters`` whose rows before ``polled`` were handed out
    by a poll (for unpickling)."""
    log = ViolationLog(ring, head, counters)
    log._polled = polled
    return log


def _on_stream(device: str, stream):
    return on_stream(device, runtime.resolve_stream(stream, ()))
