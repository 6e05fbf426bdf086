"""The canary record format: constants, reasons, hashes, the two chain kinds.

This module is the Python twin of ``kernels_cu/kvcanary_common.cuh``; the test
``tests/test_format.py`` parses that header and keeps both sides equal.

Hashes are computed in uint64 arithmetic that wraps; records store them bit for
bit as int64.
"""
from __future__ import annotations

import enum

import numpy as np

# --- record layout -----------------------------------------------------------
RECORD_WORDS = 4  # int64 words per record
RECORD_BYTES = 32
FIELD_TOKEN = 0
FIELD_POSITION = 1
FIELD_LINK = 2
FIELD_FINGERPRINT = 3
RESERVED_SLOT = 0  # engines park padding tokens here: never written; a live row that reads it is a violation
PADDING_REQ = 0  # request-table row 0 is the padding row of a batch
# A write plan's seed for a row that stamps nothing: padding, a row that cannot be planned, or
# a row after one whose span of the step's tokens is unknown. -1 is a row that starts a chain.
SEED_SKIP = -2

# --- hash constants ----------------------------------------------------------
SPLITMIX_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX_MUL2 = 0x94D049BB133111EB
ANCHOR = 0xC0FFEE1234567890
ANCHOR_HASH = 0xDE7FAE23A9A1B716  # splitmix64(ANCHOR); checked by the tests
# --- chain kinds (DESIGN §3.1) ------------------------------------------------
# "scan" (v2, the default): next_link = SCAN_MUL * link + scan_term(token, position) mod P61,
# an affine map, so a row's links are a parallel prefix scan. "sglang" (v1): next_link =
# mix3(link, token, position), serial, byte for byte SGLang's records.
CHAIN_SCAN = "scan"
CHAIN_SGLANG = "sglang"
CHAINS = (CHAIN_SCAN, CHAIN_SGLANG)
DEFAULT_CHAIN = CHAIN_SCAN
P61 = (1 << 61) - 1  # the Mersenne prime the scan chain works modulo
SCAN_ANCHOR = 0x1E7FAE23A9A1B71C  # ANCHOR_HASH mod P61: the first link of a scan chain
SCAN_MUL = 0x1BD238973A2B1490  # splitmix64(2) mod P61
KV_CHUNK_BYTES = 16  # the real-KV fold consumes 16-byte chunks
FOLD_DESC_WORDS = 4  # int64 words of one real-KV fold descriptor row the CUDA backend uploads

# --- violation ring layout ---------------------------------------------------
VIOLATION_COLUMNS = (
    "tag",
    "slot",
    "position",
    "stored_token",
    "expected_token",
    "stored_link",
    "expected_link",
    "fail_bits",
    "batch_row",
    "expected_position",
    # Past the ten columns of SGLang's rows (equal to its rows, byte for byte), what points
    # at the damage (the header's RowDetail). A verify entry's row: its predecessor slot as
    # planned (-1: the first entry) and the position that predecessor's record holds (-1:
    # not read), the record's fingerprint and the live bytes' (the record's when the
    # fingerprint was not checked).
    "prev_slot",
    "prev_position",
    "stored_fingerprint",
    "expected_fingerprint",
    # A write's row: the token's index in the step's token arrays (-1: a fault of the row
    # itself, its span or seed), the row's span there, and how many tokens the arrays hold
    # (the shortest); the position of the token its chain follows is in prev_position.
    "token_index",
    "span_start",
    "span_end",
    "tokens_given",
)
VIOLATION_WORDS = len(VIOLATION_COLUMNS)  # 18
SGLANG_VIOLATION_WORDS = 10  # the leading columns SGLang's rows have
COL_TAG = 0
COL_SLOT = 1
COL_POSITION = 2
COL_STORED_TOKEN = 3
COL_EXPECTED_TOKEN = 4
COL_STORED_LINK = 5
COL_EXPECTED_LINK = 6
COL_FAIL_BITS = 7
COL_BATCH_ROW = 8
COL_EXPECTED_POSITION = 9
COL_PREV_SLOT = 10
COL_PREV_POSITION = 11
COL_STORED_FINGERPRINT = 12
COL_EXPECTED_FINGERPRINT = 13
COL_TOKEN_INDEX = 14
COL_SPAN_START = 15
COL_SPAN_END = 16
COL_TOKENS_GIVEN = 17
# What a row holds in the columns it does not use (the header's no_detail).
UNUSED_DETAIL = {"prev_slot": -1, "prev_position": -1, "stored_fingerprint": 0, "expected_fingerprint": 0,
                 "token_index": -1, "span_start": -1, "span_end": -1, "tokens_given": -1}

