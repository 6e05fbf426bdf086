"""The DLPack boundary: any array in, a NumPy or CuPy view out, zero copy.

Nothing outside this module knows which framework an input came from. CuPy is
imported only when the first CUDA array arrives; PyTorch only when the caller
already imported it (for its current stream).

On the GPU: PyTorch CUDA tensors, JAX arrays and CuPy arrays come in through
DLPack (or ``__cuda_array_interface__``) as CuPy views of the same memory.
PyTorch tensors are imported with PyTorch's current stream as the consumer
stream, so the import adds no cross-stream event (and is legal inside a
``torch.cuda.graph`` capture). JAX arrays are immutable: their views are marked
read-only, and an op that would write into one raises. Byte views of bf16 / fp8
tensors (for :class:`~kvcanary_cupy.RealKvSource`) go through PyTorch's
``view(torch.uint8)`` or, for JAX, through the array's device buffer pointer.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
import weakref
from typing import Sequence

import numpy as np

from . import runtime
from .runtime import device_of, is_cupy_array

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
INT64 = (np.dtype(np.int64),)

# DLPack device types (dlpack.h, DLDeviceType)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


# --- memory ranges --------------------------------------------------------------
def byte_range(a) -> tuple[str, int, int]:
    """(device, first byte, one past the last byte) that array ``a`` can touch."""
    lo = hi = data_ptr(a)
    if a.size:
        for n, st in zip(a.shape, a.strides):
            if st < 0:
                lo += st * (n - 1)
            else:
                hi += st * (n - 1)
        hi += a.itemsize
    return device_of(a), lo, hi


def check_disjoint(owner: str, named: dict) -> None:
    """Refuse two arrays that share memory: an op writing one would change the other
    (one array passed for two fields makes the kernels race with themselves). Address
    ranges are compared, not object identity, so two views of one buffer are caught."""
    spans = [(name, byte_range(a)) for name, a in named.items() if a is not None and a.size]
    for i, (n1, (d1, lo1, hi1)) in enumerate(spans):
        for n2, (d2, lo2, hi2) in spans[i + 1:]:
            if d1 == d2 and lo1 < hi2 and lo2 < hi1:
                raise ValueError(f"kvcanary: {owner}: {n1} and {n2} share memory; expected a separate "
                                 "array for each")


def check_apart(op: str, written: dict, read: dict) -> None:
    """Refuse what an op writes sharing memory (see :func:`check_disjoint`), and any array
    it reads inside one it writes: the launch would read what it has just written, in an
    order no backend promises. Inputs may share memory with each other: both are only read."""
    check_disjoint(op, written)
    out = [(name, byte_range(a)) for name, a in written.items() if a is not None and a.size]
    for rname, r in read.items():
        if r is None or not r.size:
            continue
        d1, lo1, hi1 = byte_range(r)
        for wname, (d2, lo2, hi2) in out:
            if d1 == d2 and lo1 < hi2 and lo2 < hi1:
                raise ValueError(f"kvcanary: {op}: {rname} shares memory with {wname}, which {op} writes; expected "
                                 f"an input apart from the op's outputs (pass a copy of {rname} made once, outside "
                                 "the step)")


# --- what an object holds for its life ------------------------------------------
# A launch reads an object's arrays at the addresses and extents validated when it was
# prepared, so neither the object's attributes nor its arrays' layouts may change after
# that: reassigning a field would leave prepared launches on the old arrays (on CUDA, on
# memory that may be freed), and a resize, reshape or read-only flag would turn the next
# launch into a bare NumPy error halfway through its writes.

class FixedError(dataclasses.FrozenInstanceError, TypeError):
    """An attribute of a library object assigned or deleted after construction."""


def fix_attributes(cls, remedy: str, mutable: frozenset = frozenset()):
    """Make ``cls``'s attributes fixed once constructed (constructors set them with
    ``object.__setattr__``); ``mutable``: private bookkeeping that may change."""

    def refuse(self, name):
        if name not in mutable:
            raise FixedError(f"kvcanary: {type(self).__name__}.{name} is fixed for the object's life (launches "
                             f"prepared with the object read it); {remedy}")

    def __setattr__(self, name, value):
        refuse(self, name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        refuse(self, name)
        object.__delattr__(self, name)

    cls.__setattr__, cls.__delattr__ = __setattr__, __delattr__
    return cls


def _data_assignable() -> bool:
    """Whether this NumPy still lets ``a.data = buffer`` move an array's memory (deprecated
    since NumPy 1.12, refused by recent ones; CuPy never allowed it)."""
    a = np.zeros(1, np.uint8)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a.data = bytearray(1)
    except (AttributeError, TypeError, ValueError):
        return False
    return True


_DATA_ASSIGNABLE = _data_assignable()


def layout(a, written: bool = True) -> tuple:
    """What can change in place while the array object stays the same: its shape, strides,
    dtype and, for a NumPy array the library writes, whether it is writable; and its
    address where NumPy lets ``.data`` be assigned. Otherwise the address cannot change
    unseen: NumPy's ``resize`` moves the data only for a new size (a new shape)."""
    lay = a.shape, a.strides, a.dtype, written and isinstance(a, np.ndarray) and a.flags.writeable
    return lay + (data_ptr(a),) if _DATA_ASSIGNABLE and isinstance(a, np.ndarray) else lay


