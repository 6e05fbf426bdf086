"""Tensor-parallel agreement and moving records over NCCL: two processes, one GPU each
(tests/tp_ranks.py, ``NCCL_NVLS_ENABLE=0``). Skipped unless PyTorch sees two CUDA devices
and NCCL.

The CPU tests' checks, with NCCL on the monitors' streams (poll reads one step late on a
GPU, so "the same poll" is checked as equal poll indices and agreement steps on both ranks):
clean runs are silent; one slot-table entry changed on rank 1 is reported on both ranks,
naming rank 1; policy="raise" raises on both ranks at the same poll, and so do rows a
sweep logged after a step's agreement, one agreement later; a prefill on rank 0
whose KV and records go to rank 1 (NCCL send/recv) at other slots decodes on cleanly there,
and a byte corrupted in transit is REAL_KV. And the step captured in a CUDA graph with the
agreement inside (the capture runs nothing), replayed, still catches a divergence.
"""
from __future__ import annotations

import pytest

from kvcanary_cupy import FailReason as F
from tests.tp_ranks import run_ranks

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2 or not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
    pytest.skip("needs 2 CUDA devices and NCCL", allow_module_level=True)


def nccl(scenario, **kw):
    return run_ranks(scenario, backend="nccl", timeout=300, **kw)


def firing(polls):
    return [i for i, (status, rows) in enumerate(polls) if status == "raised" or rows]


def divergence_rows(polls, i):
    return [row for row in polls[i][1] if row[1] & F.RANK_DIVERGENCE]


def test_clean_decode_over_nccl():
    for r in nccl("clean_decode", steps=12):
        assert firing(r["polls"]) == []
        assert r["stats"]["agreement_steps"] == 13 and r["stats"]["divergences"] == 0


def test_simulator_over_nccl():
    for r in nccl("sim_tp", steps=40):
        assert r["violations"] == []
        for s in r["stats"].values():
            assert s["agreement_steps"] == s["steps"] > 0 and s["divergences"] == 0


def test_divergence_over_nccl_is_reported_on_both_ranks():
    r0, r1 = nccl("divergence", at=6, steps=10)
    f0, f1 = firing(r0["polls"]), firing(r1["polls"])
    assert f0 and f0 == f1
    for r in (r0, r1):
        (row,) = divergence_rows(r["polls"], f0[0])
        text, _, rank, ref, step, _, _ = row
        assert (rank, ref, step) == (1, 0, 7) and "rank 1's plan differs from rank 0's" in text


def test_policy_raise_over_nccl_fires_on_both_ranks_at_the_same_poll():
    r0, r1 = nccl("policy_raise", at=4, steps=8)
    raised = [[i for i, (status, _) in enumerate(r["polls"]) if status == "raised"] for r in (r0, r1)]
    assert raised[0] and raised[0] == raised[1]
    assert r0["stats"]["logged"] == 0 and r1["stats"]["logged"] > 0


def test_late_rows_over_nccl_come_out_on_both_ranks_in_the_same_poll():
    r0, r1 = nccl("sweep_late", at=3, steps=6)
    f0, f1 = firing(r0["polls"]), firing(r1["polls"])
    assert f0 and f0 == f1
    assert r0["stats"]["group_violations"] == r1["stats"]["group_violations"] == r1["stats"]["logged"] > 0


def test_prefill_on_rank_0_decodes_on_rank_1_over_nccl():
    r0, r1 = nccl("transfer")
    assert firing(r0["polls"]) == [] and firing(r1["polls"]) == []


def test_a_byte_corrupted_in_an_nccl_transfer_is_real_kv():
    _, r1 = nccl("transfer", corrupt=True)
    rows = [row for _, found in r1["polls"] for row in found]
    assert rows and {row[1] for row in rows} == {int(F.REAL_KV)}


def test_graph_captured_step_with_agreement_catches_a_divergence():
    r0, r1 = nccl("graph_divergence", replays=8, at=4)
    for r in (r0, r1):
        assert not r["captured_ran"], "the agreement ran outside the graph during capture"
    f0, f1 = firing(r0["polls"]), firing(r1["polls"])
    assert f0 and f0 == f1 and f0[0] >= 4
    steps = []
    for r in (r0, r1):
        (row,) = divergence_rows(r["polls"], f0[0])
        assert row[2:4] == (1, 0)
        steps.append(row[4])
    assert steps[0] == steps[1]
