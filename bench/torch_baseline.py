"""The PyTorch baseline: plan, verify and write with stock tensor ops, no custom kernels.

This is what an engine team would write on its own: ``repeat_interleave`` /
``cumsum`` / gathers for the plan, masked gathers for verify, and the write
chain vectorized across rows: for the ``"scan"`` chain (the default) a
Hillis-Steele scan of affine maps over each row's tokens, for the ``"sglang"``
chain, serial by definition, a Python loop over token index. It computes the
same bytes as the NumPy reference for both chain kinds
(``tests/test_torch_baseline.py`` checks plan entries, records and violation
rows on random, corrupted inputs) and is timed beside kvcanary by the bench.

Hashes run in torch int64: multiplication wraps identically in two's complement,
and a logical right shift is an arithmetic one masked to the low ``64 - k`` bits.
Torch has no 128-bit product, so the scan chain's multiply mod ``2**61 - 1`` is
done in 32-bit pieces whose partial products fit int64 (see :func:`mulmod61`).

Like a straightforward implementation, it reads a few sizes back to the host
(``int(tensor)``), so it synchronizes the device several times per call; that
cost is part of what the bench measures.

Objects here own torch tensors (CPU or CUDA); inputs are torch tensors on the
same device. Index inputs may be int32 or int64; plans, records and the log are
int64.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass

from kvcanary_cupy import format as fmt

_MASK64 = (1 << 64) - 1


def _i64(u: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


_M1 = _i64(fmt.SPLITMIX_MUL1)
_M2 = _i64(fmt.SPLITMIX_MUL2)
ANCHOR_HASH_I64 = _i64(fmt.ANCHOR_HASH)
_P61 = fmt.P61  # < 2**63: a plain positive int64
_M32 = (1 << 32) - 1
_M29 = (1 << 29) - 1
_FP_BLOCK = 1 << 22  # entries fingerprinted per block: bounds the gathered bytes

_CHAIN = int(fmt.FailReason.CHAIN)
_POSITION = int(fmt.FailReason.POSITION)
_REAL_KV = int(fmt.FailReason.REAL_KV)
_WRITE_TOKEN = int(fmt.FailReason.WRITE_TOKEN)
_WRITE_POSITION = int(fmt.FailReason.WRITE_POSITION)
_TOKEN = int(fmt.FailReason.TOKEN)
_SLOT_OOR = int(fmt.FailReason.SLOT_OUT_OF_RANGE)
_INPUT_OOR = int(fmt.FailReason.INPUT_OUT_OF_RANGE)
_RESERVED = int(fmt.FailReason.RESERVED_SLOT)
_I64_MAX = (1 << 63) - 1


def _torch():
    import torch  # noqa: PLC0415  (the bench imports torch only when the baseline runs)

    return torch


# --- hashes ------------------------------------------------------------------
def splitmix64(x):
    """splitmix64 on an int64 tensor holding uint64 bits; returns a new int64 tensor."""
    z = x ^ ((x >> 30) & ((1 << 34) - 1))
    z.mul_(_M1)
    z ^= (z >> 27) & ((1 << 37) - 1)
    z.mul_(_M2)
    z ^= (z >> 31) & ((1 << 33) - 1)
    return z


def mix3(a, b, c):
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)`` on int64 tensors."""
    return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)


def reduce61(x):
    """``x mod P61`` for int64 tensors holding any uint64 bits.

    ``2**61 = 1`` mod P61, so the top three bits fold onto the low 61: the sum is at
    most ``P61 + 7``, and one conditional subtraction finishes.
    """
    x = (x & _P61) + ((x >> 61) & 7)
    return _torch().where(x >= _P61, x - _P61, x)


def mulmod61(a, b):
    """``a * b mod P61`` for int64 tensors (or a Python int ``a``) with ``0 <= a, b < P61``.

    With ``a = a1 2**32 + a0`` (``a1 < 2**29``): ``a1 b1 2**64 = 8 a1 b1`` and
    ``mid 2**32 = (mid >> 29) 2**61 + (mid & (2**29 - 1)) 2**32`` mod P61; every
    partial product but ``a0 b0`` fits int64, and ``a0 b0`` wraps to its uint64
    bits, which :func:`reduce61` reads as such.
    """
    a1, a0, b1, b0 = a >> 32, a & _M32, b >> 32, b & _M32
    mid = a1 * b0 + a0 * b1  # < 2**62
    hi = (a1 * b1) << 3  # < 2**61
    mid = (mid >> 29) + ((mid & _M29) << 32)
    return reduce61(reduce61(reduce61(a0 * b0) + hi) + reduce61(mid))


