"""What travels to the device each step: the per-step rows and the request tables' changes.

On the CPU the monitors read host arrays directly and nothing travels. On CUDA the
host writes pinned buffers and one kernel launch on the engine's compute stream reads
them in place, ordered before the monitors' launches that read its results; a buffer
is written again only once that launch is done (an event after it). Buffers, the
launch and the event are made once and reused: the launch targets every table each
step (a table without changes gets an empty range), so it is made again only when a
table is replaced (the expected tokens' table widening).
"""
from __future__ import annotations

import array
import operator

import numpy as np

from .tables import as_ints

_BATCH = ("rows", "prefix", "extend", "valid")
_ARRAY = operator.attrgetter("array")


def _write(buf: memoryview, values, at: int = 0) -> None:
    """``buf[at:at + len(values)] = values`` for a memoryview of ints: one C-level copy from Python ints."""
    buf[at:at + len(values)] = array.array(buf.format, as_ints(values))


def _frozen(values) -> tuple:
    """``values`` as a tuple of Python ints (a tuple is kept as is)."""
    if isinstance(values, tuple):
        return values
    return tuple(values.tolist() if isinstance(values, np.ndarray) else values)


class StepArrays:
    """The per-step rows the monitors bind once: request row, prefix, extend and valid
    length per batch row, and per layer group the slots a decode-fast-path step writes
    (the engine fills no write index then: one token per request).

    Example::

        >>> s = StepArrays(max_batch=2, loc_groups=1, device="cpu")
        >>> s.set_batch((1, 2), [3, 4], [1, 1], [4, 5])
        >>> s.device_view("prefix").tolist(), s.host["loc0"].shape, s.loc[0] is s.host["loc0"]
        ([3, 4], (2,), True)
    """

    def __init__(self, *, max_batch: int, loc_groups: int, device: str):
        names = list(_BATCH) + [f"loc{i}" for i in range(loc_groups)]
        n = len(names) * max_batch
        self.cpu = device == "cpu"
        if self.cpu:
            buf = dev = np.zeros(n, dtype=np.int64)
            self._pinned = None
        else:
            import torch  # noqa: PLC0415

            self._pinned = torch.zeros(n, dtype=torch.int64, pin_memory=True)
            buf = self._pinned.numpy()
            dev = torch.zeros(n, dtype=torch.int64, device=device)
        self._dev = dev
        self._words = n
        self.host = {k: buf[i * max_batch:(i + 1) * max_batch] for i, k in enumerate(names)}
        self.loc = [self.host[f"loc{i}"] for i in range(loc_groups)]  # host rows by group index
        self._batch = [memoryview(self.host[k]) for k in _BATCH]
        self._last: tuple = (None, None)  # the rows and extend lengths in the buffer
        self._views = {k: dev[i * max_batch:(i + 1) * max_batch] for i, k in enumerate(names)}

    def device_view(self, name: str):
        """The device array the monitors bind for ``name``."""
        return self._views[name]

    def set_batch(self, rows, prefix, extend, valid) -> None:
        """Write the step's request rows, prefix, extend and valid lengths (one value per request).

        Rows and extend lengths equal to the previous step's (a steady decode: same
        requests, one token each) are already in the buffer and are not written again.
        """
        rows_buf, prefix_buf, extend_buf, valid_buf = self._batch
        rows, extend = _frozen(rows), _frozen(extend)
        last_rows, last_extend = self._last
        word, n = rows_buf.format, len(rows)  # one C-level copy each, from Python ints
        if rows is not last_rows and rows != last_rows:
            rows_buf[:n] = array.array(word, rows)
        if extend != last_extend:
            extend_buf[:n] = array.array(word, extend)
        prefix_buf[:n] = array.array(word, as_ints(prefix))
        valid_buf[:n] = array.array(word, as_ints(valid))
        self._last = (rows, extend)

    @property
    def pinned_address(self) -> int:
        """Host address of the pinned rows (CUDA)."""
        return self._pinned.data_ptr()

    @property
    def device_address(self) -> int:
        """Device address of the rows the monitors read (CUDA)."""
        return self._dev.data_ptr()

    @property
    def words(self) -> int:
        """How many int64 words the rows take."""
        return self._words


