"""The agreement kernels (kernels_cu/digest.cu) against their NumPy twins, byte for byte.

digest_rows: random rows (int32 and int64, lengths up to a few hundred thousand so the
grid has many blocks, device-held counts and gates, bad counts) give the same digest on
both backends, launch after launch (the kernel's launch state resets itself), and
inside a CUDA graph replayed after the rows changed in place. compare_digests: random
gathered digests (majorities, ties, all agreeing) and log heads give the same state and
the same violation rows as a multiset (the GPU appends in no fixed order).
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.runtime import to_host

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


def random_rows(rng):
    rows = []
    for k in range(int(rng.integers(1, 8))):
        n = int(rng.choice([0, 1, 31, 257, 5000, int(rng.integers(1, 300_000))]))
        dt = np.int32 if rng.random() < 0.4 else np.int64
        hi = np.iinfo(dt).max
        vals = rng.integers(-hi, hi, size=n, dtype=np.int64).astype(dt)
        count = None if rng.random() < 0.5 else np.array([int(rng.integers(-10, n + 10))], np.int64)
        gate = None if rng.random() < 0.6 else np.array([int(rng.choice([0, 1, 1, 2]))], np.int64)
        rows.append((vals, count, gate, int(rng.integers(-(1 << 63), 1 << 63))))
    return rows


def build(xp, rows, carry):
    spec = [kc.DigestRow(xp.asarray(v), count=None if c is None else xp.asarray(c),
                         gate=None if g is None else xp.asarray(g), salt=s) for v, c, g, s in rows]
    out = xp.zeros(1 + carry.shape[0], dtype=np.int64)
    return kc.Digest(spec, out=out, carry=xp.asarray(carry)), spec


@pytest.mark.parametrize("seed", range(40))
def test_digest_parity(cp, seed):
    rng = np.random.default_rng(seed)
    rows = random_rows(rng)
    carry = rng.integers(-100, 100, size=int(rng.integers(0, 3)))
    ref, _ = build(np, rows, carry)
    dev, _ = build(cp, rows, carry)
    ref.run()
    for _ in range(3):  # the launch state is zero again after each launch
        dev.run()
        assert np.array_equal(to_host(dev.out), ref.out), seed


def test_digest_in_a_cuda_graph_sees_rows_refilled_in_place(cp):
    rng = np.random.default_rng(7)
    rows = [(rng.integers(0, 1 << 40, size=100_000), np.array([90_000]), None, 5),
            (rng.integers(0, 1 << 20, size=64).astype(np.int32), None, np.array([1]), 6)]
    carry = np.array([3])
    dev, spec = build(cp, rows, carry)
    stream = cp.cuda.Stream(non_blocking=True)
    dev.run(stream=stream)  # prepare (upload the descriptor table) before the capture
    stream.synchronize()
    dev.out.fill(-1)
    stream.begin_capture()
    dev.run(stream=stream)
    graph = stream.end_capture()
    stream.synchronize()
    assert to_host(dev.out).tolist() == [-1, -1], "the digest ran outside the graph"
    for i in range(3):
        new = [(rng.integers(0, 1 << 40, size=100_000), np.array([int(rng.integers(0, 100_000))]), None, 5),
               (rng.integers(0, 1 << 20, size=64).astype(np.int32), None, np.array([i % 2]), 6)]
        for (v, c, g, _), s in zip(new, spec):
            s.array.set(v)
            if c is not None:
                s.count.set(c)
            if g is not None:
                s.gate.set(g)
        cp.cuda.Device().synchronize()  # the refills ran on CuPy's stream, the graph runs on another
        graph.launch(stream)
        stream.synchronize()
        ref, _ = build(np, new, carry)
        ref.run()
        assert np.array_equal(to_host(dev.out), ref.out), i


def _rows(log):
    return collections.Counter(tuple(int(x) for x in r) for r in log.rows())


@pytest.mark.parametrize("seed", range(40))
def test_compare_parity(cp, seed):
    rng = np.random.default_rng(1000 + seed)
    world = int(rng.choice([1, 2, 3, 4, 8, 33, 300, 1024]))
    values = rng.integers(-(1 << 62), 1 << 62, size=int(rng.integers(1, 4)))
    gathered = np.stack([rng.choice(values, size=world), rng.integers(0, 50, size=world)], axis=1).astype(np.int64)
    if rng.random() < 0.3:
        gathered = np.concatenate([gathered, rng.integers(0, 9, size=(world, 2))], axis=1)
    state0 = np.array([3, int(rng.integers(0, 5)), 7, 1, 2], np.int64)
    rank = int(rng.integers(0, world))
    cap = int(rng.choice([1, 4, 2048]))
    out = []
    for xp, device in ((np, "cpu"), (cp, "cuda")):
        log = kc.ViolationLog.allocate(capacity=cap, device=device)
        log.head[...] = xp.asarray([2])
        state = xp.asarray(state0.copy())
        for _ in range(2):
            kc.RankCompare(xp.asarray(gathered), rank=rank, state=state, log=log).run()
        out.append((to_host(state).tolist(), log.count, _rows(log)))
    assert out[0][:2] == out[1][:2], seed
    if out[0][1] <= cap:
        assert out[0][2] == out[1][2], seed
