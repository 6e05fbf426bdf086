"""What the engine-connector benches share: timing an object's calls, and a run per batch size.

Used by ``bench.vllm_connector_overhead`` (vLLM's CPU engine) and ``bench.vllm_gpu_host``
(the connector's worker side on CUDA).
"""
from __future__ import annotations

import contextlib
import json
import time


@contextlib.contextmanager
def timed_calls(obj, names, acc: list):
    """Within the block, every call of ``obj.<name>`` (each of ``names``) adds its wall time to
    ``acc[0]``; the attributes are put back after it (bench only: the wrappers cost host time)."""
    own = {n: n in getattr(obj, "__dict__", {}) for n in names}
    originals = {n: getattr(obj, n) for n in names}

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t0
        return wrapper
    for n, fn in originals.items():
        setattr(obj, n, timed(fn))
    try:
        yield acc
    finally:
        for n, fn in originals.items():
            if own[n]:
                setattr(obj, n, fn)
            else:
                delattr(obj, n)


def run_batches(batches: str, run, line, json_path: str | None, variants=(None,)) -> int:
    """``run(batch)`` for each of the comma-separated ``batches`` (``run(batch, variant)`` for each
    variant of ``variants`` when given, all batches of the first variant first), printing
    ``line(result)`` as each ends; the results as a JSON list at ``json_path`` when given. Returns 0."""
    results = []
    for v, b in ((v, int(x)) for v in variants for x in batches.split(",")):
        r = run(b) if v is None else run(b, v)
        results.append(r)
        print(line(r), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
