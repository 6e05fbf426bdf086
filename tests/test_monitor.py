"""KvCanary: per-step orchestration, request mapping, policies, overflow, SWA, sweeps,
sampling, warm-up, bound inputs, rebinding, misuse, and (GPU) graph capture. Tests taking
``chain_kind`` run once per chain kind (the monitor's ``chain=``)."""
from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from kvcanary_cupy import LaunchTag as T
from kvcanary_cupy.monitor import KvCanaryError, KvCanaryWarning, SwaGroup, SweepChain
from kvcanary_cupy.sim.model import KvPool
from tests.workloads import drain, sync

WIDTH = 32
ROWS = 5
NUM_SLOTS = 1 + (ROWS - 1) * WIDTH



class Toy:
    """A hand-driven engine: row r holds positions at slots 1 + (r-1)*WIDTH + pos, tokens 1000*r + pos."""

    def __init__(self, xp, device, *, kv=False, swa_window=None, expected=False, **mon_kw):
        self.xp = xp
        self.table_h = np.zeros((ROWS, WIDTH), np.int32)
        for r in range(1, ROWS):
            self.table_h[r] = 1 + (r - 1) * WIDTH + np.arange(WIDTH)
        self.table = xp.asarray(self.table_h)
        self.P = {r: 0 for r in range(ROWS)}
        self.pool = KvPool(layers=2, num_slots=NUM_SLOTS, page_size=1, bytes_per_token=32, device=device,
                           salt=5) if kv else None
        self.exp_h = np.full((ROWS, WIDTH + 1), -1, np.int64)
        for r in range(1, ROWS):
            self.exp_h[r, :WIDTH + 1] = 1000 * r + np.arange(WIDTH + 1)
        self.exp = xp.asarray(self.exp_h)
        self.lut = None
        swa = None
        if swa_window:
            # SWA slot = full slot + 7 (wrapping inside the SWA pool), slot 0 -> 0.
            lut = (np.arange(NUM_SLOTS) + 7) % (NUM_SLOTS + 8)
            lut[0] = 0
            self.lut = xp.asarray(lut.astype(np.int32))
            swa = SwaGroup(window=swa_window, lut=self.lut, num_slots=NUM_SLOTS + 8)
        kw = dict(num_slots=NUM_SLOTS, req_to_token=self.table, max_batch=4, device=device, swa=swa)
        if kv:
            kw.update(real_kv=[self.pool.source()], real_kv_mode=kc.RealKvMode.ALL)
        if expected:
            kw.update(expected_tokens=self.exp)
        kw.setdefault("policy", lambda found: None)
        kw.update(mon_kw)
        self.mon = kc.KvCanary(**kw)

    def inputs(self, rows, ext):
        ids, pos, loc = [], [], []
        for r, e in zip(rows, ext):
            for p in range(self.P[r], self.P[r] + e):
                ids.append(1000 * r + p)
                pos.append(p)
                loc.append(int(self.table_h[r, p]))
        return ids, pos, loc

    def step(self, rows, ext, request_ids=None, between=None, **after_kw):
        xp = self.xp
        ids, pos, loc = self.inputs(rows, ext)
        self.mon.before_forward(xp.asarray(rows), xp.asarray([self.P[r] for r in rows]), xp.asarray(ext),
                                request_ids=request_ids)
        if self.pool is not None:
            self.pool.write(loc, ids, pos)
        if between is not None:
            between()
        self.mon.after_forward(xp.asarray(ids), xp.asarray(pos), xp.asarray(loc), **after_kw)
        for r, e in zip(rows, ext):
            self.P[r] += e

    def set_entry(self, r, p, slot):
        self.table_h[r, p] = slot
        self.table[r, p] = slot


# --- clean path ---------------------------------------------------------------
def test_clean_steps_stamp_chained_records(xp, device, chain_kind):
    toy = Toy(xp, device, chain=chain_kind)
    toy.step([1, 2], [5, 3], request_ids=["a", "b"])
    for _ in range(3):
        toy.step([1, 2], [1, 1], request_ids=["a", "b"])
    assert drain(toy.mon, xp) == []
    rec = toy.mon.canary.host_records()
    want = kc.make_records(1000 + np.arange(8), np.arange(8), chain=chain_kind)
    np.testing.assert_array_equal(rec[1:9], want)
    s = toy.mon.stats()
    assert s["steps"] == 4 and s["violations"] == 0 and s["overflows"] == 0 and s["input_errors"] == 0
    assert s["slots_written"] == 8 + 3 * 2
    assert s["slots_checked"] == (5 + 3) + (6 + 4) + (7 + 5)
    assert s["kernel_runs"] == 8


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, ROWS - 1), st.integers(1, 4)), min_size=1, max_size=12),
       st.sampled_from([None, 2, 5]))
