"""Sweeps: verify idle cached sequences a bounded slice at a time.

An engine's prefix cache (a radix tree, a hash table of blocks) keeps sequences
no running request reads, so no step verifies them; a stray write into one shows
only when a later request hits it. A sweep checks them in the background: each
call verifies at most ``budget`` records, continuing where the previous call
stopped (round robin), so its cost per step is bounded.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import arrays, runtime
from ..plans import VerifyPlan

_ENTRY_FIELDS = VerifyPlan.ENTRY_FIELDS  # slot, prev, expected position, expected token
_NUM_SCALARS = len(VerifyPlan.SCALAR_FIELDS)


@dataclass(frozen=True, eq=False)
class SweepChain:
    """One cached sequence (or a piece of one) in a canary buffer's slot space.

    Args:
        slots: int ``[n]``, the slots holding positions ``first_position ..
            first_position + n - 1``, in order. A NumPy array / list, or an
            array on the monitor's device (e.g. a radix node's index tensor).
        first_position: the position of ``slots[0]``.
        prev_slot: the slot of position ``first_position - 1`` (the parent node's
            last slot); ``-1`` when the chain starts its sequence
            (``first_position == 0``); ``0`` when unknown (the first record's
            link is then not checked).
        tokens: optional int ``[n]``, the token ids the slots must hold (checked
            when given).
        key: any object naming the chain (e.g. the radix node); violations report
            it as ``Violation.request``.

    Example::

        >>> import numpy as np
        >>> c = SweepChain(np.array([7, 8, 9]), first_position=4, prev_slot=3, key="node-12")
        >>> len(c)
        3
    """

    slots: object
    first_position: int = 0
    prev_slot: int = -1
    tokens: object = None
    key: object = None

    def __post_init__(self):
        if isinstance(self.slots, (list, tuple)):
            object.__setattr__(self, "slots", np.asarray(self.slots, dtype=np.int64))
        object.__setattr__(self, "slots", arrays.as_index_array(self.slots, "SweepChain.slots"))
        if isinstance(self.tokens, (list, tuple)):
            object.__setattr__(self, "tokens", np.asarray(self.tokens, dtype=np.int64))
        if self.tokens is not None:
            t = arrays.as_index_array(self.tokens, "SweepChain.tokens")
            if t.shape[0] != self.slots.shape[0]:
                raise ValueError(f"kvcanary: SweepChain.tokens: expected {self.slots.shape[0]} tokens like slots, "
                                 f"got {t.shape[0]}")
            object.__setattr__(self, "tokens", t)
        fp, prev = int(self.first_position), int(self.prev_slot)
        if fp < 0:
            raise ValueError(f"kvcanary: SweepChain.first_position: expected >= 0, got {fp}")
        if prev < -1:
            raise ValueError(f"kvcanary: SweepChain.prev_slot: expected a slot, -1 (sequence start) or 0 "
                             f"(unknown), got {prev}")
        if prev == -1 and fp > 0:
            raise ValueError(f"kvcanary: SweepChain.prev_slot: -1 means the chain starts its sequence, but "
                             f"first_position is {fp}; pass the predecessor's slot, or 0 if unknown")
        object.__setattr__(self, "first_position", fp)
        object.__setattr__(self, "prev_slot", prev)

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    @classmethod
    def coerce(cls, obj, index: int) -> "SweepChain":
        if isinstance(obj, SweepChain):
            return obj
        if isinstance(obj, (tuple, list)) and 1 <= len(obj) <= 4:
            return cls(*obj) if len(obj) < 4 else cls(obj[0], obj[1], obj[2], obj[3])
        raise TypeError(f"kvcanary: chains[{index}]: expected a SweepChain or a tuple (slots, first_position, "
                        f"prev_slot[, tokens]), got {type(obj).__name__}")


class SweepPlanner:
    """Owns a small VerifyPlan and fills it, from the host, with the next slice of chains.

    All device memory is allocated once: the four entry arrays are rows of one
    ``[4, budget]`` array and the offsets and the plan's scalars (named by
    ``VerifyPlan.SCALAR_FIELDS``) one ``[max_chains + 1 + len(SCALAR_FIELDS)]``
    array, so a sweep of host chains costs two host-to-device copies.
    """

    def __init__(self, *, budget: int, max_chains: int, device: str):
        budget, max_chains = int(budget), int(max_chains)
        if budget < 1:
            raise ValueError(f"kvcanary: sweep_budget: expected >= 1, got {budget}")
        if max_chains < 1:
            raise ValueError(f"kvcanary: sweep_max_chains: expected >= 1, got {max_chains}")
        self.device = device
        self.budget = budget
        self.max_chains = max_chains
        self.entries = runtime.empty((len(_ENTRY_FIELDS), budget), np.int64, device, fill=-1)
        self.meta = runtime.empty((max_chains + 1 + _NUM_SCALARS,), np.int64, device, fill=0)
        mb1 = max_chains + 1
        scal = {f: self.meta[mb1 + i: mb1 + i + 1] for i, f in enumerate(VerifyPlan.SCALAR_FIELDS)}
        self.plan = VerifyPlan.from_buffers(**{f: self.entries[i] for i, f in enumerate(_ENTRY_FIELDS)},
                                            offsets=self.meta[:mb1], **scal)
        cpu = runtime.is_cpu(device)
        self._h_entries = self.entries if cpu else np.empty_like(runtime.to_host(self.entries))
        self._h_meta = self.meta if cpu else np.zeros(self.meta.shape, np.int64)
        self._iota = runtime.empty((budget,), np.int64, device)
        runtime.put(self._iota, np.arange(budget, dtype=np.int64))
        self.cursor = 0  # entry index (into the concatenation of all chains) the next slice starts at

    def fill(self, chains: list, ptr=None) -> tuple[int, list]:
        """Lay out the next slice; returns (entries planned, the key of each piece)."""
        lens = [len(c) for c in chains]
        total = sum(lens)
        if total == 0:
            return 0, []
        start = self.cursor % total
        ci, off = 0, start
        while off >= lens[ci]:  # the chain holding entry `start`
            off -= lens[ci]
            ci += 1
        host = all(isinstance(c.slots, np.ndarray) and (c.tokens is None or isinstance(c.tokens, np.ndarray))
                   for c in chains) or runtime.is_cpu(self.device)
        taken, pieces, keys = 0, [], []
        want = min(self.budget, total)
        while taken < want and len(pieces) < self.max_chains:
            n = min(lens[ci] - off, want - taken)
            if n > 0:
                pieces.append((chains[ci], off, n, taken))
                keys.append(chains[ci].key if chains[ci].key is not None else ci)
                taken += n
            off = 0
            ci = (ci + 1) % len(chains)
        if host:
            self._fill_host(pieces, ptr)
        else:
            self._fill_device(pieces, ptr)
        m = self._h_meta
        mb1 = self.max_chains + 1
        m[:mb1] = taken
        for k, (_, _, _, at) in enumerate(pieces):
            m[k] = at
        scalars = dict(num_valid=taken, enable=1, requested=taken, input_errors=0, overflows=0, max_requested=taken)
        m[mb1:mb1 + _NUM_SCALARS] = [scalars[f] for f in VerifyPlan.SCALAR_FIELDS]
        if not runtime.is_cpu(self.device):
            runtime.put(self.meta, m, ptr)
        self.cursor = start + taken
        return taken, keys

    def _fill_host(self, pieces, ptr) -> None:
        e = self._h_entries
        for chain, i, n, at in pieces:
            s = runtime.to_host(chain.slots)
            e[0, at:at + n] = s[i:i + n]
            e[1, at] = chain.prev_slot if i == 0 else s[i - 1]
            e[1, at + 1:at + n] = s[i:i + n - 1]
            e[2, at:at + n] = np.arange(chain.first_position + i, chain.first_position + i + n)
            if chain.tokens is None:
                e[3, at:at + n] = -1
            else:
                e[3, at:at + n] = runtime.to_host(chain.tokens)[i:i + n]
        if not runtime.is_cpu(self.device):
            runtime.put(self.entries, e, ptr)

    def _fill_device(self, pieces, ptr) -> None:
        xp = runtime.array_module(self.device)
        e = self.entries
        with runtime.on_stream(self.device, ptr):
            for chain, i, n, at in pieces:
                runtime.put(e[0, at:at + n], chain.slots[i:i + n], ptr)
                if i == 0:
                    e[1, at:at + 1].fill(chain.prev_slot)
                else:
                    runtime.put(e[1, at:at + 1], chain.slots[i - 1:i], ptr)
                if n > 1:
                    runtime.put(e[1, at + 1:at + n], chain.slots[i:i + n - 1], ptr)
                xp.add(self._iota[:n], chain.first_position + i, out=e[2, at:at + n])
                if chain.tokens is None:
                    e[3, at:at + n].fill(-1)
                else:
                    runtime.put(e[3, at:at + n], chain.tokens[i:i + n], ptr)
