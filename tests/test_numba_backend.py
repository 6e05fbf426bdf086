"""The numba CPU backend: byte for byte the NumPy reference, and how a process picks it.

The parity fuzz of the CUDA backend (``tests/gpu/test_parity_fuzz.py``) runs here with
numba's compiled ops in the device's place: random steps with padding, page tables, SWA
windows, expected tokens, real-KV sources, corrupted records, tables and plans and data out
of range, compared after every op: records, plans (the fused ops' entries too), counters
and violation rows in the reference's order. The hand-made cases with known answers run on
it through the ``xp`` fixture's ``"numba"`` parameter.

``KVCANARY_NUMBA_FUZZ_CASES`` (default 60) sets the number of cases.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import kvcanary_cupy as kc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = int(os.environ.get("KVCANARY_NUMBA_FUZZ_CASES", "60"))


def test_parity_fuzz_against_the_reference(capsys):
    pytest.importorskip("numba")
    from kvcanary_cupy.backends import numba_cpu
    from tests.gpu import test_parity_fuzz as fuzz

    compiled = fuzz.Side(numba_cpu, "cpu", lambda a: np.array(a, copy=True), np.asarray, fused_entries=True,
                         ordered=True)
    failures = fuzz.run_fuzz(fuzz.cpu_side(), compiled, CASES, 20261206)
    assert not failures, "\n".join(failures)


def test_use_cpu_backend_names_what_it_takes():
    with pytest.raises(ValueError, match="^kvcanary: name: expected one of 'numpy', 'numba', got 'fast'"):
        kc.use_cpu_backend("fast")
    previous = kc.use_cpu_backend("numpy")
    try:
        assert kc.cpu_backend() == "numpy"
    finally:
        kc.use_cpu_backend(previous)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, **env})


def test_the_environment_sets_the_first_choice():
    pytest.importorskip("numba")
    out = _python("import kvcanary_cupy as kc; print(kc.cpu_backend())", KVCANARY_CPU_BACKEND="numba")
    assert out.returncode == 0 and out.stdout.split() == ["numba"], out.stderr
    out = _python("import kvcanary_cupy as kc; print(kc.cpu_backend())", KVCANARY_CPU_BACKEND="")
    assert out.returncode == 0 and out.stdout.split() == ["numpy"], out.stderr
    out = _python("import kvcanary_cupy as kc; kc.cpu_backend()", KVCANARY_CPU_BACKEND="jit")
    assert out.returncode != 0 and "kvcanary: KVCANARY_CPU_BACKEND: expected one of 'numpy', 'numba'" in out.stderr


def test_numba_missing_is_refused_when_picked():
    out = _python("import sys; sys.modules['numba'] = None\n"
                  "import kvcanary_cupy as kc\n"
                  "try:\n    kc.use_cpu_backend('numba')\nexcept ImportError as e:\n    print(e)\n"
                  "print(kc.cpu_backend())")
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.strip().splitlines()[0], out.stdout.split()[-1]
    assert first.startswith("kvcanary: the 'numba' CPU backend needs numba") and last == "numpy"


def test_a_step_on_numba_finds_what_the_reference_finds():
    """A monitor on each backend, the same corrupted step: the same violations, counters and records."""
    pytest.importorskip("numba")
    results = []
    for name in ("numpy", "numba"):
        previous = kc.use_cpu_backend(name)
        try:
            r2t = np.arange(64, dtype=np.int32).reshape(4, 16)
            mon = kc.KvCanary(num_slots=64, req_to_token=r2t, max_batch=2, policy=lambda found: None)
            mon.before_forward(np.array([1, 2]), np.array([0, 0]), np.array([3, 2]), request_ids=["a", "b"])
            mon.after_forward(np.array([7, 8, 9, 4, 5]), np.array([0, 1, 2, 0, 1]), np.array([16, 17, 18, 32, 33]))
            mon.canary.records[17, 0] = 99  # a stray write into request a's second slot
            r2t[2, 1] = 17  # and request b's table now points at it
            mon.before_forward(np.array([1, 2]), np.array([3, 2]), np.array([1, 1]), request_ids=["a", "b"])
            mon.after_forward(np.array([10, 6]), np.array([3, 2]), np.array([19, 34]))
            found = [(v.request, v.slot, v.position, int(v.reasons)) for v in mon.poll() + mon.poll()]
            results.append((found, mon.stats()["slots_checked"], mon.canary.records.copy()))
        finally:
            kc.use_cpu_backend(previous)
    (found, checked, records), (found_nb, checked_nb, records_nb) = results
    assert found and found == found_nb and checked == checked_nb == 3 + 2  # the second step reads 3 + 2
    np.testing.assert_array_equal(records, records_nb)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_compile_ahead_leaves_the_canary_as_it_was(backend):
    """``BlockTableCanary.compile_ahead`` (an engine's start, on numba) runs its step on a spare
    canary: this one's records, counters and gather count stay as they were, and its first step
    is checked as usual."""
    if backend == "numba":
        pytest.importorskip("numba")
    from kvcanary_cupy.integrations.engine.block_table import AttentionStep, BlockTableCanary
    from kvcanary_cupy.integrations.engine.kv_layout import GatheredSlots

    previous = kc.use_cpu_backend(backend)
    try:
        bs, dim = 4, 8
        kv = np.arange(6 * 2 * bs * dim, dtype=np.float32).reshape(6, 2 * bs * dim)  # 6 blocks
        k_off = np.arange(dim)[None, :] * bs + np.arange(bs)[:, None]
        v_off = bs * dim + np.arange(bs)[:, None] * dim + np.arange(dim)[None, :]
        fp = GatheredSlots([kv], block_size=bs, key_offsets=k_off, value_offsets=v_off, mode=kc.RealKvMode.PARTIAL,
                           num_slots=6 * bs)
        c = BlockTableCanary(num_blocks=6, block_size=bs, rows=3, width=4, max_batch=2, device="cpu", fingerprints=fp)
        c.compile_ahead()
        assert not c.monitor.canary.records.any() and fp.gathered == 0
        assert (c.monitor.stats()["slots_checked"], c.monitor.stats()["slots_written"]) == (0, 0)

        class Req:
            initial_tokens, generated_tokens = [5, 6, 7, 8, 9], []
        step = AttentionStep(rows=[1], tags=["a"], states=[Req()], fresh=[True], block_table=np.array([[3, 5]], np.int32),
                             seq_lens=np.array([5]), query_start_loc=np.array([0, 5]),
                             slot_mapping=np.array([12, 13, 14, 15, 20]), tokens=[5, 6, 7, 8, 9])
        assert c.check_reads(step) == [] and c.stamp_writes(step) == []
        assert c.monitor.stats()["slots_written"] == 5 and c.monitor.canary.records[[12, 20], 0].tolist() == [5, 9]
    finally:
        kc.use_cpu_backend(previous)


def test_a_pool_fingerprinted_on_numba_is_freed_with_its_objects():
    """The compiled backend keeps a prepared call's sources laid out, but never the pool past the
    objects that hold it."""
    pytest.importorskip("numba")
    import gc
    import weakref

    previous = kc.use_cpu_backend("numba")
    try:
        pool = np.ones((64, 16), dtype=np.uint8)
        alive = weakref.ref(pool)
        src = kc.RealKvSource(pool, bytes_per_token=16)
        canary = kc.CanaryBuffer.allocate(num_slots=64)
        vp, wp = kc.VerifyPlan.allocate(capacity=8, max_batch=1), kc.WritePlan.allocate(max_batch=1)
        log = kc.ViolationLog.allocate(capacity=4)
        table = np.arange(64, dtype=np.int32).reshape(4, 16)
        for prefix, tokens in ((0, [7, 8]), (2, [9])):
            kc.plan(vp, wp, req_to_token=table, req_pool_indices=np.array([1]), prefix_lens=np.array([prefix]),
                    extend_lens=np.array([len(tokens)]))
            kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY, real_kv=src, real_kv_mode=kc.RealKvMode.ALL)
            kc.write(canary, wp, input_ids=np.array(tokens), positions=np.arange(prefix, prefix + len(tokens)),
                     out_cache_loc=np.arange(16 + prefix, 16 + prefix + len(tokens)), log=log,
                     tag=kc.LaunchTag.WRITE, real_kv=src, real_kv_mode=kc.RealKvMode.ALL)
        assert log.count == 0 and log.counters()["slots_checked"] == 2
        assert canary.records[16:19, 3].all()  # fingerprinted: the pool's bytes were read
        del pool, src, canary, vp, wp, log
        gc.collect()
        assert alive() is None
    finally:
        kc.use_cpu_backend(previous)


def _block_table_run(backend: str) -> list:
    """A BlockTableCanary driven through random steps of a small pool (int32 metadata, as vLLM's):
    prefills, decodes, rows moving, a block-table entry damaged; what each step leaves."""
    from kvcanary_cupy.integrations.engine.block_table import AttentionStep, BlockTableCanary

    previous = kc.use_cpu_backend(backend)
    try:
        rng = np.random.default_rng(11)
        bs, width = 4, 6
        c = BlockTableCanary(num_blocks=40, block_size=bs, rows=5, width=width, max_batch=3, device="cpu")

        class Req:
            def __init__(self, tokens):
                self.initial_tokens, self.generated_tokens = tokens, []
        free = list(rng.permutation(np.arange(1, 40)))
        reqs = {}
        for rid in "abc":
            reqs[rid] = (Req(rng.integers(0, 1000, 9).tolist()), [int(free.pop()) for _ in range(width)], 0)
        out = []
        for k in range(12):
            ids = list(reqs)[k % 2:]  # the rows' order and count change from step to step
            bt, seq, qsl, sm, toks, fresh = [], [], [0], [], [], []
            for rid in ids:
                req, blocks, done = reqs[rid]
                new = 9 - done if done == 0 else 1
                if done + new > len(req.initial_tokens):
                    req.generated_tokens.append(int(rng.integers(0, 1000)))
                toks += (req.initial_tokens + req.generated_tokens)[done:done + new]
                sm += [blocks[p // bs] * bs + p % bs for p in range(done, done + new)]
                bt.append(blocks + [0] * (width - len(blocks)))
                seq.append(done + new)
                qsl.append(qsl[-1] + new)
                fresh.append(done == 0)
                reqs[rid] = (req, blocks, done + new)
            bt = np.array(bt, np.int32)
            if k == 7:
                bt[0, 1] = bt[-1, 0]  # the first row's second block is now another row's
            step = AttentionStep(rows=[1 + "abc".index(r) for r in ids], tags=ids, states=[reqs[r][0] for r in ids],
                                 fresh=fresh, block_table=bt, seq_lens=np.array(seq, np.int32),
                                 query_start_loc=np.array(qsl, np.int32), slot_mapping=np.array(sm), tokens=toks)
            found = c.check_reads(step) + c.stamp_writes(step)
            out.append(([(v.request, v.slot, int(v.reasons)) for v in found], c.table.copy(),
                        c.monitor.canary.records.copy(), c.stats()["slots_checked"], c.stats()["slots_read"]))
        return out
    finally:
        kc.use_cpu_backend(previous)


def test_block_table_steps_stage_alike_on_both_backends():
    """The numba backend stages a block-table step's rows in one compiled call: the same table,
    records, violations and counters as the NumPy path, step after step."""
    pytest.importorskip("numba")
    reference, compiled = _block_table_run("numpy"), _block_table_run("numba")
    assert any(step[0] for step in reference)  # the damaged entry is found
    for (f0, t0, r0, c0, s0), (f1, t1, r1, c1, s1) in zip(reference, compiled):
        assert f0 == f1 and (c0, s0) == (c1, s1)
        np.testing.assert_array_equal(t0, t1)
        np.testing.assert_array_equal(r0, r1)