def test_random_clean_traffic_is_silent(steps, window):
    toy = Toy(np, "cpu", kv=True, swa_window=window, expected=True)
    for r, e in steps:
        e = min(e, WIDTH - toy.P[r])
        if e > 0:
            toy.step([r], [e])
    assert toy.mon.poll() == []
    assert toy.mon.stats()["input_errors"] == 0


# --- request mapping ------------------------------------------------------------
def test_rows_found_later_map_to_the_request_of_their_step(xp, device, chain_kind):
    toy = Toy(xp, device, chain=chain_kind)
    toy.step([1, 2], [4, 4], request_ids=["a", "b"])
    toy.set_entry(2, 1, int(toy.table_h[1, 1]))  # b's position 1 now reads a's slot
    toy.step([2, 1], [1, 1], request_ids=["b", "a"])  # b is batch row 0 here
    toy.step([1, 2], [1, 1], request_ids=["a", "b"])  # and batch row 1 here
    found = drain(toy.mon, xp)
    assert found and {v.request for v in found} == {"b"}
    assert {v.batch_row for v in found} == {0, 1}
    assert all(v.tag == T.VERIFY and v.reasons & (F.CHAIN | F.POSITION) for v in found)
    assert "request 'b'" in str(found[0])


def test_without_request_ids_rows_stay_unnamed(xp, device):
    toy = Toy(xp, device)
    toy.step([1], [3])
    toy.set_entry(1, 0, 40)
    toy.step([1], [1])
    found = drain(toy.mon, xp)
    assert found and all(v.request is None and v.batch_row == 0 for v in found)


# --- policies ---------------------------------------------------------------------
def test_policy_raise(xp, device):
    toy = Toy(xp, device, policy="raise")
    toy.step([1], [3], request_ids=["x"])
    toy.set_entry(1, 1, 60)
    toy.step([1], [1], request_ids=["x"])
    with pytest.raises(KvCanaryError) as e:
        drain(toy.mon, xp)
    assert e.value.violations[0].request == "x"


def test_policy_callable_and_log(xp, device, caplog):
    got = []
    toy = Toy(xp, device, policy=got.append)
    toy.step([1], [3], request_ids=["x"])
    toy.set_entry(1, 1, 60)
    toy.step([1], [1], request_ids=["x"])
    found = drain(toy.mon, xp)
    assert got and sum(map(len, got)) == len(found)
    toy = Toy(xp, device, policy="log")
    toy.step([1], [3], request_ids=["y"])
    toy.set_entry(1, 1, 60)
    toy.step([1], [1], request_ids=["y"])
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        drain(toy.mon, xp)
    assert any("request 'y'" in r.getMessage() for r in caplog.records)


# --- overflow and input errors ------------------------------------------------------
def test_overflow_is_reported_and_the_plan_grows(xp, device, chain_kind):
    toy = Toy(xp, device, verify_capacity=2, chain=chain_kind)
    toy.step([1], [6], request_ids=["a"])
    toy.set_entry(1, 4, 70)  # caught only if the overflowing step is still verified
    with pytest.warns(KvCanaryWarning, match="overflowed"):
        toy.step([1], [1], request_ids=["a"])
        found = drain(toy.mon, xp)
        for _ in range(2):
            toy.step([1], [1], request_ids=["a"])
            found += drain(toy.mon, xp)
    s = toy.mon.stats()
    assert s["overflows"] >= 1 and s["groups"]["main"]["capacity"] >= 6
    assert any(v.slot == 70 for v in found)
    if xp is np:  # on the CPU the same step is re-planned at once
        assert s["overflows"] == 1 and found[0].slot == 70


def test_overflow_without_growth_skips_and_counts(xp, device):
    toy = Toy(xp, device, verify_capacity=2, grow_on_overflow=False)
    toy.step([1], [6])
    toy.set_entry(1, 4, 70)
    with pytest.warns(KvCanaryWarning, match="grow_on_overflow=False"):
        toy.step([1], [1])
        found = drain(toy.mon, xp)
        toy.step([1], [1])
        found += drain(toy.mon, xp)
    assert found == []  # the skipped verify saw nothing: that is why it is reported
    s = toy.mon.stats()
    assert s["overflows"] == 2 and s["groups"]["main"]["capacity"] == 2


def test_overflow_counts_are_the_plans_own_scalars(xp, device):
    """The plan kernel keeps overflows and the largest request; stats report exactly those."""
    toy = Toy(xp, device, verify_capacity=2, grow_on_overflow=False)
    toy.step([1], [6])
    with pytest.warns(KvCanaryWarning, match=r"overflowed in 2 step\(s\) \(largest request 7 entries"):
        toy.step([1], [1])
        toy.step([1], [1])
        drain(toy.mon, xp)
    plan = toy.mon.verify_plan.host_scalars()
    g = toy.mon.stats()["groups"]["main"]
    assert (plan["overflows"], plan["max_requested"]) == (g["overflows"], g["max_requested"]) == (2, 7)


