"""BlockTableCanary: one KvCanary over a block-table KV pool, driven by what attention reads.

An engine with a vLLM-style pool (block ``b`` holds slots ``b * block_size ..``, a
request's block table lists its blocks, position ``p`` lives in block
``table[p // block_size]``) hands this, every step, its attention inputs in its own
row order: the block table, each row's sequence length and query start, and the slot
mapping of the tokens it writes, plus per row the request's canary tag and token lists.
The step's check is engine-neutral: it copies each row of the block table into the
request's row of the canary's page table, verifies every slot each row reads
(positions ``[0, seq_len - query_len)``), and after the forward stamps every slot the
step wrote with its token and position, fingerprinting the live K/V bytes.

A row may read slots another row writes in the same step (a prefix-cache hit on blocks
still being filled): the engine names those rows ``deferred``; they are checked and
stamped after the other rows' stamps, still before the step ends, so the same step's
writes count as truth and every row's chain continues from stamped records.

Arrays stay where the engine keeps them: NumPy views on the CPU; on CUDA the block table
and slot mapping stay on the device (copied there into the canary's buffers), while the
per-row lengths, rows, tokens and positions, which the engine also has on the host, are
staged in pinned memory and travel in one launch with the expected tokens' changes
(:mod:`.staging`), so a step costs a handful of launches and never waits for the device.
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np

from ...backends import backend_for, cpu_backend
from .staging import ChangeUpload, StepArrays, TokenStaging
from .step_arrays import host_view, ops_for, positions
from .tables import ExpectedTable


_NO_ROWS = np.arange(0)
_NO_ROWS.flags.writeable = False
_EVERY_ROW: dict = {}


def _every_row(n: int) -> np.ndarray:
    """``arange(n)``, made once per batch size (read only)."""
    out = _EVERY_ROW.get(n)
    if out is None:
        out = _EVERY_ROW[n] = np.arange(n)
        out.flags.writeable = False
    return out


def _quiet(found) -> None:
    """The monitor's own policy: nothing; the adapter applies its policy to the engine's violations."""


@dataclasses.dataclass
class AttentionStep:
    """One step's attention inputs, rows in the engine's order.

    Attributes:
        rows: host ints ``[n]``: each row's canary table row (1 .. rows - 1, one per live request).
        tags: ``[n]``: what a violation of each row reports as its request.
        states: ``[n]``: each row's request tokens, objects with ``initial_tokens`` and
            ``generated_tokens`` (lists of ints; a position past both is unknown, not checked).
        fresh: host bools ``[n]``: the row was just (re)assigned to its request.
        block_table: int32 ``[>= n, width]``: the blocks each row's attention reads.
        seq_lens: int ``[>= n]``: tokens of each row after the step (cached plus new).
        query_start_loc: int ``[n + 1]``: each row's first token in the step's token arrays.
        slot_mapping: int64 ``[>= T]``: the slot each of the step's ``T`` tokens is written to.
        tokens: host ints ``[T]``: the step's token ids, row after row.
        deferred: host bools ``[n]`` or None: rows that read slots another row writes this step.
        host_seq_lens, host_query_start_loc: host ints ``[n]`` and ``[n + 1]``: ``seq_lens`` and
            ``query_start_loc`` as the host has them (on a GPU, a step given both never waits
            for the device; a step given neither reads them back once).
        stream: PyTorch's current stream (raw), where the forward and the step's torch ops run,
            as the engine resolved it once for the step (None: resolved here).
    """

    rows: list
    tags: list
    states: list
    fresh: list
    block_table: object
    seq_lens: object
    query_start_loc: object
    slot_mapping: object
    tokens: list
    deferred: list | None = None
    host_seq_lens: list | None = None
    host_query_start_loc: list | None = None
    stream: int | None = None


class BlockTableCanary:
    """A KvCanary over one block-table pool (one layer group of an engine).

    Args:
        num_blocks: blocks of the pool (the canary holds ``num_blocks * block_size`` records;
            block 0 must never hold a live token: its slot 0 is the canary's padding slot).
        block_size: slots per block.
        rows: canary table rows (1 + the most live requests; row 0 is padding).
        width: blocks a request's table row holds at most.
        max_batch: rows a step has at most.
        device: ``"cpu"`` (NumPy arrays) or ``"cuda:N"`` (torch tensors on that device).
        fingerprints: a :class:`~.kv_layout.ContiguousSlots` or :class:`~.kv_layout.GatheredSlots`
            (or None: no real-KV fingerprints).
        name: the monitor's name in incidents, events and metrics.
        options: further :class:`~kvcanary_cupy.KvCanary` options.

    Example (a 2-block request, prefill then one decode step)::

        >>> import numpy as np
        >>> from types import SimpleNamespace as R
        >>> c = BlockTableCanary(num_blocks=8, block_size=4, rows=3, width=4, max_batch=2, device="cpu")
        >>> req = R(initial_tokens=[5, 6, 7, 8, 9], generated_tokens=[])
        >>> bt = np.array([[3, 6, 0, 0]], np.int32)
        >>> step = AttentionStep(rows=[1], tags=["a"], states=[req], fresh=[True], block_table=bt,
        ...                      seq_lens=np.array([5]), query_start_loc=np.array([0, 5]),
        ...                      slot_mapping=np.array([12, 13, 14, 15, 24]), tokens=[5, 6, 7, 8, 9])
        >>> c.check_reads(step), c.stamp_writes(step)
        ([], [])
        >>> req.generated_tokens.append(11)
        >>> step = dataclasses.replace(step, fresh=[False], seq_lens=np.array([6]), query_start_loc=np.array([0, 1]),
        ...                            slot_mapping=np.array([25]), tokens=[11])
        >>> c.check_reads(step), c.monitor.stats()["slots_checked"]
        ([], 5)
    """

    def __init__(self, *, num_blocks: int, block_size: int, rows: int, width: int, max_batch: int, device: str,
                 fingerprints=None, name: str = "", options: dict | None = None, max_tokens: int = 8192):
        from ...monitor import KvCanary  # noqa: PLC0415

        self.ops = ops_for(device)
        self.device = device
        self.block_size = int(block_size)
        self.num_slots = int(num_blocks) * self.block_size
        self.table = self.ops.zeros((int(rows), int(width)), np.int32)
        self.staged = None if self.ops.cpu else StepArrays(max_batch=int(max_batch), loc_groups=0, device=device)
        self.valid = self.ops.zeros((int(max_batch),), np.int64) if self.staged is None \
            else self.staged.device_view("valid")
        self.expected = ExpectedTable(int(rows), 256, device, self.valid)
        self.fingerprints = fingerprints
        opts = dict(options or {})
        self._options = dict(opts)  # as given: compile_ahead builds a spare canary with them
        # A step verifies at most max_batch * width * block_size records (requests sharing a
        # prefix each verify it); a larger step grows the plan.
        opts.setdefault("verify_capacity", max(1, min(int(max_batch) * int(width) * self.block_size,
                                                      2 * self.num_slots)))
        self.monitor = KvCanary(num_slots=self.num_slots, block_table=self.table, page_size=self.block_size,
                                max_batch=int(max_batch), device=device, policy=_quiet, name=name,
                                real_kv=() if fingerprints is None else fingerprints.sources, **opts)
        # The step's rows and tokens go into buffers bound once: a step of a batch size seen
        # before then reuses the monitor's prepared op calls (no validation, no imports).
        self.max_tokens = max(1, int(max_tokens))
        if self.staged is None:
            self._rows = {k: self.ops.zeros((int(max_batch),)) for k in ("rows", "prefix", "extend")}
        else:
            self._rows = {k: self.staged.device_view(k) for k in ("rows", "prefix", "extend")}
        self._bind_tokens(self.max_tokens)
        self.upload = None if self.staged is None else ChangeUpload(device, self.staged, rows_to=self.table)
        self._step = None  # (step, prefix, extend, now, later, stream) between check_reads and stamp_writes
        self.open = False  # whether the monitor has a step open
        self.aborted = 0
        self.deferred_rows = 0
        self.slots_read = 0  # positions the step's rows read, from the engine's own lengths

    def _bind_tokens(self, n: int) -> None:
        # One allocation, rows ids / pos / loc: the ids and positions travel in one 2-D copy.
        both = self.ops.zeros((3, n))
        self._tokens = {k: both[i] for i, k in enumerate(("ids", "pos", "loc"))}
        if self.staged is not None:  # the step's token ids and positions, written on the host
            self._pinned_tokens = TokenStaging(n, self.device)
        self.max_tokens = n
        self.monitor.bind_inputs(req_pool_indices=self._rows["rows"], prefix_lens=self._rows["prefix"],
                                 extend_lens=self._rows["extend"], input_ids=self._tokens["ids"],
                                 positions=self._tokens["pos"], out_cache_loc=self._tokens["loc"])

    # ------------------------------------------------------------------ a step
    def check_reads(self, step: AttentionStep) -> list:
        """Before the forward: fill the tables and verify what the step's rows read (deferred rows
        wait for :meth:`stamp_writes`). Returns the monitor's new violation rows."""
        if self.open:  # the previous forward never reached its stamp: close that step unstamped
            self.abort()
        n = len(step.rows)
        if n == 0:
            self._step = None
            return []
        ptr = self._stream(step)
        rows = np.asarray(step.rows, dtype=np.int64)
        staged = self._stage_compiled(step, rows) if step.deferred is None else None
        if staged is None:
            prefix, extend, extend_list = self._lengths(step, n)
            self.slots_read += sum(prefix.tolist())
            # A step has a few rows: its lengths' sums and maxima are taken in Python (a NumPy
            # reduction of 8 numbers costs several microseconds in an engine step's cold caches).
            ends = [p + e for p, e in zip(prefix.tolist(), extend_list)]
        else:
            prefix, extend = staged
            extend_list, ends = extend.tolist(), self.valid[:n].tolist()
        if step.deferred is None:
            now, later = _every_row(n), _NO_ROWS
        else:
            deferred = np.asarray(step.deferred, dtype=bool)
            now, later = np.flatnonzero(~deferred), np.flatnonzero(deferred)
        self.deferred_rows += int(later.size)
        self.expected.reserve(max(ends), None)
        self.expected.fill(step.rows, step.states, ends, step.fresh)
        bt = step.block_table
        # On CUDA, with every row checked now, the staging launch copies the block table's rows
        # too (int32 rows of unit stride, as vLLM's); else torch does, after it.
        direct = (self.staged is not None and now.size == n and bt.dtype == self.table.dtype and bt.dim() == 2
                  and bt.stride(1) == 1 and bt.shape[0] >= n and bt.shape[1] <= self.table.shape[1]
                  and bt.device == self.table.device)
        if staged is None:
            self._stage_rows(rows, prefix, extend, now, ptr, rows_from=(bt, n) if direct else None)
        if not direct and self.staged is not None and now.size == n:  # the staged rows index the table
            self.table[:, :bt.shape[1]].index_copy_(0, self._rows["rows"][:n], bt[:n].to(self.table.dtype))
        elif not direct and staged is None:
            self.ops.put_rows(self.table, rows, bt)
        self._step = (step, prefix, extend, extend_list, now, later, ptr)
        if now.size:
            self._before(step, now, ptr)
        return self.monitor.poll(stream=ptr)

    def stamp_writes(self, step: AttentionStep | None = None) -> list:
        """After the forward: stamp every slot the step wrote; check and stamp deferred rows.
        Returns the monitor's new violation rows."""
        if self._step is None:
            return []
        step, prefix, extend, extend_list, now, later, ptr = self._step
        self._step = None
        total = len(step.tokens)
        ids = np.asarray(step.tokens, dtype=np.int64)
        longest = None if later.size else self._stage_tokens_compiled(step, ids, prefix, extend)
        if longest is not None:  # the step's tokens, positions and slots are in the monitor's buffers
            if self.fingerprints is not None:
                self.fingerprints.gather_slots(self._tokens["loc"][:total])
            self.open = False
            self.monitor.after_forward(num_tokens=total, max_row_tokens=longest, stream=ptr)
            return self.monitor.poll(stream=ptr, queue_next=False)
        pos = positions(prefix, extend_list, total)
        slots = self.ops.arr(step.slot_mapping)[:total] if self.ops.cpu else step.slot_mapping
        if self.fingerprints is not None and self.ops.cpu:
            self.fingerprints.gather_slots(slots)
        if now.size:
            self._after(step, extend_list, now, later, ids, pos, slots, ptr)
        if later.size:
            self._stage_rows(np.asarray(step.rows, dtype=np.int64), prefix, extend, later, ptr)
            self._before(step, later, ptr)
            self._after(step, extend_list, later, now, ids, pos, slots, ptr)
        # This poll takes the copy queued after the check (an engine asks for the step's
        # damaged requests after this call) and queues none: the write's rows and counters
        # travel in the copy queued after the next step's check, so a clean step pays one
        # copy. Rows checked after the writes get a copy of their own.
        return self.monitor.poll(stream=ptr, queue_next=bool(later.size))

    def drain(self) -> list:
        """The monitor's rows not returned yet, the last step's write included (waits for the
        device): for the end of a run, after the last :meth:`stamp_writes`."""
        return self.monitor.poll() + self.monitor.poll(queue_next=False)

    def _lengths(self, step: AttentionStep, n: int) -> tuple[np.ndarray, np.ndarray, list]:
        """``(prefix, extend, extend_list)``: host int64 ``[n]`` each row's cached tokens read and
        new tokens written, and ``extend`` as Python ints."""
        seq, qsl = step.host_seq_lens, step.host_query_start_loc
        if (seq is None or qsl is None) and self.ops.cpu:
            prefix, extend = self.ops.lengths(step.seq_lens, step.query_start_loc, n)
            return prefix, extend, extend.tolist()
        if seq is None or qsl is None:  # not given: read back once (the host waits for the device)
            import torch  # noqa: PLC0415

            both = torch.cat([step.seq_lens[:n].to(torch.int64), step.query_start_loc[:n + 1].to(torch.int64)])
            both = both.cpu().numpy()
            seq, qsl = both[:n], both[n:]
        # The host's lengths are a few Python ints: differences taken in Python, one conversion.
        q = [int(x) for x in qsl[:n + 1]]
        ext = [b - a for a, b in zip(q, q[1:])]
        both = np.array([[int(s) - e for s, e in zip(seq[:n], ext)], ext], dtype=np.int64).reshape(2, n)
        return both[0], both[1], ext

    def _stage_compiled(self, step: AttentionStep, rows: np.ndarray):
        """On the numba CPU backend, with every row checked before the forward: the rows'
        lengths, the monitor's bound rows and the table's rows in one compiled call (see
        :func:`~kvcanary_cupy.backends.numba_cpu.stage_rows`). Returns ``(prefix, extend)``,
        views of the bound rows, or None where the general path stages the step (another
        backend, or arrays of other shapes, which it reports)."""
        if not self.ops.cpu or cpu_backend() != "numba":
            return None
        n = rows.shape[0]
        qsl, seq, bt = (host_view(a) for a in (step.query_start_loc, step.seq_lens, step.block_table))
        b = self._rows
        if not (qsl.ndim == 1 and seq.ndim == 1 and bt.ndim == 2 and qsl.shape[0] > n and seq.shape[0] >= n
                and bt.shape[0] >= n and bt.shape[1] <= self.table.shape[1] and n <= b["rows"].shape[0]):
            return None
        read = backend_for("cpu").stage_rows(qsl, seq, rows, bt, self.table, b["rows"], b["prefix"], b["extend"],
                                             self.valid)
        if read < 0:
            return None
        self.slots_read += int(read)
        return b["prefix"][:n], b["extend"][:n]

    def _stage_tokens_compiled(self, step: AttentionStep, ids: np.ndarray, prefix: np.ndarray, extend: np.ndarray):
        """On the numba CPU backend, with every row stamped at once: the step's token ids,
        positions and slots into the monitor's token buffers in one compiled call (see
        :func:`~kvcanary_cupy.backends.numba_cpu.stage_tokens`). Returns the longest row's
        token count, or None where the general path stages them (another backend, more
        tokens than the buffers hold, lengths that are no layout of the step's tokens)."""
        if not self.ops.cpu or cpu_backend() != "numba" or ids.shape[0] > self.max_tokens:
            return None
        slots = host_view(step.slot_mapping)
        if slots.ndim != 1 or slots.shape[0] < ids.shape[0]:
            return None
        t = self._tokens
        longest = backend_for("cpu").stage_tokens(ids, prefix, extend, slots, t["ids"], t["pos"], t["loc"])
        return None if longest < 0 else int(longest)

    def _stage_rows(self, rows: np.ndarray, prefix: np.ndarray, extend: np.ndarray, idx: np.ndarray, ptr,
                    rows_from=None) -> None:
        """The monitor's bound rows for batch rows ``idx``; on CUDA one launch carries them, the
        expected tokens' pending changes and (``rows_from``, see :meth:`ChangeUpload.flush`) the
        block table's rows."""
        r, p, e = (rows, prefix, extend) if idx.size == rows.size else (rows[idx], prefix[idx], extend[idx])
        if self.staged is None:
            k, b = idx.size, self._rows
            b["rows"][:k], b["prefix"][:k], b["extend"][:k] = r, p, e
            self.valid[:k] = p + e
            return
        self.upload.wait_reusable()
        self.staged.set_batch(r, p, e, p + e)
        self.upload.flush([self.expected.table], stream=ptr, rows_from=rows_from)

    def _before(self, step: AttentionStep, idx: np.ndarray, ptr) -> None:
        k, b = idx.size, self._rows
        if self.fingerprints is not None and self.ops.cpu:
            self.fingerprints.gather_reads(self.table, b["rows"][:k], b["prefix"][:k])
        tags = list(step.tags) if k == len(step.tags) else [step.tags[i] for i in idx.tolist()]
        self.monitor.before_forward(batch_size=k, expected=self.expected.tokens(), request_ids=tags, stream=ptr)
        self.open = True

    def _after(self, step: AttentionStep, extend: list, idx: np.ndarray, others: np.ndarray, ids: np.ndarray,
               pos: np.ndarray, slots, ptr) -> None:
        """Stamp the tokens of rows ``idx`` (all when ``others`` is empty); ``slots``: the step's
        slot mapping (on the CPU its ``[:total]`` as NumPy)."""
        self.open = False
        total = ids.shape[0]
        keep = None
        if others.size:
            keep = np.flatnonzero(np.repeat(np.isin(np.arange(len(extend)), idx), extend))
            ids, pos = ids[keep], pos[keep]
        m = int(ids.shape[0])
        if m > self.max_tokens:
            if ptr is not None:  # queued copies and launches may still use the buffers being replaced
                import cupy  # noqa: PLC0415

                cupy.cuda.runtime.streamSynchronize(ptr)
            self._bind_tokens(max(m, 2 * self.max_tokens))
        t = self._tokens
        if self.staged is None:
            t["ids"][:m], t["pos"][:m], t["loc"][:m] = ids, pos, slots if keep is None else slots[keep]
        else:
            self._pinned_tokens.copy(ids, pos, t["ids"], t["pos"], ptr)
            slots = slots[:total] if keep is None else self.ops.select(slots, keep)
            self.ops.copy_into(t["loc"], slots, ptr)
        longest = max(extend) if others.size == 0 else max(extend[i] for i in idx.tolist())
        self.monitor.after_forward(num_tokens=m, max_row_tokens=longest, stream=ptr)

    def compile_ahead(self) -> None:
        """On the numba CPU backend, compile now what a step runs (numba compiles each op at its
        first call: seconds with nothing cached, which would stall the engine's first request):
        a throwaway request's prefill and decode, on a spare canary of this one's kind (three
        blocks, this canary's fingerprint sources and options, without events or metrics). This
        canary is not touched; the sources' shadow is refreshed from the live K/V, as every check
        refreshes it, and their gather count is kept as it was. Nothing to do elsewhere."""
        if not self.ops.cpu or cpu_backend() != "numba" or self.num_slots < 3 * self.block_size:
            return
        # Neither the compiled code's types nor the result depend on these: the spare keeps its
        # own capacity, and reports nowhere.
        opts = {k: v for k, v in self._options.items() if k not in ("events", "metrics", "verify_capacity")}
        spare = BlockTableCanary(num_blocks=3, block_size=self.block_size, rows=2, width=2, max_batch=1,
                                 device="cpu", fingerprints=self.fingerprints, name="compile-ahead", options=opts,
                                 max_tokens=8)
        gathered = getattr(self.fingerprints, "gathered", None)
        blocks = [1, 2]
        slot = [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(3)]
        request = types.SimpleNamespace(initial_tokens=[1, 2, 3], generated_tokens=[])
        steps = []
        for lengths in (np.int32, np.int64):  # an engine's lengths come in either (vLLM's: int32)
            prefill = AttentionStep(rows=[1], tags=["compile-ahead"], states=[request], fresh=[True],
                                    block_table=np.array([blocks], dtype=np.int32), seq_lens=np.array([2], lengths),
                                    query_start_loc=np.array([0, 2], lengths), slot_mapping=np.array(slot[:2]),
                                    tokens=[1, 2])
            steps += [prefill, dataclasses.replace(prefill, fresh=[False], seq_lens=np.array([3], lengths),
                                                   query_start_loc=np.array([0, 1], lengths),
                                                   slot_mapping=np.array(slot[2:]), tokens=[3])]
        try:
            for step in steps:
                spare.check_reads(step)
                spare.stamp_writes(step)
        finally:
            spare.monitor.close()
            if gathered is not None:
                self.fingerprints.gathered = gathered

    def _stream(self, step: AttentionStep):
        """The raw stream of the step's launches (None on the CPU): the step's, else PyTorch's current one."""
        if self.ops.cpu:
            return None
        if step.stream is not None:
            return int(step.stream)
        import torch  # noqa: PLC0415

        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def abort(self) -> None:
        """Close an open step without stamping (its forward failed)."""
        if self.open:
            self.monitor.abort_step()
            self.open = False
            self.aborted += 1
        self._step = None

    def poll(self) -> list:
        return self.monitor.poll()

    def stats(self) -> dict:
        out = self.monitor.stats()
        out["deferred_rows"] = self.deferred_rows
        out["slots_read"] = self.slots_read
        out["aborted_forwards"] = self.aborted
        if self.fingerprints is not None:
            out["slots_gathered"] = getattr(self.fingerprints, "gathered", 0)
        return out
