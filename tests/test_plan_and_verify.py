"""plan_and_verify leaves what plan followed by verify leaves.

Two identical states run one random workload step by step, one with
``plan_and_verify`` before each write, the other with ``plan`` then ``verify``:
violation rows (as multisets), counters, the verify plan's scalars and offsets,
the whole write plan, the records and the sampler's state must agree after every
step, with faults injected into records and KV bytes, token- and page-level tables,
SWA windows, expected tokens, real-KV sources with sampling, and plans too small
for a step (verification skipped and counted). Both chain kinds; NumPy and CuPy.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvMode
from kvcanary_cupy import format as fmt
from kvcanary_cupy.digest import Digest, DigestRow
from tests.workloads import Runner, arr, host, kv_sources, make_kv_pools, make_workload

pytestmark = pytest.mark.usefixtures("chain_kind")
POISON = -0x5A5A5A5A5A5A5A5B  # what a digest holds before a step: an unwritten one shows


def _state(r: Runner):
    rows = collections.Counter(tuple(v) for v in host(r.log.ring)[: min(int(host(r.log.head)[0]), r.log.capacity)]
                               .tolist())
    out = {"rows": rows, "head": int(host(r.log.head)[0]), "counters": host(r.log.counter_array).tolist(),
           "records": host(r.canary.records).tolist()}
    for f in kc.VerifyPlan.SCALAR_FIELDS + ("offsets", "first_input_error"):
        out["vp." + f] = host(getattr(r.vp, f)).tolist()
    for f in kc.WritePlan.FIELDS:
        out["wp." + f] = host(getattr(r.wp, f)).tolist()
    return out


@pytest.mark.parametrize("seed", range(8))
def test_fused_step_equals_plan_then_verify(xp, device, seed):
    rng = np.random.default_rng(seed)
    page = int(rng.choice([1, 4]))
    wl = make_workload(rng, num_requests=6, max_len=48, page_size=page, swa_size=int(rng.choice([0, 5])) or None)
    pools = make_kv_pools(rng, wl.num_slots)
    mode = RealKvMode(int(rng.integers(0, 3)))
    runners = []
    for _ in range(2):
        _, srcs = kv_sources(xp, pools)
        r = Runner(xp, device, wl, table="block" if page > 1 else "token", sources=tuple(srcs), mode=mode)
        if seed % 3 == 0:  # too small for the larger steps: verification is skipped, and counted
            r.vp = kc.VerifyPlan.allocate(capacity=7, max_batch=wl.max_batch, device=device)
        runners.append(r)
    fused, split = runners
    samplers = [kc.FingerprintSampler.allocate(period=3, device=device) if seed % 2 else None for _ in range(2)]
    # The fused step's entry digest against a Digest of the entries the split step's plan wrote.
    digest, oracle = xp.zeros(1, dtype=np.int64), xp.zeros(1, dtype=np.int64)
    entry_digest = Digest([DigestRow(getattr(split.vp, f), count=split.vp.num_valid, gate=split.vp.enable, salt=salt)
                           for f, salt in zip(kc.VerifyPlan.ENTRY_FIELDS, fmt.ENTRY_DIGEST_SALTS)], out=oracle)
    digested = 0
    with_digest = seed % 4 < 2  # with and without: a step asked for its digest is planned another way on a GPU
    for i, step in enumerate(wl.steps):
        if i % 3 == 2:  # a fault in a cached record, the same in both
            live = np.nonzero(host(fused.canary.records)[:, 1] != 0)[0]
            field, value = int(rng.integers(0, 4)), int(rng.integers(1, 99))
            if live.shape[0]:
                s = int(live[i % live.shape[0]])
                for r in runners:
                    r.canary.records[s:s + 1, field] = value
        dt = wl.index_dtype
        expected = kc.ExpectedTokens(fused._dev["tokens"], arr(xp, step.valid_lens, dt))
        plan_in = dict(req_pool_indices=arr(xp, step.req_pool_indices, dt), prefix_lens=arr(xp, step.prefix_lens, dt),
                       extend_lens=arr(xp, step.extend_lens, dt), swa=fused._dev["swa"], **fused._dev["table"])
        check_in = dict(tag=kc.LaunchTag.VERIFY, real_kv=fused.sources, real_kv_mode=mode, check_tokens=True)
        digest.fill(POISON)
        kc.plan_and_verify(fused.vp, fused.wp, fused.canary, expected=expected, log=fused.log, sample=samplers[0],
                           digest=digest if with_digest else None, **plan_in, **check_in)
        kc.plan(split.vp, split.wp, expected=expected, **plan_in)
        if with_digest:
            entry_digest.run()
            assert int(host(digest)[0]) == int(host(oracle)[0]) != POISON
        kc.verify(split.canary, split.vp, log=split.log, sample=samplers[1], **{**check_in, "real_kv": split.sources})
        for r in runners:
            r.write(step)
        a, b = _state(fused), _state(split)
        assert a == b, [k for k in a if a[k] != b[k]]
        if with_digest:
            digested = max(digested, int(host(split.vp.num_valid)[0]) if int(host(split.vp.enable)[0]) == 1 else 0)
        if samplers[0] is not None:
            assert host(samplers[0].state).tolist() == host(samplers[1].state).tolist()
    if seed % 3 == 0:
        assert fused.log.counters()["verifies_skipped"] > 0
    else:
        assert digested > 0 or not with_digest  # some step's digest covered entries
        assert fused.log.counters()["slots_checked"] > 0 and fused.log.count > 0  # the faults were seen


def test_misuse_names_the_argument():
    canary = kc.CanaryBuffer.allocate(num_slots=8)
    wp = kc.WritePlan.allocate(max_batch=1)
    log = kc.ViolationLog.allocate(capacity=4)
    rows = dict(req_pool_indices=np.array([1]), prefix_lens=np.array([1]), extend_lens=np.array([1]),
                req_to_token=np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="kvcanary: verify_plan"):
        kc.plan_and_verify(None, wp, canary, log=log, tag=1, **rows)
    vp = kc.VerifyPlan.allocate(capacity=4, max_batch=1)
    with pytest.raises(TypeError, match="kvcanary: plan_and_verify\\(\\) takes no verify_capacity"):
        kc.plan_and_verify(vp, wp, canary, log=log, tag=1, verify_capacity=4, **rows)
    with pytest.raises(TypeError, match="kvcanary: tag"):
        kc.plan_and_verify(vp, wp, canary, log=log, tag=1.5, **rows)
    with pytest.raises(ValueError, match="kvcanary: plan: pass exactly one slot table"):
        kc.plan_and_verify(vp, wp, canary, log=log, tag=1, req_pool_indices=np.array([1]),
                           prefix_lens=np.array([1]), extend_lens=np.array([1]))


def _known_entry_digest(entries):
    """The entry digest of ``entries`` ([n, 4] slot, prev, position, token) by its definition."""
    total = 0
    for k, salt in enumerate(fmt.ENTRY_DIGEST_SALTS):
        total += int(fmt.mix3(salt, -1, len(entries)))
        total += sum(int(fmt.mix3(salt, e, v[k])) for e, v in enumerate(entries))
    total &= (1 << 64) - 1
    return total - (1 << 64) if total >> 63 else total


def test_entry_digest_known_answer(xp, device):
    """Row 1 reads positions 0..2 of slots 5, 6, 7 (tokens 50, 60, 70 expected); an overflowed
    plan digests no entry at all (its counts are 0)."""
    canary = kc.CanaryBuffer.allocate(num_slots=16, device=device)
    wp = kc.WritePlan.allocate(max_batch=1, device=device)
    log = kc.ViolationLog.allocate(capacity=8, device=device)
    table = xp.asarray(np.array([[0] * 8, [5, 6, 7, 8, 9, 10, 11, 12]], np.int32))
    tokens = xp.asarray(np.array([[0] * 8, [50, 60, 70, 80, 0, 0, 0, 0]], np.int64))
    rows = dict(req_pool_indices=xp.asarray(np.array([1])), prefix_lens=xp.asarray(np.array([3])),
                extend_lens=xp.asarray(np.array([1])), req_to_token=table,
                expected=kc.ExpectedTokens(tokens, xp.asarray(np.array([4]))))
    digest = xp.full(1, POISON, dtype=np.int64)
    vp = kc.VerifyPlan.allocate(capacity=8, max_batch=1, device=device)
    kc.plan_and_verify(vp, wp, canary, log=log, tag=1, digest=digest, **rows)
    assert int(host(digest)[0]) == _known_entry_digest([(5, -1, 0, 50), (6, 5, 1, 60), (7, 6, 2, 70)])
    small = kc.VerifyPlan.allocate(capacity=2, max_batch=1, device=device)
    digest.fill(POISON)
    kc.plan_and_verify(small, wp, canary, log=log, tag=1, digest=digest, **rows)
    assert int(host(small.enable)[0]) == 0
    assert int(host(digest)[0]) == _known_entry_digest([])


def test_entry_digest_misuse_names_the_argument():
    canary = kc.CanaryBuffer.allocate(num_slots=8)
    vp, wp = kc.VerifyPlan.allocate(capacity=4, max_batch=1), kc.WritePlan.allocate(max_batch=1)
    log = kc.ViolationLog.allocate(capacity=4)
    rows = dict(req_pool_indices=np.array([1]), prefix_lens=np.array([1]), extend_lens=np.array([1]),
                req_to_token=np.ones((2, 4), np.int32))
    for bad, match in ((np.zeros(2, np.int64), "kvcanary: digest: expected an int64 \\[1\\]"),
                       (np.zeros(1, np.int32), "kvcanary: digest"), (np.zeros((1, 1), np.int64), "kvcanary: digest")):
        with pytest.raises((ValueError, TypeError), match=match):
            kc.plan_and_verify(vp, wp, canary, log=log, tag=1, digest=bad, **rows)
    with pytest.raises(ValueError, match="kvcanary: plan_and_verify"):  # the digest may not alias an output
        kc.plan_and_verify(vp, wp, canary, log=log, tag=1, digest=vp.num_valid, **rows)