def _change(was: tuple, now: tuple) -> str:
    if was[0] != now[0]:
        return f"shape {tuple(was[0])} is now {tuple(now[0])}"
    if was[2] != now[2]:
        return f"dtype {was[2]} is now {now[2]}"
    if was[1] != now[1]:
        return f"strides {tuple(was[1])} are now {tuple(now[1])}"
    if was[3] != now[3]:
        return "it is now read-only"
    return "its data was moved (.data assigned)"


class Held:
    """Arrays validated once, with their layouts then: :meth:`check` refuses any array whose
    layout changed since (a resize, a new shape, dtype or strides, a read-only flag).

    ``owner`` prefixes the names in errors (``"VerifyPlan"``: ``VerifyPlan.offsets``);
    ``written``: the names the library writes (their writeable flag counts), or True for all.
    """

    __slots__ = ("owner", "names", "arrays", "written", "layouts", "remedy")

    def __init__(self, owner: str, named: dict, remedy: str, written=True):
        self.owner, self.remedy = owner, remedy
        self.names = tuple(named)
        self.arrays = tuple(named.values())
        self.written = tuple(written is True or n in written for n in self.names)
        self.layouts = tuple(map(layout, self.arrays, self.written))

    def check(self) -> None:
        # Runs before every launch of a kept call on the CPU: attribute reads only.
        if _DATA_ASSIGNABLE:
            if tuple(map(layout, self.arrays, self.written)) != self.layouts:
                self._refuse()
            return
        for a, (shape, strides, dtype, writable) in zip(self.arrays, self.layouts):
            if (a.shape != shape or a.strides != strides or (a.dtype is not dtype and a.dtype != dtype)
                    or (writable and not a.flags.writeable)):
                self._refuse()

    def _refuse(self):
        for name, a, w, was in zip(self.names, self.arrays, self.written, self.layouts):
            now = layout(a, w)
            if now != was:
                what = f"{self.owner}.{name}" if self.owner else name
                raise ValueError(f"kvcanary: {what}: changed in place since it was validated ({_change(was, now)}); "
                                 f"{self.remedy}")


def hold(obj, cls_name: str, views: dict, written=True) -> None:
    """Keep, as ``obj._held``, the arrays ``obj`` validated and their layouts (see :class:`Held`)."""
    remedy = f"the arrays of a {cls_name} are fixed for its life: make a new {cls_name} over the arrays you need"
    object.__setattr__(obj, "_held", Held(cls_name, views, remedy, written))


def fixed(cls):
    """``cls``'s fields fixed for the object's life, and pickled as a new object made by its
    constructor (validated again, with an empty launch cache: prepared launches belong to
    the process that prepared them)."""
    init = tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def __reduce__(self):
        return type(self), tuple(getattr(self, n) for n in init)

    cls.__reduce__ = __reduce__
    return fix_attributes(cls, f"make a new {cls.__name__}")


# --- import ------------------------------------------------------------------
def _producer(obj) -> str:
    """The top-level module of an object's type: 'torch', 'jax', 'jaxlib', 'numpy', ..."""
    return type(obj).__module__.split(".")[0]


def _is_jax(obj) -> bool:
    return _producer(obj) in ("jax", "jaxlib")


_READONLY: dict = {}  # id(view) -> weakref(view): CuPy views of immutable (JAX) buffers


def _mark_readonly(view):
    key = id(view)
    _READONLY[key] = weakref.ref(view, lambda _r, k=key: _READONLY.pop(k, None))
    return view


def is_readonly(a) -> bool:
    """True for a view the library must not write: a read-only NumPy array or a
    CuPy view of a JAX array."""
    if isinstance(a, np.ndarray):
        return not a.flags.writeable
    r = _READONLY.get(id(a))
    return r is not None and r() is a


