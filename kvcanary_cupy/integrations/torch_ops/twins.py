"""The ``Torch*`` twins: the library's objects as frozen dataclasses of ``torch.Tensor`` s.

One twin per library object the ops take (:class:`TorchCanaryBuffer`,
:class:`TorchVerifyPlan`, :class:`TorchWritePlan`, :class:`TorchViolationLog`,
:class:`TorchRealKvSource`, :class:`TorchFingerprintSampler`, :class:`TorchSwaWindow`,
:class:`TorchExpectedTokens`). Each builds its library object once, at construction, zero
copy through DLPack (so every check of the library's constructors runs there), and pins it
in ``views._OBJECTS`` under the key its op arguments will have (:mod:`.objects`), so the op
implementations find it again instead of building one per call. ``.allocate(...)`` makes
new tensors with torch's allocator, the constructor wraps tensors the caller owns,
``.from_library(obj)`` wraps an existing library object; ``.library`` is the object
underneath. :class:`TorchViolationLog` also reads the log on the host, ordered after the
work queued on PyTorch's current stream.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kvcanary_cupy as kc
from kvcanary_cupy import scalars
from kvcanary_cupy.format import INPUT_ERROR_WORDS

from .objects import (
    _MAKE,
    _canary_key,
    _expected_key,
    _list_key,
    _make_canary,
    _make_source,
    _sampler_key,
    _source_key,
    _swa_key,
)
from .views import _OBJECTS, _stream

_I64 = torch.int64


def _device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def _to_torch(a) -> torch.Tensor:
    """A tensor over a library array's memory (NumPy or CuPy), zero copy."""
    return torch.from_dlpack(a)


def _check_tensors(obj, names: Sequence[str]) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"kvcanary: {type(obj).__name__}.{n}: expected a torch.Tensor, got {type(v).__name__}")


def _pin(holder, key, build=None, obj=None) -> None:
    """Give ``holder`` its library object: ``obj`` (from_library), else the one found or built."""
    object.__setattr__(holder, "_library", _OBJECTS.pin(key, build, obj))


def _from_template(lib_obj, names: Sequence[str], device) -> dict:
    """Tensors on ``device`` holding copies of a (CPU) library object's arrays."""
    dev = _device(device)
    return {n: torch.from_numpy(getattr(lib_obj, n).copy()).to(dev) for n in names}


@dataclass(frozen=True, eq=False)
class TorchCanaryBuffer:
    """The canary records as a torch tensor: a :class:`~kvcanary_cupy.CanaryBuffer`.

    Args:
        records: int64 ``[num_slots, 4]`` (token, position, link, fingerprint), writable,
            contiguous, on the CPU or a CUDA device. A new buffer is zeros.
        chain: the chain kind of the records (see :class:`~kvcanary_cupy.CanaryBuffer`);
            None takes the library's default.

    Example::

        >>> canary = TorchCanaryBuffer.allocate(num_slots=1024)
        >>> canary.records.shape, canary.num_slots
        (torch.Size([1024, 4]), 1024)
    """

    records: torch.Tensor
    chain: str | None = None
    LIBRARY_CLASS = kc.CanaryBuffer

    def __post_init__(self):
        _check_tensors(self, ("records",))
        _pin(self, _canary_key(self.records, self.chain), lambda: _make_canary(self.records, self.chain))

    @classmethod
    def allocate(cls, *, num_slots: int, device="cpu", chain: str | None = None) -> TorchCanaryBuffer:
        """``num_slots`` zeroed records on ``device`` (a str or ``torch.device``)."""
        num_slots = scalars.check_int(num_slots, "num_slots", minimum=1)
        return cls(torch.zeros((num_slots, 4), dtype=_I64, device=_device(device)), chain)

    @classmethod
    def from_library(cls, canary: kc.CanaryBuffer) -> TorchCanaryBuffer:
        """The same records, as a tensor (zero copy); ``.library`` is ``canary`` itself."""
        chain = getattr(canary, "chain", None)
        out = object.__new__(cls)
        object.__setattr__(out, "records", _to_torch(canary.records))
        object.__setattr__(out, "chain", chain)
        _pin(out, _canary_key(out.records, chain), obj=canary)
        return out

    @property
    def library(self) -> kc.CanaryBuffer:
        """The library object over the same memory (for host reads: ``host_records()``)."""
        return self._library

    @property
    def num_slots(self) -> int:
        return int(self.records.shape[0])


