"""What travels to the device each step: the per-step rows and the request tables' changes.

On the CPU the monitors read host arrays directly and nothing travels. On CUDA the
host writes pinned buffers and one kernel launch on the engine's compute stream reads
them in place, ordered before the monitors' launches that read its results; a buffer
is written again only once that launch is done (an event after it). Buffers, the
launch and the event are made once and reused.
"""
from __future__ import annotations

import array

import numpy as np

from .tables import as_ints

_BATCH = ("rows", "prefix", "extend", "valid")


def _write(buf: memoryview, values) -> None:
    """``buf[:len(values)] = values`` for a memoryview of int64: one C-level copy from Python ints."""
    buf[:len(values)] = array.array(buf.format, as_ints(values))


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
        if rows != self._last[0]:
            _write(rows_buf, rows)
        if extend != self._last[1]:
            _write(extend_buf, extend)
        _write(prefix_buf, prefix)
        _write(valid_buf, valid)
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
    """

    def __init__(self, device: str, steps: StepArrays | None = None):
        self.device = device
        self.cuda = str(device).startswith("cuda")
        self.steps = steps
        self._cap = 0
        self._event = None
        self._launcher = None  # HostUpdates for the current tables
        self._targets = None  # their arrays' ids
        self._target_arrays = ()

    def wait_reusable(self) -> None:
        """Before the host writes the step rows or queues changes: the previous launch has read them."""
        if self._event is not None:
            self._event.synchronize()

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
        self._host_address = self._host.ctypes.data
        self._launcher = None

    def flush(self, tables, stream=None) -> int:
        """Apply the pending changes of ``tables`` (and, on CUDA, copy the step rows) on the
        device, on ``stream`` (a raw CUDA stream; else the current stream); returns how many
        entries moved."""
        pending = [(t, t.take()) for t in tables if not t.cpu]
        pending = [(t, c) for t, c in pending if c is not None]
        total = sum(len(c[0]) for _, c in pending)
        if total == 0 and not (self.cuda and self.steps is not None):
            return 0
        self.wait_reusable()
        self._reserve(max(total, 1))
        at = 0
        ends = []
        for _, (idx, val) in pending:
            n = len(idx)
            self._host[at:at + n] = idx
            self._host32[2 * self._cap + at:2 * self._cap + at + n] = val
            at += n
            ends.append(at)
        if self.cuda:
            self._launch([t for t, _ in pending], ends, stream)
        else:
            self._torch_scatter(pending, total)
        return total

    def _launch(self, tables, ends, stream) -> None:
        """One HostUpdates launch on ``stream``: the step rows, then each table's changes."""
        import cupy  # noqa: PLC0415

        arrays = tuple(t.array for t in tables)
        if self._launcher is None or self._targets != tuple(map(id, arrays)):
            from ...backends.cuda import MAX_UPDATE_TARGETS, HostUpdates  # noqa: PLC0415

            if len(arrays) > MAX_UPDATE_TARGETS:
                raise ValueError(f"kvcanary: {len(arrays)} tables changed in one step; at most {MAX_UPDATE_TARGETS}")
            dev = int(self.device.split(":")[1])
            steps = self.steps
            self._launcher = HostUpdates(words=steps.pinned_address if steps else 0,
                                         copy_to=steps.device_address if steps else 0,
                                         targets=[(a.data_ptr(), a.numel()) for a in arrays], device=dev)
            self._targets, self._target_arrays = tuple(map(id, arrays)), arrays  # held: their ids stay theirs
            if self._event is None:
                with cupy.cuda.Device(dev):
                    self._event = cupy.cuda.Event(disable_timing=True)
        ptr = int(stream) if stream is not None else cupy.cuda.get_current_stream().ptr
        self._launcher(copy_words=self.steps.words if self.steps else 0, index=self._host_address,
                       value=self._host_address + 8 * self._cap, ends=ends, stream=ptr)
        cupy.cuda.runtime.eventRecord(self._event.ptr, ptr)

    def _torch_scatter(self, pending, total: int) -> None:
        """The same with torch ops on the current stream (a non-CUDA torch device)."""
        import torch  # noqa: PLC0415

        words = total + (total + 1) // 2
        dev = self._dev[:words]
        dev[:total].copy_(self._pinned[:total])
        vals = self._pinned[self._cap:self._cap + (total + 1) // 2]
        dev[total:].copy_(vals)
        values = dev[total:].view(torch.int32)
        at = 0
        for t, (idx, _) in pending:
            n = len(idx)
            t.array.view(-1).index_copy_(0, dev[at:at + n], values[at:at + n])
            at += n
