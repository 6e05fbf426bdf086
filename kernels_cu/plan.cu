// plan.cu: derive a step's verify entries and write metadata on the device.
//
// Two kernels, one argument list:
//   plan_rows  one block per batch row (grid-stride): row validity (every slot
//              the row reads must be readable), entry count, write length and
//              chain seed; counts go into offsets[r + 1]; the last block to
//              finish (ticket) turns them into exclusive prefix sums and writes
//              the plan scalars, then resets the ticket to 0 for the next run.
//   plan_fill  grid-stride over verify entries; each finds its row by binary
//              search over the offsets and fills slot, prev slot, position and
//              expected token.
// Row r reads positions [max(start - 1, 0), P): its window, the window head's
// predecessor and (P > 0) the seed at P - 1, so one pass over that range
// decides validity exactly as the reference does.
#include "kvcanary_common.cuh"

namespace kvc {

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
    i64 vp_capacity, vp_max_batch;
    i64* wp_offsets;  // write plan, or all null
    i64* wp_seeds;    // [wp_max_batch]
    i64* wp_num_rows;
    i64* wp_input_errors;
    i64 wp_max_batch;
    i64* ticket;  // one int64, 0 between runs
};

// T(table(rp, pos)): false when unreadable (negative table value, a slot that
// wraps negative, a LUT index outside the LUT or a negative LUT value).
__device__ __forceinline__ bool slot_at(const PlanArgs& a, i64 rp, i64 pos, i64& slot) {
    i64 v = load_index(a.table, width_bit(a.widths, W_TABLE), rp * a.twidth + pos / a.page);
    if (v < 0) return false;
    i64 s = a.page == 1 ? v : (i64)((u64)v * (u64)a.page + (u64)(pos % a.page));
    if (s < 0) return false;
    if (a.lut_len >= 0) {
        if (s >= a.lut_len) return false;
        s = load_index(a.lut, width_bit(a.widths, W_LUT), s);
        if (s < 0) return false;
    }
    slot = s;
    return true;
}

__device__ __forceinline__ i64 window_start(const PlanArgs& a, i64 P) {
    return (a.swa_size > 0 && P > a.swa_size) ? P - a.swa_size : 0;
}

// In place: a[1..n] holds counts; afterwards a[0] = 0 and a[1..n] the inclusive
// sums, a[n+1..tail_end] the total. Returns the total (every thread). One block.
__device__ i64 scan_counts(i64* a, i64 n, i64 tail_end, i64* sh) {
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
    for (i64 i = n + 1 + t; i <= tail_end; i += nt) a[i] = total;
    __syncthreads();
    return total;
}

__global__ void __launch_bounds__(256) plan_rows(PlanArgs a) {
    __shared__ i64 sh[33];
    __shared__ int s_last;
    const bool w_rpi = width_bit(a.widths, W_RPI), w_pre = width_bit(a.widths, W_PRE),
               w_ext = width_bit(a.widths, W_EXT);
    const i64 width = a.twidth * a.page;
    i64 errors = 0;  // thread 0
    for (i64 r = blockIdx.x; r < a.bs; r += gridDim.x) {
        i64 rp = load_index(a.rpi, w_rpi, r);
        i64 P = load_index(a.pre, w_pre, r);
        i64 E = load_index(a.ext, w_ext, r);
        bool active = rp != PADDING_REQ;
        bool ok = active && rp > 0 && rp < a.nreq && P >= 0 && E >= 0 && P <= width && E <= width - P;
        if (a.erows >= 0) ok = ok && rp < a.erows;
        i64 start = ok ? window_start(a, P) : 0;
        bool bad = false;
        if (ok) {
            i64 lo = start > 0 ? start - 1 : 0;
            for (i64 pos = lo + threadIdx.x; pos < P; pos += blockDim.x) {
                i64 s;
                if (!slot_at(a, rp, pos, s)) bad = true;
            }
        }
        bad = __syncthreads_or(bad);
        if (threadIdx.x == 0) {
            bool valid = ok && !bad;
            if (active && !valid) ++errors;
            if (a.vp_offsets != nullptr) a.vp_offsets[r + 1] = valid ? P - start : 0;
            if (a.wp_offsets != nullptr) {
                a.wp_offsets[r + 1] = valid ? E : 0;
                i64 seed = -1;
                if (valid && P > 0 && E > 0) slot_at(a, rp, P - 1, seed);
                a.wp_seeds[r] = seed;
            }
        }
    }
    if (threadIdx.x == 0) {
        if (errors != 0) {
            if (a.vp_input_errors != nullptr) atomicAdd((u64*)a.vp_input_errors, (u64)errors);
            if (a.wp_input_errors != nullptr) atomicAdd((u64*)a.wp_input_errors, (u64)errors);
        }
        __threadfence();
        s_last = atomicAdd((u64*)a.ticket, 1ULL) == (u64)(gridDim.x - 1);
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (a.vp_offsets != nullptr) {
        i64 total = scan_counts(a.vp_offsets, a.bs, a.vp_max_batch, sh);
        if (threadIdx.x == 0) {
            *a.vp_requested = total;
            *a.vp_num_valid = total < a.vp_capacity ? total : a.vp_capacity;
            *a.vp_enable = total <= a.vp_capacity ? 1 : 0;
        }
    }
    if (a.wp_offsets != nullptr) {
        scan_counts(a.wp_offsets, a.bs, a.wp_max_batch, sh);
        for (i64 i = a.bs + threadIdx.x; i < a.wp_max_batch; i += blockDim.x) a.wp_seeds[i] = -1;
        if (threadIdx.x == 0) *a.wp_num_rows = a.bs;
    }
    if (threadIdx.x == 0) *a.ticket = 0;
}

__global__ void __launch_bounds__(256) plan_fill(PlanArgs a) {
    if (a.vp_offsets == nullptr || *a.vp_enable != 1) return;
    const i64 n = *a.vp_num_valid;
    const bool w_rpi = width_bit(a.widths, W_RPI), w_pre = width_bit(a.widths, W_PRE);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        i64 r = row_of(a.vp_offsets, a.bs + 1, e);
        if (r < 0 || r >= a.bs) continue;  // cannot happen with the offsets plan_rows wrote
        i64 rp = load_index(a.rpi, w_rpi, r);
        i64 P = load_index(a.pre, w_pre, r);
        i64 pos = window_start(a, P) + (e - a.vp_offsets[r]);
        i64 slot = -1, prev = -1;
        slot_at(a, rp, pos, slot);
        if (pos > 0) slot_at(a, rp, pos - 1, prev);
        i64 tok = -1;
        if (a.erows >= 0) {
            i64 k = pos + a.eoffset;
            i64 lim = load_index(a.evl, width_bit(a.widths, W_EVL), r);
            if (lim > a.ewidth) lim = a.ewidth;
            if (k >= 0 && k < lim) tok = load_index(a.etab, width_bit(a.widths, W_ETAB), rp * a.ewidth + k);
        }
        a.vp_slot[e] = slot;
        a.vp_prev[e] = prev;
        a.vp_epos[e] = pos;
        a.vp_etok[e] = tok;
    }
}

}  // namespace kvc