def scan_term(token, position):
    """``splitmix64(splitmix64(token) ^ position) mod P61``: what a record adds to the scan chain."""
    return reduce61(splitmix64(splitmix64(token) ^ position))


def check_chain(chain: str) -> str:
    """``chain`` if it names a chain kind, else a ``kvcanary:`` error (as the library's)."""
    return fmt.check_chain(chain)


def first_link(chain: str) -> int:
    """The link of a sequence's first record, as int64 bits."""
    return _i64(fmt.first_link(chain))


def next_link(link, token, position, chain: str):
    """The link a record's successor stores, from the record's fields (int64 tensors)."""
    if chain == fmt.CHAIN_SGLANG:
        return mix3(link, token, position)
    return reduce61(mulmod61(fmt.SCAN_MUL, reduce61(link)) + scan_term(token, position))


# --- owned objects -------------------------------------------------------------
def _full_i64(n: int, value: int, device):
    torch = _torch()
    return torch.full((n,), value, dtype=torch.int64, device=device)


@dataclass(eq=False)
class TorchVerifyPlan:
    """The verify plan's arrays as int64 torch tensors (see ``kvcanary_cupy.VerifyPlan``)."""

    slot_indices: object
    prev_slot_indices: object
    expected_positions: object
    expected_tokens: object
    offsets: object
    num_valid: object
    enable: object
    requested: object
    input_errors: object
    overflows: object
    max_requested: object

    @classmethod
    def allocate(cls, *, capacity: int, max_batch: int, device="cpu", fill: int = -1) -> "TorchVerifyPlan":
        full = functools.partial(_full_i64, device=device)

        return cls(full(capacity, fill), full(capacity, fill), full(capacity, fill), full(capacity, fill),
                   full(max_batch + 1, 0), full(1, 0), full(1, 0), full(1, 0), full(1, 0), full(1, 0), full(1, 0))

    @property
    def capacity(self) -> int:
        return int(self.slot_indices.shape[0])


@dataclass(eq=False)
class TorchWritePlan:
    """The write plan's arrays as int64 torch tensors (see ``kvcanary_cupy.WritePlan``)."""

    offsets: object
    seed_slots: object
    num_rows: object
    input_errors: object
    position_check: object

    @classmethod
    def allocate(cls, *, max_batch: int, device="cpu") -> "TorchWritePlan":
        full = functools.partial(_full_i64, device=device)

        return cls(full(max_batch + 1, 0), full(max_batch, -1), full(1, 0), full(1, 0), full(1, 1))


@dataclass(eq=False)
class TorchLog:
    """A violation ring ``[capacity, 10]``, its append index ``[1]`` and counters ``[NUM_COUNTERS]``."""

    ring: object
    head: object
    counters: object

    @classmethod
    def allocate(cls, *, capacity: int, device="cpu") -> "TorchLog":
        torch = _torch()
        return cls(torch.zeros((capacity, fmt.VIOLATION_WORDS), dtype=torch.int64, device=device),
                   torch.zeros(1, dtype=torch.int64, device=device),
                   torch.zeros(fmt.NUM_COUNTERS, dtype=torch.int64, device=device))

    def rows(self):
        """The rows held (a torch tensor; synchronizes)."""
        n = min(int(self.head[0]), self.ring.shape[0])
        return self.ring[:n]


@dataclass(eq=False)
class TorchKvSource:
    """A KV source seen as int64 words.

    Attributes:
        words: int64 ``[num_layers, layer_bytes // 8]``, the pool's bytes.
        bytes_per_token, read_bytes: as in ``RealKvSource`` (multiples of 16).
    """

    words: object
    bytes_per_token: int
    read_bytes: int

    @property
    def num_layers(self) -> int:
        return int(self.words.shape[0])

    @classmethod
    def from_source(cls, src) -> "TorchKvSource":
        """Zero-copy torch view of a ``RealKvSource`` (NumPy or CuPy bytes) through DLPack."""
        torch = _torch()
        data = torch.from_dlpack(src.data)  # uint8 [num_layers, layer_bytes]
        return cls(data.view(torch.int64), int(src.bytes_per_token), int(src.read_bytes))