def test_cpu_repair_reports_and_counts_each_overflow_and_bad_row_once():
    """On the CPU an overflowing step is grown and planned again at once; the second plan
    counts neither the overflow nor the step's bad rows again, and poll does not re-report."""
    toy = Toy(np, "cpu", verify_capacity=2)
    toy.step([1, 2], [3, 3])
    toy.set_entry(2, 1, -5)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", KvCanaryWarning)
        toy.step([1, 2], [1, 1])
        toy.mon.poll()
        toy.mon.poll()
    msgs = [str(w.message) for w in got if issubclass(w.category, KvCanaryWarning)]
    assert len(msgs) == 2 and "asked for 3 entries, capacity 2; grown to 6" in msgs[0]
    assert "group 'main': 1 live batch row(s) had out-of-range plan input" in msgs[1]
    assert "1 live batch row(s) stamped nothing" in msgs[1]
    s = toy.mon.stats()
    assert (s["overflows"], s["input_errors"], s["groups"]["main"]["max_requested"]) == (1, 1, 3)
    assert s["rows_unstamped"] == 1


def test_warmup_discards_overflow_and_input_error_counts(xp, device):
    toy = Toy(xp, device, verify_capacity=2, grow_on_overflow=False)
    toy.step([1, 2], [3, 3])
    with toy.mon.warmup():  # nothing polled inside: the warm-up data's overflow is never reported
        toy.set_entry(2, 1, -5)  # an out-of-range row
        toy.step([1, 2], [1, 1])  # and an overflow
        toy.set_entry(2, 1, int(toy.table_h[2, 0]) + 1)
    s = toy.mon.stats()
    assert (s["overflows"], s["input_errors"], s["groups"]["main"]["max_requested"]) == (0, 0, 0)
    assert toy.mon.write_plan.position_check[0] == 1
    with pytest.warns(KvCanaryWarning, match=r"overflowed in 1 step\(s\)"):
        toy.step([1], [1])
        drain(toy.mon, xp)
    s = toy.mon.stats()
    assert (s["overflows"], s["input_errors"], s["groups"]["main"]["max_requested"]) == (1, 0, 4)


def test_out_of_range_plan_input_is_reported(xp, device):
    toy = Toy(xp, device)
    toy.step([1, 2], [3, 3])
    toy.set_entry(2, 1, -5)
    with pytest.warns(KvCanaryWarning, match="out-of-range plan input"):
        toy.step([1, 2], [1, 1])
        drain(toy.mon, xp)
        toy.step([1], [1])
        drain(toy.mon, xp)
    assert toy.mon.stats()["input_errors"] == 1


def test_the_input_warning_names_the_row_its_request_and_the_table_entry(xp, device):
    toy = Toy(xp, device)
    toy.step([1, 2], [3, 3], request_ids=["a", "b"])
    toy.set_entry(2, 1, -5)  # request b's position 1 now maps to no slot
    with pytest.warns(KvCanaryWarning) as got:
        toy.step([1, 2], [1, 1], request_ids=["a", "b"])
        drain(toy.mon, xp)
    (msg,) = [str(w.message) for w in got if "plan input" in str(w.message)]
    assert ("in the latest step, batch row 1 (request 'b'), request-table row 2, prefix 3, extend 1: the table "
            "entry for position 1 is -5 (unreadable)") in msg


def test_default_capacity_rule():
    t = np.zeros((9, 100), np.int32)
    assert kc.KvCanary(num_slots=500, req_to_token=t, max_batch=8).verify_plan.capacity == 500
    assert kc.KvCanary(num_slots=5000, req_to_token=t, max_batch=8).verify_plan.capacity == 800
    assert kc.KvCanary(num_slots=500, req_to_token=t, max_batch=8, verify_capacity="max").verify_plan.capacity == 800
    m = kc.KvCanary(num_slots=500, block_table=np.zeros((9, 10), np.int32), page_size=16, max_batch=4,
                    swa=SwaGroup(window=32, lut=np.zeros(500, np.int32), num_slots=50))
    assert m.verify_plan.capacity == 500 and m.swa.vp.capacity == 50  # 4 * 160 > 500; 4 * 32 > 50


