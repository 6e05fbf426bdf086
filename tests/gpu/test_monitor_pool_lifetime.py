"""A JAX-style engine hands the monitor a new KV pool every step (``rebind``): the
monitor must let the old pools go, so GPU memory stays flat however long it runs."""
import gc
import os
import weakref

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with CuPy

import kvcanary_cupy as kc  # noqa: E402

pytestmark = pytest.mark.gpu

STEPS = 120
PAGE, SLOTS, DIM = 4, 64, 64  # 64 slots x 256 bytes per layer, 2 layers: 32 KiB a pool


def _drive(make_pool, rebind_table):
    """Run STEPS decode steps of one request, a fresh pool (same bytes, new buffer) each
    step; returns the number of pools still alive after each step, and the monitor."""
    import cupy as cp  # noqa: PLC0415

    table = cp.zeros((2, SLOTS // PAGE), dtype=cp.int32)
    table[1, :-1] = cp.arange(1, SLOTS // PAGE, dtype=cp.int32)  # position p -> slot p + PAGE
    first = make_pool(0)
    src = lambda pool: kc.RealKvSource(pool, page_size=PAGE, bytes_per_token=DIM * 4, layer_axis=True)  # noqa: E731
    mon = kc.KvCanary(num_slots=SLOTS, block_table=table, page_size=PAGE, max_batch=1, device="cuda",
                      real_kv=src(first), real_kv_mode=kc.RealKvMode.ALL, policy="raise")
    refs, alive = [weakref.ref(first)], []
    del first
    for step in range(STEPS):
        pos = step % (SLOTS - 2 * PAGE)  # wraps: a new request in the same row
        pool = make_pool(step + 1)
        refs.append(weakref.ref(pool))
        mon.rebind(real_kv=src(pool))
        if rebind_table:
            mon.rebind(block_table=table)
        mon.before_forward(cp.asarray([1]), cp.asarray([pos]), cp.asarray([1]))
        mon.after_forward(cp.asarray([100 + step]), cp.asarray([pos]), cp.asarray([pos + PAGE]))
        mon.poll()
        del pool
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
    return alive, mon


def test_fresh_cupy_pools_do_not_accumulate():
    import cupy as cp  # noqa: PLC0415

    pool_bytes = []

    def make_pool(i):
        return cp.full((2, SLOTS, DIM), 1.5, dtype=cp.float32)

    mempool = cp.get_default_memory_pool()

    def tracked(i):
        pool_bytes.append(mempool.used_bytes())
        return make_pool(i)

    alive, mon = _drive(tracked, rebind_table=True)
    assert max(alive) <= 16, alive
    assert alive[-1] <= alive[20] + 1, alive
    # Flat: the memory in use at the end is what it was a hundred steps earlier, give or take a pool.
    assert pool_bytes[-1] <= pool_bytes[20] + 2 * SLOTS * DIM * 4 * 2, pool_bytes[::20]
    assert mon.stats()["violations"] == 0


def test_fresh_jax_pools_do_not_accumulate():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp  # noqa: PLC0415

    if not any(d.platform in ("gpu", "cuda") for d in jax.devices()):
        pytest.skip("JAX has no GPU here")

    def make_pool(i):
        return jnp.full((2, SLOTS, DIM), 1.5, dtype=jnp.float32)

    live_before = len(jax.live_arrays())
    alive, mon = _drive(make_pool, rebind_table=False)
    assert max(alive) <= 16, alive
    assert len(jax.live_arrays()) <= live_before + 16
    assert mon.stats()["violations"] == 0
