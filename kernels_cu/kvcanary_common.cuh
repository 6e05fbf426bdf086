// kvcanary_common.cuh: the canary record format (both chain kinds) for the CUDA kernels.
//
// The CUDA twin of kvcanary_cupy/format.py. Every constant is written as
//     inline constexpr <type> NAME = <value>;
// with NAME as in format.py (FailReason bits as FAIL_<NAME>), so a test can
// parse this file and keep both sides equal. Only constants a kernel uses live
// here.
//
// No standard header is included: NVRTC compiles this without the CUDA
// toolkit's include directory (CuPy 14 cannot open <cstdint> there).
#pragma once

namespace kvc {

typedef long long i64;
typedef unsigned long long u64;

// --- record layout ----------------------------------------------------------
inline constexpr i64 RECORD_WORDS = 4;  // int64 words per record
inline constexpr i64 FIELD_POSITION = 1;
inline constexpr i64 FIELD_LINK = 2;
inline constexpr i64 FIELD_FINGERPRINT = 3;
inline constexpr i64 RESERVED_SLOT = 0;  // padding tokens park here; never written, a violation when read
inline constexpr i64 PADDING_REQ = 0;    // request-table row 0: a padding batch row
inline constexpr i64 SEED_SKIP = -2;     // a write plan's seed for a row that stamps nothing

// --- hash constants ---------------------------------------------------------
inline constexpr u64 SPLITMIX_MUL1 = 0xBF58476D1CE4E5B9ULL;
inline constexpr u64 SPLITMIX_MUL2 = 0x94D049BB133111EBULL;
inline constexpr u64 ANCHOR_HASH = 0xDE7FAE23A9A1B716ULL;  // splitmix64(ANCHOR), the first link of a chain
// The scan chain (format v2): links are affine maps mod P61.
inline constexpr u64 P61 = 0x1FFFFFFFFFFFFFFFULL;          // 2**61 - 1
inline constexpr u64 SCAN_ANCHOR = 0x1E7FAE23A9A1B71CULL;  // ANCHOR_HASH mod P61, the first link of a scan chain
inline constexpr u64 SCAN_MUL = 0x1BD238973A2B1490ULL;     // splitmix64(2) mod P61

// --- fail reasons (FailReason) ---------------------------------------------
inline constexpr i64 FAIL_CHAIN = 1;
inline constexpr i64 FAIL_POSITION = 2;
inline constexpr i64 FAIL_REAL_KV = 4;
inline constexpr i64 FAIL_WRITE_TOKEN = 8;
inline constexpr i64 FAIL_WRITE_POSITION = 16;
inline constexpr i64 FAIL_TOKEN = 32;
inline constexpr i64 FAIL_SLOT_OUT_OF_RANGE = 64;
inline constexpr i64 FAIL_INPUT_OUT_OF_RANGE = 128;
inline constexpr i64 FAIL_RANK_DIVERGENCE = 256;
inline constexpr i64 FAIL_RESERVED_SLOT = 512;

// --- violation ring layout --------------------------------------------------
// append_violation writes the columns in format.py's order: the ten of SGLang's rows, then a
// RowDetail's eight.
inline constexpr i64 VIOLATION_WORDS = 18;

// --- a verify plan's first input error (format.INPUT_ERROR_FIELDS) ------------
// [batch_row, request_row, prefix_len, extend_len, position, table_value]: the lowest live
// batch row of the latest plan that could not be planned (batch_row -1: none), and for a row
// whose scalars were in range, the first position it reads whose table entry is unreadable
// and that entry (-1, -1 when the row's own scalars are out of range).
inline constexpr i64 INPUT_ERROR_WORDS = 6;

// --- log counters -----------------------------------------------------------
inline constexpr i64 NUM_COUNTERS = 6;
inline constexpr i64 CTR_KERNEL_RUNS = 0;
inline constexpr i64 CTR_SLOTS_CHECKED = 1;
inline constexpr i64 CTR_SLOTS_WRITTEN = 2;
inline constexpr i64 CTR_VERIFIES_SKIPPED = 3;  // verify runs whose plan is not enabled
inline constexpr i64 CTR_WRITES_SKIPPED = 4;    // write runs whose plan was never planned
inline constexpr i64 CTR_TOKENS_SKIPPED = 5;    // tokens of live write rows on a negative slot

// --- real-KV fold descriptors (built by the host, one row per source layer) --
// Row k of the descriptor array: [layer base address, bytes_per_token,
// 16-byte chunks hashed (eff / 16), unused]. Slot s of the layer starts at
// base + s * bytes_per_token (the source's page geometry reduces to that).
inline constexpr i64 FOLD_DESC_WORDS = 4;

inline constexpr unsigned FULL_MASK = 0xFFFFFFFFu;

// --- hashes -----------------------------------------------------------------
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x ^= x >> 30;
    x *= SPLITMIX_MUL1;
    x ^= x >> 27;
    x *= SPLITMIX_MUL2;
    return x ^ (x >> 31);
}