# --- bound inputs, foreign arrays, rebinding --------------------------------------------
def test_bound_inputs_give_the_same_bytes(xp, device):
    a, b = Toy(xp, device, kv=True), Toy(xp, device, kv=True)
    rpi, pre, ext = (xp.full(4, -9, xp.int64) for _ in range(3))  # poisoned: only [:bs] may be read
    ids, pos, loc = (xp.full(16, -9, xp.int64) for _ in range(3))
    b.mon.bind_inputs(req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, input_ids=ids, positions=pos,
                      out_cache_loc=loc)
    for rows, e in (([1, 2], [4, 2]), ([1, 2], [1, 1]), ([2], [3])):
        a.step(rows, e)
        i, p, l_ = b.inputs(rows, e)
        rpi[:len(rows)] = xp.asarray(rows)
        pre[:len(rows)] = xp.asarray([b.P[r] for r in rows])
        ext[:len(rows)] = xp.asarray(e)
        ids[:len(i)], pos[:len(i)], loc[:len(i)] = xp.asarray(i), xp.asarray(p), xp.asarray(l_)
        b.mon.before_forward(batch_size=len(rows))
        b.pool.write(l_, i, p)
        b.mon.after_forward(num_tokens=len(i))
        for r, n in zip(rows, e):
            b.P[r] += n
    np.testing.assert_array_equal(a.mon.canary.host_records(), b.mon.canary.host_records())
    assert drain(b.mon, xp) == []


def test_torch_tables_mutated_in_place_are_seen():
    torch = pytest.importorskip("torch")
    table = torch.zeros(3, 16, dtype=torch.int32)
    table[1, :4] = torch.tensor([3, 4, 5, 6], dtype=torch.int32)
    mon = kc.KvCanary(num_slots=32, req_to_token=table, max_batch=1, policy=lambda f: None)
    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    mon.before_forward(t(1), t(0), t(3), request_ids=["r"])
    mon.after_forward(t(7, 8, 9), t(0, 1, 2), table[1, :3])
    table[1, 1] = 20  # the engine's in-place update, seen through the zero-copy view
    mon.before_forward(t(1), t(3), t(1), request_ids=["r"])
    mon.after_forward(t(10), t(3), table[1, 3:4])
    found = mon.poll()
    assert found and found[0].slot == 20 and found[0].request == "r"


def test_jax_inputs_and_rebind_cpu():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    with jax.default_device(jax.devices("cpu")[0]):  # JAX's GPU, where it has one, is not this test's
        _jax_inputs_and_rebind(jnp)


def _jax_inputs_and_rebind(jnp):
    table = jnp.zeros((3, 16), jnp.int32).at[1, :3].set(jnp.array([3, 4, 5], jnp.int32))
    mon = kc.KvCanary(num_slots=32, req_to_token=table, max_batch=1, policy=lambda f: None)
    i = lambda *v: jnp.array(v, jnp.int32)  # noqa: E731
    mon.before_forward(i(1), i(0), i(3))
    mon.after_forward(i(7, 8, 9), i(0, 1, 2), i(3, 4, 5))
    table = table.at[1, 3].set(6)
    mon.rebind(req_to_token=table)
    mon.before_forward(i(1), i(3), i(1))
    mon.after_forward(i(10), i(3), i(6))
    assert mon.poll() == []
    mon.rebind(req_to_token=table.at[1, 0].set(9))
    mon.before_forward(i(1), i(4), i(0))
    assert [v.slot for v in mon.poll()] == [9, 4]  # the wrong slot, and its successor's broken link


def test_rebind_rejects_other_geometry():
    mon = kc.KvCanary(num_slots=32, req_to_token=np.zeros((3, 16), np.int32), max_batch=1)
    with pytest.raises(ValueError, match="kvcanary: req_to_token: expected shape"):
        mon.rebind(req_to_token=np.zeros((3, 8), np.int32))
    with pytest.raises(ValueError, match="kvcanary: block_table"):
        mon.rebind(block_table=np.zeros((3, 16), np.int32))
    with pytest.raises(ValueError, match="kvcanary: expected_tokens"):
        mon.rebind(expected_tokens=np.zeros((3, 16), np.int32))
    with pytest.raises(ValueError, match="kvcanary: swa_lut"):
        mon.rebind(swa_lut=np.zeros(32, np.int32))


# --- expected tokens, draft offset ------------------------------------------------------
def test_token_check_and_draft_offset(xp, device, chain_kind):
    toy = Toy(xp, device, expected=True, chain=chain_kind)
    toy.step([1], [4], request_ids=["t"])
    toy.step([1], [1], request_ids=["t"])
    assert drain(toy.mon, xp) == []
    toy.exp[1, 2] = 5  # the truth says position 2 holds token 5: the stored 1002 is wrong
    toy.step([1], [1], request_ids=["t"])
    found = drain(toy.mon, xp)
    assert [(v.slot, v.expected_token, v.stored_token) for v in found] == [(int(toy.table_h[1, 2]), 5, 1002)]
    assert found[0].reasons == F.TOKEN

    # A draft pool stores token p+1 at position p: offset +1 and the draft tags.
    d = Toy(xp, device, expected=True, draft=True, chain=chain_kind)
    for P, E in ((0, 4), (4, 1), (5, 1)):
        ids = xp.asarray([1000 + p + 1 for p in range(P, P + E)])
        d.mon.before_forward(xp.asarray([1]), xp.asarray([P]), xp.asarray([E]),
                             expected_valid_lens=xp.asarray([P + E + 1]))
        d.mon.after_forward(ids, xp.arange(P, P + E), xp.asarray(d.table_h[1, P:P + E]))
    assert drain(d.mon, xp) == []
    d.exp[1, 3] = 77
    d.mon.before_forward(xp.asarray([1]), xp.asarray([6]), xp.asarray([0]), expected_valid_lens=xp.asarray([7]))
    found = drain(d.mon, xp)
    assert [(v.tag, v.position, v.expected_token) for v in found] == [(T.VERIFY_DRAFT, 2, 77)]


