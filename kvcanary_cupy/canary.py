"""CanaryBuffer (the records) and RealKvSource (a byte view of a KV pool)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import arrays, runtime, scalars
from .launch_cache import LaunchCache
from .format import DEFAULT_CHAIN, KV_CHUNK_BYTES, RECORD_WORDS, check_chain


@arrays.fixed
@dataclass(frozen=True, eq=False)
class CanaryBuffer:
    """One 32-byte record per KV slot.

    Attributes:
        records: int64 ``[num_slots, 4]`` (token, position, link, fingerprint),
            NumPy on ``"cpu"``, CuPy on CUDA. A new buffer is zeros.
        chain: how links chain, ``"scan"`` (the default: an affine map mod 2**61 - 1,
            so a row's links are a parallel prefix scan) or ``"sglang"`` (SGLang's
            serial ``mix3`` chain, byte for byte its records). Every op follows it.
        launches: the prepared write and verify calls made with this canary
            (:class:`~kvcanary_cupy.launch_cache.LaunchCache`); they go with it.

    Its fields and the layout of ``records`` are fixed for its life (launches prepared
    with it read them); a pickled canary comes back as a new one over a copy of the
    records, with no prepared launches.

    Example::

        >>> canary = CanaryBuffer.allocate(num_slots=1024, device="cpu")
        >>> canary.records.shape, canary.chain
        ((1024, 4), 'scan')
    """

    records: object
    chain: str = DEFAULT_CHAIN
    launches: LaunchCache = field(default_factory=LaunchCache, init=False, repr=False, compare=False)

    def __post_init__(self):
        # write stores records at raw addresses: the array must be writable and packed.
        r = arrays.as_array(self.records, "records", dtypes=arrays.INT64, ndim=2, writable=True)
        if r.shape[1] != RECORD_WORDS:
            raise ValueError(f"kvcanary: records: expected shape [num_slots, {RECORD_WORDS}], got {tuple(r.shape)}")
        if r.shape[0] < 1:
            raise ValueError("kvcanary: records: expected at least one slot (slot 0 is reserved)")
        object.__setattr__(self, "records", r)
        check_chain(self.chain)
        arrays.hold(self, "CanaryBuffer", {"records": r})

    @classmethod
    def allocate(cls, *, num_slots: int, device: str = "cpu", chain: str = DEFAULT_CHAIN) -> "CanaryBuffer":
        num_slots = scalars.check_int(num_slots, "num_slots", minimum=1)
        check_chain(chain)
        return cls(runtime.empty((num_slots, RECORD_WORDS), np.int64, device, fill=0), chain)

    @property
    def num_slots(self) -> int:
        return int(self.records.shape[0])

    @property
    def device(self) -> str:
        return runtime.device_of(self.records)

    def host_records(self) -> np.ndarray:
        """A NumPy copy of the records (synchronizes on CUDA)."""
        return np.array(runtime.to_host(self.records), copy=True)


class RealKvSource:
    """A byte view of (part of) a KV pool whose bytes are fingerprinted.

    Slot ``s`` lives at row ``s // page_size``, byte ``(s % page_size) * bytes_per_token``
    of each layer; the first ``read_bytes`` bytes of it are hashed (16 in PARTIAL mode).

    Args:
        tensor: a C-contiguous array of any dtype (bf16 and fp8 included), imported
            zero copy. With ``layer_axis=True`` its first axis is the layer.
        page_size: slots per row of the pool (1 for a token-level pool).
        bytes_per_token: bytes of one slot in one layer; a multiple of 16.
        read_bytes: bytes of a slot that ALL mode hashes; a multiple of 16,
            ``<= bytes_per_token``. Default: ``bytes_per_token``.
        layer_axis: the tensor's first axis holds layers; each counts as one
            source, in layer order.

    Its attributes are fixed for its life: a launch prepared with it holds the pool's
    address and extent (make a new source for another pool).

    Example::

        >>> import numpy as np
        >>> k_pool = np.zeros((2, 64, 8, 16), dtype=np.float16)  # [layers, slots, heads, dim]
        >>> src = RealKvSource(k_pool, page_size=1, bytes_per_token=256, layer_axis=True)
        >>> src.num_layers, src.num_slots
        (2, 64)
    """

    __slots__ = ("data", "page_size", "bytes_per_token", "read_bytes", "num_layers", "layer_bytes", "_held",
                 "__weakref__")

    def __init__(self, tensor, page_size: int = 1, bytes_per_token: int | None = None,
                 read_bytes: int | None = None, *, layer_axis: bool = False):
        if tensor is None or isinstance(tensor, RealKvSource):
            raise TypeError(f"kvcanary: tensor: expected the KV pool array, got {type(tensor).__name__}")
        flat = arrays.as_byte_view(tensor, "tensor")
        num_layers = _leading_dim(tensor) if scalars.check_flag(layer_axis, "layer_axis") else 1
        if num_layers < 1 or flat.shape[0] % num_layers:
            raise ValueError(f"kvcanary: tensor: a layer axis of {num_layers} does not divide {flat.shape[0]} bytes")
        page_size = scalars.check_int(page_size, "page_size", minimum=1)
        if bytes_per_token is None:
            raise ValueError("kvcanary: bytes_per_token: expected the bytes of one slot (a multiple of 16), got None")
        bpt = scalars.check_int(bytes_per_token, "bytes_per_token")
        rb = bpt if read_bytes is None else scalars.check_int(read_bytes, "read_bytes")
        if bpt <= 0 or bpt % KV_CHUNK_BYTES:
            raise ValueError(f"kvcanary: bytes_per_token: expected a positive multiple of 16, got {bpt}")
        if rb <= 0 or rb % KV_CHUNK_BYTES or rb > bpt:
            raise ValueError(f"kvcanary: read_bytes: expected a positive multiple of 16 <= bytes_per_token ({bpt}), got {rb}")
        layer_bytes = flat.shape[0] // num_layers
        row_bytes = page_size * bpt
        if layer_bytes % row_bytes:
            raise ValueError(
                f"kvcanary: tensor: {layer_bytes} bytes per layer is not a whole number of rows of "
                f"page_size * bytes_per_token = {row_bytes} bytes"
            )
        if arrays.data_ptr(flat) % KV_CHUNK_BYTES:
            raise ValueError("kvcanary: tensor: its data must be 16-byte aligned for the fingerprint's 16-byte loads")
        data = flat.reshape(num_layers, layer_bytes)
        for name, value in (("data", data), ("page_size", page_size), ("bytes_per_token", bpt), ("read_bytes", rb),
                            ("num_layers", num_layers), ("layer_bytes", layer_bytes)):
            object.__setattr__(self, name, value)
        arrays.hold(self, "RealKvSource", {"data": data}, written=())

    def __reduce__(self):
        # A new source over a copy of the bytes, made (and checked) by the constructor.
        return _source_of, (self.data, self.page_size, self.bytes_per_token, self.read_bytes)

    @property
    def num_slots(self) -> int:
        """Slots the pool holds per layer."""
        return (self.layer_bytes // (self.page_size * self.bytes_per_token)) * self.page_size

    @property
    def device(self) -> str:
        return runtime.device_of(self.data)

    def __repr__(self) -> str:
        return (f"RealKvSource(num_slots={self.num_slots}, page_size={self.page_size}, "
                f"bytes_per_token={self.bytes_per_token}, read_bytes={self.read_bytes}, "
                f"num_layers={self.num_layers}, device={self.device!r})")


arrays.fix_attributes(RealKvSource, "make a new RealKvSource")


def _source_of(data, page_size: int, bytes_per_token: int, read_bytes: int) -> RealKvSource:
    """A source over ``data`` (``[num_layers, layer_bytes]`` bytes), for unpickling."""
    return RealKvSource(data, page_size, bytes_per_token, read_bytes, layer_axis=True)


def _leading_dim(tensor) -> int:
    shape = getattr(tensor, "shape", None)
    if not shape:
        raise ValueError("kvcanary: tensor: layer_axis=True needs an array with at least one axis")
    return int(shape[0])
