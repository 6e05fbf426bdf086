// plan.cu: derive a step's verify entries and write metadata on the device.
//
// Two kernels run one body, plan_body: plan_step (plan: stores the verify entries and
// the write plan) and plan_verify_step<kFp, kScan> (plan_and_verify: checks each entry
// against the records where it is derived instead of storing it). step.cu builds on
// this file: its kernel is plan_body with a tail that writes the step's tokens.
//
// Routes: a launch takes one, the same in every block (small_rows decides from the
// rows' inputs alone), and no block ever waits on a block that is not running.
//   small route  (plan_small.cuh) a step of at most SMALL_ROWS rows, a decode
//                step of a few: with a verify plan and no entry digest, no row reading
//                more than SMALL_ROW_MAX positions, and the rows' entries within the
//                plan's capacity and small_max even if every row is valid. Tiles of
//                entries whose warps check or store them on their own, with no
//                grid-wide wait (small_tiles); the last block out then finishes the
//                plan (small_finish, moving plan's entries down with small_compact
//                when a row was unreadable).
//   block route  (section "block route") every other step: the rows, scan and fill
//                phases joined by the launch state, the fill waiting for the scan.
//                Their code is in the section; plan_body runs them in order.
// Shared by both routes, before them: the arguments and the launch state (SYNC_*),
// the table lookups and row checks, the plans' tails, the first input error, and the
// check of one entry (verify.cu's check, as plan_and_verify runs it). After them:
// plan_body (a route, then in the last block out its finish, the first input error
// and the tail) and the kernels.
#include "kvcanary_common.cuh"

