"""The bench's own CUDA kernels (``bench/probes.cu``): source, options, names, the compiled module.

The probes are not part of the library: the bench compiles them itself, with the
library's common header inlined exactly as the library inlines it into its own
kernels (:func:`kvcanary_cupy.backends.cuda_sources.inline_header`), so the text
needs no include path. :func:`source` imports no CuPy: the NVRTC compile check
(``tests/test_kernels_compile.py``) compiles this text on machines without a GPU.
"""
from __future__ import annotations

import functools
from pathlib import Path

from kvcanary_cupy.backends import cuda_sources

FILE = Path(__file__).resolve().with_name("probes.cu")
OPTIONS = cuda_sources.OPTIONS
NAME_EXPRESSIONS = ("kvc::bench_empty", "kvc::bench_empty_args", "kvc::bench_gather", "kvc::bench_spin")
BLOCK = 256  # threads per block, as the library's kernels
BLOCKS_PER_SM = 8  # where CuPy lacks the occupancy call: 2048 resident threads per SM at 256 per block


@functools.lru_cache(maxsize=None)
def source() -> str:
    """The text of ``probes.cu`` with the library's common header inlined."""
    return cuda_sources.inline_header(FILE.read_text(), what=FILE.name)


def module(cp):
    """A ``cupy.RawModule`` of the probes (compiled on first use of a kernel; CuPy caches it on disk)."""
    return cp.RawModule(code=source(), options=OPTIONS, name_expressions=NAME_EXPRESSIONS)


def resident_blocks(cp, kernel, device_id: int) -> int:
    """Blocks of :data:`BLOCK` threads of ``kernel`` (a ``cupy.RawKernel``) resident on the device at
    once: the occupancy per SM times the SM count, the grid of a grid-stride kernel in one wave."""
    sms = int(cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id))
    try:
        per_sm = int(cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, BLOCK, 0))
    except Exception:  # noqa: BLE001  (a CuPy without the occupancy call: assume full residency)
        per_sm = BLOCKS_PER_SM
    return max(1, per_sm) * sms


def blocks(threads: int, resident: int) -> int:
    """Grid of a grid-stride kernel: enough blocks for ``threads``, at most one full wave."""
    return max(1, min(-(-threads // BLOCK), resident))
