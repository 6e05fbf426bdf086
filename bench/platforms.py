"""Where the bench runs: a CUDA device through CuPy, or the CPU (a dry run of the harness).

A platform hands the runner its array module, device string, stream, timers,
and the device-only pieces: the copy-bandwidth probe, a bare kernel launch for
host-overhead comparison, and CUDA-graph capture. CuPy and PyTorch are imported
only when a platform is made.
"""
from __future__ import annotations

import platform as _pyplatform
import time

import numpy as np

from . import probes
from .timing import CudaTimer, TorchTimer, WallTimer

GATHER_INDEX_BYTES = 8  # bench_gather reads one int64 index per element

class CudaPlatform:
    """The current CUDA device; every kvcanary op runs on one non-blocking CuPy stream.

    PyTorch (the baseline) runs on its own current stream: the runner synchronizes
    the device whenever work passes from one to the other.
    """

    kind = "cuda"

    def __init__(self):
        import cupy as cp  # noqa: PLC0415

        self.cp = cp
        self.xp = cp
        self.device_id = int(cp.cuda.runtime.getDevice())
        self.device = f"cuda:{self.device_id}"
        self.props = cp.cuda.runtime.getDeviceProperties(self.device_id)
        l2 = int(self.props.get("l2CacheSize", 0) or 0)
        self.l2_bytes = l2 if l2 > 0 else 60 << 20
        # One stream for everything CuPy does here (inputs, ops, timing, capture): made
        # current, so plain CuPy calls and RawKernel launches are stream-ordered with the ops.
        self._previous = cp.cuda.get_current_stream()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.stream.use()
        self.timer = CudaTimer(cp, self.stream, 2 * self.l2_bytes, spin=lambda *a: self._probe("kvc::bench_spin")(*a))
        self._module = None

    # --- basics -------------------------------------------------------------------
    def sync(self) -> None:
        self.stream.synchronize()
        self.cp.cuda.Device(self.device_id).synchronize()

    def close(self) -> None:
        """Drain the device and make the caller's stream current again."""
        try:
            self.sync()
        except Exception:  # noqa: BLE001  (a sticky CUDA error is already in the results; keep them)
            pass
        finally:
            self._previous.use()

    def free(self) -> None:
        """Return cached blocks of CuPy's (and PyTorch's) pools to the driver."""
        self.sync()
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()
        import sys  # noqa: PLC0415

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def info(self) -> dict:
        cp = self.cp
        name = self.props.get("name", b"?")
        free, total = cp.cuda.runtime.memGetInfo()
        return {"platform": "cuda", "device": name.decode() if isinstance(name, bytes) else str(name),
                "device_id": self.device_id, "l2_bytes": self.l2_bytes, "memory_bytes": int(total),
                "memory_free_bytes": int(free), "sm_count": int(self.props.get("multiProcessorCount", 0)),
                "cupy": cp.__version__, "cuda_runtime": int(cp.cuda.runtime.runtimeGetVersion()),
                "cuda_driver": int(cp.cuda.runtime.driverGetVersion()), "python": _pyplatform.python_version(),
                "host": _pyplatform.node()}

    def rotation_l2(self) -> int:
        return self.l2_bytes

    # --- torch ----------------------------------------------------------------------
    def torch_device(self):
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        return torch.device("cuda", self.device_id)

    def torch_timer(self):
        import torch  # noqa: PLC0415

        return TorchTimer(torch, self.torch_device(), 2 * self.l2_bytes)

    # --- probes ---------------------------------------------------------------------
    def copy_bandwidth(self, nbytes: int, runs: int) -> dict:
        """Device-to-device copy of ``nbytes``: bytes read + written per second (median run)."""
        cp = self.cp
        src = cp.empty(nbytes, dtype=cp.uint8)
        dst = cp.empty(nbytes, dtype=cp.uint8)
        src.data.memset_async(0x5A, nbytes, self.stream)

        def copy(_i):
            dst.data.copy_from_device_async(src.data, nbytes, self.stream)

        t = self.timer.device(copy, runs=max(runs, 1), warmup=3)
        moved = 2 * nbytes
        return {"buffer_bytes": nbytes, "bytes_moved": moved, "time_us": t.device_us, "runs": t.runs,
                "bandwidth_bytes_per_s": moved / (t.device_us * 1e-6), "method": "cudaMemcpyAsync D2D"}

    def bare_launchers(self) -> dict:
        """Zero-argument callables launching an empty RawKernel (no args / 8 args) on the stream."""
        cp = self.cp
        k0 = self._probe("kvc::bench_empty")
        k8 = self._probe("kvc::bench_empty_args")
        a = cp.zeros(8, dtype=cp.int64)
        args8 = (a, a, a, a, a, np.int64(8), np.int64(9), np.int32(1))
        grid, block = (1,), (32,)

        def bare():  # on the current stream, which is self.stream
            k0(grid, block, ())

        def bare_args():
            k8(grid, block, args8)

        return {"bare": bare, "bare_args": bare_args, "_keep": a}

    def _probe(self, name: str):
        if self._module is None:
            self._module = probes.module(self.cp)
        return self._module.get_function(name)

    def gather_probe(self, *, n: int, pool_slots: int, slot_bytes: int, runs: int,
                     orders=("random", "sorted")) -> list[dict]:
        """The fastest read of ``slot_bytes`` at each of ``n`` slots of a ``pool_slots`` pool:
        slots drawn at random, then (``orders``) the same slots sorted. Bytes = indices + slot bytes."""
        cp = self.cp
        words = slot_bytes // 16
        pool = cp.empty(pool_slots * words * 2, dtype=cp.uint64)
        pool.data.memset_async(0x3C, pool.nbytes, self.stream)
        rng = cp.random.default_rng(7)
        idx = rng.integers(1, pool_slots, size=n, dtype=cp.int64)
        sink = cp.zeros(1, dtype=cp.uint64)
        k = self._probe("kvc::bench_gather")
        grid = probes.blocks(n, probes.resident_blocks(self.cp, k, self.device_id))
        out = []
        for order in orders:
            ix = cp.sort(idx) if order == "sorted" else idx
            args = (pool, ix, np.int64(n), np.int64(words), sink)
            t = self.timer.device(lambda _i: k((grid,), (probes.BLOCK,), args), runs=max(runs, 1), warmup=3,
                                  flush=True)
            moved = n * (GATHER_INDEX_BYTES + slot_bytes)
            out.append({"entries": n, "pool_slots": pool_slots, "slot_bytes": slot_bytes, "order": order,
                        "bytes": moved, "time_us": t.device_us, "runs": t.runs,
                        "bandwidth_bytes_per_s": moved / (t.device_us * 1e-6)})
        del pool, idx
        return out

    def capture(self, fn):
        """Capture ``fn()`` (ops on this platform's stream) into a CUDA graph; returns ``launch()``."""
        s = self.stream
        self.sync()
        s.begin_capture()
        try:
            fn()
        except BaseException:
            if s.is_capturing():
                s.end_capture()
            raise
        graph = s.end_capture()
        if hasattr(graph, "upload"):  # older CuPy lacks it; the first launch then uploads
            graph.upload(s)

        def launch():
            graph.launch(s)

        launch.graph = graph
        return launch


