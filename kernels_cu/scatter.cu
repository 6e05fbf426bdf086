// scatter.cu: copy each request's token ids into its row of the expected-token
// table, for the token check. One block per batch row (grid-stride), threads
// over the row's tokens. Padding rows and empty spans are skipped; so are rows
// outside the table and spans outside `tokens`, each counted in *errors (if given).
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
    i64* errors;  // [1], rows skipped for out-of-range input are added to it (or null)
};

__global__ void __launch_bounds__(256) scatter_expected_tokens(ScatterArgs a) {
    const bool w_out = width_bit(a.widths, W_TABLE_OUT), w_tok = width_bit(a.widths, W_TOKENS),
               w_off = width_bit(a.widths, W_OFFSETS), w_req = width_bit(a.widths, W_REQ);
    for (i64 r = blockIdx.x; r < a.bs; r += gridDim.x) {
        const i64 rp = load_index(a.req_pool_indices, w_req, r);
        const i64 lo = load_index(a.offsets, w_off, r), hi = load_index(a.offsets, w_off, r + 1);
        if (rp == PADDING_REQ || hi == lo) continue;
        if (rp < 0 || rp >= a.nreq || lo < 0 || hi > a.ntok || hi < lo) {
            if (threadIdx.x == 0 && a.errors != nullptr) atomicAdd((u64*)a.errors, 1ULL);
            continue;
        }
        const i64 n = hi - lo < a.width ? hi - lo : a.width;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            const i64 v = load_index(a.tokens, w_tok, lo + j);
            if (w_out) ((i64*)a.table)[rp * a.width + j] = v;
            else ((int*)a.table)[rp * a.width + j] = (int)v;
        }
    }
}

}  // namespace kvc

// ---------------------------------------------------------------------------------
// apply_updates: a batch of changes a host prepared for device arrays, applied in one
// launch that reads them in place from pinned host memory (mapped into the device's
// address space under unified addressing), so they need no copy call first: words
// [0, copy_words) go to `copy_to` with `shift` added (`words` may be device memory
// too), then update k sets element index[k] of target t to value[k], where target t
// takes updates [end[t - 1], end[t]) (end[-1] = 0). An index outside its target is
// never written: it is counted in *skipped (when given). Last, with `rows_from` given, row i
// of that int32 table (an engine's block table) is copied into row copy_to[i]'s index,
// words[i] + shift, of `rows_to`, one block per row: the rows the copied words name; a row
// index outside `rows_to` is never written and counts one skipped update.
namespace kvc {

inline constexpr int MAX_UPDATE_TARGETS = 4;

struct UpdateArgs {
    const i64* words;   // host: copy_words words to copy
    i64* copy_to;       // device: [copy_words]
    i64 copy_words;
    i64 shift;
    const i64* index;   // host: [count] element indices
    const int* value;   // host: [count] values
    i64 count;
    int* target[MAX_UPDATE_TARGETS];  // device int32 arrays (flat)
    i64 target_len[MAX_UPDATE_TARGETS];
    i64 end[MAX_UPDATE_TARGETS];  // cumulative update counts
    i64* skipped;       // device: updates not applied, added to (or null)
    const int* rows_from;  // device: [>= row_count, rows_from_stride], rows copied (or null)
    i64 rows_from_stride;  // elements from one row of rows_from to the next
    i64 row_count, row_width;  // rows copied, elements of each (at most rows_to_width are)
    int* rows_to;          // device: [rows_to_count, rows_to_width]
    i64 rows_to_count, rows_to_width;
};

__global__ void __launch_bounds__(256) apply_updates(UpdateArgs a) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 i = first; i < a.copy_words; i += stride) a.copy_to[i] = a.words[i] + a.shift;
    i64 skipped = 0;
    for (i64 k = first; k < a.count; k += stride) {
        int t = 0;
        while (t < MAX_UPDATE_TARGETS - 1 && k >= a.end[t]) ++t;
        const i64 j = a.index[k];
        if (k < a.end[t] && j >= 0 && j < a.target_len[t]) a.target[t][j] = a.value[k];
        else ++skipped;
    }
    if (a.rows_from != nullptr) {
        const i64 width = a.row_width < a.rows_to_width ? a.row_width : a.rows_to_width;
        for (i64 i = blockIdx.x; i < a.row_count; i += gridDim.x) {
            const i64 r = a.words[i] + a.shift;  // the words copy_to[i] gets: no wait for that copy
            if (r < 0 || r >= a.rows_to_count) {
                if (threadIdx.x == 0) ++skipped;
                continue;
            }
            const int* from = a.rows_from + i * a.rows_from_stride;
            int* to = a.rows_to + r * a.rows_to_width;
            for (i64 j = threadIdx.x; j < width; j += blockDim.x) to[j] = from[j];
        }
    }
    if (skipped != 0 && a.skipped != nullptr) atomicAdd((u64*)a.skipped, (u64)skipped);
}

}  // namespace kvc