namespace kvc {

// Block route, rows phase: 32-bit table lookups per thread in flight (a block per
// row leaves few warps per SM, so latency, not bandwidth, bounds it); half as many
// 64-bit ones.
inline constexpr int ROW_UNROLL = 8;

// --- shared by both routes: arguments, launch state, table lookups, row checks -------

// Bits of `widths`: which index inputs are int64 (else int32).
inline constexpr int W_RPI = 0, W_PRE = 1, W_EXT = 2, W_TABLE = 3, W_LUT = 4, W_ETAB = 5, W_EVL = 6;

struct PlanArgs {
    const void* rpi;  // [bs] request-table row per batch row
    const void* pre;  // [>= bs] prefix lengths
    const void* ext;  // [>= bs] extend lengths
    const void* table;  // [nreq, twidth] token- or page-level slot table
    const void* lut;    // [lut_len] SWA translation (lut_len < 0: no LUT)
    const void* etab;   // [erows, ewidth] expected tokens (erows < 0: none)
    const void* evl;    // [>= bs] expected valid lengths
    i64 widths;
    i64 bs, nreq, twidth, page;
    i64 lut_len;   // -1 without a LUT
    i64 swa_size;  // 0 without a window
    i64 erows;     // -1 without expected tokens
    i64 ewidth, eoffset;
    i64* vp_slot;  // verify plan, or all null
    i64* vp_prev;
    i64* vp_epos;
    i64* vp_etok;
    i64* vp_offsets;  // [vp_max_batch + 1]
    i64* vp_num_valid;
    i64* vp_enable;
    i64* vp_requested;
    i64* vp_input_errors;
    i64* vp_overflows;      // plans whose total exceeded the capacity (cumulative)
    i64* vp_max_requested;  // the largest total any plan asked for (running max)
    i64* vp_first_error;    // [INPUT_ERROR_WORDS] the plan's first input error, or null
    i64 vp_capacity, vp_max_batch;
    i64* wp_offsets;  // write plan, or all null
    i64* wp_seeds;    // [wp_max_batch]
    i64* wp_num_rows;
    i64* wp_input_errors;
    i64 wp_max_batch;
    i64* sync;  // [SYNC_WORDS] launch state, all 0 between launches
    i64 small_max;  // the most entries a step may have to take the small route (0: never)
};

// The launch state of plan_step: rows handed out, rows finished, blocks exited (and,
// in the high word, the small route's warps that found a position unreadable), the entry digest's partial sum
// (plan_and_verify), (a 128-byte line of its own, so that blocks polling it do not slow
// the counters' atomics) the scan published (0 / 1), and per row of the small route: its
// verdict (0, or UNREADABLE once a tile found a position unreadable), the entries its
// tiles counted as checked (plan_and_verify), and, for a tail that writes (step.cu), its
// seed state: the link after its seed record, that record's position and, once published,
// the seed's slot + 1 (0 before). The last block out zeroes it (the seed states: the tail
// that reads them).
inline constexpr int SYNC_ROWS_CLAIMED = 0, SYNC_ROWS_DONE = 1, SYNC_EXITED = 2, SYNC_DIGEST = 3, SYNC_SCANNED = 16;
// bs - r for the first row r whose extend length is out of range (a running max; 0: none).
inline constexpr int SYNC_UNKNOWN_SPAN = 4;
// bs - r for the first live row r that could not be planned (block route; 0: none).
inline constexpr int SYNC_FIRST_ERROR = 5;
inline constexpr int SYNC_VERDICTS = 32;
inline constexpr int SMALL_ROWS = 256;  // rows the small route takes at most
inline constexpr int SYNC_CHECKED = SYNC_VERDICTS + SMALL_ROWS;
inline constexpr int SYNC_SEEDS = SYNC_CHECKED + SMALL_ROWS, SEED_WORDS = 3;
inline constexpr int SYNC_WORDS = 1312;
static_assert(SYNC_WORDS == SYNC_SEEDS + SEED_WORDS * SMALL_ROWS,
              "a verdict, a checked count and a seed state per row of the small route");

inline constexpr i64 I64_MAX = 0x7FFFFFFFFFFFFFFFLL;

// v * page for v, page >= 0, or -1 when the product does not fit int64. The high
// word of the 128-bit product costs one instruction; a division would cost dozens.
__device__ __forceinline__ i64 mul_or_neg(i64 v, i64 page) {
    const u64 lo = (u64)v * (u64)page;
    return (__umul64hi((u64)v, (u64)page) != 0 || (i64)lo < 0) ? -1 : (i64)lo;
}

// The table element that holds position pos of request-table row rp.
__device__ __forceinline__ i64 table_at(const PlanArgs& a, i64 rp, i64 pos) {
    // page == 1 (a token-level table) skips the 64-bit division, dozens of instructions.
    return load_index(a.table, width_bit(a.widths, W_TABLE), rp * a.twidth + (a.page == 1 ? pos : pos / a.page));
}

// T of table element v at position pos, or -1 when unreadable: a negative table
// value, a slot that does not fit int64 (v * page + pos % page > 2**63 - 1:
// wrapping could land on a valid slot), a LUT index outside the LUT or a
// negative LUT value.
__device__ __forceinline__ i64 slot_of_value(const PlanArgs& a, i64 v, i64 pos) {
    if (v < 0) return -1;
    i64 s = v;
    if (a.page != 1) {
        s = mul_or_neg(v, a.page);
        if (s < 0) return -1;
        // Both terms are < 2**63, so their sum fits u64 and overflows int64 iff its sign is set.
        s = (i64)((u64)s + (u64)(pos % a.page));
        if (s < 0) return -1;
    }
    if (a.lut_len >= 0) {
        if (s >= a.lut_len) return -1;
        s = load_index(a.lut, width_bit(a.widths, W_LUT), s);
        if (s < 0) return -1;
    }
    return s;
}

// T(table(rp, pos)), or -1 when unreadable (see slot_of_value).
__device__ __forceinline__ i64 slot_at(const PlanArgs& a, i64 rp, i64 pos) {
    return slot_of_value(a, table_at(a, rp, pos), pos);
}

// Row r reads positions [max(start - 1, 0), P): its window, the window head's
// predecessor and (P > 0) the seed at P - 1, so one pass over that range
// decides validity exactly as the reference does.
__device__ __forceinline__ i64 window_start(const PlanArgs& a, i64 P) {
    return (a.swa_size > 0 && P > a.swa_size) ? P - a.swa_size : 0;
}

// The table's width in positions, saturated: twidth * page may not fit int64.
__device__ __forceinline__ i64 table_width(const PlanArgs& a) {
    const i64 width = mul_or_neg(a.twidth, a.page);
    return width < 0 ? I64_MAX : width;
}

// Whether an extend length can be a row's span of the step's tokens. Every row keeps its
// span in the write plan (the engine's layout) whether or not it stamps it; after a row
// whose length is out of range the layout is unknown, and no later row stamps.
__device__ __forceinline__ bool span_known(const PlanArgs& a, i64 E) { return E >= 0 && E <= table_width(a); }

// Whether row r's scalar inputs are in range (plan_row's first test): a request-table
// row, a prefix and an extend that fit the table's width, and expected tokens for it.
__device__ __forceinline__ bool row_inputs_ok(const PlanArgs& a, i64 rp, i64 P, i64 E) {
    const i64 width = table_width(a);
    bool ok = rp != PADDING_REQ && rp > 0 && rp < a.nreq && P >= 0 && E >= 0 && P <= width && E <= width - P;
    if (a.erows >= 0) ok = ok && rp < a.erows;
    return ok;
}

// The plans' entries past the batch's rows: offsets [bs + 1, max_batch] hold the totals,
// seeds [bs, max_batch) -1. No kernel of this launch reads them, so they are stored off
// the critical path: grid-stride over `blocks` blocks from `block`.
__device__ __forceinline__ void plan_tails(const PlanArgs& a, i64 vtotal, i64 wtotal, i64 block, i64 blocks) {
    const i64 stride = blocks * blockDim.x, first = block * blockDim.x + threadIdx.x;
    if (a.vp_offsets != nullptr)
        for (i64 i = a.bs + 1 + first; i <= a.vp_max_batch; i += stride) a.vp_offsets[i] = vtotal;
    if (a.wp_offsets != nullptr) {
        for (i64 i = a.bs + 1 + first; i <= a.wp_max_batch; i += stride) a.wp_offsets[i] = wtotal;
        for (i64 i = a.bs + first; i < a.wp_max_batch; i += stride) a.wp_seeds[i] = -1;
    }
}

// The verify plan's first input error (INPUT_ERROR_WORDS): row r's inputs and, when they
// are in range, its first unreadable position and that position's table entry; r < 0: none.
// r is uniform over the block; every thread calls it. Runs only on a step with such a row.
__device__ void describe_input_error(const PlanArgs& a, i64 r) {
    if (a.vp_first_error == nullptr) return;
    i64* out = a.vp_first_error;
    if (r < 0) {
        if (threadIdx.x == 0)
            for (int k = 0; k < INPUT_ERROR_WORDS; ++k) out[k] = -1;
        return;
    }
    const i64 rp = load_index(a.rpi, width_bit(a.widths, W_RPI), r);
    const i64 P = load_index(a.pre, width_bit(a.widths, W_PRE), r);
    const i64 E = load_index(a.ext, width_bit(a.widths, W_EXT), r);
    i64 first = I64_MAX;
    if (row_inputs_ok(a, rp, P, E)) {
        const i64 start = window_start(a, P);
        for (i64 pos = (start > 0 ? start - 1 : 0) + threadIdx.x; pos < P && first == I64_MAX; pos += blockDim.x)
            if (slot_at(a, rp, pos) < 0) first = pos;
    }
    // The lowest position any thread found: a block-wide minimum over the threads' firsts.
    __shared__ unsigned long long s_first;
    if (threadIdx.x == 0) s_first = (unsigned long long)I64_MAX;
    __syncthreads();
    if (first != I64_MAX) atomicMin(&s_first, (unsigned long long)first);
    __syncthreads();
    if (threadIdx.x == 0) {
        const i64 pos = s_first == (unsigned long long)I64_MAX ? -1 : (i64)s_first;
        const i64 words[INPUT_ERROR_WORDS] = {r, rp, P, E, pos, pos < 0 ? -1 : table_at(a, rp, pos)};
        for (int k = 0; k < INPUT_ERROR_WORDS; ++k) out[k] = words[k];
    }
}

// --- shared by both routes: plan_and_verify's check of one entry ---------------------
// What plan_verify_step adds to a plan: the canary, the log, the real-KV folds and
// the fingerprint sampler (as in verify.cu's VerifyArgs).
struct CheckArgs {
    const i64* records;  // [num_slots, 4]
    i64 num_slots;
    i64* ring;  // [ring_capacity, VIOLATION_WORDS]
    i64* head;
    i64 ring_capacity;
    i64* counters;  // [NUM_COUNTERS]
    i64 tag;
    i64 check_tokens;
    const i64* folds;  // [num_folds, FOLD_DESC_WORDS], or null
    i64 num_folds;
    i64* sample_state;  // [2] (phase counter, ticket), or null
    i64 period;
    i64* digest;  // [1] receives the digest of the entries, or null (see ENTRY_DIGEST_SALT)
};

struct PlanVerifyArgs {
    PlanArgs p;
    CheckArgs c;
};

// Fingerprints of the 32 lanes' slots with g lanes per slot (see lanes_per_fingerprint):
// round u folds the slots of lanes [u 32/g, (u + 1) 32/g), a group of g lanes each,
// and hands each result back to the lane it belongs to. Every lane must call it.
__device__ __forceinline__ u64 lane_fingerprints(const CheckArgs& c, i64 slot, bool need, int g) {
    if (g == 1) return fingerprint(c.folds, c.num_folds, slot, need, 1);
    const int lane = (int)lane_id(), per = 32 / g;
    u64 mine = 0;
    for (int u = 0; u < g; ++u) {
        const int q = u * per + lane / g;
        const i64 s = __shfl_sync(FULL_MASK, slot, q);
        const bool nd = __shfl_sync(FULL_MASK, (int)need, q) != 0;
        const u64 f = fingerprint(c.folds, c.num_folds, s, nd, g);
        const u64 v = __shfl_sync(FULL_MASK, f, ((lane - u * per) * g) & 31);
        if (lane / per == u) mine = v;
    }
    return mine;
}

// What the check of one entry found: the reasons it fails (0: none) and what its
// violation row holds.
struct EntryCheck {
    i64 bits, pos, tok;
    u64 link, elink;
    u64 fp, efp;  // the record's fingerprint and the live bytes' (the record's when not checked)
};

// verify.cu's check of one entry, for the entry each lane of a warp derived: entries
// of consecutive lanes are consecutive, so a predecessor that is the lane below's
// slot takes its link over a shuffle. Every lane must call it. Returns whether it read
// the entry's record, and that record in *loaded (if given); what it found goes to `out`
// (check_entry appends it; the small route below first asks whether the row is readable).
template <bool kFp, bool kScan>
__device__ __forceinline__ bool entry_check(const CheckArgs& c, bool act, i64 slot, i64 prev, i64 epos, i64 etok,
                                            int g, i64 phase, i64& checked, EntryCheck& out,
                                            Record* loaded = nullptr) {
    const unsigned lane = lane_id();
    const i64 N = c.num_slots;
    // Every active entry is a live row's read: the reserved slot too, which is reported, not read.
    const bool live = act;
    const bool reserved = live && slot == RESERVED_SLOT;
    const bool oor = live && !reserved && (slot < 0 || slot >= N || prev < -1 || prev >= N);
    const bool chk = live && !oor && !reserved;
    // Without sources (kFp false) the expected fingerprint is 0, and it is still checked.
    const bool fp_sel = chk && (phase < 0 || pmod(slot, c.period) == phase);
    const i64 below = __shfl_up_sync(FULL_MASK, chk ? slot : -1, 1);
    const bool prev_below = lane >= 1 && prev > 0 && below == prev;
    Record r = {}, pr = {};
    if (chk) {
        r = load_record(c.records, slot);
        if (prev > 0 && !prev_below) pr = load_record(c.records, prev);
    }
    const u64 plink = predecessor_link<kScan>(r, pr, prev_below, 1);
    u64 fp = 0;
    if (kFp) fp = lane_fingerprints(c, slot, fp_sel, g);
    out = EntryCheck{0, -1, -1, 0, 0, r.fingerprint, fp_sel ? fp : r.fingerprint};
    if (live) {
        ++checked;
        if (reserved) {
            out.bits = FAIL_RESERVED_SLOT;
        } else if (oor) {
            out.bits = FAIL_SLOT_OUT_OF_RANGE;
        } else {
            out.bits = record_failures<kScan>(r, prev, plink, epos, etok, c.check_tokens != 0, fp_sel, fp,
                                              out.elink);
            out.pos = r.position;
            out.tok = r.token;
            out.link = r.link;
        }
    }
    if (loaded != nullptr) *loaded = r;
    return chk;
}

// entry_check, then its violation row.
template <bool kFp, bool kScan>
__device__ __forceinline__ void check_entry(const CheckArgs& c, bool act, i64 row, i64 slot, i64 prev, i64 epos,
                                            i64 etok, int g, i64 phase, i64& checked) {
    EntryCheck x;
    entry_check<kFp, kScan>(c, act, slot, prev, epos, etok, g, phase, checked, x);
    const bool has = x.bits != 0;
    append_violation(c.ring, c.head, c.ring_capacity, has, c.tag, slot, x.pos, x.tok, etok, x.link, x.elink, x.bits,
                     row, epos, entry_detail(prev, prev_position_of(c.records, c.num_slots, has, prev), x.fp, x.efp));
}

// --- block route: rows, scan, fill ---------------------------------------------------
// Every step the small route does not take, in three phases joined by the launch
// state:
//   rows  blocks claim batch rows one at a time (an atomic counter): row
//         validity (every slot the row reads must be readable), entry count,
//         write length and chain seed; counts go into offsets[r + 1].
//   scan  the block that finishes the last row turns the counts into
//         exclusive prefix sums, writes the plan scalars and raises a flag.
//   fill  every block waits for the flag, then each of its warps fills a
//         contiguous run of verify entries: slot, prev slot, position,
//         expected token (plan_and_verify: checks each instead).
// No block waits on a block that is not running: a block reaches the wait only
// after every row has been claimed, and the scanning block is one that holds a
// row. So the grid may exceed what fits on the device, and another kernel
// sharing the device cannot deadlock it. One launch instead of two saves a
// launch's host cost and the gap between kernels.

// Rows phase (ROW_UNROLL above).

// slot_of_value for a token-level table (page 1) without branches: the LUT load is
// predicated, so a loop of these keeps every load in flight at once.
__device__ __forceinline__ i64 token_slot(const PlanArgs& a, i64 v) {
    if (a.lut_len < 0) return v < 0 ? -1 : v;
    const bool in = v >= 0 && v < a.lut_len;
    const i64 s = in ? load_index(a.lut, width_bit(a.widths, W_LUT), v) : -1;
    return s < 0 ? -1 : s;
}

// row_readable for one table width and kind. The loads of a round are issued before any
// is used, and nothing between them branches (NVCC would otherwise convert each int32
// value, or divide by the page, right after its load and wait for it there: a round
// trip per load instead of per round).
template <typename T, bool kToken>
__device__ __forceinline__ bool row_readable_in(const PlanArgs& a, const T* row, i64 lo, i64 P, i64* last) {
    constexpr int U = ROW_UNROLL * 4 / (int)sizeof(T);
    bool bad = false, has_last = false;
    i64 last_slot = -1;
    const i64 step = (i64)blockDim.x * U;
    for (i64 p0 = lo + threadIdx.x; p0 < P; p0 += step) {
        T v[U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const i64 pos = p0 + (i64)j * blockDim.x;
            v[j] = pos < P ? row[kToken ? pos : pos / a.page] : (T)0;
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const i64 pos = p0 + (i64)j * blockDim.x;
            if (pos < P) {
                const i64 s = kToken ? token_slot(a, (i64)v[j]) : slot_of_value(a, (i64)v[j], pos);
                bad |= s < 0;
                if (pos == P - 1) {
                    has_last = true;
                    last_slot = s;
                }
            }
        }
    }
    if (has_last) *last = last_slot;
    return !__syncthreads_or(bad);
}

// Whether every position in [lo, P) of request-table row rp has a readable slot, in
// every thread; the thread that checks position P - 1 stores its slot (or -1) in *last.
// Every thread of the block must call it.
__device__ __forceinline__ bool row_readable(const PlanArgs& a, i64 rp, i64 lo, i64 P, i64* last) {
    const i64 base = rp * a.twidth;
    if (width_bit(a.widths, W_TABLE)) {
        const i64* row = (const i64*)a.table + base;
        return a.page == 1 ? row_readable_in<i64, true>(a, row, lo, P, last)
                           : row_readable_in<i64, false>(a, row, lo, P, last);
    }
    const int* row = (const int*)a.table + base;
    return a.page == 1 ? row_readable_in<int, true>(a, row, lo, P, last)
                       : row_readable_in<int, false>(a, row, lo, P, last);
}

// Row r (thread 0 gets the results): validity, and the counts and seed it stores.
__device__ __forceinline__ void plan_row(const PlanArgs& a, i64 r, i64& errors, i64* seed) {
    i64 rp = load_index(a.rpi, width_bit(a.widths, W_RPI), r);
    i64 P = load_index(a.pre, width_bit(a.widths, W_PRE), r);
    i64 E = load_index(a.ext, width_bit(a.widths, W_EXT), r);
    bool active = rp != PADDING_REQ;
    bool ok = row_inputs_ok(a, rp, P, E);
    i64 start = ok ? window_start(a, P) : 0;
    bool readable = true;
    if (ok) {
        const i64 lo = start > 0 ? start - 1 : 0;
        readable = row_readable(a, rp, lo, P, seed);
    }
    if (threadIdx.x == 0) {
        bool valid = ok && readable;
        if (active && !valid) {  // rare: the last block out describes the first such row
            ++errors;
            atomicMax(a.sync + SYNC_FIRST_ERROR, a.bs - r);
        }
        if (a.vp_offsets != nullptr) a.vp_offsets[r + 1] = valid ? P - start : 0;
        if (a.wp_offsets != nullptr) {
            const bool known = span_known(a, E);
            a.wp_offsets[r + 1] = known ? E : 0;
            a.wp_seeds[r] = !valid ? SEED_SKIP : P > 0 && E > 0 ? *seed : -1;
            // Rare: the scan (plan_skip_after_unknown) skips the rows after the first such row.
            if (!known) atomicMax(a.sync + SYNC_UNKNOWN_SPAN, a.bs - r);
        }
    }
}

// Scan phase.

// In place: a[1..n] holds counts; afterwards a[0] = 0 and a[1..n] the inclusive
// sums. Returns the total (every thread). One block.
__device__ i64 scan_counts(i64* a, i64 n, i64* sh) {
    unsigned t = threadIdx.x, nt = blockDim.x, lane = lane_id(), w = t >> 5;
    i64 per = (n + nt - 1) / nt;
    i64 b = (i64)t * per, e = b + per < n ? b + per : n;
    i64 s = 0;
    for (i64 i = b; i < e; ++i) s += __ldcg(a + 1 + i);
    i64 incl = s;  // inclusive warp scan
    for (int d = 1; d < 32; d <<= 1) {
        i64 v = __shfl_up_sync(FULL_MASK, incl, d);
        if ((int)lane >= d) incl += v;
    }
    __syncthreads();
    if (lane == 31) sh[w] = incl;
    __syncthreads();
    if (t == 0) {
        i64 run = 0;
        for (unsigned i = 0; i < (nt + 31) >> 5; ++i) {
            i64 x = sh[i];
            sh[i] = run;
            run += x;
        }
        sh[32] = run;
    }
    __syncthreads();
    i64 run = sh[w] + incl - s;
    for (i64 i = b; i < e; ++i) {
        run += __ldcg(a + 1 + i);
        a[1 + i] = run;
    }
    i64 total = sh[32];
    if (t == 0) a[0] = 0;
    __syncthreads();
    return total;
}

// After the scan, in the scanning block: the rows after the first whose span is unknown
// stamp nothing; those that would have are counted as the write plan's input errors.
__device__ void plan_skip_after_unknown(const PlanArgs& a, i64* sh) {
    const i64 u = __ldcg(a.sync + SYNC_UNKNOWN_SPAN);
    if (u <= 0) return;  // uniform over the block
    i64 skipped = 0;
    for (i64 r = a.bs - u + 1 + threadIdx.x; r < a.bs; r += blockDim.x) {
        if (__ldcg(a.wp_seeds + r) != SEED_SKIP) {
            a.wp_seeds[r] = SEED_SKIP;
            ++skipped;
        }
    }
    skipped = block_sum(skipped, sh);
    if (threadIdx.x == 0 && skipped != 0 && a.wp_input_errors != nullptr)
        atomicAdd((u64*)a.wp_input_errors, (u64)skipped);
}

// The counts of every row are in: prefix sums and plan scalars. One block; the totals
// go to vtotal / wtotal (for plan_tails, after the scan is published).
__device__ void plan_scan(const PlanArgs& a, i64* sh, i64& vtotal, i64& wtotal) {
    vtotal = wtotal = 0;
    if (a.vp_offsets != nullptr) {
        i64 total = vtotal = scan_counts(a.vp_offsets, a.bs, sh);
        if (threadIdx.x == 0) {
            *a.vp_requested = total;
            *a.vp_num_valid = total < a.vp_capacity ? total : a.vp_capacity;
            *a.vp_enable = total <= a.vp_capacity ? 1 : 0;
            // Atomics whose result is not used: the scan publishes its flag without waiting
            // for a read of either (the other blocks wait on that flag).
            if (total > a.vp_capacity) atomicAdd((u64*)a.vp_overflows, 1ULL);
            atomicMax(a.vp_max_requested, total);
        }
    }
    if (a.wp_offsets != nullptr) {
        wtotal = scan_counts(a.wp_offsets, a.bs, sh);
        if (threadIdx.x == 0) *a.wp_num_rows = a.bs;
        plan_skip_after_unknown(a, sh);
    }
}

// Fill phase.

// The digest of a plan's verify entries, as digest.cu's digest_rows computes it over the
// four entry arrays a plan writes (slot, prev slot, position, token) with these salts,
// the plan's num_valid as their count and its enable as their gate: tensor-parallel
// ranks compare it without the entries ever being written. The twins of
// format.ENTRY_DIGEST_SALTS.
inline constexpr i64 ENTRY_DIGEST_SALT = 1;  // the slot's; prev, position, token: + 1, + 2, + 3

__device__ __forceinline__ u64 entry_digest_term(i64 e, i64 slot, i64 prev, i64 pos, i64 tok) {
    return mix3(ENTRY_DIGEST_SALT, e, slot) + mix3(ENTRY_DIGEST_SALT + 1, e, prev) +
           mix3(ENTRY_DIGEST_SALT + 2, e, pos) + mix3(ENTRY_DIGEST_SALT + 3, e, tok);
}

// What the fill needs of the row a warp is in: its first and end entry, its
// request-pool index and the position of its first entry.
struct FillRow {
    i64 lo, hi, rp, start;
};

__device__ __forceinline__ FillRow fill_row(const PlanArgs& a, const i64* off, i64 row, bool w_rpi, bool w_pre) {
    return FillRow{__ldcg(off + row), __ldcg(off + row + 1), load_index(a.rpi, w_rpi, row),
                   window_start(a, load_index(a.pre, w_pre, row))};
}

// The verify entries, each warp a contiguous run of them, 32 at a time. Offsets
// and plan scalars are read through L2 (__ldcg): another block of this launch
// wrote them. A warp's entries span few rows, so the warp keeps its current row
// and that row's bounds in registers and searches the offsets only when a lane
// lies past the row's end.
template <bool kVerify, bool kFp, bool kScan>
__device__ void plan_fill(const PlanArgs& a, const CheckArgs* c, i64 phase, i64& checked, u64* warp_digest) {
    if (__ldcg(a.vp_enable) != 1) return;
    const i64 n = __ldcg(a.vp_num_valid);
    const int g = kFp ? lanes_per_fingerprint(n, c->num_folds) : 1;
    const i64* off = a.vp_offsets;
    const bool w_rpi = width_bit(a.widths, W_RPI), w_pre = width_bit(a.widths, W_PRE);
    const unsigned lane = lane_id();
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 per_warp = ((n + warps - 1) / warps + 31) & ~(i64)31;
    const i64 first = warp * per_warp;
    const i64 last = first + per_warp < n ? first + per_warp : n;
    if (first >= last) return;
    i64 row = row_of<true>(off, a.bs + 1, first);  // the same in every lane
    FillRow cur = fill_row(a, off, row, w_rpi, w_pre);
    for (i64 base = first; base < last; base += 32) {
        const i64 e = base + lane;
        const bool act = e < last;
        i64 r = row, rp = cur.rp, pos = cur.start + (e - cur.lo), slot = -1;
        if (act && e >= cur.hi) {  // a later row: rare, and only past a row boundary
            r = row + 1 + row_of<true>(off + row + 1, a.bs - row, e);
            const FillRow later = fill_row(a, off, r, w_rpi, w_pre);
            rp = later.rp;
            pos = later.start + (e - later.lo);
        }
        if (act) slot = slot_at(a, rp, pos);
        // The slot at pos - 1 is, but for a row's first entry, the lane below's slot.
        const i64 below_rp = __shfl_up_sync(FULL_MASK, act ? rp : -1, 1);
        const i64 below_pos = __shfl_up_sync(FULL_MASK, pos, 1);
        const i64 below_slot = __shfl_up_sync(FULL_MASK, slot, 1);
        // The row of the warp's last active lane carries over to the next 32 entries.
        const i64 next_row = __shfl_sync(FULL_MASK, r, (int)(last - base < 32 ? last - base - 1 : 31));
        if (next_row != row) {
            row = next_row;
            cur = fill_row(a, off, row, w_rpi, w_pre);
        }
        i64 prev = -1, tok = -1;
        if (act) {
            if (lane > 0 && below_rp == rp && below_pos == pos - 1) prev = below_slot;
            else if (pos > 0) prev = slot_at(a, rp, pos - 1);
            if (a.erows >= 0) {
                i64 k = pos + a.eoffset;
                i64 lim = load_index(a.evl, width_bit(a.widths, W_EVL), r);
                if (lim > a.ewidth) lim = a.ewidth;
                if (k >= 0 && k < lim) tok = load_index(a.etab, width_bit(a.widths, W_ETAB), rp * a.ewidth + k);
            }
        }
        if constexpr (kVerify) {
            // Summed over the warp into shared memory before the check: nothing of it stays live
            // in registers across the check, which is register-bound.
            if (c->digest != nullptr) {
                const u64 t = warp_sum(act ? entry_digest_term(e, slot, prev, pos, tok) : 0ULL);
                if (lane == 0) *warp_digest += t;
            }
            check_entry<kFp, kScan>(*c, act, r, slot, prev, pos, tok, g, phase, checked);
        } else if (act) {
            a.vp_slot[e] = slot;
            a.vp_prev[e] = prev;
            a.vp_epos[e] = pos;
            a.vp_etok[e] = tok;
        }
    }
}

// --- small route (small steps): plan_small.cuh ---------------------------------------
// Its bound on the positions a row reads (the backend's twin: SMALL_PLAN_ROW_POSITIONS;
// its bound on rows, SMALL_ROWS, sizes the launch state above).
inline constexpr i64 SMALL_ROW_MAX = 8192;

}  // namespace kvc