@dataclass(frozen=True, eq=False)
class TorchVerifyPlan:
    """A :class:`~kvcanary_cupy.VerifyPlan` whose arrays are torch tensors.

    Args (all int64, writable, contiguous, on one device, none sharing memory):
        slot_indices, prev_slot_indices, expected_positions, expected_tokens:
            ``[capacity]``, one entry per record a step reads.
        offsets: ``[max_batch + 1]``, exclusive prefix sums of entries per batch row.
        num_valid, enable, requested, input_errors, overflows, max_requested: ``[1]``
            device scalars (see :class:`~kvcanary_cupy.VerifyPlan`).
        first_input_error: ``[6]``, where the latest plan's first dropped row went wrong
            (see :class:`~kvcanary_cupy.VerifyPlan`); None: one of its own, beside
            ``offsets``, like the library's.

    Example::

        >>> vp = TorchVerifyPlan.allocate(capacity=4096, max_batch=8)
        >>> vp.capacity, vp.max_batch, vp.slot_indices.dtype
        (4096, 8, torch.int64)
    """

    slot_indices: torch.Tensor
    prev_slot_indices: torch.Tensor
    expected_positions: torch.Tensor
    expected_tokens: torch.Tensor
    offsets: torch.Tensor
    num_valid: torch.Tensor
    enable: torch.Tensor
    requested: torch.Tensor
    input_errors: torch.Tensor
    overflows: torch.Tensor
    max_requested: torch.Tensor
    first_input_error: torch.Tensor | None = None
    LIBRARY_CLASS = kc.VerifyPlan

    def __post_init__(self):
        if self.first_input_error is None and isinstance(self.offsets, torch.Tensor):
            object.__setattr__(self, "first_input_error", torch.full((INPUT_ERROR_WORDS,), -1, dtype=_I64,
                                                                     device=self.offsets.device))
        _check_tensors(self, kc.VerifyPlan.FIELDS)
        ts = self.tensors()
        _pin(self, _list_key("verify_plan", ts), lambda: _MAKE["verify_plan"](ts, "TorchVerifyPlan"))

    def tensors(self) -> list:
        """The tensors in the order the ops take them (``kc.VerifyPlan.FIELDS``)."""
        return [getattr(self, f) for f in kc.VerifyPlan.FIELDS]

    @classmethod
    def allocate(cls, *, capacity: int, max_batch: int, device="cpu") -> TorchVerifyPlan:
        """A never-planned plan on ``device``, initialized exactly like ``kc.VerifyPlan.allocate``."""
        template = kc.VerifyPlan.allocate(capacity=capacity, max_batch=max_batch, device="cpu")
        return cls(**_from_template(template, kc.VerifyPlan.FIELDS, device))

    @classmethod
    def from_library(cls, plan: kc.VerifyPlan) -> TorchVerifyPlan:
        """The same arrays, as tensors (zero copy); ``.library`` is ``plan`` itself."""
        out = object.__new__(cls)
        for f in kc.VerifyPlan.FIELDS:
            object.__setattr__(out, f, _to_torch(getattr(plan, f)))
        _pin(out, _list_key("verify_plan", out.tensors()), obj=plan)
        return out

    @property
    def library(self) -> kc.VerifyPlan:
        """The library object over the same memory (``host_scalars()``, ``host_entries()``)."""
        return self._library

    @property
    def capacity(self) -> int:
        return int(self.slot_indices.shape[0])

    @property
    def max_batch(self) -> int:
        return int(self.offsets.shape[0]) - 1


