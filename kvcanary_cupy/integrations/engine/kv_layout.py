"""Real-KV fingerprint sources over an engine's KV tensors, following the engine's byte layout.

A canary fingerprints slot ``s`` from the bytes a :class:`~kvcanary_cupy.RealKvSource`
puts at row ``s // page_size``, byte ``(s % page_size) * bytes_per_token``: the slot's
bytes must be contiguous. Two kinds of layout:

- :class:`ContiguousSlots`: each slot's K (and V) bytes are contiguous in the engine's
  tensor (e.g. a flash-attention pool ``[2, num_blocks, block_size, kv_heads, head_dim]``,
  whose ``[0]`` and ``[1]`` are ``[num_blocks, block_size, kv_heads * head_dim]`` pages):
  sources over the engine's own tensors, nothing to do per step.
- :class:`GatheredSlots`: a slot's bytes are scattered through its block (e.g. a CPU
  attention block stores each head's keys transposed, ``[head_dim, block_size]``): the
  elements of each slot a step reads or writes are gathered, just before the check or
  the stamp, into a slot-major shadow that the sources read. The shadow holds the
  sampled elements only (the first 16 bytes of K and of V of every layer, as the
  monitor's PARTIAL mode hashes; all of them in ALL mode), so the fingerprint is of the
  live bytes at the moment of the check. On the ``"numba"`` CPU backend the gather is
  compiled too (the same copies).
"""
from __future__ import annotations

import numpy as np

from ...backends import backend_for, cpu_backend
from ...canary import RealKvSource
from ...format import KV_CHUNK_BYTES, RealKvMode

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class ContiguousSlots:
    """Sources over K and V tensors whose slots are contiguous pages.

    Args:
        pages: per layer, ``(key_pages, value_pages)``: arrays ``[num_blocks, block_size, ...]``
            (C-contiguous, any dtype, any framework), slot ``b * block_size + i`` at ``[b, i]``.
        block_size: slots per block.

    Example::

        >>> import numpy as np
        >>> kv = np.zeros((2, 4, 8, 2, 16), np.float16)  # [K/V, blocks, block_size, heads, head_dim]
        >>> s = ContiguousSlots([(kv[0], kv[1])], block_size=8)
        >>> len(s.sources), s.sources[0].bytes_per_token, s.sources[0].num_slots
        (2, 64, 32)
    """

    def __init__(self, pages, *, block_size: int):
        self.sources = []
        for k, v in pages:
            for t in (k, v):
                bpt = int(np.prod(t.shape[2:])) * _itemsize(t)
                self.sources.append(RealKvSource(t, page_size=int(block_size), bytes_per_token=bpt))

    def gather_reads(self, table, rows, prefix) -> int:
        """Nothing to gather: the sources read the engine's tensors. Returns 0 slots."""
        return 0

    def gather_slots(self, slots) -> int:
        return 0


