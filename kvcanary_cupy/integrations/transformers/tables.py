"""The request tables a monitor reads, filled on the host from the engine's own bookkeeping.

Each request the engine schedules gets a row (row 0 is the padding row), kept
while it stays live so a step writes only what changed: a new block, a block
the prefix cache swapped, a window that slid, the tokens generated since. The
host keeps a mirror of every table; on the CPU the monitor reads the mirror
itself, on CUDA the step's changes travel to the device (:mod:`.staging`).
"""
from __future__ import annotations

import collections
import contextlib
import itertools

import numpy as np


def spans(starts, stops) -> tuple[np.ndarray, np.ndarray]:
    """The integers ``[starts[i], stops[i])`` of every ``i``, concatenated: ``(i of each, value)``.

    Example::

        >>> owner, value = spans([0, 5, 9], [2, 5, 12])
        >>> owner.tolist(), value.tolist()
        ([0, 0, 2, 2, 2], [0, 1, 9, 10, 11])
    """
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.maximum(np.asarray(stops, dtype=np.int64) - starts, 0)
    owner = np.repeat(np.arange(len(lens)), lens)
    first = np.cumsum(lens) - lens
    return owner, np.arange(int(lens.sum()), dtype=np.int64) - first[owner] + starts[owner]


def flatten(lists) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Python int lists as one int64 array: ``(values, start of each list, length of each list)``.

    Example::

        >>> values, starts, lens = flatten([[4, 5], [], [7]])
        >>> values.tolist(), starts.tolist(), lens.tolist()
        ([4, 5, 7], [0, 2, 2], [2, 0, 1])
    """
    lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    values = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lens.sum()))
    return values, np.cumsum(lens) - lens, lens


class RowPool:
    """Rows ``1 .. num_rows - 1`` of the request tables, one per live request state.

    A row belongs to one ``RequestState`` object (a soft reset or a fork makes a new
    object, hence a fresh row); rows of states not seen for longest are reused first,
    never one the current step holds.

    Example::

        >>> pool = RowPool(3)
        >>> a, b, c = object(), object(), object()
        >>> pool.acquire(a, busy=set()), pool.acquire(b, busy=set()), pool.acquire(a, busy=set())
        ((1, True), (2, True), (1, False))
        >>> pool.acquire(c, busy={1})  # row 2 (b's) is the only one free to take
        (2, True)
    """

    def __init__(self, num_rows: int):
        self.num_rows = int(num_rows)
        self.clear()

    def clear(self) -> None:
        """Forget every owner (the engine reset its requests)."""
        self._free = list(range(self.num_rows - 1, 0, -1))
        self._owner: collections.OrderedDict = collections.OrderedDict()  # id(state) -> (row, state)

    def acquire(self, state, busy: set) -> tuple[int, bool]:
        """``(row, fresh)``: the row of ``state``; ``fresh`` when it was just (re)assigned."""
        key = id(state)
        hit = self._owner.get(key)
        if hit is not None and hit[1] is state:
            self._owner.move_to_end(key)
            return hit[0], False
        if self._free:
            row = self._free.pop()
        else:
            for k, (r, _) in self._owner.items():
                if r not in busy:
                    del self._owner[k]
                    row = r
                    break
            else:
                raise ValueError(f"kvcanary: the step holds more requests than the {self.num_rows - 1} table rows")
        self._owner[key] = (row, state)
        return row, True


class MirroredTable:
    """An int32 ``[rows, width]`` table: a host mirror, and the array the monitor reads.

    Args:
        rows, width: its shape.
        device: ``"cpu"`` (the monitor reads the mirror itself) or ``"cuda:N"`` (a
            torch tensor on that device, refreshed by :class:`ChangeUpload`).
        fill: the initial value of every entry.

    Example::

        >>> t = MirroredTable(2, 4, "cpu")
        >>> t.put(np.array([1, 1]), np.array([1, 2]), np.array([7, 8]))
        >>> t.array.tolist()
        [[0, 0, 0, 0], [0, 7, 8, 0]]
    """

    def __init__(self, rows: int, width: int, device: str, fill: int = 0):
        self.host = np.full((rows, width), fill, dtype=np.int32)
        self.cpu = device == "cpu"
        if self.cpu:
            self.array = self.host
        else:
            import torch  # noqa: PLC0415

            self.array = torch.full((rows, width), fill, dtype=torch.int32, device=device)
        self._idx: list = []  # flat indices changed since the last take (CUDA)

    @property
    def width(self) -> int:
        return int(self.host.shape[1])

    def put(self, rows: np.ndarray, cols: np.ndarray, values) -> None:
        """Set ``[rows[i], cols[i]]`` to ``values[i]`` (or one value), each entry once; only changes travel."""
        if not len(rows):
            return
        flat = rows * self.width + cols
        hf = self.host.reshape(-1)
        values = np.broadcast_to(np.asarray(values, dtype=np.int32), flat.shape)
        diff = np.flatnonzero(hf[flat] != values)
        if diff.size:
            idx, v = flat[diff], values[diff]
            hf[idx] = v
            if not self.cpu:
                self._idx.append(idx)

    def take(self):
        """The pending changes ``(flat indices int64, values int32)`` since the last take, or None.

        An entry changed twice travels once, with its final value (a scatter with repeated
        indices keeps an arbitrary one of them on a GPU).
        """
        if not self._idx:
            return None
        idx = np.unique(np.concatenate(self._idx)) if len(self._idx) > 1 else self._idx[0]
        self._idx.clear()
        return idx, self.host.reshape(-1)[idx]


class ExpectedTable:
    """The token every position of every row must hold, from the requests' own token lists.

    A row holds ``prompt + generated`` of its request as far as it is known; the
    rest is -1 (not checked). The table widens on demand: it is handed to the
    monitors per step (``before_forward(expected=...)``), not bound once.

    Args:
        rows: rows (like the slot tables).
        width: initial width in positions.
        device: as :class:`MirroredTable`.
        valid_lens: the per-batch-row valid lengths array the monitors read.
    """

    def __init__(self, rows: int, width: int, device: str, valid_lens):
        self.device = device
        self.table = MirroredTable(rows, max(int(width), 1), device, fill=-1)
        self.filled = np.zeros(rows, dtype=np.int64)
        self.valid_lens = valid_lens
        self._tokens = None

    @property
    def width(self) -> int:
        return self.table.width

    def reserve(self, need: int, stream=None) -> None:
        """Widen the table to hold ``need`` positions (doubling), keeping its contents."""
        if need <= self.width:
            return
        width = self.width
        while width < need:
            width *= 2
        old = self.table
        if old.cpu:
            new = MirroredTable(old.host.shape[0], width, self.device, fill=-1)
            new.host[:, :old.width] = old.host
        else:
            import torch  # noqa: PLC0415

            # Made on the stream that reads it, so its fill runs before the copy and the steps.
            # Changes not uploaded yet live in the mirror and go with the whole-table copy (from
            # pageable memory: the host waits for it, which a rare widening can afford).
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                new = MirroredTable(old.host.shape[0], width, self.device, fill=-1)
                new.host[:, :old.width] = old.host
                new.array.copy_(torch.from_numpy(new.host))
            old.take()
            if stream is not None:
                old.array.record_stream(stream)  # steps queued on the stream may still read the old table
        self.table = new
        self._tokens = None

    def fill(self, rows: np.ndarray, states: list, ends: np.ndarray, fresh: np.ndarray) -> None:
        """Write each request's known tokens of positions ``< ends[i]`` not written yet (all of a
        ``fresh`` row); positions not known yet (a token still being sampled) hold -1."""
        start = np.where(fresh, 0, self.filled[rows])
        due = np.flatnonzero(ends > start)
        if not due.size:
            return
        values: list = []
        written = []
        for i, f, e in zip(due.tolist(), start[due].tolist(), ends[due].tolist()):
            st = states[i]
            init, gen = st.initial_tokens, st.generated_tokens
            ni = len(init)
            known = min(e, ni + len(gen))
            if f >= ni:
                if known - f == 1:  # a decode step: the one token sampled last
                    values.append(gen[f - ni])
                else:
                    values.extend(gen[f - ni:known - ni])
            else:
                values.extend(init[f:min(known, ni)])
                if known > ni:
                    values.extend(gen[:known - ni])
            if known < e:
                values.extend([-1] * (e - max(known, f)))
            written.append(max(known, f))
        owner, cols = spans(start[due], ends[due])
        self.table.put(rows[due][owner], cols, np.array(values, dtype=np.int64))
        self.filled[rows[due]] = written

    def tokens(self):
        """The :class:`~kvcanary_cupy.ExpectedTokens` the monitors use this step."""
        if self._tokens is None:
            from ...plans import ExpectedTokens  # noqa: PLC0415

            self._tokens = ExpectedTokens(self.table.array, self.valid_lens, 0)
        return self._tokens
