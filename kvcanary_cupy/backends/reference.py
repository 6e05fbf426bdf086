"""The NumPy reference backend: the oracle the CUDA kernels are checked against.

Vectorized over batch rows and plan entries. The write chain of a ``"scan"``
canary is a segmented parallel prefix scan of affine maps (log2 of the longest
row vectorized steps), as the kernel computes it; the ``"sglang"`` chain is
serial within a row by definition and loops over token index (all rows at once).
The plan, like the kernel, first decides each row's validity and counts and
builds entries only if they fit the capacity, both in chunks of table positions,
so its memory does not grow with what a batch asks for.
Every index that comes from data is range-checked before it is used, so bad data
becomes a counted input error or a SLOT_OUT_OF_RANGE violation, never an
IndexError or a wrong read.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import format as fmt
from ..format import FailReason, RealKvMode

_I64 = np.int64
_U64 = np.uint64
_FP_BLOCK = 1 << 16  # entries fingerprinted per block, to bound temporary memory
_FP_WORDS = 1 << 22  # K/V words gathered at once (a block's entries, as many layers as fit)
_PLAN_CHUNK = 1 << 18  # table positions a plan reads per chunk, to bound temporary memory
_I64_MAX = np.int64(np.iinfo(np.int64).max)


# --- helpers -----------------------------------------------------------------
def _u(a):
    return np.asarray(a, dtype=_I64).view(_U64)


def _link_of(canary, slots: np.ndarray) -> np.ndarray:
    """next_link(record(slot)) for in-range slots (uint64), in the canary's chain kind."""
    return fmt.next_link(canary.records[slots], chain=canary.chain)


def _first_link(canary):
    return _U64(fmt.first_link(canary.chain))


def _append(log, rows: list[np.ndarray]) -> None:
    """Append violation rows to the ring; rows past its capacity are dropped and counted."""
    if not rows:
        return
    block = np.concatenate([np.atleast_2d(r) for r in rows], axis=0).astype(_I64, copy=False)
    if block.shape[0] == 0:
        return
    head = int(log.head[0])
    cap = log.ring.shape[0]
    keep = max(0, min(block.shape[0], cap - head))
    if keep:
        log.ring[head:head + keep] = block[:keep]
    log.head[0] = head + block.shape[0]


def _rows(n, **cols) -> np.ndarray:
    """``n`` violation rows from per-column arrays or scalars; the detail columns a row does
    not use take their ``format.UNUSED_DETAIL`` values."""
    out = np.empty((n, fmt.VIOLATION_WORDS), dtype=_I64)
    for i, name in enumerate(fmt.VIOLATION_COLUMNS):
        out[:, i] = cols[name] if name in cols else fmt.UNUSED_DETAIL[name]
    return out


