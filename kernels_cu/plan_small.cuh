// plan_small.cuh: plan.cu's small route, for small steps (included by plan.cu).
//
// Taken when small_rows says so (see plan.cu's map of its routes): tiles of entries whose
// warps check or store them on their own (small_tiles), then the last block out's finish
// (small_finish; small_compact for plan when a row was unreadable). Builds on plan.cu's
// shared pieces (arguments, launch state, table lookups, the check of one entry) and
// its bound SMALL_ROW_MAX; plan_body (plan.cu) runs it.
//
// The block route is a chain of about twenty dependent global round trips (claim a
// row, its table, the row-done atomic, the scan, the flag, the fill), and a decode
// step of a few rows pays all of it. When the batch fits a block (bs <= SMALL_ROWS),
// no row reads more than SMALL_ROW_MAX positions and the rows' entries fit the plan's
// capacity and small_max even if every row is valid, the launch takes this route:
//   every block reads every row's inputs (a row per thread) and lays the entries out
//   as if every row whose inputs are in range were readable, in tiles of blockDim
//   entries, a tile within one row;
//   a block takes a tile, and each of its warps the tile's 32 entries at its lane's
//   place, on its own: no barrier, so a warp waiting for its records holds up no other.
//   A warp reads the table at its positions and at the one before its first, then
//   checks (plan_and_verify) or writes (plan) its entries where the layout puts them;
//   a warp that finds one of its positions unreadable marks its row (SYNC_VERDICTS) and
//   checks nothing; a warp whose checks fail reads its whole row before it reports them,
//   so that an unreadable row reports nothing, as in the reference;
//   the last block out turns the rows' verdicts into the offsets and plan scalars. Only
//   when a row was unreadable does it read the verdicts back, take back what that row's
//   readable warps counted as checked (SYNC_CHECKED) and, for plan, move the entries of
//   the rows after it down to their offsets.
// A clean step's warps never wait for each other, and each table element is read once
// (twice for a warp's first predecessor). The digest of the entries, which needs each
// entry's index, takes the block route.