// mix3(a, b, c) = splitmix64(splitmix64(splitmix64(a) ^ b) ^ c); b, c are int64
// token and position taken as uint64 bit patterns.
__device__ __forceinline__ u64 mix3(u64 a, i64 b, i64 c) {
    return splitmix64(splitmix64(splitmix64(a) ^ (u64)b) ^ (u64)c);
}

// --- index inputs -----------------------------------------------------------
// Index inputs arrive as int32 or int64, each on its own. The width travels as
// one bit of a kernel argument; the select is warp-uniform, so it costs one
// predicated load and no divergence.
__device__ __forceinline__ i64 load_index(const void* p, bool wide, i64 i) {
    return wide ? ((const i64*)p)[i] : (i64)((const int*)p)[i];
}

__device__ __forceinline__ bool width_bit(i64 widths, int k) { return (widths >> k) & 1; }

// --- records ------------------------------------------------------------------
struct Record {
    i64 token, position;
    u64 link, fingerprint;
};

// One record as two 16-byte loads (records are 32-byte aligned).
__device__ __forceinline__ Record load_record(const i64* records, i64 slot) {
    const longlong2* p = (const longlong2*)(records + slot * RECORD_WORDS);
    longlong2 a = p[0];
    longlong2 b = p[1];
    Record r;
    r.token = a.x;
    r.position = a.y;
    r.link = (u64)b.x;
    r.fingerprint = (u64)b.y;
    return r;
}

// --- the two chain kinds ------------------------------------------------------
// x mod P61 for any u64 x: 2**61 = 1 mod P61, so one fold leaves x < P61 + 8.
__device__ __forceinline__ u64 reduce61(u64 x) {
    x = (x & P61) + (x >> 61);
    return x >= P61 ? x - P61 : x;
}

// a * b mod P61 for a, b < P61: the 128-bit product is hi 2**64 + lo, and
// 2**64 = 8 mod P61; hi < 2**58, so 8 hi < 2**61 and the sum fits 63 bits.
__device__ __forceinline__ u64 mulmod61(u64 a, u64 b) {
    const u64 lo = a * b, hi = __umul64hi(a, b);
    return reduce61((lo & P61) + (lo >> 61) + (hi << 3));
}

__device__ __forceinline__ u64 scan_term(i64 token, i64 position) {
    return reduce61(splitmix64(splitmix64((u64)token) ^ (u64)position));
}

// The link after a stored (token, position) whose own link is `link`: kScan, the affine
// step SCAN_MUL * (link mod P61) + scan_term mod P61; else SGLang's mix3.
template <bool kScan>
__device__ __forceinline__ u64 advance(u64 link, i64 token, i64 position) {
    if (kScan) return reduce61(mulmod61(SCAN_MUL, reduce61(link)) + scan_term(token, position));
    return mix3(link, token, position);
}

// The link a record's successor stores.
template <bool kScan>
__device__ __forceinline__ u64 next_link(const Record& r) {
    return advance<kScan>(r.link, r.token, r.position);
}

template <bool kScan>
__device__ __forceinline__ u64 first_link() {
    return kScan ? SCAN_ANCHOR : ANCHOR_HASH;
}