# A RANK_DIVERGENCE row (tag TP_AGREE) names ranks, not a slot: slot and batch_row
# are -1 and these columns carry the agreement (Violation.rank and friends read them).
DIVERGENCE_COLUMNS = {
    "rank": "stored_token",  # the rank whose digest differs from the majority's
    "reference_rank": "expected_token",  # the lowest rank holding the majority's digest
    "agreement_step": "position",  # agreement rounds run so far, this one included: equal on every rank
    "agreeing_ranks": "expected_position",  # ranks holding the majority's digest
    "digest": "stored_link",  # the divergent rank's digest
    "reference_digest": "expected_link",  # the majority's digest
}

# --- a verify plan's first input error (VerifyPlan.first_input_error) --------
# The lowest live batch row of the latest plan that could not be planned (batch_row -1:
# none), its inputs, and, when those were in range, the first position it reads whose
# table entry is unreadable and that entry (position and table_value -1 otherwise).
INPUT_ERROR_FIELDS = ("batch_row", "request_row", "prefix_len", "extend_len", "position", "table_value")
INPUT_ERROR_WORDS = len(INPUT_ERROR_FIELDS)

# --- tensor-parallel agreement (kernels_cu/digest.cu) ------------------------
# One digest row descriptor: [data address, length, count address (0: the length),
# gate address (0: none; the row counts nothing unless the gate holds 1), element bytes
# (4 or 8), salt].
DIGEST_DESC_WORDS = 6
MAX_DIGEST_ROWS = 64  # rows one digest takes (the kernel stages their metadata in shared memory)
MAX_RANKS = 1024  # ranks the compare kernel takes (its shared-memory tally)
# The salts of a verify plan's entry digest (plan_and_verify's ``digest``): the digest of
# its slot, prev slot, expected position and expected token arrays, in that order.
ENTRY_DIGEST_SALTS = (1, 2, 3, 4)
# The compare kernel's device state, int64 words in this order:
AGREE_STATE_FIELDS = (
    "group_rows",  # rows every rank's own checks logged, summed over the group (divergence rows not included)
    "divergences",  # divergence rows appended (each once: every rank appends the same ones)
    "agreement_steps",  # agreement rounds run
    "agreed_head",  # this rank's log head right after the latest round's appends
    "own_rows",  # this rank's own-check rows as the latest round gathered them
)
AGREE_STATE_WORDS = len(AGREE_STATE_FIELDS)

# --- log counters ------------------------------------------------------------
# The last three make work that silently does nothing visible: a verify whose plan
# is not enabled (overflowed or never planned), a write whose plan was never
# planned (num_rows < 0), and tokens of live write rows parked on a negative slot.
COUNTER_NAMES = ("kernel_runs", "slots_checked", "slots_written", "verifies_skipped", "writes_skipped",
                 "tokens_skipped")
NUM_COUNTERS = len(COUNTER_NAMES)
CTR_KERNEL_RUNS = 0
CTR_SLOTS_CHECKED = 1
CTR_SLOTS_WRITTEN = 2
CTR_VERIFIES_SKIPPED = 3
CTR_WRITES_SKIPPED = 4
CTR_TOKENS_SKIPPED = 5


class FailReason(enum.IntFlag):
    """Why a record failed. Bits 1..32 mean the same as in SGLang's KV canary."""

    NONE = 0
    CHAIN = 1  # the stored link differs from the one derived from the predecessor
    POSITION = 2  # the stored position differs from the planned one
    REAL_KV = 4  # the fingerprint of the live K/V bytes differs from the stored one
    WRITE_TOKEN = 8  # a written token differs from the expected input
    WRITE_POSITION = 16  # a written position is not the expected / previous + 1
    TOKEN = 32  # the stored token differs from the expected token
    SLOT_OUT_OF_RANGE = 64  # a slot outside the canary buffer (never read)
    INPUT_OUT_OF_RANGE = 128  # write inputs shorter than the write plan needs
    RANK_DIVERGENCE = 256  # a tensor-parallel rank planned or wrote something other than the group's majority
    RESERVED_SLOT = 512  # a live row's table maps a position it reads to the reserved slot 0

    def describe(self) -> str:
        names = [m.name.lower() for m in FailReason if m and m in self]
        return "+".join(names) if names else "none"


FAIL_BITS = {m.name: int(m) for m in FailReason if m}


