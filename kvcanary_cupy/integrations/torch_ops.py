"""The ops as ``torch.library`` custom ops, callable inside ``torch.compile(fullgraph=True)``.

Engines that compile their forward (vLLM does by default) cannot call :func:`kvcanary_cupy.plan`
and friends inside the compiled region: the library objects hold NumPy / CuPy views that
Dynamo does not trace, so the call breaks the graph. This module registers the ops under the
``kvcanary`` namespace of ``torch.ops``, each with a fake (meta) implementation, declared as
mutating exactly the buffers it writes and returning nothing:

- ``torch.ops.kvcanary.plan``: writes the verify and write plans;
- ``torch.ops.kvcanary.verify``: writes the violation log (and a fingerprint sampler's state);
- ``torch.ops.kvcanary.write``: writes the canary records and the violation log;
- ``torch.ops.kvcanary.plan_and_verify``: writes both plans and the log (and the sampler);
- ``torch.ops.kvcanary.plan_verify_write``: writes both plans, the canary records and the log.

Their arguments are tensors, lists of tensors, ints, bools and strings only: the library
objects are flattened into their tensors at the boundary. The friendly way in is one level
up: :func:`plan`, :func:`verify`, :func:`write`, :func:`plan_and_verify` and
:func:`plan_verify_write` here take the
keyword arguments of the library's ops, with the library objects replaced by their
``Torch*`` twins, frozen dataclasses that hold ``torch.Tensor`` s:

========================  ===========================================================
here                      library object it stands for (``.library``)
========================  ===========================================================
TorchCanaryBuffer         :class:`~kvcanary_cupy.CanaryBuffer`
TorchVerifyPlan           :class:`~kvcanary_cupy.VerifyPlan`
TorchWritePlan            :class:`~kvcanary_cupy.WritePlan`
TorchViolationLog         :class:`~kvcanary_cupy.ViolationLog` (``read``, ``poll``, ...)
TorchRealKvSource         :class:`~kvcanary_cupy.RealKvSource`
TorchFingerprintSampler   :class:`~kvcanary_cupy.FingerprintSampler`
TorchSwaWindow            :class:`~kvcanary_cupy.SwaWindow`
TorchExpectedTokens       :class:`~kvcanary_cupy.ExpectedTokens`
========================  ===========================================================

Each ``Torch*`` object builds its library object once, at construction, zero copy through
DLPack (so every check of the library's constructors runs there, with its ``kvcanary:``
errors), and keeps it. Build them outside the compiled region, like any long-lived buffer:
``.allocate(...)`` makes new tensors with torch's allocator, the constructor wraps tensors
the caller owns, ``.from_library(obj)`` wraps an existing library object (zero copy, the
same object underneath).

Inside an op, the library objects are found again by the identity of their tensors
(address, shape, strides, dtype, device), so a step pays neither a DLPack import nor a
validation per argument: per-step index tensors (``req_pool_indices``, ``input_ids``, ...)
are imported once per buffer and kept in a bounded cache, and the library's own launch
cache then runs the prepared launch. Cached views keep their tensors' memory alive, which
is what makes the identity safe; :func:`clear_cache` lets go of them, :func:`cache_info`
counts them.

Streams: on CUDA every op runs on PyTorch's current stream of the tensors' device (the
library's objects alone would default to CuPy's), so ``with torch.cuda.stream(s):`` and a
``torch.cuda.graph`` capture take the ops with the rest of the step.

The ops are defined with :class:`torch.library.Library` and an explicit schema, whose
``Tensor(a!)`` annotations are what ``torch.library.custom_op(mutates_args=...)`` writes:
measured on a CPU, a call through ``custom_op``'s Python wrappers costs about 60 us of host
time, one through the plain schema about 12 us, for the same semantics under
``torch.compile`` and ``torch.library.opcheck``.

Example (CPU; the same code runs on CUDA tensors with ``device="cuda"``)::

    >>> import torch, kvcanary_cupy as kc
    >>> from kvcanary_cupy.integrations import torch_ops as kt
    >>> canary = kt.TorchCanaryBuffer.allocate(num_slots=64)
    >>> vplan = kt.TorchVerifyPlan.allocate(capacity=64, max_batch=2)
    >>> wplan = kt.TorchWritePlan.allocate(max_batch=2)
    >>> log = kt.TorchViolationLog.allocate(capacity=16)
    >>> table = torch.zeros(2, 16, dtype=torch.int32)
    >>> table[1, :6] = torch.tensor([9, 4, 17, 30, 2, 11])
    >>> @torch.compile(fullgraph=True)
    ... def step(rpi, prefix, extend, ids, pos, loc):
    ...     kt.plan_and_verify(vplan, wplan, canary, req_pool_indices=rpi, prefix_lens=prefix,
    ...                        extend_lens=extend, req_to_token=table, log=log, tag=kc.LaunchTag.VERIFY)
    ...     kt.write(canary, wplan, input_ids=ids, positions=pos, out_cache_loc=loc,
    ...              log=log, tag=kc.LaunchTag.WRITE)
    >>> one = torch.ones(1, dtype=torch.int64)
    >>> step(one, 0 * one, 4 * one, torch.arange(101, 105), torch.arange(4), table[1, :4].long())
    >>> step(one, 4 * one, one, torch.tensor([105]), torch.tensor([4]), table[1, 4:5].long())
    >>> log.count
    0
    >>> canary.records[17, 0] = 999  # a stray write changes slot 17's token
    >>> step(one, 5 * one, one, torch.tensor([106]), torch.tensor([5]), table[1, 5:6].long())
    >>> [(v.slot, v.reasons) for v in log.read()]  # the successor's chain no longer matches
    [(30, <FailReason.CHAIN: 1>)]
    >>> torch.compiler.reset()  # drop the compiled step (and what its guards hold)
"""
from __future__ import annotations

