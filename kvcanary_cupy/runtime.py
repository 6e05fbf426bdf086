"""The device runtime: lazy CuPy, devices, streams, capture and host reads.

Every helper takes a device string (``"cpu"`` or ``"cuda:N"``) and works on
NumPy and CuPy alike; CuPy is imported only when a CUDA device is asked for,
PyTorch only when the caller already imported it. A helper given a device
works on that device, whichever device is current.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterable

import numpy as np


# --- CuPy, lazily -----------------------------------------------------------------
def cupy():
    try:
        import cupy  # noqa: PLC0415  (lazy on purpose: the package loads without it)
    except ImportError as e:
        raise ValueError(
            "kvcanary: device: a CUDA device needs CuPy, which is not installed here "
            f"({e}); install the extra that matches the driver, pip install 'kvcanary_cupy[cuda13]' "
            "(or [cuda12]), or pass device='cpu' for the NumPy backend") from None
    return cupy


def cupy_loaded() -> bool:
    return "cupy" in sys.modules


def is_cupy_array(x) -> bool:
    return cupy_loaded() and isinstance(x, sys.modules["cupy"].ndarray)


# --- devices ----------------------------------------------------------------------
def parse_device(device) -> tuple[str, int | None]:
    """``"cpu"`` -> ("cpu", None); ``"cuda"`` -> ("cuda", current); ``"cuda:N"`` -> ("cuda", N)."""
    if device is None or device == "cpu":
        return ("cpu", None)
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        idx = None
        if device != "cuda":
            try:
                idx = int(device[5:])
            except ValueError:
                idx = -1
        if idx is None or idx >= 0:
            return ("cuda", _working_device(device, idx))
    raise ValueError(f"kvcanary: device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _working_device(device: str, idx: int | None) -> int:
    """The ordinal of a CUDA device CuPy can use (``idx``, or the current one), or a
    ``kvcanary:`` error that says what to install or pass instead."""
    cp = cupy()
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
        if idx is None:
            idx = int(cp.cuda.runtime.getDevice())
    except Exception as e:  # noqa: BLE001  (CUDARuntimeError: no driver, no device, broken install)
        raise ValueError(f"kvcanary: device: {device!r} needs a working CUDA device, but CuPy found none "
                         f"({type(e).__name__}: {e}); pass device='cpu' for the NumPy backend") from None
    if not 0 <= idx < count:
        raise ValueError(f"kvcanary: device: {device!r} is not one of the {count} CUDA device(s) CuPy sees")
    return idx


def device_of(a) -> str:
    """The device string of a NumPy / CuPy array: ``"cpu"`` or ``"cuda:N"``."""
    if isinstance(a, np.ndarray):
        return "cpu"
    return _CUDA_NAMES[a.data.device_id]  # no Device object: this runs per argument per op


class _CudaNames(dict):
    def __missing__(self, idx: int) -> str:
        self[idx] = name = f"cuda:{idx}"
        return name


_CUDA_NAMES = _CudaNames()


def array_module(device: str):
    """numpy for ``"cpu"``, cupy for a CUDA device."""
    return np if parse_device(device)[0] == "cpu" else cupy()


def empty(shape, dtype, device: str, fill=None):
    """Allocate a library-owned array on ``device`` (NumPy on cpu, CuPy on CUDA)."""
    kind, idx = parse_device(device)
    if kind == "cpu":
        a = np.empty(shape, dtype=dtype)
    else:
        cp = cupy()
        with cp.cuda.Device(idx):
            a = cp.empty(shape, dtype=dtype)
    if fill is not None:
        a.fill(fill)
    return a


def device_index(device: str) -> int:
    """The CUDA ordinal of ``"cuda:N"``, or of the current device for ``"cuda"``."""
    return int(device[5:]) if device != "cuda" else int(cupy().cuda.runtime.getDevice())


# --- streams ----------------------------------------------------------------------
_STREAMS: dict = {}  # (ptr, device) -> CuPy stream wrapping it


class _StreamHandle:
    """A raw stream pointer speaking the CUDA stream protocol."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def cupy_stream(ptr: int, device_id: int):
    """A (cached) CuPy stream object for a raw ``cudaStream_t``. To run CuPy's own
    operations on it, enter :func:`on_cupy_stream`, not the object itself."""
    key = (ptr, device_id)
    s = _STREAMS.get(key)
    if s is None:
        if len(_STREAMS) > 64:
            _STREAMS.clear()
        cp = cupy()
        if ptr == 0:
            s = cp.cuda.Stream.null
        elif hasattr(cp.cuda.Stream, "from_external"):  # CuPy >= 14
            s = cp.cuda.Stream.from_external(_StreamHandle(ptr))
        else:
            s = cp.cuda.ExternalStream(ptr, device_id)
        _STREAMS[key] = s
    return s


