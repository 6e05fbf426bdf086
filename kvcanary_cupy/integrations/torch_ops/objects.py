"""The library objects behind the ops' tensor arguments: how each kind is keyed and built.

The ops take the library objects flattened into their tensors (a plan as its list of
tensors, a real-KV source as a tensor and four layout ints, ...). For each kind this
module holds its cache key (``_*_key``), how to build it from the tensors, zero copy and
through every check of the library's constructors (``_MAKE``), and its finder
(:func:`_canary`, :func:`_verify_plan`, ..., :func:`_expected`), which returns the object
a ``Torch*`` twin pinned for those tensors, else one built once and kept in
``views._OBJECTS``. The twins (:mod:`.twins`) pin with the same keys and builders; the
op implementations (:mod:`.impls`) find.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

import kvcanary_cupy as kc

from .views import _OBJECTS, _importable, _key


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