def _torch_cuda_import(obj):
    """A CuPy view of a PyTorch CUDA tensor, consumed on PyTorch's current stream."""
    torch = sys.modules["torch"]
    dev = obj.device.index if obj.device.index is not None else torch.cuda.current_device()
    ptr = int(torch.cuda.current_stream(dev).cuda_stream)
    cp = runtime.cupy()
    with cp.cuda.Device(dev), runtime.on_cupy_stream(ptr, dev):
        return cp.from_dlpack(obj)


def _jax_device_id(obj):
    devs = list(obj.devices()) if hasattr(obj, "devices") else []
    if len(devs) != 1 or getattr(devs[0], "platform", "") not in ("gpu", "cuda", "rocm"):
        return None
    hw = getattr(devs[0], "local_hardware_id", None)  # the CUDA ordinal where JAX reports it
    return int(hw if hw is not None else devs[0].id)


def _jax_buffer_view(obj, dtype):
    """A CuPy view of a single-device JAX GPU array's buffer (zero copy), as ``dtype``
    (the array's own dtype, or uint8 for a flat byte view). None if not possible."""
    dev = _jax_device_id(obj)
    if dev is None:
        return None
    try:
        ptr = int(obj.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001  (sharded, deleted or donated arrays)
        return None
    obj.block_until_ready()  # producers queue work asynchronously; once, at import
    cp = runtime.cupy()
    nbytes = int(obj.nbytes)
    mem = cp.cuda.UnownedMemory(ptr, nbytes, obj, device_id=dev)
    shape = (nbytes,) if dtype == np.uint8 else tuple(int(x) for x in obj.shape)
    return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))


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
            if dev_type == _DL_CUDA_HOST:  # pinned host memory (a CPU tensor on a GPU machine): host memory
                return _host_import(obj)
            if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
                if _producer(obj) == "torch" and dev_type == _DL_CUDA:
                    return _torch_cuda_import(obj)
                if _is_jax(obj):
                    return _mark_readonly(_jax_import(obj))
                return runtime.cupy().from_dlpack(obj)
        except (BufferError, TypeError, RuntimeError, ValueError) as e:
            raise TypeError(
                f"kvcanary: {name}: cannot be imported zero-copy through DLPack ({e}); "
                "pass a contiguous tensor of a plain integer or byte dtype, detached from autograd"
            ) from e
        raise TypeError(f"kvcanary: {name}: DLPack device type {dev_type} is not supported (CPU or CUDA expected)")
    if hasattr(obj, "__cuda_array_interface__"):
        return runtime.cupy().asarray(obj)
    if hasattr(obj, "__array_interface__"):
        return _interface_view(obj, name)
    if hasattr(obj, "__array__"):
        # NumPy can only ask __array__ for an array, and the answer may be a copy: the op
        # would read a snapshot and never see the caller's later in-place edits.
        raise TypeError(f"kvcanary: {name}: a {type(obj).__name__} exposes only __array__, which may hand out a "
                        "copy; pass an array with __dlpack__ or __array_interface__ (NumPy, PyTorch, JAX, CuPy) "
                        "over the memory itself")
    raise TypeError(
        f"kvcanary: {name}: expected an array with __dlpack__ or __cuda_array_interface__ "
        f"(PyTorch, JAX, CuPy, NumPy), got {type(obj).__name__}"
    )


def _interface_view(obj, name: str):
    """A NumPy view of memory described by ``__array_interface__``, refused if NumPy had to copy."""
    try:
        iface = obj.__array_interface__
        a = np.asarray(obj)
    except (TypeError, ValueError) as e:
        raise TypeError(f"kvcanary: {name}: cannot read its __array_interface__ ({e})") from e
    data = iface.get("data") if isinstance(iface, dict) else None
    want = data[0] if isinstance(data, tuple) and data else None  # else: memory through the buffer protocol
    if a.dtype == object:
        raise TypeError(f"kvcanary: {name}: expected an array, got {type(obj).__name__}")
    if want is not None and a.size and data_ptr(a) != want:
        raise TypeError(f"kvcanary: {name}: NumPy cannot view the __array_interface__ of a {type(obj).__name__} "
                        "in place (it made a copy); pass an array with __dlpack__ over the memory itself")
    return a


def _host_import(obj):
    """A NumPy view of pinned host memory: NumPy's DLPack import where it takes that device
    type, else a PyTorch tensor's own ``numpy()`` (zero copy as well)."""
    try:
        return np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError, ValueError):
        if _producer(obj) != "torch":
            raise
        return obj.numpy()