import collections
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kvcanary_cupy as kc
from kvcanary_cupy import scalars
from kvcanary_cupy.format import RealKvMode

__all__ = [
    "TorchCanaryBuffer", "TorchExpectedTokens", "TorchFingerprintSampler", "TorchRealKvSource", "TorchSwaWindow",
    "TorchVerifyPlan", "TorchViolationLog", "TorchWritePlan", "cache_info", "clear_cache", "plan",
    "plan_and_verify", "plan_verify_write", "verify", "write",
]

_I64 = torch.int64


# --- finding library objects again by their tensors --------------------------------------
def _key(t: torch.Tensor) -> tuple:
    """A tensor's identity as the library sees it: the memory it covers and how."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class _Cache:
    """Objects built from tensors, found again by the tensors' keys.

    ``pinned``: objects a ``Torch*`` holder keeps alive (held here weakly: they go when
    their holder goes). ``recent``: objects built inside an op call from tensors no
    holder owns, at most ``capacity`` of them, least recently used first out. Every
    object holds views of its tensors, which keep the memory alive: while an entry
    exists, no other memory can take its address.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.pinned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.recent: collections.OrderedDict = collections.OrderedDict()
        self.hits = 0
        self.builds = 0

    def find(self, key, build):
        obj = self.pinned.get(key)
        if obj is None:
            obj = self.recent.get(key)
            if obj is None:
                obj = build()
                self.builds += 1
                self.recent[key] = obj
                if len(self.recent) > self.capacity:
                    self.recent.popitem(last=False)
                return obj
            self.recent.move_to_end(key)
        self.hits += 1
        return obj

    def pin(self, key, build=None, obj=None):
        """The object for ``key`` (``obj``, else the one found or built), held from now
        on by its holder."""
        if obj is None:
            obj = self.find(key, build)
        self.pinned[key] = obj
        self.recent.pop(key, None)
        return obj

    def clear(self) -> None:
        self.recent.clear()


_OBJECTS = _Cache(capacity=16)  # canaries, plans, logs, sources, samplers, windows, expected tokens
_VIEWS = _Cache(capacity=128)  # NumPy / CuPy views of per-step index tensors


def cache_info() -> dict:
    """How the tensor-identity caches are doing (host cost, not results).

    Returns a dict: ``objects`` (library objects alive and findable), ``views`` (index
    tensors kept imported), ``builds`` (objects and views built since import: a steady
    step adds none), ``hits`` (lookups that found one).

    Example::

        >>> from kvcanary_cupy.integrations import torch_ops as kt
        >>> sorted(kt.cache_info())
        ['builds', 'hits', 'objects', 'views']
    """
    return {"objects": len(_OBJECTS.pinned) + len(_OBJECTS.recent), "views": len(_VIEWS.recent),
            "builds": _OBJECTS.builds + _VIEWS.builds, "hits": _OBJECTS.hits + _VIEWS.hits}


def clear_cache() -> None:
    """Let go of every object and view built inside an op call for tensors no ``Torch*``
    holder owns (and of the memory they keep alive). Objects of live holders stay."""
    _OBJECTS.clear()
    _VIEWS.clear()


def _importable(t: torch.Tensor) -> torch.Tensor:
    # DLPack refuses tensors that require grad; the library only reads their bytes.
    return t.detach() if t.requires_grad else t


def _view(t: torch.Tensor | None, name: str):
    """A cached zero-copy NumPy / CuPy view of an index tensor (None stays None)."""
    if t is None:
        return None
    return _VIEWS.find(_key(t), lambda: kc.as_view(_importable(t), name))