class GatheredSlots:
    """A slot-major shadow of the sampled K/V elements of every layer, refreshed per step.

    Args:
        layers: per layer, the engine's KV tensor as a NumPy array (CPU), any shape, whose
            block ``b`` is the ``block_elems`` elements from ``b * block_elems`` of its flat view.
        block_size: slots per block.
        key_offsets, value_offsets: int64 ``[block_size, n]``: element offsets, inside a block,
            of the K (V) elements of the slot at each offset, in the order they are hashed
            (``n``: every element of the slot's K, head after head).
        mode: the monitor's :class:`~kvcanary_cupy.RealKvMode`: PARTIAL keeps the first 16
            bytes of K and of V per slot and layer, ALL keeps them all.
        num_slots: the canary's slots (``num_blocks * block_size``).

    Example (a block stores keys transposed, ``[dim, slot]``, then values ``[slot, dim]``)::

        >>> import numpy as np
        >>> bs, dim = 4, 8
        >>> kv = np.arange(3 * 2 * bs * dim, dtype=np.float32).reshape(3, 2 * bs * dim)  # 3 blocks
        >>> k_off = np.arange(dim)[None, :] * bs + np.arange(bs)[:, None]            # key d of slot i: d * bs + i
        >>> v_off = bs * dim + np.arange(bs)[:, None] * dim + np.arange(dim)[None, :]
        >>> g = GatheredSlots([kv], block_size=bs, key_offsets=k_off, value_offsets=v_off,
        ...                   mode=RealKvMode.PARTIAL, num_slots=12)
        >>> g.gather_slots(np.array([5]))
        1
        >>> g.shadow[0, 5].view(np.float32).tolist(), g.shadow[1, 5].view(np.float32).tolist()
        ([65.0, 69.0, 73.0, 77.0], [104.0, 105.0, 106.0, 107.0])
    """

    def __init__(self, layers, *, block_size: int, key_offsets, value_offsets, mode, num_slots: int):
        item = _itemsize(layers[0])
        width = key_offsets.shape[1]
        if RealKvMode(int(mode)) != RealKvMode.ALL:
            width = min(width, KV_CHUNK_BYTES // item)
        if (width * item) % KV_CHUNK_BYTES:
            raise ValueError(f"kvcanary: real_kv_mode: a slot's sampled K/V is {width * item} bytes, not a "
                             f"multiple of 16; use real_kv_mode=RealKvMode.PARTIAL or NONE")
        word = _UINT[item]
        self.block_size = int(block_size)
        self.block_elems = int(np.asarray(layers[0]).reshape(-1).shape[0] // _num_blocks(layers[0], num_slots,
                                                                                          block_size))
        self._flat = [np.asarray(t).reshape(-1).view(word) for t in layers]
        self._layers = tuple(self._flat)
        # K then V of each slot offset: one gather index per slot offset, [block_size, 2 * width].
        self._offsets = np.concatenate([np.asarray(key_offsets, np.int64)[:, :width],
                                        np.asarray(value_offsets, np.int64)[:, :width]], axis=1)
        self.width = width
        # [2 * layers, num_slots, width]: source 2l is layer l's K, 2l + 1 its V (zeros until gathered).
        self.shadow = np.zeros((2 * len(layers), int(num_slots), width), dtype=word)
        # The same memory as one item per slot (its sampled K or V bytes), so that a step's
        # slots are stored with one 1-D scatter per source, not one per element row.
        self._items = np.dtype((np.void, width * item))
        self._slot_items = self.shadow.view(self._items)[..., 0]  # [2 * layers, num_slots]
        self.sources = [RealKvSource(self.shadow, page_size=1, bytes_per_token=width * item, layer_axis=True)]
        self.gathered = 0  # slot gathers so far (a slot and all its layers count once)

    def gather_reads(self, table, rows, prefix) -> int:
        """Gather the slots rows ``rows`` of page ``table`` map for positions ``[0, prefix[i])``."""
        rows = np.asarray(rows, dtype=np.int64)
        prefix = np.asarray(prefix, dtype=np.int64)
        if cpu_backend() == "numba":  # the same copies, compiled (see use_cpu_backend)
            n = backend_for("cpu").gather_reads(self._layers, self._offsets, self.block_elems, self.block_size,
                                                self.shadow, np.asarray(table), rows, prefix)
            self.gathered += n
            return n
        total = int(prefix.sum())
        if total == 0:
            return 0
        owner = np.repeat(rows, prefix)
        pos = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(prefix) - prefix, prefix)
        pages = np.asarray(table)[owner, pos // self.block_size].astype(np.int64)
        return self._gather(pages * self.block_size + pos % self.block_size)

    def gather_slots(self, slots) -> int:
        """Refresh the shadow at canary slots ``slots`` (int ``[n]``; those outside the pool are
        left for the check to report) from the live KV of every layer."""
        slots = np.asarray(slots, dtype=np.int64)
        if cpu_backend() == "numba":
            n = backend_for("cpu").gather_slots(self._layers, self._offsets, self.block_elems, self.block_size,
                                                self.shadow, slots)
            self.gathered += n
            return n
        return self._gather(slots)

    def _gather(self, slots: np.ndarray) -> int:
        slots = slots[(slots >= 0) & (slots < self.shadow.shape[1])]
        if not slots.size:
            return 0
        block, at = np.divmod(slots, self.block_size)
        idx = self._offsets[at]
        idx += (block * self.block_elems)[:, None]
        for i, flat in enumerate(self._flat):
            got = flat[idx].view(self._items)  # [n, 2]: the slot's K item, then its V item
            self._slot_items[2 * i, slots] = got[:, 0]
            self._slot_items[2 * i + 1, slots] = got[:, 1]
        self.gathered += int(slots.size)
        return int(slots.size)


def _itemsize(t) -> int:
    size = getattr(t, "element_size", None)
    return int(size()) if callable(size) else int(np.asarray(t).itemsize)


def _num_blocks(t, num_slots: int, block_size: int) -> int:
    return int(num_slots) // int(block_size)
