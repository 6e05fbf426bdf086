"""The rows of vLLM's attention metadata, named: which request each row is, which rows wait.

The worker orders its batch its own way (it condenses and reorders rows), and the
attention metadata carries no request ids. A row is named by what only its request
does this step: the slot its first new token is written to (``slot_mapping`` at the
row's ``query_start_loc``), which the scheduler's block list of that request gives
as ``blocks[computed // block_size] * block_size + computed % block_size``, with the
row's lengths agreeing. A row no request claims alone is left unnamed (counted): its
violations name no request, and no request's tokens are stamped in its slots.

On a GPU engine the metadata lives on the device: the arrays a name needs come to the host
through a pinned buffer, the host waiting once for the step's input preparation on its
stream (which the forward waits for anyway; the KV is not read).
"""
from __future__ import annotations

import numpy as np

from ..engine.step_arrays import host_array
from .mirror import RequestTokens


def match_rows(keys, mirror, *, block_size: int) -> tuple[list, int]:
    """``(states, unmatched)``: the :class:`~.mirror.RequestTokens` of each row of the attention
    metadata whose :meth:`RowKeyReader.read` keys are ``keys``, in row order; a row that cannot be named
    gets a placeholder with no request and no known token."""
    qsl, seq, first = keys
    by_slot: dict = {}
    for s in mirror.scheduled:
        blocks = s.blocks[0] if s.blocks else ()
        i = s.computed // block_size
        if i < len(blocks):
            by_slot.setdefault(blocks[i] * block_size + s.computed % block_size, []).append(s)
    states, taken = [], {}
    for r, key in enumerate(first):
        ext = qsl[r + 1] - qsl[r]
        claims = by_slot.get(key, ())
        if len(claims) == 1:  # one request writes there: the row's if the lengths agree
            s = claims[0] if claims[0].computed + claims[0].scheduled == seq[r] and claims[0].scheduled == ext \
                else None
        else:
            pick = [s for s in claims if s.computed + s.scheduled == seq[r] and s.scheduled == ext]
            s = pick[0] if len(pick) == 1 else None
        if s is not None and id(s) in taken:  # two rows claim one request: neither is named
            t = taken[id(s)]
            states[t] = _unnamed(seq[t], qsl[t + 1] - qsl[t])
            s = None
        if s is None:
            states.append(_unnamed(seq[r], ext))
        else:
            taken[id(s)] = r
            states.append(s)
    return states, sum(1 for s in states if s.request_id is None)


class RowKeyReader:
    """Each step's row keys on the host: ``(query_start_loc [n + 1], seq_lens [n], first_slot [n])``
    of attention metadata ``md`` (``query_start_loc``, ``seq_lens``, ``slot_mapping``) as lists of
    Python ints: each row's token range, length, and the slot its first new token is written to
    (-1 for a row with no token in ``slot_mapping``). CUDA metadata is copied into one pinned
    buffer, kept from step to step, on the step's stream, then waited for once; a layout other
    than contiguous int32 / int64 vectors goes through torch. (A step has a few hundred rows at
    most: lists cost less than arrays here, and the step's host code takes lists.)"""

    def __init__(self):
        self._buf, self._bytes, self._cap = None, None, 0

    def read(self, md, stream: int | None) -> tuple[list, list, list]:
        """The keys of ``md``: NumPy arrays or CPU tensors when ``stream`` is None, else CUDA
        tensors read on raw stream ``stream``."""
        qsl, seq, slots = md.query_start_loc, md.seq_lens, md.slot_mapping
        if stream is None:  # a CPU tensor gives its ints directly
            q, sq = (t.tolist() if hasattr(t, "tolist") else host_array(t).tolist() for t in (qsl, seq))
            return _keys(q, sq, host_array(slots))
        import torch  # noqa: PLC0415  (CUDA metadata: torch is the engine's)

        words = {torch.int32: "i", torch.int64: "q"}
        parts = (slots, qsl, seq)  # the int64 slots first: every part starts aligned
        if not all(t.dtype in words and t.is_contiguous() and t.dim() == 1 for t in parts):
            q = qsl.to(torch.int64)
            n = q.numel() - 1
            packed = torch.cat([q, seq[:n].to(torch.int64), slots.to(torch.int64)]).cpu().numpy()
            return _keys(packed[:n + 1].tolist(), packed[n + 1:2 * n + 1].tolist(), packed[2 * n + 1:])
        import cupy  # noqa: PLC0415

        rt = cupy.cuda.runtime
        n = int(qsl.shape[0]) - 1
        counts = (int(slots.shape[0]), n + 1, max(n, 0))
        sizes = [c * t.element_size() for c, t in zip(counts, parts)]
        need = sum(-(-b // 8) * 8 for b in sizes)
        if need > self._cap:
            self._cap = max(need, 2 * self._cap, 4096)
            self._buf = cupy.cuda.alloc_pinned_memory(self._cap)
            self._bytes = memoryview(np.frombuffer(self._buf, np.uint8, self._cap))
        base = self._buf.ptr
        views, at = [], 0
        for t, b in zip(parts, sizes):
            if b:
                rt.memcpyAsync(base + at, t.data_ptr(), b, rt.memcpyDeviceToHost, stream)
            views.append(self._bytes[at:at + b].cast(words[t.dtype]))
            at += -(-b // 8) * 8
        rt.streamSynchronize(stream)
        sm, q, s = views
        return _keys(q.tolist(), s.tolist(), sm)


def _keys(q: list, seq: list, sm):
    """``(q, seq[:n], first)``: each row's first slot from the slot mapping ``sm`` (a sequence of
    ints; -1 where a row starts past its end)."""
    n = len(q) - 1
    m = len(sm)
    if m <= 8 * n and not isinstance(sm, list):  # a decode step's few slots: read as ints at once
        sm = sm.tolist()
    first = [int(sm[a]) if 0 <= a < m else -1 for a in q[:n]]
    return q, seq[:n], first


def _unnamed(seq_len: int, extend: int) -> RequestTokens:
    return RequestTokens(None, computed=seq_len - extend, scheduled=extend)


def deferred_rows(states: list, group: int, block_size: int) -> list | None:
    """Per row, whether it reads a block another row writes this step (a prefix-cache hit on
    blocks still being filled): only rows (re)admitted this step with cached tokens can.
    None when no row does."""
    candidates = [i for i, s in enumerate(states) if s.admitted and s.computed > 0 and s.blocks]
    if not candidates:
        return None
    written: dict = {}  # block -> the row writing it
    for i, s in enumerate(states):
        if s.blocks:
            blocks = s.blocks[group]
            for b in blocks[s.computed // block_size:-(-(s.computed + s.scheduled) // block_size)]:
                written[b] = i
    out = [False] * len(states)
    for i in candidates:
        s = states[i]
        read = s.blocks[group][:-(-s.computed // block_size)]
        out[i] = any(written.get(b, i) != i for b in read)
    return out if any(out) else None
