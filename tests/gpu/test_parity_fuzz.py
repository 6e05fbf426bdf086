"""Parity fuzz: the CUDA backend against the NumPy reference on random workloads.

Each case builds one random step in NumPy (batch with padding rows, token- or
page-level table, SWA window and LUT, expected tokens, real-KV sources with a
layer axis, corrupted records / KV bytes / tables / plans, out-of-range data of
every kind, int32 and int64 indices), copies it to both backends and runs
plan -> scatter_expected_tokens -> write -> verify (sometimes twice, sampled),
comparing after every op: canary bytes, plan arrays and scalars, counters
(skipped verifies, writes and tokens included), violation rows as multisets
(the GPU appends in no fixed order). Page ids whose slot does not fit int64,
some wrapping onto small valid slots, must make their rows input errors alike.

Rows of one step never write a slot another row writes or reads (the order
between rows is a race on a GPU by nature); within a row duplicates occur.

``KVCANARY_FUZZ_CASES`` (default 500) sets the number of cases,
``KVCANARY_FUZZ_SEED`` the seed; the count is printed.
"""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest

from kvcanary_cupy import (
    CanaryBuffer,
    ExpectedTokens,
    FingerprintSampler,
    RealKvMode,
    RealKvSource,
    SwaWindow,
    VerifyPlan,
    ViolationLog,
    WritePlan,
    runtime,
)
from kvcanary_cupy import format as fmt
from kvcanary_cupy import ops
from kvcanary_cupy.backends import reference

pytestmark = pytest.mark.gpu

CASES = int(os.environ.get("KVCANARY_FUZZ_CASES", "500"))
SEED = int(os.environ.get("KVCANARY_FUZZ_SEED", "20250531"))
POISON = -7777


# --- sides: where a backend's buffers live -------------------------------------
class Side:
    """A backend plus how to move NumPy arrays to its device and back. ``fused_entries``: its
    fused ops (plan_and_verify, plan_verify_write) write the verify entries, as the reference
    does (the CUDA kernels leave them unwritten); ``ordered``: it appends violation rows in the
    reference's order (a GPU appends in no fixed order)."""

    def __init__(self, backend, device: str, to_dev, to_host, fused_entries: bool = False, ordered: bool = False):
        self.backend, self.device, self.to_dev, self.to_host = backend, device, to_dev, to_host
        self.fused_entries, self.ordered = fused_entries, ordered

    def check_fused_entries(self, what: str, ref: "Side", dvp, rvp) -> None:
        """After a fused op: the entries poisoned as they were, or (``fused_entries``) the reference's."""
        n = int(ref.to_host(rvp.num_valid)[0]) if int(ref.to_host(rvp.enable)[0]) == 1 else 0
        for f in VerifyPlan.ENTRY_FIELDS:
            got = self.to_host(getattr(dvp, f))
            if self.fused_entries:  # the plan's entries; none past them (the array was poisoned)
                _eq(f"{what} vp.{f}", got[:n], ref.to_host(getattr(rvp, f))[:n])
                got = got[n:]
            assert (got == POISON).all(), f"{what} wrote entries past the plan's"

    def run(self, op: str, *args, **kwargs) -> None:
        """The backend's ``op``, prepared and launched at once on the current stream (the fuzz
        hands the backends raw views, as ops.py would after validating them)."""
        stream = None if self.device == "cpu" else runtime.cupy().cuda.get_current_stream().ptr
        getattr(self.backend, "prepare_" + op)(*args, stream=stream, **kwargs)(stream)


def cpu_side() -> Side:
    return Side(reference, "cpu", lambda a: np.array(a, copy=True), lambda a: np.asarray(a))


def cuda_side() -> Side:
    import cupy  # noqa: PLC0415

    from kvcanary_cupy.backends import cuda  # noqa: PLC0415

    return Side(cuda, "cuda", cupy.asarray, lambda a: cupy.asnumpy(a))


# --- random workload -----------------------------------------------------------
def _idx(rng, a):
    """An index array as int32 or int64 at random (values kept if they fit)."""
    a = np.asarray(a, dtype=np.int64)
    if rng.random() < 0.5 and (a.size == 0 or (a.min() >= -(2 ** 31) and a.max() < 2 ** 31)):
        return a.astype(np.int32)
    return a


def _chain(tokens, positions, seed_link, chain) -> np.ndarray:
    """Links of one chained run (uint64)."""
    return fmt.chain_links(tokens, positions, seed_link, chain=chain)