@contextlib.contextmanager
def on_cupy_stream(ptr: int, device_id: int):
    """Run the block's CuPy work on stream ``ptr``; afterwards CuPy's current stream is
    the caller's again.

    CuPy's ``with stream:`` alone does not promise that: leaving it can fall back to the
    null stream instead of a stream the caller made current with ``.use()``
    (cupy/cupy#8377). The caller's next CuPy work would then leave its own stream, unordered
    with everything queued there, a race that only shows when the device is busy. So the
    block switches streams only when it must, and puts the caller's stream back if CuPy
    did not."""
    cp = cupy()
    before = cp.cuda.get_current_stream()
    if before.ptr == ptr:
        yield before
        return
    try:
        with cupy_stream(ptr, device_id) as s:
            yield s
    finally:
        if cp.cuda.get_current_stream().ptr != before.ptr:
            before.use()


def to_host(a) -> np.ndarray:
    """A NumPy copy (synchronizing for CuPy arrays): for tests, read() and debugging."""
    if isinstance(a, np.ndarray):
        return a
    return a.get()


# --- streams -----------------------------------------------------------------
def is_torch(obj) -> bool:
    return type(obj).__module__.startswith("torch")


def resolve_stream(stream, inputs: Iterable[Any] = ()):
    """The CUDA stream (raw pointer, int) an op runs on.

    ``stream`` may be an object with ``__cuda_stream__`` (cuda.core, PyTorch >= 2.6),
    a CuPy stream, a PyTorch stream, or a raw ``cudaStream_t`` int. Default:
    PyTorch's current stream when any input is a PyTorch tensor, else CuPy's.
    """
    if stream is None:
        if "torch" in sys.modules:
            for x in inputs:
                if is_torch(x) and getattr(x, "is_cuda", False):
                    return int(sys.modules["torch"].cuda.current_stream(x.device).cuda_stream)
        return int(cupy().cuda.get_current_stream().ptr)
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        proto = stream.__cuda_stream__
        proto = proto() if callable(proto) else proto
        return int(proto[1])
    for attr in ("ptr", "cuda_stream", "handle"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(
        f"kvcanary: stream: expected an object with __cuda_stream__, a CuPy or PyTorch stream or a raw "
        f"cudaStream_t int, got {type(stream).__name__}"
    )


# --- work in stream order -------------------------------------------------------------
def is_cpu(device: str) -> bool:
    return device == "cpu"


def on_stream(device: str, ptr):
    """A context in which CuPy's own array operations run on stream ``ptr`` of ``device``,
    so the library's small device writes are in stream order with the ops (and are
    captured with them); afterwards the caller's device and stream are current again."""
    if is_cpu(device) or ptr is None:
        return contextlib.nullcontext()
    return _on_device_stream(device_index(device), int(ptr))


@contextlib.contextmanager
def _on_device_stream(dev: int, ptr: int):
    cp = cupy()
    with cp.cuda.Device(dev), on_cupy_stream(ptr, dev) as s:
        yield s


def is_capturing(device: str, ptr) -> bool:
    """True while ``ptr`` is being captured into a CUDA graph (CuPy or PyTorch capture)."""
    if is_cpu(device):
        return False
    try:
        return bool(cupy().cuda.runtime.streamIsCapturing(int(ptr)))
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
    if ptr is None:
        cupy().cuda.Device(device_index(device)).synchronize()
    else:
        cupy_stream(int(ptr), device_index(device)).synchronize()


def mark(device: str, ptr):
    """An event recorded on stream ``ptr`` now (None on the CPU): see :func:`wait`."""
    if is_cpu(device):
        return None
    ev = cupy().cuda.Event(disable_timing=True)
    ev.record(cupy_stream(int(ptr), device_index(device)))
    return ev


def wait(event) -> None:
    """Wait until the work queued before ``event`` (from :func:`mark`) is done."""
    if event is not None:
        event.synchronize()


def put(dst, src, ptr=None) -> None:
    """Copy ``src`` (NumPy or an array of ``dst``'s kind) into ``dst`` without allocating on the device."""
    if isinstance(dst, np.ndarray):
        if not isinstance(src, np.ndarray):
            src = to_host(src)
        dst[...] = src
        return
    if isinstance(src, np.ndarray):
        src = np.ascontiguousarray(src, dtype=dst.dtype)
        dst.set(src, stream=None if ptr is None else cupy_stream(int(ptr), dst.data.device_id))
        return
    with on_stream(device_of(dst), ptr):
        dst[...] = src


class HostReader:
    """Reads small int64 device arrays on the host without stalling the stream.

    On the CPU :meth:`read_now` and :meth:`poll` return copies of the arrays. On CUDA
    :meth:`poll` returns what the copy queued by the previous poll found (or ``None``
    when none is queued) and queues the next copy into pinned memory: one
    ``cudaMemcpyAsync`` per array or requested row range (one for all the arrays that are
    views of one allocation), no CuPy array work on the way. Two pinned sets alternate, so
    what a poll returns are views of the set the copy landed in, valid until the next poll
    (which queues into the other set).
    """

    def __init__(self, device: str, sources: list):
        self.device = device
        self.sources = list(sources)
        self._sets = None  # two lists of pinned NumPy arrays shaped like the sources
        self._groups = None  # source indices by the allocation they are views of
        self._spans = None  # per group: (device address, bytes) its sources cover
        self._bases = None  # per set, per group: the pinned address its span lands at
        self._dev = None
        self._events = None
        self._next = 0  # the set the next copy goes to
        self._staged = None  # (set, row ranges) of the queued copy

    def read_now(self) -> list[np.ndarray]:
        """Current values (synchronizes on CUDA)."""
        return [np.array(to_host(a)) for a in self.sources]

    def poll(self, ptr=None, *, queue_next: bool = True):
        """What the queued copy found (None if none), then, with ``queue_next``, queue the next
        copy on ``ptr``. ``queue_next=False`` is for a caller that queues its copy right
        after its launches and reads it after its own synchronization (one copy per step)."""
        found = self.take()
        if queue_next:
            self.queue(ptr)
        return found

    def take(self, rows=None):
        """What the queued copy found (waiting for it), or None when none is queued; on the
        CPU, copies of the arrays now (``rows``: per source, a ``(start, stop)`` range to copy,
        as :meth:`queue` takes; None: all of it)."""
        if is_cpu(self.device):
            rows = rows or [None] * len(self.sources)
            return [np.array(a if r is None else a[r[0]:r[1]]) for a, r in zip(self.sources, rows)]
        if self._staged is None:
            return None
        k, got = self._staged
        self._staged = None
        self._events[k].synchronize()
        return [p[r0:r1] for p, (r0, r1) in zip(self._sets[k], got)]

    def queue(self, ptr=None, rows=None) -> None:
        """Queue a copy of the arrays on stream ``ptr`` (nothing on the CPU). ``rows``: per
        source, a ``(start, stop)`` range along its first axis to copy (None: all of it);
        :meth:`take` then returns those ranges. Sources that are views of one allocation,
        copied whole, travel in one copy of the span they cover."""
        if is_cpu(self.device):
            return
        cp = cupy()
        rt = cp.cuda.runtime
        if self._sets is None:
            self._allocate(cp)
        k = self._next
        self._next ^= 1
        stream = int(ptr) if ptr is not None else cp.cuda.get_current_stream().ptr
        rows = rows or [None] * len(self.sources)
        ranges = [(0, int(a.shape[0])) if r is None else r for a, r in zip(self.sources, rows)]
        copies = []
        for base, (lo, size), members in zip(self._bases[k], self._spans, self._groups):
            if all(rows[i] is None for i in members):
                copies.append((base, lo, size))
                continue
            for i in members:
                a, (r0, r1) = self.sources[i], ranges[i]
                if r1 > r0:
                    off = a.data.ptr - lo + r0 * a.strides[0]
                    copies.append((base + off, lo + off, (r1 - r0) * a.strides[0]))
        prev = rt.getDevice()
        if prev != self._dev:
            rt.setDevice(self._dev)
        try:
            for dst, src, n in copies:
                rt.memcpyAsync(dst, src, n, rt.memcpyDeviceToHost, stream)
            rt.eventRecord(self._events[k].ptr, stream)
        finally:
            if prev != self._dev:
                rt.setDevice(prev)
        self._staged = (k, ranges)

    def _allocate(self, cp) -> None:
        """Two pinned sets shaped like the sources and an event per set. Sources that are
        views of one allocation share one pinned buffer laid out like their span on the device."""
        self._dev = device_index(self.device)
        by_mem: dict = {}
        for i, a in enumerate(self.sources):
            if not a.flags.c_contiguous:
                raise ValueError("kvcanary: HostReader: expected packed arrays")
            by_mem.setdefault(id(a.data.mem), []).append(i)
        self._groups = list(by_mem.values())
        self._spans = []
        for members in self._groups:
            lo = min(self.sources[i].data.ptr for i in members)
            hi = max(self.sources[i].data.ptr + self.sources[i].nbytes for i in members)
            self._spans.append((lo, hi - lo))
        self._sets, self._bases = [], []
        with cp.cuda.Device(self._dev):
            for _ in range(2):
                views, bases = [None] * len(self.sources), []
                for members, (lo, size) in zip(self._groups, self._spans):
                    buf = np.frombuffer(cp.cuda.alloc_pinned_memory(max(size, 8)), np.uint8, max(size, 8))
                    bases.append(buf.ctypes.data)  # (.ctypes is slow: once)
                    for i in members:
                        a = self.sources[i]
                        views[i] = buf[a.data.ptr - lo:a.data.ptr - lo + a.nbytes].view(a.dtype).reshape(a.shape)
                self._sets.append(views)
                self._bases.append(bases)
            self._events = [cp.cuda.Event(disable_timing=True) for _ in range(2)]

    def reset(self) -> None:
        self._staged = None
