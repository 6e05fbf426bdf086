"""One layer group of the engine's cache and the KvCanary that watches it.

The engine allocates blocks per layer group: a full-attention group keeps every
block of a request (``block_table[request] = [b0, b1, ...]``, position ``p`` in
block ``p // block_size``); a sliding-window group of window ``W`` keeps a ring of
``ceil(W / block_size)`` blocks, position ``p`` at ring index ``p % W``. Blocks of
different groups never overlap, and every layer of a group stores its K/V in the
same rows of its own cache tensors, so each group gets its own monitor over the
shared row space: a page table for a full group, a token table for a sliding
group whose entries outside the window are 0 (slot 0 is never verified). The
sliding group reads the ``W - 1`` positions before a step's first token; its
table also holds the one before those, whose record the window's first link
continues.
"""
from __future__ import annotations

import numpy as np

from .tables import MirroredTable, flatten, spans


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
        self._span = np.zeros((table.host.shape[0], 2), dtype=np.int64)  # sliding: [lo, hi) set per row
        self._step_blocks = (np.zeros(0, np.int64),) * 3

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def blocks(self, request_id) -> list:
        return self.allocator.block_table.get(request_id, ())

    def fill(self, rows: np.ndarray, request_ids: list, prefix: np.ndarray, ends: np.ndarray) -> None:
        """Point each request's row at what it reads before writing positions ``prefix .. ends - 1``.

        The block lists are read from the engine's allocator every step, whole: a table
        entry the engine changed in place is seen the step after.
        """
        blocks, first, count = flatten([self.blocks(rid) for rid in request_ids])
        self._step_blocks = blocks, first, count
        bs, width = self.slot_map.block_size, self.table.width
        if not self.sliding:
            have = np.minimum(count, width)
            owner, cols = spans(np.zeros_like(have), have)
            self.table.put(rows[owner], cols, blocks[first[owner] + cols] + 1)
            need = np.minimum(-(-ends // bs), width)
            if (need > have).any():  # pages the engine does not have: page 0, never stamped, so reading fails
                owner, cols = spans(have, need)
                self.table.put(rows[owner], cols, 0)
            return
        lo, hi = np.maximum(prefix - self.window, 0), np.minimum(prefix, width)
        old_lo, old_hi = self._span[rows, 0], self._span[rows, 1]
        for a, b in ((old_lo, np.minimum(old_hi, lo)), (np.maximum(old_lo, hi), old_hi)):
            owner, cols = spans(a, b)  # positions that left the window
            self.table.put(rows[owner], cols, 0)
        owner, pos = spans(lo, hi)
        self.table.put(rows[owner], pos, self._ring_slots(blocks, first[owner], count[owner], pos))
        self._span[rows, 0], self._span[rows, 1] = lo, np.maximum(hi, lo)

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

    def step_slots(self, positions: np.ndarray) -> np.ndarray:
        """Canary slots of one position per request of the step :meth:`fill` saw, in batch order."""
        blocks, first, count = self._step_blocks
        return self._ring_slots(blocks, first, count, positions)

    def slots_of(self, request_id, positions: np.ndarray) -> np.ndarray:
        """Canary slots (int64) where the request keeps ``positions`` in this group (1 where it has
        no block for one: a slot never stamped, so reading it is a violation)."""
        blocks = np.asarray(self.blocks(request_id), dtype=np.int64)
        n = np.full(len(positions), len(blocks), dtype=np.int64)
        return self._ring_slots(blocks, np.zeros_like(n), n, np.asarray(positions, dtype=np.int64))

    def forget_rows(self) -> None:
        """The engine reset its requests: clear every sliding window a row still points at."""
        owner, cols = spans(self._span[:, 0], self._span[:, 1])
        self.table.put(owner, cols, 0)
        self._span[:] = 0


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
