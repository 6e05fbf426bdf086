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
from tests.workloads import Runner, arr, host, kv_sources, make_kv_pools, make_workload

pytestmark = pytest.mark.usefixtures("chain_kind")


def _state(r: Runner):
    rows = collections.Counter(tuple(v) for v in host(r.log.ring)[: min(int(host(r.log.head)[0]), r.log.capacity)]
                               .tolist())
    out = {"rows": rows, "head": int(host(r.log.head)[0]), "counters": host(r.log.counter_array).tolist(),
           "records": host(r.canary.records).tolist()}
    for f in kc.VerifyPlan.SCALAR_FIELDS + ("offsets",):
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
        kc.plan_and_verify(fused.vp, fused.wp, fused.canary, expected=expected, log=fused.log, sample=samplers[0],
                           **plan_in, **check_in)
        kc.plan(split.vp, split.wp, expected=expected, **plan_in)
        kc.verify(split.canary, split.vp, log=split.log, sample=samplers[1], **{**check_in, "real_kv": split.sources})
        for r in runners:
            r.write(step)
        a, b = _state(fused), _state(split)
        assert a == b, [k for k in a if a[k] != b[k]]
        if samplers[0] is not None:
            assert host(samplers[0].state).tolist() == host(samplers[1].state).tolist()
    if seed % 3 == 0:
        assert fused.log.counters()["verifies_skipped"] > 0
    else:
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