@dataclass(frozen=True, eq=False)
class TorchWritePlan:
    """A :class:`~kvcanary_cupy.WritePlan` whose arrays are torch tensors.

    Args (all int64, writable, contiguous, on one device, none sharing memory):
        offsets: ``[max_batch + 1]``, exclusive prefix sums of tokens written per row.
        seed_slots: ``[max_batch]``, the slot each row's chain continues from (-1: none; SEED_SKIP: the row stamps nothing).
        num_rows, input_errors, position_check: ``[1]`` device scalars (see
            :class:`~kvcanary_cupy.WritePlan`).

    Example::

        >>> wp = TorchWritePlan.allocate(max_batch=8)
        >>> wp.max_batch, int(wp.num_rows)
        (8, -1)
    """

    offsets: torch.Tensor
    seed_slots: torch.Tensor
    num_rows: torch.Tensor
    input_errors: torch.Tensor
    position_check: torch.Tensor
    LIBRARY_CLASS = kc.WritePlan

    def __post_init__(self):
        _check_tensors(self, kc.WritePlan.FIELDS)
        ts = self.tensors()
        _pin(self, _list_key("write_plan", ts), lambda: _MAKE["write_plan"](ts, "TorchWritePlan"))

    def tensors(self) -> list:
        """The tensors in the order the ops take them (``kc.WritePlan.FIELDS``)."""
        return [getattr(self, f) for f in kc.WritePlan.FIELDS]

    @classmethod
    def allocate(cls, *, max_batch: int, device="cpu") -> TorchWritePlan:
        """A never-planned write plan on ``device``, initialized like ``kc.WritePlan.allocate``."""
        template = kc.WritePlan.allocate(max_batch=max_batch, device="cpu")
        return cls(**_from_template(template, kc.WritePlan.FIELDS, device))

    @classmethod
    def from_library(cls, plan: kc.WritePlan) -> TorchWritePlan:
        """The same arrays, as tensors (zero copy); ``.library`` is ``plan`` itself."""
        out = object.__new__(cls)
        for f in kc.WritePlan.FIELDS:
            object.__setattr__(out, f, _to_torch(getattr(plan, f)))
        _pin(out, _list_key("write_plan", out.tensors()), obj=plan)
        return out

    @property
    def library(self) -> kc.WritePlan:
        return self._library

    @property
    def max_batch(self) -> int:
        return int(self.seed_slots.shape[0])

    def set_position_check(self, on: bool) -> None:
        """Turn write's chain-position check on or off: a device write on the current
        stream (traceable, and captured with a graph)."""
        self.position_check.fill_(1 if scalars.check_flag(on, "on") else 0)


@dataclass(frozen=True, eq=False)
class TorchViolationLog:
    """A :class:`~kvcanary_cupy.ViolationLog` whose arrays are torch tensors.

    Args (all int64, writable, contiguous, on one device, none sharing memory):
        ring: ``[capacity, 18]`` violation rows (``kvcanary_cupy.format.VIOLATION_COLUMNS``).
        head: ``[1]`` append index (keeps counting past the capacity).
        counter_array: ``[6]`` kernel runs, slots checked, slots written, verifies
            skipped, writes skipped, tokens skipped (by name: :meth:`counters`).

    The host reads go to the library object, ordered after the work queued on PyTorch's
    current stream: :meth:`read`, :meth:`rows`, :meth:`poll`, :attr:`count`,
    :meth:`counters`, :meth:`clear`.

    Example::

        >>> log = TorchViolationLog.allocate(capacity=256)
        >>> log.count, log.read(), log.ring.shape
        (0, [], torch.Size([256, 18]))
    """

    ring: torch.Tensor
    head: torch.Tensor
    counter_array: torch.Tensor
    LIBRARY_CLASS = kc.ViolationLog

    def __post_init__(self):
        _check_tensors(self, ("ring", "head", "counter_array"))
        ts = self.tensors()
        _pin(self, _list_key("log", ts), lambda: _MAKE["log"](ts, "TorchViolationLog"))

    def tensors(self) -> list:
        """The tensors in the order the ops take them: ring, head, counters."""
        return [self.ring, self.head, self.counter_array]

    @classmethod
    def allocate(cls, *, capacity: int, device="cpu") -> TorchViolationLog:
        """An empty log of ``capacity`` rows on ``device``, like ``kc.ViolationLog.allocate``."""
        template = kc.ViolationLog.allocate(capacity=capacity, device="cpu")
        dev = _device(device)
        return cls(*(torch.from_numpy(a.copy()).to(dev) for a in (template.ring, template.head,
                                                                   template.counter_array)))

    @classmethod
    def from_library(cls, log: kc.ViolationLog) -> TorchViolationLog:
        """The same arrays, as tensors (zero copy); ``.library`` is ``log`` itself (and its poll state)."""
        out = object.__new__(cls)
        for f, a in zip(("ring", "head", "counter_array"), (log.ring, log.head, log.counter_array)):
            object.__setattr__(out, f, _to_torch(a))
        _pin(out, _list_key("log", out.tensors()), obj=log)
        return out

    @property
    def library(self) -> kc.ViolationLog:
        return self._library

    @property
    def capacity(self) -> int:
        return int(self.ring.shape[0])

    def _stream(self):
        return _stream(self.ring)

    def _synced(self) -> kc.ViolationLog:
        """The library object, once the work queued on the current stream is done (the
        ops ran there; the library's own reads wait on CuPy's stream)."""
        if self.ring.is_cuda:
            torch.cuda.current_stream(self.ring.device).synchronize()
        return self._library

    @property
    def count(self) -> int:
        """Violations appended since allocation or the last clear (synchronizes)."""
        return self._synced().count

    def read(self) -> list:
        """Every row held, decoded (:class:`~kvcanary_cupy.Violation`), in ring order (synchronizes)."""
        return self._synced().read()

    def rows(self):
        """Every row held, as an int64 NumPy array (synchronizes)."""
        return self._synced().rows()

    def poll(self) -> list:
        """The rows appended since the previous poll, without stalling the current stream
        (on CUDA, as found one poll earlier; see :meth:`kvcanary_cupy.ViolationLog.poll`)."""
        return self._library.poll(stream=self._stream())

    def counters(self) -> dict:
        """The counters by name (synchronizes); see :meth:`kvcanary_cupy.ViolationLog.counters`."""
        return self._synced().counters()

    def clear(self) -> None:
        """Empty the ring, in stream order on the current stream; counters keep counting."""
        self._library.clear(stream=self._stream())


