"""Random engine workloads, independent oracles, and helpers that run them through the ops.

Inputs are plain NumPy built from a ``numpy.random.Generator``; the runner places
them on a device through an array module ``xp`` (numpy or cupy), so the same
workload can drive any backend and a parity test can compare backends on
identical inputs.

The oracles here (``sm64``, ``fingerprint_of``, ``nxt``, ``chain_of``) are scalar
Python on ints, written from the record format alone: they share no code with the
vectorized backends they check. ``CHAIN`` is the chain kind the oracles and the
canaries built here use; the ``chain_kind`` fixture (conftest) runs a test once per kind.

Run as a script for the 1M-entry timing of the reference backend::

    PYTHONPATH=. python3 tests/workloads.py
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import format as fmt
from kvcanary_cupy.runtime import to_host
from kvcanary_cupy.format import RealKvMode

MASK64 = (1 << 64) - 1
ANCHOR_HASH = 0xDE7FAE23A9A1B716
P61 = (1 << 61) - 1
SCAN_ANCHOR = 0x1E7FAE23A9A1B71C
SCAN_MUL = 0x1BD238973A2B1490
CHAIN = "scan"  # the kind the oracles and the canaries below use (set by the chain_kind fixture)


# --- array plumbing ------------------------------------------------------------
def arr(xp, values, dtype=np.int64):
    """``values`` as a contiguous ``dtype`` array of module ``xp``."""
    return xp.ascontiguousarray(xp.asarray(np.asarray(values, dtype=dtype)))


def host(a) -> np.ndarray:
    """A NumPy copy of a NumPy / CuPy array (or element)."""
    return np.array(a) if isinstance(a, (np.ndarray, np.generic)) else np.array(to_host(a))


def s64(x: int) -> int:
    """An unsigned 64-bit int as the int64 a record stores."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


# --- scalar oracles --------------------------------------------------------------
def sm64(x: int) -> int:
    """splitmix64 on a Python int (the record format's finalizer)."""
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix(a: int, token: int, position: int) -> int:
    """mix3 on Python ints; token and position are int64 taken as uint64."""
    return sm64(sm64(sm64(a) ^ (token & MASK64)) ^ (position & MASK64))


def nxt(link: int, token: int, position: int) -> int:
    """The successor's link in the ``CHAIN`` kind: mix3 (sglang), or the affine step mod P61 (scan)."""
    if CHAIN == "sglang":
        return mix(link, token, position)
    term = sm64(sm64(token & MASK64) ^ (position & MASK64)) % P61
    return (SCAN_MUL * ((link & MASK64) % P61) + term) % P61


def chain() -> str:
    """The chain kind in use (``CHAIN``, read at call time)."""
    return CHAIN


def first_link() -> int:
    """The link of a sequence's first record in the ``CHAIN`` kind."""
    return ANCHOR_HASH if CHAIN == "sglang" else SCAN_ANCHOR


def chain_of(tokens, positions, seed_link: int | None = None) -> list[int]:
    """Links (unsigned ints) of one sequence whose first record has ``seed_link``
    (default: the chain kind's first link)."""
    out, running = [], first_link() if seed_link is None else seed_link
    for t, p in zip(tokens, positions):
        out.append(running)
        running = nxt(running, int(t), int(p))
    return out


@dataclass
class KvPool:
    """The bytes of one real-KV source, on the host.

    data: uint8 ``[layers, rows, page_size * bytes_per_token]`` (``layers`` is 1 and
    the axis absent from the source when ``layer_axis`` is False).
    """

    data: np.ndarray
    page_size: int
    bytes_per_token: int
    read_bytes: int
    layer_axis: bool

    @property
    def layers(self) -> np.ndarray:
        return self.data.reshape(-1, self.data.shape[-2], self.data.shape[-1])

    def slot_bytes(self, layer: int, slot: int) -> np.ndarray:
        """The bytes of ``slot`` in ``layer`` (a view, writable)."""
        row, col = divmod(slot, self.page_size)
        o = col * self.bytes_per_token
        return self.layers[layer, row, o:o + self.bytes_per_token]