def _stream(t: torch.Tensor):
    """PyTorch's current stream on ``t``'s device (raw handle), or None on the CPU."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _fields(tensors: Sequence[torch.Tensor], names: Sequence[str], what: str, arg: str) -> dict:
    if len(tensors) != len(names):
        raise ValueError(f"kvcanary: {arg}: expected the {len(names)} tensors of a {what} ({', '.join(names)}), "
                         f"got {len(tensors)}")
    return {n: _importable(t) for n, t in zip(names, tensors)}


# Each kind of object: its cache key, and how to build it (zero copy, every library check).
_LOG_FIELDS = ("ring", "head", "counters")
_LAYOUT_WORDS = 4  # per real-KV source: page_size, bytes_per_token, read_bytes, layer_axis


def _make_canary(records, chain):
    return kc.CanaryBuffer(records.detach()) if chain is None else kc.CanaryBuffer(records.detach(), chain)


def _make_source(tensor, layout):
    page, bpt, rb, layers = layout
    return kc.RealKvSource(_importable(tensor), page_size=page, bytes_per_token=bpt, read_bytes=rb,
                           layer_axis=bool(layers))


_MAKE = {
    "verify_plan": lambda ts, arg: kc.VerifyPlan.from_buffers(**_fields(ts, kc.VerifyPlan.FIELDS, "VerifyPlan", arg)),
    "write_plan": lambda ts, arg: kc.WritePlan.from_buffers(**_fields(ts, kc.WritePlan.FIELDS, "WritePlan", arg)),
    "log": lambda ts, arg: kc.ViolationLog.from_buffers(**_fields(ts, _LOG_FIELDS, "ViolationLog", arg)),
    "real_kv": _make_source,
    "sampler": lambda period, state: kc.FingerprintSampler(period, state.detach()),
    "swa": lambda size, lut: kc.SwaWindow(size, _importable(lut)),
    "expected": lambda table, valid_lens, offset: kc.ExpectedTokens(_importable(table), _importable(valid_lens),
                                                                     offset),
}


def _canary_key(records, chain):
    return ("canary", chain, _key(records))


def _list_key(kind, tensors):
    return (kind, *map(_key, tensors))


def _source_key(tensor, layout):
    return ("real_kv", *layout, _key(tensor))


def _sampler_key(period, state):
    return ("sampler", period, _key(state))


def _swa_key(size, lut):
    return ("swa", size, _key(lut))


def _expected_key(table, valid_lens, offset):
    return ("expected", offset, _key(table), _key(valid_lens))


def _canary(records: torch.Tensor, chain: str | None) -> kc.CanaryBuffer:
    return _OBJECTS.find(_canary_key(records, chain), lambda: _make_canary(records, chain))


def _verify_plan(tensors) -> kc.VerifyPlan | None:
    if not tensors:
        return None
    return _OBJECTS.find(_list_key("verify_plan", tensors), lambda: _MAKE["verify_plan"](tensors, "verify_plan"))


def _write_plan(tensors) -> kc.WritePlan | None:
    if not tensors:
        return None
    return _OBJECTS.find(_list_key("write_plan", tensors), lambda: _MAKE["write_plan"](tensors, "write_plan"))


def _log(tensors) -> kc.ViolationLog:
    return _OBJECTS.find(_list_key("log", tensors), lambda: _MAKE["log"](tensors, "log"))


def _sources(tensors, layout) -> tuple:
    if len(layout) != _LAYOUT_WORDS * len(tensors):
        raise ValueError(f"kvcanary: real_kv_layout: expected {_LAYOUT_WORDS} ints (page_size, bytes_per_token, "
                         f"read_bytes, layer_axis) per real_kv tensor, {_LAYOUT_WORDS * len(tensors)} in all, "
                         f"got {len(layout)}")
    out = []
    for i, t in enumerate(tensors):
        words = tuple(layout[_LAYOUT_WORDS * i:_LAYOUT_WORDS * (i + 1)])
        out.append(_OBJECTS.find(_source_key(t, words), lambda t=t, words=words: _make_source(t, words)))
    return tuple(out)


def _sampler(period: int, state: torch.Tensor | None) -> kc.FingerprintSampler | None:
    if state is None:
        return None
    return _OBJECTS.find(_sampler_key(period, state), lambda: _MAKE["sampler"](period, state))


def _swa(size: int, lut: torch.Tensor | None) -> kc.SwaWindow | None:
    if lut is None:
        return None
    return _OBJECTS.find(_swa_key(size, lut), lambda: _MAKE["swa"](size, lut))


def _expected(table: torch.Tensor | None, valid_lens: torch.Tensor | None, offset: int):
    if table is None and valid_lens is None:
        return None
    if table is None or valid_lens is None:
        raise ValueError("kvcanary: expected_table: expected tokens need both expected_table and "
                         "expected_valid_lens, got only one")
    return _OBJECTS.find(_expected_key(table, valid_lens, offset), lambda: _MAKE["expected"](table, valid_lens, offset))


def _plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa_size,
                 swa_lut, expected_table, expected_valid_lens, expected_offset) -> dict:
    return dict(req_pool_indices=_view(req_pool_indices, "req_pool_indices"),
                prefix_lens=_view(prefix_lens, "prefix_lens"), extend_lens=_view(extend_lens, "extend_lens"),
                req_to_token=_view(req_to_token, "req_to_token"), block_table=_view(block_table, "block_table"),
                page_size=page_size, swa=_swa(swa_size, swa_lut),
                expected=_expected(expected_table, expected_valid_lens, expected_offset))


# --- the ops -------------------------------------------------------------------------
# The ops live as long as this object (this module). A fragment: other modules may add ops
# to the namespace.
_LIB = torch.library.Library("kvcanary", "FRAGMENT")

_PLAN_ARGS = ("Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, Tensor? req_to_token, "
              "Tensor? block_table, int? page_size, int swa_size, Tensor? swa_lut, Tensor? expected_table, "
              "Tensor? expected_valid_lens, int expected_offset")
_CHECK_ARGS = "int tag, Tensor[] real_kv, int[] real_kv_layout, int real_kv_mode"
SCHEMAS = {
    "plan": f"plan(Tensor(a!)[] verify_plan, Tensor(b!)[] write_plan, {_PLAN_ARGS}) -> ()",
    "verify": ("verify(Tensor canary, str? chain, Tensor[] verify_plan, Tensor(a!)[] log, "
               f"{_CHECK_ARGS}, bool check_tokens, Tensor(b!)? sample_state, int sample_period) -> ()"),
    "write": ("write(Tensor(a!) canary, str? chain, Tensor[] write_plan, Tensor input_ids, Tensor positions, "
              f"Tensor out_cache_loc, Tensor(b!)[] log, {_CHECK_ARGS}, Tensor? expected_input_ids, "
              "Tensor? expected_positions) -> ()"),
    "plan_and_verify": (f"plan_and_verify(Tensor(a!)[] verify_plan, Tensor(b!)[] write_plan, Tensor canary, "
                        f"str? chain, {_PLAN_ARGS}, Tensor(c!)[] log, {_CHECK_ARGS}, bool check_tokens, "
                        "Tensor(d!)? sample_state, int sample_period) -> ()"),
    "plan_verify_write": (f"plan_verify_write(Tensor(a!)[] verify_plan, Tensor(b!)[] write_plan, "
                          f"Tensor(c!) canary, str? chain, {_PLAN_ARGS}, Tensor input_ids, Tensor positions, "
                          "Tensor out_cache_loc, Tensor? expected_input_ids, Tensor? expected_positions, "
                          "Tensor(d!)[] log, int tag, int write_tag, bool check_tokens) -> ()"),
}
"""The schema of each op: ``Tensor(x!)`` marks what it writes (``mutates_args``)."""


def _plan_impl(verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table,
               page_size, swa_size, swa_lut, expected_table, expected_valid_lens, expected_offset) -> None:
    kc.plan(_verify_plan(verify_plan), _write_plan(write_plan),
            **_plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size,
                           swa_size, swa_lut, expected_table, expected_valid_lens, expected_offset),
            stream=_stream((verify_plan or write_plan or [req_pool_indices])[0]))


def _verify_impl(canary, chain, verify_plan, log, tag, real_kv, real_kv_layout, real_kv_mode, check_tokens,
                 sample_state, sample_period) -> None:
    kc.verify(_canary(canary, chain), _verify_plan(verify_plan), log=_log(log), tag=tag,
              real_kv=_sources(real_kv, real_kv_layout), real_kv_mode=real_kv_mode, check_tokens=check_tokens,
              sample=_sampler(sample_period, sample_state), stream=_stream(canary))


def _token_inputs(input_ids, positions, out_cache_loc, expected_input_ids, expected_positions) -> dict:
    """A write's token inputs, as the library's ops take them."""
    expected_inputs = None
    if expected_input_ids is not None or expected_positions is not None:
        expected_inputs = (_view(expected_input_ids, "expected_input_ids"),
                           _view(expected_positions, "expected_positions"))
    return dict(input_ids=_view(input_ids, "input_ids"), positions=_view(positions, "positions"),
                out_cache_loc=_view(out_cache_loc, "out_cache_loc"), expected_inputs=expected_inputs)


def _write_impl(canary, chain, write_plan, input_ids, positions, out_cache_loc, log, tag, real_kv, real_kv_layout,
                real_kv_mode, expected_input_ids, expected_positions) -> None:
    kc.write(_canary(canary, chain), _write_plan(write_plan),
             **_token_inputs(input_ids, positions, out_cache_loc, expected_input_ids, expected_positions),
             log=_log(log), tag=tag, real_kv=_sources(real_kv, real_kv_layout), real_kv_mode=real_kv_mode,
             stream=_stream(canary))


def _library_plan_and_verify():
    """The library's fused op, where this version of it has one."""
    fused = getattr(kc, "plan_and_verify", None)
    return fused if fused is not None else getattr(kc.ops, "plan_and_verify", None)