def test_record_tokens_fills_the_bound_table():
    exp = np.full((3, 8), -1, np.int64)
    mon = kc.KvCanary(num_slots=32, req_to_token=np.zeros((3, 8), np.int32), max_batch=2, expected_tokens=exp)
    mon.record_tokens(np.array([2, 1]), np.array([5, 6, 7, 8, 9]), np.array([0, 2, 5]))
    assert exp[2, :2].tolist() == [5, 6] and exp[1, :3].tolist() == [7, 8, 9] and exp[1, 3] == -1
    with pytest.raises(ValueError, match="kvcanary: record_tokens"):
        kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1).record_tokens(
            np.array([1]), np.array([1]), np.array([0, 1]))


# --- SWA group ---------------------------------------------------------------------------
def test_swa_group_clean_and_off_by_one(xp, device, chain_kind):
    toy = Toy(xp, device, swa_window=3, kv=True, chain=chain_kind)
    toy.step([1, 2], [6, 2], request_ids=["a", "b"])
    for _ in range(3):
        toy.step([1, 2], [1, 1], request_ids=["a", "b"])
    assert drain(toy.mon, xp) == []
    swa = toy.mon.swa_canary.host_records()
    lut = np.asarray(kc.runtime.to_host(toy.lut))
    np.testing.assert_array_equal(swa[lut[toy.table_h[1, :9]]],
                                  kc.make_records(1000 + np.arange(9), np.arange(9), chain=chain_kind))
    assert toy.mon.stats()["groups"]["swa"]["max_requested"] == 3 + 3  # two windows of 3
    s = int(toy.table_h[1, 7])  # inside a's window [6, 9)
    toy.lut[s] = int(lut[s]) + 1
    toy.step([1, 2], [1, 1], request_ids=["a", "b"])
    found = drain(toy.mon, xp)
    assert found and all(v.tag == T.VERIFY_SWA and v.request == "a" for v in found)


def test_swa_translation_skips_negative_and_matches_explicit(xp, device):
    a, b = Toy(xp, device, swa_window=4), Toy(xp, device, swa_window=4)
    a.step([1], [3])
    b.step([1], [3])
    lut = np.asarray(kc.runtime.to_host(a.lut))
    ids, pos, loc = a.inputs([1], [3])
    loc[1] = -1  # a skipped token: no store, the chain does not advance, in both groups
    for t in (a, b):
        t.mon.before_forward(xp.asarray([1]), xp.asarray([3]), xp.asarray([3]))
    a.mon.after_forward(xp.asarray(ids), xp.asarray(pos), xp.asarray(loc))
    swa_loc = np.where(np.asarray(loc) >= 0, lut[np.maximum(loc, 0)], -1)
    b.mon.after_forward(xp.asarray(ids), xp.asarray(pos), xp.asarray(loc), swa_out_cache_loc=xp.asarray(swa_loc))
    np.testing.assert_array_equal(a.mon.swa_canary.host_records(), b.mon.swa_canary.host_records())
    rec = a.mon.swa_canary.host_records()
    assert not rec[lut[a.table_h[1, 4]]].any()  # the skipped slot was never written


# --- sweep ---------------------------------------------------------------------------------
def _idle_sequence(xp, device, n=10, **kw):
    toy = Toy(xp, device, kv=True, **kw)
    toy.step([1], [n])
    slots = toy.table_h[1, :n].astype(np.int64)
    chains = [SweepChain(slots[:4], 0, -1, 1000 + np.arange(4), key="n1"),
              (slots[4:], 4, int(slots[3]), 1000 + np.arange(4, n))]
    return toy, slots, chains


def test_sweep_round_robin_is_bounded_and_clean(xp, device):
    toy, slots, chains = _idle_sequence(xp, device, sweep_budget=4)
    sizes = [toy.mon.sweep(chains) for _ in range(5)]
    assert sizes == [4, 4, 4, 4, 4] and drain(toy.mon, xp) == []
    s = toy.mon.stats()
    assert s["sweeps"] == 5 and s["sweep_entries"] == 20
    assert toy.mon.sweep([]) == 0


