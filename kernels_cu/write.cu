// write.cu: stamp records for the tokens a step writes.
//
// One kernel, write_tokens<kFp, kScan, kLong>, in two phases with no grid-wide barrier
// between them (they write different record fields):
//   A. the chain: each stored token's id, position and link, by one of the routes
//      below, row by row (every row's span and seed checked first: row_ok);
//   B. the fingerprints (kFp, with real-KV sources): field 3 of every stored
//      token's record, grid-stride over all input tokens (in write_tokens).
// Without sources (kFp = false) phase A stores the fingerprint 0 itself. A launch may
// also carry a digest, computed by one extra block, the grid's last (WriteStepArgs).
//
// Routes of phase A, by chain kind (kScan) and row length:
//   sglang chain (kScan false, format v1), section "sglang chain": a warp per row,
//       every lane running the serial chain in lockstep (chain_row).
//   scan chain (kScan true, format v2), section "scan chain": a row's links are a
//   prefix scan of affine maps (the pieces every scan route shares come first):
//     rows of at most WARP_ROW_MAX tokens (decode, speculative steps): a warp each
//       (scan_row_warp);
//     longer rows (prefill), when the launch has at most TILE_ROWS rows in order
//       and its tile state has room: cut into tiles, one block step each, spread over
//       the grid, each learning the chain's state before it by a look-back
//       (write_tiles.cuh: plan_tiles decides, write_tiles, finish_tiles);
//     longer rows of any other launch: a block each, block step after block step
//       (scan_row_block, section "block steps", whose steps the tiles use too).
// write_tokens, at the end, gives each row its route, then runs phase B and adds the
// counters. Its kLong = false instances (the host's choice for scan-chain inputs of at most
// WARP_ROW_MAX tokens) hold only the warp route, and none of the long routes' shared memory
// and registers (a decode write at bs 1 and 64 is 0.5-0.9 us faster so: bench/README.md).
#include "kvcanary_common.cuh"