def _jax_import(obj):
    """DLPack first; JAX builds that refuse to export to CuPy fall back to the
    buffer pointer (same memory, same dtype)."""
    try:
        return runtime.cupy().from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError, ValueError):
        try:
            dtype = np.dtype(obj.dtype)
        except TypeError:
            dtype = None
        view = _jax_buffer_view(obj, dtype) if dtype is not None and dtype.kind in "biuf" else None
        if view is None:
            raise
        return view


def as_view(obj, name: str):
    """Zero-copy NumPy / CuPy view of ``obj``; no checks beyond importability."""
    if type(obj) is np.ndarray:
        return obj
    if isinstance(obj, np.ndarray):
        return _plain_numpy(obj, name)
    if is_cupy_array(obj):
        return obj
    if obj is None:
        raise TypeError(f"kvcanary: {name}: expected an array, got None")
    return _from_foreign(obj, name)


def _plain_numpy(obj, name: str):
    """A NumPy subclass: a memmap is plain memory (its plain view is taken); any other may
    give its elements another meaning (a mask, matrix indexing), which the kernels and the
    reference would not honour, so it is refused with what to pass."""
    if isinstance(obj, np.memmap):
        return obj.view(np.ndarray)
    if isinstance(obj, np.ma.MaskedArray):
        raise TypeError(f"kvcanary: {name}: expected a plain array, got a numpy.ma.MaskedArray (its mask would be "
                        "ignored); pass the values it stands for, e.g. x.filled(fill) once, outside the step")
    kind = f"{type(obj).__module__}.{type(obj).__name__}"
    raise TypeError(f"kvcanary: {name}: expected a plain numpy.ndarray, got a {kind}; pass np.asarray(x) "
                    "(a zero-copy plain view) if its elements mean what they say")


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
    if writable and is_readonly(a):
        raise ValueError(f"kvcanary: {name}: expected a writable array, got a read-only one "
                         "(JAX arrays are immutable: pass a CuPy or PyTorch buffer the library may write)")
    return a


def as_array(obj, name: str, **checks):
    """Import ``obj`` zero copy and check it (see :func:`check_array`)."""
    try:
        view = as_view(obj, name)
    except TypeError as e:
        dtypes = checks.get("dtypes")
        if dtypes is not None and hasattr(obj, "dtype") and str(obj.dtype).split(".")[-1] not in {
                str(d) for d in dtypes}:
            raise TypeError(f"kvcanary: {name}: expected dtype {_dtype_words(dtypes)}, got {obj.dtype}") from e
        raise
    return check_array(view, name, **checks)


def as_index_array(obj, name: str, *, ndim: int = 1, device: str | None = None, min_len: int | None = None):
    """An int32 / int64 index array (engines use both; JAX defaults to int32)."""
    return as_array(obj, name, dtypes=INDEX_DTYPES, ndim=ndim, device=device, min_len=min_len)


def as_byte_view(obj, name: str):
    """A flat uint8 view of a contiguous array of any dtype (bf16, fp8 included).

    Dtypes NumPy / CuPy cannot express are viewed as bytes through the producer's
    own ``view`` (PyTorch) or buffer pointer (JAX) before import; still zero copy.
    """
    try:
        a = as_view(obj, name)
    except TypeError:
        viewed = _producer_byte_view(obj, name)
        if viewed is None:
            raise
        a = as_view(viewed, name)
    check_array(a, name)
    return a.reshape(-1).view(np.uint8) if a.dtype != np.uint8 or a.ndim != 1 else a


def _producer_byte_view(obj, name: str = "tensor"):
    mod = _producer(obj)
    if mod == "torch" and hasattr(obj, "view"):
        torch = sys.modules["torch"]
        if not obj.is_contiguous():
            raise ValueError(f"kvcanary: {name}: expected a contiguous tensor (strides {tuple(obj.stride())} for "
                             f"shape {tuple(obj.shape)}); pass a packed pool")
        return obj.view(torch.uint8)
    if mod in ("jax", "jaxlib"):
        # No DLPack consumer here takes bf16 / fp8; the device buffer is dense
        # row-major, so a byte view of it is the same memory.
        view = _jax_buffer_view(obj, np.uint8)
        if view is None:
            raise TypeError(
                f"kvcanary: {name}: a JAX array of dtype {obj.dtype} can be viewed as bytes only when it lives on "
                "one GPU (not sharded, not deleted); pass jax.lax.bitcast_convert_type(x, jnp.uint8) instead")
        return _mark_readonly(view)
    return None


def data_ptr(a) -> int:
    """The address of a view's first element."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)