// --- the check of one record ------------------------------------------------------
// The link a checked entry's predecessor's successor stores, for an entry that has a
// predecessor (prev > 0): from the predecessor's record, which is the lane `delta` below's
// when prev_below (its fields come over shuffles) and `pr` otherwise. The inputs are
// chosen before the one link is computed: a warp computes a link once, not once for its
// lanes and again for those whose predecessor is not below. Every lane must call it.
template <bool kScan>
__device__ __forceinline__ u64 predecessor_link(const Record& r, const Record& pr, bool prev_below, unsigned delta) {
    const i64 tok = __shfl_up_sync(FULL_MASK, r.token, delta);
    const i64 pos = __shfl_up_sync(FULL_MASK, r.position, delta);
    const u64 link = __shfl_up_sync(FULL_MASK, r.link, delta);
    return advance<kScan>(prev_below ? link : pr.link, prev_below ? tok : pr.token, prev_below ? pos : pr.position);
}

// The reasons a readable entry's record `r` fails, and the link it should hold (elink):
// the first link when it has no predecessor (prev -1), its own when the predecessor is
// the padding slot (prev 0: the chain is not checked), else `plink`, its predecessor's
// successor link (predecessor_link). Shared by verify and plan_and_verify.
template <bool kScan>
__device__ __forceinline__ i64 record_failures(const Record& r, i64 prev, u64 plink, i64 epos, i64 etok,
                                               bool check_tokens, bool fp_sel, u64 fp, u64& elink) {
    if (prev == -1) elink = first_link<kScan>();
    else if (prev == 0) elink = r.link;
    else elink = plink;
    i64 bits = 0;
    if (r.link != elink) bits |= FAIL_CHAIN;
    if (r.position != epos) bits |= FAIL_POSITION;
    if (check_tokens && etok != -1 && r.token != etok) bits |= FAIL_TOKEN;
    if (fp_sel && r.fingerprint != fp) bits |= FAIL_REAL_KV;
    return bits;
}

// The write's chain-position check of a token at position p stored after one at prev:
// p must be prev + 1 (in epos, wrapped), and nothing follows the largest position,
// whose successor would wrap around to the smallest.
__device__ __forceinline__ bool position_breaks(i64 prev, i64 p, i64& epos) {
    epos = (i64)((u64)prev + 1ULL);
    return prev == 0x7FFFFFFFFFFFFFFFLL || p != epos;
}

// x mod m in [0, m) for m > 0 (C++'s % keeps the sign of x): a sampler's phase.
__device__ __forceinline__ i64 pmod(i64 x, i64 m) {
    i64 r = x % m;
    return r < 0 ? r + m : r;
}

// --- warp helpers -----------------------------------------------------------
__device__ __forceinline__ unsigned lane_id() { return threadIdx.x & 31u; }

__device__ __forceinline__ unsigned lanes_below(unsigned lane) { return (1u << lane) - 1u; }

__device__ __forceinline__ unsigned lanes_above(unsigned lane) {
    return lane == 31u ? 0u : (FULL_MASK << (lane + 1u));
}

// Sum of v over the warp, valid in every lane (T = u64 for digests: unsigned sums wrap).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL_MASK, v, d);
    return v;
}

// Sum of v over the block, valid in thread 0 only. Every thread of the block
// must call it; `scratch` holds one T per warp, and may be reused right after.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
    v = warp_sum(v);
    unsigned w = threadIdx.x >> 5;
    __syncthreads();
    if (lane_id() == 0) scratch[w] = v;
    __syncthreads();
    T total = 0;
    if (threadIdx.x == 0)
        for (unsigned i = 0; i < (blockDim.x + 31u) >> 5; ++i) total += scratch[i];
    return total;
}

// Inclusive prefix sum of v over the block; `total` gets the block's sum in every
// thread. Every thread must call it; `scratch` holds a value per warp.
__device__ __forceinline__ i64 block_scan(i64 v, i64* scratch, i64& total) {
    const unsigned lane = lane_id(), w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    i64 incl = v;
    for (int d = 1; d < 32; d <<= 1) {
        const i64 x = __shfl_up_sync(FULL_MASK, incl, d);
        if ((int)lane >= d) incl += x;
    }
    __syncthreads();  // a previous use of scratch is over
    if (lane == 31) scratch[w] = incl;
    __syncthreads();
    if (w == 0) {
        i64 x = lane < nw ? scratch[lane] : 0;
        for (int d = 1; d < 32; d <<= 1) {
            const i64 y = __shfl_up_sync(FULL_MASK, x, d);
            if ((int)lane >= d) x += y;
        }
        if (lane < nw) scratch[lane] = x;
    }
    __syncthreads();
    total = scratch[nw - 1];
    return (w > 0 ? scratch[w - 1] : 0) + incl;
}