namespace kvc {

// Bits of `widths`: which token inputs are int64 (else int32), and which of the
// optional expected inputs are given.
inline constexpr int W_IDS = 0, W_POS = 1, W_LOC = 2, W_ETOK = 3, W_EPOS = 4, HAS_ETOK = 5, HAS_EPOS = 6;

struct WriteArgs {
    i64* records;  // [num_slots, 4]
    i64 num_slots;
    const i64* offsets;  // write plan [max_batch + 1]
    const i64* seeds;    // [max_batch]
    const i64* num_rows;
    const i64* position_check;
    i64 max_batch;
    const void* input_ids;  // [>= avail]
    const void* positions;
    const void* out_cache_loc;
    const void* exp_tokens;     // used if widths has HAS_ETOK
    const void* exp_positions;  // used if widths has HAS_EPOS
    i64 widths;
    i64 avail;  // the shortest token input
    i64* ring;
    i64* head;
    i64 ring_capacity;
    i64* counters;  // [NUM_COUNTERS]
    i64 tag;
    const i64* folds;  // or null
    i64 num_folds;
    i64* tiles;  // the scan chain's tile state (see write_tiles), or null: long rows a block each
    i64 tile_cap;   // tiles it has room for
    i64 table_cap;  // words of each of its hash tables (a power of two >= 64)
};

// A row's span and seed, checked: false (and a violation row from the caller's
// lane 0 when `report`) for a reversed or out-of-range span or a seed outside
// the canary; false and nothing reported for a row the plan skipped (it counted it).
__device__ __forceinline__ bool row_ok(const WriteArgs& a, i64 r, i64 o0, i64 o1, i64 seed, bool report) {
    if (seed == SEED_SKIP) return false;  // uniform over the caller's warp: one row
    const bool span_bad = o0 < 0 || o1 > a.avail || o1 < o0;  // a reversed span: a forged plan
    const bool seed_bad = !span_bad && (seed < -1 || seed >= a.num_slots);
    if (report)
        append_violation(a.ring, a.head, a.ring_capacity, lane_id() == 0 && (span_bad || seed_bad), a.tag,
                         span_bad ? -1 : seed, -1, -1, -1, 0, 0,
                         span_bad ? FAIL_INPUT_OUT_OF_RANGE : FAIL_SLOT_OUT_OF_RANGE, r, -1,
                         write_detail(-1, -1, o0, o1, a.avail));
    return !span_bad && !seed_bad && o1 > o0;
}

// --- sglang chain (kScan false, format v1): a warp per row, serial -------------------
// One warp per write row (grid-stride). The chain is serial by definition; the warp
// loads 32 tokens at a time, coalesced, and every lane runs the same chain over them
// in lockstep (values broadcast by shuffles), keeping the link of its own token. Then
// all lanes check and store in parallel. Within a batch of 32 a slot written twice is
// stored only by its last token (match_any), and __syncwarp orders batches, so the
// last write of a slot in a row wins, as in the reference.
template <bool kFp>
__device__ __forceinline__ void chain_row(const WriteArgs& a, i64 r, i64 o0, i64 o1, i64 seed, bool check_pos,
                                          i64& written, i64& skipped) {
    const unsigned lane = lane_id();
    const bool w_ids = width_bit(a.widths, W_IDS), w_pos = width_bit(a.widths, W_POS),
               w_loc = width_bit(a.widths, W_LOC);
    u64 running = ANCHOR_HASH;
    i64 prev = 0;
    bool has_prev = false;
    if (seed >= 0) {
        Record s = load_record(a.records, seed);
        running = next_link<false>(s);
        prev = s.position;
        has_prev = true;
    }
    for (i64 b = o0; b < o1; b += 32) {
        const i64 i = b + lane;
        const bool in = i < o1;
        const i64 s = in ? load_index(a.out_cache_loc, w_loc, i) : -1;
        const i64 t = in ? load_index(a.input_ids, w_ids, i) : 0;
        const i64 p = in ? load_index(a.positions, w_pos, i) : 0;
        u64 my_link = 0;
        i64 my_prev = 0;
        bool my_has_prev = false;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const i64 sj = __shfl_sync(FULL_MASK, s, j);
            if (sj >= 0) {  // warp-uniform: a negative slot is skipped, the chain does not advance
                const i64 tj = __shfl_sync(FULL_MASK, t, j);
                const i64 pj = __shfl_sync(FULL_MASK, p, j);
                if ((int)lane == j) {
                    my_link = running;
                    my_prev = prev;
                    my_has_prev = has_prev;
                }
                running = mix3(running, tj, pj);
                prev = pj;
                has_prev = true;
            }
        }
        const bool stored = in && s >= 0;
        i64 bits = 0, etok = -1, epos = -1;
        if (stored) {
            if (check_pos && my_has_prev) {
                if (position_breaks(my_prev, p, epos)) bits |= FAIL_WRITE_POSITION;
            }
            if (width_bit(a.widths, HAS_ETOK)) {
                etok = load_index(a.exp_tokens, width_bit(a.widths, W_ETOK), i);
                if (etok != -1 && etok != t) bits |= FAIL_WRITE_TOKEN;
            }
            if (width_bit(a.widths, HAS_EPOS)) {
                const i64 ep = load_index(a.exp_positions, width_bit(a.widths, W_EPOS), i);
                if (ep != -1) {
                    epos = ep;
                    if (ep != p) bits |= FAIL_WRITE_POSITION;
                }
            }
            if (s >= a.num_slots) bits |= FAIL_SLOT_OUT_OF_RANGE;
        }
        const bool store = stored && s < a.num_slots;
        const unsigned same = __match_any_sync(FULL_MASK, store ? s : -1 - (i64)lane);
        if (store && (same & lanes_above(lane)) == 0u) {
            longlong2* rec = (longlong2*)(a.records + s * RECORD_WORDS);
            rec[0] = make_longlong2(t, p);
            if (kFp) a.records[s * RECORD_WORDS + FIELD_LINK] = (i64)my_link;  // phase B stores field 3
            else rec[1] = make_longlong2((i64)my_link, 0);
        }
        written += __popc(__ballot_sync(FULL_MASK, store));
        skipped += __popc(__ballot_sync(FULL_MASK, in && s < 0));
        append_violation(a.ring, a.head, a.ring_capacity, bits != 0, a.tag, s, p, t, etok, my_link, my_link, bits, r,
                         epos, write_detail(i, my_has_prev ? my_prev : -1, o0, o1, a.avail));
        __syncwarp();
    }
}

// --- scan chain (kScan true, format v2) ----------------------------------------------
// Each stored token is the affine map x -> SCAN_MUL x + scan_term(token, position)
// mod P61 (a skipped token the identity), so a row's links are a prefix scan of maps:
// per 32 tokens a warp scan over shuffles, chunk after chunk a carried map. Rows of at
// most WARP_ROW_MAX tokens (decode, speculative steps) take a warp each; longer rows
// (prefill) go by block steps, whose warps scan 32 x SCAN_ITEMS tokens apiece and
// combine their maps through shared memory. A launch of at most TILE_ROWS rows in
// order spreads its long rows' block steps (tiles) over the grid, each tile learning
// the state before it by a look-back (see write_tiles); any other launch gives a long
// row one block, step after step. Within a row the last write of a slot wins, as in
// the reference: a warp settles its own duplicates with match_any, a block step its
// warps' through a shared-memory table of the highest token index per slot, and
// tiles theirs through a launch-wide one.
// Rows longer than KVC_WARP_ROW_MAX tokens take a block; a block step covers
// KVC_SCAN_ITEMS chunks of 32 tokens per warp.
#ifndef KVC_WARP_ROW_MAX
#define KVC_WARP_ROW_MAX 128
#endif
#ifndef KVC_SCAN_ITEMS
#define KVC_SCAN_ITEMS 1
#endif
inline constexpr i64 WARP_ROW_MAX = KVC_WARP_ROW_MAX;
inline constexpr int SCAN_ITEMS = KVC_SCAN_ITEMS;
inline constexpr int MAX_WARPS = 8;       // blockDim.x <= 256
inline constexpr int DEDUPE_SLOTS = 2 * MAX_WARPS * 32 * SCAN_ITEMS;  // twice a block step's tokens
inline constexpr u64 EMPTY_KEY = ~0ULL;

