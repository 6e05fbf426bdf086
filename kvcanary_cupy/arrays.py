"""The DLPack boundary: any array in, a NumPy or CuPy view out, zero copy.

Nothing outside this module knows which framework an input came from. CuPy is
imported only when the first CUDA array arrives; PyTorch only when the caller
already imported it (for its current stream).
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Sequence

import numpy as np

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
INT64 = (np.dtype(np.int64),)

# DLPack device types (dlpack.h, DLDeviceType)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _cupy():
    import cupy  # noqa: PLC0415  (lazy on purpose: the package loads without it)

    return cupy


def cupy_loaded() -> bool:
    return "cupy" in sys.modules


def is_cupy_array(x) -> bool:
    return cupy_loaded() and isinstance(x, sys.modules["cupy"].ndarray)


# --- devices -------------------------------------------------------------------
def parse_device(device) -> tuple[str, int | None]:
    """``"cpu"`` -> ("cpu", None); ``"cuda"`` -> ("cuda", current); ``"cuda:N"`` -> ("cuda", N)."""
    if device is None or device == "cpu":
        return ("cpu", None)
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        if device == "cuda":
            return ("cuda", int(_cupy().cuda.runtime.getDevice()))
        try:
            return ("cuda", int(device[5:]))
        except ValueError:
            pass
    raise ValueError(f"kvcanary: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def device_of(a) -> str:
    """The device string of a NumPy / CuPy array: ``"cpu"`` or ``"cuda:N"``."""
    if isinstance(a, np.ndarray):
        return "cpu"
    return f"cuda:{a.device.id}"


def array_module(device: str):
    """numpy for ``"cpu"``, cupy for a CUDA device."""
    return np if parse_device(device)[0] == "cpu" else _cupy()


def empty(shape, dtype, device: str, fill=None):
    """Allocate a library-owned array on ``device`` (NumPy on cpu, CuPy on CUDA)."""
    kind, idx = parse_device(device)
    if kind == "cpu":
        a = np.empty(shape, dtype=dtype)
    else:
        cp = _cupy()
        with cp.cuda.Device(idx):
            a = cp.empty(shape, dtype=dtype)
    if fill is not None:
        a.fill(fill)
    return a


# --- import ------------------------------------------------------------------
def _from_foreign(obj, name: str):
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        try:
            dev_type, _ = obj.__dlpack_device__()
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"kvcanary: {name}: cannot read its DLPack device ({e})") from e
        dev_type = int(dev_type)
        try:
            if dev_type == _DL_CPU:
                return np.from_dlpack(obj)
            if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED, _DL_CUDA_HOST):
                return _cupy().from_dlpack(obj)
        except (BufferError, TypeError, RuntimeError, ValueError) as e:
            raise TypeError(
                f"kvcanary: {name}: cannot be imported zero-copy through DLPack ({e}); "
                "pass a contiguous tensor of a plain integer or byte dtype, detached from autograd"
            ) from e
        raise TypeError(f"kvcanary: {name}: DLPack device type {dev_type} is not supported (CPU or CUDA expected)")
    if hasattr(obj, "__cuda_array_interface__"):
        return _cupy().asarray(obj)
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        a = np.asarray(obj)
        if a.dtype == object:
            raise TypeError(f"kvcanary: {name}: expected an array, got {type(obj).__name__}")
        return a
    raise TypeError(
        f"kvcanary: {name}: expected an array with __dlpack__ or __cuda_array_interface__ "
        f"(PyTorch, JAX, CuPy, NumPy), got {type(obj).__name__}"
    )


def as_view(obj, name: str):
    """Zero-copy NumPy / CuPy view of ``obj``; no checks beyond importability."""
    if isinstance(obj, np.ndarray) or is_cupy_array(obj):
        return obj
    if obj is None:
        raise TypeError(f"kvcanary: {name}: expected an array, got None")
    return _from_foreign(obj, name)


def _dtype_words(dtypes: Sequence[np.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_array(
    a,
    name: str,
    *,
    dtypes: Sequence[np.dtype] | None = None,
    ndim: int | None = None,
    device: str | None = None,
    min_len: int | None = None,
    contiguous: bool = True,
    writable: bool = False,
):
    """Check a view: dtype, rank, device, contiguity, length. Returns it unchanged."""
    if dtypes is not None and a.dtype not in dtypes:
        raise TypeError(f"kvcanary: {name}: expected dtype {_dtype_words(dtypes)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"kvcanary: {name}: expected {ndim}-D array, got shape {tuple(a.shape)}")
    if device is not None:
        got = device_of(a)
        if got != device:
            raise ValueError(f"kvcanary: {name}: expected an array on {device}, got one on {got}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(
            f"kvcanary: {name}: expected a C-contiguous array (strides {tuple(a.strides)} for shape "
            f"{tuple(a.shape)}); pass .contiguous() / a packed copy made once, outside the step"
        )
    if min_len is not None and a.shape[0] < min_len:
        raise ValueError(f"kvcanary: {name}: expected length >= {min_len}, got {a.shape[0]}")
    if writable and isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ValueError(f"kvcanary: {name}: expected a writable array, got a read-only one")
    return a


def as_array(obj, name: str, **checks):
    """Import ``obj`` zero copy and check it (see :func:`check_array`)."""
    return check_array(as_view(obj, name), name, **checks)


def as_index_array(obj, name: str, *, ndim: int = 1, device: str | None = None, min_len: int | None = None):
    """An int32 / int64 index array (engines use both; JAX defaults to int32)."""
    return as_array(obj, name, dtypes=INDEX_DTYPES, ndim=ndim, device=device, min_len=min_len)


def same_device(name_arrays: Iterable[tuple[str, Any]], device: str) -> None:
    for name, a in name_arrays:
        if a is not None:
            check_array(a, name, device=device, contiguous=False)


def as_byte_view(obj, name: str):
    """A flat uint8 view of a contiguous array of any dtype (bf16, fp8 included).

    Dtypes NumPy / CuPy cannot express are viewed as bytes through the producer's
    own ``view`` (PyTorch) before import.
    """
    try:
        a = as_view(obj, name)
    except TypeError:
        viewed = _producer_byte_view(obj)
        if viewed is None:
            raise
        a = as_view(viewed, name)
    check_array(a, name)
    return a.reshape(-1).view(np.uint8) if a.dtype != np.uint8 or a.ndim != 1 else a


def _producer_byte_view(obj):
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch" and hasattr(obj, "view"):
        torch = sys.modules["torch"]
        return obj.contiguous().view(torch.uint8) if obj.is_contiguous() else None
    return None


def to_host(a) -> np.ndarray:
    """A NumPy copy (synchronizing for CuPy arrays): for tests, read() and debugging."""
    if isinstance(a, np.ndarray):
        return a
    return a.get()


# --- streams -----------------------------------------------------------------
def _is_torch(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


def resolve_stream(stream, inputs: Iterable[Any] = ()):
    """The CUDA stream (raw pointer, int) an op runs on.

    ``stream`` may be an object with ``__cuda_stream__`` (cuda.core, PyTorch >= 2.6),
    a CuPy stream, a PyTorch stream, or a raw ``cudaStream_t`` int. Default:
    PyTorch's current stream when any input is a PyTorch tensor, else CuPy's.
    """
    if stream is None:
        if "torch" in sys.modules and any(_is_torch(x) for x in inputs):
            return int(sys.modules["torch"].cuda.current_stream().cuda_stream)
        return int(_cupy().cuda.get_current_stream().ptr)
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


def data_ptr(a) -> int:
    """The address of a view's first element."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)
