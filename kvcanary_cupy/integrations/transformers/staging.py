"""What travels to the device each step: the per-step rows and the request tables' changes.

On the CPU the monitors read host arrays directly and nothing travels. On CUDA the
host writes pinned buffers and one asynchronous copy per buffer moves them, on the
engine's compute stream, ordered before the monitors' launches that read them; a
buffer is written again only once its previous copy is done. The caller makes the
compute stream current around :meth:`StepArrays.upload` and :meth:`ChangeUpload.flush`
(one stream switch per step); buffers and events are made once and reused.
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
        self._event = None
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

    def wait_reusable(self) -> None:
        """Before the host writes the next step: the previous upload has left the pinned buffer."""
        if self._event is not None:
            self._event.synchronize()

    def upload(self) -> None:
        """Copy the step's rows to the device, on the current (compute) stream (nothing to do on the CPU)."""
        if self.cpu:
            return
        import torch  # noqa: PLC0415

        self._dev.copy_(self._pinned, non_blocking=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()


class ChangeUpload:
    """Every table's pending changes in one pinned copy, then one scatter per table.

    The copy holds the flat indices (int64) of every table's changes, then their values
    packed as int32 (what the tables hold), so no cast runs on the device. ``device``:
    where the tables live (``"cuda:N"``; a CPU torch device works too, unpinned, for tests).
    """

    def __init__(self, device: str):
        self.device = device
        self.cuda = str(device).startswith("cuda")
        self._cap = 0
        self._event = None

    def _reserve(self, n: int) -> None:
        """Room for ``n`` changes: ``n`` int64 indices and ``n`` int32 values (``ceil(n / 2)`` int64 words)."""
        import torch  # noqa: PLC0415

        if n <= self._cap:
            return
        self._cap = max(2 * n, 4096)
        words = self._cap + (self._cap + 1) // 2
        self._pinned = torch.empty(words, dtype=torch.int64, pin_memory=self.cuda)
        self._host = self._pinned.numpy()
        self._host32 = self._host.view(np.int32)
        self._dev = torch.empty(words, dtype=torch.int64, device=self.device)

    def flush(self, tables) -> int:
        """Apply the pending changes of ``tables`` on the device, on the current stream; returns how many
        entries moved."""
        pending = [(t, t.take()) for t in tables if not t.cpu]
        pending = [(t, c) for t, c in pending if c is not None]
        total = sum(len(c[0]) for _, c in pending)
        if total == 0:
            return 0
        import torch  # noqa: PLC0415

        if self._event is not None:
            self._event.synchronize()
        self._reserve(total)
        at = 0
        for _, (idx, val) in pending:
            n = len(idx)
            self._host[at:at + n] = idx
            self._host32[2 * total + at:2 * total + at + n] = val
            at += n
        words = total + (total + 1) // 2
        dev = self._dev[:words]
        dev.copy_(self._pinned[:words], non_blocking=True)
        values = dev[total:].view(torch.int32)  # the int32 values, packed after the indices
        at = 0
        for t, (idx, _) in pending:
            n = len(idx)
            t.array.view(-1).index_copy_(0, dev[at:at + n], values[at:at + n])
            at += n
        if self.cuda:
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()
        return total