// Where a chain stands after some tokens, as a map of what it stood at before:
// x -> a x + b mod P61, and the position of the last stored token (has: any).
struct ChainMap {
    u64 a, b;
    i64 pos;
    int has;
};

__device__ __forceinline__ ChainMap identity_map() { return ChainMap{1, 0, 0, 0}; }

// `later` after `first`.
__device__ __forceinline__ ChainMap then(const ChainMap& first, const ChainMap& later) {
    ChainMap r;
    r.a = mulmod61(later.a, first.a);
    r.b = reduce61(mulmod61(later.a, first.b) + later.b);
    r.has = first.has | later.has;
    r.pos = later.has ? later.pos : first.pos;
    return r;
}

__device__ __forceinline__ u64 apply_map(const ChainMap& m, u64 x) { return reduce61(mulmod61(m.a, x) + m.b); }

// The map lane `src` holds (src mod 32). Every lane of the warp must call it.
__device__ __forceinline__ ChainMap shfl_map(const ChainMap& m, unsigned src) {
    return ChainMap{__shfl_sync(FULL_MASK, m.a, src & 31u), __shfl_sync(FULL_MASK, m.b, src & 31u),
                    __shfl_sync(FULL_MASK, m.pos, src & 31u), __shfl_sync(FULL_MASK, m.has, src & 31u)};
}

// One chunk of 32 consecutive tokens of a row, a token per lane.
struct ScanChunk {
    i64 i, s, t, p;  // token index, slot, token id, position
    bool in;         // i lies in the row
    ChainMap before;  // the chunk's tokens below this lane, composed
};

// Loads a lane's token of a chunk (the loads of several chunks are issued before
// any is scanned, so their latencies overlap).
__device__ __forceinline__ void load_chunk(const WriteArgs& a, i64 i, i64 o1, ScanChunk& c) {
    c.i = i;
    c.in = i < o1;
    c.s = c.in ? load_index(a.out_cache_loc, width_bit(a.widths, W_LOC), i) : -1;
    c.t = c.in ? load_index(a.input_ids, width_bit(a.widths, W_IDS), i) : 0;
    c.p = c.in ? load_index(a.positions, width_bit(a.widths, W_POS), i) : 0;
}

// SCAN_MUL^k mod P61 for k = 0..32: within a chunk a map is x -> SCAN_MUL^k x + b, with k
// the chunk's stored tokens so far, so composing two costs one multiply, not two.
__constant__ u64 MUL_POW[33] = {
    0x0000000000000001ULL,
    0x1BD238973A2B1490ULL,
    0x1978F2F7811F0F65ULL,
    0x1C874B5DDE0E42C7ULL,
    0x0121BEF6B432EA24ULL,
    0x09EE6244957F8F9CULL,
    0x016ADB1B614AD81DULL,
    0x014EF94321DDDEEAULL,
    0x09915018A7E5B688ULL,
    0x0A7B1A42CF0A4EC1ULL,
    0x0E2A7EB8E363D7FBULL,
    0x1EBAC25DC76C34E8ULL,
    0x0A991448C8ED0BC0ULL,
    0x1C8B43CE83CB01E0ULL,
    0x04E688B9E51EF154ULL,
    0x1AB35ACB92A2F4D4ULL,
    0x14310CB207D3CB2EULL,
    0x11EB49CD49097EE1ULL,
    0x05A6454615D959E3ULL,
    0x0FA66F7D36DE9376ULL,
    0x0ABD2C184679FE1BULL,
    0x0FED20C9A11F5D12ULL,
    0x1EC9E6F5535A642EULL,
    0x0A7054D2AF8BC4CCULL,
    0x1BE262D2447B32CDULL,
    0x17156F19013F17F2ULL,
    0x0441BE2641ADB78EULL,
    0x10F21A93D21B09F3ULL,
    0x17E289E3ECE4F020ULL,
    0x0DBCB7B14241A6C9ULL,
    0x1D5300002BD4445FULL,
    0x023B403F39C3D404ULL,
    0x0229BB5A83201732ULL
};

