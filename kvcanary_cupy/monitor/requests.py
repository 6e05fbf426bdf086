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

A sweep inside an open step starts a sequence of its own, so the step's later rows
get a sequence again, with the step's ids (:meth:`RequestMap.resume`). A clear of the
log restarts the ring's indices: the map forgets every older sequence and counts the
newest one's rows from index 0 (:meth:`RequestMap.cleared`), which is why the
monitor's log routes its ``clear()`` through the monitor (:class:`MonitorLog`).
"""
from __future__ import annotations

import collections
import dataclasses
import weakref

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
        self._sweeps: collections.OrderedDict = collections.OrderedDict()  # seqs of sweeps (their ids name chains)
        self._last_step = (None, False)  # (request ids, capturing) of the latest step, for resume()
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
        self._last_step = (request_ids, capturing)
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
        self._remember(self._sweeps, seq, None)
        self._named = True
        return seq

    def resume(self, ptr) -> int:
        """After a sweep inside an open step: a sequence for the step's rows that follow, with
        the step's request ids (its own sequence, if it had one, is older than the sweep's)."""
        ids, capturing = self._last_step
        seq = self._next_seq(ptr)
        if capturing:
            self._captured_seqs.add(seq)
        self._remember(self._ids, seq, ids)
        self._named = capturing or ids is not None
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

    def map_rows(self, found: list[Violation], heads: np.ndarray, upto_seq: int, replay_now: int,
                 first: int | None = None) -> list:
        """Name each row's request: find the launch that wrote it from the head snapshots.
        The rows are the next ones of the ring after those mapped before (``first``: they
        start at that ring index instead, and count as mapped by no poll)."""
        if first is None:
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

    def step_request(self, batch_row: int, upto_seq: int, replay_now: int):
        """The request id of ``batch_row`` in the newest step up to sequence ``upto_seq`` (the
        step a poll's copy of the plans belongs to), or None where that step named none."""
        for q in reversed(self._ids):
            if q > upto_seq or q in self._sweeps:
                continue
            ids = self._replay_ids.get(replay_now) if q in self._captured_seqs else self._ids[q]
            return ids[batch_row] if ids is not None and 0 <= batch_row < len(ids) else None
        return None

    def map_ring(self, rows: list[Violation], heads: np.ndarray) -> list:
        """Every row of the ring, from its start, mapped; what polls have returned is unchanged."""
        return self.map_rows(rows, heads, self.seq, self.replays, first=0)

    def cleared(self) -> None:
        """The ring was cleared: its indices start again from 0 (queue it on the monitor's stream,
        after the clear). Older sequences' rows are gone and their snapshots mean nothing now;
        rows after the clear and before the next sequence (the rest of an open step) belong to
        the newest one, from index 0."""
        self.heads.fill(0)
        self._rows_seen = 0
        self._min_seq = max(self.seq, 1)
        self._staged_seq = self.seq

    def forget_replays(self) -> None:
        """Count replays from 0 again (the warm-up's are discarded with its results)."""
        self.replays = 0
        self._staged_replay = 0


class MonitorLog(ViolationLog):
    """A monitor's :class:`ViolationLog`: its ``clear()`` goes through the monitor, which
    maps every row to a request by its ring index, and its rows are handed out by the
    monitor's ``poll()`` (a ``poll()`` here would take them from under the monitor).

    A log no monitor owns (``_cleared`` unset) behaves as a plain :class:`ViolationLog`.

    Example::

        >>> log = MonitorLog.allocate(capacity=4)
        >>> log.clear(); log.count
        0
    """

    _cleared = None  # the owning monitor's clear: empties the ring, then restarts the request map

    def clear(self, stream=None) -> None:
        """Empty the ring (stream-ordered on CUDA), through the owning monitor."""
        cleared = None if self._cleared is None else self._cleared()
        if cleared is None:
            super().clear(stream)
        else:
            cleared(stream)

    def _own(self, cleared) -> None:
        """Route ``clear()`` to the owning monitor's ``cleared(stream)`` (set once, at its construction).
        Held weakly: the log must not keep its monitor alive (a monitor with a process group has
        to go with the caller's last reference, before the group is destroyed)."""
        object.__setattr__(self, "_cleared", weakref.WeakMethod(cleared))  # bookkeeping past the fixed fields

    def _clear_ring(self, stream=None) -> None:
        super().clear(stream)

    def poll(self, stream=None, *, queue_next: bool = True) -> list[Violation]:
        """Refused: the owning monitor's ``poll()`` hands out this log's rows."""
        if self._cleared is None:
            return super().poll(stream, queue_next=queue_next)
        raise _taken_by_monitor("poll")

    def take_copied(self, head: int, rows: np.ndarray, start: int) -> list[Violation]:
        """Refused: the owning monitor's ``poll()`` hands out this log's rows."""
        if self._cleared is None:
            return super().take_copied(head, rows, start)
        raise _taken_by_monitor("take_copied")

    def _take_copied(self, head: int, rows: np.ndarray, start: int) -> list[Violation]:
        return super().take_copied(head, rows, start)


def _taken_by_monitor(name: str) -> RuntimeError:
    return RuntimeError(f"kvcanary: log.{name}: this log belongs to a KvCanary, whose poll() hands out its rows "
                        "mapped to their requests; call the monitor's poll() (log.read() reads the ring without "
                        "consuming it)")
