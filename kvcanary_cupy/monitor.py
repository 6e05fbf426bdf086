"""KvCanary: the per-step orchestration an engine integrates.

One monitor watches one KV pool (plus, optionally, its sliding-window pool). The
engine calls :meth:`KvCanary.before_forward` once its batch is planned, lets the
model write its K/V, calls :meth:`KvCanary.after_forward`, and now and then
:meth:`KvCanary.poll` to collect what the checks found, without stalling the
stream. Everything per step runs on the device; the host reads results one step
late through pinned copies.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import sys
import warnings
from typing import Callable, Sequence

import numpy as np

from . import arrays, ops, runtime, scalars
from ._sweep import SweepChain, SweepPlanner
from .canary import CanaryBuffer, RealKvSource
from .format import COUNTER_NAMES, LaunchTag, RealKvMode
from .plans import ExpectedTokens, FingerprintSampler, SwaWindow, VerifyPlan, WritePlan, check_token_offset
from .violations import Violation, ViolationLog

__all__ = ["KvCanary", "KvCanaryError", "KvCanaryWarning", "SwaGroup", "SweepChain"]

logger = logging.getLogger("kvcanary")


# Layout of a group's device scalars (one int64 array, so the host reads a group in one copy);
# overflows = plans - enabled.
_NUM_VALID, _ENABLE, _REQUESTED, _VP_ERRORS, _PLANS, _ENABLED, _MAX_REQUESTED, \
    _NUM_ROWS, _WP_ERRORS, _POSITION_CHECK = range(10)
_NUM_SCALARS = 10


def _tally_plan(sc, device: str, ptr) -> None:
    """plans += 1, enabled += enable, max_requested = max(max_requested, requested), on the
    device in stream order: one tiny launch that allocates nothing, so it can be captured."""
    if device == "cpu":
        sc[_PLANS] += 1
        sc[_ENABLED] += sc[_ENABLE]
        sc[_MAX_REQUESTED] = max(sc[_MAX_REQUESTED], sc[_REQUESTED])
        return
    with runtime.on_stream(device, ptr):
        _tally_kernel()(sc, size=1)


@functools.lru_cache(maxsize=1)
def _tally_kernel():
    import cupy  # noqa: PLC0415

    return cupy.ElementwiseKernel(
        "", "raw int64 s",
        f"s[{_PLANS}] += 1; s[{_ENABLED}] += s[{_ENABLE}];"
        f"if (s[{_REQUESTED}] > s[{_MAX_REQUESTED}]) s[{_MAX_REQUESTED}] = s[{_REQUESTED}];",
        "kvcanary_tally_plan")


class KvCanaryError(RuntimeError):
    """Raised by :meth:`KvCanary.poll` under ``policy="raise"``; ``.violations`` holds the rows."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        head = str(self.violations[0]) if self.violations else "no rows"
        more = f" (and {len(self.violations) - 1} more)" if len(self.violations) > 1 else ""
        super().__init__(f"{head}{more}")


class KvCanaryWarning(UserWarning):
    """Plan overflow or out-of-range plan input, reported by the monitor."""


@dataclasses.dataclass(frozen=True, eq=False)
class SwaGroup:
    """A sliding-window KV pool watched next to the full pool.

    Args:
        window: window length in tokens (>= 1): a step reads the last ``window``
            prefix positions of each request (and the record before them, whose
            link the window's first record continues).
        lut: int32 / int64 ``[num_full_slots]``, full-pool slot -> SWA-pool slot
            (negative: no SWA slot). Bound once; the engine mutates it in place.
        num_slots: slots of the SWA pool (its own canary buffer holds as many).
        real_kv: :class:`RealKvSource` s over the SWA pool's K/V (its own slot space).
        real_kv_mode: defaults to the monitor's mode.
        verify_capacity: like the monitor's, for this group.

    Example::

        >>> import numpy as np
        >>> g = SwaGroup(window=128, lut=np.full(4096, -1, np.int32), num_slots=1024)
        >>> g.window, g.num_slots
        (128, 1024)
    """

    window: int
    lut: object
    num_slots: int
    real_kv: Sequence[RealKvSource] = ()
    real_kv_mode: RealKvMode | None = None
    verify_capacity: int | str = "pool"


class _Group:
    """One canary buffer with the plans, sources and tags that go with it."""

    def __init__(self, name: str, *, num_slots: int, device: str, max_batch: int, capacity: int,
                 hard_capacity: int, swa: SwaWindow | None, sources, mode, sample_period, tags):
        self.name = name
        self.device = device
        self.canary = CanaryBuffer.allocate(num_slots=num_slots, device=device)
        self.sc = runtime.empty((_NUM_SCALARS,), np.int64, device, fill=0)
        self.sc[_POSITION_CHECK:_POSITION_CHECK + 1].fill(1)
        self.sc[_NUM_ROWS:_NUM_ROWS + 1].fill(-1)  # never planned, like WritePlan.allocate
        self.hard_capacity = hard_capacity
        self.vp = self._verify_plan(capacity, offsets=runtime.empty((max_batch + 1,), np.int64, device, fill=0))
        self.wp = WritePlan.from_buffers(
            offsets=runtime.empty((max_batch + 1,), np.int64, device, fill=0),
            seed_slots=runtime.empty((max_batch,), np.int64, device, fill=-1),
            num_rows=self.sc[_NUM_ROWS:_NUM_ROWS + 1], input_errors=self.sc[_WP_ERRORS:_WP_ERRORS + 1],
            position_check=self.sc[_POSITION_CHECK:_POSITION_CHECK + 1])
        self.swa = swa
        self.sources = tuple(sources)
        self.mode = mode
        self.sampler = FingerprintSampler.allocate(period=sample_period, device=device) if sample_period else None
        self.tag_verify, self.tag_write, self.tag_after = tags
        self.host_overflows = 0  # overflows seen and repaired at once (CPU)
        self.reported = {"overflows": 0, "input_errors": 0}

    def _verify_plan(self, capacity: int, offsets) -> VerifyPlan:
        e = {f: runtime.empty((capacity,), np.int64, self.device, fill=-1) for f in VerifyPlan.ENTRY_FIELDS}
        s = self.sc
        return VerifyPlan.from_buffers(**e, offsets=offsets, num_valid=s[_NUM_VALID:_NUM_VALID + 1],
                                       enable=s[_ENABLE:_ENABLE + 1], requested=s[_REQUESTED:_REQUESTED + 1],
                                       input_errors=s[_VP_ERRORS:_VP_ERRORS + 1])

    def grow(self, requested: int) -> int:
        """Reallocate the entry arrays for at least ``requested`` entries; returns the new capacity."""
        # Double past the request so a growing batch does not overflow again on the next step.
        new = max(2 * int(requested), 2 * self.vp.capacity, 1)
        if self.hard_capacity:
            new = min(new, max(self.hard_capacity, int(requested)))
        self.vp = self._verify_plan(new, offsets=self.vp.offsets)
        return new

    @staticmethod
    def counts(sc: np.ndarray) -> dict:
        return {"overflows": int(sc[_PLANS] - sc[_ENABLED]), "input_errors": int(sc[_VP_ERRORS]),
                "max_requested": int(sc[_MAX_REQUESTED]), "plans": int(sc[_PLANS])}


