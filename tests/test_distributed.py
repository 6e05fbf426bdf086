"""Tensor-parallel agreement and records that travel between ranks, on the CPU: two real
processes per test, joined in a gloo process group (see tests/tp_ranks.py).

What each proves:
- clean TP runs (a PyTorch decode loop, the simulator) are silent on both ranks, every
  step is agreed, and rank-local K/V fingerprints (which differ) are not compared;
- one slot-table entry changed on rank 1 is reported on BOTH ranks, in the same poll and
  the same agreement step, as rank 1 diverging from rank 0;
- a fault only rank 1's checks see makes policy="raise" raise on both ranks at the same
  poll (rank 0 with a group notice naming what the other rank logged), and rows logged
  after a step's agreement (a sweep's) wait for the next one, so they too come out on
  both ranks in the same poll;
- records and K/V sent with torch.distributed to the other rank and imported at other
  slots verify clean there, and a byte corrupted in transit is REAL_KV;
- misuse of process_group is refused with kvcanary: errors, and a monitor without one
  never imports PyTorch.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from kvcanary_cupy import LaunchTag as T

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from tests.tp_ranks import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def firing(polls):
    """Indices of the polls that reported something (or raised)."""
    return [i for i, (status, rows) in enumerate(polls) if status == "raised" or rows]


def test_clean_decode_is_silent_on_both_ranks_and_every_step_agrees():
    r0, r1 = run_ranks("clean_decode", steps=12)
    for r in (r0, r1):
        assert firing(r["polls"]) == []
        s = r["stats"]
        assert s["agreement_steps"] == 13 == s["steps"]
        assert s["divergences"] == 0 and s["group_violations"] == 0 and s["logged"] == 0
        assert s["slots_checked"] > 0


def test_simulator_under_tp_is_silent():
    r0, r1 = run_ranks("sim_tp", steps=40)
    for r in (r0, r1):
        assert r["violations"] == []
        for name, s in r["stats"].items():
            assert s["agreement_steps"] == s["steps"] > 0, name
            assert s["divergences"] == 0 and s["group_violations"] == 0, name
            assert s["slots_checked"] > 0 and s["overflows"] == 0 and s["input_errors"] == 0, name


def test_divergence_on_rank_1_is_reported_on_both_ranks_in_the_same_step():
    r0, r1 = run_ranks("divergence", at=6, steps=10)
    f0, f1 = firing(r0["polls"]), firing(r1["polls"])
    assert f0 and f0 == f1, (f0, f1)  # the same polls fire on both ranks
    first = f0[0]
    assert first == 6  # poll 0 is the prefill's; the change precedes decode step 6
    div = []
    for r in (r0, r1):
        rows = r["polls"][first][1]
        d = [row for row in rows if row[1] & F.RANK_DIVERGENCE]
        assert len(d) == 1, rows
        text, bits, rank, ref, step, tag, _ = d[0]
        assert bits == F.RANK_DIVERGENCE and tag == T.TP_AGREE
        assert (rank, ref) == (1, 0)
        assert "rank 1's plan differs from rank 0's" in text, text
        div.append(step)
    assert div[0] == div[1] == 7  # agreement rounds: the prefill's, then decode steps 1..6
    # Only rank 1's own checks see the changed entry (a slot nobody stamped there).
    own1 = [row for row in r1["polls"][first][1] if not row[1] & F.RANK_DIVERGENCE]
    assert own1 and all(row[1] & (F.CHAIN | F.POSITION) for row in own1)
    assert all(row[1] & F.RANK_DIVERGENCE for row in r0["polls"][first][1])
    for r in (r0, r1):
        s = r["stats"]
        assert s["divergences"] == 5  # steps 6..10, rank 1 each time
        assert s["agreement_steps"] == 11
    assert r0["stats"]["group_violations"] == r1["stats"]["group_violations"] > 5


def test_policy_raise_fires_on_both_ranks_at_the_same_poll():
    r0, r1 = run_ranks("policy_raise", at=4, steps=8)
    raised0 = [i for i, (status, _) in enumerate(r0["polls"]) if status == "raised"]
    raised1 = [i for i, (status, _) in enumerate(r1["polls"]) if status == "raised"]
    assert raised0 and raised0 == raised1 == firing(r0["polls"]) == firing(r1["polls"])
    assert raised0[0] == 4
    rows1 = r1["polls"][4][1]
    assert rows1 and all(row[1] & F.CHAIN for row in rows1)  # what rank 1 found itself
    (notice,) = r0["polls"][4][1]  # rank 0 found nothing: the group notice stands in
    text, bits, rank, _, step, tag, others = notice
    assert bits == 0 and tag == T.TP_AGREE and rank is None and others == len(rows1) and step == 5
    assert "other ranks of the process group logged" in text
    assert r0["stats"]["logged"] == 0 and r1["stats"]["logged"] > 0
    assert r0["stats"]["group_violations"] == r1["stats"]["group_violations"] == r1["stats"]["logged"]
    assert r0["stats"]["divergences"] == 0  # a corrupted record is not a plan divergence


def test_rows_logged_after_the_agreement_wait_for_the_next_one():
    """A sweep after step 3's agreement finds rows on rank 1 only: they are reported with step 4's
    agreement, on both ranks in the same poll, never on one rank alone."""
    r0, r1 = run_ranks("sweep_late", at=3, steps=6)
    f0, f1 = firing(r0["polls"]), firing(r1["polls"])
    assert f0 == f1 == [4], (r0["polls"], r1["polls"])
    rows1 = r1["polls"][4][1]
    assert rows1 and all(row[5] == T.SWEEP for row in rows1)
    (notice,) = r0["polls"][4][1]
    assert notice[6] == len(rows1) and notice[4] == 5


def test_records_and_kv_sent_to_another_rank_verify_clean_there():
    r0, r1 = run_ranks("transfer")
    assert firing(r0["polls"]) == [] and firing(r1["polls"]) == []
    assert set(r1["landing"]).isdisjoint(r0["sent"])


def test_a_byte_corrupted_in_transit_is_real_kv():
    _, r1 = run_ranks("transfer", corrupt=True)
    f = firing(r1["polls"])
    assert f and f[0] == 0, r1["polls"]
    rows = r1["polls"][0][1]
    assert [row[1] for row in rows] == [int(F.REAL_KV)]
    assert f"slot {r1['landing'][3]}" in rows[0][0]


def test_process_group_misuse_is_refused():
    r0, _ = run_ranks("misuse")
    for name, err in r0.items():
        assert err is not None and "kvcanary: process_group:" in err, (name, err)


def test_process_group_needs_an_initialized_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="kvcanary: process_group: torch.distributed is not initialized"):
        kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1, process_group=object())


def test_no_torch_without_a_process_group():
    code = ("import sys, numpy as np, kvcanary_cupy as kc, kvcanary_cupy.distributed;"
            "m = kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1);"
            "m.before_forward(np.array([1]), np.array([0]), np.array([1])); m.after_forward(np.array([1]), np.array([0]), np.array([1]));"
            "m.poll(); s = m.stats();"
            "assert s['agreement_steps'] == s['divergences'] == s['group_violations'] == 0, s;"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
