"""Fault injectors: engine bugs that corrupt the KV cache silently, each tied to the
check that must catch it.

A fault is armed between steps with :meth:`Fault.arm`. Faults that corrupt state
directly (a table entry, a byte) apply at once and show from the next step;
faults that live inside a step (an allocator that hands out a live slot, a batch
builder that swaps tokens) hook into the next step that gives them a chance.
``fired_at`` is the first step that can observe the corruption; :meth:`Fault.matches`
says whether a violation comes from the detector the fault is tied to.
"""
from __future__ import annotations

import numpy as np

from ..format import FailReason as F
from ..format import LaunchTag as T

_VERIFY = frozenset({T.VERIFY, T.VERIFY_AFTER, T.VERIFY_SWA, T.VERIFY_DRAFT})
_LAYOUT = F.CHAIN | F.POSITION | F.TOKEN | F.SLOT_OUT_OF_RANGE


class Fault:
    """Base class: ``number``, ``name``, the detector in words, and what it must raise."""

    number = 0
    name = ""
    detector = ""
    tags: frozenset = frozenset()
    reasons = F.NONE

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.fired_at: int | None = None
        self.info: dict = {}

    def arm(self, sim) -> bool:
        """Apply (or hook) the fault; False when the sim's state offers no target yet."""
        raise NotImplementedError

    def matches(self, monitor: str, v) -> bool:
        return v.tag in self.tags and bool(v.reasons & self.reasons)

    # --- helpers -------------------------------------------------------------------
    def _pick(self, items):
        return items[int(self.rng.integers(len(items)))] if items else None

    def _fire(self, sim, at_next: bool) -> None:
        self.fired_at = sim.clock + 1 if at_next else sim.clock
        if self in sim.hooks:
            sim.hooks.remove(self)

    @staticmethod
    def _hook(sim, fault) -> bool:
        sim.hooks.append(fault)
        return True

    def _readers(self, sim, min_steps: int = 1, min_P: int = 1):
        return [r for r in sim.running if r.P >= min_P and r.steps_left(sim.cfg.chunk) >= min_steps]

    def _flip(self, sim, pool, slot: int) -> None:
        layer = int(self.rng.integers(pool.layers))
        byte = int(self.rng.integers(pool.bytes_per_token))
        pool.flip(slot, layer, byte, int(1 << self.rng.integers(8)))
        self.info.update(slot=slot, layer=layer, byte=byte)


