"""A monitor's constructor options, checked and normalized.

:func:`check_options` takes what :class:`~kvcanary_cupy.KvCanary` is told about how to
watch (the device, sizes, switches, the policy, the chain kind, the real-KV sources and
mode) and returns it as :class:`Options`, or refuses it with a ``kvcanary:`` error naming
the argument; the arrays it binds (the tables, the SWA group's LUT) are checked where
:mod:`.parts` imports them. :func:`check_like` checks an array that replaces one of them.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import arrays, ops, runtime, scalars
from ..format import RealKvMode, check_chain
from ..plans import check_token_offset
from .policy import check_policy


@dataclasses.dataclass(frozen=True)
class Options:
    """What :func:`check_options` returns: the monitor's options, normalized (see :class:`KvCanary`).

    ``device`` is the device's canonical name (``"cpu"`` or ``"cuda:N"``), ``sample_period`` the
    ``fingerprint_sample_period``, ``token_offset`` resolved from ``draft`` when not given,
    ``sources`` the real-KV sources as a tuple and ``mode`` their :class:`RealKvMode`.
    """

    device: str
    chain: str
    policy: object
    max_batch: int
    num_slots: int
    draft: bool
    ring_capacity: int
    sweep_budget: int
    sweep_max_chains: int
    history: int
    sample_period: int | None
    max_tokens: int | None
    window: int | None
    token_offset: int
    sources: tuple
    mode: RealKvMode
    grow_on_overflow: bool
    verify_after: bool
    stamp_before_forward: bool


def check_options(*, num_slots, max_batch, device, real_kv, real_kv_mode, swa, token_offset, draft,
                  grow_on_overflow, verify_after, fingerprint_sample_period, ring_capacity, policy, max_tokens,
                  sweep_budget, sweep_max_chains, history, process_group, chain, stamp_before_forward,
                  window) -> Options:
    """The constructor's options, checked (each as :class:`KvCanary` documents it) and normalized.

    Example::

        >>> from kvcanary_cupy.monitor.options import check_options
        >>> kw = dict(num_slots=64, max_batch=2, device="cpu", real_kv=(), real_kv_mode=None, swa=None,
        ...           token_offset=None, draft=True, grow_on_overflow=True, verify_after=False,
        ...           fingerprint_sample_period=None, ring_capacity=16, policy="log", max_tokens=None,
        ...           sweep_budget=8, sweep_max_chains=2, history=4, process_group=None, chain="scan",
        ...           stamp_before_forward=False, window=None)
        >>> o = check_options(**kw)
        >>> o.device, o.token_offset, o.mode.name
        ('cpu', 1, 'NONE')
        >>> check_options(**dict(kw, max_batch=0))
        Traceback (most recent call last):
        ...
        ValueError: kvcanary: max_batch: expected an integer >= 1, got 0
    """
    chain = check_chain(chain, "chain")
    policy = check_policy(policy)
    kind, _ = runtime.parse_device(device)
    device = "cpu" if kind == "cpu" else runtime.device_of(runtime.empty((1,), np.int64, device))
    max_batch = scalars.check_int(max_batch, "max_batch", minimum=1)
    num_slots = scalars.check_int(num_slots, "num_slots", minimum=1)
    draft = scalars.check_flag(draft, "draft")
    ring_capacity = scalars.check_int(ring_capacity, "ring_capacity", minimum=1)
    sweep_budget = scalars.check_int(sweep_budget, "sweep_budget", minimum=1)
    sweep_max_chains = scalars.check_int(sweep_max_chains, "sweep_max_chains", minimum=1)
    history = scalars.check_int(history, "history", minimum=1)
    if fingerprint_sample_period is not None:
        fingerprint_sample_period = scalars.check_int(fingerprint_sample_period, "fingerprint_sample_period",
                                                     minimum=1)
    if max_tokens is not None:
        max_tokens = scalars.check_int(max_tokens, "max_tokens", minimum=0)
    if window is not None:
        window = scalars.check_int(window, "window", minimum=1)
        if swa is not None:
            raise ValueError("kvcanary: window: a windowed pool is watched alone; pass window or swa, not both")
    token_offset = check_token_offset(token_offset if token_offset is not None else (1 if draft else 0),
                                      "token_offset")
    srcs = ops.source_tuple(real_kv)
    mode = ops.real_kv_mode_of(real_kv_mode) if real_kv_mode is not None else (
        RealKvMode.PARTIAL if srcs else RealKvMode.NONE)
    grow_on_overflow = scalars.check_flag(grow_on_overflow, "grow_on_overflow")
    verify_after = scalars.check_flag(verify_after, "verify_after")
    stamp_before_forward = scalars.check_flag(stamp_before_forward, "stamp_before_forward")
    if stamp_before_forward:
        why = ("real-KV fingerprints (a record stamped before the forward cannot hold K/V the forward has not "
               "written yet; use real_kv_mode NONE)" if srcs and mode != RealKvMode.NONE else
               "verify_after (it checks what the forward left, after the stamp)" if verify_after else
               "a process_group (the ranks agree on what after_forward stamps)" if process_group is not None
               else None)
        if why is not None:
            raise ValueError(f"kvcanary: stamp_before_forward: not with {why}")
    return Options(device=device, chain=chain, policy=policy, max_batch=max_batch, num_slots=num_slots, draft=draft,
                   ring_capacity=ring_capacity, sweep_budget=sweep_budget, sweep_max_chains=sweep_max_chains,
                   history=history, sample_period=fingerprint_sample_period, max_tokens=max_tokens, window=window,
                   token_offset=token_offset, sources=srcs, mode=mode, grow_on_overflow=grow_on_overflow,
                   verify_after=verify_after, stamp_before_forward=stamp_before_forward)


def check_like(obj, name: str, like, device: str):
    """``obj`` imported as an index array of ``like``'s rank and shape (an array that replaces
    ``like``, bound at construction)."""
    a = arrays.as_index_array(obj, name, ndim=like.ndim, device=device)
    if tuple(a.shape) != tuple(like.shape):
        raise ValueError(f"kvcanary: {name}: expected shape {tuple(like.shape)} like the array bound at "
                         f"construction, got {tuple(a.shape)}")
    return a