class RealKvMode(enum.IntEnum):
    """How much of each slot's real K/V bytes the fingerprint covers."""

    NONE = 0  # no fingerprint (stored as 0)
    PARTIAL = 1  # the first 16 bytes of each source
    ALL = 2  # read_bytes of each source


class LaunchTag(enum.IntEnum):
    """Names the launch that wrote a violation row. Any int64 is a valid tag."""

    VERIFY = 1
    WRITE = 2
    VERIFY_AFTER = 3
    VERIFY_SWA = 4
    WRITE_SWA = 5
    SWEEP = 6
    VERIFY_DRAFT = 7
    WRITE_DRAFT = 8
    TP_AGREE = 9  # the per-step agreement of tensor-parallel ranks (kvcanary_cupy.distributed)


# --- hashes ------------------------------------------------------------------
_U64 = np.uint64
_MUL1 = _U64(SPLITMIX_MUL1)
_MUL2 = _U64(SPLITMIX_MUL2)
_S30, _S27, _S31 = _U64(30), _U64(27), _U64(31)


def as_u64(x) -> np.ndarray:
    """Reinterpret ints / int64 arrays as uint64 (-1 -> 0xFFFF_FFFF_FFFF_FFFF)."""
    a = np.asarray(x)
    if a.dtype == np.uint64:
        return a
    if a.dtype == np.int64:
        return a.view(np.uint64)
    if a.dtype.kind in "iu":
        return a.astype(np.int64).view(np.uint64)
    if a.dtype == object or a.dtype.kind == "O":
        return np.array([int(v) & 0xFFFFFFFFFFFFFFFF for v in a.ravel()], dtype=np.uint64).reshape(a.shape)
    raise TypeError(f"kvcanary: expected integers for hashing, got dtype {a.dtype}")


def _u64_scalar_or_array(x):
    if isinstance(x, int):
        return np.array(x & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
    return as_u64(x)


def splitmix64(x):
    """Vectorized splitmix64 finalizer on uint64 (wrapping multiply, no warnings).

    Accepts Python ints (any sign, taken mod 2**64) and integer arrays; returns
    uint64 (a 0-d array for scalar input).
    """
    u = _u64_scalar_or_array(x)
    # uint64 array multiplication wraps silently; on a 0-d array NumPy computes with
    # np.uint64 scalars, which warn on overflow.
    u = u.reshape(1) if u.ndim == 0 else u
    z = u >> _S30  # a new array: the input is left as it is
    z ^= u
    z *= _MUL1
    z ^= z >> _S27
    z *= _MUL2
    z ^= z >> _S31
    return z.reshape(np.shape(x)) if np.ndim(x) == 0 else z


def mix3(a, b, c):
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)`` with int64 b, c taken as uint64."""
    return splitmix64(splitmix64(splitmix64(a) ^ _u64_scalar_or_array(b)) ^ _u64_scalar_or_array(c))


def check_chain(chain, name: str = "chain") -> str:
    """``chain`` if it names a chain kind (``"scan"`` or ``"sglang"``), else a ``kvcanary:`` error."""
    if not isinstance(chain, str) or chain not in CHAINS:
        raise ValueError(f"kvcanary: {name}: expected one of {', '.join(map(repr, CHAINS))}, got {chain!r}")
    return chain


_P61 = _U64(P61)
_S61, _S32, _S29, _M32, _M29 = _U64(61), _U64(32), _U64(29), _U64(0xFFFFFFFF), _U64((1 << 29) - 1)


def _fold61(x):
    """A value congruent to uint64 x mod P61 and below 2**61 + 8 (2**64 = 8 mod P61)."""
    return (x & _P61) + (x >> _S61)


def reduce61(x):
    """x mod P61 for uint64 x < 2**64 (one fold leaves x < 2**61 + 8, the compare finishes)."""
    x = _fold61(x)
    return x - np.where(x >= _P61, _P61, _U64(0))


def mulmod61(a, b):
    """``a * b mod P61`` for uint64 arrays with ``a, b < P61``, without 128-bit integers:
    with ``a = a1 2^32 + a0`` and ``b = b1 2^32 + b0``, ``2^64 = 8`` and ``2^61 = 1`` mod P61."""
    a, b = np.asarray(a, dtype=_U64), np.asarray(b, dtype=_U64)
    a1, a0, b1, b0 = a >> _S32, a & _M32, b >> _S32, b & _M32
    mid = a1 * b0 + a0 * b1  # < 2^62
    hi = (a1 * b1) << _U64(3)  # a1 b1 2^64 = 8 a1 b1, < 2^61
    mid = (mid >> _S29) + ((mid & _M29) << _S32)  # mid 2^32 = (mid >> 29) 2^61 + (mid & (2^29 - 1)) 2^32
    # Folds keep every partial sum below 2^63 (each fold < 2^61 + 8); only the sum is reduced.
    return reduce61(_fold61(_fold61(a0 * b0) + hi) + _fold61(mid))


def scan_term(token, position):
    """``splitmix64(splitmix64(token) ^ position) mod P61``: what a record adds to the scan chain."""
    return splitmix64(splitmix64(token) ^ _u64_scalar_or_array(position)) % _P61


def _next_link(link, token, position, chain: str):
    if chain == CHAIN_SGLANG:
        return mix3(link, token, position)
    return reduce61(mulmod61(_U64(SCAN_MUL), _u64_scalar_or_array(link) % _P61) + scan_term(token, position))


def next_link(records, *, chain: str = DEFAULT_CHAIN):
    """The link a record's successor must store (uint64 ``[...]``).

    ``records``: int64 ``[..., 4]`` records (token, position, link, fingerprint). ``"scan"``:
    ``(SCAN_MUL * (link mod P61) + scan_term(token, position)) mod P61``; ``"sglang"``:
    ``mix3(link, token, position)``.

    Example::

        >>> import kvcanary_cupy as kc
        >>> hex(int(kc.next_link(kc.make_records([101], [0])[0])))
        '0x14e8c713dba50ce1'
    """
    r = np.asarray(records, dtype=np.int64)
    if r.shape[-1:] != (RECORD_WORDS,):
        raise ValueError(f"kvcanary: records: expected int64 [..., {RECORD_WORDS}], got shape {r.shape}")
    return _next_link(r[..., FIELD_LINK].view(_U64), r[..., FIELD_TOKEN], r[..., FIELD_POSITION],
                      check_chain(chain))


def first_link(chain: str = DEFAULT_CHAIN) -> int:
    """The link of a sequence's first record: ``SCAN_ANCHOR`` or ``ANCHOR_HASH``."""
    return SCAN_ANCHOR if check_chain(chain) == CHAIN_SCAN else ANCHOR_HASH