def test_sweep_finds_a_flipped_idle_byte(xp, device):
    toy, slots, chains = _idle_sequence(xp, device, sweep_budget=3, sweep_max_chains=2)
    toy.pool.flip(int(slots[8]), 1, 5)
    found = []
    for _ in range(4):  # 10 entries, 3 per call: every entry within 4 calls
        toy.mon.sweep(chains)
        found += drain(toy.mon, xp)
    assert found and all(v.tag == T.SWEEP and v.reasons == F.REAL_KV and v.slot == slots[8] for v in found)
    assert {v.request for v in found} == {1}  # a tuple chain is named by its index


def test_sweep_chain_tokens_and_links_are_checked(xp, device, chain_kind):
    toy, slots, chains = _idle_sequence(xp, device, sweep_budget=64, chain=chain_kind)
    bad = [SweepChain(slots[:4], 0, -1, 1000 + np.arange(4) + (np.arange(4) == 2), key="tok"),
           SweepChain(slots[4:], 4, int(slots[2]), key="link")]
    toy.mon.sweep(bad)
    found = drain(toy.mon, xp)
    assert {(v.request, v.reasons) for v in found} == {("tok", F.TOKEN), ("link", F.CHAIN)}


def test_sweep_device_chains(xp, device):
    toy, slots, chains = _idle_sequence(xp, device, sweep_budget=5)
    dev_chains = [SweepChain(xp.asarray(slots[:4]), 0, -1, key="a"),
                  SweepChain(xp.asarray(slots[4:]), 4, int(slots[3]), xp.asarray(1000 + np.arange(4, 10)), key="b")]
    assert [toy.mon.sweep(dev_chains) for _ in range(2)] == [5, 5]
    assert drain(toy.mon, xp) == []
    toy.pool.flip(int(slots[1]), 0, 0)
    toy.mon.sweep(dev_chains)
    toy.mon.sweep(dev_chains)
    assert {v.request for v in drain(toy.mon, xp)} == {"a"}


def test_sweep_chain_validation():
    with pytest.raises(ValueError, match="kvcanary: SweepChain.prev_slot"):
        SweepChain(np.array([3]), first_position=2, prev_slot=-1)
    with pytest.raises(ValueError, match="kvcanary: SweepChain.tokens"):
        SweepChain(np.array([3, 4]), tokens=np.array([1]))
    with pytest.raises(TypeError, match="kvcanary: chains\\[0\\]"):
        SweepChain.coerce("nope", 0)
    mon = kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1)
    with pytest.raises(ValueError, match="kvcanary: group"):
        mon.sweep([], group="swa")


# --- sampling, warm-up, verify-after -----------------------------------------------------
def test_sampled_fingerprints_cover_every_slot_within_the_period(xp, device):
    period = 3
    toy = Toy(xp, device, kv=True, fingerprint_sample_period=period)
    toy.step([1], [9])
    flipped = int(toy.table_h[1, 4])
    toy.pool.flip(flipped, 1, 30)
    hits = []
    for k in range(period):
        toy.step([1], [1])
        hits.append(any(v.slot == flipped for v in drain(toy.mon, xp)))
    assert sum(hits) == 1  # exactly one phase of the period checks that slot's fingerprint
    assert toy.mon.main.sampler.phase() == (1 + period) % period


def test_warmup_discards_and_switches_the_position_check(xp, device):
    toy = Toy(xp, device)
    toy.step([1], [3])
    mon = toy.mon

    def skewed_decode(r):  # writes position P+1 where P is due: the chain-position check's case
        p = toy.P[r]
        mon.before_forward(xp.asarray([r]), xp.asarray([p]), xp.asarray([1]))
        mon.after_forward(xp.asarray([1000 * r + p]), xp.asarray([p + 1]), xp.asarray([int(toy.table_h[r, p])]))

    with mon.warmup():
        skewed_decode(2)  # P = 0: nothing to compare with
        toy.step([2], [2])
        skewed_decode(2)  # the check is off: silent
        toy.set_entry(1, 0, 50)  # an unstamped slot: verify fires, and warm-up discards it
        toy.step([1], [1])
        toy.set_entry(1, 0, 1)
    assert drain(mon, xp) == [] and mon.stats()["steps"] == 0 and mon.stats()["logged"] == 0
    toy.step([3], [2])
    skewed_decode(3)
    found = drain(mon, xp)
    assert [(v.tag, v.reasons, v.position, v.expected_position) for v in found] == [(T.WRITE, F.WRITE_POSITION, 3, 2)]


def test_verify_after_catches_corruption_during_the_forward(xp, device, chain_kind):
    toy = Toy(xp, device, kv=True, verify_after=True, chain=chain_kind)
    toy.step([1], [4], request_ids=["q"])
    slot = int(toy.table_h[1, 1])
    toy.step([1], [1], request_ids=["q"], between=lambda: toy.pool.flip(slot, 0, 3))
    found = drain(toy.mon, xp)
    assert [(v.tag, v.slot, v.request) for v in found] == [(T.VERIFY_AFTER, slot, "q")]