@dataclass(frozen=True, eq=False)
class TorchRealKvSource:
    """A :class:`~kvcanary_cupy.RealKvSource` over a torch KV pool.

    Args:
        tensor: the KV pool, contiguous, any dtype (bf16 and fp8 included), read zero copy;
            with ``layer_axis`` its first axis is the layer.
        page_size: slots per row of the pool (1 for a token-level pool).
        bytes_per_token: bytes of one slot in one layer, a multiple of 16.
        read_bytes: bytes of a slot that ALL mode hashes (a multiple of 16, at most
            ``bytes_per_token``); None: all of them.
        layer_axis: the first axis holds layers, fingerprinted in order.

    Example::

        >>> k_pool = torch.zeros(2, 64, 8, 16, dtype=torch.bfloat16)  # [layers, slots, heads, dim]
        >>> src = TorchRealKvSource(k_pool, bytes_per_token=256, layer_axis=True)
        >>> src.library.num_layers, src.library.num_slots
        (2, 64)
    """

    tensor: torch.Tensor
    page_size: int = 1
    bytes_per_token: int | None = None
    read_bytes: int | None = None
    layer_axis: bool = False
    LIBRARY_CLASS = kc.RealKvSource

    def __post_init__(self):
        _check_tensors(self, ("tensor",))
        if self.bytes_per_token is None:
            raise ValueError("kvcanary: bytes_per_token: expected the bytes of one slot (a multiple of 16), got None")
        for n in ("page_size", "bytes_per_token") + (("read_bytes",) if self.read_bytes is not None else ()):
            object.__setattr__(self, n, scalars.check_int(getattr(self, n), n))
        object.__setattr__(self, "layer_axis", scalars.check_flag(self.layer_axis, "layer_axis"))
        layout = self.layout()
        _pin(self, _source_key(self.tensor, layout), lambda: _make_source(self.tensor, layout))

    def layout(self) -> list:
        """The ints the ops take for this source: page_size, bytes_per_token, read_bytes, layer_axis."""
        rb = self.bytes_per_token if self.read_bytes is None else self.read_bytes
        return [self.page_size, self.bytes_per_token, rb, int(self.layer_axis)]

    @classmethod
    def from_library(cls, source: kc.RealKvSource) -> TorchRealKvSource:
        """The same bytes, as a uint8 ``[num_layers, layer_bytes]`` tensor (zero copy);
        ``.library`` is ``source`` itself."""
        out = object.__new__(cls)
        values = dict(tensor=_to_torch(source.data), page_size=source.page_size,
                      bytes_per_token=source.bytes_per_token, read_bytes=source.read_bytes, layer_axis=True)
        for f, v in values.items():
            object.__setattr__(out, f, v)
        _pin(out, _source_key(out.tensor, out.layout()), obj=source)
        return out

    @property
    def library(self) -> kc.RealKvSource:
        return self._library


