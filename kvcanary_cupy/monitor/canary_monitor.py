"""KvCanary: the per-step orchestration an engine integrates.

The monitor's jobs live in the modules beside this one: :mod:`.options` (the
constructor's options, checked), :mod:`.parts` (the parts built from them),
:mod:`.group` (a watched pool: canary, plans, scalars, capacity), :mod:`.inputs`
(bound buffers, per-call imports, the stream), :mod:`.steps` (a step's op arguments,
prepared once per shape of step), :mod:`.requests` (which request a violation row
belongs to), :mod:`.swa` (SWA slot translation), :mod:`.lifetime` (keeping arrays
alive for queued work), :mod:`.policy` (violations, warnings, stats),
:mod:`.plan_counters` (what a poll does with the plans' counters), :mod:`.outputs`
(incidents, events, metrics), :mod:`.sweep` (idle cached chains) and :mod:`.threads`
(one thread at a time). :class:`KvCanary` runs the ops around the forward and hands
the rest to them. Given a ``process_group``, each step ends with the tensor-parallel
agreement of :mod:`kvcanary_cupy.distributed`, and records move with their KV through
:mod:`kvcanary_cupy.transfer`.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Sequence

import numpy as np

from .. import ops, runtime, transfer
from ..canary import CanaryBuffer, RealKvSource
from ..format import CTR_WRITES_SKIPPED, DEFAULT_CHAIN, LaunchTag, RealKvMode
from ..plans import ExpectedTokens, SwaWindow, VerifyPlan, WritePlan
from ..violations import Violation
from .group import SwaGroup
from .options import check_like, check_options
from .parts import build_parts
from .policy import apply_policy, group_stats, stats_dict
from .steps import AfterStep, BeforeStep
from .sweep import SweepChain
from .threads import CallGuard, guarded


class KvCanary:
    """Watches a paged KV pool: stamps what each step writes, checks what each step reads.

    Construction binds the pool's geometry once. The slot table (``req_to_token``
    or ``block_table``), the SWA LUT and the expected-token table are imported
    zero copy at construction and read in place every step: the engine keeps
    mutating its own arrays. The monitor owns the canary buffer(s), the verify
    and write plans and the violation log, all on ``device``.

    Args:
        num_slots: slots of the KV pool (the canary holds one record per slot;
            slot 0 is the padding slot: never stamped, and a live row that reads it
            is a RESERVED_SLOT violation).
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
        window: the pool itself is a sliding window's (e.g. a sliding-window layer
            group with a pool of its own): a step reads only the last ``window``
            prefix positions of each row, and the table entry before them names the
            record the window's first link continues (0 where the row has none: that
            link is then not checked). Table entries outside are never read (0 is
            fine); those inside must be slots of the pool (one that is not fails its
            row as an out-of-range plan input, counted and warned about). Not with
            ``swa``. See ``verify_after`` for a pool whose step overwrites its window.
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
            With ``window`` it verifies the window the step leaves instead,
            positions ``[P + E - window, P + E)`` of each row (the table must then
            map the positions the step writes too): in a pool that is a ring, the
            engine reads the window and then writes its new tokens over the oldest
            positions, so the prefix it read no longer exists after the step. That
            check plans again (its input errors and overflows are counted as the
            step's own are).
        fingerprint_sample_period: check fingerprints of ``1/period`` of the
            verified slots per step (a rotating residue class; every slot and
            layer covered over ``period`` steps). Chain, position and token
            checks still cover every slot every step.
        ring_capacity: violation rows the device ring holds before it drops (and counts).
        policy: what :meth:`poll` does with new incidents: ``"log"`` (the
            ``kvcanary`` logger, error level), ``"raise"`` (:class:`KvCanaryError`)
            or a callable taking the list. A damaged slot is found again at every step
            that reads it: the rows of one (request, group, slot, reasons) are folded
            into one :class:`~kvcanary_cupy.monitor.incidents.Incident` (first step,
            last step, rows), and the policy sees each incident once, when it opens
            (an incident reads like its first :class:`Violation`: ``.slot``,
            ``.request``, ``.reasons``, ``.batch_row``, ...). :meth:`poll` still
            returns every row. With a ``process_group`` the policy sees every row
            (ranks fold only their own rows, and must decide alike in every poll).
        events: where each new incident goes as one JSON object (and its end, as an
            ``incident_end`` event): a path (JSON lines appended, flushed per poll that
            has any) or a callable taking the event dict; None (default): nowhere.
            ``python -m kvcanary_cupy report PATH`` summarizes such a file.
        metrics: keep Prometheus counters (``kvcanary_violations_total`` and
            ``kvcanary_incidents_total`` by ``reason`` and ``group``, and the totals
            of slots checked and written, verifies and writes skipped, rows dropped
            and steps): True for prometheus_client's default registry, or a
            ``CollectorRegistry``; needs the ``metrics`` extra.
        incident_quiet_steps: steps without a row after which an incident ends, so
            a later row at its slot opens a new one (:meth:`end_request` ends a
            finished request's at once).
        name: a label for this monitor's groups in incidents, events and metrics
            (``"<name>.main"``), for a process that runs several monitors.
        max_tokens: longest ``out_cache_loc`` expected (sizes the SWA translation
            scratch up front; it grows on demand outside graph capture).
        sweep_budget: records one :meth:`sweep` call verifies at most.
        sweep_max_chains: chains (pieces) one sweep call covers at most.
        history: steps whose request ids are kept for mapping late violation rows.
        process_group: a ``torch.distributed`` process group of tensor-parallel ranks
            (NCCL on CUDA, gloo on the CPU; default None: no agreement). Every
            :meth:`after_forward` then ends with the ranks agreeing on what they
            planned and wrote (one small collective on the step's stream, see
            :mod:`kvcanary_cupy.distributed`): a rank that differs is named in a
            RANK_DIVERGENCE row on every rank, and :meth:`poll` fires on every rank
            in the same poll when any rank found violations. Every rank must run the
            same steps with the same configuration.
        chain: how records chain, ``"scan"`` (the default, format v2) or ``"sglang"``
            (v1, byte for byte SGLang's records): the kind of every canary buffer the
            monitor allocates (the full pool's and the SWA pool's); sweeps and record
            transfers follow it. See :class:`~kvcanary_cupy.CanaryBuffer`.
        stamp_before_forward: stamp a step's records in :meth:`before_forward`, beside
            its check, instead of in :meth:`after_forward`: for engines that set the
            step's token ids, positions and slots before the forward (pass them to
            ``before_forward`` or bind them) and keep no real-KV fingerprints (a record
            then holds nothing the forward writes). A step of at most
            ``ops.STEP_WRITE_TOKENS`` tokens is then one launch per group
            (:func:`~kvcanary_cupy.plan_verify_write`), and ``after_forward()`` only
            closes the step. Not with real-KV sources, ``verify_after`` or a
            ``process_group``.

    A step's pre-forward check is one :func:`~kvcanary_cupy.plan_and_verify` per group,
    which on CUDA does not write the verify plan's per-entry arrays
    (``verify_plan.slot_indices``, ...): only its scalars and offsets, and the write
    plan. With ``verify_after`` (which reads the entries again after the forward) the
    step runs :func:`~kvcanary_cupy.plan` and :func:`~kvcanary_cupy.verify` instead,
    which write them. With a ``process_group`` the fused launch also leaves the digest
    of the entries the ranks compare (``digest=``), so agreement needs no entries either.

    Verify capacity: a step's verify entries are the prefix positions its active
    rows read, so they never exceed ``max_batch * per_row`` with ``per_row`` the
    table width in positions (for a ``window`` and the SWA group: ``min(width, window)``). Without
    prefix sharing they also never exceed the slots of the pool, so ``"pool"``
    allocates ``min(max_batch * per_row, num_slots)`` (SWA: the SWA pool's slots).
    Requests that share a prefix each verify it, which can exceed that; such a
    step overflows: its verify is skipped, a :class:`KvCanaryWarning` is issued,
    ``stats()["overflows"]`` counts it and the plan grows (on the CPU at once, the
    same step; on CUDA at the next :meth:`poll`). ``"max"`` allocates the hard
    bound, which never overflows: use it under CUDA graphs.

    Threads: a monitor is not shared by threads that step it at the same time. A step
    (:meth:`before_forward` through :meth:`after_forward` or :meth:`abort_step`) belongs
    to the thread that opened it, and the monitor takes one call at a time: a call from
    another thread while a step is open, or while another thread is inside a call, is
    refused with a ``kvcanary:`` :class:`RuntimeError` before it changes anything (take
    turns under one lock, each step whole, to drive a monitor from several threads).
    :meth:`stats` and the attributes may be read from any thread at any time.

    The violation ``log`` is the monitor's: ``log.clear()`` empties it through the
    monitor, which keeps mapping the rows that follow to their requests (rows not
    polled before the clear are gone), and its rows are handed out by :meth:`poll`
    (``log.poll()`` is refused; ``log.read()`` looks without consuming). With a
    ``process_group`` every rank must clear alike, as every rank steps alike.

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
                 sweep_max_chains: int = 64, history: int = 256, process_group=None, chain: str = DEFAULT_CHAIN,
                 stamp_before_forward: bool = False, window: int | None = None, events=None,
                 metrics=False, incident_quiet_steps: int = 64, name: str = ""):
        opts = check_options(num_slots=num_slots, max_batch=max_batch, device=device, real_kv=real_kv,
                             real_kv_mode=real_kv_mode, swa=swa, token_offset=token_offset, draft=draft,
                             grow_on_overflow=grow_on_overflow, verify_after=verify_after,
                             fingerprint_sample_period=fingerprint_sample_period, ring_capacity=ring_capacity,
                             policy=policy, max_tokens=max_tokens, sweep_budget=sweep_budget,
                             sweep_max_chains=sweep_max_chains, history=history, process_group=process_group,
                             chain=chain, stamp_before_forward=stamp_before_forward, window=window)
        parts = build_parts(opts, req_to_token=req_to_token, block_table=block_table, page_size=page_size,
                            expected_tokens=expected_tokens, swa=swa, verify_capacity=verify_capacity,
                            process_group=process_group, events=events, metrics=metrics,
                            incident_quiet_steps=incident_quiet_steps, name=name)
        # --- options ----------------------------------------------------------
        self.chain, self.policy, self.device, self.max_batch = opts.chain, opts.policy, opts.device, opts.max_batch
        self._cpu = self.device == "cpu"
        self.xp = runtime.array_module(self.device)
        self.token_offset, self.window = opts.token_offset, opts.window
        self.grow_on_overflow, self.verify_after = opts.grow_on_overflow, opts.verify_after
        self.stamp_before_forward = opts.stamp_before_forward
        # --- parts (see .parts) -----------------------------------------------
        self.page_size = parts.layout.page_size
        self.main, self.swa, self.groups, self.log = parts.main, parts.swa, parts.groups, parts.log
        self._keepalive, self._inputs, self._layout = parts.keepalive, parts.inputs, parts.layout
        self._swa_map, self._sweep, self._requests = parts.swa_map, parts.sweep, parts.requests
        self._reporter, self._plan_counters, self._agreement = parts.reporter, parts.plan_counters, parts.agreement
        self._reader, self._outputs = parts.reader, parts.outputs
        # --- state and counts ---------------------------------------------------
        self._window_start = 0  # the first ring row the queued copy holds
        self._last_quiet = None  # a CPU poll's report state after it (see _quiet_state)
        self._step_open = None  # (stream ptr, tokens checked, BeforeStep) between before_ and after_forward
        self._guard = CallGuard()
        self._sweeps = 0
        self._sweep_entries = 0
        self._steps = 0
        self._violations = 0
        self._aborted = 0
        self._record_errors = None  # record_tokens' skipped rows, a device scalar once it runs
        self.log._own(self._clear_log)

    # ------------------------------------------------------------------ setup
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

    @property
    def table(self):
        """The slot table (``req_to_token`` or ``block_table``), read in place every step."""
        return self._layout.table

    @property
    def expected_table(self):
        """The expected-token table (None: no token check), read in place every step."""
        return self._layout.expected_table

    @guarded
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
        self._inputs.bind(dict(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                               input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                               swa_out_cache_loc=swa_out_cache_loc, expected_valid_lens=expected_valid_lens))
        self._layout.forget()
        loc = self._inputs.bound("out_cache_loc")
        if self.swa is not None and loc is not None:
            self._swa_map.reserve(int(loc.shape[0]), self.swa.swa.lut)

    @guarded
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
        if self._requests.captured:
            raise ValueError("kvcanary: rebind: a CUDA graph captured this monitor's launches with the old arrays; "
                             "refill those arrays in place instead")
        # Queued work may still read the old arrays.
        self._keepalive.retire((self.table, self.expected_table, self.main.sources,
                                self.swa and (self.swa.swa, self.swa.sources)), self._inputs.stream(None))
        self._layout.rebind(req_to_token=req_to_token, block_table=block_table, expected_tokens=expected_tokens)
        if (swa_lut is not None or swa_real_kv is not None) and self.swa is None:
            raise ValueError("kvcanary: swa_lut: this monitor has no SWA group")
        if swa_lut is not None:
            lut = check_like(swa_lut, "swa_lut", self.swa.swa.lut, self.device)
            if lut.dtype != self.swa.swa.lut.dtype:
                self._swa_map.forget()
            self.swa.swa = SwaWindow(self.swa.swa.size, lut)
            loc = self._inputs.bound("out_cache_loc")
            if self._swa_map.capacity == 0 and loc is not None:
                self._swa_map.reserve(int(loc.shape[0]), lut)
        for g, srcs, name in ((self.main, real_kv, "real_kv"), (self.swa, swa_real_kv, "swa_real_kv")):
            if srcs is not None:
                g.replace_sources(srcs, name)

    # ------------------------------------------------------------------ warm-up
    @guarded
    def set_position_check(self, on: bool, stream=None) -> None:
        """Turn write's chain-position check on or off (a device write; captured graphs see it).

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> mon = kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1)
            >>> mon.set_position_check(False)
            >>> int(mon.write_plan.position_check[0])
            0
        """
        with runtime.on_stream(self.device, self._inputs.stream(stream)):
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

    @guarded
    def end_warmup(self, stream=None) -> None:
        """Discard warm-up results (violations, input errors, overflow counts, step count)
        and switch the position check on. Synchronizes: call it outside the hot path."""
        ptr = self._inputs.stream(stream)
        runtime.synchronize(self.device, ptr)
        self._clear_log(ptr)
        with runtime.on_stream(self.device, ptr):
            for g in self.groups:
                g.reset_counters()
        self._requests.forget_replays()
        self._reporter.reset()
        self.set_position_check(True, stream)
        runtime.synchronize(self.device, ptr)
        self._reader.reset()
        self._steps = 0

    @functools.partial(guarded, name="log.clear")
    def _clear_log(self, stream=None) -> None:
        """``log.clear()``: empty the ring and start the request map, the agreement's view of
        the ring and the poll copy over with it, so the rows that follow map to their requests
        (stream-ordered on CUDA, like the clear)."""
        ptr = self._inputs.stream(stream)
        self.log._clear_ring(stream=ptr)
        with runtime.on_stream(self.device, ptr):
            self._requests.cleared()
        if self._agreement is not None:
            self._agreement.reset(ptr)
        self._reader.reset()  # the queued copy holds rows and head snapshots from before the clear
        self._window_start = 0
        self._last_quiet = None

    # ------------------------------------------------------------------ per step
    @guarded
    def before_forward(self, req_pool_indices=None, prefix_lens=None, extend_lens=None, *, batch_size=None,
                       expected_valid_lens=None, expected: ExpectedTokens | None = None, request_ids=None,
                       input_ids=None, positions=None, out_cache_loc=None, num_tokens=None, swa_out_cache_loc=None,
                       expected_input_ids=None, expected_positions=None, max_row_tokens=None, stream=None) -> None:
        """Plan the step and verify every record it will read (with ``stamp_before_forward``,
        also stamp the records of the tokens it writes).

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
            input_ids, positions, out_cache_loc, num_tokens, swa_out_cache_loc,
                expected_input_ids, expected_positions, max_row_tokens: only with
                ``stamp_before_forward``: the step's write inputs, as
                :meth:`after_forward` takes them (``None``: the bound buffers).
            stream: CUDA stream (default: PyTorch's current stream for PyTorch
                inputs, else CuPy's). Inside a CUDA graph capture pass the
                capturing stream (e.g. ``torch.cuda.current_stream()``).

        Each group's plan and verify are one :func:`~kvcanary_cupy.plan_and_verify`
        (see the class docstring for when the separate ops run instead). A step that
        passes no arrays (bound buffers) and a batch size seen before reuses the op
        arguments prepared for that size: it validates nothing again and builds nothing.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> r2t = np.arange(64, dtype=np.int32).reshape(4, 16)  # row r, position p -> slot 16 r + p
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy=lambda found: None)
            >>> mon.before_forward(np.array([1, 2]), np.array([0, 0]), np.array([2, 1]), request_ids=["a", "b"])
            >>> mon.after_forward(np.array([7, 8, 9]), np.array([0, 1, 0]), np.array([16, 17, 32]))
            >>> mon.before_forward(np.array([1, 2]), np.array([2, 1]), np.array([1, 1]), request_ids=["a", "b"])
            >>> mon.stats()["slots_checked"]  # a's prefix (2 records), then b's (1)
            3
        """
        if self._step_open is not None:
            raise ValueError("kvcanary: before_forward: the previous step is still open; call after_forward() "
                             "after the forward (or abort_step() if the forward failed) before planning the next")
        step = self._layout.before(req_pool_indices, prefix_lens, extend_lens, batch_size, expected_valid_lens,
                                   expected)
        if request_ids is not None and len(request_ids) != step.bs:
            raise ValueError(f"kvcanary: request_ids: expected one id per batch row ({step.bs}), "
                             f"got {len(request_ids)}")
        stamp = None
        if self.stamp_before_forward:
            stamp = self._layout.after(input_ids, positions, out_cache_loc, num_tokens, swa_out_cache_loc,
                                       expected_input_ids, expected_positions, max_row_tokens)
        elif (input_ids is not None or positions is not None or out_cache_loc is not None or num_tokens is not None
              or swa_out_cache_loc is not None or expected_input_ids is not None or expected_positions is not None
              or max_row_tokens is not None):  # every step makes this check: the names only to raise
            given = [k for k, v in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc),
                                    ("num_tokens", num_tokens), ("swa_out_cache_loc", swa_out_cache_loc),
                                    ("expected_input_ids", expected_input_ids),
                                    ("expected_positions", expected_positions),
                                    ("max_row_tokens", max_row_tokens)) if v is not None]
            raise ValueError(f"kvcanary: {given[0]}: a step's write inputs go to after_forward (or construct the "
                             "monitor with stamp_before_forward=True to stamp before the forward)")
        if self._cpu:
            ptr, capturing = None, False
        else:
            ptr = self._inputs.stream(stream, step.objs if stamp is None else step.objs + stamp.objs)
            capturing = self._inputs.capturing(ptr)
        self._requests.step(ptr, capturing=capturing, request_ids=request_ids)
        if step.valid_lens is not None:
            self._layout.fill_valid_lens(step, ptr)
        repair = self._cpu and self.grow_on_overflow  # on a GPU: at the next poll
        kept = step.launches is not None and (stamp is None or stamp.kept)
        launches = step.recorded(stamp) if kept else None
        if launches is not None:
            for launch in launches:
                launch(ptr)
        else:
            rec = ops.Recording(ptr) if kept and self._recordable(stamp, repair) else None
            self._check_step(step, stamp, ptr, ptr if rec is None else rec, repair)
            if rec is not None:
                step.record(stamp, self.groups, rec.ops)
        if not capturing:
            self._steps += 1
        self._step_open = (ptr, step.check_tokens, step)
        self._guard.step_thread = threading.get_ident()

    def _recordable(self, stamp: AfterStep | None, repair: bool) -> bool:
        """Whether a kept step's launches are the same op calls every time (then they are
        recorded once and launched directly): not when a group's plan is repaired on the
        host, nor when the step's work includes more than ops (the entries' digest after
        a plan, the SWA translation of the stamped slots)."""
        return (not self.verify_after and not (repair and any(g.may_overflow for g in self.groups))
                and (stamp is None or not stamp.translate))

    def _check_step(self, step: BeforeStep, stamp: AfterStep | None, ptr, s, repair: bool) -> None:
        """Each group's plan and verify (and, stamped, the step's writes), the ops on stream ``s``
        (``ptr``, or a :class:`~kvcanary_cupy.ops.Recording` on it)."""
        stamped = set()  # groups whose write ran in their check's launch
        for i, (g, args, verify_args, (rpi, pre, ext, r2t, bt, ps, swa, exp, log, tag, srcs, mode, check,
                                       sample)) in enumerate(step.groups):
            loc = stamp.groups[i][1] if stamp is not None else None  # None: not stamped here, or translated
            if loc is not None and stamp.tokens <= ops.STEP_WRITE_TOKENS and not (repair and g.may_overflow):
                _, write_tag, _, _, exp_in = stamp.groups[i][2]
                ops.plan_verify_write(g.vp, g.wp, g.canary, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext,
                                      req_to_token=r2t, block_table=bt, page_size=ps, swa=swa, expected=exp,
                                      input_ids=stamp.ids, positions=stamp.pos, out_cache_loc=loc,
                                      expected_inputs=exp_in, log=log, tag=tag, write_tag=write_tag,
                                      check_tokens=check, stream=s)
                stamped.add(i)
                continue
            if self.verify_after or (repair and g.may_overflow):
                # The verify after the write reads the entries again, and on the CPU a plan that
                # overflows is grown and planned again before its verify: plan and verify apart.
                # (Never recorded: see _recordable.)
                grown = g.plan(args, repair=repair and g.may_overflow, stream=ptr)
                if grown is not None:
                    self._reporter.repaired(g.name, *grown)
                ops.verify(g.canary, g.vp, stream=ptr, **verify_args)
                if g.entry_digest is not None:
                    g.digest_entries(ptr)
                continue
            # Every keyword spelled out: a call through **kwargs builds and unpacks a dict per call.
            ops.plan_and_verify(g.vp, g.wp, g.canary, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext,
                                req_to_token=r2t, block_table=bt, page_size=ps, swa=swa, expected=exp, log=log,
                                tag=tag, real_kv=srcs, real_kv_mode=mode, check_tokens=check, sample=sample,
                                digest=g.entry_digest, stream=s)
        if stamp is not None and len(stamped) < len(step.groups):
            self._write_step(stamp, ptr, skip=stamped, stream=s)

    @guarded
    def abort_step(self) -> None:
        """Close a step whose forward failed: nothing is stamped, ``stats()["aborted_steps"]``
        counts it, and the next :meth:`before_forward` may follow. The records the step did
        not stamp are unverified, not wrong: the engine must not read the tokens it failed
        to write (its own rollback), or the next verify reports them. With
        ``stamp_before_forward`` the step's records were stamped before the forward failed;
        the same rollback keeps them from being read.

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
        self._close_step()
        self._aborted += 1

    def _close_step(self) -> None:
        self._step_open = None
        self._guard.step_thread = None

    @guarded
    def after_forward(self, input_ids=None, positions=None, out_cache_loc=None, *, num_tokens=None,
                      swa_out_cache_loc=None, expected_input_ids=None, expected_positions=None, max_row_tokens=None,
                      stream=None) -> None:
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
            max_row_tokens: optional int, a bound on every batch row's new tokens (1 for
                a decode step), as :func:`~kvcanary_cupy.write` takes it: a faster route on
                a GPU, the same records (rounded up to a power of two: a step is prepared
                once for all the bounds that round alike).
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
        ptr0, checked_tokens, before = self._step_open
        if self.stamp_before_forward:
            if any(x is not None for x in (input_ids, positions, out_cache_loc, num_tokens, swa_out_cache_loc,
                                           expected_input_ids, expected_positions, max_row_tokens)):
                raise ValueError("kvcanary: after_forward: this monitor stamps in before_forward "
                                 "(stamp_before_forward=True); pass the step's write inputs there")
            self._close_step()
            return
        # Every argument of every group is imported and checked before the first launch, so a
        # misuse raises with no record changed (the step stays open: fix the call and repeat it).
        step = self._layout.after(input_ids, positions, out_cache_loc, num_tokens, swa_out_cache_loc,
                                  expected_input_ids, expected_positions, max_row_tokens)
        ptr = self._inputs.stream(stream, step.objs) if stream is not None or step.given else ptr0
        self._close_step()
        if step.launches is not None:
            for launch in step.launches:
                launch(ptr)
        elif step.kept and not step.translate and self._agreement is None:
            # The same writes every time (the agreement's digest and the SWA translation are
            # more than ops): recorded once, then launched directly.
            rec = ops.Recording(ptr)
            self._write_step(step, ptr, stream=rec)
            step.launches = tuple(rec.ops)
        else:
            self._write_step(step, ptr)
        if self.verify_after:
            for i, g in enumerate(self.groups):
                if g is self.main and self.window is not None:
                    self._plan_left_window(g, before.groups[i][1], before.bs, ptr)
                ops.verify(g.canary, g.vp, log=self.log, tag=g.tag_after, real_kv=g.sources,
                           real_kv_mode=g.mode, check_tokens=checked_tokens, sample=g.sampler, stream=ptr)
        if self._agreement is not None:
            self._agreement.exchange(ptr)

    def _plan_left_window(self, g, args: dict, bs: int, ptr) -> None:
        """Plan, into ``g``'s verify plan, the window the step leaves: each row's prefix grown by
        what the step wrote, nothing to write (see ``verify_after``)."""
        ends, none = self._layout.window_rows(bs)
        with runtime.on_stream(self.device, ptr):
            self.xp.add(args["prefix_lens"][:bs], args["extend_lens"][:bs], out=ends)
        repair = self._cpu and self.grow_on_overflow and g.may_overflow
        grown = g.plan_verify_only(dict(args, prefix_lens=ends, extend_lens=none), repair=repair, stream=ptr)
        if grown is not None:
            self._reporter.repaired(g.name, *grown)

    def _write_step(self, step: AfterStep, ptr, skip=(), stream=None) -> None:
        """Each group's write (but the groups in ``skip``), the agreement's digest in the last;
        the writes on ``stream`` (default ``ptr``; a :class:`~kvcanary_cupy.ops.Recording` on it)."""
        s = ptr if stream is None else stream
        swa_loc = self._swa_map.translate(step.loc, self.swa.swa.lut, ptr) if step.translate else None
        ids, pos = step.ids, step.pos
        digest = None  # the ranks' agreement: its digest runs in the last write's launch
        if self._agreement is not None:
            locs = [swa_loc if loc is None else loc for _, loc, _ in step.groups]
            digest = self._agreement.step_digest(self.groups, input_ids=ids, positions=pos, locs=locs)
        last, bound = len(step.groups) - 1, step.max_row_tokens
        for i, (g, loc, (log, tag, srcs, mode, exp_in)) in enumerate(step.groups):
            if i in skip:
                continue
            ops.write(g.canary, g.wp, input_ids=ids, positions=pos, out_cache_loc=swa_loc if loc is None else loc,
                      log=log, tag=tag, real_kv=srcs, real_kv_mode=mode, expected_inputs=exp_in,
                      digest=digest if i == last else None, max_row_tokens=bound, stream=s)

    # ------------------------------------------------------------------ graphs
    @guarded
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
        self._requests.replay(request_ids)

    # ------------------------------------------------------------------ sweep
    @guarded
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

        Violations carry tag SWEEP and name the chain's ``key`` as the request. A sweep
        may run while a step is open (between :meth:`before_forward` and
        :meth:`after_forward`, on the step's stream): the step's later rows still name
        its requests.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=np.zeros((2, 8), np.int32), max_batch=1)
            >>> mon.sweep([kc.SweepChain(np.array([3, 4]), 0, -1, key="node")])
            2
            >>> sorted({v.request for v in mon.poll()})  # slots 3, 4 were never stamped
            ['node']
        """
        g = self._group(group)
        chains = [SweepChain.coerce(c, i) for i, c in enumerate(chains)]
        ptr = self._inputs.stream(stream, [c.slots for c in chains])
        self._keepalive.hold(chains)
        n, keys = self._sweep.fill(chains, ptr)
        if n == 0:
            return 0
        self._requests.sweep(ptr, keys)
        ops.verify(g.canary, self._sweep.plan, log=self.log, tag=LaunchTag.SWEEP,
                   real_kv=g.sources, real_kv_mode=g.mode, check_tokens=True, stream=ptr)
        if self._step_open is not None:  # the rest of the open step's rows are its requests' again
            self._requests.resume(ptr)
        self._sweeps += 1
        self._sweep_entries += n
        return n

    # ------------------------------------------------------------------ transfer
    def _group(self, group: str):
        g = {"main": self.main, "swa": self.swa}.get(group)
        if g is None:
            names = "'main' or 'swa'" if self.swa else "'main'"
            raise ValueError(f"kvcanary: group: expected {names}, got {group!r}")
        return g

    @guarded
    def export_slots(self, slots, *, group: str = "main", stream=None):
        """The records of ``slots``, to travel with their KV (offload, disaggregation, another rank).

        A copy, int64 ``[n, 4]`` on the monitor's device (NumPy on ``"cpu"``, CuPy on
        CUDA), gathered on the monitor's stream without a host sync. A record's link is
        derived from its predecessor's record alone (token, position, link), never from
        a slot id, so records moved with their KV into other slots still chain: see
        :meth:`import_slots` and :func:`kvcanary_cupy.export_records`. The links are
        this monitor's ``chain`` kind: the receiving monitor must use the same kind.

        Args:
            slots: host integers ``[n]`` (a NumPy array, a list, a CPU tensor), each in
                ``[1, num_slots)`` of the group's pool.
            group: ``"main"`` or ``"swa"`` (slots then are SWA-pool slots).
            stream: CUDA stream, as for :meth:`before_forward`.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> r2t = np.arange(64, dtype=np.int32).reshape(4, 16)
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=1)
            >>> mon.before_forward(np.array([1]), np.array([0]), np.array([2]))
            >>> mon.after_forward(np.array([7, 8]), np.array([0, 1]), np.array([16, 17]))
            >>> mon.export_slots([16, 17])[:, :2].tolist()
            [[7, 0], [8, 1]]
        """
        g = self._group(group)
        return transfer.export_records(g.canary, slots, stream=self._inputs.stream(stream))

    @guarded
    def import_slots(self, slots, records, *, group: str = "main", stream=None) -> None:
        """Write records that travelled with their KV into ``slots`` (any slots: where the KV landed).

        Stream-ordered with the monitor's ops, no host sync. The next verify that reads
        those slots checks the chain and positions against this monitor's own slot
        table and the fingerprints against the KV bytes that arrived: a byte corrupted
        in transit is a REAL_KV violation, KV landing in the wrong slots a CHAIN /
        POSITION one. The records must come from a monitor of the same ``chain`` kind
        (links of the other kind fail the chain check).

        Args:
            slots: host integers ``[n]``, each in ``[1, num_slots)``, none twice.
            records: int64 ``[n, 4]`` on the monitor's device (from :meth:`export_slots`
                on the sender, moved by any means), zero copy from any framework.
            group: ``"main"`` or ``"swa"``.
            stream: CUDA stream, as for :meth:`before_forward`.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> r2t = np.arange(64, dtype=np.int32).reshape(4, 16)
            >>> a = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=1, policy="raise")
            >>> a.before_forward(np.array([1]), np.array([0]), np.array([2]))
            >>> a.after_forward(np.array([7, 8]), np.array([0, 1]), np.array([16, 17]))
            >>> b = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=1, policy="raise")
            >>> b.import_slots([32, 33], a.export_slots([16, 17]))  # row 2 of b's table holds them
            >>> b.before_forward(np.array([2]), np.array([2]), np.array([1]))
            >>> b.after_forward(np.array([9]), np.array([2]), np.array([34]))
            >>> b.poll()
            []
        """
        g = self._group(group)
        ptr = self._inputs.stream(stream, (records,))
        transfer.import_records(g.canary, slots, records, stream=ptr)
        self._keepalive.hold(records)  # the scatter may run after this call returns

    # ------------------------------------------------------------------ results
    @guarded
    def poll(self, stream=None, *, queue_next: bool = True) -> list[Violation]:
        """The violations found since the previous poll, mapped to request ids, after the policy ran.

        Never stalls the stream: on CUDA it returns what the copy queued by the
        previous poll found (the rows of the step before) and queues the next copy.
        An engine that synchronizes its stream every step can see a step's own rows with
        one copy: ``poll()`` right after ``after_forward`` (it queues the copy), then
        ``poll(queue_next=False)`` after the engine's synchronization (it reads the copy,
        long done, and queues nothing). On the CPU every poll reads the current rows (one that
        finds nothing new since the previous poll returns at once).
        Plan overflows and out-of-range plan inputs found in the same copy are
        reported as :class:`KvCanaryWarning` s (and grow the plan, see the class
        docstring). The rows are folded into incidents: the policy sees the new ones
        (under ``policy="raise"`` a poll that opens one raises instead of returning),
        and the event sink and metrics count them.

        With a ``process_group`` the decision is the group's, the same on every rank:
        rows this rank logged up to the latest step's agreement are returned (later
        rows, e.g. a sweep's, wait for the next agreement), RANK_DIVERGENCE rows come
        on every rank alike, and when other ranks logged rows and this one none, a
        group notice (``Violation.other_ranks_rows``) is returned in their place, so
        the policy fires on every rank in the same poll.

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
        ptr = self._inputs.stream(stream)
        # On CUDA the rows and scalars returned now were copied at an earlier poll.
        upto_seq, replay_now = self._requests.stage(now=self._cpu, queue=queue_next)
        if self._cpu:
            quiet = self._quiet_state()
            if quiet is not None and quiet == self._last_quiet:  # nothing new since the last poll
                self._keepalive.polled(waited=True, queued=queue_next)
                return []
        if self._cpu:  # the ring's rows after those handed out, as a CUDA copy holds them
            self._window_start, stop = self.log.copy_window()
            scal = self._reader.take(rows=self._window_rows(stop))
        else:
            scal = self._reader.take()
        found = [] if scal is None else self.log._take_copied(int(scal[-2][0]), scal[-1], self._window_start)
        if queue_next and not self._cpu:
            self._window_start, stop = self.log.copy_window()
            self._reader.queue(ptr, rows=self._window_rows(stop))
        self._keepalive.polled(waited=scal is not None, queued=queue_next)
        out = []
        if scal is not None:
            n = len(self.groups)
            self._plan_counters.report(scal[:n], scal[n + 1], ptr, upto_seq, replay_now)
            out = self._requests.map_rows(found, scal[n], upto_seq, replay_now)
            if self._agreement is not None:
                out = self._agreement.release(out, scal[n + 2])
        self._violations += len(out)
        counters = dropped = None
        if scal is not None:
            counters, dropped = scal[n + 1], max(0, int(scal[-2][0]) - self.log.capacity)
            self._reporter.dropped(dropped, self.log.capacity)
        new = self._outputs.take(out, step=self._steps, counters=counters, dropped=dropped or 0)
        # Tensor-parallel ranks must decide alike in every poll, and a rank folds only its own
        # rows: with a process group the policy sees every row, as the group's tally does.
        found = out if self._agreement is not None else new
        if self._cpu:
            self._last_quiet = self._quiet_state()
        if found:
            apply_policy(self.policy, found)
        return out

    def _quiet_state(self):
        """On the CPU, all a poll reports from but the counters it passes on: the ring's head,
        the skipped writes and each group's warned-about counters. A poll that finds them as
        the previous poll left them has nothing to report (no rows, no warnings) and returns
        at once. None where every poll reports (open incidents expire with the steps, metrics
        take every poll's counters, a process group agrees on every poll)."""
        if self._agreement is not None or self._outputs.metrics is not None or len(self._outputs.folder):
            return None
        return (self.log.head.item(0), self.log.counter_array.item(CTR_WRITES_SKIPPED),
                *(c for g in self.groups for c in g.reported()))

    def _window_rows(self, stop: int) -> list:
        """The poll's row ranges: every source whole but the ring, rows ``_window_start .. stop``."""
        return [None] * (len(self._reader.sources) - 1) + [(self._window_start, stop)]

    @property
    def incidents(self) -> list:
        """The open incidents (:class:`~kvcanary_cupy.monitor.incidents.Incident`), in the order
        they opened, each as of its latest row: one per request, group, slot and reasons."""
        return self._outputs.folder.incidents

    def end_request(self, request_id) -> None:
        """A request finished (its slots may be handed to another): end its incidents now
        (``incident_end`` events), so that damage found later at its slots opens new ones."""
        self._outputs.end_request(request_id, step=self._steps)

    def close(self) -> None:
        """End every open incident (an ``incident_end`` event each) and close the event file.
        The monitor may step on; later incidents are reported as usual but written nowhere."""
        self._outputs.close(step=self._steps)

    @guarded
    def read(self) -> list[Violation]:
        """Every violation row the ring holds, mapped, without the policy (synchronizes)."""
        rows = self.log.read()
        heads = runtime.HostReader(self.device, [self._requests.heads]).read_now()[0]
        return self._requests.map_ring(rows, heads)

    def stats(self) -> dict:
        """Counters (synchronizes on CUDA).

        Returns a dict: ``steps`` (before_forward calls outside capture plus
        replays noted), ``aborted_steps`` (closed by :meth:`abort_step`),
        ``violations`` (returned by poll), ``logged`` (appended
        to the ring), ``dropped`` (past the ring), ``overflows`` and
        ``input_errors`` (all groups: live rows not verified for out-of-range plan input),
        ``rows_unstamped`` (all groups: live rows whose tokens were not stamped, see
        :func:`kvcanary_cupy.plan`), the log's counters (``kernel_runs``,
        ``slots_checked``, ``slots_written``, ``verifies_skipped``,
        ``writes_skipped``, ``tokens_skipped``: see
        :meth:`ViolationLog.counters`), ``sweeps``, ``sweep_entries``, the
        tensor-parallel agreement's ``group_violations`` (rows the whole process
        group logged: every rank's checks' plus each divergence row once, as of
        the latest agreement), ``divergences`` (ranks found differing, summed over
        steps) and ``agreement_steps`` (all 0 without a ``process_group``), the
        ``chain`` kind of the monitor's canaries, ``incidents`` (opened so far: the
        rows of one request, group, slot and reasons fold into one), ``tokens_unrecorded_rows`` (rows of
        :meth:`record_tokens` skipped: a table row or token span out of range), and per
        group ``groups[name]``
        with ``capacity``, ``max_requested``, ``overflows``, ``input_errors``,
        ``rows_unstamped``.

        Example::

            >>> import numpy as np, kvcanary_cupy as kc
            >>> r2t = np.arange(64, dtype=np.int32).reshape(4, 16)  # row r, position p -> slot 16 r + p
            >>> mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy=lambda found: None)
            >>> mon.before_forward(np.array([1]), np.array([0]), np.array([3]))
            >>> mon.after_forward(np.array([7, 8, 9]), np.array([0, 1, 2]), np.array([16, 17, 18]))
            >>> s = mon.stats()
            >>> s["steps"], s["slots_written"], s["groups"]["main"]["capacity"], s["chain"]
            (1, 3, 32, 'scan')
        """
        now = self._reader.read_now()
        per = group_stats(self.groups, now)
        agreement = None if self._agreement is None else self._agreement.stats(now[len(self.groups) + 2])
        return stats_dict(steps=self._steps, aborted=self._aborted, violations=self._violations, log=self.log,
                          groups=per, sweeps=self._sweeps, sweep_entries=self._sweep_entries, agreement=agreement,
                          chain=self.chain, record_errors=self._record_errors, incidents=self._outputs.incidents)

    # ------------------------------------------------------------------ expected tokens
    @guarded
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
        if self._record_errors is None:
            self._record_errors = runtime.empty((1,), np.int64, self.device, fill=0)
        ops.scatter_expected_tokens(self.expected_table, tokens=tokens, offsets=offsets,
                                    req_pool_indices=req_pool_indices, input_errors=self._record_errors,
                                    stream=self._inputs.stream(stream, (tokens, offsets, req_pool_indices)))