// Scans a loaded chunk's maps; returns the whole chunk's map (every lane). `pow`:
// MUL_POW in shared memory (lanes index it at different k). The chunk's tokens in the row
// are its lanes 0..n-1, so the scan takes only the steps whose distance is below n: a
// decode row's one token takes none (lanes n and up, outside the row, are left unscanned
// and never stored), and the whole chunk's map is lane n - 1's.
__device__ __forceinline__ ChainMap scan_chunk(ScanChunk& c, const u64* pow) {
    const unsigned lane = lane_id();
    const int n = __popc(__ballot_sync(FULL_MASK, c.in));
    const bool kept = c.s >= 0;
    int k = kept ? 1 : 0, has = k;
    u64 b = kept ? scan_term(c.t, c.p) : 0;
    i64 pos = c.p;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {  // inclusive scan over the lanes: (k, b) after (k', b')
        if (d >= n) break;  // warp-uniform
        const int bk = __shfl_up_sync(FULL_MASK, k, d), bh = __shfl_up_sync(FULL_MASK, has, d);
        const u64 bb = __shfl_up_sync(FULL_MASK, b, d);
        const i64 bp = __shfl_up_sync(FULL_MASK, pos, d);
        if (lane >= (unsigned)d) {
            b = reduce61(mulmod61(pow[k], bb) + b);
            k += bk;
            if (!has) pos = bp;
            has |= bh;
        }
    }
    c.before = identity_map();
    if (n > 1) {
        const int ek = __shfl_up_sync(FULL_MASK, k, 1), eh = __shfl_up_sync(FULL_MASK, has, 1);
        const u64 eb = __shfl_up_sync(FULL_MASK, b, 1);
        const i64 ep = __shfl_up_sync(FULL_MASK, pos, 1);
        if (lane > 0) c.before = ChainMap{pow[ek], eb, ep, eh};
    }
    const unsigned top = n > 0 ? (unsigned)(n - 1) : 0u;
    return ChainMap{pow[__shfl_sync(FULL_MASK, k, top)], __shfl_sync(FULL_MASK, b, top),
                    __shfl_sync(FULL_MASK, pos, top), __shfl_sync(FULL_MASK, has, top)};
}

// The chunk's links from the chain's state before it (x, and the previous stored
// position if any), its checks, stores and violation rows. `last` says whether
// this lane's token is the last write of its slot (decided by the caller).
template <bool kFp>
__device__ __forceinline__ void store_chunk(const WriteArgs& a, const ScanChunk& c, u64 x, int has_prev, i64 prev,
                                            bool check_pos, i64 r, bool last, i64& written, i64& skipped) {
    const u64 my_link = apply_map(c.before, x);
    const bool my_has_prev = c.before.has || has_prev;
    const i64 my_prev = c.before.has ? c.before.pos : prev;
    const bool stored = c.in && c.s >= 0;
    i64 bits = 0, etok = -1, epos = -1;
    if (stored) {
        if (check_pos && my_has_prev) {
            if (position_breaks(my_prev, c.p, epos)) bits |= FAIL_WRITE_POSITION;
        }
        if (width_bit(a.widths, HAS_ETOK)) {
            etok = load_index(a.exp_tokens, width_bit(a.widths, W_ETOK), c.i);
            if (etok != -1 && etok != c.t) bits |= FAIL_WRITE_TOKEN;
        }
        if (width_bit(a.widths, HAS_EPOS)) {
            const i64 ep = load_index(a.exp_positions, width_bit(a.widths, W_EPOS), c.i);
            if (ep != -1) {
                epos = ep;
                if (ep != c.p) bits |= FAIL_WRITE_POSITION;
            }
        }
        if (c.s >= a.num_slots) bits |= FAIL_SLOT_OUT_OF_RANGE;
    }
    const bool store = stored && c.s < a.num_slots;
    if (store && last) {
        longlong2* rec = (longlong2*)(a.records + c.s * RECORD_WORDS);
        rec[0] = make_longlong2(c.t, c.p);
        if (kFp) a.records[c.s * RECORD_WORDS + FIELD_LINK] = (i64)my_link;  // phase B stores field 3
        else rec[1] = make_longlong2((i64)my_link, 0);
    }
    written += __popc(__ballot_sync(FULL_MASK, store));
    skipped += __popc(__ballot_sync(FULL_MASK, c.in && c.s < 0));
    // The row's span, for its rows only: the callers' spans are not at hand in every route.
    const bool has = bits != 0;
    const i64 o0 = has ? a.offsets[r] : -1, o1 = has ? a.offsets[r + 1] : -1;
    append_violation(a.ring, a.head, a.ring_capacity, has, a.tag, c.s, c.p, c.t, etok, my_link, my_link, bits, r,
                     epos, write_detail(c.i, my_has_prev ? my_prev : -1, o0, o1, a.avail));
}

