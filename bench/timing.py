"""Timers: CUDA events for device time, ``perf_counter_ns`` for host time.

Device time of an op is measured run by run: an event pair brackets each run on
the op's stream, and the figure reported is the median over the runs. Between
runs the caller's inputs rotate over several sets (see ``cases.rotation``); where
the sets are too small to push each other out of L2, the timer overwrites a
scratch buffer of twice the L2 size between runs, outside the bracketed interval.

Before each timed run the device is given work to do (``hold()``: a kernel that waits
HOLD_NS on the device, then the flush if any), so the run's launches are queued behind it
and its events bracket device time alone. Without it an op shorter than its own host
call would be timed at the host's pace: the start event fires on an idle device, and the
interval then includes the host's time to submit the launches (measured on an H200: a
decode write timed back to back at 12 to 14 us, behind a hold at 7 to 8 us).

Host time is the wall time of the Python call (``perf_counter_ns`` around it),
without synchronizing the device after each call; the device is drained every
``sync_every`` calls, outside the timed interval, so the launch queue never fills.

Three timers share one interface:
    ``CudaTimer``  events on a CuPy stream (the kvcanary ops run on it)
    ``TorchTimer`` events on PyTorch's current stream (the baseline)
    ``WallTimer``  wall clock only (a CPU dry run)
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

HOLD_NS = 200_000  # longer than any op's host call (a monitor step's is 20 to 60 us)


def median(xs) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


@dataclass
class Timing:
    """The outcome of one measurement: medians (µs) and how it was taken."""

    device_us: float
    host_us: float
    runs: int
    device_samples: list
    host_samples: list

    def as_dict(self) -> dict:
        return {"device_us": self.device_us, "host_us": self.host_us, "runs": self.runs,
                "device_min_us": min(self.device_samples) if self.device_samples else None,
                "device_max_us": max(self.device_samples) if self.device_samples else None}


def runs_within(first_s: float, runs: int, budget_s: float, min_runs: int = 3) -> int:
    """Runs that fit ``budget_s`` when one run takes ``first_s`` (never fewer than ``min_runs``)."""
    if first_s <= 0:
        return runs
    return max(min(runs, min_runs), min(runs, int(budget_s / first_s)))


class _Timer:
    """Shared loop; subclasses supply events, flush and synchronization."""

    def sync(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Evict L2 (no-op where there is none to evict)."""

    def hold(self) -> None:
        """Queue HOLD_NS of device work (no-op without a device)."""

    def _pair(self):
        return None

    def _record(self, ev) -> None:
        pass

    def _elapsed_us(self, pair) -> float:
        raise NotImplementedError

    def device(self, fn, *, runs: int, warmup: int = 3, flush: bool = False, budget_s: float | None = None,
               before=None) -> Timing:
        """Time ``fn(i)`` (i = run index, for rotating input sets) run by run.

        The first warm-up run is timed on the wall clock; when ``runs`` of that
        length would exceed ``budget_s``, fewer runs are taken (at least 3) and
        one warm-up suffices. ``before()``, if given, queues work after the hold and
        the flush of each timed run, outside its interval.
        """
        self.sync()
        t0 = time.perf_counter()
        fn(0)
        self.sync()
        first = time.perf_counter() - t0
        if budget_s is not None:
            runs = runs_within(first, runs, budget_s)
            if first * (warmup + runs) > budget_s:
                warmup = 1
        for i in range(1, warmup):
            fn(i)
        pairs = [self._pair() for _ in range(runs)]
        host = []
        pc = time.perf_counter_ns
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for i in range(runs):
                self.hold()
                if flush:
                    self.flush()
                if before is not None:
                    before()
                a, b = pairs[i] if pairs[i] is not None else (None, None)
                self._record(a)
                h0 = pc()
                fn(i)
                h1 = pc()
                self._record(b)
                host.append((h1 - h0) / 1000.0)
            self.sync()
        finally:
            if gc_was:
                gc.enable()
        dev = [self._elapsed_us(p) for p in pairs] if pairs and pairs[0] is not None else list(host)
        return Timing(median(dev), median(host), runs, dev, host)

    def host(self, fn, *, calls: int, warmup: int = 20, sync_every: int = 64) -> list:
        """Host µs per call of ``fn()`` (no device sync inside the timed interval)."""
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        pc = time.perf_counter_ns
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for i in range(calls):
                t0 = pc()
                fn()
                t1 = pc()
                out.append((t1 - t0) / 1000.0)
                if (i + 1) % sync_every == 0:
                    self.sync()
            self.sync()
        finally:
            if gc_was:
                gc.enable()
        return out


class CudaTimer(_Timer):
    """CUDA events on a CuPy stream; ``flush()`` reads ``flush_bytes`` of scratch;
    ``hold()`` launches ``spin`` (bench_spin: a kernel that waits its argument's ns), if given."""

    def __init__(self, cp, stream, flush_bytes: int, spin=None):
        self.cp = cp
        self.stream = stream
        self.flush_bytes = int(flush_bytes)
        self._scratch = None
        self._spin = spin

    def hold(self) -> None:
        if self._spin is not None:
            self._spin((1,), (1,), (self.cp.int64(HOLD_NS),))  # on the current stream: the timer's

    def sync(self) -> None:
        self.stream.synchronize()

    def flush(self) -> None:
        # Read, not write: a written scratch would leave L2 full of dirty lines that the
        # timed op then pays to write back.
        if self.flush_bytes <= 0:
            return
        if self._scratch is None:
            self._scratch = self.cp.ones(self.flush_bytes // 8, dtype=self.cp.int64)
        self._scratch.sum()  # on CuPy's current stream, which the platform made this timer's

    def _pair(self):
        return self.cp.cuda.Event(), self.cp.cuda.Event()

    def _record(self, ev) -> None:
        ev.record(self.stream)

    def _elapsed_us(self, pair) -> float:
        return self.cp.cuda.get_elapsed_time(pair[0], pair[1]) * 1000.0

    def release(self) -> None:
        self._scratch = None


class TorchTimer(_Timer):
    """CUDA events on PyTorch's current stream (the baseline's stream)."""

    def __init__(self, torch, device, flush_bytes: int):
        self.torch = torch
        self.device_ = device
        self.flush_bytes = int(flush_bytes)
        self._scratch = None

    def sync(self) -> None:
        self.torch.cuda.current_stream(self.device_).synchronize()

    def hold(self) -> None:
        self.torch.cuda._sleep(2 * HOLD_NS)  # clock cycles: at least HOLD_NS up to a 2 GHz clock

    def flush(self) -> None:
        if self.flush_bytes <= 0:
            return
        if self._scratch is None:
            self._scratch = self.torch.ones(self.flush_bytes // 8, dtype=self.torch.int64, device=self.device_)
        self._scratch.sum()  # read only, as CudaTimer.flush

    def _pair(self):
        E = self.torch.cuda.Event
        return E(enable_timing=True), E(enable_timing=True)

    def _record(self, ev) -> None:
        ev.record()

    def _elapsed_us(self, pair) -> float:
        return pair[0].elapsed_time(pair[1]) * 1000.0

    def release(self) -> None:
        self._scratch = None


class WallTimer(_Timer):
    """Wall clock only: device time is reported as the call's wall time."""

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass
