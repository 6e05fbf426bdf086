"""The request tables a monitor reads, filled on the host from the engine's own bookkeeping.

Each request the engine schedules gets a row (row 0 is the padding row), kept
while it stays live so a step writes only what changed: a new block, a block
the prefix cache swapped, a window that slid, the tokens generated since. The
host keeps a mirror of every table; on the CPU the monitor reads the mirror
itself, on CUDA the step's changes travel to the device (:mod:`.staging`).

The engine's host sync makes every microsecond spent here part of its step, so
the per-request work is plain Python over ints and lists, and a step's few
changes (a decode step's one token per request) are written entry by entry: a
NumPy call costs more than a decode step's whole row. Large changes (a prefill,
a rewritten row) go through NumPy.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import operator

import numpy as np

# Up to this many entries a table change is written entry by entry (see MirroredTable.put_list).
_FEW = 256

_ROW, _OWNER = operator.itemgetter(0), operator.itemgetter(1)  # of a RowPool entry (row, state)


def consume(iterator) -> None:
    """Run ``iterator`` to its end, keeping nothing: ``consume(map(f, xs))`` calls ``f`` on each in C."""
    collections.deque(iterator, maxlen=0)


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


def as_ints(values):
    """A NumPy array as a list of Python ints (cheap to index one by one); anything else as is."""
    return values.tolist() if isinstance(values, np.ndarray) else values


def _tokens_into(out: list, init: list, gen: list, first: int, end: int) -> int:
    """Append the tokens of positions ``first .. end - 1`` of prompt ``init`` then ``gen``, -1 for
    those not known yet; returns the first position not written with a known token."""
    ni = len(init)
    known = min(end, ni + len(gen))
    if first >= ni:
        out.extend(gen[first - ni:known - ni])
    else:
        out.extend(init[first:min(known, ni)])
        if known > ni:
            out.extend(gen[:known - ni])
    if known < end:
        out.extend([-1] * (end - max(known, first)))
    return max(known, first)


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
        self._last: tuple = ((), ())  # the states of the latest rows_of and their rows

    def rows_of(self, states: list) -> tuple[tuple, tuple]:
        """``(rows, fresh)`` of a step's states, in order: :meth:`acquire` for each, none
        taking a row another state of the step holds.

        A step that schedules the very same state objects in the same order as the step
        before (a steady decode) gets the same rows without touching the pool: acquiring
        them again would move them to the most recently used end, in that order, which is
        where they already are. A step whose states all hold rows already (requests left
        the batch or changed places) moves them there in C; only a step with a state new
        to the pool acquires one state at a time.

        Example::

            >>> pool = RowPool(4)
            >>> a, b = object(), object()
            >>> pool.rows_of([a, b]), pool.rows_of([a, b]), pool.rows_of([b])
            (((1, 2), (True, True)), ((1, 2), (False, False)), ((2,), (False,)))
        """
        last_states, last_rows = self._last
        if len(states) == len(last_states) and all(map(operator.is_, states, last_states)):
            return last_rows, (False,) * len(states)
        rows = self._rows_held(states)
        if rows is not None:
            self._last = (tuple(states), rows)
            return rows, (False,) * len(states)
        busy: set = set()
        rows, fresh = [], []
        for st in states:
            row, new = self.acquire(st, busy)
            busy.add(row)
            rows.append(row)
            fresh.append(new)
        rows = tuple(rows)
        self._last = (tuple(states), rows)
        return rows, tuple(fresh)

    def _rows_held(self, states: list) -> tuple | None:
        """The rows of ``states`` when every one of them holds its row already (a batch that
        lost or reordered requests), else None; what :meth:`acquire` of each would do, in C."""
        keys = list(map(id, states))
        held = list(map(self._owner.get, keys))
        if not all(held) or not all(map(operator.is_, map(_OWNER, held), states)):
            return None
        consume(map(self._owner.move_to_end, keys))  # most recently used, in batch order
        return tuple(map(_ROW, held))

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
        self._flat = memoryview(self.host.reshape(-1))  # one entry at a time, without NumPy's per-call cost
        self.width = int(width)

    def put(self, rows: np.ndarray, cols: np.ndarray, values) -> None:
        """Set ``[rows[i], cols[i]]`` to ``values[i]`` (or one value), each entry once; only changes travel."""
        if len(rows):
            self.put_flat(rows * self.width + cols, values)

    def put_list(self, flat: list, values: list) -> None:
        """:meth:`put_flat` for Python lists: a step's few changes (a decode step's one per
        request) are written one by one, which costs less than converting them for NumPy.

        Example::

            >>> t = MirroredTable(2, 3, "cpu")
            >>> t.put_list([4, 5], [7, -1])
            >>> t.host.tolist()
            [[0, 0, 0], [0, 7, -1]]
        """
        if len(flat) > _FEW:
            self.put_flat(np.array(flat, dtype=np.int64), np.array(values, dtype=np.int32))
            return
        mv = self._flat
        if self.cpu:
            for i, v in zip(flat, values):
                mv[i] = v
            return
        changed = []
        for i, v in zip(flat, values):
            if mv[i] != v:
                mv[i] = v
                changed.append(i)
        if changed:
            self._idx.append(changed)

    def put_flat(self, flat, values) -> None:
        """Set the entries at flat indices ``flat`` (int64 array) to ``values`` (or one value), each entry once.

        On the CPU the mirror is the table the monitor reads: the values go straight in.
        On CUDA only entries whose value changes are queued for the device.
        """
        if not len(flat):
            return
        hf = self.host.reshape(-1)
        if self.cpu:
            hf[flat] = values
            return
        values = np.broadcast_to(np.asarray(values, dtype=np.int32), flat.shape)
        diff = np.flatnonzero(hf[flat] != values)
        if diff.size:
            idx = flat[diff]
            hf[idx] = values[diff]
            self._idx.append(idx)

    def take(self):
        """The pending changes ``(flat indices, values)`` since the last take, or None: Python
        int lists when every change since came entry by entry (:meth:`put_list`), else
        arrays (int64 indices, int32 values).

        An entry changed twice travels once, with its final value (a scatter with repeated
        indices keeps an arbitrary one of them on a GPU).
        """
        pending = self._idx
        if not pending:
            return None
        if len(pending) == 1 and isinstance(pending[0], list):  # a decode step's
            idx = pending.pop()
            return idx, list(map(self._flat.__getitem__, idx))
        if all(isinstance(i, list) for i in pending):
            idx = list(dict.fromkeys(itertools.chain.from_iterable(pending)))
            pending.clear()
            return idx, list(map(self._flat.__getitem__, idx))
        idx = np.unique(np.concatenate([np.asarray(i, dtype=np.int64) for i in pending]))
        pending.clear()
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
        self.filled = [0] * rows  # per row: the first position not written with a known token
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

    def fill(self, rows, states: list, ends, fresh) -> None:
        """Write each request's known tokens of positions ``< ends[i]`` not written yet (all of a
        ``fresh`` row); positions not known yet (a token still being sampled) hold -1.

        ``rows``, ``ends`` and ``fresh`` are per request of ``states`` (sequences or arrays).
        A decode step writes one position per request: the token sampled last.
        """
        width, filled = self.width, self.filled
        flat, values = [], []  # single positions
        starts, stops, run_values = [], [], []  # longer runs (a prefill, a fresh row)
        for row, st, e, new in zip(as_ints(rows), states, as_ints(ends), as_ints(fresh)):
            f = 0 if new else filled[row]
            if e == f + 1:  # one position (every decode step): its token, -1 while not sampled yet
                init = st.initial_tokens
                k = f - len(init)  # its index in the generated tokens
                if k < 0:
                    values.append(init[f])
                    filled[row] = e
                else:
                    gen = st.generated_tokens
                    if k < len(gen):
                        values.append(gen[k])
                        filled[row] = e
                    else:
                        values.append(-1)
                        filled[row] = f
                flat.append(row * width + f)
            elif e > f:
                filled[row] = _tokens_into(run_values, st.initial_tokens, st.generated_tokens, f, e)
                starts.append(row * width + f)
                stops.append(row * width + e)
        if flat:
            self.table.put_list(flat, values)
        if starts:
            self.table.put_flat(spans(starts, stops)[1], np.array(run_values, dtype=np.int32))

    def tokens(self):
        """The :class:`~kvcanary_cupy.ExpectedTokens` the monitors use this step."""
        if self._tokens is None:
            from ...plans import ExpectedTokens  # noqa: PLC0415

            self._tokens = ExpectedTokens(self.table.array, self.valid_lens, 0)
        return self._tokens