// The chain's state before a row's first token: its seed record's successor link
// and position, or the first link and no position.
__device__ __forceinline__ void seed_state(const WriteArgs& a, i64 seed, u64& x, int& has, i64& pos) {
    x = SCAN_ANCHOR;
    has = 0;
    pos = 0;
    if (seed >= 0) {
        const Record s = load_record(a.records, seed);
        x = next_link<true>(s);
        has = 1;
        pos = s.position;
    }
}

// --- scan chain, rows of at most WARP_ROW_MAX tokens: a warp each --------------------
// A row of at most WARP_ROW_MAX tokens, by one warp, 32 tokens at a time (a kLong = false
// instance gives it rows of any length). The next chunk's loads are issued before this
// chunk is scanned: a chunk's scan is a long dependent sequence of 61-bit products, and
// the loads' latency hides behind it (8 rows of 128 tokens: 13.6-13.9 to 12.5-12.6 us a
// launch on an H200; one chunk, a decode row, issues no extra load).
template <bool kFp>
__device__ __forceinline__ void scan_row_warp(const WriteArgs& a, i64 r, i64 o0, i64 o1, i64 seed, bool check_pos,
                                              const u64* pow, i64& written, i64& skipped) {
    const unsigned lane = lane_id();
    ScanChunk c, next;
    load_chunk(a, o0 + lane, o1, c);  // before the seed record: both loads in flight at once
    u64 x;
    int has;
    i64 pos;
    seed_state(a, seed, x, has, pos);
    for (i64 b = o0; b < o1; b += 32) {
        if (b + 32 < o1) load_chunk(a, b + 32 + lane, o1, next);
        const ChainMap all = scan_chunk(c, pow);
        const bool store = c.in && c.s >= 0 && c.s < a.num_slots;
        // Among this chunk's writes of one slot, the highest lane's wins; __syncwarp
        // orders the chunks, so the row's last write of a slot wins.
        const unsigned same = __match_any_sync(FULL_MASK, store ? c.s : -1 - (i64)lane);
        store_chunk<kFp>(a, c, x, has, pos, check_pos, r, (same & lanes_above(lane)) == 0u, written, skipped);
        if (b + 32 < o1) {  // the chain's state after this chunk, for the next one
            x = apply_map(all, x);
            if (all.has) {
                has = 1;
                pos = all.pos;
            }
            __syncwarp();
            c = next;
        }
    }
}

// --- scan chain, block steps: a longer row by one block (tiles: by the grid) ---------
// Shared memory of the block path: the warps' maps of a block step, and the
// last-write table (slot -> highest token index of the step that writes it).
struct ScanShared {
    u64 pow[33];  // MUL_POW
    ChainMap maps[MAX_WARPS];
    ChainMap below[MAX_WARPS + 1];  // the maps of warps 0..w-1 composed; below[nwarps]: the step's
    u64 keys[DEDUPE_SLOTS];
    int last[DEDUPE_SLOTS];
    u64 x;  // a tile's chain state before it (look-back's result)
    i64 pos;
    int has;
};

__device__ __forceinline__ ScanShared& scan_shared() {
    __shared__ ScanShared sh;
    return sh;
}

__device__ __forceinline__ unsigned dedupe_hash(i64 slot) {
    return (unsigned)(splitmix64((u64)slot) & (u64)(DEDUPE_SLOTS - 1));
}

// Enters slot s written by token k of the step; returns the table index it took.
__device__ __forceinline__ unsigned dedupe_enter(ScanShared& sh, i64 s, int k) {
    unsigned h = dedupe_hash(s);
    for (;;) {  // at most half the table is ever full: a free or matching entry is found
        const u64 prev = atomicCAS(&sh.keys[h], EMPTY_KEY, (u64)s);
        if (prev == EMPTY_KEY || prev == (u64)s) {
            atomicMax(&sh.last[h], k);
            return h;
        }
        h = (h + 1) & (DEDUPE_SLOTS - 1);
    }
}

// One block step of a long row: tokens [base, base + blockDim.x * SCAN_ITEMS) below
// o1, warp w the w-th run of 32 * SCAN_ITEMS of them.
struct BlockStep {
    ScanChunk c[SCAN_ITEMS];
    ChainMap all[SCAN_ITEMS];  // each chunk's map
    unsigned entry[SCAN_ITEMS];  // its token's last-write table entry
};

__device__ __forceinline__ bool stores(const WriteArgs& a, const ScanChunk& c) {
    return c.in && c.s >= 0 && c.s < a.num_slots;
}