def _plan_and_verify_impl(verify_plan, write_plan, canary, chain, req_pool_indices, prefix_lens, extend_lens,
                          req_to_token, block_table, page_size, swa_size, swa_lut, expected_table,
                          expected_valid_lens, expected_offset, log, tag, real_kv, real_kv_layout, real_kv_mode,
                          check_tokens, sample_state, sample_period) -> None:
    vp, wp, cb = _verify_plan(verify_plan), _write_plan(write_plan), _canary(canary, chain)
    planned = _plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size,
                           swa_size, swa_lut, expected_table, expected_valid_lens, expected_offset)
    checks = dict(log=_log(log), tag=tag, real_kv=_sources(real_kv, real_kv_layout), real_kv_mode=real_kv_mode,
                  check_tokens=check_tokens, sample=_sampler(sample_period, sample_state))
    stream = _stream(canary)
    fused = _library_plan_and_verify()
    if fused is not None:
        fused(vp, wp, cb, **planned, **checks, stream=stream)
    else:  # the same results, in two launches
        kc.plan(vp, wp, **planned, stream=stream)
        kc.verify(cb, vp, **checks, stream=stream)


def _plan_verify_write_impl(verify_plan, write_plan, canary, chain, req_pool_indices, prefix_lens, extend_lens,
                            req_to_token, block_table, page_size, swa_size, swa_lut, expected_table,
                            expected_valid_lens, expected_offset, input_ids, positions, out_cache_loc,
                            expected_input_ids, expected_positions, log, tag, write_tag, check_tokens) -> None:
    kc.plan_verify_write(_verify_plan(verify_plan), _write_plan(write_plan), _canary(canary, chain),
                         **_plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table,
                                        page_size, swa_size, swa_lut, expected_table, expected_valid_lens,
                                        expected_offset),
                         **_token_inputs(input_ids, positions, out_cache_loc, expected_input_ids,
                                         expected_positions),
                         log=_log(log), tag=tag, write_tag=write_tag, check_tokens=check_tokens,
                         stream=_stream(canary))


