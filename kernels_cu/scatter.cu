// scatter.cu: copy each request's token ids into its row of the expected-token
// table, for the token check. One block per batch row (grid-stride), threads
// over the row's tokens. Rows that are padding, outside the table, or whose
// token span lies outside `tokens` (or is empty) are skipped.
#include "kvcanary_common.cuh"

namespace kvc {

// Bits of `widths`: which inputs are int64 (else int32).
inline constexpr int W_TABLE_OUT = 0, W_TOKENS = 1, W_OFFSETS = 2, W_REQ = 3;

struct ScatterArgs {
    void* table;  // [nreq, width], written
    i64 nreq, width;
    const void* tokens;  // [ntok]
    i64 ntok;
    const void* offsets;  // [>= bs + 1]
    const void* req_pool_indices;  // [bs]
    i64 bs;
    i64 widths;
};

__global__ void __launch_bounds__(256) scatter_expected_tokens(ScatterArgs a) {
    const bool w_out = width_bit(a.widths, W_TABLE_OUT), w_tok = width_bit(a.widths, W_TOKENS),
               w_off = width_bit(a.widths, W_OFFSETS), w_req = width_bit(a.widths, W_REQ);
    for (i64 r = blockIdx.x; r < a.bs; r += gridDim.x) {
        const i64 rp = load_index(a.req_pool_indices, w_req, r);
        const i64 lo = load_index(a.offsets, w_off, r), hi = load_index(a.offsets, w_off, r + 1);
        if (rp == PADDING_REQ || rp < 0 || rp >= a.nreq || lo < 0 || hi > a.ntok || hi <= lo) continue;
        const i64 n = hi - lo < a.width ? hi - lo : a.width;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            const i64 v = load_index(a.tokens, w_tok, lo + j);
            if (w_out) ((i64*)a.table)[rp * a.width + j] = v;
            else ((int*)a.table)[rp * a.width + j] = (int)v;
        }
    }
}

}  // namespace kvc