# --- internals -------------------------------------------------------------------
def _append(log: TorchLog, block) -> None:
    """Append rows; rows past the ring's capacity are dropped and counted."""
    m = int(block.shape[0])
    if m == 0:
        return
    h = int(log.head[0])
    keep = max(0, min(m, log.ring.shape[0] - h))
    if keep:
        log.ring[h:h + keep] = block[:keep]
    log.head[0] = h + m


def _rows(torch, n, device, **cols):
    """A violation block ``[n, VIOLATION_WORDS]`` from per-column tensors or scalars; the detail
    columns a row does not use take their ``format.UNUSED_DETAIL`` values."""
    out = torch.empty((n, fmt.VIOLATION_WORDS), dtype=torch.int64, device=device)
    for i, name in enumerate(fmt.VIOLATION_COLUMNS):
        out[:, i] = cols[name] if name in cols else fmt.UNUSED_DETAIL[name]
    return out


def _link_of(rec, chain: str):
    """next_link of gathered records ``[n, 4]``."""
    return next_link(rec[:, fmt.FIELD_LINK], rec[:, fmt.FIELD_TOKEN], rec[:, fmt.FIELD_POSITION], chain)


def _serial_links(running, toks, poss, stored):
    """Links stored by each token of padded rows ``[nrows, L]``, ``"sglang"`` chain: one
    token of every row at a time (the chain is serial within a row). ``running`` is each
    row's first link; a token that is not stored leaves the chain where it was."""
    torch = _torch()
    out = torch.empty_like(toks)
    for j in range(int(toks.shape[1])):
        out[:, j] = running
        running = torch.where(stored[:, j], mix3(running, toks[:, j], poss[:, j]), running)
    return out


def _scan_links(running, toks, poss, stored):
    """Links stored by each token of padded rows ``[nrows, L]``, ``"scan"`` chain.

    Each stored token is the map ``x -> SCAN_MUL x + scan_term`` mod P61 (a skipped one
    the identity); a Hillis-Steele scan composes the maps of each row's tokens in
    ``log2(L)`` steps, and a token stores its row's first link put through the maps of
    the tokens before it.
    """
    torch = _torch()
    a = torch.where(stored, torch.full_like(toks, fmt.SCAN_MUL), 1)
    b = torch.where(stored, scan_term(toks, poss), 0)
    L = int(toks.shape[1])
    d = 1
    while d < L:
        # token k takes in token k - d: (a_k, b_k) o (a_{k-d}, b_{k-d})
        na = mulmod61(a[:, d:], a[:, :-d])
        nb = reduce61(mulmod61(a[:, d:], b[:, :-d]) + b[:, d:])
        a = torch.cat([a[:, :d], na], dim=1)
        b = torch.cat([b[:, :d], nb], dim=1)
        d *= 2
    x0 = reduce61(running)[:, None]
    before = reduce61(mulmod61(a[:, :-1], x0.expand(-1, L - 1)) + b[:, :-1])  # maps of tokens 0..j-1
    return torch.cat([running[:, None], before], dim=1)