def _no_result(*args, **kwargs) -> None:
    """The fake (meta) implementation: the ops only write into their arguments."""


for _name, _impl in (("plan", _plan_impl), ("verify", _verify_impl), ("write", _write_impl),
                     ("plan_and_verify", _plan_and_verify_impl), ("plan_verify_write", _plan_verify_write_impl)):
    _LIB.define(SCHEMAS[_name])
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")  # every device: the library dispatches on it
    torch.library.register_fake(f"kvcanary::{_name}", _no_result, lib=_LIB)


# --- the Torch* holders ------------------------------------------------------------------
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


def _holder(obj, cls, name: str):
    if obj is None or isinstance(obj, cls):
        return obj
    lib_cls = cls.LIBRARY_CLASS
    if isinstance(obj, lib_cls):
        raise TypeError(f"kvcanary: {name}: expected a {cls.__name__}, got a {lib_cls.__name__}; wrap it once, "
                        f"outside the step, with {cls.__name__}.from_library(...) (zero copy) and pass that")
    raise TypeError(f"kvcanary: {name}: expected a {cls.__name__}, got {type(obj).__name__}")


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
    LIBRARY_CLASS = kc.VerifyPlan

    def __post_init__(self):
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
        ring: ``[capacity, 10]`` violation rows.
        head: ``[1]`` append index (keeps counting past the capacity).
        counter_array: ``[6]`` kernel runs, slots checked, slots written, verifies
            skipped, writes skipped, tokens skipped (by name: :meth:`counters`).

    The host reads go to the library object, ordered after the work queued on PyTorch's
    current stream: :meth:`read`, :meth:`rows`, :meth:`poll`, :attr:`count`,
    :meth:`counters`, :meth:`clear`.

    Example::

        >>> log = TorchViolationLog.allocate(capacity=256)
        >>> log.count, log.read(), log.ring.shape
        (0, [], torch.Size([256, 10]))
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


# --- the friendly functions (traceable by Dynamo) -----------------------------------------
def _int(value, name: str, optional: bool = False):
    if optional and value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return scalars.check_int(value, name)  # a NumPy integer, or a kvcanary: error


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"kvcanary: {name}: expected True or False, got {type(value).__name__} {value!r}")
    return value


def _tensor(value, name: str, optional: bool = False):
    if optional and value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"kvcanary: {name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _plan_args(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa, expected):
    swa = _holder(swa, TorchSwaWindow, "swa")
    expected = _holder(expected, TorchExpectedTokens, "expected")
    return [_tensor(req_pool_indices, "req_pool_indices"), _tensor(prefix_lens, "prefix_lens"),
            _tensor(extend_lens, "extend_lens"), _tensor(req_to_token, "req_to_token", True),
            _tensor(block_table, "block_table", True), _int(page_size, "page_size", True),
            0 if swa is None else swa.size, None if swa is None else swa.lut,
            None if expected is None else expected.table, None if expected is None else expected.valid_lens,
            0 if expected is None else expected.offset]