def _capacity_rule(spec, *, max_batch: int, width: int, num_slots: int, window: int | None,
                   name: str) -> tuple[int, int]:
    """(capacity, hard bound) of a verify plan; see :class:`KvCanary` ("Verify capacity")."""
    per_row = min(width, window) if window else width
    hard = max_batch * per_row
    if spec == "max":
        return max(hard, 1), hard
    if spec == "pool":
        return max(min(hard, num_slots), 1), hard
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool) and int(spec) >= 1:
        return int(spec), hard
    raise ValueError(f"kvcanary: {name}: expected a positive int, 'pool' or 'max', got {spec!r}")


class KvCanary:
    """Watches a paged KV pool: stamps what each step writes, checks what each step reads.

    Construction binds the pool's geometry once. The slot table (``req_to_token``
    or ``block_table``), the SWA LUT and the expected-token table are imported
    zero copy at construction and read in place every step: the engine keeps
    mutating its own arrays. The monitor owns the canary buffer(s), the verify
    and write plans and the violation log, all on ``device``.

    Args:
        num_slots: slots of the KV pool (the canary holds one record per slot;
            slot 0 is the padding slot and is never verified).
        req_to_token: int32 / int64 ``[num_requests, max_len]``, token-level slot
            table (SGLang): ``req_to_token[rp, pos]`` is the slot of position
            ``pos`` of request-table row ``rp``. Row 0 is the padding row.
        block_table: int32 / int64 ``[num_requests, max_pages]``, page-level table
            (vLLM), with ``page_size``: slot = ``block_table[rp, pos // page_size]
            * page_size + pos % page_size``. Pass exactly one of the two tables.
        page_size: slots per page of ``block_table``.
        max_batch: the most batch rows a step may have.
        device: ``"cpu"`` (NumPy reference backend) or ``"cuda"`` / ``"cuda:N"``.
        real_kv: :class:`RealKvSource` s over the pool's real K and V (a layer
            axis each, typically): their bytes are fingerprinted into the records.
        real_kv_mode: :class:`RealKvMode`; default PARTIAL (16 bytes per slot, layer
            and source) when sources are given, else NONE. ALL hashes
            ``read_bytes``; pair it with ``fingerprint_sample_period``.
        swa: :class:`SwaGroup`: also watch a sliding-window pool (its own canary).
        expected_tokens: int32 / int64 ``[num_requests, width]`` token ids each
            request must hold (-1: unknown), bound once, indexed like the slot
            table; turns on the token check. See ``before_forward``'s
            ``expected_valid_lens``.
        token_offset: the expected token of position ``pos`` is
            ``expected_tokens[rp, pos + token_offset]``: 0 for a target pool, +1
            for an EAGLE-style draft pool whose slot ``pos`` holds token ``pos + 1``.
        draft: tag this monitor's launches as a draft pool's (VERIFY_DRAFT, WRITE_DRAFT).
        verify_capacity: entries a verify plan holds: an int, ``"pool"`` (default)
            or ``"max"``. See "Verify capacity" below.
        grow_on_overflow: grow a plan that overflowed (never once a CUDA graph has
            captured it: the graph keeps the arrays it captured).
        verify_after: verify the prefix a second time after the write (tag
            VERIFY_AFTER): catches corruption during the forward in the same step.
        fingerprint_sample_period: check fingerprints of ``1/period`` of the
            verified slots per step (a rotating residue class; every slot and
            layer covered over ``period`` steps). Chain, position and token
            checks still cover every slot every step.
        ring_capacity: violation rows the device ring holds before it drops (and counts).
        policy: what :meth:`poll` does with violations: ``"log"`` (the
            ``kvcanary`` logger, error level), ``"raise"`` (:class:`KvCanaryError`)
            or a callable taking the list of :class:`Violation`.
        max_tokens: longest ``out_cache_loc`` expected (sizes the SWA translation
            scratch up front; it grows on demand outside graph capture).
        sweep_budget: records one :meth:`sweep` call verifies at most.
        sweep_max_chains: chains (pieces) one sweep call covers at most.
        history: steps whose request ids are kept for mapping late violation rows.

    Verify capacity: a step's verify entries are the prefix positions its active
    rows read, so they never exceed ``max_batch * per_row`` with ``per_row`` the
    table width in positions (for the SWA group: ``min(width, window)``). Without
    prefix sharing they also never exceed the slots of the pool, so ``"pool"``
    allocates ``min(max_batch * per_row, num_slots)`` (SWA: the SWA pool's slots).
    Requests that share a prefix each verify it, which can exceed that; such a
    step overflows: its verify is skipped, a :class:`KvCanaryWarning` is issued,
    ``stats()["overflows"]`` counts it and the plan grows (on the CPU at once, the
    same step; on CUDA at the next :meth:`poll`). ``"max"`` allocates the hard
    bound, which never overflows: use it under CUDA graphs.

    Example::

        >>> import numpy as np, kvcanary_cupy as kc
        >>> r2t = np.zeros((4, 16), np.int32); r2t[1, :3] = [5, 6, 7]
        >>> mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy="raise")
        >>> rows = dict(req_pool_indices=np.array([1]), prefix_lens=np.array([0]), extend_lens=np.array([3]))
        >>> mon.before_forward(**rows, request_ids=["a"])
        >>> mon.after_forward(np.array([11, 12, 13]), np.array([0, 1, 2]), r2t[1, :3])
        >>> mon.poll()
        []
        >>> r2t[1, 3] = 8
        >>> mon.before_forward(np.array([1]), np.array([3]), np.array([1]), request_ids=["a"])
        >>> mon.after_forward(np.array([14]), np.array([3]), r2t[1, 3:4])
        >>> mon.stats()["steps"], mon.poll()
        (2, [])
    """

    def __init__(self, *, num_slots: int, req_to_token=None, block_table=None, page_size: int | None = None,
                 max_batch: int, device: str = "cpu", real_kv: Sequence[RealKvSource] | RealKvSource = (),
                 real_kv_mode: RealKvMode | None = None, swa: SwaGroup | None = None, expected_tokens=None,
                 token_offset: int | None = None, draft: bool = False, verify_capacity: int | str = "pool",
                 grow_on_overflow: bool = True, verify_after: bool = False,
                 fingerprint_sample_period: int | None = None, ring_capacity: int = 4096,
                 policy: str | Callable = "log", max_tokens: int | None = None, sweep_budget: int = 1024,
                 sweep_max_chains: int = 64, history: int = 256):
        self.policy = self._check_policy(policy)
        kind, _ = runtime.parse_device(device)
        self.device = "cpu" if kind == "cpu" else runtime.device_of(runtime.empty((1,), np.int64, device))
        self.xp = runtime.array_module(self.device)
        self.max_batch = scalars.check_int(max_batch, "max_batch", minimum=1)
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

        # --- the slot table, bound once -------------------------------------
        self._table_kw, table, self.page_size = ops.slot_table(req_to_token, block_table, page_size)
        self.table = arrays.as_index_array(table, self._table_kw, ndim=2, device=self.device)
        self._torch_inputs = runtime.is_torch(table)
        width = min(int(self.table.shape[1]) * self.page_size, (1 << 63) - 1)

        # --- expected tokens --------------------------------------------------
        self.token_offset = check_token_offset(token_offset if token_offset is not None else (1 if draft else 0),
                                               "token_offset")
        self._valid_lens = runtime.empty((self.max_batch,), np.int64, self.device, fill=0)
        self.expected_table = None
        self._expected = None
        if expected_tokens is not None:
            self.expected_table = arrays.as_index_array(expected_tokens, "expected_tokens", ndim=2, device=self.device)
            self._expected = ExpectedTokens(self.expected_table, self._valid_lens, self.token_offset)

        # --- groups -----------------------------------------------------------
        srcs = ops.source_tuple(real_kv)
        mode = ops.real_kv_mode_of(real_kv_mode) if real_kv_mode is not None else (
            RealKvMode.PARTIAL if srcs else RealKvMode.NONE)
        self.grow_on_overflow = scalars.check_flag(grow_on_overflow, "grow_on_overflow")
        self.verify_after = scalars.check_flag(verify_after, "verify_after")
        cap, hard = _capacity_rule(verify_capacity, max_batch=self.max_batch, width=width, num_slots=num_slots,
                                   window=None, name="verify_capacity")
        tags = ((LaunchTag.VERIFY_DRAFT, LaunchTag.WRITE_DRAFT, LaunchTag.VERIFY_AFTER) if draft else
                (LaunchTag.VERIFY, LaunchTag.WRITE, LaunchTag.VERIFY_AFTER))
        self.main = _Group("main", num_slots=num_slots, device=self.device, max_batch=self.max_batch,
                           capacity=cap, hard_capacity=hard, swa=None, sources=srcs, mode=mode,
                           sample_period=fingerprint_sample_period, tags=tags)
        self.swa = None
        if swa is not None:
            if not isinstance(swa, SwaGroup):
                raise TypeError(f"kvcanary: swa: expected a SwaGroup, got {type(swa).__name__}")
            window = SwaWindow(scalars.check_int(swa.window, "swa.window", minimum=1),
                               arrays.as_index_array(swa.lut, "swa.lut", device=self.device))
            swa_slots = scalars.check_int(swa.num_slots, "swa.num_slots", minimum=1)
            ssrcs = ops.source_tuple(swa.real_kv, "swa.real_kv")
            smode = ops.real_kv_mode_of(swa.real_kv_mode, "swa.real_kv_mode") if swa.real_kv_mode is not None else (
                mode if ssrcs else RealKvMode.NONE)
            scap, shard = _capacity_rule(swa.verify_capacity, max_batch=self.max_batch, width=width,
                                         num_slots=swa_slots, window=window.size, name="swa.verify_capacity")
            self.swa = _Group("swa", num_slots=swa_slots, device=self.device, max_batch=self.max_batch,
                              capacity=scap, hard_capacity=shard, swa=window, sources=ssrcs, mode=smode,
                              sample_period=fingerprint_sample_period,
                              tags=(LaunchTag.VERIFY_SWA, LaunchTag.WRITE_SWA, LaunchTag.VERIFY_SWA))
        self.groups = [g for g in (self.main, self.swa) if g is not None]
        for g in self.groups:  # misuse shows here, not in the first step
            ops.check_sources(g.sources, g.mode, self.device, g.canary.num_slots)

        self.log = ViolationLog.allocate(capacity=ring_capacity, device=self.device)

        # --- per-step state ---------------------------------------------------
        self._bound: dict = {}
        self._bound_slices: dict = {}  # (name, n) -> the bound view's first n rows, made once
        self._swa_scratch = None
        self._hold_old: list = []  # per-call imports kept alive until their work is done (see _hold)
        self._hold_new: list = []
        self._retired: collections.deque = collections.deque()  # (event, arrays) replaced by rebind()
        if self.swa is not None and max_tokens:
            self._swa_buffers(max_tokens)
        self._sweep = SweepPlanner(budget=sweep_budget, max_chains=sweep_max_chains, device=self.device)
        self._sweeps = 0
        self._sweep_entries = 0
        self._steps = 0
        self._violations = 0
        self._step_open = None  # (seq, stream ptr, tokens checked) between before_ and after_forward
        self._aborted = 0

        # Which launch wrote a ring row: every step and sweep gets a sequence number and, on the
        # device, a snapshot of the log head as it starts (_heads[seq % history]); the row at ring
        # index i belongs to the newest sequence whose snapshot is <= i. Tags stay plain LaunchTags,
        # so launches (and their cached kernel arguments) are the same every step.
        self._history = history
        self._seq = 0
        self._min_seq = 1  # snapshots before this were invalidated by a log clear
        self._heads = runtime.empty((self._history,), np.int64, self.device, fill=0)
        self._ids: collections.OrderedDict = collections.OrderedDict()  # seq -> request id per batch row
        self._rows_seen = 0  # ring rows poll() has returned (their ring indices are consecutive)
        self._staged_seq = 0
        # Graph replays run no Python: captured sequences map through the ids note_step() records.
        self._captured = False
        self._captured_seqs: set = set()
        self._replays = 0
        self._replay_ids: collections.OrderedDict = collections.OrderedDict()
        self._staged_replay = 0
        # One pinned copy per poll: every group's scalars, the head snapshots, the log's counters.
        self._reader = runtime.HostReader(self.device, [g.sc for g in self.groups]
                                           + [self._heads, self.log.counter_array])
        self._writes_skipped_seen = 0

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _check_policy(policy):
        if policy in ("log", "raise") or callable(policy):
            return policy
        raise ValueError(f"kvcanary: policy: expected 'log', 'raise' or a callable, got {policy!r}")

    @property
    def canary(self) -> CanaryBuffer:
        """The full pool's canary buffer."""
        return self.main.canary

    @property
    def swa_canary(self) -> CanaryBuffer | None:
        return self.swa.canary if self.swa is not None else None

    @property
    def verify_plan(self) -> VerifyPlan:
        return self.main.vp

    @property
    def write_plan(self) -> WritePlan:
        return self.main.wp

    def bind_inputs(self, *, req_pool_indices=None, prefix_lens=None, extend_lens=None, input_ids=None,
                    positions=None, out_cache_loc=None, swa_out_cache_loc=None, expected_valid_lens=None) -> None:
        """Import the engine's persistent per-step input buffers once.

        A step may then omit those arguments: :meth:`before_forward` and
        :meth:`after_forward` use the bound views (sliced to ``batch_size`` /
        ``num_tokens`` when given), so a step pays no DLPack import. The engine
        refills the buffers in place; padding rows must have request row 0.

        Args:
            req_pool_indices, prefix_lens, extend_lens, expected_valid_lens:
                int32 / int64 ``[max_batch]``-long (or longer) buffers.
            input_ids, positions, out_cache_loc, swa_out_cache_loc: int32 / int64
                ``[max_tokens]`` buffers.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=np.zeros((4, 16), np.int32), max_batch=2)
            >>> rpi, pre, ext = np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64)
            >>> mon.bind_inputs(req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext)
            >>> mon.before_forward(batch_size=2)
        """
        given = dict(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                     input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                     swa_out_cache_loc=swa_out_cache_loc, expected_valid_lens=expected_valid_lens)
        for name, obj in given.items():
            if obj is None:
                continue
            self._bound[name] = arrays.as_index_array(obj, name, device=self.device)
            self._bound_slices.clear()
            if runtime.is_torch(obj):
                self._torch_inputs = True
        if self.swa is not None and "out_cache_loc" in self._bound:
            self._swa_buffers(int(self._bound["out_cache_loc"].shape[0]))

    def rebind(self, *, req_to_token=None, block_table=None, expected_tokens=None, swa_lut=None, real_kv=None,
               swa_real_kv=None) -> None:
        """Point the monitor at new arrays of the same geometry.

        For frameworks whose arrays are immutable (JAX): each functional update of a
        table or a KV pool makes a new array, so hand the new ones over before the
        step that reads them (one zero-copy import each). Shapes must match the
        arrays bound at construction; the canary and plans are kept.

        Args:
            req_to_token / block_table: the slot table (whichever kind was bound).
            expected_tokens: the expected-token table (one must have been bound).
            swa_lut: the SWA group's LUT.
            real_kv, swa_real_kv: :class:`RealKvSource` s replacing the sources.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=np.zeros((4, 16), np.int32), max_batch=1)
            >>> mon.rebind(req_to_token=np.ones((4, 16), np.int32))
            >>> int(mon.table[0, 0])
            1
        """
        if self._captured:
            raise ValueError("kvcanary: rebind: a CUDA graph captured this monitor's launches with the old arrays; "
                             "refill those arrays in place instead")
        if self.device != "cpu":  # queued work may still read the old arrays
            self._retire((self.table, self.expected_table, self.main.sources,
                          self.swa and (self.swa.swa, self.swa.sources)))

        def same(obj, name, like):
            a = arrays.as_index_array(obj, name, ndim=like.ndim, device=self.device)
            if tuple(a.shape) != tuple(like.shape):
                raise ValueError(f"kvcanary: {name}: expected shape {tuple(like.shape)} like the array bound at "
                                 f"construction, got {tuple(a.shape)}")
            return a

        other = "block_table" if self._table_kw == "req_to_token" else "req_to_token"
        if (req_to_token if other == "req_to_token" else block_table) is not None:
            raise ValueError(f"kvcanary: {other}: this monitor was bound to a {self._table_kw}; rebind that instead")
        table = req_to_token if self._table_kw == "req_to_token" else block_table
        if table is not None:
            self.table = same(table, self._table_kw, self.table)
        if expected_tokens is not None:
            if self.expected_table is None:
                raise ValueError("kvcanary: expected_tokens: no expected-token table was bound at construction")
            self.expected_table = same(expected_tokens, "expected_tokens", self.expected_table)
            self._expected = ExpectedTokens(self.expected_table, self._valid_lens, self.token_offset)
        if (swa_lut is not None or swa_real_kv is not None) and self.swa is None:
            raise ValueError("kvcanary: swa_lut: this monitor has no SWA group")
        if swa_lut is not None:
            lut = same(swa_lut, "swa_lut", self.swa.swa.lut)
            if lut.dtype != self.swa.swa.lut.dtype:
                self._swa_scratch = None
            self.swa.swa = SwaWindow(self.swa.swa.size, lut)
            if self._swa_scratch is None and "out_cache_loc" in self._bound:
                self._swa_buffers(int(self._bound["out_cache_loc"].shape[0]))
        for g, srcs in ((self.main, real_kv), (self.swa, swa_real_kv)):
            if srcs is None:
                continue
            srcs = ops.source_tuple(srcs, "real_kv" if g is self.main else "swa_real_kv")
            ops.check_sources(srcs, g.mode, self.device, g.canary.num_slots)
            g.sources = srcs

    def _arg(self, obj, name: str, n: int | None, min_len: int | None = None):
        """The step's array ``name``: ``obj`` imported, or the bound buffer; its first ``n``
        elements when ``n`` is given (a buffer shorter than ``n`` is an error, never a
        silently shorter step)."""
        if obj is None:
            a = self._bound.get(name)
            if a is None:
                raise ValueError(f"kvcanary: {name}: expected an array (or one bound with bind_inputs()), got None")
            if n is None:
                return a
            # The same slice object every step, so ops sees the same arrays and skips re-validation.
            key = (name, n)
            v = self._bound_slices.get(key)
            if v is None:
                self._check_len(a, name, n, "the buffer bound with bind_inputs() holds")
                v = self._bound_slices[key] = a[:n]
            return v
        a = arrays.as_index_array(obj, name, device=self.device, min_len=min_len)
        if self.device != "cpu":
            self._hold(a)
        if n is None:
            return a
        self._check_len(a, name, n, "the array holds")
        return a[:n]

    @staticmethod
    def _check_len(a, name: str, n: int, what: str) -> None:
        if int(a.shape[0]) < n:
            raise ValueError(f"kvcanary: {name}: the step needs {n} elements, but {what} {int(a.shape[0])}")

    def _hold(self, view) -> None:
        """Keep a per-call import (and so the producer's buffer) alive until the work that reads it is
        known done: a producer whose allocator is not ordered with our stream (JAX) could otherwise
        reuse the memory under a queued kernel. Released two polls later (see :meth:`poll`)."""
        self._hold_new.append(view)
        if len(self._hold_new) > 1024:  # nobody polls: settle once rather than grow without bound
            runtime.synchronize(self.device)
            self._hold_new.clear()
            self._hold_old = []

    def _retire(self, old) -> None:
        """Keep arrays replaced by :meth:`rebind` alive until the work queued before the rebind is
        done, and no longer: an event marks that point, and at most two generations wait (a JAX
        engine rebinds a new KV pool every step, so holding them until a poll could keep many
        pools alive)."""
        self._retired.append((runtime.mark(self.device, self._stream(None)), old))
        while len(self._retired) > 2:
            runtime.wait(self._retired.popleft()[0])

    def _stream(self, stream, objs=()):
        if self.device == "cpu":
            return None
        if stream is None and self._torch_inputs and "torch" in sys.modules:
            return int(sys.modules["torch"].cuda.current_stream().cuda_stream)
        return runtime.resolve_stream(stream, objs)

    # ------------------------------------------------------------------ warm-up
    def set_position_check(self, on: bool, stream=None) -> None:
        """Turn write's chain-position check on or off (a device write; captured graphs see it).

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> mon = kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1)
            >>> mon.set_position_check(False)
            >>> int(mon.write_plan.position_check[0])
            0
        """
        with runtime.on_stream(self.device, self._stream(stream)):
            for g in self.groups:
                g.wp.set_position_check(on)

    @contextlib.contextmanager
    def warmup(self, stream=None):
        """Warm up (and capture) with checks that fire on dummy data switched off.

        Inside the block the write's chain-position check is off; on exit
        :meth:`end_warmup` discards what warm-up data produced and switches it on.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=np.arange(64, dtype=np.int32).reshape(4, 16), max_batch=1)
            >>> with mon.warmup():
            ...     mon.before_forward(np.array([2]), np.array([3]), np.array([1]))  # unstamped: would fire
            ...     mon.after_forward(np.array([1]), np.array([9]), np.array([35]))
            >>> mon.poll(), mon.stats()["steps"]
            ([], 0)
        """
        self.set_position_check(False, stream)
        try:
            yield self
        finally:
            self.end_warmup(stream)

    def end_warmup(self, stream=None) -> None:
        """Discard warm-up results (violations, input errors, overflow counts, step count)
        and switch the position check on. Synchronizes: call it outside the hot path."""
        ptr = self._stream(stream)
        runtime.synchronize(self.device, ptr)
        self.log.clear(stream=ptr)
        with runtime.on_stream(self.device, ptr):
            for g in self.groups:
                for i in (_VP_ERRORS, _PLANS, _ENABLED, _MAX_REQUESTED, _WP_ERRORS):
                    g.sc[i:i + 1].fill(0)
                g.host_overflows = 0
                g.reported = {"overflows": 0, "input_errors": 0}
            self._heads.fill(0)  # the ring restarts at 0: older snapshots mean nothing now
        self.set_position_check(True, stream)
        runtime.synchronize(self.device, ptr)
        self._reader.reset()
        self._rows_seen = 0
        self._min_seq = self._seq + 1
        self._staged_seq = self._seq
        self._steps = 0
        self._replays = 0
        self._staged_replay = 0

    # ------------------------------------------------------------------ per step
    def before_forward(self, req_pool_indices=None, prefix_lens=None, extend_lens=None, *, batch_size=None,
                       expected_valid_lens=None, expected: ExpectedTokens | None = None, request_ids=None,
                       stream=None) -> None:
        """Plan the step and verify every record it will read.

        Args:
            req_pool_indices: int32 / int64 ``[bs]``, each batch row's slot-table
                row (0: padding row, no work). ``None``: the bound buffer.
            prefix_lens: int32 / int64 ``[bs]``, tokens already in the cache per row.
            extend_lens: int32 / int64 ``[bs]``, tokens this step writes per row.
            batch_size: slice bound buffers to their first ``batch_size`` rows.
            expected_valid_lens: int32 / int64 ``[bs]``, per row: tokens of the
                expected-token table that are known (positions ``pos`` with
                ``pos + token_offset`` below it are checked). Default
                ``prefix_lens + extend_lens``.
            expected: an :class:`ExpectedTokens` for this step only (overrides the
                bound table).
            request_ids: a sequence of ``bs`` ids (any objects): violations of
                row ``r`` report ``request_ids[r]``, even when found steps later.
            stream: CUDA stream (default: PyTorch's current stream for PyTorch
                inputs, else CuPy's). Inside a CUDA graph capture pass the
                capturing stream (e.g. ``torch.cuda.current_stream()``).

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> r2t = np.arange(64, dtype=np.int32).reshape(4, 16)  # row r, position p -> slot 16 r + p
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy=lambda found: None)
            >>> mon.before_forward(np.array([1, 2]), np.array([0, 0]), np.array([2, 1]), request_ids=["a", "b"])
            >>> mon.after_forward(np.array([7, 8, 9]), np.array([0, 1, 0]), np.array([16, 17, 32]))
            >>> mon.before_forward(np.array([1, 2]), np.array([2, 1]), np.array([1, 1]), request_ids=["a", "b"])
            >>> mon.verify_plan.host_entries()["slot_indices"].tolist()  # a's prefix, then b's
            [16, 17, 32]
        """
        if self._step_open is not None:
            raise ValueError("kvcanary: before_forward: the previous step is still open; call after_forward() "
                             "after the forward (or abort_step() if the forward failed) before planning the next")
        objs = (req_pool_indices, prefix_lens, extend_lens)
        if batch_size is not None:
            batch_size = scalars.check_int(batch_size, "batch_size", minimum=0)
        rpi = self._arg(req_pool_indices, "req_pool_indices", batch_size)
        bs = int(rpi.shape[0])
        pre = self._arg(prefix_lens, "prefix_lens", bs, min_len=bs)
        ext = self._arg(extend_lens, "extend_lens", bs, min_len=bs)
        if bs > self.max_batch:
            raise ValueError(f"kvcanary: req_pool_indices: a batch of {bs} rows exceeds max_batch = {self.max_batch}")
        if request_ids is not None and len(request_ids) != bs:
            raise ValueError(f"kvcanary: request_ids: expected one id per batch row ({bs}), got {len(request_ids)}")
        ptr = self._stream(stream, objs)
        capturing = runtime.is_capturing(self.device, ptr)
        seq = self._next_seq(ptr)
        if capturing:
            self._captured = True
            self._captured_seqs.add(seq)
        self._remember(self._ids, seq, request_ids)

        exp = expected
        if exp is None and self._expected is not None:
            exp = self._expected
            with runtime.on_stream(self.device, ptr):
                if expected_valid_lens is not None or "expected_valid_lens" in self._bound:
                    vl = self._arg(expected_valid_lens, "expected_valid_lens", bs, min_len=bs)
                    self.xp.copyto(self._valid_lens[:bs], vl, casting="same_kind")
                else:
                    self.xp.add(pre, ext, out=self._valid_lens[:bs])
        kw = {self._table_kw: self.table}
        if self._table_kw == "block_table":
            kw["page_size"] = self.page_size
        for g in self.groups:
            self._plan(g, rpi, pre, ext, kw, exp, ptr, capturing)
            ops.verify(g.canary, g.vp, log=self.log, tag=g.tag_verify, real_kv=g.sources,
                       real_kv_mode=g.mode, check_tokens=exp is not None, sample=g.sampler, stream=ptr)
        if not capturing:
            self._steps += 1
        self._step_open = (seq, ptr, exp is not None)

    def abort_step(self) -> None:
        """Close a step whose forward failed: nothing is stamped, ``stats()["aborted_steps"]``
        counts it, and the next :meth:`before_forward` may follow. The records the step did
        not stamp are unverified, not wrong: the engine must not read the tokens it failed
        to write (its own rollback), or the next verify reports them.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=np.arange(64, dtype=np.int32).reshape(4, 16),
            ...                   max_batch=1)
            >>> mon.before_forward(np.array([1]), np.array([0]), np.array([2]))
            >>> mon.abort_step()  # the model raised; the step's tokens were never written
            >>> mon.stats()["aborted_steps"]
            1
        """
        if self._step_open is None:
            raise ValueError("kvcanary: abort_step: no step is open (before_forward() opens one)")
        self._step_open = None
        self._aborted += 1

    def _plan(self, g: _Group, rpi, pre, ext, kw, exp, ptr, capturing) -> None:
        args = dict(req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, swa=g.swa, expected=exp, stream=ptr, **kw)
        ops.plan(g.vp, g.wp, **args)
        if self.device == "cpu" and self.grow_on_overflow and int(g.sc[_REQUESTED]) > g.vp.capacity:
            # Reading the plan is free on the CPU: report, grow and re-plan this very step.
            req, cap = int(g.sc[_REQUESTED]), g.vp.capacity
            g.host_overflows += 1
            new = g.grow(req)
            errors = int(g.sc[_VP_ERRORS])
            ops.plan(g.vp, None, **args)
            g.sc[_VP_ERRORS] = errors  # the first plan already counted this step's bad rows
            self._warn(f"kvcanary: verify plan of group '{g.name}' overflowed: a step asked for {req} entries, "
                       f"capacity {cap}; grown to {new} and planned again")
        _tally_plan(g.sc, self.device, ptr)

    def after_forward(self, input_ids=None, positions=None, out_cache_loc=None, *, num_tokens=None,
                      swa_out_cache_loc=None, expected_input_ids=None, expected_positions=None, stream=None) -> None:
        """Stamp the records of the tokens the step wrote, after the model wrote their K/V.

        Args:
            input_ids: int32 / int64 ``[num_tokens]``, the step's token ids, batch
                rows back to back (for a draft pool: the tokens its slots hold,
                i.e. shifted by ``token_offset``).
            positions: int32 / int64 ``[num_tokens]``, their positions.
            out_cache_loc: int32 / int64 ``[num_tokens]``, the full-pool slots the
                model wrote (negative: skipped).
            num_tokens: slice bound buffers to their first ``num_tokens`` elements.
            swa_out_cache_loc: int32 / int64 ``[num_tokens]``, the SWA-pool slots;
                default: ``out_cache_loc`` translated through the SWA LUT.
            expected_input_ids, expected_positions: optional int ``[num_tokens]``
                (-1: unchecked): what each token and position must be
                (WRITE_TOKEN / WRITE_POSITION violations).
            stream: CUDA stream, as for :meth:`before_forward`.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> r2t = np.arange(64, dtype=np.int32).reshape(4, 16)  # row r, position p -> slot 16 r + p
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy=lambda found: None)
            >>> mon.before_forward(np.array([1]), np.array([0]), np.array([2]))
            >>> mon.after_forward(np.array([7, 8]), np.array([0, 1]), np.array([16, 17]))
            >>> mon.canary.records[16:18, :2].tolist()  # (token, position) per slot
            [[7, 0], [8, 1]]
        """
        if self._step_open is None:
            raise ValueError("kvcanary: after_forward: expected a preceding before_forward() for this step")
        seq, ptr0, checked_tokens = self._step_open
        if num_tokens is not None:
            num_tokens = scalars.check_int(num_tokens, "num_tokens", minimum=0)
        # Every argument of every group is imported and checked before the first launch, so a
        # misuse raises with no record changed (the step stays open: fix the call and repeat it).
        objs = (input_ids, positions, out_cache_loc)
        ids = self._arg(input_ids, "input_ids", num_tokens)
        pos = self._arg(positions, "positions", num_tokens)
        loc = self._arg(out_cache_loc, "out_cache_loc", num_tokens)
        ptr = self._stream(stream, objs) if stream is not None or any(o is not None for o in objs) else ptr0
        exp_in = None
        if expected_input_ids is not None or expected_positions is not None:
            exp_in = (None if expected_input_ids is None else self._arg(expected_input_ids, "expected_input_ids", None),
                      None if expected_positions is None else self._arg(expected_positions, "expected_positions", None))
        locs = [self._swa_loc(loc, swa_out_cache_loc, ptr) if g is self.swa else loc for g in self.groups]
        self._step_open = None
        for g, gloc in zip(self.groups, locs):
            ops.write(g.canary, g.wp, input_ids=ids, positions=pos, out_cache_loc=gloc, log=self.log,
                      tag=g.tag_write, real_kv=g.sources, real_kv_mode=g.mode,
                      expected_inputs=exp_in, stream=ptr)
        if self.verify_after:
            for g in self.groups:
                ops.verify(g.canary, g.vp, log=self.log, tag=g.tag_after, real_kv=g.sources,
                           real_kv_mode=g.mode, check_tokens=checked_tokens, sample=g.sampler, stream=ptr)

    # ------------------------------------------------------------------ SWA translation
    def _swa_buffers(self, n: int) -> None:
        lut = self.swa.swa.lut
        have = self._swa_scratch
        if have is not None and have[0].shape[0] >= n:
            return
        n = max(n, 1)
        if have is not None and self.device != "cpu":
            self._hold(have)
        self._swa_scratch = (runtime.empty((n,), np.int64, self.device), runtime.empty((n,), lut.dtype, self.device),
                             runtime.empty((n,), np.bool_, self.device), runtime.empty((n,), np.bool_, self.device),
                             runtime.empty((1,), lut.dtype, self.device, fill=-1))

    def _swa_loc(self, loc, given, ptr):
        if given is not None or "swa_out_cache_loc" in self._bound:
            return self._arg(given, "swa_out_cache_loc", int(loc.shape[0]))
        n = int(loc.shape[0])
        if self._swa_scratch is None or self._swa_scratch[0].shape[0] < n:
            if runtime.is_capturing(self.device, ptr):
                raise ValueError(f"kvcanary: out_cache_loc: {n} tokens exceed the SWA translation scratch during a "
                                 "graph capture; pass max_tokens= or bind_inputs(out_cache_loc=...) before capturing")
            self._swa_buffers(n)
        idx, dst, m1, m2, neg = self._swa_scratch
        idx, dst, m1, m2 = idx[:n], dst[:n], m1[:n], m2[:n]
        lut = self.swa.swa.lut
        xp = self.xp
        with runtime.on_stream(self.device, ptr):
            # Negative or out-of-LUT slots have no SWA slot: -1 (skipped), like a negative LUT value.
            xp.clip(loc, 0, max(int(lut.shape[0]) - 1, 0), out=idx)
            xp.take(lut, idx, out=dst)
            xp.less(loc, 0, out=m1)
            xp.greater_equal(loc, int(lut.shape[0]), out=m2)
            xp.logical_or(m1, m2, out=m1)
            xp.copyto(dst, neg, where=m1)
        return dst

    # ------------------------------------------------------------------ graphs
    def note_step(self, request_ids=None) -> None:
        """Count one replay of a captured step and name its batch rows.

        A replayed graph runs the launches :meth:`before_forward` and
        :meth:`after_forward` recorded, but no Python: call this once per replay
        so ``stats()["steps"]`` counts it and violations of the replay map to
        ``request_ids``. Poll once per replay for an exact mapping.

        Example (a replay loop; ``graph`` captured one step)::

            for batch in batches:
                refill_inputs_in_place(batch)
                graph.replay()
                mon.note_step(request_ids=batch.ids)
                handle(mon.poll(stream=torch.cuda.current_stream()))
        """
        self._steps += 1
        self._replays += 1
        self._remember(self._replay_ids, self._replays, request_ids)

    # ------------------------------------------------------------------ sweep
    def sweep(self, chains: Sequence, *, group: str = "main", stream=None) -> int:
        """Verify the next slice of idle cached sequences; returns the records planned.

        Args:
            chains: :class:`SweepChain` s (or tuples ``(slots, first_position,
                prev_slot[, tokens])``), in the group's slot space: e.g. one per
                radix-cache node no running request reads. Pass the current list
                every call; the monitor keeps a cursor into their concatenation
                and verifies at most ``sweep_budget`` records per call, resuming
                where the previous call stopped and wrapping around.
            group: ``"main"`` or ``"swa"`` (chains then hold SWA-pool slots).
            stream: CUDA stream.

        Violations carry tag SWEEP and name the chain's ``key`` as the request.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=np.zeros((2, 8), np.int32), max_batch=1)
            >>> mon.sweep([kc.SweepChain(np.array([3, 4]), 0, -1, key="node")])
            2
            >>> sorted({v.request for v in mon.poll()})  # slots 3, 4 were never stamped
            ['node']
        """
        g = {"main": self.main, "swa": self.swa}.get(group)
        if g is None:
            raise ValueError(f"kvcanary: group: expected 'main'{' or swa' if self.swa else ''}, got {group!r}")
        chains = [SweepChain.coerce(c, i) for i, c in enumerate(chains)]
        ptr = self._stream(stream, [c.slots for c in chains])
        if self.device != "cpu":
            self._hold(chains)
        n, keys = self._sweep.fill(chains, ptr)
        if n == 0:
            return 0
        self._remember(self._ids, self._next_seq(ptr), keys)
        ops.verify(g.canary, self._sweep.plan, log=self.log, tag=LaunchTag.SWEEP,
                   real_kv=g.sources, real_kv_mode=g.mode, check_tokens=True, stream=ptr)
        self._sweeps += 1
        self._sweep_entries += n
        return n

    # ------------------------------------------------------------------ results
    def poll(self, stream=None) -> list[Violation]:
        """The violations found since the previous poll, mapped to request ids, after the policy ran.

        Never stalls the stream: on CUDA it returns what the copy queued by the
        previous poll found (the rows of the step before) and queues the next copy.
        Plan overflows and out-of-range plan inputs found in the same copy are
        reported as :class:`KvCanaryWarning` s (and grow the plan, see the class
        docstring). Under ``policy="raise"`` a non-empty result raises instead.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> r2t = np.arange(64, dtype=np.int32).reshape(4, 16)  # row r, position p -> slot 16 r + p
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy=lambda found: None)
            >>> mon.before_forward(np.array([1]), np.array([0]), np.array([2]), request_ids=["a"])
            >>> mon.after_forward(np.array([7, 8]), np.array([0, 1]), np.array([16, 17]))
            >>> r2t[1, 1] = 40  # the table now sends position 1 to a slot nobody stamped
            >>> mon.before_forward(np.array([1]), np.array([2]), np.array([0]), request_ids=["a"])
            >>> [(v.request, v.slot, v.reasons.describe()) for v in mon.poll()]
            [('a', 40, 'chain+position')]
        """
        ptr = self._stream(stream)
        cpu = self.device == "cpu"
        # On CUDA the rows and scalars returned now were copied at the previous poll.
        upto_seq, replay_now = (self._seq, self._replays) if cpu else (self._staged_seq, self._staged_replay)
        found = self.log.poll(stream=ptr)
        scal = self._reader.poll(ptr)
        self._staged_seq, self._staged_replay = self._seq, self._replays
        # The copy the log just waited for was queued after everything held in _hold_old.
        self._hold_old, self._hold_new = self._hold_new, []
        out = []
        if scal is not None:
            self._report(scal[:-2], scal[-1], ptr)
            out = self._map_rows(found, scal[-2], upto_seq, replay_now)
        self._violations += len(out)
        if out:
            self._apply_policy(out)
        return out

    def _report(self, scal, counters, ptr) -> None:
        skipped = int(counters[COUNTER_NAMES.index("writes_skipped")])
        if skipped > self._writes_skipped_seen:
            self._warn(f"kvcanary: {skipped - self._writes_skipped_seen} write(s) stamped nothing because their "
                       "write plan was never planned (stats()['writes_skipped'])")
            self._writes_skipped_seen = skipped
        for g, sc in zip(self.groups, scal):
            c = _Group.counts(sc)
            if c["overflows"] > g.reported["overflows"]:
                cap = g.vp.capacity
                if not self.grow_on_overflow:
                    action = "not grown (grow_on_overflow=False)"
                elif self._captured:
                    action = "not grown: a CUDA graph captured the plan (use verify_capacity='max')"
                elif runtime.is_capturing(self.device, ptr) or c["max_requested"] <= cap:
                    action = "not grown now"
                else:
                    if self.device != "cpu":
                        self._hold(g.vp)  # the step in flight may still read the old entries
                    action = f"grown to {g.grow(c['max_requested'])}"
                self._warn(f"kvcanary: verify plan of group '{g.name}' overflowed in "
                           f"{c['overflows'] - g.reported['overflows']} step(s) (largest request "
                           f"{c['max_requested']} entries, capacity {cap}); those steps were not verified "
                           f"(stats()['verifies_skipped']); {action}")
                g.reported["overflows"] = c["overflows"]
            if c["input_errors"] > g.reported["input_errors"]:
                self._warn(f"kvcanary: {c['input_errors'] - g.reported['input_errors']} batch row(s) of group "
                           f"'{g.name}' had out-of-range plan input (request row, lengths or a table/LUT entry); "
                           "they were neither verified nor stamped")
                g.reported["input_errors"] = c["input_errors"]

    def _map_rows(self, found: list[Violation], heads: np.ndarray, upto_seq: int, replay_now: int) -> list:
        """Name each row's request: find the launch that wrote it from the head snapshots."""
        first = self._rows_seen
        self._rows_seen += len(found)
        if not found:
            return []
        seqs = [q for q in self._ids if (q >= self._min_seq or q in self._captured_seqs) and q <= upto_seq
                and upto_seq - q < self._history]
        starts = [int(heads[q % self._history]) for q in seqs]
        out = []
        for j, v in enumerate(found):
            i = first + j
            seq = None
            for q, h in zip(reversed(seqs), reversed(starts)):  # newest first; a poll holds a step or two
                if h <= i:
                    seq = q
                    break
            ids = self._replay_ids.get(replay_now) if seq in self._captured_seqs else self._ids.get(seq)
            req = ids[v.batch_row] if ids is not None and 0 <= v.batch_row < len(ids) else None
            out.append(dataclasses.replace(v, request=req))
        return out

    def _apply_policy(self, found: list[Violation]) -> None:
        if self.policy == "log":
            for v in found:
                logger.error("%s", v)
        elif self.policy == "raise":
            raise KvCanaryError(found)
        else:
            self.policy(found)

    def read(self) -> list[Violation]:
        """Every violation row the ring holds, mapped, without the policy (synchronizes)."""
        rows = self.log.read()
        heads = runtime.HostReader(self.device, [self._heads]).read_now()[0]
        seen, self._rows_seen = self._rows_seen, 0
        try:
            return self._map_rows(rows, heads, self._seq, self._replays)
        finally:
            self._rows_seen = seen

    def stats(self) -> dict:
        """Counters (synchronizes on CUDA).

        Returns a dict: ``steps`` (before_forward calls outside capture plus
        replays noted), ``aborted_steps`` (closed by :meth:`abort_step`),
        ``violations`` (returned by poll), ``logged`` (appended
        to the ring), ``dropped`` (past the ring), ``overflows`` and
        ``input_errors`` (all groups), the log's counters (``kernel_runs``,
        ``slots_checked``, ``slots_written``, ``verifies_skipped``,
        ``writes_skipped``, ``tokens_skipped``: see
        :meth:`ViolationLog.counters`), ``sweeps``, ``sweep_entries`` and
        per group ``groups[name]`` with ``capacity``, ``max_requested``,
        ``overflows``, ``input_errors``.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> r2t = np.arange(64, dtype=np.int32).reshape(4, 16)  # row r, position p -> slot 16 r + p
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy=lambda found: None)
            >>> mon.before_forward(np.array([1]), np.array([0]), np.array([3]))
            >>> mon.after_forward(np.array([7, 8, 9]), np.array([0, 1, 2]), np.array([16, 17, 18]))
            >>> s = mon.stats()
            >>> s["steps"], s["slots_written"], s["groups"]["main"]["capacity"]
            (1, 3, 32)
        """
        per = {}
        for g, sc in zip(self.groups, self._reader.read_now()):
            c = _Group.counts(sc)
            per[g.name] = {"capacity": g.vp.capacity, "max_requested": c["max_requested"],
                           "overflows": c["overflows"] + g.host_overflows, "input_errors": c["input_errors"]}
        out = {"steps": self._steps, "aborted_steps": self._aborted, "violations": self._violations,
               "logged": self.log.count,
               "dropped": self.log.dropped,
               "overflows": sum(p["overflows"] for p in per.values()),
               "input_errors": sum(p["input_errors"] for p in per.values()),
               **self.log.counters(), "sweeps": self._sweeps, "sweep_entries": self._sweep_entries, "groups": per}
        return out

    # ------------------------------------------------------------------ helpers
    def record_tokens(self, req_pool_indices, tokens, offsets, stream=None) -> None:
        """Write each request's token ids into the bound expected-token table, from position 0
        (:func:`kvcanary_cupy.scatter_expected_tokens`; the table must be writable).

        Args:
            req_pool_indices: int32 / int64 ``[n]``, the table rows to fill (0: skipped).
            tokens: int32 / int64 ``[offsets[n]]``, the rows' token ids back to back.
            offsets: int32 / int64 ``[n + 1]``, exclusive prefix sums into ``tokens``.
            stream: CUDA stream.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> exp = np.full((3, 4), -1, np.int64)
            >>> mon = kc.KvCanary(num_slots=16, req_to_token=np.zeros((3, 4), np.int32), max_batch=1,
            ...                   expected_tokens=exp)
            >>> mon.record_tokens(np.array([2]), np.array([5, 6, 7]), np.array([0, 3]))
            >>> exp[2].tolist()
            [5, 6, 7, -1]
        """
        if self.expected_table is None:
            raise ValueError("kvcanary: record_tokens: no expected_tokens table was bound at construction")
        ops.scatter_expected_tokens(self.expected_table, tokens=tokens, offsets=offsets,
                                    req_pool_indices=req_pool_indices,
                                    stream=self._stream(stream, (tokens, offsets, req_pool_indices)))

    def _remember(self, store: collections.OrderedDict, key, ids) -> None:
        store[key] = None if ids is None else list(ids)
        while len(store) > self._history:
            store.popitem(last=False)

    def _next_seq(self, ptr) -> int:
        """A new launch sequence number, with the log head it starts at recorded on the device."""
        self._seq += 1
        k = self._seq % self._history
        if self.device == "cpu":
            self._heads[k] = self.log.head[0]
        else:
            with runtime.on_stream(self.device, ptr):
                self._heads[k:k + 1] = self.log.head  # a device copy: captured graphs keep it per replay
        return self._seq

    @staticmethod
    def _warn(msg: str) -> None:
        logger.warning("%s", msg)
        warnings.warn(msg, KvCanaryWarning, stacklevel=3)
