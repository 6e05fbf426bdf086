// write.cu: stamp records for the tokens a step writes.
//
// write_tokens<kFp>, two phases per warp, no grid-wide barrier between them
// (they write different record fields):
//   A. chain: one warp per write row (grid-stride). The chain is serial by
//      definition; the warp loads 32 tokens at a time, coalesced, and every
//      lane runs the same chain over them in lockstep (values broadcast by
//      shuffles), keeping the link of its own token. Then all lanes check and
//      store in parallel. Within a batch of 32 a slot written twice is stored
//      only by its last token (match_any), and __syncwarp orders batches, so
//      the last write of a slot in a row wins, as in the reference.
//   B. fingerprints (kFp): grid-stride over all input tokens, g lanes per
//      token; each token finds its row by binary search over the write offsets
//      (non-decreasing as plan() writes them) and stores field 3 of its
//      record. A long prefill row is thus fingerprinted by the whole grid, not
//      by its warp.
// Without sources (kFp = false) phase A stores the fingerprint 0 itself.
// Counters: each warp sums the slots it wrote and the tokens of its rows that
// a negative slot skips, and adds each with one atomic at the end; block 0 adds
// the run, and one to writes_skipped when the plan was never planned.
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
};

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
        running = next_link(s);
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
                epos = (i64)((u64)my_prev + 1ULL);
                if (p != epos) bits |= FAIL_WRITE_POSITION;
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
                         epos);
        __syncwarp();
    }
}

template <bool kFp>
__global__ void __launch_bounds__(256, kFp ? KVC_FP_MIN_BLOCKS : 1) write_tokens(WriteArgs a) {
    const i64 planned_rows = *a.num_rows;  // < 0: the plan was never planned
    i64 nrows = planned_rows;
    if (nrows > a.max_batch) nrows = a.max_batch;
    if (nrows < 0) nrows = 0;
    const bool check_pos = *a.position_check != 0;
    const unsigned lane = lane_id();
    const i64 warp0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    const i64 N = a.num_slots;

    i64 written = 0, skipped = 0;  // the same in every lane of a warp
    for (i64 r = warp0; r < nrows; r += warps) {
        const i64 o0 = a.offsets[r], o1 = a.offsets[r + 1], seed = a.seeds[r];
        const bool span_bad = o0 < 0 || o1 > a.avail || o1 < o0;  // a reversed span: a forged plan
        const bool seed_bad = !span_bad && (seed < -1 || seed >= N);
        append_violation(a.ring, a.head, a.ring_capacity, lane == 0 && (span_bad || seed_bad), a.tag,
                         span_bad ? -1 : seed, -1, -1, -1, 0, 0,
                         span_bad ? FAIL_INPUT_OUT_OF_RANGE : FAIL_SLOT_OUT_OF_RANGE, r, -1);
        if (span_bad || seed_bad || o1 <= o0) continue;
        chain_row<kFp>(a, r, o0, o1, seed, check_pos, written, skipped);
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

    if (lane == 0 && written != 0) atomicAdd((u64*)(a.counters + CTR_SLOTS_WRITTEN), (u64)written);
    if (lane == 0 && skipped != 0) atomicAdd((u64*)(a.counters + CTR_TOKENS_SKIPPED), (u64)skipped);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd((u64*)(a.counters + CTR_KERNEL_RUNS), 1ULL);
        // A write plan that was never planned writes nothing: count it, so it shows.
        if (planned_rows < 0) atomicAdd((u64*)(a.counters + CTR_WRITES_SKIPPED), 1ULL);
    }
}

}  // namespace kvc