namespace kvc {

inline constexpr int SMALL_TILE = 256;  // entries per tile: blockDim (the launch bounds)
inline constexpr i64 UNREADABLE = 2;    // a row's verdict word: a warp found a position unreadable
inline constexpr i64 ENTRY_BITS = 32;   // SmallRows::ends: tiles above, entries below
// small_rows's scan: the rows too long for the route counted above the tiles (at most SMALL_ROWS).
inline constexpr int TOO_LONG_BIT = 48;
inline constexpr i64 TILES_AND_ENTRIES = (1LL << TOO_LONG_BIT) - 1;
static_assert((i64)SMALL_ROWS * ((SMALL_ROW_MAX + SMALL_TILE) / SMALL_TILE) < (1LL << (TOO_LONG_BIT - ENTRY_BITS)),
              "small_rows's tile count stays below the count of rows too long");
inline constexpr i64 SEED_FROM_TILES = -3;  // SmallRows::wseed: the seed the row's tiles stored
// small_finish's packed sums: verify counts below bit FINISH_UNKNOWN (a small step has at most
// SMALL_ROWS * SMALL_ROW_MAX = 2**21 entries), then two 9-bit counts of rows.
inline constexpr int FINISH_UNKNOWN = 22, FINISH_ERROR = 31;
inline constexpr i64 FINISH_FIELD_LOW = (1LL << FINISH_UNKNOWN) - 1, FINISH_FIELD = (1LL << 9) - 1;
static_assert((i64)SMALL_ROWS * SMALL_ROW_MAX < (1LL << FINISH_UNKNOWN) && SMALL_ROWS < 512 &&
                  FINISH_ERROR == FINISH_UNKNOWN + 9,
              "small_finish's packed sums hold every count of a small step");

struct SmallRows {
    i64 rp[SMALL_ROWS], P[SMALL_ROWS], E[SMALL_ROWS];
    i64 n[SMALL_ROWS];    // the row's entries if it is valid; -1: its inputs are out of range
    i64 lim[SMALL_ROWS];  // expected tokens: the row's valid length, at most the table's width
    // Inclusive prefix sums over the rows, if every row is valid: tiles << ENTRY_BITS | entries.
    i64 ends[SMALL_ROWS];
    i64 offset[SMALL_ROWS];  // the last block, plan with unreadable rows: a valid row's offset, else -1
    // The last block, for a tail that writes: each row's write end (the write plan's offsets[r + 1])
    // and its seed as the finish decided it (SEED_SKIP, -1, or SEED_FROM_TILES: the one its tiles stored).
    i64 wend[SMALL_ROWS], wseed[SMALL_ROWS];
    i64 tiles, entries;      // totals over the rows
    i64 writes;              // the rows' write lengths, summed over the rows whose inputs are in range
    u64 invalid;             // warps of this block that found a position unreadable
};

// Row r's first entry in the small route's layout.
__device__ __forceinline__ i64 small_first_entry(const SmallRows& s, i64 r) {
    return (s.ends[r] & ((1LL << ENTRY_BITS) - 1)) - (s.n[r] > 0 ? s.n[r] : 0);
}

// Reads every row's inputs into s and says whether the step takes the small route: the
// same answer in every block, since it depends on the inputs only. Every thread calls it.
__device__ __forceinline__ bool small_rows(const PlanArgs& a, bool digest, SmallRows& s, i64* scratch) {
    if (a.vp_offsets == nullptr || digest || a.small_max <= 0 || a.bs > SMALL_ROWS || blockDim.x > SMALL_TILE ||
        a.bs > (i64)blockDim.x)
        return false;
    const i64 r = threadIdx.x;
    i64 n = 0, tiles = 0, w = 0;
    if (r < a.bs) {
        const i64 rp = load_index(a.rpi, width_bit(a.widths, W_RPI), r);
        const i64 P = load_index(a.pre, width_bit(a.widths, W_PRE), r);
        const i64 E = load_index(a.ext, width_bit(a.widths, W_EXT), r);
        const bool ok = row_inputs_ok(a, rp, P, E);
        n = ok ? P - window_start(a, P) : 0;
        s.rp[r] = rp;
        s.P[r] = P;
        s.E[r] = E;
        s.n[r] = ok ? n : -1;
        w = span_known(a, E) ? E : 0;
        if (a.erows >= 0) {
            const i64 lim = load_index(a.evl, width_bit(a.widths, W_EVL), r);
            s.lim[r] = lim < a.ewidth ? lim : a.ewidth;
        }
        if (n > SMALL_ROW_MAX) n = SMALL_ROW_MAX + 1;  // too long: keeps the sums below small
        tiles = (n + blockDim.x - 1) / blockDim.x;
    }
    // Every sum in one scan of two values: entries (< 2**22), tiles (< 2**15) and the rows too
    // long for the route (a count at TOO_LONG_BIT) in the first, the write lengths in the second.
    i64 incl = tiles << ENTRY_BITS | n | (i64)(n > SMALL_ROW_MAX) << TOO_LONG_BIT, writes = w, total, wtotal;
    block_scan2(incl, writes, scratch, total, wtotal);
    const bool fits = (total >> TOO_LONG_BIT) == 0;
    if (r < a.bs) s.ends[r] = incl & TILES_AND_ENTRIES;
    const i64 entries = total & ((1LL << ENTRY_BITS) - 1);
    if (threadIdx.x == 0) {
        s.tiles = (total & TILES_AND_ENTRIES) >> ENTRY_BITS;
        s.entries = entries;
        s.writes = wtotal;
        s.invalid = 0;
    }
    __syncthreads();
    const bool small = fits && entries <= a.vp_capacity && entries <= a.small_max;
    // The plans' tails, if every row is readable (the last block stores them again if not): a
    // share per block, so that the last block stores none of them.
    if (small) plan_tails(a, entries, s.writes, blockIdx.x, gridDim.x);
    return small;
}

// The row of tile k (< s.tiles): the first whose tile count so far exceeds k. One vote
// of the warp finds its group of 8 rows, a binary search the row within: 4 dependent
// steps where a search of all 256 takes 8, in a loop that runs it once per tile.
// Every lane must call it; bs <= SMALL_ROWS = 32 x 8, and tile counts fit int (< 2**15).
__device__ __forceinline__ int small_tile_row(const SmallRows& s, int bs, int k) {
    const int lane = (int)lane_id(), last = bs - 1;
    const unsigned groups = __ballot_sync(FULL_MASK, (int)(s.ends[min(lane * 8 + 7, last)] >> ENTRY_BITS) > k);
    int lo = (__ffs(groups) - 1) * 8, hi = min(lo + 7, last);
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((int)(s.ends[mid] >> ENTRY_BITS) > k) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// The slots of a warp's positions first + lane (-1 past P or unreadable) and, in lane 0,
// of first - 1 (-1 if first is 0); whether every one of them is readable (every lane).
// Both loads go out before either is used.
__device__ __forceinline__ bool warp_slots(const PlanArgs& a, i64 rp, i64 first, i64 P, i64& slot, i64& before) {
    const i64 pos = first + lane_id();
    const bool in = pos < P, want = lane_id() == 0 && first > 0;
    const i64 v = in ? table_at(a, rp, pos) : 0;
    const i64 vb = want ? table_at(a, rp, first - 1) : 0;
    slot = in ? slot_of_value(a, v, pos) : -1;
    before = want ? slot_of_value(a, vb, first - 1) : -1;
    return !__any_sync(FULL_MASK, (in && slot < 0) || (want && before < 0));
}

// Whether row rp's whole range [start - 1, P) is readable, by one warp (every lane).
__device__ bool warp_row_readable(const PlanArgs& a, i64 rp, i64 P) {
    const i64 start = window_start(a, P);
    bool bad = false;
    for (i64 pos = (start > 0 ? start - 1 : 0) + lane_id(); pos < P; pos += 32) bad |= slot_at(a, rp, pos) < 0;
    return !__any_sync(FULL_MASK, bad);
}

// The small route's tiles for this block (see above), k = blockIdx.x + j gridDim.x, each
// warp its 32 entries of each. kSeeds: publish each writing row's seed state (see
// SYNC_SEEDS), from the check of its last position, whose record is the seed.
template <bool kVerify, bool kFp, bool kScan, bool kSeeds>
__device__ __forceinline__ void small_tiles(const PlanArgs& a, const CheckArgs* c, SmallRows& s, i64 phase,
                                            i64& checked) {
    i64* sync = a.sync;
    const bool w_etab = width_bit(a.widths, W_ETAB);
    const unsigned lane = lane_id();
    const int g = kFp ? lanes_per_fingerprint(s.entries, c->num_folds) : 1;
    u64 unreadable = 0;  // lane 0
    for (i64 k = blockIdx.x; k < s.tiles; k += gridDim.x) {
        const i64 r = small_tile_row(s, (int)a.bs, (int)k), jt = k - (r > 0 ? s.ends[r - 1] >> ENTRY_BITS : 0);
        const i64 rp = s.rp[r], P = s.P[r], start = window_start(a, P);
        const i64 i = jt * blockDim.x + threadIdx.x;  // the entry's index in its row
        const i64 pos = start + i, first = pos - lane;
        if (first >= P) continue;  // uniform over the warp: none of the tile's entries is its
        const bool act = pos < P;
        // The expected token's load goes out now and is used after the table: a raw value
        // per width, since a conversion right after the load would wait for it.
        const bool want = act && a.erows >= 0 && pos + a.eoffset >= 0 && pos + a.eoffset < s.lim[r];
        const i64 ek = rp * a.ewidth + pos + a.eoffset;
        const i64 tok64 = want && w_etab ? ((const i64*)a.etab)[ek] : 0;
        const int tok32 = want && !w_etab ? ((const int*)a.etab)[ek] : 0;
        // The position before the warp's first: the row's first warp's is the window head's
        // predecessor, which the row reads; a later warp's is read again for the predecessor
        // of its first entry. Every position of [start - 1, P) is in some warp's range.
        i64 slot, before;
        const bool readable = warp_slots(a, rp, first, P, slot, before);
        const i64 below = __shfl_up_sync(FULL_MASK, slot, 1);
        if (!readable && lane == 0) {
            sync[SYNC_VERDICTS + r] = UNREADABLE;
            ++unreadable;
        }
        // The row's last position holds its seed (the last block stores -1 if the row is unreadable).
        if (act && pos == P - 1 && a.wp_offsets != nullptr) a.wp_seeds[r] = readable && s.E[r] > 0 ? slot : -1;
        if (!readable) continue;  // uniform over the warp
        const i64 prev = act && pos > 0 ? (lane > 0 ? below : before) : -1;
        const i64 tok = want ? (w_etab ? tok64 : (i64)tok32) : -1;
        if constexpr (kVerify) {
            const i64 was = checked;
            EntryCheck x;
            Record rec;
            const bool read = entry_check<kFp, kScan>(*c, act, slot, prev, pos, tok, g, phase, checked, x,
                                                      kSeeds ? &rec : nullptr);
            if (kSeeds && read && pos == P - 1 && s.E[r] > 0) {
                i64* st = sync + SYNC_SEEDS + r * SEED_WORDS;
                st[0] = (i64)next_link<kScan>(rec);
                st[1] = rec.position;
                st[2] = slot + 1;  // the seed (read, so in range): the tail need not load it
            }
            // The warp's count, kept per row: the last block takes it back if the row is unreadable.
            const unsigned counted = __ballot_sync(FULL_MASK, checked != was);
            if (lane == 0 && counted != 0u) atomicAdd((u64*)(sync + SYNC_CHECKED + r), (u64)__popc(counted));
            // An unreadable row reports nothing: a warp with failures (rare) reads its whole row,
            // then checks again and reports (nothing of the first check stays live meanwhile).
            if (__any_sync(FULL_MASK, x.bits != 0) && warp_row_readable(a, rp, P)) {
                i64 again = 0;
                check_entry<kFp, kScan>(*c, act, r, slot, prev, pos, tok, g, phase, again);
            }
        } else if (act) {
            const i64 e = small_first_entry(s, r) + i;
            a.vp_slot[e] = slot;
            a.vp_prev[e] = prev;
            a.vp_epos[e] = pos;
            a.vp_etok[e] = tok;
        }
    }
    if (lane == 0 && unreadable != 0) atomicAdd(&s.invalid, unreadable);
    __syncthreads();  // s.invalid is complete
}

// plan's entries on a small step with unreadable rows: the valid rows' entries move down
// from where the layout put them (every row valid) to their offsets. Rows in order, a
// block's worth of entries at a time, each read whole before any is stored: entries only
// move down, so no store lands on an entry not yet read. Every thread calls it.
__device__ void small_compact(const PlanArgs& a, const SmallRows& s) {
    i64* const arrays[4] = {a.vp_slot, a.vp_prev, a.vp_epos, a.vp_etok};
    for (i64 r = 0; r < a.bs; ++r) {
        const i64 to = s.offset[r], n = s.n[r], from = small_first_entry(s, r);
        if (to < 0 || to == from) continue;  // uniform: shared values
        for (i64 k = 0; k < n; k += blockDim.x) {
            const i64 i = k + threadIdx.x;
            i64 v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = i < n ? __ldcg(arrays[j] + from + i) : 0;
            __syncthreads();
            if (i < n) {
#pragma unroll
                for (int j = 0; j < 4; ++j) arrays[j][to + i] = v[j];
            }
        }
    }
}

// The small route's last block: the offsets, seeds and plan scalars from the rows'
// verdicts, the verdicts and per-row counts cleared for the next launch. Every thread
// calls it. `invalid`: the launch's warps that found a position unreadable; with none,
// every row whose inputs are in range is valid and nothing needs reading back. Returns
// the first live row that could not be planned (-1: none), in every thread.
template <bool kVerify>
__device__ __forceinline__ i64 small_finish(const PlanArgs& a, const CheckArgs* c, SmallRows& s, i64 invalid,
                                             i64* scratch) {
    i64* sync = a.sync;
    const i64 r = threadIdx.x;
    i64 vc = 0, wc = 0, undo = 0, n = -1;
    bool error = false, valid = false, known = true;
    if (r < a.bs) {
        n = s.n[r];
        valid = n >= 0;
        if (n > 0) {
            if (invalid != 0) {
                valid = __ldcg(sync + SYNC_VERDICTS + r) != UNREADABLE;
                sync[SYNC_VERDICTS + r] = 0;
                if (kVerify && !valid) undo = __ldcg(sync + SYNC_CHECKED + r);
            }
            if (kVerify) sync[SYNC_CHECKED + r] = 0;
        }
        error = s.rp[r] != PADDING_REQ && !valid;
        vc = valid ? n : 0;
        known = span_known(a, s.E[r]);
        wc = known ? s.E[r] : 0;
    }
    // One scan for the sums the finish needs: the verify counts (below FINISH_UNKNOWN), the rows
    // of unknown span and the rows in error (9 bits each: at most SMALL_ROWS), and the write
    // counts beside them.
    i64 packed = vc | (i64)!known << FINISH_UNKNOWN | (i64)error << FINISH_ERROR, wi = wc, pt, wt;
    block_scan2(packed, wi, scratch, pt, wt);
    const i64 vi = packed & FINISH_FIELD_LOW, vt = pt & FINISH_FIELD_LOW;
    const i64 unknown = (pt >> FINISH_UNKNOWN) & FINISH_FIELD, errors = (pt >> FINISH_ERROR) & FINISH_FIELD;
    // The rows after the first whose span is unknown stamp nothing, as do invalid rows.
    const i64 after = ((packed >> FINISH_UNKNOWN) & FINISH_FIELD) - (i64)!known;
    const bool stamps = valid && after == 0;
    // The seeds the tiles stored before this block's store over them (rare: only a step with an
    // unknown span has valid rows that stamp nothing; one with unreadable rows fenced already).
    if (unknown != 0) __threadfence();
    if (a.wp_offsets != nullptr && r < a.bs) {
        // A row without entries (P == 0) starts its chain; the tiles stored a stamping row's seed.
        if (!stamps) a.wp_seeds[r] = SEED_SKIP;
        else if (n == 0) a.wp_seeds[r] = -1;
    }
    if (r < a.bs) {
        s.wend[r] = wi;
        s.wseed[r] = !stamps ? SEED_SKIP : n == 0 ? -1 : SEED_FROM_TILES;
    }
    // Without a row of unknown span every valid row stamps: the unstamped live rows are those in error.
    const i64 unstamped = unknown == 0 ? errors : __syncthreads_count(r < a.bs && s.rp[r] != PADDING_REQ && !stamps);
    __shared__ i64 s_first;
    i64 first_error = -1;
    if (errors != 0) {  // uniform; rare
        if (error && ((packed >> FINISH_ERROR) & FINISH_FIELD) == 1) s_first = r;
        __syncthreads();
        first_error = s_first;
    }
    const i64 undone = kVerify && invalid != 0 ? block_sum(undo, scratch) : 0;  // thread 0
    if (r < a.bs) a.vp_offsets[r + 1] = vi;
    if (a.wp_offsets != nullptr && r < a.bs) a.wp_offsets[r + 1] = wi;
    if (!kVerify && invalid != 0) {
        if (r < a.bs) s.offset[r] = valid && vc > 0 ? vi - vc : -1;
        __syncthreads();
        small_compact(a, s);
    }
    // Every block stored the tails with the totals of a step whose rows are all readable;
    // only a step with unreadable rows has other totals.
    if (invalid != 0) plan_tails(a, vt, wt, 0, 1);
    if (threadIdx.x == 0) {
        // The route is taken only when every entry fits: nothing overflows.
        a.vp_offsets[0] = 0;
        *a.vp_requested = vt;
        *a.vp_num_valid = vt;
        *a.vp_enable = 1;
        // Atomics whose result is not used, not read-modify-writes: nothing here waits for a read.
        atomicMax(a.vp_max_requested, vt);
        if (errors != 0 && a.vp_input_errors != nullptr) atomicAdd((u64*)a.vp_input_errors, (u64)errors);
        if (a.wp_offsets != nullptr) {
            a.wp_offsets[0] = 0;
            *a.wp_num_rows = a.bs;
            if (unstamped != 0 && a.wp_input_errors != nullptr) atomicAdd((u64*)a.wp_input_errors, (u64)unstamped);
        }
        if (undone != 0) atomicAdd((u64*)(c->counters + CTR_SLOTS_CHECKED), (u64)(-undone));
    }
    return first_error;
}

}  // namespace kvc
