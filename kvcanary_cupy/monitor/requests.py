"""Which request a violation row belongs to.

A ring row names its launch's batch row, not a request. Every step and sweep
gets a sequence number and, on the device, a snapshot of the log head as it
starts (``heads[seq % history]``); the row at ring index i belongs to the newest
sequence whose snapshot is <= i, and that sequence's request ids name its batch
rows. Tags stay plain LaunchTags, so launches (and their cached kernel arguments)
are the same every step. Graph replays run no Python: captured sequences map
through the ids :meth:`RequestMap.replay` records for each replay.

A step that names no requests needs no sequence of its own when the newest one
names none either: its rows then fall in that sequence and map to no request,
exactly as in their own. Such a step records nothing (no snapshot copy); an engine
that never names requests pays nothing here.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from .. import runtime
from ..violations import Violation, ViolationLog


class RequestMap:
    """Sequence numbers, head snapshots and request ids, for ``history`` launches back.

    Example::

        >>> from kvcanary_cupy import ViolationLog
        >>> m = RequestMap(history=8, device="cpu", log=ViolationLog.allocate(capacity=4))
        >>> m.step(None, capturing=False, request_ids=["a", "b"]), m.sweep(None, ["node"])
        (1, 2)
    """

    def __init__(self, *, history: int, device: str, log: ViolationLog, heads=None):
        self.history = history
        self.device = device
        self._cpu = runtime.is_cpu(device)
        self._log = log
        # The log's head at each sequence's start, int64 [history] (given: a view of the monitor's polled block).
        self.heads = runtime.empty((history,), np.int64, device, fill=0) if heads is None else heads
        self.seq = 0
        self._min_seq = 1  # snapshots before this were invalidated by a log clear
        self._ids: collections.OrderedDict = collections.OrderedDict()  # seq -> request id per batch row
        self._rows_seen = 0  # ring rows poll() has returned (their ring indices are consecutive)
        self._staged_seq = 0
        self._captured_seqs: set = set()
        self.replays = 0
        self._replay_ids: collections.OrderedDict = collections.OrderedDict()
        self._staged_replay = 0
        self._named = False  # whether rows of the newest sequence may name requests
        if not self._cpu:
            # The head snapshot is one 8-byte device-to-device copy per step, queued straight on
            # the step's stream: no CuPy operation (a kernel, views, stream switches) on the hot
            # path. A captured graph records it as a copy node, so every replay snapshots anew.
            cp = runtime.cupy()
            rt = cp.cuda.runtime
            self._memcpy_async, self._get_device = rt.memcpyAsync, rt.getDevice
            self._d2d = getattr(rt, "memcpyDeviceToDevice", 3)
            self._device_id = int(self.heads.device.id)
            self._heads_ptr, self._head_ptr = int(self.heads.data.ptr), int(log.head.data.ptr)
            self._device_ctx = cp.cuda.Device

    @property
    def captured(self) -> bool:
        """Whether a CUDA graph captured a step of this monitor (and keeps its arrays)."""
        return bool(self._captured_seqs)

    def _next_seq(self, ptr) -> int:
        """A new launch sequence number, with the log head it starts at recorded on the device."""
        self.seq += 1
        k = self.seq % self.history
        if self._cpu:
            self.heads[k] = self._log.head[0]
        elif self._get_device() == self._device_id:
            self._memcpy_async(self._heads_ptr + 8 * k, self._head_ptr, 8, self._d2d, ptr)
        else:
            with self._device_ctx(self._device_id):
                self._memcpy_async(self._heads_ptr + 8 * k, self._head_ptr, 8, self._d2d, ptr)
        return self.seq

    def _remember(self, store: collections.OrderedDict, key, ids) -> None:
        store[key] = None if ids is None else list(ids)
        while len(store) > self.history:
            store.popitem(last=False)

    def step(self, ptr, *, capturing: bool, request_ids) -> int | None:
        """Open a step's sequence (before its first launch); returns its number, or None when
        the step needs none (it names no requests, nor does the newest sequence, and no graph
        was captured: see the module docstring)."""
        if request_ids is None and not (capturing or self._named or self._captured_seqs):
            return None
        seq = self._next_seq(ptr)
        if capturing:
            self._captured_seqs.add(seq)
        self._remember(self._ids, seq, request_ids)
        self._named = capturing or request_ids is not None  # replays of a captured step name their rows
        return seq

    def sweep(self, ptr, keys) -> int:
        """Open a sweep's sequence; its rows name the chains' ``keys``."""
        seq = self._next_seq(ptr)
        self._remember(self._ids, seq, keys)
        self._named = True
        return seq

    def replay(self, request_ids) -> None:
        """Count one replay of a captured step, whose batch rows are ``request_ids``."""
        self.replays += 1
        self._remember(self._replay_ids, self.replays, request_ids)

    def stage(self, *, now: bool, queue: bool = True) -> tuple[int, int]:
        """For a poll: the newest sequence and replay its rows can come from (``now``: the current
        ones; else those of the copy queued before, which this poll returns), and, with
        ``queue``, stage the current ones for the copy this poll queues."""
        out = (self.seq, self.replays) if now else (self._staged_seq, self._staged_replay)
        if queue:
            self._staged_seq, self._staged_replay = self.seq, self.replays
        return out

    def map_rows(self, found: list[Violation], heads: np.ndarray, upto_seq: int, replay_now: int) -> list:
        """Name each row's request: find the launch that wrote it from the head snapshots.
        The rows are the next ones of the ring after those mapped before."""
        first = self._rows_seen
        self._rows_seen += len(found)
        if not found:
            return []
        seqs = [q for q in self._ids if (q >= self._min_seq or q in self._captured_seqs) and q <= upto_seq
                and upto_seq - q < self.history]
        starts = [int(heads[q % self.history]) for q in seqs]
        out = []
        for j, v in enumerate(found):
            i = first + j
            seq = None
            for q, h in zip(reversed(seqs), reversed(starts)):  # newest first; a poll holds a step or two
                if h <= i:
                    seq = q
                    break
            ids = self._replay_ids.get(replay_now) if seq in self._captured_seqs else self._ids.get(seq)
            req = ids[v.batch_row] if ids is not None and 0 <= v.batch_row < len(ids) else None
            out.append(dataclasses.replace(v, request=req))
        return out

    def map_ring(self, rows: list[Violation], heads: np.ndarray) -> list:
        """Every row of the ring, from its start, mapped; what polls have returned is unchanged."""
        seen, self._rows_seen = self._rows_seen, 0
        try:
            return self.map_rows(rows, heads, self.seq, self.replays)
        finally:
            self._rows_seen = seen

    def restart(self) -> None:
        """The ring was cleared: older snapshots mean nothing now (queue it on the monitor's stream)."""
        self.heads.fill(0)
        self._rows_seen = 0
        self._min_seq = self.seq + 1
        self._staged_seq = self.seq
        self.replays = 0
        self._staged_replay = 0