def fingerprints(sources, mode: int, slots):
    """Fingerprints (int64 bits) of in-range ``slots`` (int64 ``[n]``) for ``sources``."""
    torch = _torch()
    r = torch.zeros_like(slots)
    if int(mode) == int(fmt.RealKvMode.NONE) or not sources:
        return r
    n = int(slots.shape[0])
    for lo in range(0, n, _FP_BLOCK):
        s = slots[lo:lo + _FP_BLOCK]
        acc = torch.zeros_like(s)
        for src in sources:
            eff = fmt.KV_CHUNK_BYTES if int(mode) == int(fmt.RealKvMode.PARTIAL) else src.read_bytes
            wpt = src.bytes_per_token // 8
            for layer in range(src.num_layers):
                g = src.words[layer].view(-1, wpt)[:, : eff // 8].index_select(0, s)
                fold = torch.zeros_like(s)
                for j in range(eff // 8):
                    fold = splitmix64(fold ^ g[:, j])
                acc = splitmix64(acc ^ fold)
        r[lo:lo + _FP_BLOCK] = acc
    return r


def _translate(torch, vals, lut):
    """(slots, bad): apply the SWA LUT where given; negative or unmapped values are bad."""
    bad = vals < 0
    if lut is None:
        return vals, bad
    n = int(lut.shape[0])
    inside = (vals >= 0) & (vals < n)
    if n == 0:
        return torch.full_like(vals, -1), torch.ones_like(bad)
    out = torch.where(inside, lut[vals.clamp(0, n - 1)].long(), -1)
    return out, bad | ~inside | (out < 0)


def _slots_at(torch, table, page_size, rows, pos, lut):
    """T(table(rows, pos)); rows / pos must lie inside the table."""
    vals = table[rows, torch.div(pos, page_size, rounding_mode="floor")].long()
    if page_size != 1:
        vals = torch.where(vals < 0, vals, vals * page_size + torch.remainder(pos, page_size))
    return _translate(torch, vals, lut)


# --- plan ----------------------------------------------------------------------
def plan(vp: TorchVerifyPlan | None, wp: TorchWritePlan | None, *, req_pool_indices, prefix_lens, extend_lens,
         table, page_size: int = 1, swa_size: int | None = None, lut=None, expected_table=None,
         valid_lens=None, expected_offset: int = 0) -> None:
    """Plan a step (same meaning as ``kvcanary_cupy.plan``).

    Args:
        vp, wp: outputs (either may be None).
        req_pool_indices, prefix_lens, extend_lens: int ``[bs]`` (lens may be longer).
        table: int ``[num_requests, width / page_size]``; ``page_size`` slots per entry.
        swa_size, lut: the sliding window and its slot LUT (both or neither).
        expected_table, valid_lens, expected_offset: the expected-token option.
    """
    torch = _torch()
    dev = req_pool_indices.device
    bs = int(req_pool_indices.shape[0])
    rp = req_pool_indices.long()
    P = prefix_lens[:bs].long()
    E = extend_lens[:bs].long()
    nreq, tw = int(table.shape[0]), int(table.shape[1])
    width = tw * page_size

    active = rp != fmt.PADDING_REQ
    ok = active & (rp > 0) & (rp < nreq) & (P >= 0) & (E >= 0) & (P <= width) & (E <= width - P.clamp(min=0))
    if expected_table is not None:
        ok &= rp < int(expected_table.shape[0])
    start = (P - swa_size).clamp(min=0) if swa_size is not None else torch.zeros_like(P)
    count = torch.where(ok, P - start, 0)

    # One entry per (row, position in the window) of every structurally valid row.
    total_all = int(count.sum())
    row_of = torch.repeat_interleave(torch.arange(bs, device=dev), count, output_size=total_all)
    first = torch.cumsum(count, 0) - count
    pos = torch.arange(total_all, device=dev) - first[row_of] + start[row_of]
    slot, bad = _slots_at(torch, table, page_size, rp[row_of], pos, lut)

    # The predecessor of an entry is the previous entry of its row, except at the
    # window head, whose real predecessor (position start - 1) is looked up per row.
    have_table = nreq > 0 and tw > 0
    rp_c = rp.clamp(0, max(nreq - 1, 0))
    if have_table:
        head, head_bad = _slots_at(torch, table, page_size, rp_c, (start - 1).clamp(0, width - 1), lut)
        seed_v, seed_bad = _slots_at(torch, table, page_size, rp_c, (P - 1).clamp(0, width - 1), lut)
    else:
        head = seed_v = torch.full_like(P, -1)
        head_bad = seed_bad = torch.zeros_like(ok)
    is_first = pos == start[row_of]
    has_head = start > 0
    shifted = torch.cat([torch.full((1,), -1, dtype=torch.int64, device=dev), slot[:-1]])
    prev = torch.where(is_first, torch.where(has_head[row_of], head[row_of], -1), shifted)
    bad |= is_first & has_head[row_of] & head_bad[row_of]
    row_bad = torch.zeros(bs, dtype=torch.int64, device=dev).index_add_(0, row_of, bad.long()) > 0

    W = torch.where(ok, E, 0)
    wants_seed = ok & (P > 0) & (W > 0)
    row_bad |= wants_seed & seed_bad
    seed = torch.where(wants_seed, seed_v, -1)

    dropped = ok & row_bad
    ok &= ~row_bad
    errors = (active & ~ok).sum()
    count = torch.where(ok, count, 0)
    # Every row keeps its span of the step's tokens; after one whose length is no span, none stamps.
    known = (E >= 0) & (E <= width)
    W = torch.where(known, E, 0)
    unknown = (~known).long()
    stamps = ok & ((torch.cumsum(unknown, 0) - unknown) == 0)
    unstamped = (active & ~stamps).sum()
    seed = torch.where(stamps, seed, fmt.SEED_SKIP)
    if bool(dropped.any()):  # compact only when a row was dropped (rare)
        keep = ok[row_of]
        row_of, pos, slot, prev = row_of[keep], pos[keep], slot[keep], prev[keep]

    if vp is not None:
        total = int(row_of.shape[0])
        cap = vp.capacity
        offs = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(count, 0)])
        vp.offsets[: bs + 1] = offs
        vp.offsets[bs + 1:] = total
        vp.requested.fill_(total)
        vp.num_valid.fill_(min(total, cap))
        vp.enable.fill_(1 if total <= cap else 0)
        vp.input_errors.add_(errors)
        vp.overflows.add_(1 if total > cap else 0)
        vp.max_requested.clamp_(min=total)
        if total <= cap:
            vp.slot_indices[:total] = slot
            vp.prev_slot_indices[:total] = prev
            vp.expected_positions[:total] = pos
            tok = torch.full_like(pos, -1)
            if expected_table is not None and int(expected_table.shape[1]) > 0 and total:
                ew = int(expected_table.shape[1])
                k = pos + expected_offset
                lim = valid_lens[:bs].long()[row_of].clamp(max=ew)
                m = (k >= 0) & (k < lim)
                tok = torch.where(m, expected_table[rp_c[row_of], k.clamp(0, ew - 1)].long(), -1)
            vp.expected_tokens[:total] = tok
    if wp is not None:
        offs = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(W, 0)])
        wp.offsets[: bs + 1] = offs
        wp.offsets[bs + 1:] = offs[-1]
        wp.seed_slots[:bs] = seed
        wp.seed_slots[bs:] = -1
        wp.num_rows.fill_(bs)
        wp.input_errors.add_(unstamped)


