"""The rows of vLLM's attention metadata, named: which request each row is, which rows wait.

The worker orders its batch its own way (it condenses and reorders rows), and the
attention metadata carries no request ids. A row is named by what only its request
does this step: the slot its first new token is written to (``slot_mapping`` at the
row's ``query_start_loc``), which the scheduler's block list of that request gives
as ``blocks[computed // block_size] * block_size + computed % block_size``, with the
row's lengths agreeing. A row no request claims alone is left unnamed (counted): its
violations name no request, and no request's tokens are stamped in its slots.
"""
from __future__ import annotations

import numpy as np

from ..engine.step_arrays import host_array
from .mirror import RequestTokens


def match_rows(md, mirror, *, block_size: int) -> tuple[list, int]:
    """``(states, unmatched)``: the :class:`~.mirror.RequestTokens` of each row of attention
    metadata ``md`` (``query_start_loc``, ``seq_lens``, ``slot_mapping``), in row order; a row
    that cannot be named gets a placeholder with no request and no known token."""
    qsl = host_array(md.query_start_loc)
    n = len(qsl) - 1
    seq = host_array(md.seq_lens)[:n].tolist()
    ext = np.diff(qsl).tolist()
    first = host_array(md.slot_mapping)[qsl[:-1]].tolist()
    by_slot: dict = {}
    for s in mirror.scheduled:
        blocks = s.blocks[0] if s.blocks else ()
        i = s.computed // block_size
        if i < len(blocks):
            by_slot.setdefault(blocks[i] * block_size + s.computed % block_size, []).append(s)
    states, taken = [], {}
    for r in range(n):
        pick = [s for s in by_slot.get(first[r], ()) if s.computed + s.scheduled == seq[r] and s.scheduled == ext[r]]
        s = pick[0] if len(pick) == 1 else None
        if s is not None and id(s) in taken:  # two rows claim one request: neither is named
            states[taken[id(s)]] = _unnamed(seq[taken[id(s)]], ext[taken[id(s)]])
            s = None
        if s is None:
            states.append(_unnamed(seq[r], ext[r]))
        else:
            taken[id(s)] = r
            states.append(s)
    return states, sum(1 for s in states if s.request_id is None)


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