def _token_args(input_ids, positions, out_cache_loc, expected_inputs=None) -> list:
    """A write's token tensors, then its expected ones (or None each)."""
    exp_ids = exp_pos = None
    if expected_inputs is not None:
        if not isinstance(expected_inputs, (tuple, list)) or len(expected_inputs) != 2:
            raise TypeError("kvcanary: expected_inputs: expected a pair (tokens, positions), either may be None")
        exp_ids = _tensor(expected_inputs[0], "expected_inputs[0]", True)
        exp_pos = _tensor(expected_inputs[1], "expected_inputs[1]", True)
    return [_tensor(input_ids, "input_ids"), _tensor(positions, "positions"), _tensor(out_cache_loc, "out_cache_loc"),
            exp_ids, exp_pos]


def _check_args(tag, real_kv, real_kv_mode):
    if real_kv is None:
        real_kv = ()
    elif isinstance(real_kv, (TorchRealKvSource, kc.RealKvSource)):
        real_kv = (real_kv,)
    sources = [_holder(s, TorchRealKvSource, f"real_kv[{i}]") for i, s in enumerate(real_kv)]
    layout = []
    for s in sources:
        layout += s.layout()
    return [_int(tag, "tag"), [s.tensor for s in sources], layout, _int(real_kv_mode, "real_kv_mode")]


def _sample_args(sample):
    sample = _holder(sample, TorchFingerprintSampler, "sample")
    return [None, 1] if sample is None else [sample.state, sample.period]


def _run(op, stream, args) -> None:
    if stream is None:
        op(*args)
    else:
        with torch.cuda.stream(stream):
            op(*args)


def plan(verify_plan: TorchVerifyPlan | None, write_plan: TorchWritePlan | None, *, req_pool_indices,
         prefix_lens, extend_lens, req_to_token=None, block_table=None, page_size: int | None = None,
         swa: TorchSwaWindow | None = None, expected: TorchExpectedTokens | None = None, stream=None) -> None:
    """:func:`kvcanary_cupy.plan` through ``torch.ops.kvcanary.plan``.

    Args:
        verify_plan: :class:`TorchVerifyPlan` receiving one entry per record the step
            reads; None to plan writes only.
        write_plan: :class:`TorchWritePlan` receiving per-row write offsets and seeds;
            None to plan verification only.
        req_pool_indices: int32 / int64 ``[bs]`` tensor, each row's request-table row
            (0: padding).
        prefix_lens: int32 / int64 ``[bs]`` tensor, tokens already cached per row.
        extend_lens: int32 / int64 ``[bs]`` tensor, tokens this step writes per row.
        req_to_token: int32 / int64 ``[num_requests, max_len]`` token-level slot table; or
        block_table: int32 / int64 ``[num_requests, max_pages]`` with ``page_size`` (int).
        swa: :class:`TorchSwaWindow`: verify the window only, slots through its LUT.
        expected: :class:`TorchExpectedTokens`: fill the plan's expected tokens.
        stream: a ``torch.cuda.Stream`` to run on; None (and always inside a compiled
            region): PyTorch's current stream.

    Example::

        >>> vp, wp = TorchVerifyPlan.allocate(capacity=64, max_batch=2), TorchWritePlan.allocate(max_batch=2)
        >>> table = torch.arange(1, 33, dtype=torch.int32).reshape(2, 16)
        >>> plan(vp, wp, req_pool_indices=torch.tensor([1, 0]), prefix_lens=torch.tensor([3, 7]),
        ...      extend_lens=torch.tensor([1, 9]), req_to_token=table)
        >>> vp.slot_indices[:3].tolist(), wp.seed_slots.tolist()
        ([17, 18, 19], [19, -2])
    """
    vp = _holder(verify_plan, TorchVerifyPlan, "verify_plan")
    wp = _holder(write_plan, TorchWritePlan, "write_plan")
    _run(torch.ops.kvcanary.plan.default, stream,
         [[] if vp is None else vp.tensors(), [] if wp is None else wp.tensors(),
          *_plan_args(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa,
                      expected)])


def verify(canary: TorchCanaryBuffer, verify_plan: TorchVerifyPlan, *, log: TorchViolationLog, tag: int,
           real_kv=(), real_kv_mode=RealKvMode.NONE, check_tokens: bool = False,
           sample: TorchFingerprintSampler | None = None, stream=None) -> None:
    """:func:`kvcanary_cupy.verify` through ``torch.ops.kvcanary.verify``.

    Args:
        canary: :class:`TorchCanaryBuffer`, the records (read).
        verify_plan: :class:`TorchVerifyPlan` from :func:`plan` for this step (read).
        log: :class:`TorchViolationLog` receiving violation rows and counters.
        tag: an int (e.g. :class:`~kvcanary_cupy.LaunchTag`) naming this launch in rows.
        real_kv: a :class:`TorchRealKvSource` or a sequence of them, whose bytes the
            fingerprints cover, in order.
        real_kv_mode: :class:`~kvcanary_cupy.RealKvMode` (or its int value).
        check_tokens: also compare stored tokens with the plan's expected tokens.
        sample: :class:`TorchFingerprintSampler`: fingerprints of a rotating
            ``1/period`` of the slots only (its state is written).
        stream: as for :func:`plan`.

    Example::

        >>> canary, log = TorchCanaryBuffer.allocate(num_slots=64), TorchViolationLog.allocate(capacity=4)
        >>> vp = TorchVerifyPlan.allocate(capacity=8, max_batch=1)
        >>> verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY)   # never planned: skipped, counted
        >>> log.counters()["verifies_skipped"]
        1
    """
    cb = _holder(canary, TorchCanaryBuffer, "canary")
    vp = _holder(verify_plan, TorchVerifyPlan, "verify_plan")
    lg = _holder(log, TorchViolationLog, "log")
    if vp is None:
        raise TypeError("kvcanary: verify_plan: expected a TorchVerifyPlan, got None")
    _run(torch.ops.kvcanary.verify.default, stream,
         [cb.records, cb.chain, vp.tensors(), lg.tensors(), *_check_args(tag, real_kv, real_kv_mode),
          _flag(check_tokens, "check_tokens"), *_sample_args(sample)])


