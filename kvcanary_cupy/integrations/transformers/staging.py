"""What travels to the device each step: the per-step rows and the request tables' changes.

On the CPU the monitors read host arrays directly and nothing travels. On CUDA the
host writes pinned buffers and one asynchronous copy per buffer moves them, on the
engine's compute stream, ordered before the monitors' launches that read them; a
buffer is written again only once its previous copy is done.
"""
from __future__ import annotations

import numpy as np


class StepArrays:
    """The per-step rows the monitors bind once: request row, prefix, extend and valid
    length per batch row, and per layer group the slots a decode-fast-path step writes
    (the engine fills no write index then: one token per request).

    Example::

        >>> s = StepArrays(max_batch=2, loc_groups=1, device="cpu")
        >>> s.host["prefix"][:] = [3, 4]
        >>> s.device_view("prefix").tolist(), s.host["loc0"].shape
        ([3, 4], (2,))
    """

    def __init__(self, *, max_batch: int, loc_groups: int, device: str):
        names = ["rows", "prefix", "extend", "valid"] + [f"loc{i}" for i in range(loc_groups)]
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
        self._views = {k: dev[i * max_batch:(i + 1) * max_batch] for i, k in enumerate(names)}

    def device_view(self, name: str):
        """The device array the monitors bind for ``name``."""
        return self._views[name]

    def wait_reusable(self) -> None:
        """Before the host writes the next step: the previous upload has left the pinned buffer."""
        if self._event is not None:
            self._event.synchronize()

    def upload(self, stream) -> None:
        """Copy the step's rows to the device, on ``stream`` (nothing to do on the CPU)."""
        if self.cpu:
            return
        import torch  # noqa: PLC0415

        with torch.cuda.stream(stream):
            self._dev.copy_(self._pinned, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)


class ChangeUpload:
    """On CUDA: every table's pending changes in one pinned copy, then one scatter per table."""

    def __init__(self, device: str):
        self.device = device
        self._cap = 0
        self._event = None

    def _reserve(self, n: int) -> None:
        import torch  # noqa: PLC0415

        if n <= self._cap:
            return
        self._cap = max(2 * n, 4096)
        self._pinned = torch.empty(2 * self._cap, dtype=torch.int64, pin_memory=True)
        self._host = self._pinned.numpy()
        self._dev = torch.empty(2 * self._cap, dtype=torch.int64, device=self.device)

    def flush(self, tables, stream) -> int:
        """Apply the pending changes of ``tables`` on the device; returns how many entries moved."""
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
            self._host[total + at:total + at + n] = val
            at += n
        with torch.cuda.stream(stream):
            dev = self._dev[:2 * total]
            dev.copy_(self._pinned[:2 * total], non_blocking=True)
            at = 0
            for t, (idx, _) in pending:
                n = len(idx)
                t.array.view(-1).index_copy_(0, dev[at:at + n], dev[total + at:total + at + n].to(torch.int32))
                at += n
            self._event = torch.cuda.Event()
            self._event.record(stream)
        return total
