"""A new KV pool every step (the JAX way) must not pile up on the GPU.

A JAX engine updates its KV pool functionally: every step makes a new pool array
(``pool.at[slots].set(kv)``) and wraps it in a new ``RealKvSource``. Here 120 such
steps run through the raw ops (``kc.plan`` / ``kc.verify`` / ``kc.write`` with
``real_kv=kc.RealKvSource(pool, ...)``), with CuPy pools and, where JAX has a GPU,
JAX pools. The pools must not be kept alive by the library (weak references to
them, after ``gc.collect()``), CuPy's memory pool must stay flat, and the records,
violations and counters must equal, byte for byte, the NumPy reference's after
the same steps on host pools.
"""
from __future__ import annotations

import collections
import gc
import os
import weakref

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with CuPy

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy import RealKvMode  # noqa: E402

pytestmark = pytest.mark.gpu

STEPS = 120
BS = 4  # requests, one token each per step
N = BS * STEPS + 64  # slots
BPT = 1024  # bytes per slot: a pool is N * BPT bytes, about 0.5 MiB
MAX_LIVE_POOLS = 16
MEMORY_SLACK = 64 << 10  # bytes; a pool kept per step would add 0.5 MiB each
JAX_MEMORY_SLACK = MEMORY_SLACK + 4 * N * BPT  # JAX frees buffers asynchronously: a few pools of play
WARM_STEP = 20


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


def _jax_or_skip():
    jax = pytest.importorskip("jax")
    try:
        if not jax.devices("gpu"):
            pytest.skip("JAX sees no GPU")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    return jax


def _workload():
    """Slots (distinct, never 0), tokens, and the KV bytes each step writes."""
    rng = np.random.default_rng(7)
    slots = (1 + rng.permutation(N - 1)[: BS * STEPS]).reshape(BS, STEPS).astype(np.int64)
    table = np.zeros((BS + 1, STEPS + 1), dtype=np.int64)
    table[1:, :STEPS] = slots
    tokens = rng.integers(0, 1 << 20, size=(BS, STEPS))
    kv = rng.integers(0, 256, size=(STEPS, BS, BPT), dtype=np.uint8)
    first = rng.integers(0, 256, size=(N, BPT), dtype=np.uint8)
    return table, tokens, kv, first


class Pools:
    """How one framework makes its first pool and each step's new one."""

    def __init__(self, first, update):
        self.first, self.update = first, update


def _numpy_pools():
    def update(pool, slots, vals):
        new = pool.copy()
        new[slots] = vals
        return new

    return Pools(lambda host: host.copy(), update)


def _cupy_pools(cp):
    def update(pool, slots, vals):
        new = pool.copy()
        new[cp.asarray(slots)] = cp.asarray(vals)
        return new

    return Pools(cp.asarray, update)


def _jax_pools(jax):
    jnp = jax.numpy

    def update(pool, slots, vals):
        return pool.at[jnp.asarray(slots.astype(np.int32))].set(jnp.asarray(vals))

    return Pools(jnp.asarray, update)


def _run(device, xp, pools: Pools, on_step=None):
    """STEPS decode steps, each verifying the prefix and writing one token per request
    against a new pool; returns records, violation rows (a multiset), counters."""
    table, tokens, kv, first = _workload()
    canary = kc.CanaryBuffer.allocate(num_slots=N, device=device)
    log = kc.ViolationLog.allocate(capacity=256, device=device)
    vp = kc.VerifyPlan.allocate(capacity=BS * STEPS, max_batch=BS, device=device)
    wp = kc.WritePlan.allocate(max_batch=BS, device=device)
    # Long-lived step inputs, refilled in place (as an engine with graphs does).
    rpi = xp.asarray(np.arange(1, BS + 1, dtype=np.int64))
    pre = xp.zeros(BS, dtype=np.int64)
    ext = xp.ones(BS, dtype=np.int64)
    ids = xp.zeros(BS, dtype=np.int64)
    pos = xp.zeros(BS, dtype=np.int64)
    loc = xp.zeros(BS, dtype=np.int64)
    req_to_token = xp.asarray(table)
    pool = pools.first(first)
    for s in range(STEPS):
        pool = pools.update(pool, table[1:, s], kv[s])
        src = kc.RealKvSource(pool, page_size=1, bytes_per_token=BPT)
        pre.fill(s)
        kc.plan(vp, wp, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, req_to_token=req_to_token)
        kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY, real_kv=src, real_kv_mode=RealKvMode.ALL)
        ids[...] = xp.asarray(tokens[:, s])
        pos.fill(s)
        loc[...] = xp.asarray(table[1:, s])
        kc.write(canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc, log=log, tag=kc.LaunchTag.WRITE,
                 real_kv=src, real_kv_mode=RealKvMode.ALL)
        del src
        if on_step is not None:
            on_step(s, pool)
    rows = collections.Counter(tuple(int(x) for x in r) for r in log.rows())
    return canary.host_records(), rows, log.counters()


class Tracker:
    """Weak references to every pool a run made; live pools and memory per step."""

    def __init__(self, used_bytes=None):
        self.refs, self.live, self.used = [], [], {}
        self.used_bytes = used_bytes

    def __call__(self, step, pool):
        try:
            self.refs.append(weakref.ref(pool))
        except TypeError:  # a framework whose arrays take no weak reference: memory only
            pass
        wait = getattr(pool, "block_until_ready", None)  # JAX: its updates run asynchronously
        if wait is not None:
            wait()
        gc.collect()
        self.live.append(sum(r() is not None for r in self.refs))
        if self.used_bytes is not None and step + 1 in (WARM_STEP, STEPS):
            self.used[step + 1] = self.used_bytes()


@pytest.fixture(scope="module")
def reference():
    return _run("cpu", np, _numpy_pools())


def _check(got, want, tracker):
    rec, rows, counters = got
    want_rec, want_rows, want_counters = want
    assert np.array_equal(rec, want_rec)
    assert rows == want_rows and not rows  # every step verifies clean
    assert counters == want_counters
    assert counters["slots_written"] == BS * STEPS and counters["kernel_runs"] == 2 * STEPS
    if tracker.refs:
        assert max(tracker.live) <= MAX_LIVE_POOLS, tracker.live


def test_cupy_pools_do_not_pile_up(cp, reference):
    mem = cp.get_default_memory_pool()

    def used():
        cp.cuda.Device().synchronize()
        return mem.used_bytes()

    t = Tracker(used)
    got = _run("cuda", cp, _cupy_pools(cp), on_step=t)
    _check(got, reference, t)
    assert len(t.refs) == STEPS
    assert t.used[STEPS] <= t.used[WARM_STEP] + MEMORY_SLACK, t.used


def test_jax_pools_do_not_pile_up(cp, reference):
    jax = _jax_or_skip()
    dev = jax.devices("gpu")[0]

    def used():
        cp.cuda.Device().synchronize()
        stats = dev.memory_stats() or {}
        return stats.get("bytes_in_use", 0) + cp.get_default_memory_pool().used_bytes()

    t = Tracker(used)
    got = _run("cuda", cp, _jax_pools(jax), on_step=t)
    _check(got, reference, t)
    assert t.used[STEPS] <= t.used[WARM_STEP] + JAX_MEMORY_SLACK, t.used
