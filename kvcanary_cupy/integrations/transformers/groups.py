"""One layer group of the engine's cache and the KvCanary that watches it.

The engine allocates blocks per layer group: a full-attention group keeps every
block of a request (``block_table[request] = [b0, b1, ...]``, position ``p`` in
block ``p // block_size``); a sliding-window group of window ``W`` keeps a ring of
``ceil(W / block_size)`` blocks, position ``p`` at ring index ``p % W``. Blocks of
different groups never overlap, and every layer of a group stores its K/V in the
same rows of its own cache tensors, so each group gets its own monitor over the
shared row space: a page table for a full group, a token table for a sliding
group whose entries outside the window are 0. The sliding group reads the
``W - 1`` positions before a step's first token (its monitor's ``window``), from
its ring before the step writes into it; its table also holds the one before
those, whose record the window's first link continues, and the positions the
step writes: after the write, the ring holds the ``W`` positions up to the
step's last one, the window the next step (and a check after the write) reads.

A table row is a function of the block list it was written from (and, for a
sliding group, of its window): each row keeps a copy of that list, and a step
compares the engine's list with it (the engine, or a fault, may change a list in
place). A row whose list is unchanged gets only what moved: nothing for a full
group, the positions that entered and left the window for a sliding one; a full
group's row whose list only grew gets the new blocks' pages. Any other row is
rewritten whole, exactly as a first fill would.
"""
from __future__ import annotations

import itertools
import operator

import numpy as np

from ..engine.tables import MirroredTable, as_ints, flatten, spans

# A window that moved by more positions than this is rewritten with NumPy rather than position by position.
_SLIDE_MAX = 16