// Loads and scans a block step, publishes each warp's map in sh.maps and enters its
// stored slots in the last-write table. The caller syncs the block before reading either.
__device__ __forceinline__ void scan_step(const WriteArgs& a, i64 base, i64 o1, ScanShared& sh, BlockStep& st) {
    const unsigned lane = lane_id(), warp = threadIdx.x >> 5;
    const i64 w0 = base + (i64)warp * 32 * SCAN_ITEMS;
#pragma unroll
    for (int j = 0; j < SCAN_ITEMS; ++j) load_chunk(a, w0 + j * 32 + lane, o1, st.c[j]);
#pragma unroll
    for (int j = 0; j < SCAN_ITEMS; ++j) st.all[j] = scan_chunk(st.c[j], sh.pow);
    ChainMap mine = st.all[0];
#pragma unroll
    for (int j = 1; j < SCAN_ITEMS; ++j) mine = then(mine, st.all[j]);
    if (lane == 0) sh.maps[warp] = mine;
#pragma unroll
    for (int j = 0; j < SCAN_ITEMS; ++j)
        st.entry[j] = stores(a, st.c[j]) ? dedupe_enter(sh, st.c[j].s, (int)(st.c[j].i - base)) : 0u;
}

// Whether a token of the step is the step's last write of its slot (after the
// barrier that follows scan_step).
__device__ __forceinline__ bool last_in_step(const WriteArgs& a, const ScanShared& sh, const BlockStep& st, int j,
                                             i64 base) {
    return stores(a, st.c[j]) && sh.last[st.entry[j]] == (int)(st.c[j].i - base);
}

// sh.below from sh.maps, by warp 0 (a scan over its lanes, one warp's map each) after
// the barrier that follows scan_step; the block syncs again before reading it.
__device__ __forceinline__ void scan_warp_maps(ScanShared& sh) {
    const unsigned lane = lane_id(), nwarps = blockDim.x >> 5;
    ChainMap m = lane < nwarps ? sh.maps[lane] : identity_map();
    for (int d = 1; d < MAX_WARPS; d <<= 1) {
        const ChainMap o = shfl_map(m, lane - d);
        if (lane >= (unsigned)d) m = then(o, m);
    }
    if (lane < nwarps) sh.below[lane + 1] = m;
    if (lane == 0) sh.below[0] = identity_map();
}

// Stores a scanned block step from the chain's state before it (x, has, pos); keep[j]:
// chunk j's token stores its record (its slot's last write).
template <bool kFp>
__device__ __forceinline__ void store_step(const WriteArgs& a, const ScanShared& sh, const BlockStep& st, u64 x,
                                           int has, i64 pos, const bool (&keep)[SCAN_ITEMS], bool check_pos, i64 r,
                                           i64& written, i64& skipped) {
    // The chain's state before this warp's run: the step's start, then the warps below.
    const ChainMap below = sh.below[threadIdx.x >> 5];
    u64 xw = apply_map(below, x);
    int hw = has | below.has;
    i64 pw = below.has ? below.pos : pos;
#pragma unroll
    for (int j = 0; j < SCAN_ITEMS; ++j) {
        store_chunk<kFp>(a, st.c[j], xw, hw, pw, check_pos, r, keep[j], written, skipped);
        xw = apply_map(st.all[j], xw);
        if (st.all[j].has) {
            hw = 1;
            pw = st.all[j].pos;
        }
    }
}

// Empties the step's last-write table entries; the caller syncs the block before and after.
__device__ __forceinline__ void clear_step(const WriteArgs& a, ScanShared& sh, const BlockStep& st) {
#pragma unroll
    for (int j = 0; j < SCAN_ITEMS; ++j) {
        if (stores(a, st.c[j])) {
            sh.keys[st.entry[j]] = EMPTY_KEY;
            sh.last[st.entry[j]] = -1;
        }
    }
}

// A row longer than WARP_ROW_MAX tokens, by the whole block, one block step after
// another. Every thread of the block must call it with the same row.
template <bool kFp>
__device__ void scan_row_block(const WriteArgs& a, i64 r, i64 o0, i64 o1, i64 seed, bool check_pos, ScanShared& sh,
                               i64& written, i64& skipped) {
    const unsigned nwarps = blockDim.x >> 5;
    const i64 step_tokens = (i64)blockDim.x * SCAN_ITEMS;
    u64 x;
    int has;
    i64 pos;
    seed_state(a, seed, x, has, pos);
    for (i64 base = o0; base < o1; base += step_tokens) {
        BlockStep st;
        scan_step(a, base, o1, sh, st);
        __syncthreads();
        if (threadIdx.x < 32) scan_warp_maps(sh);
        __syncthreads();
        bool keep[SCAN_ITEMS];
#pragma unroll
        for (int j = 0; j < SCAN_ITEMS; ++j) keep[j] = last_in_step(a, sh, st, j, base);
        store_step<kFp>(a, sh, st, x, has, pos, keep, check_pos, r, written, skipped);
        const ChainMap step = sh.below[nwarps];
        x = apply_map(step, x);
        if (step.has) {
            has = 1;
            pos = step.pos;
        }
        __syncthreads();  // every lookup and map read is done: empty the table for the next step
        clear_step(a, sh, st);
        __syncthreads();
    }
}

