"""The compiled CPU backend: plan, verify and write as numba-compiled loops.

The NumPy reference pays for its vectorization in calls: a decode step of a few rows costs
a few hundred NumPy calls whatever its size, some hundreds of microseconds. This backend
computes the same bytes as the reference (it is checked against it, byte for byte, by
``tests/test_numba_backend.py``) one entry and one token at a time, as a CUDA thread
would, in a handful of compiled calls. It needs numba (the ``numba`` extra; vLLM's CPU
build brings it) and is picked with :func:`kvcanary_cupy.use_cpu_backend`.

What the ops do is the reference's, rule for rule (see :mod:`.reference`): the same
validity checks on every index that comes from data, the same counters, the same
violation rows in the same order. Violation rows are rare: the compiled loops collect
them, and the reference's own ring append stores them. The scatter of expected tokens
and the tensor-parallel digests are not on a step's hot path and run on the reference.

Beside the ops, the CPU side of an engine integration compiled on this backend: the
gather of a CPU attention layout's K/V bytes (:mod:`kvcanary_cupy.integrations.engine.kv_layout`)
and the staging of a block-table step's rows and tokens into the monitor's buffers
(:mod:`kvcanary_cupy.integrations.engine.block_table`), each one call a step where NumPy
would make a dozen small ones.
"""
from __future__ import annotations

import weakref

import numpy as np
from numba import njit

from .. import format as fmt
from ..format import FailReason, RealKvMode
from . import reference

_I64_MAX = np.iinfo(np.int64).max
_U = np.uint64

_MUL1 = _U(fmt.SPLITMIX_MUL1)
_MUL2 = _U(fmt.SPLITMIX_MUL2)
_P61 = _U(fmt.P61)
_SCAN_MUL = _U(fmt.SCAN_MUL)
_M32 = _U(0xFFFFFFFF)
_M29 = _U((1 << 29) - 1)
_WORDS = fmt.VIOLATION_WORDS
_TOKEN, _POSITION, _LINK, _FP = fmt.FIELD_TOKEN, fmt.FIELD_POSITION, fmt.FIELD_LINK, fmt.FIELD_FINGERPRINT
_CTR_CHECKED, _CTR_WRITTEN, _CTR_T_SKIPPED = fmt.CTR_SLOTS_CHECKED, fmt.CTR_SLOTS_WRITTEN, fmt.CTR_TOKENS_SKIPPED
_CTR_RUNS, _CTR_V_SKIPPED, _CTR_W_SKIPPED = fmt.CTR_KERNEL_RUNS, fmt.CTR_VERIFIES_SKIPPED, fmt.CTR_WRITES_SKIPPED
_CHAIN, _POS, _REAL_KV, _TOK = int(FailReason.CHAIN), int(FailReason.POSITION), int(FailReason.REAL_KV), \
    int(FailReason.TOKEN)
_W_TOKEN, _W_POS = int(FailReason.WRITE_TOKEN), int(FailReason.WRITE_POSITION)
_SLOT_OOR, _INPUT_OOR, _RESERVED = int(FailReason.SLOT_OUT_OF_RANGE), int(FailReason.INPUT_OUT_OF_RANGE), \
    int(FailReason.RESERVED_SLOT)
_SEED_SKIP, _RESERVED_SLOT, _PADDING_REQ = fmt.SEED_SKIP, fmt.RESERVED_SLOT, fmt.PADDING_REQ
_SCAN_FIRST, _SGLANG_FIRST = _U(fmt.SCAN_ANCHOR), _U(fmt.ANCHOR_HASH)
_NONE = np.zeros(0, dtype=np.int64)  # an optional array that is absent


def _jit(fn):
    """Compiled on first call, and cached on disk where numba finds a place to write."""
    try:
        return njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # no writable cache location: compiled once per process
        return njit(nogil=True)(fn)


# --- hashes (format.py's, on one uint64 at a time) ------------------------------
@_jit
def _splitmix64(x):
    z = x ^ (x >> _U(30))
    z = z * _MUL1
    z = z ^ (z >> _U(27))
    z = z * _MUL2
    return z ^ (z >> _U(31))


@_jit
def _mix3(a, b, c):
    return _splitmix64(_splitmix64(_splitmix64(a) ^ b) ^ c)


@_jit
def _fold61(x):
    return (x & _P61) + (x >> _U(61))


@_jit
def _reduce61(x):
    x = _fold61(x)
    return x - _P61 if x >= _P61 else x