class LayerGroup:
    """A layer group: its allocator, its request table and its monitor.

    Args:
        index: the group's index in the engine's cache.
        kind: ``"full_attention"`` or ``"sliding_attention"``.
        layers: the model layers of the group.
        allocator: the engine's cache allocator of the group (``block_table``: request id -> blocks).
        window: the sliding window (sliding groups), else None.
        slot_map: the engine-row / canary-slot shift.
        table: the group's :class:`MirroredTable` (pages or slots per row).
    """

    def __init__(self, *, index: int, kind: str, layers: tuple, allocator, window: int | None, slot_map, table):
        self.index = index
        self.kind = kind
        self.layers = tuple(layers)
        self.allocator = allocator
        self.window = window
        self.slot_map = slot_map
        self.table = table
        self.monitor = None  # the KvCanary, set by the engine canary
        self.loc = None  # the canary slots the step wrote (the monitor's bound out_cache_loc)
        rows = table.host.shape[0]
        self._seen: list = [None] * rows  # per row: a copy of the block list the row was written from
        self._span = [(0, 0)] * rows  # sliding: the positions [lo, hi) each row maps (see _window)
        self._step_rows: list = []

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def blocks(self, request_id) -> list:
        return self.allocator.block_table.get(request_id, ())

    def fill(self, rows, request_ids: list, prefix, ends) -> None:
        """Point each request's row at what it reads before writing positions ``prefix .. ends - 1``.

        The block lists are read from the engine's allocator every step, whole, and
        compared with the ones each row was written from: an entry the engine (or a
        fault) changed in place is seen the step after. ``rows``, ``prefix`` and
        ``ends`` are per request (sequences or arrays).
        """
        rows, prefix, ends = as_ints(rows), as_ints(prefix), as_ints(ends)
        lists = list(map(self.allocator.block_table.get, request_ids, itertools.repeat(())))
        self._step_rows = rows
        if self.sliding:
            self._fill_windows(rows, lists, prefix, ends)
        else:
            self._fill_pages(rows, lists, ends)

    def _fill_pages(self, rows: list, lists: list, ends: list) -> None:
        """Full group: the pages of blocks appended to a row's list; rows whose list changed
        otherwise, or that read past their last block, are rewritten."""
        seen, bs, width = self._seen, self.slot_map.block_size, self.table.width
        # The common step, in C: every list as its row holds it, and covering what the request reads.
        if list(map(seen.__getitem__, rows)) == lists and all(
                map(operator.ge, map(operator.mul, map(len, lists), itertools.repeat(bs)), ends)):
            return
        flat, values, stale = [], [], []
        for i, (row, blocks, end) in enumerate(zip(rows, lists, ends)):
            old = seen[row]
            if blocks == old and end <= len(blocks) * bs:
                continue
            n = -1 if old is None else len(old)
            if 0 <= n < len(blocks) <= width and end <= len(blocks) * bs and blocks[:n] == old:
                base = row * width
                flat.extend(range(base + n, base + len(blocks)))
                values.extend(b + 1 for b in blocks[n:])
                old.extend(blocks[n:])
            else:
                stale.append(i)
        if flat:
            self.table.put_list(flat, values)
        if stale:
            self._write_pages([rows[i] for i in stale], [lists[i] for i in stale], [ends[i] for i in stale])
            for i in stale:
                seen[rows[i]] = list(lists[i])

    def _write_pages(self, rows: list, lists: list, ends: list) -> None:
        """Write whole rows: every page of each request, then page 0 for the pages it reads but lacks."""
        blocks, first, count = flatten(lists)
        rows, ends = np.array(rows, dtype=np.int64), np.array(ends, dtype=np.int64)
        bs, width = self.slot_map.block_size, self.table.width
        have = np.minimum(count, width)
        owner, cols = spans(np.zeros_like(have), have)
        self.table.put(rows[owner], cols, blocks[first[owner] + cols] + 1)
        need = np.minimum(-(-ends // bs), width)
        if (need > have).any():  # pages the engine does not have: page 0, never stamped, so reading fails
            owner, cols = spans(have, need)
            self.table.put(rows[owner], cols, 0)

    def _window(self, prefix: int, end: int) -> tuple[int, int]:
        """The positions ``[lo, hi)`` a sliding group's row maps for a step that reads before
        ``prefix`` and writes up to ``end``: the ``window`` before ``prefix`` and those written."""
        lo = prefix - self.window if prefix > self.window else 0
        return lo, max(min(end, self.table.width), lo)

    def _fill_windows(self, rows: list, lists: list, prefix: list, ends: list) -> None:
        """Sliding group: each row maps the positions ``[prefix - window, end)``, 0 elsewhere.

        A row whose block list is unchanged and whose span moved a little gets the
        positions that left (0) and entered (their slots); the others are rewritten. The
        common step, a span one position further (a decode step), is written inline: the
        position the step writes enters, and once the window is full the oldest leaves.
        """
        seen, span = self._seen, self._span
        w, width = self.window, self.table.width
        bs, shift = self.slot_map.block_size, self.slot_map.shift
        flat, values, stale = [], [], []
        for i, (row, blocks, p, e) in enumerate(zip(rows, lists, prefix, ends)):
            same = blocks == seen[row]
            lo, hi = self._window(p, e)
            old_lo, old_hi = span[row]
            if same and hi == old_hi + 1 and old_lo <= lo <= min(old_lo + 1, old_hi):
                k, off = divmod(old_hi % w, bs)
                if k < len(blocks):
                    base = row * width
                    flat.append(base + old_hi)
                    values.append(blocks[k] * bs + off + shift)
                    if lo > old_lo:
                        flat.append(base + old_lo)
                        values.append(0)
                    span[row] = (lo, hi)
                    continue
            if same and lo == old_lo and hi == old_hi:
                continue
            if not same or abs(lo - old_lo) + abs(hi - old_hi) > _SLIDE_MAX:
                stale.append(i)
                continue
            base = row * width
            for pos in (*range(old_lo, min(old_hi, lo)), *range(max(old_lo, hi), old_hi)):  # left the span
                flat.append(base + pos)
                values.append(0)
            for pos in (*range(lo, min(hi, old_lo)), *range(max(lo, old_hi), hi)):  # entered it
                flat.append(base + pos)
                values.append(self._ring_slot(blocks, pos))
            span[row] = (lo, hi)
        if flat:
            self.table.put_list(flat, values)
        if stale:
            self._write_windows([rows[i] for i in stale], [lists[i] for i in stale], [prefix[i] for i in stale],
                                [ends[i] for i in stale])

    def _write_windows(self, rows: list, lists: list, prefix: list, ends: list) -> None:
        """Rewrite whole spans: 0 where a row's previous span no longer reaches, the slots of the new one."""
        blocks, first, count = flatten(lists)
        old = np.array([self._span[r] for r in rows], dtype=np.int64).reshape(-1, 2)
        old_lo, old_hi = old[:, 0], old[:, 1]
        lo, hi = self._windows(prefix, ends)
        for r, blk, a, b in zip(rows, lists, lo.tolist(), hi.tolist()):
            self._span[r] = (a, b)
            self._seen[r] = list(blk)
        rows = np.array(rows, dtype=np.int64)
        for a, b in ((old_lo, np.minimum(old_hi, lo)), (np.maximum(old_lo, hi), old_hi)):
            owner, cols = spans(a, b)  # positions that left the span
            self.table.put(rows[owner], cols, 0)
        owner, pos = spans(lo, hi)
        self.table.put(rows[owner], pos, self._ring_slots(blocks, first[owner], count[owner], pos))

    def _windows(self, prefix, ends) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_window` of each row, as int64 arrays ``(lo, hi)``."""
        prefix = np.asarray(prefix, dtype=np.int64)
        lo = np.maximum(prefix - self.window, 0)
        return lo, np.maximum(np.minimum(np.asarray(ends, dtype=np.int64), self.table.width), lo)

    def _ring_slot(self, blocks: list, position: int) -> int:
        """:meth:`_ring_slots` of one position, in plain Python."""
        bs = self.slot_map.block_size
        idx = position % self.window if self.sliding else position
        k = idx // bs
        return blocks[k] * bs + idx % bs + self.slot_map.shift if k < len(blocks) else 1

    def _ring_slots(self, blocks, first, count, positions) -> np.ndarray:
        """Canary slots of ``positions`` given each one's request blocks (``first``, ``count`` into ``blocks``);
        1 (the canary's unused first page: never stamped) where the request has no such block."""
        bs = self.slot_map.block_size
        idx = positions % self.window if self.sliding else positions
        k = idx // bs
        have = k < count
        at = np.where(have, first + k, 0)
        found = blocks[at] * bs + idx % bs + self.slot_map.shift if len(blocks) else np.zeros_like(at)
        return np.where(have, found, 1)

    def step_slots(self, positions) -> list:
        """Canary slots of one position per request of the step :meth:`fill` saw, in batch order
        (:meth:`_ring_slot` of each, inlined: a decode step asks for every request's)."""
        seen, window = self._seen, self.window
        bs, shift = self.slot_map.block_size, self.slot_map.shift
        out = []
        for row, p in zip(self._step_rows, as_ints(positions)):
            blocks = seen[row]
            k, off = divmod(p % window if window else p, bs)
            out.append(blocks[k] * bs + off + shift if k < len(blocks) else 1)
        return out

    def slots_of(self, request_id, positions: np.ndarray) -> np.ndarray:
        """Canary slots (int64) where the request keeps ``positions`` in this group (1 where it has
        no block for one: a slot never stamped, so reading it is a violation)."""
        blocks = np.asarray(self.blocks(request_id), dtype=np.int64)
        n = np.full(len(positions), len(blocks), dtype=np.int64)
        return self._ring_slots(blocks, np.zeros_like(n), n, np.asarray(positions, dtype=np.int64))

    def forget_rows(self) -> None:
        """The engine reset its requests: clear every sliding window a row still points at, and
        forget the block lists, so every row is rewritten at its next fill."""
        if self.sliding:
            owner, cols = spans(*np.array(self._span, dtype=np.int64).reshape(-1, 2).T)
            self.table.put(owner, cols, 0)
        self._span[:] = [(0, 0)] * len(self._span)
        self._seen[:] = [None] * len(self._seen)
        self._step_rows = []


def build_groups(cache, slot_map, *, rows: int, max_len: int, device: str) -> list[LayerGroup]:
    """A :class:`LayerGroup` per layer group of ``cache``, tables allocated, monitors not yet.

    Full groups get a page table ``[rows, num_blocks + 1]``; sliding groups a token
    table ``[rows, max_len]``.
    """
    from transformers.generation.continuous_batching.cache_manager import (  # noqa: PLC0415
        SlidingAttentionCacheAllocator)

    layers: dict[int, list] = {}
    for layer, (g, _) in sorted(cache.layer_index_to_group_indices.items()):
        layers.setdefault(g, []).append(layer)
    out = []
    for g, alloc in enumerate(cache.group_cache_managers):
        sliding = isinstance(alloc, SlidingAttentionCacheAllocator)
        width = max_len if sliding else cache.num_blocks + 1
        out.append(LayerGroup(index=g, kind="sliding_attention" if sliding else "full_attention",
                              layers=tuple(layers.get(g, ())), allocator=alloc,
                              window=int(alloc.sliding_window) if sliding else None, slot_map=slot_map,
                              table=MirroredTable(rows, width, device)))
    return out