# --- misuse ----------------------------------------------------------------------------------
def test_misuse_raises_kvcanary_errors():
    t = np.zeros((3, 8), np.int32)
    cases = [
        (ValueError, "exactly one slot table", dict(num_slots=8, max_batch=1)),
        (ValueError, "exactly one slot table", dict(num_slots=8, max_batch=1, req_to_token=t, block_table=t)),
        (ValueError, "page_size", dict(num_slots=8, max_batch=1, block_table=t)),
        (ValueError, "page_size", dict(num_slots=8, max_batch=1, req_to_token=t, page_size=4)),
        (ValueError, "max_batch", dict(num_slots=8, max_batch=0, req_to_token=t)),
        (ValueError, "num_slots", dict(num_slots=0, max_batch=1, req_to_token=t)),
        (ValueError, "policy", dict(num_slots=8, max_batch=1, req_to_token=t, policy="shout")),
        (ValueError, "verify_capacity", dict(num_slots=8, max_batch=1, req_to_token=t, verify_capacity="big")),
        (TypeError, "swa", dict(num_slots=8, max_batch=1, req_to_token=t, swa=(4, t))),
        (TypeError, "req_to_token", dict(num_slots=8, max_batch=1, req_to_token=t.astype(np.float32))),
        (ValueError, "device", dict(num_slots=8, max_batch=1, req_to_token=t, device="tpu")),
    ]
    for exc, words, kw in cases:
        with pytest.raises(exc, match="^kvcanary: .*" + words):
            kc.KvCanary(**kw)
    mon = kc.KvCanary(num_slots=8, req_to_token=t, max_batch=1)
    with pytest.raises(ValueError, match="^kvcanary: after_forward"):
        mon.after_forward(np.array([1]), np.array([0]), np.array([1]))
    with pytest.raises(ValueError, match="^kvcanary: req_pool_indices"):
        mon.before_forward()
    with pytest.raises(ValueError, match="^kvcanary: req_pool_indices: a batch of 2"):
        mon.before_forward(np.array([1, 2]), np.array([0, 0]), np.array([1, 1]))
    with pytest.raises(ValueError, match="^kvcanary: prefix_lens"):
        mon.before_forward(np.array([1]), np.array([], np.int64), np.array([1]))
    with pytest.raises(ValueError, match="^kvcanary: real_kv"):
        kc.KvCanary(num_slots=64, req_to_token=t, max_batch=1,
                    real_kv=kc.RealKvSource(np.zeros((4, 16), np.uint8), bytes_per_token=16), real_kv_mode=2)