class CpuPlatform:
    """NumPy reference and CPU torch: exercises the harness, its figures mean nothing."""

    kind = "cpu"

    def __init__(self):
        self.xp = np
        self.device = "cpu"
        self.stream = None
        self.l2_bytes = 0
        self.timer = WallTimer()

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def free(self) -> None:
        pass

    def info(self) -> dict:
        return {"platform": "cpu", "device": _pyplatform.processor() or _pyplatform.machine(),
                "numpy": np.__version__, "python": _pyplatform.python_version(), "host": _pyplatform.node(),
                "l2_bytes": 0}

    def rotation_l2(self) -> int:
        return 0

    def torch_device(self):
        import torch  # noqa: PLC0415

        return torch.device("cpu")

    def torch_timer(self):
        return WallTimer()

    def copy_bandwidth(self, nbytes: int, runs: int) -> dict:
        src = np.full(nbytes, 0x5A, dtype=np.uint8)
        dst = np.empty_like(src)
        t = self.timer.device(lambda _i: np.copyto(dst, src), runs=max(runs, 1), warmup=1)
        moved = 2 * nbytes
        return {"buffer_bytes": nbytes, "bytes_moved": moved, "time_us": t.device_us, "runs": t.runs,
                "bandwidth_bytes_per_s": moved / (t.device_us * 1e-6), "method": "numpy.copyto"}

    def gather_probe(self, *, n: int, pool_slots: int, slot_bytes: int, runs: int,
                     orders=("random", "sorted")) -> list[dict]:
        words = slot_bytes // 8
        pool = np.full((pool_slots, words), 0x3C, dtype=np.uint64)
        idx = np.random.default_rng(7).integers(1, pool_slots, size=n)
        out = []
        for order in orders:
            ix = np.sort(idx) if order == "sorted" else idx
            t = self.timer.device(lambda _i: np.bitwise_xor.reduce(pool[ix], axis=None), runs=max(runs, 1), warmup=1)
            moved = n * (GATHER_INDEX_BYTES + slot_bytes)
            out.append({"entries": n, "pool_slots": pool_slots, "slot_bytes": slot_bytes, "order": order,
                        "bytes": moved, "time_us": t.device_us, "runs": t.runs,
                        "bandwidth_bytes_per_s": moved / (t.device_us * 1e-6)})
        return out

    def bare_launchers(self) -> dict:
        def bare():
            pass

        return {"bare": bare, "bare_args": bare}

    def capture(self, fn):
        raise NotImplementedError("CUDA graphs need a CUDA device")


class NoCudaDevice(RuntimeError):
    """``--device cuda`` on a machine where CuPy is missing or sees no CUDA device."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text and text[0] else type(e).__name__


def cuda_device_count() -> int:
    """Devices CuPy sees; raises :class:`NoCudaDevice` (saying why) when there are none."""
    try:
        import cupy as cp  # noqa: PLC0415
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "cupy":
            raise NoCudaDevice(f"no CUDA device: CuPy cannot be imported ({_first_line(e)})") from e
        raise NoCudaDevice("no CUDA device: CuPy is not installed") from e
    except Exception as e:  # noqa: BLE001  (a broken CuPy install: no CUDA platform either)
        raise NoCudaDevice(f"no CUDA device: CuPy cannot be imported ({_first_line(e)})") from e
    try:
        n = int(cp.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001  (no driver, driver too old, no device)
        raise NoCudaDevice(f"no CUDA device: CuPy found none ({_first_line(e)})") from e
    if n < 1:
        raise NoCudaDevice("no CUDA device: CuPy found none (device count 0)")
    return n


def make_platform(kind: str):
    if kind == "cpu":
        return CpuPlatform()
    if kind == "cuda":
        cuda_device_count()
        return CudaPlatform()
    raise ValueError(f"kvcanary: --device: expected 'cuda' or 'cpu', got {kind!r}")


def now() -> float:
    return time.monotonic()