@dataclass(frozen=True, eq=False)
class TorchFingerprintSampler:
    """A :class:`~kvcanary_cupy.FingerprintSampler` whose state is a torch tensor.

    Args:
        period: each verify checks fingerprints of the slots with ``slot % period == phase``.
        state: int64 ``[2]`` (phase counter, completion ticket), written by verify.

    Example::

        >>> s = TorchFingerprintSampler.allocate(period=4)
        >>> s.period, s.state.tolist()
        (4, [0, 0])
    """

    period: int
    state: torch.Tensor
    LIBRARY_CLASS = kc.FingerprintSampler

    def __post_init__(self):
        _check_tensors(self, ("state",))
        object.__setattr__(self, "period", scalars.check_int(self.period, "period", minimum=1))
        _pin(self, _sampler_key(self.period, self.state), lambda: _MAKE["sampler"](self.period, self.state))

    @classmethod
    def allocate(cls, *, period: int, device="cpu") -> TorchFingerprintSampler:
        template = kc.FingerprintSampler.allocate(period=period, device="cpu")
        return cls(template.period, torch.from_numpy(template.state.copy()).to(_device(device)))

    @classmethod
    def from_library(cls, sampler: kc.FingerprintSampler) -> TorchFingerprintSampler:
        """The same state, as a tensor (zero copy); ``.library`` is ``sampler`` itself."""
        out = object.__new__(cls)
        object.__setattr__(out, "period", sampler.period)
        object.__setattr__(out, "state", _to_torch(sampler.state))
        _pin(out, _sampler_key(out.period, out.state), obj=sampler)
        return out

    @property
    def library(self) -> kc.FingerprintSampler:
        return self._library


@dataclass(frozen=True, eq=False)
class TorchSwaWindow:
    """A :class:`~kvcanary_cupy.SwaWindow` with a torch LUT.

    Args:
        size: window length in tokens, >= 1.
        lut: int32 / int64 ``[num_full_slots]``, full-pool slot -> SWA-pool slot.

    Example::

        >>> w = TorchSwaWindow(4, torch.arange(64))
        >>> w.size
        4
    """

    size: int
    lut: torch.Tensor
    LIBRARY_CLASS = kc.SwaWindow

    def __post_init__(self):
        _check_tensors(self, ("lut",))
        object.__setattr__(self, "size", scalars.check_int(self.size, "SwaWindow.size", minimum=1))
        _pin(self, _swa_key(self.size, self.lut), lambda: _MAKE["swa"](self.size, self.lut))

    @property
    def library(self) -> kc.SwaWindow:
        return self._library


@dataclass(frozen=True, eq=False)
class TorchExpectedTokens:
    """An :class:`~kvcanary_cupy.ExpectedTokens` with torch tensors.

    Args:
        table: int32 / int64 ``[num_requests, width]``, the token each request holds at
            each position, indexed like the slot table.
        valid_lens: int32 / int64 ``[>= batch]``, per batch row: positions at or past
            ``valid_lens[r] - offset`` are not checked.
        offset: 0 (target pool) or 1 (a draft pool whose slot ``pos`` holds token ``pos + 1``).

    Example::

        >>> e = TorchExpectedTokens(torch.zeros(4, 16, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
        >>> e.offset
        0
    """

    table: torch.Tensor
    valid_lens: torch.Tensor
    offset: int = 0
    LIBRARY_CLASS = kc.ExpectedTokens

    def __post_init__(self):
        _check_tensors(self, ("table", "valid_lens"))
        object.__setattr__(self, "offset", scalars.check_int(self.offset, "ExpectedTokens.offset"))
        _pin(self, _expected_key(self.table, self.valid_lens, self.offset),
             lambda: _MAKE["expected"](self.table, self.valid_lens, self.offset))

    @property
    def library(self) -> kc.ExpectedTokens:
        return self._library