def write(canary: TorchCanaryBuffer, write_plan: TorchWritePlan, *, input_ids, positions, out_cache_loc,
          log: TorchViolationLog, tag: int, real_kv=(), real_kv_mode=RealKvMode.NONE, expected_inputs=None,
          stream=None) -> None:
    """:func:`kvcanary_cupy.write` through ``torch.ops.kvcanary.write``.

    Args:
        canary: :class:`TorchCanaryBuffer`, the records (written).
        write_plan: :class:`TorchWritePlan` from :func:`plan` for this step (read).
        input_ids: int32 / int64 ``[>= total]`` tensor, the tokens written, rows back to back.
        positions: int32 / int64 ``[>= total]`` tensor, their positions.
        out_cache_loc: int32 / int64 ``[>= total]`` tensor, their slots (negative: skipped).
        log: :class:`TorchViolationLog` receiving violation rows and counters.
        tag: an int (e.g. :class:`~kvcanary_cupy.LaunchTag`) naming this launch in rows.
        real_kv, real_kv_mode: as for :func:`verify`; the fingerprints stored.
        expected_inputs: optional pair ``(tokens, positions)`` of int32 / int64
            ``[>= total]`` tensors (either may be None; -1 skips an element):
            WRITE_TOKEN / WRITE_POSITION violations where they differ.
        stream: as for :func:`plan`.

    Example::

        >>> canary, log = TorchCanaryBuffer.allocate(num_slots=8), TorchViolationLog.allocate(capacity=4)
        >>> wp = TorchWritePlan.allocate(max_batch=1)
        >>> plan(None, wp, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]),
        ...      extend_lens=torch.tensor([2]), req_to_token=torch.tensor([[0, 0], [5, 6]]))
        >>> write(canary, wp, input_ids=torch.tensor([7, 8]), positions=torch.tensor([0, 1]),
        ...       out_cache_loc=torch.tensor([5, 6]), log=log, tag=kc.LaunchTag.WRITE)
        >>> canary.records[5:7, :2].tolist()
        [[7, 0], [8, 1]]
    """
    cb = _holder(canary, TorchCanaryBuffer, "canary")
    wp = _holder(write_plan, TorchWritePlan, "write_plan")
    lg = _holder(log, TorchViolationLog, "log")
    if wp is None:
        raise TypeError("kvcanary: write_plan: expected a TorchWritePlan, got None")
    tokens = _token_args(input_ids, positions, out_cache_loc, expected_inputs)
    _run(torch.ops.kvcanary.write.default, stream,
         [cb.records, cb.chain, wp.tensors(), *tokens[:3], lg.tensors(), *_check_args(tag, real_kv, real_kv_mode),
          *tokens[3:]])