#include "plan_small.cuh"

namespace kvc {

// --- one launch: a route, then the last block out ------------------------------------
// What the last block out runs after the plan (step.cu's write); by default nothing. A tail
// may load what it needs at the start of the launch (prefetch, every block) and keep it
// (stash, after the rows' inputs are read), and may ask for the rows' seed states (kSeeds);
// on the small route it gets the rows as the last block's finish left them (SmallRows).
struct NoTail {
    static constexpr bool kSeeds = false;
    struct Prefetched {};
    __device__ __forceinline__ Prefetched prefetch() const { return {}; }
    __device__ __forceinline__ void stash(const Prefetched&) const {}
    __device__ __forceinline__ void last_block(const PlanArgs&, const CheckArgs*, const SmallRows*) const {}
};

// The whole plan in one launch (see the routes at the top of the file); with
// kVerify, the fill checks each entry instead of writing it (plan_and_verify). The
// last block out then runs `tail` (every thread of it): every other block's reads
// are over by then.
template <bool kVerify, bool kFp, bool kScan, typename Tail = NoTail>
__device__ __forceinline__ void plan_body(const PlanArgs& a, const CheckArgs* c, const Tail& tail = Tail{}) {
    __shared__ i64 sh[65];  // block sums and scans: up to two values per warp, and one more
    __shared__ i64 s_row, s_seed;
    __shared__ int s_scan, s_last;
    __shared__ i64 s_phase;
    __shared__ SmallRows s_small;
    i64* sync = a.sync;
    if constexpr (kVerify) {
        // The sampler's phase, read before any block can finish (the last one out advances it).
        if (threadIdx.x == 0)
            s_phase = c->sample_state != nullptr ? pmod(__ldcg(c->sample_state), c->period) : -1;
    }
    const auto fetched = tail.prefetch();  // in flight with the rows' inputs
    const bool small = small_rows(a, kVerify && c->digest != nullptr, s_small, sh);
    tail.stash(fetched);
    i64 checked = 0;
    __shared__ u64 s_digest[32];  // kVerify with c->digest: per warp, its entries' terms
    s_digest[threadIdx.x >> 5] = 0;  // before the barriers below
    i64 errors = 0;  // thread 0: the block route's rows this block could not plan
    if (small) {
        small_tiles<kVerify, kFp, kScan, Tail::kSeeds>(a, c, s_small, kVerify ? s_phase : -1, checked);
    } else {
        bool scanner = false;  // thread 0
        for (;;) {
            if (threadIdx.x == 0) s_row = (i64)atomicAdd((u64*)(sync + SYNC_ROWS_CLAIMED), 1ULL);
            __syncthreads();
            const i64 r = s_row;
            __syncthreads();  // every thread has r before thread 0 claims again
            if (r >= a.bs) break;
            plan_row(a, r, errors, &s_seed);
            if (threadIdx.x == 0) {
                __threadfence();  // the row's counts before its completion
                scanner |= atomicAdd((u64*)(sync + SYNC_ROWS_DONE), 1ULL) == (u64)(a.bs - 1);
            }
        }
        if (threadIdx.x == 0) {
            if (errors != 0) {
                if (a.vp_input_errors != nullptr) atomicAdd((u64*)a.vp_input_errors, (u64)errors);
                if (a.wp_input_errors != nullptr) atomicAdd((u64*)a.wp_input_errors, (u64)errors);
            }
            s_scan = scanner || (a.bs == 0 && blockIdx.x == 0);
        }
        __syncthreads();
        if (s_scan) {
            __threadfence();
            i64 vtotal, wtotal;
            plan_scan(a, sh, vtotal, wtotal);
            __threadfence();  // every thread's offsets before the flag
            __syncthreads();
            if (threadIdx.x == 0) atomicExch((u64*)(sync + SYNC_SCANNED), 1ULL);
            plan_tails(a, vtotal, wtotal, 0, 1);
        }
        if (a.vp_offsets != nullptr) {
            // Waits only on the scanning block, which is running: every row has been
            // claimed by a running block before any block gets here.
            // A plain (volatile) load, not an atomic: polling must not slow the atomics.
            if (threadIdx.x == 0) poll_at_least(sync + SYNC_SCANNED, 1);
            __syncthreads();
            __threadfence();
            plan_fill<kVerify, kFp, kScan>(a, c, kVerify ? s_phase : -1, checked, &s_digest[threadIdx.x >> 5]);
        }
    }
    if constexpr (kVerify) {
        const i64 sum = block_sum(checked, sh);
        const u64 dsum = c->digest != nullptr ? block_sum(lane_id() == 0 ? s_digest[threadIdx.x >> 5] : 0ULL, (u64*)sh) : 0;
        if (threadIdx.x == 0) {
            if (dsum != 0) atomicAdd((u64*)(sync + SYNC_DIGEST), dsum);
            if (sum != 0) atomicAdd((u64*)(c->counters + CTR_SLOTS_CHECKED), (u64)sum);
            if (blockIdx.x == 0) {
                atomicAdd((u64*)(c->counters + CTR_KERNEL_RUNS), 1ULL);
                // An overflowed plan checks nothing: count it, so it shows. (The small route
                // is taken only when nothing can overflow; its enable is written last.)
                if (!small && __ldcg(a.vp_enable) != 1) atomicAdd((u64*)(c->counters + CTR_VERIFIES_SKIPPED), 1ULL);
            }
        }
    }
    // The exit count in the low word; in the high word the small route's warps that found a position unreadable, or
    // the block route's rows that could not be planned, so that the last block out learns of them from the same atomic.
    __shared__ i64 s_invalid;
    if (threadIdx.x == 0) {
        __threadfence();
        const u64 mine = small ? s_small.invalid : (u64)errors;
        const u64 before = atomicAdd((u64*)(sync + SYNC_EXITED), 1ULL + (mine << 32));
        s_last = (before & 0xFFFFFFFFULL) == (u64)(gridDim.x - 1);
        s_invalid = (i64)((before >> 32) + mine);
    }
    __syncthreads();
    if (!s_last) return;
    // The last block out: no other block reads the state any more; ready the next launch.
    // It acquires what the others published before their exit atomics only where it reads
    // it below (the verdicts of a step with unreadable rows, the digest's scalars): a clean
    // small step's last block waits for nothing.
    if ((small && s_invalid != 0) || (kVerify && c->digest != nullptr)) __threadfence();
    // The first live row that could not be planned (uniform over the block; -1: none). A clean
    // step's last block adds no barrier for it.
    i64 first_error = -1;
    if (small) {
        first_error = small_finish<kVerify>(a, c, s_small, s_invalid, sh);
    } else if (s_invalid != 0) {  // rare
        __shared__ i64 s_first_error;
        if (threadIdx.x == 0) s_first_error = a.bs - (i64)atomicExch((u64*)(sync + SYNC_FIRST_ERROR), 0ULL);
        __syncthreads();
        first_error = s_first_error;
    }
    describe_input_error(a, first_error);
    if (threadIdx.x == 0) {
        sync[SYNC_ROWS_CLAIMED] = 0;
        sync[SYNC_ROWS_DONE] = 0;
        sync[SYNC_SCANNED] = 0;
        sync[SYNC_EXITED] = 0;
        sync[SYNC_UNKNOWN_SPAN] = 0;
        if constexpr (kVerify) {
            if (c->sample_state != nullptr) c->sample_state[0] = __ldcg(c->sample_state) + 1;
            if (c->digest != nullptr) {
                // Each entry array's count term: num_valid, or 0 when the gate is shut.
                const i64 n = __ldcg(a.vp_enable) == 1 ? __ldcg(a.vp_num_valid) : 0;
                u64 d = (u64)atomicExch((u64*)(sync + SYNC_DIGEST), 0ULL);
                for (i64 k = 0; k < 4; ++k) d += mix3(ENTRY_DIGEST_SALT + k, -1, n);
                *c->digest = (i64)d;
            }
        }
    }
    __syncthreads();  // the plan's scalars and offsets, written by this block, before the tail reads them
    tail.last_block(a, c, small ? &s_small : nullptr);
}

__global__ void __launch_bounds__(256, 4) plan_step(PlanArgs a) { plan_body<false, false, false>(a, nullptr); }

// plan_and_verify: kFp with real-KV sources, kScan for a scan-chain canary.
template <bool kFp, bool kScan>
__global__ void __launch_bounds__(256, kFp ? KVC_FP_MIN_BLOCKS : 3) plan_verify_step(PlanVerifyArgs a) {
    plan_body<true, kFp, kScan>(a.p, &a.c);
}

}  // namespace kvc
