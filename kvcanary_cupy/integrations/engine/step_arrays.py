"""The few array operations a block-table step needs on the engine's arrays: NumPy (CPU) or torch (CUDA).

The engine's per-step arrays (its block table, lengths and slot mapping) stay where the
engine keeps them: NumPy views of CPU tensors on the CPU, torch tensors on CUDA, where
each operation below is one small launch on the current stream and none waits for the
device (index arrays come from the host).
"""
from __future__ import annotations

import numpy as np


def host_view(a) -> np.ndarray:
    """A CPU array (NumPy, a CPU torch tensor, a list) as NumPy, its own dtype, zero copy where it can."""
    if not isinstance(a, np.ndarray) and hasattr(a, "numpy") and (
            getattr(a, "is_cpu", False) or (getattr(a, "device", None) is not None and str(a.device) == "cpu")):
        a = a.numpy()
    return np.asarray(a)


def host_array(a, dtype=np.int64) -> np.ndarray:
    """A CPU array (NumPy, a CPU torch tensor, a list) as NumPy ``dtype``, zero copy where it can."""
    return host_view(a).astype(dtype, copy=False)


def positions(prefix, extend, total: int) -> np.ndarray:
    """Each token's position, host int64 ``[total]``: row after row, ``prefix[r] .. prefix[r] + extend[r] - 1``
    (``extend``: a sequence of a few ints, or an array)."""
    ext = extend.tolist() if isinstance(extend, np.ndarray) else extend
    if total == len(ext) and all(e == 1 for e in ext):  # one token a row: a decode step
        return np.array(prefix, dtype=np.int64)
    starts = np.cumsum(extend) - extend
    return np.repeat(np.asarray(prefix) - starts, extend) + np.arange(total, dtype=np.int64)


class NumpyOps:
    """Step operations over NumPy arrays (the CPU monitor's device)."""

    cpu = True

    def zeros(self, shape, dtype=np.int64):
        return np.zeros(shape, dtype=dtype)

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


class TorchOps:
    """Step operations over torch tensors on a CUDA ``device``."""

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

    def put_rows(self, table, rows, block_table) -> None:
        n = len(rows)
        table[self.from_host(rows), :block_table.shape[1]] = block_table[:n].to(table.dtype)

    def select(self, a, index):
        return a[self.from_host(index)] if isinstance(index, np.ndarray) else a[index]

    def copy_into(self, out, values, stream: int) -> None:
        """``out[:len(values)] = values`` on raw stream ``stream``: one device copy when ``values``
        is contiguous and of ``out``'s dtype (a vLLM slot mapping is int64), else a torch copy."""
        m = int(values.shape[0])
        if values.dtype == out.dtype and values.is_contiguous() and values.device == out.device:
            import cupy  # noqa: PLC0415

            rt = cupy.cuda.runtime
            rt.memcpyAsync(out.data_ptr(), values.data_ptr(), m * out.element_size(), rt.memcpyDeviceToDevice, stream)
            return
        with self.torch.cuda.stream(self.torch.cuda.ExternalStream(stream)):
            out[:m].copy_(values)


def _torch_dtype(torch, dtype):
    return {np.int64: torch.int64, np.int32: torch.int32}[np.dtype(dtype).type]


def ops_for(device: str):
    """:class:`NumpyOps` for ``"cpu"``, :class:`TorchOps` for a CUDA device."""
    return NumpyOps() if device == "cpu" else TorchOps(device)
