"""A toy model: deterministic K/V bytes per (token, position), written into real pools."""
from __future__ import annotations

import numpy as np

from .. import runtime
from ..canary import RealKvSource
from ..format import splitmix64

_GOLD = np.uint64(0x9E3779B97F4A7C15)
_POS = np.uint64(0xD1B54A32D192ED03)


def kv_bytes(tokens, positions, layers: int, bytes_per_token: int, salt: int) -> np.ndarray:
    """uint8 ``[layers, n, bytes_per_token]``: what the model writes for each token.

    A pure function of (token, position, layer, salt), so two sequences with the
    same prefix write the same bytes and a cache hit reads what it expects.
    """
    t = np.asarray(tokens, dtype=np.int64).view(np.uint64)
    p = np.asarray(positions, dtype=np.int64).view(np.uint64)
    words = bytes_per_token // 8
    base = splitmix64((t * _GOLD) ^ (p * _POS) ^ np.uint64(salt))
    j = np.arange(layers * words, dtype=np.uint64).reshape(layers, 1, words)
    w = splitmix64(base.reshape(1, -1, 1) ^ (j * _GOLD + np.uint64(salt)))
    return np.ascontiguousarray(w).view(np.uint8).reshape(layers, t.shape[0], bytes_per_token)


class KvPool:
    """A K/V byte pool ``[layers, slots, bytes_per_token]`` on the sim's device.

    Paged (``page_size > 1``) pools are allocated ``[layers, pages, page_size,
    bytes_per_token]`` like a vLLM cache and written through a flat view.
    """

    def __init__(self, *, layers: int, num_slots: int, page_size: int, bytes_per_token: int, device: str, salt: int):
        shape = (layers, num_slots, bytes_per_token) if page_size == 1 else \
            (layers, num_slots // page_size, page_size, bytes_per_token)
        self.data = runtime.empty(shape, np.uint8, device, fill=0)
        self.flat = self.data.reshape(layers, num_slots, bytes_per_token)
        self.layers, self.page_size, self.bytes_per_token, self.salt = layers, page_size, bytes_per_token, salt
        self.device = device

    def source(self) -> RealKvSource:
        return RealKvSource(self.data, page_size=self.page_size, bytes_per_token=self.bytes_per_token,
                            layer_axis=True)

    def write(self, slots, tokens, positions) -> None:
        """The model's store: bytes of (token, position) at each slot (negative slots skipped)."""
        slots = np.asarray(slots, dtype=np.int64)
        keep = slots >= 0
        if not keep.any():
            return
        b = kv_bytes(np.asarray(tokens)[keep], np.asarray(positions)[keep], self.layers, self.bytes_per_token,
                     self.salt)
        if self.device == "cpu":
            self.flat[:, slots[keep]] = b
        else:
            xp = runtime.array_module(self.device)
            self.flat[:, xp.asarray(slots[keep])] = xp.asarray(b)

    def flip(self, slot: int, layer: int, byte: int, mask: int = 0x10) -> None:
        """A stray write: flip bits of one byte."""
        self.flat[layer, slot, byte] ^= np.uint8(mask)
