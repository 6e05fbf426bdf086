"""PagedKvSim: a small paged-KV engine with a KvCanary attached.

Host bookkeeping (requests, free lists, the prefix cache, the tables) lives in
NumPy; the tables, the per-step inputs and the K/V pools the monitor reads live
on the configured device (the same arrays on the CPU, mirrored each step on a GPU),
as in a real engine whose scheduler runs on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import runtime
from ..monitor import KvCanary, SwaGroup
from .allocator import FreeList
from .config import SimConfig
from .model import KvPool
from .prefix_cache import Node, PrefixCache


@dataclass
class Request:
    """One request: its tokens (prompt + generated), where its KV lives, how far it got."""

    rid: str
    row: int
    tokens: list
    prompt_len: int
    max_new: int
    P: int = 0  # positions whose K/V is written
    shared: int = 0  # positions [0, shared) are cache nodes'
    nodes: list = field(default_factory=list)
    pages: list = field(default_factory=list)  # own pages for positions [shared, ...)
    swa_slid: int = 0  # own positions below this had their SWA slots freed
    generated: int = 0
    sys_len: int = 0  # tokens of the shared system prompt at its head

    def slot(self, pos: int, page_size: int, block: int) -> int:
        if pos < self.shared:
            return int(self.nodes[pos // block].slots[pos % block])
        k = pos - self.shared
        return self.pages[k // page_size] * page_size + pos % page_size

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new

    def steps_left(self, chunk: int) -> int:
        """Steps this request still runs (its last one included)."""
        if self.P < self.prompt_len:
            return -(-(self.prompt_len - self.P) // chunk) + self.max_new - 1
        return self.max_new - self.generated

    def own_pages_in_prefix(self, page_size: int) -> list[tuple[int, int]]:
        """(page index, first position) of own pages whose every slot is already written."""
        return [(k, self.shared + k * page_size) for k in range(len(self.pages))
                if self.shared + (k + 1) * page_size <= self.P]


@dataclass
class StepRecord:
    step: int
    batch: list  # request ids, batch order
    violations: list  # (monitor name, Violation)


class _Mirror:
    """A host array and its device copy (the same array on the CPU)."""

    def __init__(self, host: np.ndarray, device: str):
        self.host = host
        self.dev = host if device == "cpu" else runtime.empty(host.shape, host.dtype, device)
        self.device = device
        self.sync()

    def sync(self) -> None:
        if self.device != "cpu":
            runtime.put(self.dev, self.host)


class PagedKvSim:
    """A paged KV engine: admission with prefix-cache hits, chunked prefill, decode,
    a sliding-window pool, a draft pool, eviction, and a canary on all of it.

    Each :meth:`step` schedules up to ``max_batch`` running requests, allocates
    their new slots, calls the monitors around the toy model's K/V writes, samples
    tokens, finishes requests into the prefix cache, sweeps idle cached blocks and
    polls. Fault injectors (:mod:`kvcanary_cupy.sim.faults`) hook into the step.

    Example::

        >>> from kvcanary_cupy.sim import PagedKvSim, SimConfig
        >>> sim = PagedKvSim(SimConfig(seed=1))
        >>> recs = sim.run(30)
        >>> sum(len(r.violations) for r in recs), sim.monitor.stats()["steps"]
        (0, 30)
    """

    def __init__(self, cfg: SimConfig | None = None, **overrides):
        cfg = cfg or SimConfig()
        for k, v in overrides.items():
            setattr(cfg, k, v)
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        dev = cfg.device
        ps, B = cfg.page_size, cfg.block
        n_slots = cfg.num_slots
        self.clock = 0
        self.hooks: list = []  # armed faults
        self.log: list[StepRecord] = []

        # --- tables ------------------------------------------------------------
        width = cfg.max_len // ps
        self.table = _Mirror(np.zeros((cfg.max_requests, width), np.int32), dev)
        self.expected = _Mirror(np.full((cfg.max_requests, cfg.max_len + 1), -1, np.int64), dev)
        self.swa_of = np.full(n_slots, -1, np.int64)  # host bookkeeping: full slot -> SWA slot
        self.lut = _Mirror(np.full(n_slots, -1, np.int32), dev) if cfg.swa_window else None
        if self.lut is not None:
            self.lut.host[0] = 0

        # --- pools and allocators -------------------------------------------------
        self.pages = FreeList(cfg.num_pages, first=1)  # page 0 holds slot 0, the padding slot
        self.swa_free = FreeList(cfg.swa_slots, first=1) if cfg.swa_window else None
        self.rows = FreeList(cfg.max_requests, first=1)
        self.cache = PrefixCache(B)
        kv = dict(num_slots=n_slots, page_size=ps, bytes_per_token=cfg.bytes_per_token, device=dev)
        self.k = KvPool(layers=cfg.layers, salt=1, **kv)
        self.v = KvPool(layers=cfg.layers, salt=2, **kv)
        self.swa_kv = KvPool(layers=1, num_slots=cfg.swa_slots, page_size=1, bytes_per_token=cfg.bytes_per_token,
                             device=dev, salt=3) if cfg.swa_window else None
        self.draft_kv = KvPool(layers=1, salt=4, **kv) if cfg.draft else None

        # --- per-step inputs (bound once to the monitors) -------------------------
        mt = cfg.max_batch * max(cfg.chunk, 1)
        self.inp = {name: _Mirror(np.zeros(n, np.int64), dev) for name, n in (
            ("rpi", cfg.max_batch), ("pre", cfg.max_batch), ("ext", cfg.max_batch), ("ids", mt), ("pos", mt),
            ("loc", mt), ("dids", mt), ("dpos", mt), ("dvlen", cfg.max_batch))}

        # --- monitors ---------------------------------------------------------------
        tkw = dict(req_to_token=self.table.dev) if ps == 1 else dict(block_table=self.table.dev, page_size=ps)
        swa = SwaGroup(window=cfg.swa_window, lut=self.lut.dev, num_slots=cfg.swa_slots,
                       real_kv=(self.swa_kv.source(),)) if cfg.swa_window else None
        common = dict(num_slots=n_slots, max_batch=cfg.max_batch, device=dev, expected_tokens=self.expected.dev,
                      real_kv_mode=cfg.real_kv_mode, fingerprint_sample_period=cfg.sample_period,
                      policy=lambda found: None, verify_after=cfg.verify_after, chain=cfg.chain,
                      stamp_before_forward=cfg.stamp_before_forward, events=cfg.events, **tkw)
        self.monitor = KvCanary(real_kv=(self.k.source(), self.v.source()), swa=swa, max_tokens=mt,
                                sweep_budget=cfg.sweep_budget, name=cfg.name, **common)
        i = self.inp
        self.monitor.bind_inputs(req_pool_indices=i["rpi"].dev, prefix_lens=i["pre"].dev, extend_lens=i["ext"].dev,
                                 input_ids=i["ids"].dev, positions=i["pos"].dev, out_cache_loc=i["loc"].dev)
        self.draft = None
        if cfg.draft:
            self.draft = KvCanary(real_kv=(self.draft_kv.source(),), draft=True,
                                  name=f"{cfg.name}.draft" if cfg.name else "draft", **common)
            self.draft.bind_inputs(req_pool_indices=i["rpi"].dev, prefix_lens=i["pre"].dev,
                                   extend_lens=i["ext"].dev, input_ids=i["dids"].dev, positions=i["dpos"].dev,
                                   out_cache_loc=i["loc"].dev, expected_valid_lens=i["dvlen"].dev)
        self.monitors = {"main": self.monitor, **({"draft": self.draft} if self.draft else {})}

        # --- traffic ------------------------------------------------------------------
        self.system = [self._tokens(B * int(self.rng.integers(cfg.system_blocks[0], cfg.system_blocks[1] + 1)))
                       for _ in range(cfg.system_prompts)]
        self.running: list[Request] = []
        self.next_rid = 0
        self.force_admit = False
        self.stats_prefix_hits = 0
        self.stats_evictions = 0

    # ------------------------------------------------------------------ traffic
    def _tokens(self, n: int) -> list:
        return [int(t) for t in self.rng.integers(1, self.cfg.vocab, size=n)]

    def _new_request(self) -> Request | None:
        row = self.rows.alloc()
        if row is None:
            return None
        cfg = self.cfg
        prompt = list(self.system[int(self.rng.integers(len(self.system)))])
        sys_len = len(prompt)
        prompt += self._tokens(int(self.rng.integers(cfg.suffix_len[0], cfg.suffix_len[1] + 1)))
        prompt = prompt[:cfg.max_len - 2]
        max_new = int(self.rng.integers(cfg.output_len[0], cfg.output_len[1] + 1))
        max_new = max(1, min(max_new, cfg.max_len + 1 - len(prompt)))
        self.next_rid += 1
        return Request(f"r{self.next_rid}", row, prompt, len(prompt), max_new, sys_len=min(sys_len, len(prompt)))

    def _admit(self) -> None:
        while len(self.running) < self.cfg.concurrency or self.force_admit:
            req = self._new_request()
            if req is None:
                return
            self.force_admit = False
            path = self._match(req)
            for h in list(self.hooks):
                path = h.on_match(self, req, path) if hasattr(h, "on_match") else path
            B = self.cfg.block
            self.stats_prefix_hits += bool(path)
            for n in path:
                n.ref += 1
            req.nodes, req.shared, req.P, req.swa_slid = list(path), len(path) * B, len(path) * B, len(path) * B
            for pos in range(0, req.shared, self.cfg.page_size):
                self._set_table(req, pos)
            self.expected.host[req.row, :] = -1
            self.expected.host[req.row, :len(req.tokens)] = req.tokens
            self.running.append(req)

    def _match(self, req: Request) -> list[Node]:
        cfg, B = self.cfg, self.cfg.block
        path = self.cache.match(req.tokens, len(req.tokens) - 1, self.clock)
        if cfg.draft:
            # A draft record of a block's last position holds the token after it: share a block only
            # when this request continues it with that same token.
            for i in range(len(path) - 1):
                if path[i].next_token != path[i + 1].key[0]:
                    path = path[:i + 1]
                    break
            while path and path[-1].next_token != req.tokens[len(path) * B]:
                path = path[:-1]
        if cfg.swa_window:
            # The window (and the record before it) of the first step must still have SWA slots.
            while path:
                L = len(path) * B
                lo = max(0, L - cfg.swa_window - 1)
                if all(self.swa_of[path[p // B].slots[p % B]] >= 0 for p in range(lo, L)):
                    break
                path = path[:-1]
        return path

    def _set_table(self, req: Request, pos: int) -> None:
        ps = self.cfg.page_size
        s = req.slot(pos, ps, self.cfg.block)
        if ps == 1:
            self.table.host[req.row, pos] = s
        else:
            self.table.host[req.row, pos // ps] = s // ps

    # ------------------------------------------------------------------ allocation
    def _alloc_page(self, req: Request) -> int | None:
        for h in list(self.hooks):
            if hasattr(h, "on_alloc"):
                p = h.on_alloc(self, req)
                if p is not None:
                    return p
        p = self.pages.alloc()
        while p is None and self._evict_one():
            p = self.pages.alloc()
        return p

    def _alloc_swa(self) -> int | None:
        s = self.swa_free.alloc()
        while s is None and self._evict_one():
            s = self.swa_free.alloc()
        return s

    def _evict_one(self) -> bool:
        for n in self.cache.evictable():
            self.cache.remove(n)
            self.stats_evictions += 1
            for p in n.pages:
                self._free_page(p)
            return True
        return False

    def _free_page(self, page: int) -> None:
        ps = self.cfg.page_size
        for s in range(page * ps, page * ps + ps):
            self._free_swa(s)
        self.pages.free(page)

    def _free_swa(self, slot: int) -> None:
        t = int(self.swa_of[slot])
        if t >= 0:
            self.swa_free.free(t)
            self.swa_of[slot] = -1
            self.lut.host[slot] = -1

    def _grow(self, req: Request, E: int) -> bool:
        """Give ``req`` slots for positions [P, P+E); False if the pools ran dry."""
        ps = self.cfg.page_size
        need = (req.P + E - req.shared + ps - 1) // ps
        while len(req.pages) < need:
            p = self._alloc_page(req)
            if p is None:
                return False
            req.pages.append(p)
            if ps > 1:  # a page-table entry is written once, when its page is allocated
                self.table.host[req.row, req.shared // ps + len(req.pages) - 1] = p
        for pos in range(req.P, req.P + E):
            if ps == 1:
                self._set_table(req, pos)
            if self.swa_free is not None:
                s = req.slot(pos, ps, self.cfg.block)
                if self.swa_of[s] < 0:
                    t = self._alloc_swa()
                    if t is None:
                        return False
                    self.swa_of[s] = t
                    self.lut.host[s] = t
        return True

    # ------------------------------------------------------------------ the step
    def step(self) -> StepRecord:
        cfg = self.cfg
        self.clock += 1
        self._admit()
        batch, spans = [], []
        for req in self.running:
            if len(batch) == cfg.max_batch:
                break
            E = min(cfg.chunk, req.prompt_len - req.P) if req.P < req.prompt_len else 1
            if self._grow(req, E):
                batch.append(req)
                spans.append(E)
        rec = StepRecord(self.clock, [r.rid for r in batch], [])
        if not batch:
            self._after_step(rec)
            return rec

        # --- inputs, as the engine assembles them ---------------------------------------
        ps, B = cfg.page_size, cfg.block
        bs = len(batch)
        i = {k: m.host for k, m in self.inp.items()}
        n = sum(spans)
        i["rpi"][:bs] = [r.row for r in batch]
        i["pre"][:bs] = [r.P for r in batch]
        i["ext"][:bs] = spans
        toks = np.concatenate([r.tokens[r.P:r.P + E] for r, E in zip(batch, spans)])
        poss = np.concatenate([np.arange(r.P, r.P + E) for r, E in zip(batch, spans)])
        locs = np.array([r.slot(int(p), ps, B) for r, E in zip(batch, spans) for p in range(r.P, r.P + E)], np.int64)
        i["ids"][:n], i["pos"][:n], i["loc"][:n] = toks, poss, locs
        for h in list(self.hooks):
            if hasattr(h, "on_inputs"):
                h.on_inputs(self, batch, spans)
        self._sync()
        ids = [r.rid for r in batch]

        # --- forward: verify, model writes, stamp ----------------------------------------
        # A monitor that stamps before the forward takes the step's tokens there.
        stamp = cfg.stamp_before_forward
        w = {"num_tokens": n, "max_row_tokens": max(spans)}  # the step's write inputs: bound, and its longest row
        self.monitor.before_forward(batch_size=bs, request_ids=ids, **(w if stamp else {}))
        self.k.write(i["loc"][:n], i["ids"][:n], i["pos"][:n])
        self.v.write(i["loc"][:n], i["ids"][:n], i["pos"][:n])
        if self.swa_kv is not None:
            self.swa_kv.write(self.swa_of[i["loc"][:n]], i["ids"][:n], i["pos"][:n])
        self.monitor.after_forward(**({} if stamp else w))
        for h in list(self.hooks):
            if hasattr(h, "after_stamp"):
                h.after_stamp(self, batch, spans)

        # --- sample ------------------------------------------------------------------------
        old_P = [r.P for r in batch]
        for r, E in zip(batch, spans):
            r.P += E
            if r.P == len(r.tokens):
                t = self._tokens(1)[0]
                r.tokens.append(t)
                r.generated += 1
                if len(r.tokens) - 1 < self.expected.host.shape[1]:
                    self.expected.host[r.row, len(r.tokens) - 1] = t

        # --- draft pass: slot p holds token p + 1 -------------------------------------------
        if self.draft is not None:
            i["dids"][:n] = np.concatenate([r.tokens[p + 1:p + 1 + E] for r, p, E in zip(batch, old_P, spans)])
            i["dpos"][:n] = poss
            i["dvlen"][:bs] = [p + E + 1 for p, E in zip(old_P, spans)]
            for h in list(self.hooks):
                if hasattr(h, "on_draft_inputs"):
                    h.on_draft_inputs(self, batch, spans)
            self._sync(("expected", "dids", "dpos", "dvlen"))
            self.draft.before_forward(batch_size=bs, request_ids=ids, **(w if stamp else {}))
            self.draft_kv.write(i["loc"][:n], i["dids"][:n], i["dpos"][:n])
            self.draft.after_forward(**({} if stamp else w))

        # --- slide the window, finish -------------------------------------------------------
        if cfg.swa_window:
            for r in batch:
                # Slide past the request's own tail only: the SWA slots of its system-prompt head stay, so a
                # later request can still hit that prefix (a hit needs its window's SWA slots).
                lo, hi = max(r.swa_slid, r.shared, r.sys_len), r.P - cfg.swa_window - 1
                for pos in range(lo, hi):
                    self._free_swa(r.slot(pos, ps, B))
                r.swa_slid = max(r.swa_slid, hi)
        for r in [r for r in batch if r.done]:
            self._finish(r)
        self._after_step(rec)
        return rec

    def _sync(self, names=None) -> None:
        if self.cfg.device == "cpu":
            return
        if names is None:
            mirrors = [self.table, self.expected, *self.inp.values()] + ([self.lut] if self.lut else [])
        else:
            mirrors = [self.expected if k == "expected" else self.inp[k] for k in names]
        for m in mirrors:
            m.sync()

    def _after_step(self, rec: StepRecord) -> None:
        chains = [n.chain() for n in sorted(self.cache.idle(), key=lambda n: n.id)]
        if chains:
            self.monitor.sweep(chains)
        for name, mon in self.monitors.items():
            rec.violations += [(name, v) for v in mon.poll()]
        for h in list(self.hooks):
            if hasattr(h, "after_step"):
                h.after_step(self, rec)
        self.log.append(rec)

    def _finish(self, req: Request) -> None:
        """Cache the request's full blocks (written positions only), free the rest."""
        B, ps = self.cfg.block, self.cfg.page_size
        self.running.remove(req)
        written = req.P  # the last sampled token was never fed, so never written
        parent = self.cache.root
        for d in range(len(req.nodes)):
            parent = req.nodes[d]
        kept = set()
        for d in range(len(req.nodes), written // B):
            key = tuple(req.tokens[d * B:(d + 1) * B])
            child = parent.children.get(key)
            if child is None:
                first = (d * B - req.shared) // ps
                pages = req.pages[first:first + B // ps]
                slots = [req.slot(p, ps, B) for p in range(d * B, (d + 1) * B)]
                child = self.cache.insert(parent, key, pages, slots, req.tokens[(d + 1) * B], self.clock)
                kept.update(pages)
            parent = child
        for n in req.nodes:
            n.ref -= 1
        for p in req.pages:
            if p not in kept:
                self._free_page(p)
        self.rows.free(req.row)

    # ------------------------------------------------------------------ driving
    def run(self, steps: int) -> list[StepRecord]:
        return [self.step() for _ in range(steps)]

    def find(self, predicate) -> list[Request]:
        return [r for r in self.running if predicate(r)]