def gen_case(rng, scale: float = 1.0) -> dict:
    """One random step (all NumPy): geometry, tables, records, sources, inputs."""
    c: dict = {}
    big = rng.random() < 0.05 * scale
    page = int(rng.choice([1, 1, 1, 2, 4, 16]))
    c["token_level"] = page == 1 and rng.random() < 0.7
    c["page"] = page
    decode = rng.random() < 0.25
    bs = int(rng.integers(1, 2049)) if decode and rng.random() < 0.3 * scale else int(rng.integers(1, 33))
    max_prefix = 16384 if big else (300 if decode else int(rng.choice([8, 64, 600])))
    if bs > 200:
        max_prefix = 24
    max_extend = 1 if decode else int(rng.choice([4, 16, 64, 300]))
    swa = rng.random() < 0.3
    nreq = bs + 1 + int(rng.integers(0, 4))
    rps = rng.permutation(np.arange(1, nreq))[:bs]
    pad = rng.random(bs) < 0.1
    rps[pad] = 0
    P = rng.integers(0, max_prefix + 1, size=bs)
    if big:
        P[rng.integers(0, bs)] = max_prefix
    E = rng.integers(0, max_extend + 1, size=bs)
    if not decode and rng.random() < 0.1 * scale:  # a long prefill row: several steps of a block
        E[int(rng.integers(0, bs))] = int(rng.integers(1025, 5000))
    lens = P + E
    width_pos = int(lens.max()) + int(rng.integers(0, 8))
    twidth = -(-max(width_pos, 1) // page)
    width_pos = twidth * page
    # Distinct pages per request (page 0 holds the reserved slot 0).
    need = np.zeros(nreq, dtype=np.int64)
    need[rps] = -(-lens // page)
    need[0] = 0
    npages_full = int(need.sum()) + 1 + int(rng.integers(0, 8))
    perm = rng.permutation(np.arange(1, npages_full))
    table = rng.integers(0, npages_full, size=(nreq, twidth)).astype(np.int64)  # unused rows: junk
    table[0] = 0
    at = 0
    for rp in range(1, nreq):
        k = int(need[rp])
        table[rp, :k] = perm[at:at + k]
        at += k
    nslots_full = npages_full * page
    if c["token_level"]:
        # req_to_token: slot = table value; values are page ids times 1.
        pass
    c["table"], c["twidth"] = table, twidth
    if swa:
        size = int(rng.integers(1, max(2, int(P.max()) + 3)))
        lut_len = nslots_full if rng.random() < 0.9 else int(rng.integers(1, nslots_full + 1))
        n_swa = nslots_full + int(rng.integers(1, 16))
        lut = rng.permutation(np.arange(1, n_swa))[:lut_len].astype(np.int64)
        lut[0] = 0  # full slot 0 (reserved) maps to SWA slot 0
        num_slots = n_swa
        c["swa"] = (size, lut)
    else:
        c["swa"] = None
        num_slots = nslots_full + int(rng.integers(0, 8))
    c["num_slots"] = num_slots
    c["rps"], c["P"], c["E"], c["bs"], c["nreq"] = rps, P, E, bs, nreq

    # Out-of-range batch / table data.
    if rng.random() < 0.3:
        for _ in range(int(rng.integers(1, 4))):
            r = int(rng.integers(0, bs))
            kind = int(rng.integers(0, 8))
            if kind == 0:
                rps[r] = nreq + int(rng.integers(0, 3))
            elif kind == 1:
                rps[r] = -int(rng.integers(1, 3))
            elif kind == 2:
                P[r] = width_pos + int(rng.integers(1, 4))
            elif kind == 3:
                E[r] = width_pos - max(P[r], 0) + int(rng.integers(1, 4))
            elif kind == 4:
                P[r] = -int(rng.integers(1, 3))
            elif kind == 5:
                E[r] = -1
            elif kind == 6 and 0 < rps[r] < nreq and 0 < P[r] <= width_pos:
                table[rps[r], int(rng.integers(0, -(-P[r] // page)))] = -int(rng.integers(1, 5))
            elif kind == 7 and 0 < rps[r] < nreq and 0 < P[r] <= width_pos:
                # page-level: a page id whose slot does not fit int64, wrapping mod 2**64 either
                # negative or (page >= 4) onto a small, valid-looking slot; token-level: a slot
                # past the pool
                if page == 1:
                    v = num_slots + 100
                elif page >= 4 and rng.random() < 0.5:
                    v = (1 << 64) // page + int(rng.integers(0, 3))
                else:
                    v = (1 << 63) // page + 5
                table[rps[r], int(rng.integers(0, -(-P[r] // page)))] = v
    if swa and rng.random() < 0.3:
        lut = c["swa"][1]
        lut[rng.integers(0, lut.shape[0], size=2)] = -1

    # Expected tokens.
    c["expected"] = None
    if rng.random() < 0.5:
        erows = nreq if rng.random() < 0.9 else max(1, nreq - 2)
        ewidth = max(1, width_pos + int(rng.integers(-3, 3)))
        etab = rng.integers(-1, 1000, size=(erows, ewidth))
        vl = np.minimum(P + E, ewidth) + rng.integers(-2, 3, size=bs)
        c["expected"] = (etab, vl, int(rng.choice([0, 1])))

    # Real-KV sources.
    c["sources"] = []
    c["mode"] = RealKvMode(int(rng.choice([0, 1, 2, 2])))
    if c["mode"] != RealKvMode.NONE or rng.random() < 0.2:
        for _ in range(int(rng.integers(1, 9 if not big else 3))):
            layers = int(rng.integers(1, 4))
            bpt = int(rng.choice([16, 32, 64, 256]))
            rb = int(rng.integers(1, bpt // 16 + 1)) * 16
            spage = int(rng.choice([1, 2, 8]))
            rows = -(-num_slots // spage) + int(rng.integers(0, 2))
            data = rng.integers(0, 256, size=(layers, rows * spage * bpt), dtype=np.uint8)
            c["sources"].append((data, spage, bpt, rb, layers))

    # Records of every prefix window: a clean chain from the window head's predecessor.
    c["rec_seed"] = int(rng.integers(0, 2 ** 63))
    c["big"] = big
    c["corrupt_records"] = int(rng.integers(0, 6)) if rng.random() < 0.4 else 0
    c["corrupt_kv"] = int(rng.integers(1, 6)) if rng.random() < 0.3 else 0
    c["capacity_factor"] = float(rng.choice([0.0, 0.5, 1.0, 1.0, 1.0, 2.0]))
    c["ring_capacity"] = int(rng.choice([1, 8, 64, 4096]))
    c["plans"] = str(rng.choice(["both", "both", "both", "verify", "write"]))
    c["chain"] = str(rng.choice(["scan", "sglang"]))
    c["fused"] = rng.random() < 0.5  # also plan_and_verify against plan + verify
    c["stamp"] = rng.random() < 0.5  # also plan_verify_write against plan + verify + write
    return c


def slot_of(c, rp, pos):
    """T(table(rp, pos)) or None when unreadable (host-side, for building records/inputs)."""
    page = c["page"]
    v = int(c["table"][rp, pos // page])
    if v < 0:
        return None
    s = v * page + pos % page
    if s >= 2 ** 63:
        return None
    if c["swa"] is not None:
        lut = c["swa"][1]
        if s >= lut.shape[0] or lut[s] < 0:
            return None
        s = int(lut[s])
    return s


# --- building both sides ---------------------------------------------------------
def build_state(c, rng, side: Side) -> dict:
    st = {}
    st["canary"] = CanaryBuffer(side.to_dev(c["records"]), c["chain"])
    st["sources"] = tuple(RealKvSource(side.to_dev(d), page_size=p, bytes_per_token=b, read_bytes=r, layer_axis=True)
                          for (d, p, b, r, _l) in c["sources"])
    return st


def prefix_records(c, rng):
    """Canary records: clean chains over each active row's window (+ predecessor),
    junk elsewhere. Returns (records, written slots, {rp: (first position, tokens)})."""
    N = c["num_slots"]
    rec = np.zeros((N, 4), dtype=np.int64)
    junk = rng.random(N) < 0.05
    rec[junk] = rng.integers(-5, 2 ** 40, size=(int(junk.sum()), 4))
    written = np.zeros(N, dtype=bool)
    runs = {}
    budget = 70000
    for r in range(c["bs"]):
        rp, P = int(c["rps"][r]), int(c["P"][r])
        if rp <= 0 or rp >= c["nreq"] or P <= 0 or P > c["twidth"] * c["page"]:
            continue
        swa = c["swa"]
        start = max(0, P - swa[0]) if swa is not None else 0
        lo = max(start - 1, 0)
        n = P - lo
        if n > budget:
            continue
        budget -= n
        toks = rng.integers(0, 50000, size=n)
        poss = np.arange(lo, P)
        seed = fmt.first_link(c["chain"]) if lo == 0 else int(rng.integers(0, 2 ** 63))
        links = _chain(toks, poss, seed, c["chain"])
        runs[rp] = (lo, toks)
        for j, pos in enumerate(range(lo, P)):
            s = slot_of(c, rp, pos)
            if s is None or s >= N:
                continue
            rec[s] = (toks[j], pos, links[j].view(np.int64), 0)
            written[s] = True
    return rec, written, runs


def fill_fingerprints(c, rec, written, cpu_sources):
    """Stored fingerprints that match the live bytes (before any KV corruption)."""
    live = np.nonzero(written)[0]
    if len(live) and cpu_sources and c["mode"] != RealKvMode.NONE:
        rec[live, 3] = reference.fingerprints(cpu_sources, c["mode"], live).view(np.int64)


def fill_expected(c, rng, runs):
    """Expected tokens that mostly agree with the stored prefix tokens."""
    if c["expected"] is None:
        return
    etab, _vl, off = c["expected"]
    for rp, (lo, toks) in runs.items():
        if rp >= etab.shape[0]:
            continue
        for j, t in enumerate(toks):
            k = lo + j + off
            if 0 <= k < etab.shape[1]:
                etab[rp, k] = t if rng.random() > 0.02 else t + 1


def write_inputs(c, rng, wp_offsets, wp_seeds, bs):
    """input_ids / positions / out_cache_loc for the rows the write plan holds."""
    total = int(wp_offsets[bs])
    ids = rng.integers(0, 50000, size=total)
    pos = np.zeros(total, dtype=np.int64)
    loc = np.full(total, -1, dtype=np.int64)
    N = c["num_slots"]
    for r in range(bs):
        a, b = int(wp_offsets[r]), int(wp_offsets[r + 1])
        if b <= a:
            continue
        if int(wp_seeds[r]) == fmt.SEED_SKIP:  # a row that stamps nothing keeps its span: slots it must not stamp
            loc[a:b] = rng.integers(0, N, size=b - a)
            continue
        rp, P = int(c["rps"][r]), int(c["P"][r])
        row_slots = []
        for j in range(b - a):
            p = P + j
            pos[a + j] = p
            s = slot_of(c, rp, p)
            loc[a + j] = -1 if s is None else s
            if s is not None:
                row_slots.append(s)
        # Corruption within the row: skipped slots, out-of-range slots, duplicates, position slips.
        for _ in range(int(rng.integers(0, 3)) if rng.random() < 0.4 else 0):
            j = a + int(rng.integers(0, b - a))
            kind = int(rng.integers(0, 4))
            if kind == 0:
                loc[j] = -int(rng.integers(1, 3))
            elif kind == 1:
                loc[j] = N + int(rng.integers(0, 5))
            elif kind == 2 and row_slots:
                loc[j] = row_slots[int(rng.integers(0, len(row_slots)))]
            else:
                pos[j] += int(rng.choice([-1, 1, 2]))
    return ids, pos, loc


# --- comparisons -----------------------------------------------------------------
def _rows_multiset(rows) -> collections.Counter:
    return collections.Counter(tuple(int(x) for x in r) for r in rows)


class LogPair:
    """The reference logs into a large ring; the device log may overflow. After each
    op: heads and counters equal; the device's kept rows of the op are the
    reference's rows of the op (equal multisets, or a sub-multiset on overflow)."""

    def __init__(self, ref: Side, dev: Side, capacity: int, ref_capacity: int):
        self.ref_log = ViolationLog.allocate(capacity=ref_capacity, device=ref.device)
        self.dev_log = ViolationLog.allocate(capacity=capacity, device=dev.device)
        self.dev_log.ring.fill(POISON)
        self.ref, self.dev = ref, dev
        self.head = 0

    def check(self, what: str):
        rh = int(self.ref.to_host(self.ref_log.head)[0])
        dh = int(self.dev.to_host(self.dev_log.head)[0])
        assert rh == dh, f"{what}: violation count {dh} != reference {rh}"
        rc = self.ref.to_host(self.ref_log.counter_array)
        dc = self.dev.to_host(self.dev_log.counter_array)
        assert np.array_equal(rc, dc), f"{what}: counters {dc.tolist()} != reference {rc.tolist()}"
        ref_rows = self.ref.to_host(self.ref_log.ring)[self.head:rh]
        cap = self.dev_log.capacity
        lo, hi = min(self.head, cap), min(dh, cap)
        dev_ring = self.dev.to_host(self.dev_log.ring)
        dev_rows = dev_ring[lo:hi]
        assert (dev_ring[hi:] == POISON).all(), f"{what}: ring rows past the head were written"
        rm, dm = _rows_multiset(ref_rows), _rows_multiset(dev_rows)
        if hi - lo == rh - self.head and self.dev.ordered:
            _eq(f"{what}: violation rows, in order", dev_rows, ref_rows)
        elif hi - lo == rh - self.head:
            assert rm == dm, f"{what}: violation rows differ:\n only device {dm - rm}\n only reference {rm - dm}"
        else:
            assert not (dm - rm), f"{what}: device rows not in the reference: {dm - rm}"
        self.head = rh


def _eq(what, a, b):
    a, b = np.asarray(a), np.asarray(b)
    if not np.array_equal(a, b):
        bad = np.nonzero(a.ravel() != b.ravel())[0][:8]
        raise AssertionError(f"{what}: device != reference at flat {bad.tolist()}: "
                             f"{a.ravel()[bad].tolist()} vs {b.ravel()[bad].tolist()}")


def compare_plans(what, ref: Side, dev: Side, rvp, dvp, rwp, dwp):
    if rvp is not None:
        for f in VerifyPlan.SCALAR_FIELDS + ("offsets", "first_input_error"):
            _eq(f"{what} vp.{f}", dev.to_host(getattr(dvp, f)), ref.to_host(getattr(rvp, f)))
        # The entries are defined up to num_valid; a plan that overflowed writes none.
        n = int(ref.to_host(rvp.num_valid)[0])
        enabled = int(ref.to_host(rvp.enable)[0]) == 1
        for f in VerifyPlan.ENTRY_FIELDS:
            d = dev.to_host(getattr(dvp, f))
            _eq(f"{what} vp.{f}", d[:n], ref.to_host(getattr(rvp, f))[:n])
            if not enabled:
                assert (d == POISON).all(), f"{what} vp.{f}: an overflowed plan wrote entries"
    if rwp is not None:
        for f in ("offsets", "seed_slots", "num_rows", "input_errors"):
            _eq(f"{what} wp.{f}", dev.to_host(getattr(dwp, f)), ref.to_host(getattr(rwp, f)))


# --- one case ----------------------------------------------------------------------
def run_case(seed, ref: Side, dev: Side, scale: float = 1.0) -> None:
    rng = np.random.default_rng(seed)
    c = gen_case(rng, scale)
    cpu_sources = tuple(RealKvSource(d, page_size=p, bytes_per_token=b, read_bytes=r, layer_axis=True)
                        for (d, p, b, r, _l) in c["sources"])
    rec, written, runs = prefix_records(c, rng)
    fill_fingerprints(c, rec, written, cpu_sources)
    fill_expected(c, rng, runs)
    # Corrupt some records and KV bytes (after the fingerprints were taken).
    for _ in range(c["corrupt_records"]):
        s = int(rng.integers(0, c["num_slots"]))
        rec[s, int(rng.integers(0, 4))] ^= 1 << int(rng.integers(0, 63))
    for _ in range(c["corrupt_kv"]):
        if c["sources"]:
            d = c["sources"][int(rng.integers(0, len(c["sources"])))][0]
            d[int(rng.integers(0, d.shape[0])), int(rng.integers(0, d.shape[1]))] ^= 0x5A
    c["records"] = rec

    sides = {}
    for name, side in (("ref", ref), ("dev", dev)):
        st = build_state(c, rng, side)
        st["side"] = side
        sides[name] = st
    bs = c["bs"]
    max_batch = bs + int(rng.integers(0, 4))
    total_entries = int(np.sum(np.maximum(c["P"], 0)))
    cap = max(0, int(total_entries * c["capacity_factor"]) + int(rng.integers(-1, 2)))
    with_vp = c["plans"] in ("both", "verify")
    with_wp = c["plans"] in ("both", "write")
    init_err = int(rng.integers(0, 3))
    for st in sides.values():
        side = st["side"]
        st["vp"] = VerifyPlan.allocate(capacity=cap, max_batch=max_batch, device=side.device) if with_vp else None
        st["wp"] = WritePlan.allocate(max_batch=max_batch, device=side.device) if with_wp else None
        for p in (st["vp"], st["wp"]):
            if p is not None:
                p.input_errors.fill(init_err)
        if st["vp"] is not None:
            for f in VerifyPlan.ENTRY_FIELDS + ("first_input_error",):  # every plan writes the last
                getattr(st["vp"], f).fill(POISON)
        if st["wp"] is not None:
            st["wp"].seed_slots.fill(POISON)

    # Plan inputs with random index dtypes (the same on both sides).
    rpi, pre, ext = _idx(rng, c["rps"]), _idx(rng, c["P"]), _idx(rng, c["E"])
    table = _idx(rng, c["table"])
    lut = _idx(rng, c["swa"][1]) if c["swa"] is not None else None
    exp = None
    if c["expected"] is not None:
        exp = (_idx(rng, c["expected"][0]), _idx(rng, c["expected"][1]), c["expected"][2])
    for st in sides.values():
        side = st["side"]
        d = side.to_dev
        swa = SwaWindow(c["swa"][0], d(lut)) if lut is not None else None
        et = ExpectedTokens(d(exp[0]), d(exp[1]), exp[2]) if exp is not None and st["vp"] is not None else None
        side.run("plan", st["vp"], st["wp"], req_pool_indices=d(rpi), prefix_lens=d(pre), extend_lens=d(ext),
                          table=d(table), page_size=c["page"], swa=swa, expected=et)
    R, D = sides["ref"], sides["dev"]
    compare_plans("plan", ref, dev, R["vp"], D["vp"], R["wp"], D["wp"])

    # The reference ring holds every row this case can raise: one per verify entry
    # (two verifies at most), one per write token, one per write row.
    ref_ring = 2 * cap + int(np.maximum(c["E"], 0).sum()) + 2 * max_batch + 64
    logs = LogPair(ref, dev, c["ring_capacity"], ref_ring)
    for st, lg in ((R, logs.ref_log), (D, logs.dev_log)):
        st["log"] = lg
    tag = int(rng.integers(-3, 10))

    # scatter_expected_tokens into a fresh table, from random spans.
    if rng.random() < 0.3:
        ntab = int(rng.integers(1, 12))
        width = int(rng.integers(1, 40))
        sb = int(rng.integers(1, 10))
        spans = rng.integers(0, 50, size=sb)
        offs = np.concatenate(([0], np.cumsum(spans)))
        if rng.random() < 0.3:
            offs[int(rng.integers(0, sb + 1))] += int(rng.integers(-5, 60))
        toks = rng.integers(-5, 90000, size=int(max(offs[-1], 0)) + int(rng.integers(-3, 3)) if offs[-1] > 3 else 4)
        srp = rng.permutation(np.arange(-1, ntab + 2))[:sb]
        tab0 = rng.integers(0, 9, size=(ntab, width))
        tab_t, toks_t, offs_t, srp_t = _idx(rng, tab0), _idx(rng, toks), _idx(rng, offs), _idx(rng, srp)
        outs = []
        for st in (R, D):
            side = st["side"]
            t = side.to_dev(tab_t)
            side.run("scatter", t, tokens=side.to_dev(toks_t), offsets=side.to_dev(offs_t),
                                                 req_pool_indices=side.to_dev(srp_t))
            outs.append(side.to_host(t))
        _eq("scatter_expected_tokens", outs[1], outs[0])

    # write
    if with_wp:
        wo = ref.to_host(R["wp"].offsets)
        ids, pos, loc = write_inputs(c, rng, wo, ref.to_host(R["wp"].seed_slots), bs)
        total = ids.shape[0]
        cut = total
        if rng.random() < 0.15 and total > 0:
            cut = int(rng.integers(0, total))  # inputs shorter than the plan: INPUT_OUT_OF_RANGE
        elif rng.random() < 0.2:
            cut = total + int(rng.integers(1, 4))
        def fit(a):
            a = np.asarray(a, dtype=np.int64)
            if cut <= a.shape[0]:
                return a[:cut]
            return np.concatenate([a, rng.integers(0, 9, size=cut - a.shape[0])])
        ids, pos, loc = fit(ids), fit(pos), fit(loc)
        exp_tok = exp_pos = None
        if rng.random() < 0.3:
            exp_tok = np.where(rng.random(cut) < 0.1, -1, ids)
            exp_tok = np.where(rng.random(cut) < 0.05, exp_tok + 1, exp_tok)
            if rng.random() < 0.2:
                exp_tok = exp_tok[: max(0, cut - 1)]
        if rng.random() < 0.3:
            exp_pos = np.where(rng.random(cut) < 0.1, -1, pos)
            exp_pos = np.where(rng.random(cut) < 0.05, exp_pos + 1, exp_pos)
        ids, pos, loc = _idx(rng, ids), _idx(rng, pos), _idx(rng, loc)
        exp_tok = _idx(rng, exp_tok) if exp_tok is not None else None
        exp_pos = _idx(rng, exp_pos) if exp_pos is not None else None
        # Corrupt seeds; flip the position check.
        seed_fix = {}
        if rng.random() < 0.15:
            for _ in range(int(rng.integers(1, 3))):
                seed_fix[int(rng.integers(0, max_batch))] = int(rng.choice([-2, -5, c["num_slots"],
                                                                            c["num_slots"] + 7]))
        reverse = rng.random() < 0.1 and bs > 0  # a forged reversed span (last row: no overlap)
        rev_by = int(rng.integers(1, 3))
        pcheck = 0 if rng.random() < 0.2 else 1
        unplanned = rng.random() < 0.05  # as never planned: nothing written, writes_skipped counts it
        w_sources = R["sources"] if rng.random() < 0.8 else ()
        mode = c["mode"] if w_sources else RealKvMode.NONE
        # A caller's bound on the rows' tokens picks a route, right or not: the same bytes.
        bound = None if rng.random() < 0.5 else int(rng.choice([0, 1, 2, 32, 128, 129, 4096]))
        for st in (R, D):
            side = st["side"]
            for k, v in seed_fix.items():
                st["wp"].seed_slots[k:k + 1] = v
            if reverse:
                st["wp"].offsets[bs:bs + 1] = int(wo[bs - 1]) - rev_by
            st["wp"].position_check.fill(pcheck)
            if unplanned:
                st["wp"].num_rows.fill(-1)
            srcs = st["sources"] if w_sources else ()
            d = side.to_dev
            side.run("write", st["canary"], st["wp"], input_ids=d(ids), positions=d(pos), out_cache_loc=d(loc),
                               log=st["log"], tag=tag, sources=srcs if mode != RealKvMode.NONE else (),
                               mode=mode if srcs else RealKvMode.NONE,
                               expected_tokens=d(exp_tok) if exp_tok is not None else None,
                               expected_positions=d(exp_pos) if exp_pos is not None else None,
                               max_row_tokens=bound)
        _eq("write records", dev.to_host(D["canary"].records), ref.to_host(R["canary"].records))
        logs.check("write")

    # verify (maybe sampled, maybe twice)
    if with_vp:
        if rng.random() < 0.2 and cap > 0:
            fixes = []
            for _ in range(int(rng.integers(1, 4))):
                e = int(rng.integers(0, cap))
                f = str(rng.choice(["slot_indices", "prev_slot_indices"]))
                v = int(rng.choice([-1, -3, c["num_slots"], c["num_slots"] + 9, 0]))
                fixes.append((f, e, v))
            for st in (R, D):
                for f, e, v in fixes:
                    getattr(st["vp"], f)[e:e + 1] = v
        use_src = rng.random() < 0.85
        mode = c["mode"] if use_src else RealKvMode.NONE
        check_tokens = bool(rng.random() < 0.6)
        sampled = rng.random() < 0.3
        period = int(rng.integers(1, 5))
        phase0 = int(rng.integers(-3, 10))
        for st in (R, D):
            side = st["side"]
            srcs = st["sources"] if (use_src and mode != RealKvMode.NONE) else ()
            st["sample"] = None
            if sampled and srcs:
                st["sample"] = FingerprintSampler.allocate(period=period, device=side.device)
                st["sample"].state[0:1] = phase0
        for rep in range(2 if sampled else 1):
            for st in (R, D):
                side = st["side"]
                srcs = st["sources"] if (use_src and mode != RealKvMode.NONE) else ()
                side.run("verify", st["canary"], st["vp"], log=st["log"], tag=tag, sources=srcs,
                                    mode=mode if srcs else RealKvMode.NONE, check_tokens=check_tokens,
                                    sample=st["sample"])
            logs.check(f"verify#{rep}")
            if R["sample"] is not None:
                _eq("sampler state", dev.to_host(D["sample"].state), ref.to_host(R["sample"].state))

    # plan_and_verify on the device against plan + verify on the reference, on the same
    # inputs and the records as they now stand (sampled, token check, sources at random).
    if with_vp and c["fused"]:
        use_src = rng.random() < 0.85
        mode = c["mode"] if use_src else RealKvMode.NONE
        check_tokens = bool(rng.random() < 0.6)
        sampled = rng.random() < 0.3
        period, phase0 = int(rng.integers(1, 5)), int(rng.integers(-3, 10))
        for f in VerifyPlan.ENTRY_FIELDS:  # the fused op does not write the entries: keep them poisoned
            getattr(D["vp"], f).fill(POISON)
        D["vp"].first_input_error.fill(POISON)  # it writes this one: an unwritten word shows
        for st in (R, D):
            side = st["side"]
            d = side.to_dev
            srcs = st["sources"] if (use_src and mode != RealKvMode.NONE) else ()
            sample = None
            if sampled and srcs:
                sample = st["fsample"] = FingerprintSampler.allocate(period=period, device=side.device)
                sample.state[0:1] = phase0
            swa = SwaWindow(c["swa"][0], d(lut)) if lut is not None else None
            et = ExpectedTokens(d(exp[0]), d(exp[1]), exp[2]) if exp is not None else None
            plan_in = dict(req_pool_indices=d(rpi), prefix_lens=d(pre), extend_lens=d(ext), table=d(table),
                           page_size=c["page"], swa=swa, expected=et)
            check_in = dict(log=st["log"], tag=tag, sources=srcs, mode=mode if srcs else RealKvMode.NONE,
                            check_tokens=check_tokens, sample=sample)
            if st is R:
                side.run("plan", st["vp"], st["wp"], **plan_in)
                side.run("verify", st["canary"], st["vp"], **check_in)
            else:
                side.run("plan_and_verify", st["vp"], st["wp"], st["canary"], **plan_in, **check_in)
        for f in VerifyPlan.SCALAR_FIELDS + ("offsets", "first_input_error"):
            _eq(f"plan_and_verify vp.{f}", dev.to_host(getattr(D["vp"], f)), ref.to_host(getattr(R["vp"], f)))
        dev.check_fused_entries("plan_and_verify", ref, D["vp"], R["vp"])
        compare_plans("plan_and_verify", ref, dev, None, None, R["wp"], D["wp"])
        logs.check("plan_and_verify")
        if sampled and "fsample" in R:
            _eq("plan_and_verify sampler", dev.to_host(D["fsample"].state), ref.to_host(R["fsample"].state))


    # plan_verify_write on the device against plan, verify and write on the reference: the
    # whole step in one launch (no real-KV folds), for steps of at most STEP_WRITE_TOKENS tokens.
    if with_vp and with_wp and c["stamp"]:
        stamp_step(c, rng, ref, dev, R, D, logs, tag, rpi, pre, ext, table, lut, exp)


STAMPED = [0]  # cases that ran plan_verify_write (their steps fit its token bound)


def stamp_step(c, rng, ref: Side, dev: Side, R, D, logs, tag, rpi, pre, ext, table, lut, exp) -> None:
    check_tokens = bool(rng.random() < 0.6)
    write_tag = int(rng.integers(-3, 10))

    def plan_in(side):
        d = side.to_dev
        swa = SwaWindow(c["swa"][0], d(lut)) if lut is not None else None
        et = ExpectedTokens(d(exp[0]), d(exp[1]), exp[2]) if exp is not None else None
        return dict(req_pool_indices=d(rpi), prefix_lens=d(pre), extend_lens=d(ext), table=d(table),
                    page_size=c["page"], swa=swa, expected=et)

    # The reference plans first: its write rows say what token inputs the step has.
    ref.run("plan", R["vp"], R["wp"], **plan_in(ref))
    wo, seeds = ref.to_host(R["wp"].offsets), ref.to_host(R["wp"].seed_slots)
    ids, pos, loc = write_inputs(c, rng, wo, seeds, c["bs"])
    cut = ids.shape[0]
    if rng.random() < 0.15 and cut > 0:
        cut = int(rng.integers(0, cut))  # inputs shorter than the plan: INPUT_OUT_OF_RANGE rows
    if cut > ops.STEP_WRITE_TOKENS:
        # Beyond the fused op's bound: the reference's plan stands alone, the device plans alike.
        dev.run("plan", D["vp"], D["wp"], **plan_in(dev))
        logs.check("plan (a step too long to stamp)")
        return
    STAMPED[0] += 1
    ids, pos, loc = (_idx(rng, a[:cut]) for a in (ids, pos, loc))
    exp_tok = _idx(rng, np.where(rng.random(cut) < 0.05, np.asarray(ids) + 1, -1)) if rng.random() < 0.3 else None
    exp_pos = _idx(rng, np.where(rng.random(cut) < 0.05, np.asarray(pos) + 1, -1)) if rng.random() < 0.3 else None
    for f in VerifyPlan.ENTRY_FIELDS:
        getattr(D["vp"], f).fill(POISON)
    D["vp"].first_input_error.fill(POISON)  # written by every plan: an unwritten word shows
    for st in (R, D):
        side = st["side"]
        d = side.to_dev
        tokens = dict(input_ids=d(ids), positions=d(pos), out_cache_loc=d(loc),
                      expected_tokens=d(exp_tok) if exp_tok is not None else None,
                      expected_positions=d(exp_pos) if exp_pos is not None else None)
        if st is R:
            side.run("verify", st["canary"], st["vp"], log=st["log"], tag=tag, sources=(), mode=RealKvMode.NONE,
                     check_tokens=check_tokens, sample=None)
            side.run("write", st["canary"], st["wp"], log=st["log"], tag=write_tag, sources=(),
                     mode=RealKvMode.NONE, **tokens)
        else:
            side.run("plan_verify_write", st["vp"], st["wp"], st["canary"], **plan_in(side), log=st["log"], tag=tag,
                     write_tag=write_tag, check_tokens=check_tokens, **tokens)
    for f in VerifyPlan.SCALAR_FIELDS + ("offsets", "first_input_error"):
        _eq(f"plan_verify_write vp.{f}", dev.to_host(getattr(D["vp"], f)), ref.to_host(getattr(R["vp"], f)))
    dev.check_fused_entries("plan_verify_write", ref, D["vp"], R["vp"])
    compare_plans("plan_verify_write", ref, dev, None, None, R["wp"], D["wp"])
    _eq("plan_verify_write records", dev.to_host(D["canary"].records), ref.to_host(R["canary"].records))
    logs.check("plan_verify_write")


def run_fuzz(ref: Side, dev: Side, cases: int, seed: int, scale: float = 1.0, report=print) -> list:
    failures = []
    STAMPED[0] = 0
    for i in range(cases):
        try:
            run_case([seed, i], ref, dev, scale)
        except AssertionError as e:
            failures.append(f"case {i} (seed [{seed}, {i}]): {e}")
            if len(failures) >= 5:
                break
    report(f"kvcanary parity fuzz: {cases} cases, seed {seed}, {len(failures)} failing "
           f"({STAMPED[0]} stamped by plan_verify_write)")
    return failures


def test_parity_fuzz(capsys):
    failures = run_fuzz(cpu_side(), cuda_side(), CASES, SEED)
    with capsys.disabled():
        print(f"\nkvcanary parity fuzz: {CASES} cases (KVCANARY_FUZZ_CASES), seed {SEED}")
    assert not failures, "\n".join(failures)
