// digest.cu: what tensor-parallel ranks compare every step.
//
// digest_rows folds a few device arrays (plan entry digests, plan scalars, write
// inputs) into one 64-bit digest (digest_block, in the common header: a write
// launch can run the same digest in an extra block of its own).
//
// compare_digests runs after the ranks gathered [digest, log head] from each
// other: it names every rank whose digest differs from the majority's in a
// RANK_DIVERGENCE row (every rank appends the same rows, from the same gathered
// bytes) and keeps the group's violation tally.
#include "kvcanary_common.cuh"

namespace kvc {

// The twins of format.py's constants of the same names.
inline constexpr i64 MAX_RANKS = 1024;
// The words of the agreement state, in format.AGREE_STATE_FIELDS' order.
inline constexpr i64 ST_GROUP_ROWS = 0, ST_DIVERGENCES = 1, ST_AGREEMENT_STEPS = 2;
inline constexpr i64 ST_AGREED_HEAD = 3, ST_OWN_ROWS = 4;

struct AgreeArgs {
    const i64* gathered;  // [world, words]: per rank its digest, then its log head
    i64 world, words, rank;
    i64* state;  // [5]: the ST_* words
    i64* ring;
    i64* head;
    i64 ring_capacity;
    i64 tag;
};

// The digest of the rows (see digest_block in the common header), over the grid.
__global__ void __launch_bounds__(256) digest_rows(DigestArgs a) { digest_block(a, blockIdx.x, gridDim.x); }

// One block. The majority digest is the one most ranks hold; on a tie the lowest
// rank's wins (with two ranks that disagree: rank 0's), so every rank picks the
// same reference from the same gathered bytes.
__global__ void __launch_bounds__(256) compare_digests(AgreeArgs a) {
    __shared__ i64 holders[MAX_RANKS];
    __shared__ i64 ref_s;
    const i64 W = a.words;
    // The state's words and the log head first: their round trip overlaps the gathered digests'.
    const i64 div_prev = a.state[ST_DIVERGENCES];
    const i64 step = a.state[ST_AGREEMENT_STEPS] + 1;
    const i64 head0 = *(volatile const i64*)a.head;
    for (i64 r = threadIdx.x; r < a.world; r += blockDim.x) {
        const i64 d = a.gathered[r * W];
        i64 n = 0;
        for (i64 q = 0; q < a.world; ++q) n += a.gathered[q * W] == d;
        holders[r] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 best = 0;
        for (i64 r = 1; r < a.world; ++r)
            if (holders[r] > holders[best]) best = r;
        ref_s = best;
    }
    __syncthreads();
    const i64 ref = ref_s;
    const i64 ref_digest = a.gathered[ref * W];
    const i64 agreeing = holders[ref];
    // Every lane of every warp takes part in each append (the sink's ballot needs them).
    for (i64 base = 0; base < a.world; base += blockDim.x) {
        const i64 r = base + threadIdx.x;
        const bool differs = r < a.world && a.gathered[r * W] != ref_digest;
        append_violation(a.ring, a.head, a.ring_capacity, differs, a.tag, -1, step, r, ref,
                         differs ? (u64)a.gathered[r * W] : 0ULL, (u64)ref_digest, FAIL_RANK_DIVERGENCE, -1,
                         agreeing, no_detail());
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // Every rank's head holds the divergence rows of earlier rounds (each rank appended the
        // same ones): take them out so the group's tally counts only what its checks found.
        u64 heads = 0;
        for (i64 r = 0; r < a.world; ++r) heads += (u64)a.gathered[r * W + 1];
        a.state[ST_GROUP_ROWS] = (i64)(heads - (u64)a.world * (u64)div_prev);
        a.state[ST_OWN_ROWS] = a.gathered[a.rank * W + 1] - div_prev;
        a.state[ST_DIVERGENCES] = div_prev + (a.world - agreeing);
        a.state[ST_AGREEMENT_STEPS] = step;
        // The head after this round's appends: one row per rank that differs (the launch is
        // ordered after every other append to the log on its stream).
        a.state[ST_AGREED_HEAD] = head0 + (a.world - agreeing);
    }
}

}  // namespace kvc