class TableRepoint(Fault):
    number, name = 1, "table entry repointed"
    detector = "verify: chain / position"
    tags, reasons = _VERIFY, _LAYOUT

    def arm(self, sim) -> bool:
        ps = sim.cfg.page_size
        victim = self._pick(self._readers(sim, min_P=2))
        if victim is None:
            return False
        q = int(self.rng.integers(victim.P))
        mine = {victim.slot(p, ps, sim.cfg.block) // ps for p in range(victim.P)}
        donors = [(r, p) for r in sim.running if r is not victim for p in range(0, r.P, ps)
                  if r.slot(p, ps, sim.cfg.block) // ps not in mine and p // ps != q // ps]
        pick = self._pick(donors)
        if pick is None:
            return False
        r, p = pick
        slot = r.slot(p, ps, sim.cfg.block)
        sim.table.host[victim.row, q // ps] = slot if ps == 1 else slot // ps
        self.info.update(request=victim.rid, position=q, now=slot)
        self._fire(sim, at_next=True)
        return True


def _live_page(sim, fault, exclude=None):
    """A running request's own page, fully written, in its unique (non system-prompt) tail."""
    ps = sim.cfg.page_size
    cands = [(r, k) for r in fault._readers(sim, min_steps=3) if r is not exclude
             for k, a0 in r.own_pages_in_prefix(ps) if a0 >= r.sys_len]
    return fault._pick(cands)


class DoubleAlloc(Fault):
    number, name = 2, "slot allocated to two live requests"
    detector = "verify: chain / position"
    tags, reasons = _VERIFY, F.CHAIN | F.POSITION | F.TOKEN

    def arm(self, sim) -> bool:
        return self._hook(sim, self)

    def on_alloc(self, sim, req):
        pick = _live_page(sim, self, exclude=req)
        if pick is None:
            return None
        owner, k = pick
        self.info.update(owner=owner.rid, taker=req.rid, page=owner.pages[k])
        self._fire(sim, at_next=False)
        return owner.pages[k]


class FreeWhileRead(Fault):
    number, name = 3, "slot freed and reused while read"
    detector = "verify: chain / position"
    tags, reasons = _VERIFY, F.CHAIN | F.POSITION | F.TOKEN

    def arm(self, sim) -> bool:
        pick = _live_page(sim, self)
        if pick is None:
            return False
        owner, k = pick
        sim.pages.free(owner.pages[k])  # the owner still reads it; the next allocation reuses it
        self.info.update(owner=owner.rid, page=owner.pages[k])
        self._fire(sim, at_next=True)
        return True


class BadPrefixHit(Fault):
    number, name = 4, "prefix hit onto other tokens"
    detector = "verify: token"
    tags, reasons = _VERIFY, F.TOKEN

    def arm(self, sim) -> bool:
        if not sim.cache.nodes:
            return False
        sim.force_admit = True
        return self._hook(sim, self)

    def on_match(self, sim, req, path):
        B = sim.cfg.block
        cands = []
        for p in sim.cache.paths():
            L = len(p) * B
            if L > len(req.tokens) - 1 or [t for n in p for t in n.key] == req.tokens[:L]:
                continue
            if sim.cfg.swa_window and not all(sim.swa_of[p[q // B].slots[q % B]] >= 0
                                             for q in range(max(0, L - sim.cfg.swa_window - 1), L)):
                continue
            cands.append(p)
        bad = self._pick(cands)
        if bad is None:
            sim.force_admit = True
            return path
        self.info.update(request=req.rid, length=len(bad) * B)
        self._fire(sim, at_next=False)
        return bad


class SwaOffByOne(Fault):
    number, name = 5, "SWA translation off by one"
    detector = "SWA verify: chain / position"
    tags, reasons = frozenset({T.VERIFY_SWA}), _LAYOUT | F.REAL_KV

    def arm(self, sim) -> bool:
        if sim.lut is None:
            return False
        W = sim.cfg.swa_window
        cands = [(r, q) for r in self._readers(sim) for q in range(max(0, r.P - W), r.P)
                 if sim.lut.host[r.slot(q, sim.cfg.page_size, sim.cfg.block)] > 0]
        pick = self._pick(cands)
        if pick is None:
            return False
        r, q = pick
        s = r.slot(q, sim.cfg.page_size, sim.cfg.block)
        sim.lut.host[s] += 1
        self.info.update(request=r.rid, position=q, slot=s)
        self._fire(sim, at_next=True)
        return True


class PositionOffByOne(Fault):
    number, name = 6, "position off by one (speculative)"
    detector = "write: chain position"
    tags, reasons = frozenset({T.WRITE, T.WRITE_DRAFT}), F.WRITE_POSITION

    def arm(self, sim) -> bool:
        return self._hook(sim, self)

    def _shift(self, sim, batch, spans, key):
        rows = [i for i, (r, E) in enumerate(zip(batch, spans)) if E == 1 and r.P >= 1]
        i = self._pick(rows)
        if i is None:
            return
        at = int(sum(spans[:i]))
        sim.inp[key].host[at] += 1
        self.info.update(request=batch[i].rid, pass_="draft" if key == "dpos" else "target")
        self._fire(sim, at_next=False)

    def on_inputs(self, sim, batch, spans):
        if sim.draft is None:
            self._shift(sim, batch, spans, "pos")

    def on_draft_inputs(self, sim, batch, spans):
        self._shift(sim, batch, spans, "dpos")


class TokenSwap(Fault):
    number, name = 7, "tokens swapped between requests"
    detector = "verify: token"
    tags, reasons = _VERIFY | {T.WRITE}, F.TOKEN | F.WRITE_TOKEN

    def arm(self, sim) -> bool:
        return self._hook(sim, self)

    def on_inputs(self, sim, batch, spans):
        ids = sim.inp["ids"].host
        at = np.cumsum([0] + list(spans))
        rows = [i for i, (r, E) in enumerate(zip(batch, spans)) if E == 1 and r.steps_left(sim.cfg.chunk) >= 2]
        pairs = [(a, b) for a in rows for b in rows if a < b and ids[at[a]] != ids[at[b]]]
        pick = self._pick(pairs)
        if pick is None:
            return
        a, b = pick
        ids[at[a]], ids[at[b]] = ids[at[b]], ids[at[a]]
        self.info.update(requests=(batch[a].rid, batch[b].rid))
        self._fire(sim, at_next=False)


class KvFlipActive(Fault):
    number, name = 8, "K/V byte flipped (active)"
    detector = "verify: real-KV fingerprint"
    tags, reasons = frozenset({T.VERIFY, T.VERIFY_AFTER}), F.REAL_KV

    def arm(self, sim) -> bool:
        r = self._pick(self._readers(sim))
        if r is None:
            return False
        s = r.slot(int(self.rng.integers(r.P)), sim.cfg.page_size, sim.cfg.block)
        self._flip(sim, self._pick([sim.k, sim.v]), s)
        self.info.update(request=r.rid)
        self._fire(sim, at_next=True)
        return True


class KvFlipIdle(Fault):
    number, name = 9, "K/V byte flipped (idle cache)"
    detector = "sweep: real-KV fingerprint"
    tags, reasons = frozenset({T.SWEEP}), F.REAL_KV

    def arm(self, sim) -> bool:
        # A block past every system prompt: no new request can hit it, only the sweep reads it.
        longest = max(len(s) for s in sim.system)
        cands = [n for n in sim.cache.idle() if n.first_position >= longest]
        if not cands:
            return False
        n = max(cands, key=lambda n: (n.last_used, n.id))
        n.pinned = True  # keep it from eviction, so the flip stays to be found
        self._flip(sim, self._pick([sim.k, sim.v]), int(n.slots[int(self.rng.integers(len(n.slots)))]))
        self.info.update(node=n.id)
        self._fire(sim, at_next=True)
        return True


class FlipAfterStamp(Fault):
    number, name = 10, "K/V byte flipped after stamp"
    detector = "next verify: real-KV fingerprint"
    tags, reasons = frozenset({T.VERIFY, T.VERIFY_AFTER}), F.REAL_KV

    def arm(self, sim) -> bool:
        return self._hook(sim, self)

    def after_stamp(self, sim, batch, spans):
        rows = [i for i, r in enumerate(batch) if r.steps_left(sim.cfg.chunk) >= 2]
        i = self._pick(rows)
        if i is None:
            return
        r = batch[i]
        s = r.slot(r.P + spans[i] - 1, sim.cfg.page_size, sim.cfg.block)
        self._flip(sim, self._pick([sim.k, sim.v]), s)
        self.info.update(request=r.rid)
        self._fire(sim, at_next=True)


FAULTS = [TableRepoint, DoubleAlloc, FreeWhileRead, BadPrefixHit, SwaOffByOne, PositionOffByOne, TokenSwap,
          KvFlipActive, KvFlipIdle, FlipAfterStamp]
"""Every fault class, in the order of their numbers."""
