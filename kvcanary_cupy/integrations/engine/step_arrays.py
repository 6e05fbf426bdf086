"""The few array operations a block-table step needs, on NumPy (CPU) or torch (CPU or CUDA).

The engine's per-step arrays (its block table, lengths and slot mapping) stay where the
engine keeps them: NumPy views of CPU tensors on the CPU, torch tensors on CUDA, where
each operation below is one small launch on the current stream and none waits for the
device (index arrays come from the host, lengths are taken from the host when given).
"""
from __future__ import annotations

import numpy as np


def host_array(a, dtype=np.int64) -> np.ndarray:
    """A CPU array (NumPy, a CPU torch tensor, a list) as NumPy ``dtype``, zero copy where it can."""
    if hasattr(a, "numpy") and getattr(a, "device", None) is not None and str(a.device) == "cpu":
        a = a.numpy()
    return np.asarray(a).astype(dtype, copy=False)


class NumpyOps:
    """Step operations over NumPy arrays (the CPU monitor's device)."""

    cpu = True

    def zeros(self, shape, dtype=np.int64):
        return np.zeros(shape, dtype=dtype)

    def from_host(self, values, dtype=np.int64):
        return np.asarray(values, dtype=dtype)

    def arr(self, a, dtype=np.int64):
        return host_array(a, dtype)

    def put_rows(self, table, rows, block_table) -> None:
        """``table[rows, :width] = block_table`` (rows: host ints)."""
        bt = host_array(block_table, table.dtype)
        table[rows, :bt.shape[1]] = bt[:len(rows)]

    def lengths(self, seq_lens, query_start_loc, n: int):
        """``(prefix, extend)`` int64 ``[n]`` of each row: cached tokens read, new tokens written."""
        seq = host_array(seq_lens)[:n]
        qsl = host_array(query_start_loc)[:n + 1]
        ext = np.diff(qsl)
        return seq - ext, ext

    def positions(self, prefix, extend, total: int):
        """Each token's position: row after row, ``prefix[r] .. prefix[r] + extend[r] - 1``."""
        starts = np.cumsum(extend) - extend
        return np.repeat(prefix - starts, extend) + np.arange(total, dtype=np.int64)

    def select(self, a, index):
        return a[index]


class TorchOps:
    """Step operations over torch tensors on ``device`` (a CUDA device, or "cpu" for tests)."""

    cpu = False

    def __init__(self, device: str):
        import torch  # noqa: PLC0415

        self.torch = torch
        self.device = torch.device(device)

    def zeros(self, shape, dtype=np.int64):
        return self.torch.zeros(shape, dtype=_torch_dtype(self.torch, dtype), device=self.device)

    def from_host(self, values, dtype=np.int64):
        t = self.torch.as_tensor(np.asarray(values, dtype=dtype))
        return t.to(self.device, non_blocking=True)

    def arr(self, a, dtype=np.int64):
        return a.to(_torch_dtype(self.torch, dtype))

    def put_rows(self, table, rows, block_table) -> None:
        n = len(rows)
        table[self.from_host(rows), :block_table.shape[1]] = block_table[:n].to(table.dtype)

    def lengths(self, seq_lens, query_start_loc, n: int):
        seq = seq_lens[:n].to(self.torch.int64)
        qsl = query_start_loc[:n + 1].to(self.torch.int64)
        ext = qsl[1:] - qsl[:-1]
        return seq - ext, ext

    def positions(self, prefix, extend, total: int):
        starts = self.torch.cumsum(extend, 0) - extend
        return (self.torch.repeat_interleave(prefix - starts, extend, output_size=total)
                + self.torch.arange(total, device=self.device))

    def select(self, a, index):
        return a[self.from_host(index)] if isinstance(index, np.ndarray) else a[index]


def _torch_dtype(torch, dtype):
    return {np.int64: torch.int64, np.int32: torch.int32}[np.dtype(dtype).type]


def ops_for(device: str):
    """:class:`NumpyOps` for ``"cpu"``, :class:`TorchOps` for a CUDA device."""
    return NumpyOps() if device == "cpu" else TorchOps(device)
