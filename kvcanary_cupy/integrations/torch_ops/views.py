"""Tensors as the library sees them, and the caches that find what was built from them.

A tensor's identity (:func:`_key`: address, shape, strides, dtype, device) stands for the
library object or view built from it, so an op call pays neither a DLPack import nor a
validation per argument. Two caches hold what was built: ``_OBJECTS`` (canaries, plans,
logs, ... : the ``Torch*`` twins pin theirs, :mod:`.objects` builds the rest) and
``_VIEWS`` (zero-copy NumPy / CuPy views of the per-step index tensors, :func:`_view`).
:func:`cache_info` counts them, :func:`clear_cache` lets go of what no twin holds. Also
here: a tensor in the form DLPack takes (:func:`_importable`) and PyTorch's current
stream on its device (:func:`_stream`).
"""
from __future__ import annotations

import collections
import weakref

import torch

import kvcanary_cupy as kc


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

