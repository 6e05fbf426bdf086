"""Device plumbing the monitor needs on top of the ops: streams, capture, lazy host reads.

Every helper takes the monitor's device string and works on NumPy (``"cpu"``)
and CuPy (CUDA) alike; CuPy is imported only on a CUDA device, PyTorch only when
the caller already imported it.
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np

from . import arrays


def is_cpu(device: str) -> bool:
    return device == "cpu"


def _current_device() -> int:
    cp = sys.modules.get("cupy") or __import__("cupy")
    return int(cp.cuda.runtime.getDevice())


def _cupy_stream(ptr):
    return arrays.cupy_stream(int(ptr), _current_device())


def on_stream(device: str, ptr):
    """A context that makes ``ptr`` CuPy's current stream, so the monitor's own small
    array operations run in stream order with the ops (and are captured with them)."""
    if is_cpu(device) or ptr is None:
        return contextlib.nullcontext()
    return arrays.on_cupy_stream(int(ptr), _current_device())


def is_capturing(device: str, ptr) -> bool:
    """True while ``ptr`` is being captured into a CUDA graph (CuPy or PyTorch capture)."""
    if is_cpu(device):
        return False
    try:
        cp = __import__("cupy")
        return bool(cp.cuda.runtime.streamIsCapturing(int(ptr)))
    except Exception:  # noqa: BLE001  (fall back to PyTorch's view of its own stream)
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                return bool(torch.cuda.is_current_stream_capturing())
            except Exception:  # noqa: BLE001
                return False
        return False


def synchronize(device: str, ptr=None) -> None:
    """Wait for the work queued on ``ptr`` (or the whole device); nothing on the CPU."""
    if is_cpu(device):
        return
    cp = __import__("cupy")
    if ptr is None:
        cp.cuda.Device().synchronize()
    else:
        _cupy_stream(ptr).synchronize()


def mark(device: str, ptr):
    """An event recorded on stream ``ptr`` now (None on the CPU): see :func:`wait`."""
    if is_cpu(device):
        return None
    cp = __import__("cupy")
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(_cupy_stream(ptr))
    return ev


def wait(event) -> None:
    """Wait until the work queued before ``event`` (from :func:`mark`) is done."""
    if event is not None:
        event.synchronize()


def put(dst, src, ptr=None) -> None:
    """Copy ``src`` (NumPy or an array of ``dst``'s kind) into ``dst`` without allocating on the device."""
    if isinstance(dst, np.ndarray):
        if not isinstance(src, np.ndarray):
            src = arrays.to_host(src)
        dst[...] = src
        return
    if isinstance(src, np.ndarray):
        src = np.ascontiguousarray(src, dtype=dst.dtype)
        dst.set(src, stream=None if ptr is None else _cupy_stream(ptr))
        return
    with on_stream("cuda", ptr):
        dst[...] = src


class HostReader:
    """Reads small int64 device arrays on the host without stalling the stream.

    On the CPU :meth:`read_now` and :meth:`poll` return the arrays themselves. On
    CUDA :meth:`poll` returns what the copy queued by the previous poll found (or
    ``None`` the first time) and queues the next copy into pinned memory.
    """

    def __init__(self, device: str, sources: list):
        self.device = device
        self.sources = list(sources)
        self._pinned = None
        self._event = None
        self._staged = False

    def read_now(self) -> list[np.ndarray]:
        """Current values (synchronizes on CUDA)."""
        return [np.array(arrays.to_host(a)) for a in self.sources]

    def poll(self, ptr=None):
        if is_cpu(self.device):
            return [np.array(a) for a in self.sources]
        cp = __import__("cupy")
        found = None
        if self._staged:
            self._event.synchronize()
            found = [np.array(p) for p in self._pinned]
        if self._pinned is None:
            self._pinned = [np.frombuffer(cp.cuda.alloc_pinned_memory(max(a.nbytes, 8)), a.dtype, a.size)
                            .reshape(a.shape) for a in self.sources]
            self._event = cp.cuda.Event(disable_timing=True)
        s = _cupy_stream(ptr) if ptr is not None else cp.cuda.get_current_stream()
        for a, p in zip(self.sources, self._pinned):
            a.get(stream=s, out=p, blocking=False)  # CuPy's default would block the host
        self._event.record(s)
        self._staged = True
        return found

    def reset(self) -> None:
        self._staged = False