def plan_and_verify(verify_plan: TorchVerifyPlan, write_plan: TorchWritePlan | None,
                    canary: TorchCanaryBuffer, *, req_pool_indices, prefix_lens, extend_lens, req_to_token=None,
                    block_table=None, page_size: int | None = None, swa: TorchSwaWindow | None = None,
                    expected: TorchExpectedTokens | None = None, log: TorchViolationLog, tag: int,
                    real_kv=(), real_kv_mode=RealKvMode.NONE, check_tokens: bool = False,
                    sample: TorchFingerprintSampler | None = None, stream=None) -> None:
    """A step's plan and verify, through ``torch.ops.kvcanary.plan_and_verify``.

    The results are those of :func:`plan` followed by :func:`verify` with the same
    arguments: the same log rows (as a multiset) and counters, the verify plan's
    scalars and ``offsets``, the whole write plan, the sampler's state. It runs the
    library's one-launch :func:`kvcanary_cupy.plan_and_verify`, which on CUDA does not
    write the verify plan's per-entry arrays (``slot_indices``, ``prev_slot_indices``,
    ``expected_positions``, ``expected_tokens``; the NumPy backend does); against a
    library version without it, ``plan`` then ``verify``, which write them. The op
    declares the whole verify plan as written either way.

    Args:
        verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens,
            req_to_token, block_table, page_size, swa, expected: as for :func:`plan`
            (``verify_plan`` is required).
        canary, log, tag, real_kv, real_kv_mode, check_tokens, sample: as for
            :func:`verify`.
        stream: as for :func:`plan`.

    Example::

        >>> canary, log = TorchCanaryBuffer.allocate(num_slots=8), TorchViolationLog.allocate(capacity=4)
        >>> vp, wp = TorchVerifyPlan.allocate(capacity=8, max_batch=1), TorchWritePlan.allocate(max_batch=1)
        >>> plan_and_verify(vp, wp, canary, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]),
        ...                 extend_lens=torch.tensor([2]), req_to_token=torch.tensor([[0, 0], [5, 6]]),
        ...                 log=log, tag=kc.LaunchTag.VERIFY)
        >>> wp.offsets.tolist(), log.count
        ([0, 2], 0)
    """
    vp = _holder(verify_plan, TorchVerifyPlan, "verify_plan")
    wp = _holder(write_plan, TorchWritePlan, "write_plan")
    cb = _holder(canary, TorchCanaryBuffer, "canary")
    lg = _holder(log, TorchViolationLog, "log")
    if vp is None:
        raise TypeError("kvcanary: verify_plan: expected a TorchVerifyPlan, got None")
    _run(torch.ops.kvcanary.plan_and_verify.default, stream,
         [vp.tensors(), [] if wp is None else wp.tensors(), cb.records, cb.chain,
          *_plan_args(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa,
                      expected),
          lg.tensors(), *_check_args(tag, real_kv, real_kv_mode), _flag(check_tokens, "check_tokens"),
          *_sample_args(sample)])


def plan_verify_write(verify_plan: TorchVerifyPlan, write_plan: TorchWritePlan, canary: TorchCanaryBuffer, *,
                      req_pool_indices, prefix_lens, extend_lens, req_to_token=None, block_table=None,
                      page_size: int | None = None, swa: TorchSwaWindow | None = None,
                      expected: TorchExpectedTokens | None = None, input_ids, positions, out_cache_loc,
                      expected_inputs=None, log: TorchViolationLog, tag: int, write_tag: int,
                      check_tokens: bool = False, stream=None) -> None:
    """A small step's plan, verify and write, through ``torch.ops.kvcanary.plan_verify_write``.

    The library's one-launch :func:`kvcanary_cupy.plan_verify_write`: what
    :func:`plan_and_verify` followed by :func:`write` leave (no real-KV fingerprints), for
    an engine that has the step's token inputs before its forward. At most
    ``kvcanary_cupy.STEP_WRITE_TOKENS`` (256) tokens; a larger step raises.

    Args:
        verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens,
            req_to_token, block_table, page_size, swa, expected: as for :func:`plan`
            (both plans are required).
        canary, log, check_tokens: as for :func:`verify`; the canary's records are written.
        input_ids, positions, out_cache_loc, expected_inputs: as for :func:`write`.
        tag: the verify's rows' tag; ``write_tag``: the write's.
        stream: as for :func:`plan`.

    Example::

        >>> canary, log = TorchCanaryBuffer.allocate(num_slots=8), TorchViolationLog.allocate(capacity=4)
        >>> vp, wp = TorchVerifyPlan.allocate(capacity=8, max_batch=1), TorchWritePlan.allocate(max_batch=1)
        >>> plan_verify_write(vp, wp, canary, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]),
        ...                   extend_lens=torch.tensor([2]), req_to_token=torch.tensor([[0, 0], [5, 6]]),
        ...                   input_ids=torch.tensor([7, 8]), positions=torch.tensor([0, 1]),
        ...                   out_cache_loc=torch.tensor([5, 6]), log=log, tag=kc.LaunchTag.VERIFY,
        ...                   write_tag=kc.LaunchTag.WRITE)
        >>> canary.records[5:7, :2].tolist(), log.count
        ([[7, 0], [8, 1]], 0)
    """
    vp = _holder(verify_plan, TorchVerifyPlan, "verify_plan")
    wp = _holder(write_plan, TorchWritePlan, "write_plan")
    cb = _holder(canary, TorchCanaryBuffer, "canary")
    lg = _holder(log, TorchViolationLog, "log")
    for given, name, cls in ((vp, "verify_plan", "TorchVerifyPlan"), (wp, "write_plan", "TorchWritePlan")):
        if given is None:
            raise TypeError(f"kvcanary: {name}: expected a {cls}, got None")
    _run(torch.ops.kvcanary.plan_verify_write.default, stream,
         [vp.tensors(), wp.tensors(), cb.records, cb.chain,
          *_plan_args(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa,
                      expected),
          *_token_args(input_ids, positions, out_cache_loc, expected_inputs), lg.tensors(),
          _int(tag, "tag"), _int(write_tag, "write_tag"), _flag(check_tokens, "check_tokens")])
