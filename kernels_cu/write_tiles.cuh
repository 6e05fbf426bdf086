// write_tiles.cuh: write.cu's tiles, a launch's long rows split over the grid (included
// by write.cu).
//
// Taken by the scan chain's rows longer than WARP_ROW_MAX tokens when plan_tiles says so
// (see write.cu's map of its routes); builds on write.cu's block steps (scan_step,
// store_step) and the tile state's sizes it declares (TILE_ROWS, TILE_STATE_WORDS,
// TILE_DATA_WORDS); write_tokens (write.cu) runs write_tiles and finish_tiles.
//
// When a launch's offsets are in order (rows back to back, as plan writes them) and
// it has at most TILE_ROWS rows, its long rows are cut into tiles of one block step
// each, spread over the grid, so a 16K-token row is not one block's serial work:
//   - tile t goes to block t mod blocks, in order; a block's tiles are in order too,
//     and a tile waits only for earlier tiles, so with the grid resident at once
//     (the backend sizes it so) the earliest unfinished tile can always go on;
//   - a tile publishes its map (TILE_AGG), then the chain's state after it
//     (TILE_PREFIX) once it knows the state before it: its row's seed, or a look-back
//     over the earlier tiles of its row (a warp reads 32 of their flags at a time and
//     composes the maps back to the nearest published state);
//   - the last write of a slot wins, across tiles as within one: each tile's last
//     writer of a slot enters its token index in a launch-wide hash table (slot + 1 in
//     the high word, the highest token index + 1 in the low one). Finding a later
//     token there, it does not store; finding an earlier one, it stores only after
//     that token's tile has published TILE_DONE (its stores made visible).
// The launch state (WriteArgs::tiles) is TILE_STATE_WORDS words, a flag per tile,
// TILE_DATA_WORDS per tile, then two hash tables of table_cap words: a launch uses
// table gen & 1 and empties the other, which the launch before it used; its last
// block out records how much of its table it used and moves gen on. Flags carry
// gen (gen * 4 + status), so they are never reset.