// block_scan of two values at once, for the latency of one: inclusive sums of a and b,
// their totals in ta and tb (every thread). `scratch` holds two values per warp.
__device__ __forceinline__ void block_scan2(i64& a, i64& b, i64* scratch, i64& ta, i64& tb) {
    const unsigned lane = lane_id(), w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int d = 1; d < 32; d <<= 1) {
        const i64 x = __shfl_up_sync(FULL_MASK, a, d), y = __shfl_up_sync(FULL_MASK, b, d);
        if ((int)lane >= d) {
            a += x;
            b += y;
        }
    }
    __syncthreads();  // a previous use of scratch is over
    if (lane == 31) {
        scratch[w] = a;
        scratch[32 + w] = b;
    }
    __syncthreads();
    if (w == 0) {
        i64 x = lane < nw ? scratch[lane] : 0, y = lane < nw ? scratch[32 + lane] : 0;
        for (int d = 1; d < 32; d <<= 1) {
            const i64 u = __shfl_up_sync(FULL_MASK, x, d), v = __shfl_up_sync(FULL_MASK, y, d);
            if ((int)lane >= d) {
                x += u;
                y += v;
            }
        }
        if (lane < nw) {
            scratch[lane] = x;
            scratch[32 + lane] = y;
        }
    }
    __syncthreads();
    ta = scratch[nw - 1];
    tb = scratch[32 + nw - 1];
    if (w > 0) {
        a += scratch[w - 1];
        b += scratch[32 + w - 1];
    }
}

// Waits until *p >= at_least, another block's store; returns the value seen. A plain
// (volatile) load, not an atomic: polling must not slow the atomics. Backs off from
// KVC_POLL_MIN_NS to KVC_POLL_MAX_NS. Only for a value a running block will store.
#ifndef KVC_POLL_MIN_NS
#define KVC_POLL_MIN_NS 64
#endif
#ifndef KVC_POLL_MAX_NS
#define KVC_POLL_MAX_NS 1024
#endif
__device__ __forceinline__ i64 poll_at_least(const i64* p, i64 at_least) {
    unsigned ns = KVC_POLL_MIN_NS;
    i64 v;
    while ((v = *(const volatile i64*)p) < at_least) {
        __nanosleep(ns);
        ns = ns < KVC_POLL_MAX_NS / 2 ? 2 * ns : KVC_POLL_MAX_NS;
    }
    return v;
}

// Last index i in [0, n) with a[i] <= x, or -1 (numpy searchsorted 'right' - 1
// on a non-decreasing array). Used for batch rows, only where needed. kL2: read
// through L2, for offsets another block of the same launch wrote.
template <bool kL2 = false>
__device__ __forceinline__ i64 row_of(const i64* a, i64 n, i64 x) {
    i64 lo = 0, hi = n;  // first index with a[i] > x lies in [lo, hi]
    while (lo < hi) {
        i64 mid = (lo + hi) >> 1;
        if ((kL2 ? __ldcg(a + mid) : a[mid]) <= x) lo = mid + 1;
        else hi = mid;
    }
    return lo - 1;
}

// --- violation sink -----------------------------------------------------------
// What a row holds past SGLang's ten columns (format.VIOLATION_COLUMNS 10..17), so that
// it points at the damage: a verify entry's predecessor record and both fingerprints;
// a write's token index and its row's span in the step's token arrays, and how many
// tokens those arrays hold. Columns a row does not use hold -1 (fingerprints 0).
struct RowDetail {
    i64 prev_slot, prev_position;
    u64 stored_fp, expected_fp;
    i64 token_index, span_start, span_end, tokens_given;
};

__device__ __forceinline__ RowDetail no_detail() { return RowDetail{-1, -1, 0, 0, -1, -1, -1, -1}; }