# --- write ---------------------------------------------------------------------
def _position_check(torch, wp: TorchWritePlan, stored, poss, has_seed, seed_pos):
    """(position bad, expected position column, previous position column) of padded rows
    ``[nrows, L]``: each stored token's position must follow the previous stored token's in
    its row (the seed record's before the first); a row without a seed does not check its
    first token. The previous position column is -1 where a token follows none."""
    L = int(stored.shape[1])
    jj = torch.arange(L, device=stored.device).expand_as(stored)
    last = torch.cummax(torch.where(stored, jj, -1), dim=1).values  # latest stored token at or before j
    before = torch.cat([torch.full_like(last[:, :1], -1), last[:, :-1]], dim=1)
    in_row = before >= 0
    prev_p = torch.where(in_row, poss.gather(1, before.clamp(min=0)), seed_pos[:, None])
    has_prev = in_row | has_seed[:, None]
    chk = stored & has_prev & (wp.position_check[0] != 0)  # no sync per call
    # No position follows the largest: its successor wraps, as in the kernels.
    return (chk & ((poss != prev_p + 1) | (prev_p == _I64_MAX)), torch.where(chk, prev_p + 1, -1),
            torch.where(has_prev, prev_p, -1))


def write(records, wp: TorchWritePlan, *, input_ids, positions, out_cache_loc, log: TorchLog, tag: int,
          sources=(), mode: int = 0, expected_tokens=None, expected_positions=None,
          chain: str = fmt.DEFAULT_CHAIN) -> None:
    """Stamp records (same meaning as ``kvcanary_cupy.write``).

    Args:
        records: int64 ``[num_slots, 4]``.
        wp: the write plan.
        input_ids, positions, out_cache_loc: int ``[>= total]``.
        log: violations and counters.
        tag: launch tag for violation rows.
        sources: ``TorchKvSource`` s; mode: ``RealKvMode`` value.
        expected_tokens, expected_positions: optional int ``[>= total]`` (-1 skips).
        chain: the canary's chain kind, ``"scan"`` or ``"sglang"``.
    """
    torch = _torch()
    check_chain(chain)
    dev = records.device
    N = int(records.shape[0])
    log.counters[fmt.CTR_KERNEL_RUNS] += 1
    if int(wp.num_rows[0]) < 0:  # never planned
        log.counters[fmt.CTR_WRITES_SKIPPED] += 1
    nrows = max(0, min(int(wp.num_rows[0]), int(wp.seed_slots.shape[0])))  # a forged count reads nothing extra
    if nrows == 0:
        return
    offs = wp.offsets[: nrows + 1]
    seeds = wp.seed_slots[:nrows]
    o0, o1 = offs[:-1], offs[1:]
    avail = min(int(a.shape[0]) for a in (input_ids, positions, out_cache_loc, expected_tokens, expected_positions)
                if a is not None)
    skip = seeds == fmt.SEED_SKIP  # the plan skipped (and counted) the row
    span_bad = ~skip & ((o0 < 0) | (o1 > avail) | (o1 < o0))
    seed_bad = ~skip & ~span_bad & ((seeds < -1) | (seeds >= N))
    live = ~skip & ~span_bad & ~seed_bad & (o1 > o0)
    lens = torch.where(live, o1 - o0, 0)
    blocks = []
    rows_idx = torch.arange(nrows, device=dev)
    for mask, slot_col, bit in ((span_bad, -1, _INPUT_OOR), (seed_bad, seeds, _SLOT_OOR)):
        r = rows_idx[mask]
        if r.shape[0]:
            s = slot_col if isinstance(slot_col, int) else slot_col[r]
            blocks.append(_rows(torch, int(r.shape[0]), dev, tag=tag, slot=s, position=-1, stored_token=-1,
                                expected_token=-1, stored_link=0, expected_link=0, fail_bits=bit, batch_row=r,
                                expected_position=-1, span_start=o0[r], span_end=o1[r], tokens_given=avail))
    L = int(lens.max())
    if L == 0:
        if blocks:
            _append(log, torch.cat(blocks))
        return

    # Rows padded to [nrows, L]: token (r, j) is input index offsets[r] + j.
    jj = torch.arange(L, device=dev)
    valid = jj[None, :] < lens[:, None]
    tidx = torch.where(valid, o0[:, None] + jj[None, :], 0)
    loc = torch.where(valid, out_cache_loc[tidx].long(), -1)
    log.counters[fmt.CTR_TOKENS_SKIPPED] += int((valid & (loc < 0)).sum())
    toks = input_ids[tidx].long()
    poss = positions[tidx].long()

    has_seed = live & (seeds >= 0)
    seed_rec = records[torch.where(has_seed, seeds, 0)]
    running = torch.where(has_seed, _link_of(seed_rec, chain), first_link(chain))
    stored = loc >= 0  # a negative slot is skipped: no store, the chain does not advance
    chain_fn = _scan_links if chain == fmt.CHAIN_SCAN else _serial_links
    stored_link = chain_fn(running, toks, poss, stored)
    pos_bad, exp_pos_col, prev_pos_col = _position_check(torch, wp, stored, poss, has_seed,
                                                         seed_rec[:, fmt.FIELD_POSITION])

    bits = pos_bad.long() * _WRITE_POSITION
    exp_tok_col = torch.full_like(loc, -1)
    if expected_tokens is not None:
        exp_tok_col = torch.where(valid, expected_tokens[tidx].long(), -1)
        bits |= (stored & (exp_tok_col != -1) & (exp_tok_col != toks)).long() * _WRITE_TOKEN
    if expected_positions is not None:
        ep = torch.where(valid, expected_positions[tidx].long(), -1)
        has = ep != -1
        exp_pos_col = torch.where(has, ep, exp_pos_col)
        bits |= (stored & has & (ep != poss)).long() * _WRITE_POSITION
    oor = stored & (loc >= N)
    bits |= oor.long() * _SLOT_OOR
    store = stored & ~oor
    sl = loc[store]
    if sl.shape[0]:
        fp = fingerprints(sources, mode, sl)
        records[sl] = torch.stack([toks[store], poss[store], stored_link[store], fp], dim=1)
    log.counters[fmt.CTR_SLOTS_WRITTEN] += int(sl.shape[0])

    v = bits != 0
    if bool(v.any()):
        link = stored_link[v]
        row = rows_idx[:, None].expand(nrows, L)[v]
        blocks.append(_rows(torch, int(link.shape[0]), dev, tag=tag, slot=loc[v], position=poss[v],
                            stored_token=toks[v], expected_token=exp_tok_col[v], stored_link=link,
                            expected_link=link, fail_bits=bits[v], batch_row=row, expected_position=exp_pos_col[v],
                            prev_position=prev_pos_col[v], token_index=tidx[v], span_start=o0[row],
                            span_end=o1[row], tokens_given=avail))
    if blocks:
        _append(log, torch.cat(blocks))