class ChangeUpload:
    """Every table's pending changes, and the step's rows, onto the device.

    On CUDA one launch does it all (:class:`~kvcanary_cupy.backends.cuda.HostUpdates`):
    it reads the step rows and the changes (flat indices int64, values int32) in place
    from pinned host memory, copies the rows and scatters the changes, so a step costs
    one kernel launch and no framework op. Elsewhere (a CPU torch device, for tests) one
    copy and one ``index_copy_`` per table do the same. ``device``: where the tables live.
    ``steps``: the :class:`StepArrays` whose rows travel with the changes (CUDA only).
    ``skipped``: device address of an int64 counter the launches add changes they could
    not apply to (CUDA; 0: each launcher counts on its own). ``rows_to``: an int32 CUDA
    table (a canary's page table) the same launch may copy an engine's table rows into,
    at the step rows' indices (``flush(..., rows_from=...)``).
    """

    def __init__(self, device: str, steps: StepArrays | None = None, skipped: int = 0, rows_to=None):
        self.device = device
        self._skipped_at = skipped
        self._rows_to = rows_to
        self.cuda = str(device).startswith("cuda")
        self.steps = steps
        self._cap = 0
        self._event = None
        self._in_flight = False  # a launch may still read the pinned buffers
        self._launcher = None  # HostUpdates for the current tables
        self._target_arrays = ()  # their arrays, held: a launch writes to their addresses
        self._max_targets = 0  # tables one launch takes
        self._copy_words = steps.words if steps is not None and self.cuda else 0
        if self.cuda:
            import cupy  # noqa: PLC0415

            from ...backends.cuda import MAX_UPDATE_TARGETS  # noqa: PLC0415

            self._max_targets = MAX_UPDATE_TARGETS
            self._record_event, self._current_stream = cupy.cuda.runtime.eventRecord, cupy.cuda.get_current_stream

    def wait_reusable(self) -> None:
        """Before the host writes the step rows or queues changes: the previous launch has read them."""
        if self._in_flight:
            self._event.synchronize()
            self._in_flight = False

    def _reserve(self, n: int) -> None:
        """Room for ``n`` changes: ``n`` int64 indices and ``n`` int32 values (``ceil(n / 2)`` int64 words)."""
        if n <= self._cap:
            return
        self._cap = max(2 * n, 4096)
        words = self._cap + (self._cap + 1) // 2
        if self.cuda:
            import cupy  # noqa: PLC0415

            self._host = np.frombuffer(cupy.cuda.alloc_pinned_memory(8 * words), np.int64, words)
        else:
            import torch  # noqa: PLC0415

            self._pinned = torch.empty(words, dtype=torch.int64)
            self._host = self._pinned.numpy()
            self._dev = torch.empty(words, dtype=torch.int64, device=self.device)
        self._host32 = self._host.view(np.int32)
        self._index_words = memoryview(self._host)[:self._cap]  # Python int lists go in through these
        self._value_words = memoryview(self._host32)[2 * self._cap:]
        self._host_address = self._host.ctypes.data
        self._launcher = None

    def flush(self, tables, stream=None, rows_from=None) -> int:
        """Apply the pending changes of ``tables`` (and, on CUDA, copy the step rows) on the
        device, on ``stream`` (a raw CUDA stream; else the current stream); returns how many
        entries moved. ``rows_from`` (CUDA, with ``rows_to``): ``(table, n)``, a contiguous-row
        int32 CUDA tensor whose rows ``0 .. n - 1`` go to ``rows_to``'s rows named by the
        step rows' first ``n`` words, in the same launch."""
        if rows_from is not None and not (self.cuda and self.steps is not None and self._rows_to is not None):
            raise ValueError("kvcanary: rows_from: table rows travel only in a CUDA launch made with step rows "
                             "and rows_to; copy them with the framework instead")
        tables = [t for t in tables if not t.cpu]
        changes = [t.take() for t in tables]
        total = sum(len(c[0]) for c in changes if c is not None)
        if total == 0 and not (self.cuda and self.steps is not None):
            return 0
        self.wait_reusable()
        self._reserve(max(total, 1))
        at = 0
        ends = []
        for change in changes:
            if change is not None:
                at = self._stage(*change, at)
            ends.append(at)
        if not self.cuda:
            self._torch_scatter(tables, changes, ends)
        elif len(tables) <= self._max_targets:  # every table: the launch stays the same from step to step
            self._launch(tables, ends, stream, rows_from)
        else:
            self._launch(*self._changed_only(tables, changes, ends), stream, rows_from)
        return total

    def _stage(self, idx, values, at: int) -> int:
        """Put one table's changes in the pinned buffers from ``at``; returns where the next one starts."""
        n = len(idx)
        if isinstance(idx, list):
            _write(self._index_words, idx, at)
            _write(self._value_words, values, at)
        else:
            self._host[at:at + n] = idx
            self._host32[2 * self._cap + at:2 * self._cap + at + n] = values
        return at + n

    def _changed_only(self, tables: list, changes: list, ends: list) -> tuple[list, list]:
        """``(tables, ends)`` of the tables that changed: the targets when there are more tables
        than a launch takes."""
        most = self._max_targets
        changed = [i for i, c in enumerate(changes) if c is not None]
        if len(changed) > most:
            raise ValueError(f"kvcanary: {len(changed)} tables changed in one step; at most {most}")
        return [tables[i] for i in changed], [ends[i] for i in changed]

    def _launch(self, tables, ends, stream, rows_from=None) -> None:
        """One HostUpdates launch on ``stream``: the step rows, each table's changes, the table rows."""
        arrays = tuple(map(_ARRAY, tables))
        held = self._target_arrays
        if self._launcher is None or len(arrays) != len(held) or not all(map(operator.is_, arrays, held)):
            self._make_launcher(arrays)
        ptr = int(stream) if stream is not None else self._current_stream().ptr
        rows = None
        if rows_from is not None:
            src, n = rows_from
            rows = (src.data_ptr(), src.stride(0), n, src.shape[1])
        self._launcher(copy_words=self._copy_words, index=self._host_address,
                       value=self._host_address + 8 * self._cap, ends=ends, stream=ptr, rows_from=rows)
        self._record_event(self._event.ptr, ptr)
        self._in_flight = True

    def _make_launcher(self, arrays: tuple) -> None:
        """The HostUpdates launch (and its event) for the step rows and the tables' ``arrays``."""
        import cupy  # noqa: PLC0415

        from ...backends.cuda import HostUpdates  # noqa: PLC0415

        dev = int(self.device.split(":")[1])
        steps = self.steps
        to = self._rows_to
        self._launcher = HostUpdates(words=steps.pinned_address if steps else 0,
                                     copy_to=steps.device_address if steps else 0,
                                     targets=[(a.data_ptr(), a.numel()) for a in arrays], device=dev,
                                     skipped=self._skipped_at,
                                     rows_to=None if to is None else (to.data_ptr(), to.shape[0], to.shape[1]))
        self._target_arrays = arrays
        if self._event is None:
            with cupy.cuda.Device(dev):
                self._event = cupy.cuda.Event(disable_timing=True)

    def _torch_scatter(self, tables, changes, ends) -> None:
        """The same with torch ops on the current stream (a non-CUDA torch device)."""
        import torch  # noqa: PLC0415

        total = ends[-1]
        words = total + (total + 1) // 2
        dev = self._dev[:words]
        dev[:total].copy_(self._pinned[:total])
        vals = self._pinned[self._cap:self._cap + (total + 1) // 2]
        dev[total:].copy_(vals)
        values = dev[total:].view(torch.int32)
        at = 0
        for t, change, end in zip(tables, changes, ends):
            if change is not None:
                t.array.view(-1).index_copy_(0, dev[at:end], values[at:end])
            at = end


class TokenStaging:
    """A step's token ids and positions (host values) onto the device buffers a monitor binds.

    The host writes them into pinned memory and a copy on the step's stream carries them (one
    2-D copy where the two device rows are ``n``-word rows of one array, else two); the host
    writes again only once the previous step's copy is done (an event after it), so a step
    never waits for the device in the common case. ``n``: tokens at most; ``device``: the
    CUDA device (``"cuda:N"``).
    """

    def __init__(self, n: int, device: str):
        import cupy  # noqa: PLC0415

        self._rt = cupy.cuda.runtime
        self.n = int(n)
        self._host = np.frombuffer(cupy.cuda.alloc_pinned_memory(16 * self.n), np.int64, 2 * self.n).reshape(2, self.n)
        self._address = self._host.ctypes.data
        with cupy.cuda.Device(int(str(device).split(":")[1])):
            self._event = cupy.cuda.Event(disable_timing=True)
        self._in_flight = False

    def copy(self, ids, pos, out_ids, out_pos, stream: int) -> None:
        """``out_ids[:m], out_pos[:m] = ids, pos`` on raw stream ``stream`` (host int64 ``[m]`` each;
        contiguous int64 device tensors out)."""
        m = len(ids)
        if self._in_flight:
            self._event.synchronize()
        self._host[0, :m] = ids
        self._host[1, :m] = pos
        rt = self._rt
        dst, pitch = out_ids.data_ptr(), out_pos.data_ptr() - out_ids.data_ptr()
        if pitch >= 8 * m and m:
            rt.memcpy2DAsync(dst, pitch, self._address, 8 * self.n, 8 * m, 2, rt.memcpyHostToDevice, stream)
        else:
            rt.memcpyAsync(dst, self._address, 8 * m, rt.memcpyHostToDevice, stream)
            rt.memcpyAsync(out_pos.data_ptr(), self._address + 8 * self.n, 8 * m, rt.memcpyHostToDevice, stream)
        rt.eventRecord(self._event.ptr, stream)
        self._in_flight = True
