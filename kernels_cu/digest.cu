// digest.cu: what tensor-parallel ranks compare every step.
//
// digest_rows folds a few device arrays (plan entries, plan scalars, write
// inputs) into one 64-bit digest: the wrapping sum over every element of
// mix3(salt, index, value), plus mix3(salt, -1, count) per row. A sum does not
// depend on the order blocks finish in, so the digest is the same bytes on every
// launch and on the NumPy reference, and the per-element hash keeps a moved,
// changed, missing or extra element from cancelling out. Rows whose length lives
// on the device (a plan's num_valid) are read at run time: the launch has no
// data-dependent shape, so it can be captured in a CUDA graph.
//
// compare_digests runs after the ranks gathered [digest, log head] from each
// other: it names every rank whose digest differs from the majority's in a
// RANK_DIVERGENCE row (every rank appends the same rows, from the same gathered
// bytes) and keeps the group's violation tally.
#include "kvcanary_common.cuh"

namespace kvc {

// The twins of format.py's constants of the same names.
inline constexpr i64 DIGEST_DESC_WORDS = 6;  // [data, length, count ptr, gate ptr, element bytes, salt]
inline constexpr i64 MAX_RANKS = 1024;
// The words of the agreement state, in format.AGREE_STATE_FIELDS' order.
inline constexpr i64 ST_GROUP_ROWS = 0, ST_DIVERGENCES = 1, ST_AGREEMENT_STEPS = 2;
inline constexpr i64 ST_AGREED_HEAD = 3, ST_OWN_ROWS = 4;

struct DigestArgs {
    const i64* descs;  // [num_descs, DIGEST_DESC_WORDS]
    i64 num_descs;
    i64* out;  // [1 + carry_words]: the digest, then the carried words
    u64* state;  // [2]: partial sum, finished blocks; zero between launches
    const i64* carry;  // copied verbatim after the digest (the log head), so one collective moves both
    i64 carry_words;
};

struct AgreeArgs {
    const i64* gathered;  // [world, words]: per rank its digest, then its log head
    i64 world, words, rank;
    i64* state;  // [5]: the ST_* words
    i64* ring;
    i64* head;
    i64 ring_capacity;
    i64 tag;
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

// Rows a launch takes at most (prepare_digest refuses more): their metadata is
// staged in shared memory once per block.
inline constexpr int MAX_DIGEST_ROWS = 64;

// One grid-stride pass over the concatenation of all rows, so a thread's few
// loads are independent and in flight together (a pass per row would chain a
// global round trip per row, most of a step's digest time); a block first
// stages every row's metadata (count and gate read once) in shared memory.
// Per block one atomic add of its partial sum, and the last block out
// publishes the total and zeroes the state for the next launch (so no memset
// is needed between launches or graph replays). A grid of one block (a step's
// agreement digests a few hundred elements) publishes its sum directly: the
// atomics, fences and ticket are a chain of global round trips that a step pays
// for on its critical path.
__global__ void __launch_bounds__(256) digest_rows(DigestArgs a) {
    __shared__ u64 scratch[32];
    __shared__ bool last;
    __shared__ i64 s_start[MAX_DIGEST_ROWS + 1];
    __shared__ const void* s_data[MAX_DIGEST_ROWS];
    __shared__ u64 s_salt[MAX_DIGEST_ROWS];
    __shared__ bool s_wide[MAX_DIGEST_ROWS];
    const int rows = (int)(a.num_descs < MAX_DIGEST_ROWS ? a.num_descs : MAX_DIGEST_ROWS);
    const bool alone = gridDim.x == 1;
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
        if (blockIdx.x == 0) acc += mix3((u64)d[5], -1, n);  // each row's count, once per launch
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        s_start[0] = 0;
        for (int k = 0; k < rows; ++k) s_start[k + 1] += s_start[k];
    }
    __syncthreads();
    const i64 total = s_start[rows];
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride) {
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
        last = atomicAdd(&a.state[1], 1ULL) == (u64)gridDim.x - 1;
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
                         agreeing);
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