def make_kv_pools(rng: np.random.Generator, num_slots: int) -> list[KvPool]:
    """Two or three sources of random bytes covering ``num_slots`` slots: a token-level
    pool, a pool with a layer axis and read_bytes < bytes_per_token, and maybe a paged one."""
    pools = []
    specs = [(1, 32, 32, False, 1), (1, 48, 32, True, 2)]
    if rng.random() < 0.5:
        specs.append((4, 16, 16, False, 1))
    for page, bpt, rb, layer_axis, layers in specs:
        rows = -(-num_slots // page)
        data = rng.integers(0, 256, size=(layers, rows, page * bpt), dtype=np.uint8)
        pools.append(KvPool(data if layer_axis else data[0], page, bpt, rb, layer_axis))
    return pools


def kv_sources(xp, pools: list[KvPool]):
    """Device copies of ``pools`` and a RealKvSource over each: ``(arrays, sources)``.

    Corrupt a byte through the returned arrays (on NumPy they are ``pool.data``)."""
    arrays, sources = [], []
    for p in pools:
        a = xp.asarray(p.data)
        arrays.append(a)
        sources.append(kc.RealKvSource(a, page_size=p.page_size, bytes_per_token=p.bytes_per_token,
                                       read_bytes=p.read_bytes, layer_axis=p.layer_axis))
    return arrays, sources


def fingerprint_of(pools: list[KvPool], mode, slot: int) -> int:
    """The real-KV fingerprint of ``slot`` (unsigned int), folded chunk by chunk."""
    if RealKvMode(mode) == RealKvMode.NONE or not pools:
        return 0
    r = 0
    for p in pools:
        eff = 16 if RealKvMode(mode) == RealKvMode.PARTIAL else p.read_bytes
        for layer in range(p.layers.shape[0]):
            b = p.slot_bytes(layer, slot)[:eff].tobytes()
            acc = 0
            for o in range(0, eff, 16):
                lo = int.from_bytes(b[o:o + 8], "little")
                hi = int.from_bytes(b[o + 8:o + 16], "little")
                acc = sm64(sm64(acc ^ lo) ^ hi)
            r = sm64(r ^ acc)
    return r


# --- workloads -------------------------------------------------------------------
@dataclass
class Step:
    """One engine step's inputs (all int64 NumPy; cast with ``Workload.index_dtype``).

    req_pool_indices, prefix_lens, extend_lens, valid_lens: ``[bs]``;
    input_ids, positions, out_cache_loc: ``[>= sum of extend_lens]``, every row's span in
    batch order, a padding row's tokens parked on slot 0 (trailing padding tokens may follow).
    """

    req_pool_indices: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    valid_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray

    @property
    def batch(self) -> int:
        return int(self.req_pool_indices.shape[0])


@dataclass
class Workload:
    """A pool, its tables, and the steps of a run that fills it.

    block_table: ``[R, pages]`` page ids (page 0 holds slot 0 and is never handed out);
    req_to_token: ``[R, width]`` the equivalent token-level table (full-pool slots);
    tokens: ``[R, width]`` each request's token ids (-1 past its length);
    lengths: ``[R]`` tokens each request holds at the end (row 0: padding, 0);
    lut: with SWA, full-pool slot -> canary slot; canary slots of written tokens
    are ``lut[req_to_token]``. num_slots: slots of the canary.
    """

    page_size: int
    block_table: np.ndarray
    req_to_token: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    num_slots: int
    swa_size: int | None
    lut: np.ndarray | None
    steps: list[Step]
    index_dtype: type = np.int64
    max_batch: int = 1

    @property
    def width(self) -> int:
        return int(self.req_to_token.shape[1])

    def canary_slots(self, full_slots) -> np.ndarray:
        full_slots = np.asarray(full_slots, dtype=np.int64)
        return full_slots if self.lut is None else self.lut[full_slots]

    def final_step(self) -> Step:
        """Read back every request whole (E = 0): the sweep that proves the run clean."""
        rp = np.arange(1, self.lengths.shape[0], dtype=np.int64)
        z = np.zeros(0, dtype=np.int64)
        return Step(rp, self.lengths[rp].copy(), np.zeros_like(rp), self.lengths[rp].copy(), z, z, z)

    def expected_entries(self, step: Step) -> list[tuple[int, int, int, int, int]]:
        """(batch_row, slot, prev_slot, position, token) of every verify entry of a clean step."""
        out = []
        for r in range(step.batch):
            rp, P = int(step.req_pool_indices[r]), int(step.prefix_lens[r])
            if rp == 0:
                continue
            start = max(0, P - self.swa_size) if self.swa_size else 0
            for pos in range(start, P):
                slot = int(self.canary_slots(self.req_to_token[rp, pos]))
                prev = int(self.canary_slots(self.req_to_token[rp, pos - 1])) if pos else -1
                out.append((r, slot, prev, pos, int(self.tokens[rp, pos])))
        return out


def make_workload(rng: np.random.Generator, *, num_requests: int = 5, max_len: int = 40, page_size: int = 1,
                  swa_size: int | None = None, share_prob: float = 0.5, max_chunk: int = 12,
                  decode_prob: float = 0.5, pad_rows: int = 2, index_dtype=np.int64) -> Workload:
    """A random run: prefill chunks and decode steps of several requests, some of which
    start from a prefix another request wrote (whole pages shared), with padding rows
    (request row 0, a garbage prefix length, a span of 0 to 2 tokens on slot 0) mixed into
    batches, and garbage past each request's
    last page so a read beyond the planned range cannot pass unnoticed."""
    R = num_requests + 1
    ps = int(page_size)
    pages_per_req = math.ceil(max_len / ps)
    width = pages_per_req * ps
    lengths = np.zeros(R, dtype=np.int64)
    lengths[1:] = rng.integers(2, width + 1, size=num_requests)
    tokens = np.full((R, width), -1, dtype=np.int64)
    for r in range(1, R):
        tokens[r, :lengths[r]] = rng.integers(1, 1 << 20, size=lengths[r])

    num_pages = 1 + num_requests * pages_per_req + 2
    free = list(rng.permutation(np.arange(1, num_pages)))
    bt = np.zeros((R, pages_per_req), dtype=np.int64)
    parent = np.full(R, -1, dtype=np.int64)
    shared = np.zeros(R, dtype=np.int64)
    for r in range(1, R):
        used = math.ceil(lengths[r] / ps)
        first = 0
        if r >= 2 and rng.random() < share_prob:
            q = int(rng.integers(1, r))
            kp = int(rng.integers(0, min(lengths[q], lengths[r] - 1) // ps + 1))  # whole pages, < length
            if kp:
                parent[r], shared[r] = q, kp * ps
                tokens[r, :kp * ps] = tokens[q, :kp * ps]
                bt[r, :kp] = bt[q, :kp]
                first = kp
        for j in range(first, used):
            bt[r, j] = free.pop()
        # never read: a negative page or one far past the pool
        bt[r, used:] = rng.choice([-1, 1 << 20], size=pages_per_req - used)
    num_full = num_pages * ps
    rt = bt[:, np.arange(width) // ps] * ps + np.arange(width) % ps
    rt[0] = 0

    lut = None
    num_slots = num_full
    if swa_size:
        num_slots = num_full + int(rng.integers(0, 8))
        lut = np.zeros(num_full, dtype=np.int64)
        lut[1:] = 1 + rng.permutation(num_slots - 1)[:num_full - 1]

    def slots_of(full):
        return full if lut is None else lut[full]

    steps, done, started = [], np.zeros(R, dtype=np.int64), np.zeros(R, dtype=bool)
    max_batch = 1
    while (done[1:] < lengths[1:]).any():
        runnable = [r for r in range(1, R) if done[r] < lengths[r]
                    and (started[r] or parent[r] < 0 or done[parent[r]] >= shared[r])]
        pick = rng.permutation(runnable)[:int(rng.integers(1, len(runnable) + 1))]
        rows = []
        for r in pick:
            if not started[r]:
                started[r], done[r] = True, shared[r]
            left = lengths[r] - done[r]
            e = 1 if done[r] and rng.random() < decode_prob else int(rng.integers(1, min(max_chunk, left) + 1))
            rows.append((int(r), int(done[r]), e))
        for _ in range(int(rng.integers(0, pad_rows + 1))):
            garbage = int(rng.choice([-7, 0, 3, 1 << 40, -(1 << 40)]))
            rows.insert(int(rng.integers(0, len(rows) + 1)), (0, garbage, int(rng.integers(0, 3))))
        ids, pos, loc = [], [], []
        for rp, P, E in rows:
            if rp:
                ids.append(tokens[rp, P:P + E])
                pos.append(np.arange(P, P + E))
                loc.append(slots_of(rt[rp, P:P + E]))
                done[rp] += E
            else:
                ids.append(np.zeros(E, dtype=np.int64))
                pos.append(np.zeros(E, dtype=np.int64))
                loc.append(np.zeros(E, dtype=np.int64))
        npad = int(rng.integers(0, 3))
        ids.append(np.zeros(npad, dtype=np.int64))
        pos.append(np.zeros(npad, dtype=np.int64))
        loc.append(np.zeros(npad, dtype=np.int64))
        rp_a = np.array([r[0] for r in rows], dtype=np.int64)
        steps.append(Step(rp_a, np.array([r[1] for r in rows], dtype=np.int64),
                          np.array([r[2] for r in rows], dtype=np.int64), lengths[rp_a].copy(),
                          np.concatenate(ids).astype(np.int64), np.concatenate(pos).astype(np.int64),
                          np.concatenate(loc).astype(np.int64)))
        max_batch = max(max_batch, len(rows))
    return Workload(ps, bt, rt, tokens, lengths, num_slots, swa_size, lut, steps, index_dtype,
                    max(max_batch, R - 1))


# --- monitors ----------------------------------------------------------------------
def sync(xp) -> None:
    """Wait for the device (nothing to wait for on NumPy)."""
    if xp is not np:
        xp.cuda.Device().synchronize()


def drain(mon, xp) -> list:
    """Everything a monitor found so far (on CUDA poll returns one copy late: poll twice
    around a sync)."""
    out = mon.poll()
    if xp is not np:
        sync(xp)
        out += mon.poll()
    return out


# --- running a workload ----------------------------------------------------------
@dataclass
class Runner:
    """Runs a workload through plan -> verify -> write per step, on one device.

    table: "token" (req_to_token) or "block" (block_table + page_size).
    """

    xp: object
    device: str
    wl: Workload
    table: str = "token"
    sources: tuple = ()
    mode: RealKvMode = RealKvMode.NONE
    check_tokens: bool = True
    log_capacity: int = 4096
    canary: object = None
    log: object = None
    vp: object = None
    wp: object = None
    tokens_written: int = 0
    kernel_runs: int = 0
    _dev: dict = field(default_factory=dict)

    def __post_init__(self):
        xp, wl, dt = self.xp, self.wl, self.wl.index_dtype
        self.canary = kc.CanaryBuffer.allocate(num_slots=wl.num_slots, device=self.device, chain=CHAIN)
        self.log = kc.ViolationLog.allocate(capacity=self.log_capacity, device=self.device)
        cap = max(1, int(wl.lengths.sum()))
        self.vp = kc.VerifyPlan.allocate(capacity=cap, max_batch=wl.max_batch, device=self.device)
        self.wp = kc.WritePlan.allocate(max_batch=wl.max_batch, device=self.device)
        if self.table == "token":
            self._dev["table"] = dict(req_to_token=arr(xp, wl.req_to_token, dt))
        else:
            self._dev["table"] = dict(block_table=arr(xp, wl.block_table, dt), page_size=wl.page_size)
        self._dev["swa"] = kc.SwaWindow(wl.swa_size, arr(xp, wl.lut, dt)) if wl.swa_size else None
        self._dev["tokens"] = arr(xp, wl.tokens, dt)

    def plan(self, step: Step, *, verify_plan=True, write_plan=True) -> None:
        xp, dt = self.xp, self.wl.index_dtype
        expected = kc.ExpectedTokens(self._dev["tokens"], arr(xp, step.valid_lens, dt)) if verify_plan else None
        kc.plan(self.vp if verify_plan else None, self.wp if write_plan else None,
                req_pool_indices=arr(xp, step.req_pool_indices, dt), prefix_lens=arr(xp, step.prefix_lens, dt),
                extend_lens=arr(xp, step.extend_lens, dt), swa=self._dev["swa"], expected=expected,
                **self._dev["table"])

    def verify(self, tag=kc.LaunchTag.VERIFY, **kw) -> None:
        kc.verify(self.canary, self.vp, log=self.log, tag=tag, real_kv=self.sources, real_kv_mode=self.mode,
                  check_tokens=self.check_tokens, **kw)
        self.kernel_runs += 1

    def write(self, step: Step) -> None:
        xp, dt = self.xp, self.wl.index_dtype
        kc.write(self.canary, self.wp, input_ids=arr(xp, step.input_ids, dt), positions=arr(xp, step.positions, dt),
                 out_cache_loc=arr(xp, step.out_cache_loc, dt), log=self.log, tag=kc.LaunchTag.WRITE,
                 real_kv=self.sources, real_kv_mode=self.mode)
        self.kernel_runs += 1
        self.tokens_written += int(step.extend_lens[step.req_pool_indices != 0].sum())

    def run(self) -> "Runner":
        """Every step (plan, verify the prefix, write), then the final whole-request verify."""
        for step in self.wl.steps:
            self.plan(step)
            self.verify()
            self.write(step)
        return self.final()

    def final(self) -> "Runner":
        self.plan(self.wl.final_step(), write_plan=False)
        self.verify(tag=kc.LaunchTag.SWEEP)
        return self


# --- a small fixed setting for hand-made cases -------------------------------------
class Env:
    """A canary, a log and a pair of plans on one device, with terse op calls.

    Entry arrays are poisoned (-777) before every plan, so an entry the plan did not
    write shows; the write plan's arrays too.
    """

    POISON = -777

    def __init__(self, xp, device, *, num_slots=64, capacity=256, max_batch=8, log_capacity=64, table=None,
                 dtype=np.int64):
        self.xp, self.device, self.dtype = xp, device, dtype
        self.canary = kc.CanaryBuffer.allocate(num_slots=num_slots, device=device, chain=CHAIN)
        self.log = kc.ViolationLog.allocate(capacity=log_capacity, device=device)
        self.vp = kc.VerifyPlan.allocate(capacity=capacity, max_batch=max_batch, device=device)
        self.wp = kc.WritePlan.allocate(max_batch=max_batch, device=device)
        self.table = table

    def a(self, values, dtype=None):
        return arr(self.xp, values, dtype or self.dtype)

    def poison(self) -> None:
        for f in kc.VerifyPlan.ENTRY_FIELDS + ("offsets",):
            getattr(self.vp, f).fill(self.POISON)
        self.wp.offsets.fill(self.POISON)
        self.wp.seed_slots.fill(self.POISON)

    def plan(self, rp, P, E, *, verify_plan=True, write_plan=True, **kw) -> None:
        if "req_to_token" not in kw and "block_table" not in kw:
            kw["req_to_token"] = self.a(self.table)
        self.poison()
        kc.plan(self.vp if verify_plan else None, self.wp if write_plan else None,
                req_pool_indices=self.a(rp), prefix_lens=self.a(P), extend_lens=self.a(E), **kw)

    def write(self, ids, pos, loc, *, tag=kc.LaunchTag.WRITE, **kw) -> None:
        kc.write(self.canary, self.wp, input_ids=self.a(ids), positions=self.a(pos), out_cache_loc=self.a(loc),
                 log=self.log, tag=tag, **kw)

    def verify(self, *, tag=kc.LaunchTag.VERIFY, **kw) -> None:
        kc.verify(self.canary, self.vp, log=self.log, tag=tag, **kw)

    def records(self) -> np.ndarray:
        return host(self.canary.records)

    def entries(self) -> dict:
        return {f: host(getattr(self.vp, f)) for f in kc.VerifyPlan.ENTRY_FIELDS}

    def scalars(self) -> dict:
        return {f: int(host(getattr(self.vp, f))[0]) for f in kc.VerifyPlan.SCALAR_FIELDS}

    def rows(self, *, detail: bool = False) -> list[tuple]:
        """Violation rows as sorted tuples (GPU order is not deterministic): SGLang's ten
        columns, or every column with ``detail`` (``vrow`` / ``vrow_detail`` build them)."""
        n = fmt.VIOLATION_WORDS if detail else fmt.SGLANG_VIOLATION_WORDS
        return sorted(v.as_row()[:n] for v in self.log.read())


def vrow(*, tag, slot, position=-1, stored_token=-1, expected_token=-1, stored_link=0, expected_link=0,
         bits, batch_row, expected_position=-1) -> tuple:
    """A violation row's first ten columns (SGLang's) as ``Violation.as_row`` gives them; links
    may be unsigned."""
    return (int(tag), slot, position, stored_token, expected_token, s64(stored_link), s64(expected_link),
            int(bits), batch_row, expected_position)


def vrow_detail(*, detail: dict, **sglang_columns) -> tuple:
    """A whole violation row: ``vrow``'s columns, then the detail columns, each from ``detail``
    (fingerprints may be unsigned) or its ``format.UNUSED_DETAIL`` value."""
    unknown = set(detail) - set(fmt.UNUSED_DETAIL)
    assert not unknown, unknown
    tail = tuple(s64(detail.get(name, fmt.UNUSED_DETAIL[name]))
                 for name in fmt.VIOLATION_COLUMNS[fmt.SGLANG_VIOLATION_WORDS:])
    return vrow(**sglang_columns) + tail


# --- the 1M-entry timing -----------------------------------------------------------
def time_million(num_requests: int = 128, prefix: int = 8192, chunk: int = 2048, kv: bool = False) -> dict:
    """Prefill ``num_requests`` x ``prefix`` tokens in chunks (plan + write per chunk), then
    plan and verify every token (``num_requests * prefix`` entries) with one decode write.
    ``kv``: fingerprint a 2-layer, 64-byte-per-token pool in PARTIAL mode too."""
    import time  # noqa: PLC0415

    rng = np.random.default_rng(0)
    n = num_requests * prefix
    slots = (1 + rng.permutation(n + num_requests)).astype(np.int64)
    table = np.zeros((num_requests + 1, prefix + 1), dtype=np.int32)
    table[1:] = slots.reshape(num_requests, prefix + 1)
    toks = rng.integers(1, 1 << 17, size=(num_requests + 1, prefix + 1))
    canary = kc.CanaryBuffer.allocate(num_slots=n + num_requests + 1)
    log = kc.ViolationLog.allocate(capacity=1024)
    vp = kc.VerifyPlan.allocate(capacity=n, max_batch=num_requests)
    wp = kc.WritePlan.allocate(max_batch=num_requests)
    rp = np.arange(1, num_requests + 1, dtype=np.int64)
    fp = {}
    if kv:
        pool = rng.integers(0, 256, size=(2, canary.num_slots, 64), dtype=np.uint8)
        fp = dict(real_kv=[kc.RealKvSource(pool, bytes_per_token=64, layer_axis=True)],
                  real_kv_mode=RealKvMode.PARTIAL)
    t0 = time.perf_counter()
    for p0 in range(0, prefix, chunk):
        kc.plan(None, wp, req_pool_indices=rp, prefix_lens=np.full(num_requests, p0),
                extend_lens=np.full(num_requests, chunk), req_to_token=table)
        cols = np.arange(p0, p0 + chunk)
        kc.write(canary, wp, input_ids=toks[1:, cols].ravel(), positions=np.tile(cols, num_requests),
                 out_cache_loc=table[1:, cols].astype(np.int64).ravel(), log=log, tag=2, **fp)
    t1 = time.perf_counter()
    kc.plan(vp, wp, req_pool_indices=rp, prefix_lens=np.full(num_requests, prefix),
            extend_lens=np.ones(num_requests, np.int64), req_to_token=table,
            expected=kc.ExpectedTokens(toks, np.full(num_requests, prefix)))
    t2 = time.perf_counter()
    kc.verify(canary, vp, log=log, tag=1, check_tokens=True, **fp)
    t3 = time.perf_counter()
    kc.write(canary, wp, input_ids=toks[1:, prefix].copy(), positions=np.full(num_requests, prefix),
             out_cache_loc=table[1:, prefix].astype(np.int64), log=log, tag=2, **fp)
    t4 = time.perf_counter()
    assert log.count == 0 and int(vp.num_valid[0]) == n, (log.count, log.read()[:3])
    return {"entries": n, "prefill_writes_s": t1 - t0, "plan_s": t2 - t1, "verify_s": t3 - t2,
            "decode_write_s": t4 - t3, "plan_verify_write_s": t4 - t1}


if __name__ == "__main__":
    for kv in (False, True):
        print("real-KV PARTIAL, 2 layers" if kv else "no real-KV")
        for k, v in time_million(kv=kv).items():
            print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
