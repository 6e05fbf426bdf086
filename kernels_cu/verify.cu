// verify.cu: check every planned record against its predecessor, position,
// token and (optionally) the fingerprint of the live K/V bytes.
//
// verify_entries<kFp, kScan>: grid-stride over entries in whole warps; kScan
// selects the canary's chain kind (scan or sglang). kFp = false
// when no real-KV source is given (the expected fingerprint is then 0), which
// keeps the common kernel small. Fingerprints are computed by g lanes per
// entry (see lanes_per_fingerprint); the other checks by the group's first
// lane. A predecessor that is the previous entry's slot (every entry of a row
// but its first) is not gathered again: its link comes from the lane below.
// Counters go through a block reduction (one atomic per block); a run whose
// plan is not enabled adds one to verifies_skipped (block 0, beside kernel_runs);
// violations through the warp-aggregated ring append. The batch row of an
// entry is searched in the offsets only when the entry fails.
//
// Sampling (state non-null): every block reads the phase state[0] % period at
// its start; the last block to finish (ticket state[1]) advances state[0] and
// resets the ticket, so the same kernel node works in a replayed CUDA graph.
#include "kvcanary_common.cuh"

namespace kvc {

struct VerifyArgs {
    const i64* records;  // [num_slots, 4]
    i64 num_slots;
    const i64* slot_indices;  // verify plan arrays [capacity]
    const i64* prev_slot_indices;
    const i64* expected_positions;
    const i64* expected_tokens;
    const i64* offsets;  // [offsets_len]
    i64 offsets_len;
    const i64* num_valid;
    const i64* enable;
    i64 capacity;
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
};

template <bool kFp, bool kScan>
__global__ void __launch_bounds__(256, kFp ? KVC_FP_MIN_BLOCKS : 5) verify_entries(VerifyArgs a) {
    __shared__ i64 sh[32];
    __shared__ i64 s_phase;
    if (threadIdx.x == 0) s_phase = a.sample_state != nullptr ? pmod(__ldcg(a.sample_state), a.period) : -1;
    __syncthreads();
    const i64 phase = s_phase;

    const bool enabled = *a.enable == 1;
    i64 n = enabled ? *a.num_valid : 0;
    if (n > a.capacity) n = a.capacity;
    if (n < 0) n = 0;
    const int g = kFp ? lanes_per_fingerprint(n, a.num_folds) : 1;
    const int shift = __ffs(g) - 1;
    const i64 total = n << shift;
    const unsigned lane = lane_id();
    const i64 warp0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    const i64 N = a.num_slots;

    i64 checked = 0;
    for (i64 base = warp0 << 5; base < total; base += warps << 5) {
        const i64 q = base + lane;
        const bool act = q < total;
        const i64 e = q >> shift;
        const bool lead = (q & (g - 1)) == 0;
        i64 slot = 0, prev = -1;
        if (act) {
            slot = a.slot_indices[e];
            prev = a.prev_slot_indices[e];
        }
        // Every active entry is a live row's read: the reserved slot too, which is reported, not read.
        const bool live = act;
        const bool reserved = live && slot == RESERVED_SLOT;
        const bool oor = live && !reserved && (slot < 0 || slot >= N || prev < -1 || prev >= N);
        const bool chk = live && !oor && !reserved;
        const bool fp_sel = chk && (phase < 0 || pmod(slot, a.period) == phase);
        // Entries of a row are consecutive, so the predecessor is mostly the slot of
        // entry e - 1, whose record the lead lane g below loads anyway: its link comes
        // over a shuffle, and only a row's first entry in a warp gathers a second record.
        const i64 below = __shfl_up_sync(FULL_MASK, chk ? slot : -1, g);
        const bool prev_below = lane >= (unsigned)g && prev > 0 && below == prev;
        // Issue the record loads before the fingerprint's, so their latencies overlap.
        Record r = {}, pr = {};
        i64 etok = -1, epos = -1;
        if (lead && live) {
            etok = a.expected_tokens[e];
            epos = a.expected_positions[e];
        }
        if (lead && chk) {
            r = load_record(a.records, slot);
            if (prev > 0 && !prev_below) pr = load_record(a.records, prev);
        }
        const u64 plink = predecessor_link<kScan>(r, pr, prev_below, g);
        u64 fp = 0;
        if (kFp) fp = fingerprint(a.folds, a.num_folds, slot, fp_sel, g);

        bool has = false;
        i64 bits = 0, pos = -1, tok = -1;
        u64 link = 0, elink = 0;
        if (lead && live) {
            ++checked;
            if (reserved) {
                bits = FAIL_RESERVED_SLOT;
            } else if (oor) {
                bits = FAIL_SLOT_OUT_OF_RANGE;
            } else {
                bits = record_failures<kScan>(r, prev, plink, epos, etok, a.check_tokens != 0, fp_sel, fp, elink);
                pos = r.position;
                tok = r.token;
                link = r.link;
            }
            has = bits != 0;
        }
        const i64 row = has ? row_of(a.offsets, a.offsets_len, e) : -1;
        const RowDetail d = entry_detail(prev, prev_position_of(a.records, N, has, prev), r.fingerprint,
                                         fp_sel ? fp : r.fingerprint);
        append_violation(a.ring, a.head, a.ring_capacity, has, a.tag, slot, pos, tok, etok, link, elink, bits, row,
                         epos, d);
    }

    i64 sum = block_sum(checked, sh);
    if (threadIdx.x == 0) {
        if (sum != 0) atomicAdd((u64*)(a.counters + CTR_SLOTS_CHECKED), (u64)sum);
        if (blockIdx.x == 0) {
            atomicAdd((u64*)(a.counters + CTR_KERNEL_RUNS), 1ULL);
            // An overflowed or never-planned plan checks nothing: count it, so it shows.
            if (!enabled) atomicAdd((u64*)(a.counters + CTR_VERIFIES_SKIPPED), 1ULL);
        }
        if (a.sample_state != nullptr) {
            __threadfence();
            if (atomicAdd((u64*)(a.sample_state + 1), 1ULL) == (u64)(gridDim.x - 1)) {
                a.sample_state[0] = __ldcg(a.sample_state) + 1;
                a.sample_state[1] = 0;
                __threadfence();
            }
        }
    }
}

}  // namespace kvc
