"""A monitor that stamps before the forward leaves what one that stamps after it leaves.

``stamp_before_forward=True`` moves each step's write into ``before_forward``: one
launch per group for a step of at most ``ops.STEP_WRITE_TOKENS`` tokens
(``plan_verify_write``), the check then the write for a longer one, the write after the
SWA translation for an SWA group. Twin engines run the same steps, with faults between
them (a record changed, a slot handed to another request, an SWA LUT entry moved, a
position off by one), one monitor of each kind: records, violations, their requests
and the stats must be the same. Misuse raises before any record changes.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.monitor import SwaGroup
from kvcanary_cupy.sim.model import KvPool
from tests.workloads import drain

ROWS, WIDTH = 4, 400
NUM_SLOTS = 1 + (ROWS - 1) * WIDTH


class Engine:
    """Row r holds position p at slot 1 + (r - 1) WIDTH + p, token 1000 r + p."""

    def __init__(self, xp, device, *, stamp: bool, swa_window=None, expected=False, chain="scan", bind=False):
        self.xp, self.stamp, self.bind = xp, stamp, bind
        self.table_h = np.zeros((ROWS, WIDTH), np.int32)
        for r in range(1, ROWS):
            self.table_h[r] = 1 + (r - 1) * WIDTH + np.arange(WIDTH)
        self.table = xp.asarray(self.table_h)
        self.P = {r: 0 for r in range(ROWS)}
        kw = dict(num_slots=NUM_SLOTS, req_to_token=self.table, max_batch=3, device=device, chain=chain,
                  policy=lambda found: None, stamp_before_forward=stamp)
        if swa_window:
            lut = (np.arange(NUM_SLOTS) + 7) % (NUM_SLOTS + 8)
            lut[0] = 0
            self.lut = xp.asarray(lut.astype(np.int32))
            kw["swa"] = SwaGroup(window=swa_window, lut=self.lut, num_slots=NUM_SLOTS + 8)
        if expected:
            exp = np.full((ROWS, WIDTH + 1), -1, np.int64)
            for r in range(1, ROWS):
                exp[r] = 1000 * r + np.arange(WIDTH + 1)
            kw["expected_tokens"] = xp.asarray(exp)
        self.mon = kc.KvCanary(**kw)
        if bind:
            self.buf = {k: xp.zeros(n, dtype=np.int64) for k, n in (("req_pool_indices", 3), ("prefix_lens", 3),
                                                                    ("extend_lens", 3), ("input_ids", 2 * WIDTH),
                                                                    ("positions", 2 * WIDTH),
                                                                    ("out_cache_loc", 2 * WIDTH))}
            self.mon.bind_inputs(**self.buf)

    def step(self, rows, ext, *, slip=None):
        xp = self.xp
        ids, pos, loc = [], [], []
        for r, e in zip(rows, ext):
            for p in range(self.P[r], self.P[r] + e):
                ids.append(1000 * r + p)
                pos.append(p + (1 if slip == (r, p) else 0))
                loc.append(int(self.table_h[r, p]))
        plan = dict(req_pool_indices=xp.asarray(rows), prefix_lens=xp.asarray([self.P[r] for r in rows]),
                    extend_lens=xp.asarray(ext))
        tokens = dict(input_ids=xp.asarray(ids, dtype=np.int64), positions=xp.asarray(pos, dtype=np.int64),
                      out_cache_loc=xp.asarray(loc, dtype=np.int64))
        names = [f"req{r}" for r in rows]
        if self.bind:
            for k, v in {**plan, **tokens}.items():
                self.buf[k][: v.shape[0]] = v
            sizes = dict(batch_size=len(rows))
            if self.stamp:
                self.mon.before_forward(**sizes, num_tokens=len(ids), request_ids=names)
                self.mon.after_forward()
            else:
                self.mon.before_forward(**sizes, request_ids=names)
                self.mon.after_forward(num_tokens=len(ids))
        elif self.stamp:
            self.mon.before_forward(**plan, **tokens, request_ids=names)
            self.mon.after_forward()
        else:
            self.mon.before_forward(**plan, request_ids=names)
            self.mon.after_forward(**tokens)
        for r, e in zip(rows, ext):
            self.P[r] += e


def run_twins(xp, device, **kw):
    """A stamp-after and a stamp-before engine through the same steps and faults; returns the
    violations each step found (the same for both)."""
    twins = [Engine(xp, device, stamp=s, **kw) for s in (False, True)]
    found = []

    def both(fn):
        for t in twins:
            fn(t)
        seen = []
        for t in twins:
            seen.append(sorted((v.tag, v.slot, v.position, int(v.reasons), v.stored_link, v.batch_row, str(v.request)) for v in drain(t.mon, xp)))
        assert seen[0] == seen[1]
        a, b = (t.mon.canary.host_records() for t in twins)
        np.testing.assert_array_equal(a, b)
        if twins[0].mon.swa is not None:
            np.testing.assert_array_equal(*(t.mon.swa_canary.host_records() for t in twins))
        found.append(seen[0])

    both(lambda t: t.step([1, 2], [300, 5]))  # more than STEP_WRITE_TOKENS: the check, then the write
    both(lambda t: t.step([1, 2, 3], [1, 1, 4]))  # decode and a short prefill: one launch
    both(lambda t: t.mon.canary.records.__setitem__((int(t.table_h[2, 3]), 1), 99))  # a record changed
    both(lambda t: t.step([1, 2], [1, 1]))
    both(lambda t: t.step([1, 3], [2, 1], slip=(3, 4)))  # a position off by one
    for t in twins:  # row 3's next position reuses row 1's slot of position 10
        t.table_h[3, 6] = t.table_h[1, 10]
        t.table[3, 6] = int(t.table_h[1, 10])
    both(lambda t: t.step([3, 1], [1, 1]))
    both(lambda t: t.step([1, 3], [1, 1]))
    if twins[0].mon.swa is not None:
        for t in twins:
            s = int(t.table_h[1, 303])
            t.lut[s] = int(t.lut[s]) + 1
        both(lambda t: t.step([1], [1]))
    s0, s1 = (t.mon.stats() for t in twins)
    for k in ("steps", "violations", "slots_checked", "slots_written", "kernel_runs", "input_errors", "overflows"):
        assert s0[k] == s1[k], k
    return found


def test_stamp_before_matches_stamp_after(xp, device, chain_kind):
    found = run_twins(xp, device, chain=chain_kind)
    assert found[:2] == [[], []]
    assert found[3] and found[4] and found[6]  # the changed record, the slip, the reused slot


def test_stamp_before_with_swa_and_expected_tokens(xp, device):
    found = run_twins(xp, device, swa_window=8, expected=True)
    assert found[-1], "the moved LUT entry"


def test_stamp_before_with_bound_buffers(xp, device):
    found = run_twins(xp, device, bind=True)
    assert found[:2] == [[], []] and found[3]


def test_stamp_before_refuses_what_it_cannot_do():
    table = np.zeros((2, 8), np.int32)
    pool = KvPool(layers=1, num_slots=16, page_size=1, bytes_per_token=32, device="cpu", salt=1)
    base = dict(num_slots=16, req_to_token=table, max_batch=1, stamp_before_forward=True)
    with pytest.raises(ValueError, match="kvcanary: stamp_before_forward: not with real-KV fingerprints"):
        kc.KvCanary(**base, real_kv=[pool.source()])
    with pytest.raises(ValueError, match="kvcanary: stamp_before_forward: not with verify_after"):
        kc.KvCanary(**base, verify_after=True)
    with pytest.raises(TypeError, match="kvcanary: stamp_before_forward"):
        kc.KvCanary(**{**base, "stamp_before_forward": "yes"})
    kc.KvCanary(**base, real_kv=[pool.source()], real_kv_mode=kc.RealKvMode.NONE)  # no fingerprints: fine


def test_write_inputs_go_where_the_monitor_stamps():
    table = np.arange(16, dtype=np.int32).reshape(2, 8)
    one = dict(req_pool_indices=np.array([1]), prefix_lens=np.array([0]), extend_lens=np.array([1]))
    tokens = dict(input_ids=np.array([5]), positions=np.array([0]), out_cache_loc=np.array([8]))
    after = kc.KvCanary(num_slots=16, req_to_token=table, max_batch=1)
    with pytest.raises(ValueError, match="kvcanary: input_ids: a step's write inputs go to after_forward"):
        after.before_forward(**one, **tokens)
    before = kc.KvCanary(num_slots=16, req_to_token=table, max_batch=1, stamp_before_forward=True)
    before.before_forward(**one, **tokens)
    with pytest.raises(ValueError, match="kvcanary: after_forward: this monitor stamps in before_forward"):
        before.after_forward(**tokens)
    before.after_forward()
    assert before.canary.host_records()[8, :2].tolist() == [5, 0]
    assert before.stats()["steps"] == 1