@_jit
def _mulmod61(a, b):
    a1, a0, b1, b0 = a >> _U(32), a & _M32, b >> _U(32), b & _M32
    mid = a1 * b0 + a0 * b1
    hi = (a1 * b1) << _U(3)
    mid = (mid >> _U(29)) + ((mid & _M29) << _U(32))
    return _reduce61(_fold61(_fold61(a0 * b0) + hi) + _fold61(mid))


@_jit
def _next_link(link, token, position, scan):
    """The link a record (link, token, position: int64) passes to its successor (uint64)."""
    u, t, p = _U(link), _U(token), _U(position)
    if scan:
        return _reduce61(_mulmod61(_SCAN_MUL, u % _P61) + _splitmix64(_splitmix64(t) ^ p) % _P61)
    return _mix3(u, t, p)


@_jit
def _fingerprints(words, ks, slots, num_slots):
    """The real-KV fingerprint of each slot of ``slots`` (uint64 ``[len(slots)]``; a slot outside
    ``[0, num_slots)`` gets slot 0's, which nothing reads): over every source (``words[i]``:
    uint64 ``[layers, slots, words]``, of which the first ``ks[i]`` are hashed) and layer in
    order, ``acc = splitmix64(acc ^ fold)``, each layer's fold ``splitmix64(f ^ w)`` over its
    words. Computed a layer and a word at a time across the slots: their hashes are
    independent, so they run side by side (and in vector lanes) instead of one chain at a time."""
    n = slots.shape[0]
    at = np.empty(n, dtype=np.int64)
    for e in range(n):
        s = np.int64(slots[e])
        at[e] = s if s >= 0 and s < num_slots else 0
    acc = np.zeros(n, dtype=np.uint64)
    fold = np.empty(n, dtype=np.uint64)
    for i in range(len(words)):
        w = words[i]
        for layer in range(w.shape[0]):
            for e in range(n):
                fold[e] = _U(0)
            for j in range(ks[i]):
                for e in range(n):
                    fold[e] = _splitmix64(fold[e] ^ w[layer, at[e], j])
            for e in range(n):
                acc[e] = _splitmix64(acc[e] ^ fold[e])
    return acc


@_jit
def _row(out, n, tag, slot, position, stored_token, expected_token, stored_link, expected_link, bits, batch_row,
         expected_position, prev_slot, prev_position, stored_fp, expected_fp, token_index, span_start, span_end,
         tokens_given):
    """Write violation row ``n`` of ``out`` (the columns of ``format.VIOLATION_COLUMNS``)."""
    r = out[n]
    r[0], r[1], r[2], r[3], r[4], r[5] = tag, slot, position, stored_token, expected_token, stored_link
    r[6], r[7], r[8], r[9], r[10], r[11] = expected_link, bits, batch_row, expected_position, prev_slot, prev_position
    r[12], r[13], r[14], r[15], r[16], r[17] = stored_fp, expected_fp, token_index, span_start, span_end, tokens_given
    return n + 1


