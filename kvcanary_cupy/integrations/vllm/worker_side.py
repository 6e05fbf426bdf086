"""The connector's worker side: the canary around every forward of vLLM's worker.

- ``register_kv_caches``: one :class:`~kvcanary_cupy.integrations.engine.block_table.BlockTableCanary`
  per KV-cache group, with fingerprints that follow the attention backend's layout (:mod:`.layout`).
- ``start_load_kv`` (before the forward: the scheduler side asks for it): take the step's
  metadata (:mod:`.mirror`), name the request of every row of the attention metadata
  (:mod:`.rows`), and verify every slot each row reads, in every group.
- ``wait_for_save`` (after the forward): stamp every slot the step wrote; check the rows
  that read another row's writes of the same step.
- ``get_block_ids_with_load_errors``: under ``policy="cancel"``, one block per corrupted
  request, which vLLM's failure path (``kv_load_failure_policy="fail"``) charges to that
  request alone: it fails it, drops its token and evicts the block from the prefix cache.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import time
import typing

import numpy as np

from ...backends import use_cpu_backend
from ...format import RealKvMode
from ...monitor.policy import KvCanaryError, warn
from ..engine.block_table import AttentionStep, BlockTableCanary
from ..engine.policy import IncidentPolicy
from ..engine.step_arrays import host_view
from ..engine.tables import RowPool
from ..engine.violations import EngineViolation
from .config import monitor_options
from .layout import group_fingerprints
from .mirror import RequestMirror
from .rows import RowKeyReader, deferred_rows, match_rows

logger = logging.getLogger("kvcanary")


@dataclasses.dataclass
class Group:
    """One KV-cache group: its layers, block size and canary."""

    index: int
    kind: str
    layers: tuple
    block_size: int
    canary: BlockTableCanary


class WorkerSide:
    """The canaries of one worker and what drives them.

    Args:
        vllm_config: the engine's ``VllmConfig``.
        kv_cache_config: vLLM's ``KVCacheConfig`` (groups, blocks).
        options: the connector's checked options (:func:`~.config.parse_options`).
    """

    def __init__(self, vllm_config, kv_cache_config, options: dict):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.options = options
        self.policy = IncidentPolicy(options.get("policy", "log"))
        groups = kv_cache_config.kv_cache_groups
        if options.get("policy") == "cancel" and len(groups) > 1:
            raise ValueError("kvcanary: policy: 'cancel' fails requests through vLLM's invalid-block path, which "
                             f"supports one KV-cache group; this model has {len(groups)}: use 'log' or 'raise'")
        if vllm_config.speculative_config is not None:
            raise ValueError("kvcanary: speculative_config: speculative decoding writes draft tokens the scheduler "
                             "does not know yet; the connector cannot watch it")
        self.mirror = RequestMirror(len(groups))
        self.groups: list = []
        self.found: list = []  # every EngineViolation found
        self.cancelled: dict = {}  # request id -> the block reported for it
        self._load_errors: set = set()
        self.steps = 0
        self.empty_steps = 0
        self.rows_unmatched = 0
        self.cancel_unavailable = 0
        self.cancel_count = 0  # requests handed to vLLM's failure path
        self.host_seconds = 0.0
        self.preempted = 0  # requests preempted (the mirror counts prefix hits and chunked prefills)
        self._step = None  # (per group AttentionStep) between start_load_kv and wait_for_save
        self.row_keys = RowKeyReader()
        self.cpu_backend = None  # what runs a CPU engine's checks ("numpy" or "numba"); None on a GPU
        self._previous_cpu_backend = None

    # ------------------------------------------------------------------ setup
    def register(self, kv_caches: dict) -> None:
        """Build each group's canary over ``kv_caches`` (layer name -> KV tensor)."""
        import torch  # noqa: PLC0415

        cfg = self.vllm_config
        static = cfg.compilation_config.static_forward_context
        mon = monitor_options(self.options)
        mode = RealKvMode(int(mon.get("real_kv_mode", RealKvMode.PARTIAL)))
        num_blocks = int(self.kv_cache_config.num_blocks)
        if kv_caches and next(iter(kv_caches.values())).device.type == "cpu":
            self._pick_cpu_backend()  # before any monitor prepares its calls
        max_batch = int(cfg.scheduler_config.max_num_seqs)
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = g.kv_cache_spec
            bs = int(spec.block_size)
            layers = {n: static[n] for n in g.layer_names if n in static}
            fp = group_fingerprints(layers, kv_caches, block_size=bs, num_blocks=num_blocks, mode=mode)
            t = kv_caches[g.layer_names[0]]
            device = "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index or torch.cuda.current_device()}"
            width = -(-int(cfg.model_config.max_model_len) // bs)
            canary = BlockTableCanary(num_blocks=num_blocks, block_size=bs, rows=2 * max_batch + 1, width=width,
                                      max_batch=max_batch, device=device, fingerprints=fp, name=f"group{i}",
                                      options=mon, max_tokens=int(cfg.scheduler_config.max_num_batched_tokens))
            self.groups.append(Group(i, type(spec).__name__, tuple(g.layer_names), bs, canary))
            canary.compile_ahead()  # at the engine's start, not in its first request's step
        self.rows = RowPool(2 * max_batch + 1)

    def _pick_cpu_backend(self) -> None:
        """On a CPU engine, the backend the options pick (see :func:`~.config.kv_transfer_config`),
        for this process until :meth:`close`."""
        choice = self.options.get("cpu_backend", "auto")
        if choice == "auto":
            # vLLM's own reading of the switch (vllm.envs); read here too where vLLM's workers
            # are stood in for without vLLM installed.
            own_process = bool(int(os.getenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")))
            choice = "numba" if own_process and importlib.util.find_spec("numba") is not None else "numpy"
        self.cpu_backend = choice
        self._previous_cpu_backend = use_cpu_backend(choice)

    # ------------------------------------------------------------------ a step
    def before_forward(self, meta, forward_context) -> None:
        """``start_load_kv``: the step's metadata, then every group's pre-forward check."""
        t0 = time.perf_counter()
        try:
            self._load_errors = set()
            if self._step is not None:  # the previous forward never reached wait_for_save
                for g in self.groups:
                    g.canary.abort()
                self._step = None
            for rid in self.mirror.apply(meta):
                self._request_left(rid)
            self.preempted += len(meta.preempted)
            md = getattr(forward_context, "attn_metadata", None) if forward_context is not None else None
            if not md or not self.groups:
                self.empty_steps += 1
                return
            if isinstance(md, list):
                raise ValueError("kvcanary: micro-batching (DBO) splits a step's attention metadata; the connector "
                                 "cannot watch it")
            self.steps += 1
            metas = [md[g.layers[0]] for g in self.groups]
            if self.cpu_backend is not None:  # a CPU engine's tensors as NumPy views, taken once a step
                metas = [HostMetadata.of(a) for a in metas]
            first = metas[0]
            stream = None if self.cpu_backend is not None else self._stream(first)
            keys = self.row_keys.read(first, stream)  # the lengths attention reads, on the host
            states, unmatched = match_rows(keys, self.mirror, block_size=self.groups[0].block_size)
            self.rows_unmatched += unmatched
            rows, fresh = self.rows.rows_of(states)
            qsl, seq = keys[0], keys[1]
            tags, tokens = [s.request_id for s in states], _step_tokens(states)
            steps = []
            for g, a in zip(self.groups, metas):
                steps.append(AttentionStep(
                    rows=list(rows), tags=tags, states=states, fresh=list(fresh),
                    block_table=a.block_table, seq_lens=a.seq_lens, query_start_loc=a.query_start_loc,
                    slot_mapping=a.slot_mapping, tokens=tokens, deferred=deferred_rows(states, g.index, g.block_size),
                    host_seq_lens=seq, host_query_start_loc=qsl, stream=stream))
            self._step = steps
            for g, step in zip(self.groups, steps):
                self._report(g, g.canary.check_reads(step))
        finally:
            self.host_seconds += time.perf_counter() - t0

    @staticmethod
    def _stream(md):
        """PyTorch's current stream (raw), where the forward runs, for CUDA metadata; else None."""
        t = md.query_start_loc
        if getattr(getattr(t, "device", None), "type", "cpu") == "cpu":
            return None
        import torch  # noqa: PLC0415

        return int(torch.cuda.current_stream(t.device).cuda_stream)

    def after_forward(self) -> None:
        """``wait_for_save``: stamp what the forward wrote, check the deferred rows."""
        if self._step is None:
            return
        t0 = time.perf_counter()
        try:
            steps, self._step = self._step, None
            for g, step in zip(self.groups, steps):
                self._report(g, g.canary.stamp_writes(step))
        finally:
            self.host_seconds += time.perf_counter() - t0

    def load_errors(self) -> set:
        """The blocks whose load failed this step (``policy="cancel"``'s requests)."""
        out, self._load_errors = self._load_errors, set()
        return out

    # ------------------------------------------------------------------ reports
    def _report(self, g: Group, rows: list) -> None:
        if not rows:
            return
        found = [dataclasses.replace(EngineViolation.from_row(v, group=g.index, group_type=g.kind, layers=g.layers,
                                                              shift=0), step=self.steps) for v in rows]
        self.found.extend(found)
        new = self.policy.new(found)
        self.policy.apply(new, cancel=self._cancel)

    def _cancel(self, rid, found: list) -> None:
        """Charge one block to ``rid`` in this step's load errors: vLLM then fails it alone."""
        if rid in self.cancelled:
            self._load_errors.add(self.cancelled[rid])
            return
        r = self.mirror.live.get(rid)
        block = None if r is None else _own_block(rid, r, self.mirror, found, self.groups[0].block_size)
        if block is None:
            self.cancel_unavailable += 1
            warn(f"kvcanary: request {rid!r}: cannot be cancelled through vLLM's failure path (no computed block "
                 f"of its own to report); its violations are logged")
            return
        self.cancelled[rid] = block
        self.cancel_count += 1
        self._load_errors.add(block)

    def _request_left(self, rid) -> None:
        """A request finished or was preempted: its incidents end; its row may be reused."""
        for g in self.groups:
            g.canary.monitor.end_request(rid)
        self.policy.forget_request(rid)
        self.cancelled.pop(rid, None)

    def stats(self) -> dict:
        """The connector's counters and each group's monitor stats."""
        per = {g.index: {"type": g.kind, "layers": g.layers, **g.canary.stats()} for g in self.groups}
        return {"steps": self.steps, "empty_steps": self.empty_steps, "violations": len(self.found),
                "cancelled": self.cancel_count, "cancel_unavailable": self.cancel_unavailable,
                "rows_unmatched": self.rows_unmatched, "preempted": self.preempted,
                "prefix_hits": self.mirror.prefix_hits, "chunked_prefills": self.mirror.chunked_prefills,
                "cpu_backend": self.cpu_backend, "host_seconds": self.host_seconds,
                "host_us_per_step": 1e6 * self.host_seconds / self.steps if self.steps else 0.0,
                "slots_checked": sum(p["slots_checked"] for p in per.values()),
                "slots_written": sum(p["slots_written"] for p in per.values()),
                "slots_read": sum(p["slots_read"] for p in per.values()), "groups": per}

    def close(self) -> None:
        """Report what the last step left on the device (its write's rows), then end every
        open incident, in every group even when the policy raises."""
        try:
            for g in self.groups:
                self._report(g, g.canary.drain())
        finally:
            for g in self.groups:
                g.canary.monitor.close()
            if self._previous_cpu_backend is not None:
                use_cpu_backend(self._previous_cpu_backend)
                self._previous_cpu_backend = None


class HostMetadata(typing.NamedTuple):
    """What the canary reads of a CPU engine's attention metadata, as NumPy views of its tensors."""

    block_table: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    slot_mapping: np.ndarray

    @classmethod
    def of(cls, md) -> "HostMetadata":
        return cls(*(host_view(getattr(md, f)) for f in cls._fields))


def _step_tokens(states) -> list:
    """The step's token ids, row after row: each row's ``scheduled`` tokens from ``computed``
    (-1 where the row could not be named: its tokens are then never stamped as another's)."""
    out = []
    for s in states:
        toks = s.initial_tokens[s.computed:s.computed + s.scheduled]
        out.extend(toks)
        if len(toks) < s.scheduled:
            out.extend([-1] * (s.scheduled - len(toks)))
    return out


def _own_block(rid, r, mirror, found: list, block_size: int):
    """A block among ``rid``'s computed blocks that no other live request holds (vLLM fails every
    request whose computed blocks include a reported block): the damaged block if it is its
    own alone, else its last computed block of its own; None if it has none."""
    blocks = r.blocks[0] if r.blocks else []
    computed = -(-r.computed // block_size)
    mine = blocks[:computed]
    if not mine:
        return None
    others = set()
    for other_id, o in mirror.live.items():
        if other_id != rid and o.blocks:
            others.update(o.blocks[0])
    for v in found:
        b = v.violation.slot // block_size
        if b in mine and b not in others:
            return b
    for b in reversed(mine):
        if b not in others:
            return b
    return None