// A verify entry's: its predecessor slot as planned, the position that predecessor's
// record holds (-1 when none was read: no predecessor, the padding slot, or out of
// range), the record's fingerprint and the live bytes' (the stored one when the
// fingerprint was not checked).
__device__ __forceinline__ RowDetail entry_detail(i64 prev, i64 prev_position, u64 stored_fp, u64 expected_fp) {
    return RowDetail{prev, prev_position, stored_fp, expected_fp, -1, -1, -1, -1};
}

// The position the record at `prev` holds, read only for a row that is appended
// (`has`) and a predecessor inside the canary; -1 otherwise.
__device__ __forceinline__ i64 prev_position_of(const i64* records, i64 num_slots, bool has, i64 prev) {
    return has && prev > 0 && prev < num_slots ? records[prev * RECORD_WORDS + FIELD_POSITION] : -1;
}

// A write's: token `token_index` (-1 for a row's own fault: its span or seed) of the row
// whose span is [span_start, span_end), in token arrays of `tokens_given` tokens; the
// position of the token its chain follows (-1: none).
__device__ __forceinline__ RowDetail write_detail(i64 token_index, i64 prev_position, i64 span_start,
                                                  i64 span_end, i64 tokens_given) {
    return RowDetail{-1, prev_position, 0, 0, token_index, span_start, span_end, tokens_given};
}

// Appends one row per lane with `has` set: one atomic per warp reserves the
// rows, lanes take them in lane order. idx = head++ keeps counting past the
// ring; a row is stored only if idx < capacity, so the ring fills once and
// earlier rows are never overwritten. Every lane of the warp must call it.
__device__ __forceinline__ void append_violation(i64* ring, i64* head, i64 capacity, bool has, i64 tag,
                                                 i64 slot, i64 position, i64 stored_token,
                                                 i64 expected_token, u64 stored_link, u64 expected_link,
                                                 i64 bits, i64 batch_row, i64 expected_position,
                                                 const RowDetail& d) {
    unsigned m = __ballot_sync(FULL_MASK, has);
    if (m == 0u) return;
    unsigned lane = lane_id();
    int leader = __ffs(m) - 1;
    i64 base = 0;
    if ((int)lane == leader) base = (i64)atomicAdd((u64*)head, (u64)__popc(m));
    base = __shfl_sync(FULL_MASK, base, leader);
    if (!has) return;
    i64 idx = base + __popc(m & lanes_below(lane));
    if (idx < 0 || idx >= capacity) return;
    longlong2* row = (longlong2*)(ring + idx * VIOLATION_WORDS);
    row[0] = make_longlong2(tag, slot);
    row[1] = make_longlong2(position, stored_token);
    row[2] = make_longlong2(expected_token, (i64)stored_link);
    row[3] = make_longlong2((i64)expected_link, bits);
    row[4] = make_longlong2(batch_row, expected_position);
    row[5] = make_longlong2(d.prev_slot, d.prev_position);
    row[6] = make_longlong2((i64)d.stored_fp, (i64)d.expected_fp);
    row[7] = make_longlong2(d.token_index, d.span_start);
    row[8] = make_longlong2(d.span_end, d.tokens_given);
}

// --- real-KV fingerprint ------------------------------------------------------
// Each lane reads its own slot's bytes, 16 bytes per load, KVC_FOLD_AHEAD loads
// in flight. Measured on an H200 (verify over 1M entries, 256 B/token, one
// source), staging the bytes through a shared-memory tile so every load reads
// whole 128-byte lines was slower (162 / 144 us against 146 / 107 us for random
// / sequential slots): each lane consumes whole 32-byte sectors over consecutive
// loads, so the uncoalesced pattern costs no DRAM bandwidth.
// Chunks a lane reads ahead in fold_layer; blocks per SM the fingerprinting
// kernels are compiled for (their register budget).
#define KVC_FOLD_AHEAD 8
#define KVC_FP_MIN_BLOCKS 4

