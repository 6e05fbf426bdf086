// probes.cu: kernels the benchmark harness times to put the ops' figures in context.
// Not part of the library: bench/probes.py compiles this file with the library's
// common header inlined (kvcanary_cupy.backends.cuda_sources.inline_header).
//
// bench_empty, bench_empty_args: the bare launches host overhead is compared to.
// bench_spin: holds one thread busy for `ns` nanoseconds of the global timer, so the
// launches queued behind it measure the host's cost alone (bench/selfcheck.py).
// bench_gather: the cheapest way to read `words` 16-byte words at each of n
// indices (a slot starts at word idx * words), the access pattern of verify's
// record and KV reads. Its time at random indices is the floor that scattered
// slots allow, beside the copy floor of sequential bytes. The loads are folded
// and stored only if the fold hits a value it does not, so none is dropped.
#include "kvcanary_common.cuh"

namespace kvc {

__global__ void bench_empty() {}

__global__ void bench_empty_args(const i64*, const i64*, const i64*, i64*, i64*, i64, i64, int) {}

__global__ void bench_spin(i64 ns) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < (u64)ns);
}

__global__ void __launch_bounds__(256) bench_gather(const ulonglong2* pool, const i64* idx, i64 n, i64 words,
                                                    u64* sink) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    u64 acc = 0;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        const ulonglong2* p = pool + idx[e] * words;
#pragma unroll 8
        for (i64 w = 0; w < words; ++w) {
            const ulonglong2 v = __ldg(p + w);
            acc ^= v.x + v.y;
        }
    }
    if (acc == 0x9E3779B97F4A7C15ULL) *sink = acc;
}

}  // namespace kvc