def chain_links(tokens, positions, seed_link=None, *, chain: str = DEFAULT_CHAIN) -> np.ndarray:
    """Links of a sequence whose first record has link ``seed_link`` (default: the chain
    kind's first link), as uint64 ``[n]``."""
    chain = check_chain(chain)
    tokens = as_u64(np.asarray(tokens, dtype=np.int64))
    positions = as_u64(np.asarray(positions, dtype=np.int64))
    seed = first_link(chain) if seed_link is None else seed_link
    out = np.empty(tokens.shape[0], dtype=np.uint64)
    running = np.array([seed & 0xFFFFFFFFFFFFFFFF if isinstance(seed, int) else seed], dtype=np.uint64)
    for i in range(tokens.shape[0]):
        out[i] = running[0]
        running = _next_link(running, tokens[i : i + 1], positions[i : i + 1], chain)
    return out


def make_records(tokens, positions, seed_link=None, fingerprints=None, *, chain: str = DEFAULT_CHAIN) -> np.ndarray:
    """Records (int64 [n, 4]) of one chained sequence, e.g. for tests and sweeps."""
    tokens = np.asarray(tokens, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    rec = np.zeros((tokens.shape[0], RECORD_WORDS), dtype=np.int64)
    rec[:, FIELD_TOKEN] = tokens
    rec[:, FIELD_POSITION] = positions
    rec[:, FIELD_LINK] = chain_links(tokens, positions, seed_link, chain=chain).view(np.int64)
    if fingerprints is not None:
        rec[:, FIELD_FINGERPRINT] = as_u64(fingerprints).view(np.int64)
    return rec


def fold_chunks(words: np.ndarray) -> np.ndarray:
    """Fold of one source: words is uint64 ``[..., n, 2*k]`` (k 16-byte chunks per slot), folded
    along its last axis; returns uint64 ``[..., n]`` (e.g. every layer of a source at once)."""
    acc = np.zeros(words.shape[:-1], dtype=np.uint64)
    for j in range(words.shape[-1]):
        acc = splitmix64(acc ^ words[..., j])
    return acc


def combine_folds(folds) -> np.ndarray:
    """Combine per-source folds in order: ``R = splitmix64(R ^ fold)``."""
    folds = list(folds)
    if not folds:
        raise ValueError("kvcanary: combine_folds needs at least one fold")
    r = np.zeros_like(folds[0])
    for f in folds:
        r = splitmix64(r ^ f)
    return r