// Fold of one source layer at one slot: acc = splitmix64(acc ^ w) over the
// little-endian words of `chunks` 16-byte chunks, read directly by this lane,
// KVC_FOLD_AHEAD chunks in flight at a time.
__device__ __forceinline__ u64 fold_layer(const i64* desc, i64 slot) {
    const ulonglong2* p = (const ulonglong2*)(desc[0] + slot * desc[1]);
    i64 chunks = desc[2];
    u64 acc = 0;
    i64 c = 0;
    for (; c + KVC_FOLD_AHEAD <= chunks; c += KVC_FOLD_AHEAD) {
        ulonglong2 w[KVC_FOLD_AHEAD];
#pragma unroll
        for (int j = 0; j < KVC_FOLD_AHEAD; ++j) w[j] = __ldg(p + c + j);
#pragma unroll
        for (int j = 0; j < KVC_FOLD_AHEAD; ++j) {
            acc = splitmix64(acc ^ w[j].x);
            acc = splitmix64(acc ^ w[j].y);
        }
    }
    for (; c < chunks; ++c) {
        ulonglong2 w = __ldg(p + c);
        acc = splitmix64(acc ^ w.x);
        acc = splitmix64(acc ^ w.y);
    }
    return acc;
}

// Lanes per fingerprint: 1 when there are enough slots to fill the grid, more
// (a power of two <= 32, <= the folds) when slots are few and folds many, so a
// decode step with dozens of layers still spreads over the GPU. Uniform over
// the grid: derived from the same n, folds and grid size in every thread.
__device__ __forceinline__ int lanes_per_fingerprint(i64 n, i64 folds) {
    i64 threads = (i64)gridDim.x * (i64)blockDim.x;
    int g = 1;
    while (g < 32 && g < folds && n * g < threads) g <<= 1;
    return g;
}

// The fingerprint of `slot` over `folds` source layers, combined in layer
// order: R = splitmix64(R ^ fold). With g == 1 every lane has its own slot and
// folds it layer after layer (parallelism across slots). With g > 1 the g lanes of an aligned group share one
// slot: lane j of the group folds layers j, j+g, ... and the group combines
// them in order through shuffles. Every lane of the warp must call it with the
// same g and folds; lanes with `need` false do no loads. Returns R in every
// lane of a group that needed it.
__device__ __forceinline__ u64 fingerprint(const i64* descs, i64 folds, i64 slot, bool need, int g) {
    u64 r = 0;
    if (g == 1) {
        if (need)
            for (i64 k = 0; k < folds; ++k) r = splitmix64(r ^ fold_layer(descs + k * FOLD_DESC_WORDS, slot));
        return r;
    }
    unsigned lane = lane_id();
    unsigned group_base = lane & ~(unsigned)(g - 1);
    unsigned j = lane - group_base;
    for (i64 k0 = 0; k0 < folds; k0 += g) {
        i64 k = k0 + j;
        u64 f = 0;
        if (need && k < folds) f = fold_layer(descs + k * FOLD_DESC_WORDS, slot);
        i64 m = folds - k0 < g ? folds - k0 : g;
        for (i64 t = 0; t < m; ++t) {
            u64 v = __shfl_sync(FULL_MASK, f, (int)(group_base + (unsigned)t));
            r = splitmix64(r ^ v);
        }
    }
    return need ? r : 0;
}

// --- digest of rows (digest.cu; a write launch runs one in an extra block) --------
// A digest folds a few device arrays into one 64-bit value: the wrapping sum over
// every element of mix3(salt, index, value), plus mix3(salt, -1, count) per row.
// A sum does not depend on the order blocks finish in, so the digest is the same
// bytes on every launch and on the NumPy reference, and the per-element hash keeps
// a moved, changed, missing or extra element from cancelling out. Rows whose length
// lives on the device (a plan's num_valid) are read at run time: the launch has no
// data-dependent shape, so it can be captured in a CUDA graph.

// The twins of format.py's constants of the same names.
inline constexpr i64 DIGEST_DESC_WORDS = 6;  // [data, length, count ptr, gate ptr, element bytes, salt]
// Rows a launch takes at most (prepare_digest refuses more): their metadata is
// staged in shared memory once per block.
inline constexpr int MAX_DIGEST_ROWS = 64;

struct DigestArgs {
    const i64* descs;  // [num_descs, DIGEST_DESC_WORDS]
    i64 num_descs;
    i64* out;  // [1 + carry_words]: the digest, then the carried words
    u64* state;  // [2]: partial sum, finished blocks; zero between launches
    const i64* carry;  // copied verbatim after the digest (the log head), so one collective moves both
    i64 carry_words;
};

