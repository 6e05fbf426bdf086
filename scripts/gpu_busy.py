"""Keep the GPU busy from a second process for SECONDS (default 60): matrix products
in a loop. With the device shared, work queued on a stream runs later than the host
expects, so a missing order between two streams shows as wrong results instead of
hiding behind an idle device. Used by the `contention` stage of scripts/gpu_suite.sh.

    python scripts/gpu_busy.py 60
"""
import sys
import time

import cupy as cp


def main(seconds: float) -> None:
    a = cp.random.random((4096, 4096), dtype=cp.float32)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a = a @ a
            a /= cp.abs(a).max() + 1  # keep the values finite
        cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