def fingerprints(sources, mode, slots) -> np.ndarray:
    """Real-KV fingerprints (uint64 ``[n]``) of in-range ``slots`` for ``sources``."""
    slots = np.asarray(slots, dtype=_I64)
    r = np.zeros(slots.shape[0], dtype=_U64)
    if mode == RealKvMode.NONE or not sources:
        return r
    for lo in range(0, slots.shape[0], _FP_BLOCK):
        s = slots[lo:lo + _FP_BLOCK]
        acc = np.zeros(s.shape[0], dtype=_U64)
        for src in sources:
            k = (fmt.KV_CHUNK_BYTES if mode == RealKvMode.PARTIAL else src.read_bytes) // 8
            words = src.data.view(_U64).reshape(src.num_layers, -1, src.bytes_per_token // 8)
            step = max(1, _FP_WORDS // (s.shape[0] * k))
            for l0 in range(0, src.num_layers, step):  # layers folded together, combined in order
                block = words[l0:l0 + step]
                # A slot hashed whole is one take along the slots (NumPy's index between two
                # slices is several times slower); its first k words keep that index, since a
                # take of the strided view would copy the whole source first.
                got = np.take(block, s, axis=1) if k == block.shape[2] else block[:, s, :k]
                for fold in fmt.fold_chunks(got):
                    acc = fmt.splitmix64(acc ^ fold)
        r[lo:lo + _FP_BLOCK] = acc
    return r


# --- plan --------------------------------------------------------------------
def _translate(vals: np.ndarray, lut) -> tuple[np.ndarray, np.ndarray]:
    """Apply the SWA LUT; returns (slots, bad) with bad marking unreadable lookups."""
    bad = vals < 0
    if lut is None:
        return vals, bad
    inside = (vals >= 0) & (vals < lut.shape[0])
    out = np.full(vals.shape, -1, dtype=_I64)
    out[inside] = lut[vals[inside]]
    return out, bad | ~inside | (out < 0)


def _slots_at(table, page_size, rows, pos, lut):
    """T(table(rp, pos)) for arrays rows/pos already known to be inside the table."""
    if page_size == 1:
        return _translate(table[rows, pos].astype(_I64), lut)
    vals = table[rows, pos // page_size].astype(_I64)
    off = pos % page_size
    # v * page + off must fit int64: a wrapped slot could land on a valid one.
    fits = (vals >= 0) & (vals <= (_I64_MAX - off) // page_size)
    return _translate(np.where(fits, np.where(fits, vals, 0) * page_size + off, -1), lut)


def _spans(lengths: np.ndarray):
    """The items of per-row spans of ``lengths[r]`` items, laid back to back, in
    chunks of at most ``_PLAN_CHUNK``: yields ``(lo, row, j)``, the chunk's first
    item and, per item, its row and its index within the row. A long row spans
    several chunks, so no chunk's arrays grow with the batch or a row."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1]) if ends.shape[0] else 0
    for lo in range(0, total, _PLAN_CHUNK):
        hi = min(lo + _PLAN_CHUNK, total)
        rows = np.arange(np.searchsorted(ends, lo, side="right"), np.searchsorted(ends, hi - 1, side="right") + 1)
        n = np.minimum(ends[rows], hi) - np.maximum(starts[rows], lo)
        yield lo, np.repeat(rows, n), np.arange(lo, hi, dtype=_I64) - np.repeat(starts[rows], n)


def plan(vp, wp, *, req_pool_indices, prefix_lens, extend_lens, table, page_size, swa, expected):
    bs = req_pool_indices.shape[0]
    rp = req_pool_indices.astype(_I64)
    P = prefix_lens[:bs].astype(_I64)
    E = extend_lens[:bs].astype(_I64)
    nreq, twidth = table.shape
    width = min(twidth * page_size, int(_I64_MAX))  # saturated: the product may not fit int64
    lut = swa.lut if swa is not None else None

    active = rp != fmt.PADDING_REQ
    ok = active & (rp > 0) & (rp < nreq) & (P >= 0) & (E >= 0) & (P <= width) & (E <= width - np.maximum(P, 0))
    if expected is not None:
        ok &= rp < expected.table.shape[0]
    start = np.maximum(P - swa.size, 0) if swa is not None else np.zeros_like(P)

    # Phase 1, like the kernel's rows phase: a row is valid iff every slot it reads is
    # readable, positions [max(start - 1, 0), P) (window, the head's predecessor and
    # the seed at P - 1). Only counts come out, so memory stays bounded by the chunk
    # whatever the batch asks for.
    lo = np.where(ok, np.maximum(start - 1, 0), 0)
    inputs_ok = ok.copy()
    first_bad = np.full(bs, _I64_MAX, dtype=_I64)  # a row's first unreadable position
    for _, row, j in _spans(np.where(ok, P - lo, 0)):
        _, bad = _slots_at(table, page_size, rp[row], lo[row] + j, lut)
        np.minimum.at(first_bad, row[bad], (lo[row] + j)[bad])
    ok &= first_bad == _I64_MAX
    errors = int(np.count_nonzero(active & ~ok))
    count = np.where(ok, P - start, 0)
    # The step's tokens are the engine's layout: every row keeps its span of E tokens whether
    # or not it stamps them. After a row whose own length is out of range the layout is
    # unknown: no later row stamps from a guess.
    known = (E >= 0) & (E <= width)
    W = np.where(known, E, 0)
    after_unknown = (np.cumsum(~known) - ~known) > 0
    stamps = ok & ~after_unknown
    unstamped = int(np.count_nonzero(active & ~stamps))
    seed = np.full(bs, fmt.SEED_SKIP, dtype=_I64)
    seed[stamps] = -1
    idx = np.nonzero(stamps & (P > 0) & (E > 0))[0]
    seed[idx] = _slots_at(table, page_size, rp[idx], P[idx] - 1, lut)[0]

    if vp is not None:
        total = int(count.sum())
        cap = vp.capacity
        offs = np.concatenate(([0], np.cumsum(count)))
        vp.offsets[: bs + 1] = offs
        vp.offsets[bs + 1:] = total
        vp.requested[0] = total
        vp.num_valid[0] = min(total, cap)
        vp.enable[0] = 1 if total <= cap else 0
        vp.input_errors[0] += errors
        vp.overflows[0] += 1 if total > cap else 0
        vp.max_requested[0] = max(int(vp.max_requested[0]), total)
        vp.first_input_error[:] = -1
        dropped = np.nonzero(active & ~ok)[0]
        if dropped.shape[0]:  # the first row dropped: its inputs, and the table entry at fault
            r = int(dropped[0])
            pos = int(first_bad[r]) if inputs_ok[r] else -1
            value = int(table[rp[r], pos // page_size]) if pos >= 0 else -1
            vp.first_input_error[:] = [r, rp[r], P[r], E[r], pos, value]
        if total <= cap:
            # Phase 2: the entries, only now that they are known to fit.
            lim = None
            if expected is not None:
                lim = np.minimum(expected.valid_lens[:bs].astype(_I64), expected.table.shape[1])
            for e0, row, j in _spans(count):
                e1 = e0 + row.shape[0]
                rrow, pos = rp[row], start[row] + j
                vp.slot_indices[e0:e1] = _slots_at(table, page_size, rrow, pos, lut)[0]
                prev = np.full(pos.shape, -1, dtype=_I64)
                has_prev = pos > 0
                prev[has_prev] = _slots_at(table, page_size, rrow[has_prev], pos[has_prev] - 1, lut)[0]
                vp.prev_slot_indices[e0:e1] = prev
                vp.expected_positions[e0:e1] = pos
                tok = np.full(pos.shape, -1, dtype=_I64)
                if expected is not None:
                    k = pos + expected.offset
                    m = (k >= 0) & (k < lim[row])
                    tok[m] = expected.table[rrow[m], k[m]]
                vp.expected_tokens[e0:e1] = tok
    if wp is not None:
        offs = np.concatenate(([0], np.cumsum(W)))
        wp.offsets[: bs + 1] = offs
        wp.offsets[bs + 1:] = offs[-1]
        wp.seed_slots[:bs] = seed
        wp.seed_slots[bs:] = -1
        wp.num_rows[0] = bs
        wp.input_errors[0] += unstamped


# --- write -------------------------------------------------------------------
def _serial_links(running, row_l, j_of, stored, toks, poss) -> np.ndarray:
    """The link each stored token stores, ``"sglang"`` chain: running = mix3(running, token,
    position) after each stored token, iterating over j for all rows at once. ``running``
    (per live row, uint64) starts at each row's first link and is consumed."""
    out = np.zeros(row_l.shape[0], dtype=_U64)
    lens = np.bincount(row_l, minlength=running.shape[0])
    start = np.cumsum(lens) - lens
    for j in range(int(lens.max()) if lens.shape[0] else 0):
        rows_j = np.nonzero(lens > j)[0]
        t = start[rows_j] + j
        go = stored[t]
        rows_j, t = rows_j[go], t[go]
        out[t] = running[rows_j]
        running[rows_j] = fmt.mix3(running[rows_j], _u(toks[t]), _u(poss[t]))
    return out


def _scan_links(running, row_l, j_of, stored, toks, poss) -> np.ndarray:
    """The link each stored token stores, ``"scan"`` chain: each stored token is the map
    ``x -> SCAN_MUL x + scan_term`` (a skipped one the identity); a Hillis-Steele scan
    composes them within each row, and a token stores its row's first link put through
    the maps of the tokens before it."""
    n = row_l.shape[0]
    a = np.where(stored, _U64(fmt.SCAN_MUL), _U64(1))
    b = np.where(stored, fmt.scan_term(toks, poss), _U64(0))
    d = 1
    while d < (int(j_of.max()) + 1 if n else 0):
        k = np.nonzero(j_of >= d)[0]  # token k takes in token k - d of the same row
        na = fmt.mulmod61(a[k], a[k - d])
        nb = fmt.reduce61(fmt.mulmod61(a[k], b[k - d]) + b[k])
        a[k], b[k] = na, nb
        d *= 2
    x0 = running[row_l]
    first = j_of == 0
    prev = np.maximum(np.arange(n) - 1, 0)
    ea = np.where(first, _U64(1), a[prev])  # the maps of the tokens before, composed
    eb = np.where(first, _U64(0), b[prev])
    return fmt.reduce61(fmt.mulmod61(ea, x0) + eb)


def write(canary, wp, *, input_ids, positions, out_cache_loc, log, tag, sources, mode,
          expected_tokens, expected_positions):
    rec = canary.records
    N = rec.shape[0]
    planned_rows = int(wp.num_rows[0])
    # A forged row count never reads past the plan's arrays.
    nrows = max(0, min(planned_rows, wp.seed_slots.shape[0]))
    offs = wp.offsets[: nrows + 1].astype(_I64)
    seeds = wp.seed_slots[:nrows].astype(_I64)
    log.counter_array[fmt.CTR_KERNEL_RUNS] += 1
    if planned_rows < 0:  # never planned: nothing to write, but it must show
        log.counter_array[fmt.CTR_WRITES_SKIPPED] += 1
    if nrows == 0:
        return
    o0, o1 = offs[:-1], offs[1:]
    avail = min([a.shape[0] for a in (input_ids, positions, out_cache_loc, expected_tokens, expected_positions)
                 if a is not None])
    out = []

    # A row the plan skipped stamps nothing (the plan counted it), whatever its span.
    skip = seeds == fmt.SEED_SKIP
    # A reversed span can only come from a forged plan: report it rather than drop the row.
    span_bad = ~skip & ((o0 < 0) | (o1 > avail) | (o1 < o0))
    seed_bad = ~skip & ~span_bad & ((seeds < -1) | (seeds >= N))
    if span_bad.any():
        r = np.nonzero(span_bad)[0]
        out.append(_rows(r.shape[0], tag=tag, slot=-1, position=-1, stored_token=-1, expected_token=-1,
                         stored_link=0, expected_link=0, fail_bits=int(FailReason.INPUT_OUT_OF_RANGE),
                         batch_row=r, expected_position=-1, span_start=o0[r], span_end=o1[r], tokens_given=avail))
    if seed_bad.any():
        r = np.nonzero(seed_bad)[0]
        out.append(_rows(r.shape[0], tag=tag, slot=seeds[r], position=-1, stored_token=-1, expected_token=-1,
                         stored_link=0, expected_link=0, fail_bits=int(FailReason.SLOT_OUT_OF_RANGE),
                         batch_row=r, expected_position=-1, span_start=o0[r], span_end=o1[r], tokens_given=avail))
    live = np.nonzero(~skip & ~span_bad & ~seed_bad & (o1 > o0))[0]
    if live.shape[0] == 0:
        _append(log, out)
        return

    # Chain state per live row, seeded from the seed record.
    sd = seeds[live]
    has_seed = sd >= 0
    running = np.full(live.shape[0], _first_link(canary), dtype=_U64)
    prev_pos = np.zeros(live.shape[0], dtype=_I64)
    if has_seed.any():
        running[has_seed] = _link_of(canary, sd[has_seed])
        prev_pos[has_seed] = rec[sd[has_seed], fmt.FIELD_POSITION]

    # Every token of every live row, rows back to back; token (row, j) is start[row] + j.
    lens = (o1 - o0)[live]
    row_l = np.repeat(np.arange(live.shape[0]), lens)
    start = np.cumsum(lens) - lens
    j_of = np.arange(row_l.shape[0]) - np.repeat(start, lens)
    tok_idx = o0[live][row_l] + j_of
    loc = out_cache_loc[tok_idx].astype(_I64)
    log.counter_array[fmt.CTR_TOKENS_SKIPPED] += int(np.count_nonzero(loc < 0))
    toks = input_ids[tok_idx].astype(_I64)
    poss = positions[tok_idx].astype(_I64)
    stored = loc >= 0  # a negative slot is skipped: no store, the chain does not advance
    chain_fn = _scan_links if canary.chain == fmt.CHAIN_SCAN else _serial_links
    stored_link = chain_fn(running, row_l, j_of, stored, toks, poss)

    # The previous stored token's position in the row (the seed's before the first).
    idx = np.where(stored, np.arange(row_l.shape[0]), -1)
    last = np.maximum.accumulate(idx) if idx.shape[0] else idx
    before = np.concatenate(([-1], last[:-1])) if last.shape[0] else last
    in_row = before >= start[row_l]
    has_prev = in_row | has_seed[row_l]
    prev_p = np.where(in_row, poss[np.maximum(before, 0)], prev_pos[row_l])
    exp_pos_col = np.full(row_l.shape[0], -1, dtype=_I64)
    pos_bad = np.zeros(row_l.shape[0], dtype=bool)
    if bool(wp.position_check[0]):
        chk = stored & has_prev
        with np.errstate(over="ignore"):  # wraps as the kernel's does; the largest position has no successor
            succ = prev_p + 1
        exp_pos_col[chk] = succ[chk]
        pos_bad = chk & ((poss != succ) | (prev_p == _I64_MAX))

    bits = np.zeros(row_l.shape[0], dtype=_I64)
    bits[pos_bad] |= int(FailReason.WRITE_POSITION)
    exp_tok_col = np.full(row_l.shape[0], -1, dtype=_I64)
    if expected_tokens is not None:
        et = expected_tokens[tok_idx].astype(_I64)
        exp_tok_col = et
        bits[stored & (et != -1) & (et != toks)] |= int(FailReason.WRITE_TOKEN)
    if expected_positions is not None:
        ep = expected_positions[tok_idx].astype(_I64)
        has = ep != -1
        exp_pos_col = np.where(has, ep, exp_pos_col)
        bits[stored & has & (ep != poss)] |= int(FailReason.WRITE_POSITION)
    oor = stored & (loc >= N)
    bits[oor] |= int(FailReason.SLOT_OUT_OF_RANGE)
    store = stored & ~oor
    sl = loc[store]
    if sl.shape[0]:
        rec[sl, fmt.FIELD_TOKEN] = toks[store]
        rec[sl, fmt.FIELD_POSITION] = poss[store]
        rec[sl, fmt.FIELD_LINK] = stored_link[store].view(_I64)
        rec[sl, fmt.FIELD_FINGERPRINT] = fingerprints(sources, mode, sl).view(_I64)
    log.counter_array[fmt.CTR_SLOTS_WRITTEN] += int(sl.shape[0])

    v = np.nonzero(bits)[0]
    if v.shape[0]:
        link = stored_link[v].view(_I64)
        row = live[row_l[v]]
        out.append(_rows(v.shape[0], tag=tag, slot=loc[v], position=poss[v], stored_token=toks[v],
                         expected_token=exp_tok_col[v], stored_link=link, expected_link=link,
                         fail_bits=bits[v], batch_row=row, expected_position=exp_pos_col[v],
                         prev_position=np.where(has_prev[v], prev_p[v], -1), token_index=tok_idx[v],
                         span_start=o0[row], span_end=o1[row], tokens_given=avail))
    _append(log, out)


# --- verify ------------------------------------------------------------------
def verify(canary, vp, *, log, tag, sources, mode, check_tokens, sample):
    rec = canary.records
    N = rec.shape[0]
    log.counter_array[fmt.CTR_KERNEL_RUNS] += 1
    phase = None
    if sample is not None:
        phase = int(sample.state[0]) % sample.period
        sample.state[0] += 1
    enabled = int(vp.enable[0]) == 1
    if not enabled:  # overflowed or never planned: nothing is checked, but it must show
        log.counter_array[fmt.CTR_VERIFIES_SKIPPED] += 1
    n = int(vp.num_valid[0]) if enabled else 0
    n = max(0, min(n, vp.capacity))
    if n == 0:
        return
    slot = vp.slot_indices[:n].astype(_I64)
    prev = vp.prev_slot_indices[:n].astype(_I64)
    epos = vp.expected_positions[:n].astype(_I64)
    etok = vp.expected_tokens[:n].astype(_I64)
    # Every entry is a live row's read: one at the reserved slot is reported, never read.
    log.counter_array[fmt.CTR_SLOTS_CHECKED] += n
    reserved = slot == fmt.RESERVED_SLOT
    oor = ~reserved & ((slot < 0) | (slot >= N) | (prev < -1) | (prev >= N))
    chk = np.nonzero(~reserved & ~oor)[0]
    s = slot[chk]
    r = rec[s]
    p = prev[chk]
    exp_link = np.full(chk.shape[0], _first_link(canary), dtype=_U64)
    linked = p > 0
    exp_link[linked] = _link_of(canary, p[linked])
    stored_link = _u(r[:, fmt.FIELD_LINK])
    exp_link[p == 0] = stored_link[p == 0]  # padding predecessor: chain not checked
    bits = np.zeros(chk.shape[0], dtype=_I64)
    bits[stored_link != exp_link] |= int(FailReason.CHAIN)
    bits[r[:, fmt.FIELD_POSITION] != epos[chk]] |= int(FailReason.POSITION)
    if check_tokens:
        et = etok[chk]
        bits[(et != -1) & (r[:, fmt.FIELD_TOKEN] != et)] |= int(FailReason.TOKEN)
    fp_sel = np.ones(chk.shape[0], dtype=bool) if phase is None else (s % sample.period) == phase
    stored_fp = r[:, fmt.FIELD_FINGERPRINT]
    live_fp = stored_fp.copy()  # a row's expected fingerprint: the stored one where none was computed
    if fp_sel.any():
        fp = fingerprints(sources, mode, s[fp_sel])
        live_fp[fp_sel] = fp.view(_I64)
        bits[live_fp != stored_fp] |= int(FailReason.REAL_KV)

    def prev_positions(e):  # what the predecessor records of entries e hold (-1: none read)
        p_e = prev[e]
        inside = (p_e > 0) & (p_e < N)
        return np.where(inside, rec[np.where(inside, p_e, 0), fmt.FIELD_POSITION], -1)

    out = []
    e_oor = np.nonzero(oor | reserved)[0]  # entries whose record is not read
    if e_oor.shape[0]:
        out.append(_rows(e_oor.shape[0], tag=tag, slot=slot[e_oor], position=-1, stored_token=-1,
                         expected_token=etok[e_oor], stored_link=0, expected_link=0,
                         fail_bits=np.where(reserved[e_oor], int(FailReason.RESERVED_SLOT),
                                            int(FailReason.SLOT_OUT_OF_RANGE)),
                         batch_row=_batch_rows(vp, e_oor), expected_position=epos[e_oor],
                         prev_slot=prev[e_oor], prev_position=prev_positions(e_oor)))
    v = np.nonzero(bits)[0]
    if v.shape[0]:
        e = chk[v]
        out.append(_rows(v.shape[0], tag=tag, slot=s[v], position=r[v, fmt.FIELD_POSITION],
                         stored_token=r[v, fmt.FIELD_TOKEN], expected_token=etok[e],
                         stored_link=stored_link[v].view(_I64), expected_link=exp_link[v].view(_I64),
                         fail_bits=bits[v], batch_row=_batch_rows(vp, e), expected_position=epos[e],
                         prev_slot=prev[e], prev_position=prev_positions(e), stored_fingerprint=stored_fp[v],
                         expected_fingerprint=live_fp[v]))
    if len(out) == 2:  # keep entry order, as a reader of the CPU log would expect
        both = np.concatenate(out)
        order = np.argsort(np.concatenate([e_oor, chk[v]]), kind="stable")
        out = [both[order]]
    _append(log, out)


def _batch_rows(vp, entries: np.ndarray) -> np.ndarray:
    """The batch row of each entry, from the plan's offsets (only on violations)."""
    return np.searchsorted(vp.offsets.astype(_I64), entries, side="right") - 1


# --- scatter_expected_tokens -------------------------------------------------
def scatter_expected_tokens(table, *, tokens, offsets, req_pool_indices, input_errors=None):
    nreq, width = table.shape
    bs = req_pool_indices.shape[0]
    rp = req_pool_indices.astype(_I64)
    lo = offsets[:bs].astype(_I64)
    hi = offsets[1:bs + 1].astype(_I64)
    live = (rp != fmt.PADDING_REQ) & (hi != lo)
    ok = live & (rp > 0) & (rp < nreq) & (lo >= 0) & (hi <= tokens.shape[0]) & (hi > lo)
    if input_errors is not None:
        input_errors[0] += int(np.count_nonzero(live & ~ok))
    n = np.where(ok, np.minimum(hi - lo, width), 0)
    row = np.repeat(np.arange(bs), n)
    col = np.arange(row.shape[0], dtype=_I64) - np.repeat(np.cumsum(n) - n, n)
    table[rp[row], col] = tokens[lo[row] + col]


# --- tensor-parallel agreement ------------------------------------------------
_M64 = (1 << 64) - 1
_DIGEST_CHUNK = 1 << 18  # elements hashed per chunk, to bound temporary memory


def _wrap_i64(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def digest(rows, *, out, carry):
    """The wrapping sum of ``mix3(salt, i, value)`` over every counted element of every row,
    plus ``mix3(salt, -1, count)`` per row, into ``out[0]``; ``carry`` copied after it."""
    total = 0
    for data, count, gate, salt in rows:
        n = int(data.shape[0])
        if count is not None:
            c = int(count[0])
            n = 0 if c < 0 else min(c, n)
        if gate is not None and int(gate[0]) != 1:
            n = 0
        s = salt & _M64
        total += int(fmt.mix3(s, -1, n))
        for lo in range(0, n, _DIGEST_CHUNK):
            hi = min(n, lo + _DIGEST_CHUNK)
            idx = np.arange(lo, hi, dtype=_I64).view(_U64)
            total += int(fmt.mix3(s, idx, data[lo:hi].astype(_I64).view(_U64)).sum(dtype=_U64))
    out[0] = _wrap_i64(total)
    if carry is not None:
        out[1:1 + carry.shape[0]] = carry


def _run_digest(d) -> None:
    """:func:`digest` of a :class:`~kvcanary_cupy.digest.Digest`'s validated rows."""
    digest(d.rows, out=d.out, carry=d.carry)


def compare_digests(gathered, *, rank, state, log, tag):
    """Name every rank whose digest (column 0) differs from the majority's in a RANK_DIVERGENCE
    row; keep the group's tally from the gathered log heads (column 1). See digest.cu."""
    world = int(gathered.shape[0])
    d = gathered[:, 0].astype(_I64)
    holders = (d[:, None] == d[None, :]).sum(axis=1)
    ref = int(np.argmax(holders))  # the first maximum: the lowest rank on a tie, like the kernel
    agreeing = int(holders[ref])
    div_prev = int(state[1])
    step = int(state[2]) + 1
    bad = np.nonzero(d != d[ref])[0]
    _append(log, [_rows(bad.shape[0], tag=tag, slot=-1, position=step, stored_token=bad, expected_token=ref,
                        stored_link=d[bad], expected_link=d[ref], fail_bits=int(FailReason.RANK_DIVERGENCE),
                        batch_row=-1, expected_position=agreeing)])
    heads = sum(int(h) for h in gathered[:, 1])
    state[0] = _wrap_i64(heads - world * div_prev)
    state[4] = _wrap_i64(int(gathered[rank, 1]) - div_prev)
    state[1] = div_prev + world - agreeing
    state[2] = step
    state[3] = int(log.head[0])


# --- the Backend interface: a prepared launch is the call, bound --------------------
def prepare_plan(vp, wp, *, stream=None, **inputs):
    """:func:`plan` bound to its arguments (nothing to pack on the CPU)."""
    return lambda _stream: plan(vp, wp, **inputs)


def bound(op):
    """A binder of ``op``: called with ``op``'s arguments, it returns ``op`` bound to them (a
    callable of no argument)."""
    return lambda *args, **kwargs: functools.partial(op, *args, **kwargs)


def fused_preparers(bind_plan, bind_verify, bind_write):
    """``(prepare_plan_and_verify, prepare_plan_verify_write)`` of a CPU backend whose binders
    (see :func:`bound`) take the arguments of this module's ``plan``, ``verify`` and ``write``:
    the fused ops as those ops in turn (a CPU backend writes the entries too)."""
    def prepare_plan_and_verify(vp, wp, canary, *, stream=None, log, tag, sources, mode, check_tokens, sample,
                                digest=None, **plan_inputs):
        """plan then verify, bound; with ``digest``, then :func:`entry_digest` into it."""
        plan = bind_plan(vp, wp, **plan_inputs)
        verify = bind_verify(canary, vp, log=log, tag=tag, sources=sources, mode=mode, check_tokens=check_tokens,
                             sample=sample)

        def run(_stream):
            plan()
            verify()
            if digest is not None:
                entry_digest(vp, out=digest)
        return run

    def prepare_plan_verify_write(vp, wp, canary, *, stream=None, log, tag, write_tag, check_tokens, input_ids,
                                  positions, out_cache_loc, expected_tokens, expected_positions, **plan_inputs):
        """plan, verify, then write (no real-KV folds), bound."""
        plan = bind_plan(vp, wp, **plan_inputs)
        verify = bind_verify(canary, vp, log=log, tag=tag, sources=(), mode=RealKvMode.NONE,
                             check_tokens=check_tokens, sample=None)
        write = bind_write(canary, wp, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                           log=log, tag=write_tag, sources=(), mode=RealKvMode.NONE,
                           expected_tokens=expected_tokens, expected_positions=expected_positions)

        def run(_stream):
            plan()
            verify()
            write()
        return run

    return prepare_plan_and_verify, prepare_plan_verify_write


prepare_plan_and_verify, prepare_plan_verify_write = fused_preparers(bound(plan), bound(verify), bound(write))


def entry_digest(vp, *, out):
    """The digest of ``vp``'s verify entries into ``out[0]``: :func:`digest` over its four entry
    arrays with ``format.ENTRY_DIGEST_SALTS``, ``num_valid`` their count and ``enable`` their gate."""
    arrays = (vp.slot_indices, vp.prev_slot_indices, vp.expected_positions, vp.expected_tokens)
    digest([(a, vp.num_valid, vp.enable, salt) for a, salt in zip(arrays, fmt.ENTRY_DIGEST_SALTS)], out=out,
           carry=None)


def prepare_write(canary, wp, *, stream=None, digest=None, max_row_tokens=None, **inputs):
    """:func:`write` bound to its arguments; with ``digest``, then :func:`digest` of its rows.
    ``max_row_tokens`` picks a CUDA route; the reference has one."""
    if digest is None:
        return lambda _stream: write(canary, wp, **inputs)

    job = digest

    def run(_stream):
        write(canary, wp, **inputs)
        _run_digest(job)
    return run


def prepare_verify(canary, vp, *, stream=None, **inputs):
    """:func:`verify` bound to its arguments."""
    return lambda _stream: verify(canary, vp, **inputs)


def prepare_scatter(table, *, stream=None, **inputs):
    """:func:`scatter_expected_tokens` bound to its arguments."""
    return lambda _stream: scatter_expected_tokens(table, **inputs)


def prepare_digest(rows, *, out, carry, stream=None):
    """:func:`digest` bound to its arguments."""
    return lambda _stream: digest(rows, out=out, carry=carry)


def prepare_agree(gathered, *, rank, state, log, tag, stream=None):
    """:func:`compare_digests` bound to its arguments."""
    return lambda _stream: compare_digests(gathered, rank=rank, state=state, log=log, tag=tag)
