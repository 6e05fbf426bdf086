"""Engine cache rows and canary slots, and the real-KV sources over the engine's cache.

The engine's ``PagedAttentionCache`` keeps, per layer of a layer group, a key and
a value tensor of ``(num_blocks + 2) * block_size`` rows; row ``b * block_size + i``
is offset ``i`` of block ``b``. Row 0 (block 0, offset 0) holds a live token, but
a canary reserves slot 0 as padding and never verifies it. The adapter therefore
shifts every row by one whole block: canary slot = engine row + ``block_size``,
canary page = engine block + 1. Page 0 of the canary is never used, no live row
goes unchecked, and block tables stay page tables (``page_size = block_size``).

The fingerprints must see the same shift: canary slot ``s`` must hash engine row
``s - block_size``. A :class:`~kvcanary_cupy.RealKvSource` that takes
``slot_offset`` expresses that directly over the engine's own tensors. Without
it, the adapter re-homes each cache tensor, before the engine writes anything,
into a buffer one block longer whose first block is padding, hands the engine
the view that skips that block (same shape, same contents) and fingerprints the
whole buffer: its row ``s`` is engine row ``s - block_size``.
"""
from __future__ import annotations

import numpy as np

from ...canary import RealKvSource
from ...format import KV_CHUNK_BYTES


class SlotMap:
    """The shift between an engine cache's rows and a canary's slots.

    Args:
        block_size: the engine's block size (rows per block).
        engine_rows: rows of each cache tensor (``(num_blocks + 2) * block_size``).

    Example::

        >>> m = SlotMap(block_size=4, engine_rows=40)
        >>> m.num_slots, m.pages([0, 3]).tolist(), m.block_slots([0, 2]).tolist()
        (44, [1, 4], [4, 5, 6, 7, 12, 13, 14, 15])
        >>> m.engine_row(4)
        0
    """

    def __init__(self, *, block_size: int, engine_rows: int):
        self.block_size = int(block_size)
        self.shift = self.block_size
        self.engine_rows = int(engine_rows)
        self.num_slots = self.engine_rows + self.shift

    def pages(self, blocks) -> np.ndarray:
        """Canary pages (int32) of engine blocks."""
        return np.asarray(blocks, dtype=np.int32) + 1

    def slots(self, rows) -> np.ndarray:
        """Canary slots (int64) of engine rows."""
        return np.asarray(rows, dtype=np.int64) + self.shift

    def block_slots(self, blocks) -> np.ndarray:
        """Every canary slot (int64) of engine blocks, block after block."""
        b = np.asarray(blocks, dtype=np.int64).reshape(-1, 1)
        return ((b + 1) * self.block_size + np.arange(self.block_size, dtype=np.int64)).reshape(-1)

    def engine_row(self, slot: int) -> int:
        """The engine row of a canary slot (negative for the canary's unused first page)."""
        return int(slot) - self.shift


def offset_supported() -> bool:
    """Whether :class:`RealKvSource` takes ``slot_offset`` (the fingerprint sees the shift itself)."""
    import inspect  # noqa: PLC0415

    return "slot_offset" in inspect.signature(RealKvSource.__init__).parameters


def bytes_per_row(cache) -> int:
    """Bytes of one row of one cache tensor."""
    t = cache.key_cache[0]
    return int(t[0].numel()) * int(t.element_size())


def kv_sources(cache, slot_map: SlotMap, offloading=None, *, rehome: bool | None = None) -> tuple[list, bool]:
    """Real-KV sources over every key and value tensor of ``cache`` in the canary's slot space.

    Returns ``(sources, rehomed)``. Rows whose size is not a multiple of 16 bytes
    cannot be fingerprinted: then no source (the caller reports it). ``rehome``:
    None picks ``slot_offset`` when the library has it, else re-homes; re-homing
    also re-points the block views ``offloading`` (the engine's OffloadingManager)
    made of the old tensors.
    """
    bpt = bytes_per_row(cache)
    if bpt % KV_CHUNK_BYTES:
        return [], False
    if rehome is None:
        rehome = not offset_supported()
    if not rehome:
        return [RealKvSource(t, page_size=1, bytes_per_token=bpt, slot_offset=slot_map.shift)
                for t in (*cache.key_cache, *cache.value_cache)], False
    padded = _rehome(cache, slot_map.shift, offloading)
    return [RealKvSource(t, page_size=1, bytes_per_token=bpt) for t in padded], True


def _rehome(cache, shift: int, offloading) -> list:
    """Move every cache tensor into a buffer with ``shift`` padding rows in front; returns the buffers.

    Runs before the engine's first forward, graph capture or compile: the engine
    then only ever sees the new tensors. One tensor at a time, so the peak extra
    memory is one tensor.
    """
    import torch  # noqa: PLC0415

    views = {"key": getattr(offloading, "_gpu_key_views", None), "value": getattr(offloading, "_gpu_value_views", None)}
    padded = []
    for kind, tensors in (("key", cache.key_cache), ("value", cache.value_cache)):
        for j, old in enumerate(tensors):
            buf = torch.empty((old.shape[0] + shift, *old.shape[1:]), dtype=old.dtype, device=old.device)
            buf[:shift].zero_()
            buf[shift:].copy_(old)  # keeps the zeroed read-trash block
            new = buf[shift:]
            torch._dynamo.mark_static_address(buf)
            torch._dynamo.mark_static_address(new)
            tensors[j] = new
            v = views[kind]
            if v:  # the swap pool's block-shaped views of the old tensor
                v[j] = new.view(-1, cache.block_size, *old.shape[1:])
            padded.append(buf)
    return padded