namespace kvc {

inline constexpr int ST_GEN = 0, ST_EXITED = 1, ST_USED = 2;  // ST_USED + k: words of table k the last use filled
inline constexpr i64 TILE_AGG = 1, TILE_PREFIX = 2, TILE_DONE = 3;

struct TileRows {
    i64 start[TILE_ROWS + 1];  // offsets[0..nrows]
    i64 first[TILE_ROWS + 1];  // row r's tiles are [first[r], first[r + 1])
    i64 seed[TILE_ROWS];
    i64 scratch[32];
    i64 tiles;  // of all rows
};

struct TileLaunch {
    i64* flags;  // [tile_cap]
    i64* data;   // [tile_cap * TILE_DATA_WORDS]
    u64* table;  // this launch's hash table
    u64 mask;    // its size - 1 (a power of two)
    i64 gen;
};

// Whether this launch splits its long rows into tiles; if so, fills tr (every thread
// must call it, and gets the same answer).
__device__ bool plan_tiles(const WriteArgs& a, i64 nrows, i64 tokens_per_tile, TileRows& tr, TileLaunch& tl) {
    if (a.tiles == nullptr || nrows <= 0 || nrows > TILE_ROWS || nrows > (i64)blockDim.x) return false;
    for (i64 r = threadIdx.x; r <= nrows; r += blockDim.x) tr.start[r] = a.offsets[r];
    const i64 r = threadIdx.x;
    const i64 seed = r < nrows ? a.seeds[r] : -1;
    __syncthreads();
    i64 n = 0, tiles = 0;
    bool bad = false;
    if (r < nrows) {
        const i64 o0 = tr.start[r], o1 = tr.start[r + 1];
        bad = o1 < o0 || (r == 0 && o0 < 0) || (r == nrows - 1 && o1 > a.avail);
        tr.seed[r] = seed;
        n = o1 - o0;
        const bool tiled = !bad && n > WARP_ROW_MAX && seed >= -1 && seed < a.num_slots;  // row_ok's seed test
        tiles = tiled ? (n + tokens_per_tile - 1) / tokens_per_tile : 0;
        if (!tiled) n = 0;
    }
    if (__syncthreads_or(bad)) return false;
    i64 total;
    const i64 incl = block_scan((tiles << 32) | n, tr.scratch, total);  // tiles < 2^31, tokens < 2^32
    if (r < nrows) tr.first[r + 1] = incl >> 32;
    if (r == 0) tr.first[0] = 0;
    const i64 all_tiles = total >> 32, long_tokens = total & 0xFFFFFFFFLL;
    if (all_tiles == 0 || all_tiles > a.tile_cap || 2 * long_tokens > a.table_cap) return false;
    u64 size = 64;
    while (size < 2 * (u64)long_tokens) size <<= 1;
    tl.gen = __ldcg(a.tiles + ST_GEN);
    tl.flags = a.tiles + TILE_STATE_WORDS;
    tl.data = tl.flags + a.tile_cap;
    tl.table = (u64*)(tl.data + a.tile_cap * TILE_DATA_WORDS) + (tl.gen & 1) * a.table_cap;
    tl.mask = size - 1;
    if (threadIdx.x == 0) tr.tiles = all_tiles;
    __syncthreads();
    return true;
}

// Token idx's write of `slot` in the hash table: its entry's word, and the first
// compare-and-swap's answer (separate, so a thread's first attempts are in flight at once).
__device__ __forceinline__ u64 last_write_word(i64 slot, i64 idx) { return (u64)(slot + 1) << 32 | (u64)(idx + 1); }

__device__ __forceinline__ u64 last_write_home(const TileLaunch& tl, i64 slot) {
    return splitmix64((u64)slot) & tl.mask;
}

// Finishes entering `mine` (last_write_word) at entry h, whose compare-and-swap of 0
// saw w; returns the highest token index + 1 entered for that slot before (0: none).
__device__ __forceinline__ u64 enter_last_write(const TileLaunch& tl, u64 mine, u64 h, u64 w) {
    const u64 key = mine & 0xFFFFFFFF00000000ULL;
    for (;;) {  // the table is at most half full: a free or matching entry is found
        if (w == 0ULL) return 0;
        if ((w & 0xFFFFFFFF00000000ULL) == key) {
            for (;;) {
                if (w >= mine) return w & 0xFFFFFFFFULL;  // same key: compare the indices
                const u64 seen = atomicCAS(tl.table + h, w, mine);
                if (seen == w) return w & 0xFFFFFFFFULL;
                w = seen;
            }
        }
        h = (h + 1) & tl.mask;
        w = atomicCAS(tl.table + h, 0ULL, mine);
    }
}

__device__ __forceinline__ void publish(i64* flag, i64 value) {
    __threadfence();  // the data before the flag
    *(volatile i64*)flag = value;
}

// The chain's state before tile t, the i-th (i > 0) of its row, by one warp: the
// maps of the tiles back to the nearest one whose state is out, applied to that state.
__device__ void look_back(const TileLaunch& tl, i64 t, i64 i, u64& x, int& has, i64& pos) {
    const unsigned lane = lane_id();
    ChainMap acc = identity_map();  // the tiles passed so far, the nearest applied last
    for (i64 j = t - 1;; j -= 32) {
        const i64 tj = j - lane;
        const bool in = tj >= t - i;
        const i64 f = in ? poll_at_least(tl.flags + tj, tl.gen * 4 + TILE_AGG) : 0;
        __threadfence();
        const unsigned out = __ballot_sync(FULL_MASK, in && f >= tl.gen * 4 + TILE_PREFIX);
        const unsigned stop = out ? (unsigned)(__ffs(out) - 1) : 32u;
        ChainMap m = identity_map();
        if (in && lane < stop) {
            const i64* d = tl.data + tj * TILE_DATA_WORDS;
            m = ChainMap{(u64)__ldcg(d), (u64)__ldcg(d + 1), __ldcg(d + 2), (int)__ldcg(d + 3)};
        }
        for (int k = 1; k < 32; k <<= 1) {  // lane 0: m_0 after m_1 after ... m_31
            const ChainMap o = shfl_map(m, lane + k);
            if (lane + k < 32) m = then(o, m);
        }
        m = shfl_map(m, 0);
        acc = then(m, acc);
        if (out) {
            const i64* d = tl.data + (j - stop) * TILE_DATA_WORDS;
            const u64 px = (u64)__ldcg(d + 4);
            const int ph = (int)__ldcg(d + 5);
            const i64 pp = __ldcg(d + 6);
            x = apply_map(acc, px);
            has = ph | acc.has;
            pos = acc.has ? acc.pos : pp;
            return;
        }
    }
}

// The long rows' tiles of this block (see above).
template <bool kFp>
__device__ void write_tiles(const WriteArgs& a, const TileRows& tr, i64 nrows, const TileLaunch& tl, unsigned blocks,
                            bool check_pos, ScanShared& sh, i64& written, i64& skipped) {
    const unsigned warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const i64 tokens_per_tile = (i64)blockDim.x * SCAN_ITEMS;
    for (i64 t = blockIdx.x; t < tr.tiles; t += blocks) {
        const i64 r = row_of(tr.first, nrows, t);
        const i64 i = t - tr.first[r], o1 = tr.start[r + 1], base = tr.start[r] + i * tokens_per_tile;
        i64* flag = tl.flags + t;
        i64* d = tl.data + t * TILE_DATA_WORDS;
        BlockStep st;
        scan_step(a, base, o1, sh, st);
        __syncthreads();
        ChainMap m;  // the tile's map (warp 0)
        if (warp == 0) {
            scan_warp_maps(sh);
            __syncwarp();
            m = sh.below[nwarps];
            if (i > 0 && threadIdx.x == 0) {  // the map first: later tiles' look-backs wait on it
                d[0] = (i64)m.a;
                d[1] = (i64)m.b;
                d[2] = m.pos;
                d[3] = m.has;
                publish(flag, tl.gen * 4 + TILE_AGG);
            }
        }
        // This tile's last writes of their slots, entered launch-wide (the atomics go out
        // before the look-back, so their latency overlaps it).
        u64 before[SCAN_ITEMS], word[SCAN_ITEMS], home[SCAN_ITEMS];
#pragma unroll
        for (int j = 0; j < SCAN_ITEMS; ++j) {
            before[j] = ~0ULL;
            if (last_in_step(a, sh, st, j, base)) {
                word[j] = last_write_word(st.c[j].s, st.c[j].i);
                home[j] = last_write_home(tl, st.c[j].s);
                before[j] = atomicCAS(tl.table + home[j], 0ULL, word[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < SCAN_ITEMS; ++j)
            if (before[j] != ~0ULL) before[j] = enter_last_write(tl, word[j], home[j], before[j]);
        if (warp == 0) {
            u64 x;
            int has;
            i64 pos;
            if (i == 0) seed_state(a, tr.seed[r], x, has, pos);
            else look_back(tl, t, i, x, has, pos);
            if (threadIdx.x == 0) {
                sh.x = x;
                sh.has = has;
                sh.pos = pos;
                d[4] = (i64)apply_map(m, x);
                d[5] = has | m.has;
                d[6] = m.has ? m.pos : pos;
                publish(flag, tl.gen * 4 + TILE_PREFIX);
            }
        }
        __syncthreads();
        bool keep[SCAN_ITEMS];
#pragma unroll
        for (int j = 0; j < SCAN_ITEMS; ++j) {
            const u64 seen = before[j], mine = (u64)st.c[j].i + 1;
            keep[j] = seen != ~0ULL && seen < mine;
            if (keep[j] && seen != 0) {  // an earlier token of another tile wrote this slot: store after it
                const i64 e = (i64)seen - 1;
                const i64 re = row_of(tr.start, nrows, e);
                const i64 te = tr.first[re] + (e - tr.start[re]) / tokens_per_tile;
                poll_at_least(tl.flags + te, tl.gen * 4 + TILE_DONE);
                __threadfence();
            }
        }
        store_step<kFp>(a, sh, st, sh.x, sh.has, sh.pos, keep, check_pos, r, written, skipped);
        __threadfence();  // this thread's stores before the tile's TILE_DONE
        __syncthreads();
        if (threadIdx.x == 0) publish(flag, tl.gen * 4 + TILE_DONE);
        clear_step(a, sh, st);
        __syncthreads();
    }
}

// After the tiles: empty the other table (every block a share); the last block out
// records this launch's use and moves gen on.
__device__ void finish_tiles(const WriteArgs& a, const TileLaunch& tl, unsigned blocks) {
    u64* other = (u64*)(tl.data + a.tile_cap * TILE_DATA_WORDS) + ((tl.gen & 1) ^ 1) * a.table_cap;
    const i64 used = __ldcg(a.tiles + ST_USED + ((tl.gen & 1) ^ 1));
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < used; k += (i64)blocks * blockDim.x) other[k] = 0;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd((u64*)(a.tiles + ST_EXITED), 1ULL) == blocks - 1) {
            a.tiles[ST_USED + (tl.gen & 1)] = (i64)tl.mask + 1;
            a.tiles[ST_USED + ((tl.gen & 1) ^ 1)] = 0;
            a.tiles[ST_EXITED] = 0;
            a.tiles[ST_GEN] = tl.gen + 1;
        }
    }
}

}  // namespace kvc