# --- plan --------------------------------------------------------------------
@_jit
def _slot_at(table, page_size, row, pos, lut):
    """``(slot, bad)``: the slot the table maps (row, pos) to, through the LUT when ``lut`` has
    entries; ``bad`` when it cannot be read (negative, an unfit page, outside the LUT)."""
    if page_size == 1:
        v = np.int64(table[row, pos])
    else:
        raw = np.int64(table[row, pos // page_size])
        off = pos % page_size
        v = raw * page_size + off if raw >= 0 and raw <= (_I64_MAX - off) // page_size else np.int64(-1)
    if v < 0:
        return v if lut.shape[0] == 0 else np.int64(-1), True
    if lut.shape[0] == 0:
        return v, False
    if v >= lut.shape[0]:
        return np.int64(-1), True
    out = np.int64(lut[v])
    return out, out < 0


@_jit
def _first_unreadable(table, page_size, row, lo, hi, lut):
    """The first position of ``[lo, hi)`` that row ``row`` of the table cannot map (see
    :func:`_slot_at`), else -1. Without a LUT a block is checked at once, at the last offset
    the range uses in it: an entry too large for an offset is too large for every later one."""
    pos = np.int64(lo)
    while pos < hi:
        end = pos + 1
        if lut.shape[0] == 0 and page_size > 1:
            end = pos + min(page_size - pos % page_size, hi - pos)
            raw = np.int64(table[row, pos // page_size])
            if raw >= 0 and raw <= (_I64_MAX - (end - 1) % page_size) // page_size:
                pos = end
                continue
        for at in range(pos, end):
            if _slot_at(table, page_size, row, at, lut)[1]:
                return at
        pos = end
    return np.int64(-1)


@_jit
def _plan(rp, prefix, extend, table, page_size, width, lut, swa_size, exp_table, exp_valid, exp_offset, has_exp,
          vp_slot, vp_prev, vp_pos, vp_tok, vp_offsets, vp_scalars, first_error, has_vp,
          wp_offsets, wp_seeds, wp_num_rows, wp_errors, has_wp):
    """``reference.plan``; ``vp_scalars``: the verify plan's num_valid, enable, requested,
    input_errors, overflows and max_requested arrays, in that order."""
    bs = rp.shape[0]
    nreq = table.shape[0]
    start = np.zeros(bs, dtype=np.int64)
    count = np.zeros(bs, dtype=np.int64)
    errors = 0
    unstamped = 0
    first_dropped = -1
    first_bad_pos = np.int64(-1)
    after_unknown = False
    w_total = np.int64(0)
    total = np.int64(0)
    for r in range(bs):
        q, p, e = np.int64(rp[r]), np.int64(prefix[r]), np.int64(extend[r])
        active = q != _PADDING_REQ
        good = (active and q > 0 and q < nreq and p >= 0 and e >= 0 and p <= width and e <= width - max(p, 0)
                and (not has_exp or q < exp_table.shape[0]))
        bad_pos = np.int64(-1)
        if good:
            s = max(p - swa_size, 0) if swa_size >= 0 else np.int64(0)
            start[r] = s
            # every slot the row reads: window, head's predecessor, seed
            bad_pos = _first_unreadable(table, page_size, q, max(s - 1, 0), p, lut)
            good = bad_pos < 0
        if active and not good:
            errors += 1
            if first_dropped < 0:
                first_dropped, first_bad_pos = r, bad_pos
        if good:
            count[r] = p - start[r]
            total += count[r]
        known = e >= 0 and e <= width
        stamps = good and not after_unknown
        if active and not stamps:
            unstamped += 1
        if has_wp:
            seed = np.int64(_SEED_SKIP)
            if stamps:
                seed = _slot_at(table, page_size, q, p - 1, lut)[0] if p > 0 and e > 0 else np.int64(-1)
            wp_seeds[r] = seed
            wp_offsets[r] = w_total
            w_total += e if known else 0
        if not known:
            after_unknown = True
    if has_vp:
        cap = vp_slot.shape[0]
        o = np.int64(0)
        for r in range(bs):
            vp_offsets[r] = o
            o += count[r]
        vp_offsets[bs:] = total
        vp_scalars[2][0] = total
        vp_scalars[0][0] = min(total, cap)
        vp_scalars[1][0] = 1 if total <= cap else 0
        vp_scalars[3][0] += errors
        vp_scalars[4][0] += 1 if total > cap else 0
        vp_scalars[5][0] = max(vp_scalars[5][0], total)
        first_error[:] = -1
        if first_dropped >= 0:
            r = first_dropped
            q = np.int64(rp[r])
            value = np.int64(table[q, first_bad_pos // page_size]) if first_bad_pos >= 0 else np.int64(-1)
            first_error[0], first_error[1], first_error[2] = r, q, prefix[r]
            first_error[3], first_error[4], first_error[5] = extend[r], first_bad_pos, value
        if total <= cap:
            i = 0
            for r in range(bs):
                if count[r] == 0:
                    continue
                q = np.int64(rp[r])
                lim = np.int64(0)
                if has_exp:
                    lim = min(np.int64(exp_valid[r]), np.int64(exp_table.shape[1]))
                prev = _slot_at(table, page_size, q, start[r] - 1, lut)[0] if start[r] > 0 else np.int64(-1)
                pos, end = start[r], start[r] + count[r]
                while pos < end:
                    # A block at a time (its table entry read once): every slot was found readable.
                    take, slot = np.int64(1), np.int64(0)
                    if lut.shape[0] == 0 and page_size > 1:
                        off = pos % page_size
                        take = min(page_size - off, end - pos)
                        slot = np.int64(table[q, pos // page_size]) * page_size + off
                    for j in range(take):
                        if take == 1:
                            slot = _slot_at(table, page_size, q, pos, lut)[0]
                        vp_slot[i], vp_prev[i], vp_pos[i] = slot, prev, pos
                        prev = slot  # the next position's predecessor
                        tok = np.int64(-1)
                        if has_exp:
                            k = pos + exp_offset
                            if k >= 0 and k < lim:
                                tok = np.int64(exp_table[q, k])
                        vp_tok[i] = tok
                        i += 1
                        pos += 1
                        slot += 1
    if has_wp:
        wp_offsets[bs:] = w_total
        wp_seeds[bs:] = -1
        wp_num_rows[0] = bs
        wp_errors[0] += unstamped


# --- verify ------------------------------------------------------------------
# The check loop keeps no growing array of rows (an array rebound in a loop costs numba
# reference counting on every entry, several times the check itself): it notes each
# flagged entry and what it found, and the rows are built from those notes afterwards.
_NOTE_BITS, _NOTE_EXPECTED, _NOTE_LIVE_FP = 0, 1, 2


@_jit
def _verify(rec, scan, slots, prevs, epos, etok, n, counters, tag, check_tokens, period, phase, words, ks, fp_on):
    """``reference.verify`` of entries ``[0, n)``; returns its violation rows with each
    entry's index in the batch-row column (the caller names the row)."""
    N = rec.shape[0]
    first = np.int64(_SCAN_FIRST if scan else _SGLANG_FIRST)
    counters[_CTR_CHECKED] += n
    flagged = np.empty(n, dtype=np.int64)
    notes = np.empty((n, 3), dtype=np.int64)
    # The fingerprints of the entries this launch samples (all of them without a period), at once.
    if fp_on and period == 0:
        live = _fingerprints(words, ks, slots[:n], N)
    else:
        live = np.zeros(n, dtype=np.uint64)
    if fp_on and period > 0:
        picked = np.empty(n, dtype=np.int64)
        m = 0
        for e in range(n):
            if np.int64(slots[e]) % period == phase:
                picked[m] = e
                m += 1
        fps = _fingerprints(words, ks, slots[picked[:m]], N)
        for i in range(m):
            live[picked[i]] = fps[i]
    k = 0
    for e in range(n):
        slot, prev, pos, tok = np.int64(slots[e]), np.int64(prevs[e]), np.int64(epos[e]), np.int64(etok[e])
        reserved = slot == _RESERVED_SLOT
        if reserved or slot < 0 or slot >= N or prev < -1 or prev >= N:
            flagged[k] = e
            notes[k, _NOTE_BITS] = _RESERVED if reserved else _SLOT_OOR
            k += 1
            continue
        stored, stored_fp = rec[slot, _LINK], rec[slot, _FP]
        expected = first
        if prev > 0:
            expected = np.int64(_next_link(rec[prev, _LINK], rec[prev, _TOKEN], rec[prev, _POSITION], scan))
        elif prev == 0:  # the padding predecessor: the chain is not checked
            expected = stored
        bits = 0
        if stored != expected:
            bits |= _CHAIN
        if rec[slot, _POSITION] != pos:
            bits |= _POS
        if check_tokens and tok != -1 and rec[slot, _TOKEN] != tok:
            bits |= _TOK
        live_fp = stored_fp
        if period == 0 or slot % period == phase:
            live_fp = np.int64(live[e])
            if live_fp != stored_fp:
                bits |= _REAL_KV
        if bits:
            flagged[k] = e
            notes[k, _NOTE_BITS], notes[k, _NOTE_EXPECTED], notes[k, _NOTE_LIVE_FP] = bits, expected, live_fp
            k += 1
    out = np.empty((k, _WORDS), dtype=np.int64)
    for i in range(k):
        e = flagged[i]
        slot, prev, pos, tok = np.int64(slots[e]), np.int64(prevs[e]), np.int64(epos[e]), np.int64(etok[e])
        prev_position = rec[prev, _POSITION] if prev > 0 and prev < N else np.int64(-1)
        bits = notes[i, _NOTE_BITS]
        if bits == _RESERVED or bits == _SLOT_OOR:  # the record is not read
            _row(out, i, tag, slot, -1, -1, tok, 0, 0, bits, e, pos, prev, prev_position, 0, 0, -1, -1, -1, -1)
        else:
            _row(out, i, tag, slot, rec[slot, _POSITION], rec[slot, _TOKEN], tok, rec[slot, _LINK],
                 notes[i, _NOTE_EXPECTED], bits, e, pos, prev, prev_position, rec[slot, _FP],
                 notes[i, _NOTE_LIVE_FP], -1, -1, -1, -1)
    return out


@_jit
def _verify_launch(rec, scan, slots, prevs, epos, etok, enable, num_valid, capacity, counters, tag, check_tokens,
                   period, sample_state, words, ks, fp_on):
    """A verify launch: counts the run, takes the plan's gate and count (an overflowed or
    unplanned plan checks nothing, and that is counted) and, with a sampling ``period``, the
    sampler's phase, which it advances; then :func:`_verify`."""
    counters[_CTR_RUNS] += 1
    phase = np.int64(0)
    if period > 0:
        phase = sample_state[0] % period
        sample_state[0] += 1
    if enable[0] != 1:
        counters[_CTR_V_SKIPPED] += 1
        return np.empty((0, _WORDS), dtype=np.int64)
    n = max(np.int64(0), min(np.int64(num_valid[0]), capacity))
    if n == 0:
        return np.empty((0, _WORDS), dtype=np.int64)
    return _verify(rec, scan, slots, prevs, epos, etok, n, counters, tag, check_tokens, period, phase, words, ks,
                   fp_on)


@_jit
def _grow(out):
    more = np.empty((max(16, 2 * out.shape[0]), _WORDS), dtype=np.int64)
    more[:out.shape[0]] = out
    return more


# --- write -------------------------------------------------------------------
@_jit
def _write(rec, scan, offsets, seeds, nrows, position_check, ids, poss, locs, exp_tok, has_et, exp_pos, has_ep,
           avail, counters, tag, words, ks, fp_on):
    """``reference.write`` of rows ``[0, nrows)``; returns its violation rows: the rows whose
    span, then those whose seed, is out of range, then the tokens' rows, in token order."""
    N = rec.shape[0]
    out = np.empty((0, _WORDS), dtype=np.int64)
    k = 0
    fps = _fingerprints(words, ks, locs[:avail], N) if fp_on else np.zeros(0, dtype=np.uint64)
    live = np.zeros(nrows, dtype=np.bool_)
    for r in range(nrows):  # spans out of range: a forged plan's rows, reported
        o0, o1, seed = offsets[r], offsets[r + 1], seeds[r]
        if seed != _SEED_SKIP and (o0 < 0 or o1 > avail or o1 < o0):
            if k == out.shape[0]:
                out = _grow(out)
            k = _row(out, k, tag, -1, -1, -1, -1, 0, 0, _INPUT_OOR, r, -1, -1, -1, 0, 0, -1, o0, o1, avail)
    for r in range(nrows):  # then seeds out of range
        o0, o1, seed = offsets[r], offsets[r + 1], seeds[r]
        if seed == _SEED_SKIP or o0 < 0 or o1 > avail or o1 < o0:
            continue
        if seed < -1 or seed >= N:
            if k == out.shape[0]:
                out = _grow(out)
            k = _row(out, k, tag, seed, -1, -1, -1, 0, 0, _SLOT_OOR, r, -1, -1, -1, 0, 0, -1, o0, o1, avail)
        else:
            live[r] = o1 > o0
    # Every live row's chain state, read from its seed record before any record is stored.
    running = np.empty(nrows, dtype=np.uint64)
    prev_pos = np.zeros(nrows, dtype=np.int64)
    for r in range(nrows):
        if live[r]:
            seed = seeds[r]
            if seed >= 0:
                running[r] = _next_link(rec[seed, _LINK], rec[seed, _TOKEN], rec[seed, _POSITION], scan)
                prev_pos[r] = rec[seed, _POSITION]
            else:
                running[r] = _SCAN_FIRST if scan else _SGLANG_FIRST
    written = 0
    skipped = 0
    for r in range(nrows):
        if not live[r]:
            continue
        o0, o1 = offsets[r], offsets[r + 1]
        link = running[r]
        has_prev = seeds[r] >= 0
        prev_p = prev_pos[r]
        for t in range(o0, o1):
            loc, tok, pos = np.int64(locs[t]), np.int64(ids[t]), np.int64(poss[t])
            if loc < 0:  # a negative slot is skipped: no store, the chain does not advance
                skipped += 1
                continue
            bits = 0
            exp_position = np.int64(-1)
            if position_check and has_prev:
                exp_position = prev_p + 1  # wraps as the kernel's does
                if pos != exp_position or prev_p == _I64_MAX:
                    bits |= _W_POS
            exp_token = np.int64(-1)
            if has_et:
                exp_token = np.int64(exp_tok[t])
                if exp_token != -1 and exp_token != tok:
                    bits |= _W_TOKEN
            if has_ep:
                ep = np.int64(exp_pos[t])
                if ep != -1:
                    exp_position = ep
                    if ep != pos:
                        bits |= _W_POS
            if loc >= N:
                bits |= _SLOT_OOR
            else:
                rec[loc, _TOKEN] = tok
                rec[loc, _POSITION] = pos
                rec[loc, _LINK] = np.int64(link)
                rec[loc, _FP] = np.int64(fps[t]) if fp_on else np.int64(0)
                written += 1
            if bits:
                if k == out.shape[0]:
                    out = _grow(out)
                k = _row(out, k, tag, loc, pos, tok, exp_token, np.int64(link), np.int64(link), bits, r, exp_position,
                         -1, prev_p if has_prev else np.int64(-1), 0, 0, t, o0, o1, avail)
            has_prev, prev_p = True, pos
            link = _reduce61(_mulmod61(_SCAN_MUL, link) + _splitmix64(_splitmix64(_U(tok)) ^ _U(pos)) % _P61) \
                if scan else _mix3(link, _U(tok), _U(pos))
    counters[_CTR_T_SKIPPED] += skipped
    counters[_CTR_WRITTEN] += written
    return out[:k]


@_jit
def _write_launch(rec, scan, offsets, seeds, num_rows, rows_max, position_check, ids, poss, locs, exp_tok, has_et,
                  exp_pos, has_ep, avail, counters, tag, words, ks, fp_on):
    """A write launch: counts the run, takes the plan's row count (an unplanned plan writes
    nothing, and that is counted) and position-check flag; then :func:`_write`."""
    counters[_CTR_RUNS] += 1
    planned = np.int64(num_rows[0])
    if planned < 0:
        counters[_CTR_W_SKIPPED] += 1
    nrows = max(np.int64(0), min(planned, rows_max))
    if nrows == 0:
        return np.empty((0, _WORDS), dtype=np.int64)
    return _write(rec, scan, offsets, seeds, nrows, position_check[0] != 0, ids, poss, locs, exp_tok, has_et,
                  exp_pos, has_ep, avail, counters, tag, words, ks, fp_on)


# --- an engine layout's gather (kvcanary_cupy.integrations.engine.kv_layout) ------------
@_jit
def _gather_slot(layers, offsets, block_elems, shadow, slot, block, at):
    """Copy slot ``slot`` (offset ``at`` of block ``block``) of every layer into ``shadow``."""
    base = block * block_elems
    w = shadow.shape[2]
    for i in range(len(layers)):
        flat = layers[i]
        for j in range(w):
            shadow[2 * i, slot, j] = flat[base + offsets[at, j]]
            shadow[2 * i + 1, slot, j] = flat[base + offsets[at, w + j]]


@_jit
def gather_slots(layers, offsets, block_elems, block_size, shadow, slots):
    """:meth:`GatheredSlots.gather_slots`: copy each slot's K elements (``offsets[slot % block_size,
    :w]`` of its block, in every layer of ``layers``) and V elements (``[w:]``) into ``shadow``
    ``[2 * layers, num_slots, w]``; slots outside it are left alone. Returns the slots copied."""
    n = 0
    for k in range(slots.shape[0]):
        s = np.int64(slots[k])
        if s >= 0 and s < shadow.shape[1]:
            _gather_slot(layers, offsets, block_elems, shadow, s, s // block_size, s % block_size)
            n += 1
    return n


@_jit
def gather_reads(layers, offsets, block_elems, block_size, shadow, table, rows, prefix):
    """:meth:`GatheredSlots.gather_reads`: :func:`gather_slots` of the slots table rows ``rows``
    map positions ``[0, prefix[i])`` to (a position past the table's width maps to none). A
    block whose slots all lie in the pool is copied element by element across its slots (a
    K element of consecutive slots is often contiguous in the engine's block), others slot by
    slot."""
    n = 0
    num_slots, w = shadow.shape[1], shadow.shape[2]
    for i in range(rows.shape[0]):
        row = np.int64(rows[i])
        if row < 0 or row >= table.shape[0]:  # no row of the table: nothing it maps (no bounds checks here)
            continue
        end = min(np.int64(prefix[i]), np.int64(table.shape[1]) * block_size)
        for page in range(-(-end // block_size)):
            block = np.int64(table[row, page])
            count = min(block_size, end - page * block_size)
            if block >= 0 and block <= (num_slots - count) // block_size:  # no slot number wraps
                first, base = block * block_size, block * block_elems
                for layer in range(len(layers)):
                    flat = layers[layer]
                    for j in range(2 * w):
                        kv, at_j = (2 * layer, j) if j < w else (2 * layer + 1, j - w)
                        for at in range(count):
                            shadow[kv, first + at, at_j] = flat[base + offsets[at, j]]
                n += count
                continue
            first = block * block_size  # may wrap for a forged entry: its slots then name their own block
            for at in range(count):
                s = first + at
                if s >= 0 and s < num_slots:
                    _gather_slot(layers, offsets, block_elems, shadow, s, s // block_size, s % block_size)
                    n += 1
    return n


# --- a block-table step's rows (kvcanary_cupy.integrations.engine.block_table) -------
@_jit
def stage_rows(query_start_loc, seq_lens, rows, block_table, table, out_rows, out_prefix, out_extend, out_valid):
    """:meth:`BlockTableCanary.check_reads`'s staging of a step's ``n = rows.shape[0]`` rows
    (the caller checks every shape): each row's extend (``query_start_loc[i + 1] -
    query_start_loc[i]``) and prefix (``seq_lens[i]`` less it) with its table row into the
    monitor's bound rows, prefix + extend into ``out_valid``, and block-table row ``i`` into
    ``table`` row ``rows[i]``. Returns the sum of the prefixes, or -1, having written nothing,
    when a row names no row of ``table``."""
    n = rows.shape[0]
    for i in range(n):
        if rows[i] < 0 or rows[i] >= table.shape[0]:
            return np.int64(-1)
    read = np.int64(0)
    for i in range(n):
        e = np.int64(query_start_loc[i + 1]) - np.int64(query_start_loc[i])
        p = np.int64(seq_lens[i]) - e
        out_rows[i], out_prefix[i], out_extend[i], out_valid[i] = rows[i], p, e, p + e
        read += p
        for j in range(block_table.shape[1]):
            table[rows[i], j] = block_table[i, j]
    return read


@_jit
def stage_tokens(ids, prefix, extend, slot_mapping, out_ids, out_pos, out_loc):
    """:meth:`BlockTableCanary.stamp_writes`'s staging of a step's ``T = ids.shape[0]`` tokens
    (the caller checks the buffers hold them): their ids, positions (row after row,
    ``prefix[r] .. prefix[r] + extend[r] - 1``) and slots into the monitor's token buffers.
    Returns the longest row's token count, or -1, having written nothing, when the rows'
    counts are no layout of the ``T`` tokens (one negative, or a sum other than ``T``)."""
    total = np.int64(0)
    longest = np.int64(0)
    for r in range(prefix.shape[0]):
        e = np.int64(extend[r])
        if e < 0:
            return np.int64(-1)
        total += e
        longest = max(longest, e)
    if total != ids.shape[0]:
        return np.int64(-1)
    t = 0
    for r in range(prefix.shape[0]):
        for j in range(np.int64(extend[r])):
            out_pos[t] = np.int64(prefix[r]) + j
            t += 1
    for t in range(ids.shape[0]):
        out_ids[t], out_loc[t] = ids[t], slot_mapping[t]
    return longest


# --- the Python side: the ops' arguments as the compiled loops take them ----------
def _sources(sources, mode):
    """``(words, ks, on)``: each source as uint64 ``[layers, slots, words]`` and the words of a
    slot it hashes (16 bytes in PARTIAL mode, ``read_bytes`` in ALL). A source's bytes are
    fixed for its life, so the layout of a prepared call's sources is kept, for as long as its
    first source lives (a layout holds views of the sources' pools, never the sources)."""
    if mode == RealKvMode.NONE or not sources:
        return _NO_SOURCES
    hit = _LAID_OUT.get(sources[0])
    if hit is not None and hit[1] == mode and len(hit[0]) == len(sources) and \
            all(r() is s for r, s in zip(hit[0], sources)):
        return hit[2]
    words = tuple(s.data.view(np.uint64).reshape(s.num_layers, -1, s.bytes_per_token // 8) for s in sources)
    ks = np.array([(fmt.KV_CHUNK_BYTES if mode == RealKvMode.PARTIAL else s.read_bytes) // 8 for s in sources],
                  dtype=np.int64)
    _LAID_OUT[sources[0]] = (tuple(weakref.ref(s) for s in sources), mode, (words, ks, True))
    return _LAID_OUT[sources[0]][2]


_NO_SOURCES = ((np.zeros((1, 1, 1), dtype=np.uint64),), np.zeros(1, dtype=np.int64), False)
_LAID_OUT = weakref.WeakKeyDictionary()  # a call's first source -> (its sources, weakly; mode; layout)


# Each op is bound once to its arguments (a prepared launch calls it step after step): what
# is fixed for the call's life is laid out then, and a call reads only the arrays' values.
def bind_plan(vp, wp, *, req_pool_indices, prefix_lens, extend_lens, table, page_size, swa, expected):
    """:func:`plan` bound: a callable of no argument."""
    bs = req_pool_indices.shape[0]
    nreq, twidth = table.shape
    lut = swa.lut if swa is not None and swa.lut is not None else _NONE
    if expected is not None:
        exp_table, exp_valid, exp_offset = expected.table, expected.valid_lens, int(expected.offset)
    else:
        exp_table, exp_valid, exp_offset = _NONE.reshape(0, 0), _NONE, 0
    if vp is not None:
        v = (vp.slot_indices, vp.prev_slot_indices, vp.expected_positions, vp.expected_tokens, vp.offsets,
             (vp.num_valid, vp.enable, vp.requested, vp.input_errors, vp.overflows, vp.max_requested),
             vp.first_input_error)
    else:
        v = (_NONE, _NONE, _NONE, _NONE, _NONE, (_NONE,) * 6, _NONE)
    w = (wp.offsets, wp.seed_slots, wp.num_rows, wp.input_errors) if wp is not None else (_NONE,) * 4
    fixed = (table, int(page_size), min(twidth * int(page_size), int(_I64_MAX)), lut,
             -1 if swa is None else int(swa.size), exp_table)
    rest = (exp_offset, expected is not None, *v, vp is not None, *w, wp is not None)
    # The per-row arrays as int64 (a few words each): fewer compiled variants of the plan.
    per_row = (req_pool_indices, prefix_lens[:bs], extend_lens[:bs], exp_valid)
    if all(x.dtype == np.int64 for x in per_row):
        args = (*per_row[:3], *fixed, per_row[3], *rest)
        return lambda: _plan(*args)

    def run():
        rp, pl, el, valid = (np.asarray(x, np.int64) for x in per_row)
        _plan(rp, pl, el, *fixed, valid, *rest)
    return run


def bind_verify(canary, vp, *, log, tag, sources, mode, check_tokens, sample):
    """:func:`verify` bound: a callable of no argument."""
    counters = log.counter_array
    fixed = (canary.records, canary.chain == fmt.CHAIN_SCAN, vp.slot_indices, vp.prev_slot_indices,
             vp.expected_positions, vp.expected_tokens)
    words, ks, on = _sources(sources, mode)
    period, state = (int(sample.period), sample.state) if sample is not None else (0, _NONE)
    args = (*fixed, vp.enable, vp.num_valid, int(vp.capacity), counters, int(tag), bool(check_tokens), period, state,
            words, ks, on)

    def run():
        rows = _verify_launch(*args)
        if rows.shape[0]:
            col = fmt.COL_BATCH_ROW
            rows[:, col] = np.searchsorted(vp.offsets.astype(np.int64), rows[:, col], side="right") - 1
            reference._append(log, [rows])
    return run


def bind_write(canary, wp, *, input_ids, positions, out_cache_loc, log, tag, sources, mode, expected_tokens,
               expected_positions):
    """:func:`write` bound: a callable of no argument."""
    counters = log.counter_array
    avail = min(a.shape[0] for a in (input_ids, positions, out_cache_loc, expected_tokens, expected_positions)
                if a is not None)
    words, ks, on = _sources(sources, mode)
    fixed = (canary.records, canary.chain == fmt.CHAIN_SCAN, wp.offsets, wp.seed_slots)
    tokens = (input_ids, positions, out_cache_loc, _NONE if expected_tokens is None else expected_tokens,
              expected_tokens is not None, _NONE if expected_positions is None else expected_positions,
              expected_positions is not None, avail, counters, int(tag), words, ks, on)
    args = (*fixed, wp.num_rows, min(wp.seed_slots.shape[0], wp.offsets.shape[0] - 1), wp.position_check, *tokens)

    def run():
        rows = _write_launch(*args)
        if rows.shape[0]:
            reference._append(log, [rows])
    return run


def plan(vp, wp, **inputs):
    bind_plan(vp, wp, **inputs)()


def verify(canary, vp, **inputs):
    bind_verify(canary, vp, **inputs)()


def write(canary, wp, **inputs):
    bind_write(canary, wp, **inputs)()


# --- the Backend interface -----------------------------------------------------
def prepare_plan(vp, wp, *, stream=None, **inputs):
    """:func:`plan` bound to its arguments."""
    run = bind_plan(vp, wp, **inputs)
    return lambda _stream: run()


prepare_plan_and_verify, prepare_plan_verify_write = reference.fused_preparers(bind_plan, bind_verify, bind_write)


def prepare_write(canary, wp, *, stream=None, digest=None, max_row_tokens=None, **inputs):
    """:func:`write` bound to its arguments; with ``digest``, then the reference's digest of its rows."""
    run = bind_write(canary, wp, **inputs)
    if digest is None:
        return lambda _stream: run()

    def run_and_digest(_stream):
        run()
        reference.digest(digest.rows, out=digest.out, carry=digest.carry)
    return run_and_digest


def prepare_verify(canary, vp, *, stream=None, **inputs):
    """:func:`verify` bound to its arguments."""
    run = bind_verify(canary, vp, **inputs)
    return lambda _stream: run()


prepare_scatter = reference.prepare_scatter
prepare_digest = reference.prepare_digest
prepare_agree = reference.prepare_agree