// Elements of a row this launch digests: the count read through its pointer,
// clamped to the row's length (bad data never reads past the array), and 0
// unless the gate holds 1 (a verify plan that overflowed wrote no entries).
__device__ __forceinline__ i64 row_count(const i64* d) {
    i64 n = d[1];
    if (d[2]) {
        const i64 c = *(const i64*)d[2];
        n = c < 0 ? 0 : (c < n ? c : n);
    }
    if (d[3] && *(const i64*)d[3] != 1) n = 0;
    return n;
}

// Block `block` of `blocks` digesting a.descs' rows: one grid-stride pass over the
// concatenation of all rows, so a thread's few loads are independent and in
// flight together (a pass per row would chain a global round trip per row); a
// block first stages every row's metadata (count and gate read once) in shared
// memory. Per block one atomic add of its partial sum, and the last block out
// publishes the total and zeroes the state for the next launch (so no memset is
// needed between launches or graph replays). A single block (a step's agreement
// digests a few hundred elements) publishes its sum directly: the atomics,
// fences and ticket are a chain of global round trips on the step's critical path.
__device__ __forceinline__ void digest_block(const DigestArgs& a, unsigned block, unsigned blocks) {
    __shared__ u64 scratch[32];
    __shared__ bool last;
    __shared__ i64 s_start[MAX_DIGEST_ROWS + 1];
    __shared__ const void* s_data[MAX_DIGEST_ROWS];
    __shared__ u64 s_salt[MAX_DIGEST_ROWS];
    __shared__ bool s_wide[MAX_DIGEST_ROWS];
    const int rows = (int)(a.num_descs < MAX_DIGEST_ROWS ? a.num_descs : MAX_DIGEST_ROWS);
    const bool alone = blocks == 1;
    // The carried words, loaded before the rows so their round trip overlaps the rows'.
    const i64 carried = alone && (i64)threadIdx.x < a.carry_words ? a.carry[threadIdx.x] : 0;
    u64 acc = 0;
    if ((int)threadIdx.x < rows) {
        const i64* d = a.descs + (i64)threadIdx.x * DIGEST_DESC_WORDS;
        const i64 n = row_count(d);
        s_start[threadIdx.x + 1] = n;  // a count for now; the prefix sum below
        s_data[threadIdx.x] = (const void*)d[0];
        s_salt[threadIdx.x] = (u64)d[5];
        s_wide[threadIdx.x] = d[4] == 8;
        if (block == 0) acc += mix3((u64)d[5], -1, n);  // each row's count, once per launch
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        s_start[0] = 0;
        for (int k = 0; k < rows; ++k) s_start[k + 1] += s_start[k];
    }
    __syncthreads();
    const i64 total = s_start[rows];
    const i64 stride = (i64)blocks * blockDim.x;
    for (i64 g = (i64)block * blockDim.x + threadIdx.x; g < total; g += stride) {
        int lo = 0, hi = rows - 1;  // the row holding g: the last start <= g
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_start[mid] <= g) lo = mid;
            else hi = mid - 1;
        }
        const i64 i = g - s_start[lo];
        acc += mix3(s_salt[lo], i, load_index(s_data[lo], s_wide[lo], i));
    }
    const u64 block_total = block_sum(acc, scratch);
    if (alone) {
        if (threadIdx.x == 0) a.out[0] = (i64)block_total;
        if ((i64)threadIdx.x < a.carry_words) a.out[1 + threadIdx.x] = carried;
        for (i64 j = blockDim.x + threadIdx.x; j < a.carry_words; j += blockDim.x) a.out[1 + j] = a.carry[j];
        return;
    }
    if (threadIdx.x == 0) {
        atomicAdd(&a.state[0], block_total);
        __threadfence();  // the sum lands before the ticket that may let another block read it
        last = atomicAdd(&a.state[1], 1ULL) == (u64)blocks - 1;
    }
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) {
        __threadfence();
        a.out[0] = (i64)atomicExch(&a.state[0], 0ULL);
        atomicExch(&a.state[1], 0ULL);
    }
    for (i64 j = threadIdx.x; j < a.carry_words; j += blockDim.x) a.out[1 + j] = a.carry[j];
}

}  // namespace kvc
