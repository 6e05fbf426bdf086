"""Sliding-window slots: ``out_cache_loc`` translated through the SWA LUT.

The SWA pool's canary is stamped at SWA-pool slots. When the engine does not pass
them, they are ``lut[out_cache_loc]``, computed on the device into scratch
buffers allocated ahead (no allocation per step, so a step can be captured).
"""
from __future__ import annotations

import numpy as np

from .. import runtime
from .lifetime import Keepalive


class SwaTranslation:
    """``lut[loc]`` per token (-1 where ``loc`` is negative or past the LUT), in reused scratch.

    Example::

        >>> import numpy as np
        >>> t = SwaTranslation("cpu", Keepalive("cpu"))
        >>> lut = np.array([0, 5, 6, 7], np.int32)
        >>> t.translate(np.array([2, -1, 3, 9]), lut, None).tolist()
        [6, -1, 7, -1]
    """

    def __init__(self, device: str, keepalive: Keepalive):
        self.device = device
        self.xp = runtime.array_module(device)
        self._keepalive = keepalive
        self._scratch = None  # (index, slots, mask, mask, [-1]), the slots in the LUT's dtype

    @property
    def capacity(self) -> int:
        """Tokens the scratch holds now (0: none allocated)."""
        return 0 if self._scratch is None else int(self._scratch[0].shape[0])

    def reserve(self, n: int, lut) -> None:
        """Scratch for at least ``n`` tokens of a LUT like ``lut``."""
        if self._scratch is not None and self.capacity >= n:
            return
        n, dev = max(n, 1), self.device
        self.forget()
        self._scratch = (runtime.empty((n,), np.int64, dev), runtime.empty((n,), lut.dtype, dev),
                         runtime.empty((n,), np.bool_, dev), runtime.empty((n,), np.bool_, dev),
                         runtime.empty((1,), lut.dtype, dev, fill=-1))

    def forget(self) -> None:
        """Drop the scratch (e.g. for a LUT of another dtype); queued work keeps the old one alive."""
        if self._scratch is not None:
            self._keepalive.hold(self._scratch)
        self._scratch = None

    def translate(self, loc, lut, ptr):
        """SWA slots of the ``loc`` tokens, on stream ``ptr``; a view of the scratch, valid until the
        next call. Outside a graph capture the scratch grows on demand."""
        n = int(loc.shape[0])
        if self._scratch is None or self.capacity < n:
            if runtime.is_capturing(self.device, ptr):
                raise ValueError(f"kvcanary: out_cache_loc: {n} tokens exceed the SWA translation scratch during a "
                                 "graph capture; pass max_tokens= or bind_inputs(out_cache_loc=...) before capturing")
            self.reserve(n, lut)
        idx, dst, m1, m2, neg = self._scratch
        idx, dst, m1, m2 = idx[:n], dst[:n], m1[:n], m2[:n]
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