def test_import_does_not_pull_frameworks():
    import subprocess
    import sys

    code = ("import sys, kvcanary_cupy as kc, numpy as np; "
            "kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1); "
            "print(sorted(m for m in ('cupy', 'torch', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- GPU: graph capture and the late poll ------------------------------------------------------
@pytest.mark.gpu
def test_cupy_graph_capture_replays_the_checks(chain_kind):
    cp = pytest.importorskip("cupy")
    table = cp.zeros((3, 32), cp.int32)
    table[1] = cp.arange(1, 33, dtype=cp.int32)
    mon = kc.KvCanary(num_slots=64, req_to_token=table, max_batch=1, device="cuda", verify_capacity="max",
                      policy=lambda f: None, chain=chain_kind)
    rpi, pre, ext = cp.ones(1, cp.int64), cp.zeros(1, cp.int64), cp.ones(1, cp.int64)
    ids, pos, loc = cp.zeros(1, cp.int64), cp.zeros(1, cp.int64), cp.zeros(1, cp.int64)
    mon.bind_inputs(req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, input_ids=ids, positions=pos,
                    out_cache_loc=loc)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        mon.before_forward(cp.array([1]), cp.array([0]), cp.array([4]), request_ids=["r"], stream=s)
        mon.after_forward(cp.arange(100, 104), cp.arange(4), table[1, :4], stream=s)

    def refill(p):
        pre.fill(p)
        pos.fill(p)
        ids.fill(100 + p)
        loc[...] = table[1, p]

    with mon.warmup(stream=s):
        with s:
            refill(4)
            mon.before_forward(batch_size=1, stream=s)
            mon.after_forward(num_tokens=1, stream=s)
            s.begin_capture()
            mon.before_forward(batch_size=1, stream=s)
            mon.after_forward(num_tokens=1, stream=s)
            graph = s.end_capture()

    def replay(positions):
        found = []
        for p in positions:
            with s:
                refill(p)
                graph.launch(stream=s)
            mon.note_step(request_ids=[f"r@{p}"])
            found += mon.poll(stream=s)
        s.synchronize()
        return found + mon.poll(stream=s)

    found = replay(range(5, 12))
    assert found == []
    rec = mon.canary.host_records()
    np.testing.assert_array_equal(rec[1:13], kc.make_records(100 + np.arange(12), np.arange(12), chain=chain_kind))
    assert mon.stats()["steps"] == 7
    table[1, 2] = 40  # corrupt; the next replays' verify must see it
    found = replay(range(12, 14))
    # slot 40 is unstamped, and position 3 (slot 4) no longer links to its predecessor
    assert found and {v.slot for v in found} == {40, 4} and all(v.tag == T.VERIFY for v in found)
    assert {v.request for v in found} <= {"r@12", "r@13"}


@pytest.mark.gpu
def test_cuda_poll_returns_rows_one_step_late():
    cp = pytest.importorskip("cupy")
    toy = Toy(cp, "cuda")
    toy.step([1], [3], request_ids=["a"])
    toy.mon.poll()
    toy.set_entry(1, 1, 70)
    toy.step([1], [1], request_ids=["a"])
    first = toy.mon.poll()  # queued the copy; returns what the previous copy held
    cp.cuda.Device().synchronize()
    second = toy.mon.poll()
    assert first == [] and second and second[0].request == "a"


def test_poll_after_the_forward_and_after_the_engine_sync_reads_each_step_once(xp, device):
    # An engine that synchronizes every step: poll() after the launches queues the copy,
    # poll(queue_next=False) after the sync reads it; the step's own rows, named.
    toy = Toy(xp, device)
    toy.step([1], [3], request_ids=["a"])
    found = toy.mon.poll()
    sync(xp)  # the engine's own synchronization
    assert found + toy.mon.poll(queue_next=False) == []
    toy.set_entry(1, 1, 70)
    toy.step([1], [1], request_ids=["b"])
    found = toy.mon.poll()
    assert found == [] or device == "cpu"  # on CUDA nothing was queued before: the copy is queued now
    sync(xp)
    found += toy.mon.poll(queue_next=False)
    assert found and {v.request for v in found} == {"b"}
    assert toy.mon.poll(queue_next=False) == []
    toy.step([1], [1], request_ids=["c"])
    found = toy.mon.poll()
    sync(xp)
    found += toy.mon.poll(queue_next=False)
    assert found and {v.request for v in found} == {"c"}  # the corrupt entry is read again


@pytest.mark.parametrize("verify_after", [False, True])
def test_no_warning_on_clean_runs(xp, device, chain_kind, verify_after):
    toy = Toy(xp, device, kv=True, swa_window=4, expected=True, verify_after=verify_after, chain=chain_kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KvCanaryWarning)
        for _ in range(3):
            toy.step([1, 2, 3], [2, 3, 1])
            assert drain(toy.mon, xp) == []


def test_poll_hands_out_a_burst_longer_than_its_copy_window_once_in_ring_order(xp, device):
    # One step reads 300 slots nobody stamped: 300 rows, more than a poll's copy holds.
    n = 300
    r2t = xp.asarray(np.arange(2 * 512, dtype=np.int32).reshape(2, 512))
    mon = kc.KvCanary(num_slots=1024, req_to_token=r2t, max_batch=1, device=device, ring_capacity=1024,
                      policy=lambda found: None)
    one = lambda x: xp.asarray(np.array([x]))  # noqa: E731
    mon.before_forward(one(1), one(n), one(0), request_ids=["a"])
    found = mon.poll()
    sync(xp)
    found += mon.poll()
    assert len(found) == n and {v.request for v in found} == {"a"}
    assert sorted(v.slot for v in found) == list(range(512, 512 + n))
    assert [v.slot for v in found] == [v.slot for v in mon.log.read()]  # ring order, each once
    sync(xp)
    assert mon.poll() + mon.poll() == []


def test_cpu_polls_with_nothing_new_miss_nothing_after(cpu_backend):
    """On the CPU a poll that finds the ring and the warned-about counters as the previous poll
    left them returns at once: the rows, warnings and incidents that come after still show."""
    toy = Toy(np, "cpu")
    toy.step([1, 2], [3, 3], request_ids=["a", "b"])
    assert [toy.mon.poll() for _ in range(3)] == [[], [], []]
    toy.set_entry(1, 1, 40)  # row 1's position 1 now reads row 2's unstamped position 7
    toy.step([1], [1], request_ids=["a"])
    assert [(v.request, v.slot) for v in toy.mon.poll()] == [("a", 40), ("a", 3)]  # and its successor's chain
    assert toy.mon.poll() == []
    toy.set_entry(2, 0, -5)
    with pytest.warns(KvCanaryWarning, match="out-of-range plan input"):
        toy.step([2], [1], request_ids=["b"])
        toy.mon.poll()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert toy.mon.poll() == []  # warned once
    toy.mon.end_warmup()  # the log and the counters start again
    toy.set_entry(2, 0, 33)
    toy.set_entry(1, 1, 41)
    toy.step([1], [1], request_ids=["a"])
    assert [(v.request, v.slot) for v in toy.mon.poll()] == [("a", 41), ("a", 3)]
