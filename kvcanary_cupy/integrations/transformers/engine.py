"""EngineCanary: the monitors of one engine cache, driven by the engine's own steps.

A step of transformers' continuous batching runs, in its generation thread:
``prepare_next_batch`` (schedule, offload, restore, build the step's buffers),
``_generation_step`` (the forward, queued on the compute stream, then a host
sync) and ``update_batch`` (append tokens, hash complete blocks, free finished
requests, deliver outputs). The adapter wraps, on the engine's instances:

- ``_generation_step``: before it, fill the request tables from the engine's
  cache allocators and the expected tokens from the requests' own token lists,
  and verify every slot the step reads (``before_forward``);
- ``model_runner.compute_batch``: after the forward is queued, stamp every slot
  the step wrote (``after_forward``, slots from the engine's write index) and
  queue a poll (with ``stamp_before_forward`` the slots are stamped before the
  forward, beside the verify: the engine has set the step's tokens, positions and
  write index by then);
- ``update_batch``: before it, read that poll's copy (the engine's sync has
  completed it on CUDA; nothing more is queued, so a step costs one copy):
  violations of this step are handled before the engine appends the step's
  tokens or delivers anything;
- the offloading manager, ``copy_cache``: records move with blocks
  (:mod:`.moves`);
- ``mark_shareable_blocks_as_complete`` and the output router, from the first
  request the canary cancels on (they run once per request of a step): a
  cancelled request never publishes its blocks to the prefix cache, and only its
  failed result is delivered.

Everything the monitors do runs on the engine's compute stream.
"""
from __future__ import annotations

import operator
import time

import numpy as np

from ...format import RealKvMode
from ...monitor.policy import warn
from ...ops import real_kv_mode_of
from .groups import build_groups
from .hooks import Hooks
from .moves import RecordMoves
from .slots import SlotMap, bytes_per_row, kv_sources
from ..engine.staging import ChangeUpload, StepArrays
from ..engine.tables import ExpectedTable, RowPool
from ..engine.violations import EngineViolation, cancel_message, request_tags


def device_name(device) -> str:
    """``"cpu"`` or ``"cuda:N"`` for a torch device (or its string)."""
    import torch  # noqa: PLC0415

    d = torch.device(device)
    if d.type == "cpu":
        return "cpu"
    if d.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if d.index is None else d.index}"
    raise ValueError(f"kvcanary: device: the engine's cache lives on {d}; watch() supports 'cpu' and 'cuda' caches")


def same_device(asked: str, actual: str) -> bool:
    """Whether ``device=`` as given names ``actual`` (``"cuda"`` names any CUDA device: the current one).

    Example::

        >>> same_device("cuda", "cuda:1"), same_device("cuda:0", "cuda:1"), same_device("cpu", "cuda:0")
        (True, False, False)
    """
    if asked == actual:
        return True
    return asked == "cuda" and actual.startswith("cuda:")


# What a step reads of each scheduled request (one C-level map each: this runs every step).
_STATE, _QUERY_LENGTH = operator.attrgetter("state"), operator.attrgetter("query_length")
_REQUEST_ID, _POSITION = operator.attrgetter("request_id"), operator.attrgetter("position_offset")


def _quiet(found) -> None:
    """The monitors' own policy: nothing; the watch applies its policy to the engine's violations."""