// --- tiles: a launch's long rows split over the grid: write_tiles.cuh ----------------
// The sizes of the tiles' launch state (the backend's twins: WRITE_TILE_ROWS,
// TILE_STATE_WORDS, TILE_DATA_WORDS); write_tiles.cuh describes the state.
inline constexpr int TILE_ROWS = 256;
inline constexpr i64 TILE_STATE_WORDS = 4;
inline constexpr i64 TILE_DATA_WORDS = 8;  // the tile's map (a, b, pos, has); the state after it (x, has, pos)

}  // namespace kvc

#include "write_tiles.cuh"

namespace kvc {

// --- the launch: each row to its route, then phase B and the counters ----------------
// Phase B, fingerprints (kFp): grid-stride over all input tokens, g lanes per
// token; each token finds its row by binary search over the write offsets
// (non-decreasing as plan() writes them) and stores field 3 of its
// record. A long prefill row is thus fingerprinted by the whole grid, not
// by its warp.
// Counters: each warp sums the slots it wrote and the tokens of its rows that
// a negative slot skips, its block adds them up in shared memory and each with
// one atomic at the end; block 0 adds the run, and one to writes_skipped when
// the plan was never planned.

// What a write launch takes: the write, and a digest (d.out null: none) that one
// extra block, the grid's last, computes beside it (a step's tensor-parallel
// agreement: one launch less on the step's critical path). The digest must not
// read what the write changes (the records, the log): it runs concurrently.
struct WriteStepArgs {
    WriteArgs w;
    DigestArgs d;
};

// kLong: the launch's inputs may hold rows longer than WARP_ROW_MAX tokens (the scan chain
// then gives them blocks or tiles). Without it (the host's choice for inputs of at most
// WARP_ROW_MAX tokens: decode and speculative steps) every row takes the warp route, which
// walks a row of any length chunk by chunk, and the launch holds none of the long routes'
// shared memory.
template <bool kFp, bool kScan, bool kLong>
__global__ void __launch_bounds__(256, kFp ? KVC_FP_MIN_BLOCKS : 2) write_tokens(WriteStepArgs step) {
    const WriteArgs& a = step.w;
    // The write's own blocks: every block but the digest's.
    const unsigned blocks = gridDim.x - (step.d.out != nullptr ? 1u : 0u);
    if (blockIdx.x >= blocks) {
        digest_block(step.d, 0, 1);
        return;
    }
    // Rows by round: in round k, warp w of block b takes row b + blocks * (w + warps_per_block * k),
    // so consecutive rows (a prefill's long ones) land in different blocks. The first
    // round's plan words are loaded before the row count is known: both loads in flight at once.
    const unsigned lane = lane_id(), warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    i64 r = (i64)blockIdx.x + (i64)blocks * warp;
    i64 o0 = 0, o1 = 0, seed = -1;
    if (r < a.max_batch) {
        o0 = a.offsets[r];
        o1 = a.offsets[r + 1];
        seed = a.seeds[r];
    }
    const i64 planned_rows = *a.num_rows;  // < 0: the plan was never planned
    i64 nrows = planned_rows;
    if (nrows > a.max_batch) nrows = a.max_batch;
    if (nrows < 0) nrows = 0;
    const bool check_pos = *a.position_check != 0;
    const i64 warp0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 warps = ((i64)blocks * blockDim.x) >> 5;
    const i64 N = a.num_slots;

    __shared__ u64 s_counts[2];  // the block's slots written and tokens skipped
    __shared__ i64 s_long[MAX_WARPS];  // a round's long rows (scan chain), one per warp or -1
    if (threadIdx.x < 2) s_counts[threadIdx.x] = 0;
    // A row is no longer than the inputs, so short inputs (a decode step) have no long rows
    // and no block-wide step.
    constexpr bool kLongScan = kScan && kLong;
    const bool long_rows = kLongScan && a.avail > WARP_ROW_MAX;
    __shared__ TileRows s_tiles;
    TileLaunch tl;
    bool tiled = false;
    const u64* pow = nullptr;  // MUL_POW in shared memory (scan chain)
    if constexpr (kLongScan) {
        tiled = long_rows && plan_tiles(a, nrows, (i64)blockDim.x * SCAN_ITEMS, s_tiles, tl);
        ScanShared& sh = scan_shared();
        for (int k = threadIdx.x; a.avail > WARP_ROW_MAX && k < DEDUPE_SLOTS; k += blockDim.x) {
            sh.keys[k] = EMPTY_KEY;  // the long rows' last-write table
            sh.last[k] = -1;
        }
        if (threadIdx.x < 33) sh.pow[threadIdx.x] = MUL_POW[threadIdx.x];
        pow = sh.pow;
    } else if constexpr (kScan) {
        __shared__ u64 s_pow[33];  // a thread a word: the host's blocks have 128 or 256 threads
        if (threadIdx.x < 33) s_pow[threadIdx.x] = MUL_POW[threadIdx.x];
        pow = s_pow;
    }
    __syncthreads();

    i64 written = 0, skipped = 0;  // the same in every lane of a warp
    const i64 per_round = (i64)blocks * nwarps;
    const i64 rounds = (nrows + per_round - 1) / per_round;  // the same in every thread of the block
    for (i64 k = 0; k < rounds; ++k, r += per_round) {
        if (k > 0 && r < nrows) {
            o0 = a.offsets[r];
            o1 = a.offsets[r + 1];
            seed = a.seeds[r];
        }
        bool is_long = false;
        if (r < nrows && row_ok(a, r, o0, o1, seed, true)) {
            if (!kScan) chain_row<kFp>(a, r, o0, o1, seed, check_pos, written, skipped);
            else if (!kLong || o1 - o0 <= WARP_ROW_MAX) scan_row_warp<kFp>(a, r, o0, o1, seed, check_pos, pow,
                                                                           written, skipped);
            else is_long = !tiled;  // tiled: write_tiles takes it
        }
        if constexpr (kLongScan) {
            if (long_rows && !tiled) {  // the round's long rows, one after another, each by the whole block
                if (lane == 0) s_long[warp] = is_long ? r : -1;
                __syncthreads();
                for (unsigned w = 0; w < nwarps; ++w) {
                    const i64 rl = s_long[w];
                    if (rl >= 0) scan_row_block<kFp>(a, rl, a.offsets[rl], a.offsets[rl + 1], a.seeds[rl],
                                                     check_pos, scan_shared(), written, skipped);
                }
                __syncthreads();  // s_long is written again next round
            }
        }
    }

    if constexpr (kLongScan) {
        if (tiled) {
            write_tiles<kFp>(a, s_tiles, nrows, tl, blocks, check_pos, scan_shared(), written, skipped);
            finish_tiles(a, tl, blocks);
        }
    }

    if (kFp && nrows > 0) {
        // Every input token, each finding its row; tokens in no live row are skipped.
        const bool w_loc = width_bit(a.widths, W_LOC);
        const i64 n = a.avail;
        const int g = lanes_per_fingerprint(n, a.num_folds);
        const int shift = __ffs(g) - 1;
        const i64 total = n << shift;
        for (i64 base = warp0 << 5; base < total; base += warps << 5) {
            const i64 q = base + lane;
            const i64 i = q >> shift;
            i64 s = 0;
            bool need = false;
            if (q < total) {
                // The last row starting at or before i (searching starts only keeps a
                // forged last offset from hiding the rows before it).
                const i64 r = row_of(a.offsets, nrows, i);
                if (r >= 0 && r < nrows) {
                    const i64 o0 = a.offsets[r], o1 = a.offsets[r + 1], seed = a.seeds[r];
                    if (o0 >= 0 && o1 <= a.avail && seed >= -1 && seed < N && o0 <= i && i < o1) {
                        s = load_index(a.out_cache_loc, w_loc, i);
                        need = s >= 0 && s < N;
                    }
                }
            }
            const u64 f = fingerprint(a.folds, a.num_folds, s, need, g);
            if (need && (q & (g - 1)) == 0) a.records[s * RECORD_WORDS + FIELD_FINGERPRINT] = (i64)f;
        }
    }

    // The counters: the block's warps add in shared memory, one atomic per counter per block.
    if (lane == 0 && written != 0) atomicAdd(&s_counts[0], (u64)written);
    if (lane == 0 && skipped != 0) atomicAdd(&s_counts[1], (u64)skipped);
    __syncthreads();
    if (threadIdx.x == 0 && s_counts[0] != 0) atomicAdd((u64*)(a.counters + CTR_SLOTS_WRITTEN), s_counts[0]);
    if (threadIdx.x == 0 && s_counts[1] != 0) atomicAdd((u64*)(a.counters + CTR_TOKENS_SKIPPED), s_counts[1]);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd((u64*)(a.counters + CTR_KERNEL_RUNS), 1ULL);
        // A write plan that was never planned writes nothing: count it, so it shows.
        if (planned_rows < 0) atomicAdd((u64*)(a.counters + CTR_WRITES_SKIPPED), 1ULL);
    }
}

}  // namespace kvc