# --- verify --------------------------------------------------------------------
def verify(records, vp: TorchVerifyPlan, *, log: TorchLog, tag: int, sources=(), mode: int = 0,
           check_tokens: bool = False, sample=None, chain: str = fmt.DEFAULT_CHAIN) -> None:
    """Check planned records (same meaning as ``kvcanary_cupy.verify``).

    Args:
        records: int64 ``[num_slots, 4]``.
        vp: the verify plan.
        log: violations and counters.
        tag: launch tag for violation rows.
        sources: ``TorchKvSource`` s; mode: ``RealKvMode`` value.
        check_tokens: compare stored tokens with the plan's expected tokens.
        sample: optional ``(period, state)``, state an int64 tensor ``[2]``: sampled
            fingerprint checks, as ``FingerprintSampler``.
        chain: the canary's chain kind, ``"scan"`` or ``"sglang"``.
    """
    torch = _torch()
    check_chain(chain)
    dev = records.device
    N = int(records.shape[0])
    log.counters[fmt.CTR_KERNEL_RUNS] += 1
    phase = period = None
    if sample is not None:
        period, state = sample
        phase = int(state[0]) % period
        state[0] += 1
    n = int(vp.num_valid[0]) if int(vp.enable[0]) == 1 else 0
    if int(vp.enable[0]) != 1:  # overflowed or never planned
        log.counters[fmt.CTR_VERIFIES_SKIPPED] += 1
    n = max(0, min(n, vp.capacity))
    if n == 0:
        return
    slot = vp.slot_indices[:n]
    prev = vp.prev_slot_indices[:n]
    epos = vp.expected_positions[:n]
    etok = vp.expected_tokens[:n]
    # Every entry is a live row's read: one at the reserved slot is reported, never read.
    log.counters[fmt.CTR_SLOTS_CHECKED] += n
    reserved = slot == fmt.RESERVED_SLOT
    oor = ~reserved & ((slot < 0) | (slot >= N) | (prev < -1) | (prev >= N))
    chk = ~reserved & ~oor
    s = torch.where(chk, slot, 0)
    rec = records[s]
    linked = chk & (prev > 0)
    exp_link = torch.where(linked, _link_of(records[torch.where(linked, prev, 0)], chain), first_link(chain))
    stored_link = rec[:, fmt.FIELD_LINK]
    exp_link = torch.where(prev == 0, stored_link, exp_link)  # padding predecessor: chain not checked
    bits = (stored_link != exp_link).long() * _CHAIN
    bits |= (rec[:, fmt.FIELD_POSITION] != epos).long() * _POSITION
    if check_tokens:
        bits |= ((etok != -1) & (rec[:, fmt.FIELD_TOKEN] != etok)).long() * _TOKEN
    fp_sel = chk if phase is None else chk & (torch.remainder(s, period) == phase)
    stored_fp = torch.where(chk, rec[:, fmt.FIELD_FINGERPRINT], 0)
    live_fp = torch.where(fp_sel, fingerprints(sources, mode, s), stored_fp)  # the stored one where not computed
    bits |= (live_fp != stored_fp).long() * _REAL_KV
    bits = torch.where(chk, bits, 0)
    inside = (prev > 0) & (prev < N)
    prev_pos = torch.where(inside, records[torch.where(inside, prev, 0), fmt.FIELD_POSITION], -1)

    e = torch.nonzero(oor | reserved | (bits != 0)).squeeze(1)  # entry order
    if e.shape[0] == 0:
        return
    o = oor[e] | reserved[e]  # not read
    r = rec[e]
    batch_row = torch.searchsorted(vp.offsets, e, right=True) - 1
    _append(log, _rows(
        torch, int(e.shape[0]), dev, tag=tag, slot=slot[e],
        position=torch.where(o, -1, r[:, fmt.FIELD_POSITION]), stored_token=torch.where(o, -1, r[:, fmt.FIELD_TOKEN]),
        expected_token=etok[e], stored_link=torch.where(o, 0, stored_link[e]),
        expected_link=torch.where(o, 0, exp_link[e]),
        fail_bits=torch.where(reserved[e], _RESERVED, torch.where(o, _SLOT_OOR, bits[e])),
        batch_row=batch_row, expected_position=epos[e], prev_slot=prev[e], prev_position=prev_pos[e],
        stored_fingerprint=stored_fp[e], expected_fingerprint=live_fp[e]))
