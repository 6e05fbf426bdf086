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

Arrays stay where the engine keeps them (:mod:`.step_arrays`): NumPy on the CPU, torch
on CUDA.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .step_arrays import ops_for
from .tables import ExpectedTable


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
        host_seq_lens: host ints ``[n]``: ``seq_lens`` on the host (needed when the arrays
            live on a GPU, so the step never waits for the device).
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
        self.valid = self.ops.zeros((int(max_batch),), np.int64)
        self.expected = ExpectedTable(int(rows), 256, device, self.valid)
        self.fingerprints = fingerprints
        opts = dict(options or {})
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
        self._rows = {k: self.ops.zeros((int(max_batch),)) for k in ("rows", "prefix", "extend")}
        self._bind_tokens(self.max_tokens)
        self.upload = None
        if not self.ops.cpu:
            from .staging import ChangeUpload  # noqa: PLC0415

            self.upload = ChangeUpload(device)
        self._step = None  # (step, prefix, extend, now, deferred) between check_reads and stamp_writes
        self.open = False  # whether the monitor has a step open
        self.aborted = 0
        self.deferred_rows = 0
        self.slots_read = 0  # positions the step's rows read, from the engine's own lengths

    def _bind_tokens(self, n: int) -> None:
        self._tokens = {k: self.ops.zeros((n,)) for k in ("ids", "pos", "loc")}
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
        ops, n = self.ops, len(step.rows)
        if n == 0:
            self._step = None
            return []
        ops.put_rows(self.table, step.rows, step.block_table)
        prefix, extend = ops.lengths(step.seq_lens, step.query_start_loc, n)
        if ops.cpu:
            self.slots_read += int(prefix.sum())
        ends = step.host_seq_lens if step.host_seq_lens is not None else prefix + extend
        ends = np.asarray(ends, dtype=np.int64) if ops.cpu else list(map(int, ends))
        self.expected.reserve(int(max(ends)), None)
        self.expected.fill(step.rows, step.states, ends, step.fresh)
        if self.upload is not None:
            self.upload.flush([self.expected.table])
        deferred = np.zeros(n, dtype=bool) if step.deferred is None else np.asarray(step.deferred, dtype=bool)
        now = np.flatnonzero(~deferred)
        self.deferred_rows += int(n - now.size)
        self._step = (step, prefix, extend, now, np.flatnonzero(deferred))
        if now.size:
            self._before(step, prefix, extend, now)
        return self.poll()

    def stamp_writes(self, step: AttentionStep | None = None) -> list:
        """After the forward: stamp every slot the step wrote; check and stamp deferred rows.
        Returns the monitor's new violation rows."""
        if self._step is None:
            return []
        step, prefix, extend, now, later = self._step
        self._step = None
        ops = self.ops
        total = len(step.tokens)
        slots = ops.arr(step.slot_mapping[:total])
        ids = ops.from_host(step.tokens)
        pos = ops.positions(prefix, extend, total)
        if self.fingerprints is not None:
            self.fingerprints.gather_slots(slots if ops.cpu else None)
        if now.size:
            self._after(now, later, extend, ids, pos, slots)
        if later.size:
            self._before(step, prefix, extend, later)
            self._after(later, now, extend, ids, pos, slots)
        return self.poll()

    def _before(self, step: AttentionStep, prefix, extend, idx: np.ndarray) -> None:
        ops, k, b = self.ops, idx.size, self._rows
        b["rows"][:k] = ops.from_host(np.asarray(step.rows, dtype=np.int64)[idx])
        b["prefix"][:k] = ops.select(prefix, idx)
        b["extend"][:k] = ops.select(extend, idx)
        self.valid[:k] = b["prefix"][:k] + b["extend"][:k]
        if self.fingerprints is not None and ops.cpu:
            self.fingerprints.gather_reads(self.table, b["rows"][:k], b["prefix"][:k])
        self.monitor.before_forward(batch_size=k, expected=self.expected.tokens(),
                                    request_ids=[step.tags[i] for i in idx])
        self.open = True

    def _after(self, idx: np.ndarray, others: np.ndarray, extend, ids, pos, slots) -> None:
        """Stamp the tokens of rows ``idx`` (all when ``others`` is empty)."""
        self.open = False
        if others.size:
            ext = extend if self.ops.cpu else extend.cpu().numpy()
            keep = np.flatnonzero(np.repeat(np.isin(np.arange(len(ext)), idx), np.asarray(ext)))
            sel = self.ops.select
            ids, pos, slots = sel(ids, keep), sel(pos, keep), sel(slots, keep)
        m = int(ids.shape[0])
        if m > self.max_tokens:
            self._bind_tokens(max(m, 2 * self.max_tokens))
        t = self._tokens
        t["ids"][:m], t["pos"][:m], t["loc"][:m] = ids, pos, slots
        self.monitor.after_forward(num_tokens=m)

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