class EngineCanary:
    """One KvCanary per layer group of one engine cache, with the hooks that drive them.

    Args:
        watch: the :class:`~kvcanary_cupy.integrations.transformers.watch.Watch` it reports to.
        manager: the engine's ``ContinuousBatchingManager``.
        processor: its ``ContinuousBatchProcessor`` (freshly created: its cache holds nothing yet).
        options: the :class:`~kvcanary_cupy.integrations.transformers.options.WatchOptions`.
        max_len_hint: the longest request the workload announced (prompt plus new tokens), or None.
    """

    def __init__(self, *, watch, manager, processor, options, max_len_hint: int | None = None):
        from ...monitor import KvCanary  # noqa: PLC0415

        self.watch = watch
        self.manager = manager
        self.bp = processor
        cache, io = processor.cache, processor.inputs_and_outputs
        self.cache, self.io = cache, io
        self.device = device_name(cache.device)
        if options.device is not None and not same_device(options.device, self.device):
            raise ValueError(f"kvcanary: device: the engine's cache lives on {self.device}, got device="
                             f"{options.device!r}; leave it out to watch the cache where it is")
        self.cpu = self.device == "cpu"
        self.stream = io.compute_stream
        self.ptr = None if self.stream is None else int(self.stream.cuda_stream)
        self.hooks = Hooks()

        bs = int(cache.block_size)
        self.slot_map = SlotMap(block_size=bs, engine_rows=int(cache.key_cache[0].shape[0]))
        sources, self.rehomed = kv_sources(cache, self.slot_map, processor.offloading_manager)
        mode = options.monitor.get("real_kv_mode")
        self.fingerprints = bool(sources) and (mode is None or real_kv_mode_of(mode) != RealKvMode.NONE)
        if not sources:
            warn(f"kvcanary: the engine's cache rows hold {bytes_per_row(cache)} bytes, not a multiple of 16: real "
                 "K/V is not fingerprinted (chain, position and token checks still run)")
        self.max_batch = int(io.max_requests_per_batch)
        num_pages = int(cache.num_blocks) * bs
        self.max_len = int(options.max_len or max_len_hint or num_pages)
        rows = 2 * self.max_batch + 1
        self.rows = RowPool(rows)
        self.groups = build_groups(cache, self.slot_map, rows=rows, max_len=self.max_len, device=self.device)
        self._group_tables = [g.table for g in self.groups]
        self.steps = StepArrays(max_batch=self.max_batch, loc_groups=len(self.groups), device=self.device)
        self.expected = ExpectedTable(rows, min(self.max_len, 256), self.device, self.steps.device_view("valid"))
        # Table changes and slot copies the device launches could not apply (an index outside
        # its array), counted on the device by every such launch of this engine (CUDA).
        self._updates_skipped = None if self.cpu else _torch_zeros(1, self.device)
        skipped_at = 0 if self.cpu else self._updates_skipped.data_ptr()
        self.upload = None if self.cpu else ChangeUpload(self.device, self.steps, skipped=skipped_at)

        kwargs = dict(options.monitor)
        # A step verifies at most max_batch * max_len records (requests sharing a prefix each
        # verify it); a larger step grows the plan.
        kwargs.setdefault("verify_capacity", max(1, min(self.max_batch * self.max_len, 2 * self.slot_map.num_slots)))
        self.sampled = (kwargs.get("fingerprint_sample_period") or 1) > 1
        self.stamp_first = bool(kwargs.get("stamp_before_forward"))
        tokens = int(cache.max_batch_tokens)
        self._write_index = io.write_index_storage.numpy() if self.cpu else io.write_index_storage
        for g in self.groups:
            g.loc = np.zeros(tokens, np.int64) if self.cpu else _torch_zeros(tokens, self.device)
            # A sliding group reads the window - 1 positions before a step from its ring, before the
            # step writes into it; the table maps the one before those and the step's own (see .groups).
            table = (dict(req_to_token=g.table.array, window=_read_window(g)) if g.sliding else
                     dict(block_table=g.table.array, page_size=bs))
            g.monitor = KvCanary(num_slots=self.slot_map.num_slots, max_batch=self.max_batch, device=self.device,
                                 real_kv=sources, policy=_quiet, name=f"group{g.index}", **table, **kwargs)
            g.monitor.bind_inputs(req_pool_indices=self.steps.device_view("rows"),
                                  prefix_lens=self.steps.device_view("prefix"),
                                  extend_lens=self.steps.device_view("extend"),
                                  input_ids=io.input_ids, positions=io.position_ids, out_cache_loc=g.loc)
        # Per group, the launches that put the step's written slots in its loc: from the slots
        # before_step worked out, or from the engine's write index row (CUDA).
        self._loc_copies = {} if self.cpu else {g.index: _loc_copies(self, g) for g in self.groups}
        self.moves = RecordMoves(self)
        self.failed: set = set()
        self._holding_back = False  # whether the hooks that hold back failed requests are installed
        self.step = 0
        self.open = False
        self.row_bound = None  # the open step's longest row of new tokens
        self.cancelled = 0
        self.too_late = 0
        self.outputs_dropped = 0
        self.host_seconds = 0.0
        if not self.cpu:
            import torch  # noqa: PLC0415

            torch.cuda.synchronize(self.device)  # tables and re-homed tensors were made on another stream

    # ------------------------------------------------------------------ hooks
    def install(self) -> None:
        """Wrap the engine's instances (see the module docstring)."""
        bp, h = self.bp, self.hooks
        h.wrap(bp, "_generation_step", self._generation_step_hook)
        h.wrap(bp.model_runner, "compute_batch", self._compute_batch_hook)
        h.wrap(bp, "update_batch", self._update_batch_hook)
        om = bp.offloading_manager
        h.wrap(om, "_offload_to_cpu", self._offload_hook)
        h.wrap(om, "restore_scheduled_requests", self._restore_hook)
        h.wrap(bp.cache, "copy_cache", self._copy_hook)

    def _hold_back_failed(self) -> None:
        """Once a request failed: keep its blocks from the prefix cache and drop its later outputs.
        Installed then, not before: these run once per request of every step."""
        if self._holding_back:
            return
        bp, h = self.bp, self.hooks
        h.wrap(bp.cache, "mark_shareable_blocks_as_complete", self._complete_hook)
        h.wrap(bp.output_router, "deliver", self._deliver_hook)
        h.wrap(bp.output_router, "deliver_batch", self._deliver_batch_hook)
        self._holding_back = True

    def _run(self, fn, *args):
        """Run a hook body under the watch's lock, timed; an error is recorded, then raised in the engine."""
        t0 = time.perf_counter()
        try:
            with self.watch.lock:
                if self.bp is None:  # let go while the engine still ran (the watch exited): unwatched now
                    return None
                return fn(*args)
        except BaseException as e:
            self.watch.record_error(e)
            raise
        finally:
            self.host_seconds += time.perf_counter() - t0

    def _generation_step_hook(self, orig):
        def _generation_step(model):
            try:
                self._run(self.before_step)
                orig(model)
            except BaseException:
                if self.open:  # close the monitors' steps, so the next step can open again
                    self._run(self.abort)
                raise
            if self.open:  # the forward did not go through compute_batch
                self._run(self.after_forward)
        return _generation_step

    def _compute_batch_hook(self, orig):
        def compute_batch(model, batch_data):
            orig(model, batch_data)
            if self.open:  # a real step (warm-up runs no step)
                self._run(self.after_forward_and_poll)
        return compute_batch

    def _update_batch_hook(self, orig):
        def update_batch():
            if self.step:  # the engine's sync has completed the copy queued after the forward: read it
                self._run(self.poll, False)
            return orig()
        return update_batch

    def _offload_hook(self, orig):
        def _offload_to_cpu(victims):
            done = orig(victims)
            if done:
                self._run(self.moves.offloaded_to_cpu, victims, done)
            return done
        return _offload_to_cpu

    def _restore_hook(self, orig):
        def restore_scheduled_requests(requests_in_batch):
            if not self.moves.saved:  # no records wait on the host: nothing to bring back
                return orig(requests_in_batch)
            states = [fs.state for fs in requests_in_batch if fs.state.is_cpu_offloaded]
            out = orig(requests_in_batch)
            if states:
                self._run(self.moves.restored_from_cpu, states)
            return out
        return restore_scheduled_requests

    def _copy_hook(self, orig):
        def copy_cache(list_source_blocks, list_forked_blocks):
            out = orig(list_source_blocks, list_forked_blocks)
            self._run(self.moves.copied, list_source_blocks, list_forked_blocks)
            return out
        return copy_cache

    def _complete_hook(self, orig):
        def mark_shareable_blocks_as_complete(state, num_complete_blocks):
            if state.request_id in self.failed:  # never publish a failed request's blocks to the prefix cache
                return None
            return orig(state, num_complete_blocks)
        return mark_shareable_blocks_as_complete

    def _deliver_hook(self, orig):
        def deliver(output):
            if output.request_id in self.failed:
                self.outputs_dropped += 1
                return None
            return orig(output)
        return deliver

    def _deliver_batch_hook(self, orig):
        def deliver_batch(outputs):
            keep = [o for o in outputs if o.request_id not in self.failed]
            self.outputs_dropped += len(outputs) - len(keep)
            if keep:
                orig(keep)
        return deliver_batch

    # ------------------------------------------------------------------ a step
    def before_step(self) -> None:
        """Fill the tables for the scheduled batch and verify what it reads."""
        io = self.io
        batch = io.requests_in_batch
        bs = len(batch)
        if bs == 0:
            return
        if bs > self.max_batch:
            raise ValueError(f"kvcanary: the engine scheduled {bs} requests, more than its max_requests_per_batch "
                             f"= {self.max_batch} the monitors were sized for")
        if self.upload is not None:
            self.upload.wait_reusable()
        states = list(map(_STATE, batch))
        rids = list(map(_REQUEST_ID, states))
        ext = list(map(_QUERY_LENGTH, batch))
        ends = list(map(_POSITION, states))  # the engine already advanced it past this step's tokens
        pre = list(map(operator.sub, ends, ext))
        rows, fresh = self.rows.rows_of(states)
        self.steps.set_batch(rows, pre, ext, ends)
        self.expected.reserve(max(ends), self.stream)
        self.expected.fill(rows, states, ends, fresh)
        fast = bool(io.use_block_table)  # one token per request, written through the engine's block table
        for g in self.groups:
            g.fill(rows, rids, pre, ends)
            if fast:
                self.steps.loc[g.index][:bs] = g.step_slots(pre)
        if not self.cpu:  # one launch: the step rows and every table's changes
            self.upload.flush(self._group_tables + [self.expected.table], stream=self.ptr)
        self.step += 1
        tags = request_tags(rids, self.step)
        exp = self.expected.tokens()
        self.row_bound = max(ext)  # the write's bound on a row's tokens (max_row_tokens)
        self.open = True  # before the first monitor opens its step: a failure below aborts them all
        if self.stamp_first:
            n = self._write_slots()
            for g in self.groups:
                g.monitor.before_forward(batch_size=bs, expected=exp, request_ids=tags, num_tokens=n,
                                         max_row_tokens=self.row_bound, stream=self.ptr)
            return
        for g in self.groups:
            g.monitor.before_forward(batch_size=bs, expected=exp, request_ids=tags, stream=self.ptr)

    def after_forward(self) -> None:
        """Stamp the records of the slots the forward wrote (the engine's write index, shifted),
        or, stamped before the forward, close the monitors' steps."""
        if self.stamp_first:
            self.open = False
            for g in self.groups:
                g.monitor.after_forward(stream=self.ptr)
            return
        n = self._write_slots()
        self.open = False
        for g in self.groups:
            g.monitor.after_forward(num_tokens=n, max_row_tokens=self.row_bound, stream=self.ptr)

    def _write_slots(self) -> int:
        """Put the slots the step writes in every group's loc; returns the step's token count."""
        io = self.io
        n = int(io.total_seqlen_q)
        fast = bool(io.use_block_table)
        for g in self.groups:
            if not fast and int(io.true_write_sizes[g.index]) != n:
                raise ValueError(f"kvcanary: layer group {g.index}: the engine wrote {io.true_write_sizes[g.index]} "
                                 f"slots for {n} tokens")
        for g in self.groups:
            self._written_slots(g, n, fast)
        return n

    def after_forward_and_poll(self) -> None:
        """:meth:`after_forward`, then :meth:`poll` (queues the copy the update's poll reads on CUDA)."""
        self.after_forward()
        self.poll()

    def _written_slots(self, g, n: int, fast: bool) -> None:
        """Put the canary slots of the ``n`` tokens the step wrote in group ``g`` where its monitor reads them:
        the slots before_step worked out (decode fast path), else the engine's write index, shifted."""
        if self.cpu:
            if fast:
                g.loc[:n] = self.steps.loc[g.index][:n]
            else:
                np.add(self._write_index[g.index, :n], self.slot_map.shift, out=g.loc[:n])
            return
        # One small launch on the compute stream, no framework op: a device copy (with the shift).
        from_steps, from_index = self._loc_copies[g.index]
        if fast:
            from_steps(copy_words=n, stream=self.ptr)
        else:
            from_index(copy_words=n, shift=self.slot_map.shift, stream=self.ptr)

    def abort(self) -> None:
        """The forward failed: close the step without stamping."""
        self.open = False
        for g in self.groups:
            try:
                g.monitor.abort_step()
            except ValueError:  # that monitor's step never opened
                pass

    def poll(self, queue_next: bool = True) -> list:
        """Collect every monitor's violations and hand them to the watch's policy (``queue_next``:
        see :meth:`~kvcanary_cupy.KvCanary.poll`)."""
        out = []
        for g in self.groups:
            for v in g.monitor.poll(stream=self.ptr, queue_next=queue_next):
                out.append(EngineViolation.from_row(v, group=g.index, group_type=g.kind, layers=g.layers,
                                                    shift=self.slot_map.shift, engine_rows=self.slot_map.engine_rows))
        if out:
            self.watch.report(self, out)
        return out

    def flush(self) -> None:
        """After the engine stopped: the last copies' violations (two polls around a sync on CUDA)."""
        self.poll()
        if not self.cpu:
            self.stream.synchronize()
            self.poll()

    def reset(self) -> None:
        """The engine reset its batch processor for a new session: its requests are gone."""
        self.rows.clear()
        for g in self.groups:
            g.forget_rows()
        self.moves.clear()

    # ------------------------------------------------------------------ cancel
    def cancel(self, request_id, found: list) -> bool:
        """Fail ``request_id`` with an error naming ``found`` and cancel it through the engine.

        The engine's ``cancel_request`` frees the request at its next step but delivers
        nothing, so the failed result is delivered here, and any later output of the
        request is dropped. Returns False when the request is no longer live.
        """
        if request_id in self.failed:
            return True
        sched = self.bp.scheduler
        state = sched.active_requests.get(request_id) or sched.waiting_requests.get(request_id)
        if state is None:
            self.too_late += 1
            return False
        self.bp.output_router.fail_and_deliver(state, RuntimeError(cancel_message(found)))
        self.failed.add(request_id)
        self._hold_back_failed()
        self.manager.cancel_request(request_id)
        self.cancelled += 1
        return True

    # ------------------------------------------------------------------ results
    def stats(self) -> dict:
        """This engine's counters and each group's monitor stats (synchronizes on CUDA)."""
        return {"steps": self.step, "cancelled": self.cancelled, "cancel_too_late": self.too_late,
                "outputs_dropped": self.outputs_dropped, "offloaded_requests": self.moves.offloaded,
                "restored_requests": self.moves.restored, "forked_blocks": self.moves.forked_blocks,
                "swept_records": self.moves.swept, "host_seconds": self.host_seconds,
                "updates_skipped": 0 if self._updates_skipped is None else int(self._updates_skipped.item()),
                "rehomed": self.rehomed,
                "fingerprints": self.fingerprints, "max_len": self.max_len,
                "groups": {g.index: {"type": g.kind, "layers": g.layers, **g.monitor.stats()} for g in self.groups}}

    def retire(self) -> dict:
        """Take the hooks off and let go of the engine (its cache can be freed); returns the final stats."""
        self.hooks.remove_all()
        final = self.stats()
        self.groups, self.bp, self.cache, self.io, self.manager = [], None, None, None, None
        self._write_index = None
        self.moves.clear()
        return final


def _read_window(g) -> int:
    """The positions a sliding group's step reads from its cache: the window less the token itself."""
    if g.window < 2:
        raise ValueError(f"kvcanary: layer group {g.index}: a sliding window of {g.window} reads no cached token; "
                         "watch() needs a window of at least 2")
    return g.window - 1


def _loc_copies(eng, g) -> tuple:
    """(from the step rows, from the engine's write index) launches for group ``g``'s loc."""
    from ...backends.cuda import HostUpdates  # noqa: PLC0415

    dev = int(eng.device.split(":")[1])
    index = eng._write_index[g.index]
    at = eng._updates_skipped.data_ptr()
    return (HostUpdates(words=eng.steps.device_view(f"loc{g.index}").data_ptr(), copy_to=g.loc.data_ptr(), device=dev,
                        skipped=at),
            HostUpdates(words=index.data_ptr(), copy_to=g.loc.data_ptr(), device=dev, skipped=at))


def _torch_zeros(n: int, device: str):
    import torch  # noqa: PLC0415

    return torch.zeros(n, dtype=torch.int64, device=device)
