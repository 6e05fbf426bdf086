"""KvCanary's step: chain kinds, the pre-forward check as one plan_and_verify, prepared steps.

- Chain kinds: every canary the monitor allocates follows ``chain=``; stamps, verifies,
  sweeps, transfers and the simulator agree with the records of that kind.
- ``before_forward`` checks through :func:`kvcanary_cupy.plan_and_verify` and leaves
  exactly what an independent :func:`kvcanary_cupy.plan` + :func:`kvcanary_cupy.verify`
  + :func:`kvcanary_cupy.write` run on the same inputs leaves (records, violation rows,
  counters, plan scalars, write plan, sampler); the separate ops run where the entries
  are read again (``verify_after``).
- Steps over bound buffers reuse their prepared arguments, yet follow new bindings,
  rebinding and plan growth, and refuse misuse as before.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from kvcanary_cupy import LaunchTag as T
from kvcanary_cupy import ops
from kvcanary_cupy.monitor import KvCanaryWarning, SwaGroup, SweepChain
from kvcanary_cupy.sim import PagedKvSim, SimConfig
from kvcanary_cupy.sim.model import KvPool
from tests.workloads import drain, sync

WIDTH, ROWS = 24, 5
NUM_SLOTS = 1 + (ROWS - 1) * WIDTH



def layout():
    """Row r holds positions at slots 1 + (r-1)*WIDTH + pos; its token at position p is 1000*r + p."""
    table = np.zeros((ROWS, WIDTH), np.int32)
    for r in range(1, ROWS):
        table[r] = 1 + (r - 1) * WIDTH + np.arange(WIDTH)
    exp = np.full((ROWS, WIDTH + 1), -1, np.int64)
    for r in range(1, ROWS):
        exp[r] = 1000 * r + np.arange(WIDTH + 1)
    return table, exp


def tokens_of(table, rows, P, ext):
    ids, pos, loc = [], [], []
    for r, e in zip(rows, ext):
        for p in range(P[r], P[r] + e):
            ids.append(1000 * r + p)
            pos.append(p)
            loc.append(int(table[r, p]))
    return ids, pos, loc


# --- chain kinds ------------------------------------------------------------------------------
def test_every_canary_follows_the_monitors_chain_kind(xp, device, chain_kind):
    table, _ = layout()
    lut = xp.asarray(((np.arange(NUM_SLOTS) + 3) % (NUM_SLOTS + 4)).astype(np.int32))
    mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=xp.asarray(table), max_batch=2, device=device,
                      swa=SwaGroup(window=3, lut=lut, num_slots=NUM_SLOTS + 4), chain=chain_kind, policy="raise")
    assert mon.chain == mon.canary.chain == mon.swa_canary.chain == chain_kind
    assert mon.stats()["chain"] == chain_kind
    P = {1: 0}
    for e in (5, 1, 1):
        ids, pos, loc = tokens_of(table, [1], P, [e])
        mon.before_forward(xp.asarray([1]), xp.asarray([P[1]]), xp.asarray([e]))
        mon.after_forward(xp.asarray(ids), xp.asarray(pos), xp.asarray(loc))
        P[1] += e
    assert drain(mon, xp) == []
    want = kc.make_records(1000 + np.arange(7), np.arange(7), chain=chain_kind)
    np.testing.assert_array_equal(mon.canary.host_records()[table[1, :7]], want)
    h_lut = kc.runtime.to_host(lut)
    np.testing.assert_array_equal(mon.swa_canary.host_records()[h_lut[table[1, :7]]], want)
    other = "sglang" if chain_kind == "scan" else "scan"
    assert not np.array_equal(want[1:, 2], kc.make_records(1000 + np.arange(7), np.arange(7), chain=other)[1:, 2])


def test_the_default_chain_kind_is_scan():
    mon = kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1)
    assert mon.chain == mon.canary.chain == "scan" and mon.stats()["chain"] == "scan"


@pytest.mark.parametrize("chain", ["v2", "SCAN", "", None, 1, ("scan",)])
def test_a_chain_kind_that_is_not_one_is_refused(chain):
    with pytest.raises(ValueError, match="^kvcanary: chain: expected one of 'scan', 'sglang'"):
        kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1, chain=chain)
    with pytest.raises(ValueError, match="^kvcanary: SimConfig.chain"):
        SimConfig(chain=chain)


def test_sweeps_follow_the_chain_kind(xp, device, chain_kind):
    table, _ = layout()
    mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=xp.asarray(table), max_batch=1, device=device,
                      chain=chain_kind, policy=lambda found: None)
    ids, pos, loc = tokens_of(table, [1], {1: 0}, [8])
    mon.before_forward(xp.asarray([1]), xp.asarray([0]), xp.asarray([8]))
    mon.after_forward(xp.asarray(ids), xp.asarray(pos), xp.asarray(loc))
    slots = table[1, :8].astype(np.int64)
    chains = [SweepChain(slots[:3], 0, -1, 1000 + np.arange(3), key="head"),
              SweepChain(slots[3:], 3, int(slots[2]), 1000 + np.arange(3, 8), key="tail")]
    assert mon.sweep(chains) == 8 and drain(mon, xp) == []
    mon.sweep([SweepChain(slots[4:], 4, int(slots[2]), key="skips one")])  # the predecessor is slot 3's, not 2's
    found = drain(mon, xp)
    assert [(v.tag, v.request, v.slot, v.reasons) for v in found] == [(T.SWEEP, "skips one", int(slots[4]), F.CHAIN)]


def test_records_travel_between_monitors_of_one_chain_kind(xp, device, chain_kind):
    table = np.arange(ROWS * WIDTH, dtype=np.int32).reshape(ROWS, WIDTH)

    def monitor(kind):
        return kc.KvCanary(num_slots=ROWS * WIDTH, req_to_token=xp.asarray(table), max_batch=1, device=device,
                           chain=kind, policy=lambda found: None)
    sender = monitor(chain_kind)
    sender.before_forward(xp.asarray([1]), xp.asarray([0]), xp.asarray([3]))
    sender.after_forward(xp.asarray([7, 8, 9]), xp.asarray([0, 1, 2]), xp.asarray(table[1, :3]))
    records = sender.export_slots(table[1, :3])
    other = "sglang" if chain_kind == "scan" else "scan"
    for kind, clean in ((chain_kind, True), (other, False)):
        receiver = monitor(kind)
        receiver.import_slots(table[2, :3], records)  # row 2 of the receiver's table holds them
        receiver.before_forward(xp.asarray([2]), xp.asarray([3]), xp.asarray([1]))
        receiver.after_forward(xp.asarray([10]), xp.asarray([3]), xp.asarray(table[2, 3:4]))
        found = drain(receiver, xp)
        if clean:
            assert found == []
        else:  # links of the other kind (the first one too: the kinds' anchors differ) fail the chain check
            assert found and all(v.reasons == F.CHAIN for v in found)
            assert {v.slot for v in found} == {int(s) for s in table[2, :3]}


def test_the_simulator_runs_with_each_chain_kind(chain_kind):
    sim = PagedKvSim(SimConfig(seed=4, chain=chain_kind))
    recs = sim.run(40)
    assert [v for r in recs for v in r.violations] == []
    for mon in sim.monitors.values():
        assert mon.chain == chain_kind and mon.canary.chain == chain_kind and mon.stats()["chain"] == chain_kind
    assert sim.monitor.swa_canary.chain == chain_kind


# --- the pre-forward check: plan_and_verify ---------------------------------------------------
class Independent:
    """The ops a monitor step stands for, run on buffers of its own: plan, verify, write."""

    def __init__(self, xp, device, *, chain, capacity, table, exp, sources, period):
        self.xp, self.table, self.exp, self.sources = xp, table, exp, sources
        self.canary = kc.CanaryBuffer.allocate(num_slots=NUM_SLOTS, device=device, chain=chain)
        self.vp = kc.VerifyPlan.allocate(capacity=capacity, max_batch=5, device=device)
        self.wp = kc.WritePlan.allocate(max_batch=5, device=device)
        self.log = kc.ViolationLog.allocate(capacity=4096, device=device)
        self.sampler = kc.FingerprintSampler.allocate(period=period, device=device)

    def step(self, rpi, pre, ext, ids, pos, loc):
        xp = self.xp
        exp = kc.ExpectedTokens(self.exp, xp.asarray(pre + ext), 0)
        kc.plan(self.vp, self.wp, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, req_to_token=self.table,
                expected=exp)
        kc.verify(self.canary, self.vp, log=self.log, tag=T.VERIFY, real_kv=self.sources,
                  real_kv_mode=kc.RealKvMode.ALL, check_tokens=True, sample=self.sampler)
        kc.write(self.canary, self.wp, input_ids=ids, positions=pos, out_cache_loc=loc, log=self.log, tag=T.WRITE,
                 real_kv=self.sources, real_kv_mode=kc.RealKvMode.ALL)


def rows_of(log):
    return sorted(map(tuple, log.rows().tolist()))  # GPU rows come in any order


def assert_same_state(mon, ind, bs):
    np.testing.assert_array_equal(mon.canary.host_records(), ind.canary.host_records())
    assert rows_of(mon.log) == rows_of(ind.log)
    assert mon.log.counters() == ind.log.counters()
    assert mon.verify_plan.host_scalars() == ind.vp.host_scalars()
    to_host = kc.runtime.to_host
    np.testing.assert_array_equal(to_host(mon.verify_plan.offsets)[:bs + 1], to_host(ind.vp.offsets)[:bs + 1])
    for f in ("offsets", "seed_slots", "num_rows"):
        np.testing.assert_array_equal(to_host(getattr(mon.write_plan, f)), to_host(getattr(ind.wp, f)), err_msg=f)
    assert mon.main.sampler.phase() == ind.sampler.phase()


@pytest.mark.parametrize("capacity", [64, 9])  # 9: some steps overflow and verify nothing, on both sides
def test_before_forward_leaves_what_plan_then_verify_leave(xp, device, chain_kind, capacity):
    h_table, h_exp = layout()
    table, exp = xp.asarray(h_table), xp.asarray(h_exp)
    pool = KvPool(layers=2, num_slots=NUM_SLOTS, page_size=1, bytes_per_token=32, device=device, salt=9)
    sources = (pool.source(),)
    mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=table, max_batch=5, device=device, real_kv=sources,
                      real_kv_mode=kc.RealKvMode.ALL, expected_tokens=exp, fingerprint_sample_period=2,
                      verify_capacity=capacity, grow_on_overflow=False, chain=chain_kind, policy=lambda found: None)
    ind = Independent(xp, device, chain=chain_kind, capacity=capacity, table=table, exp=exp, sources=sources,
                      period=2)
    rng = np.random.default_rng(7)
    P = {r: 0 for r in range(ROWS)}
    faults = {4: lambda: table.__setitem__((1, 1), int(h_table[3, 0])),  # a repointed entry
              6: lambda: pool.flip(int(h_table[2, 0]), 1, 3),  # a flipped K/V byte
              8: lambda: exp.__setitem__((2, 1), 5),  # the truth disagrees with the stored token
              10: lambda: table.__setitem__((4, 0), -3)}  # out-of-range plan input
    for k in range(14):
        if k in faults:
            faults[k]()
        rows = sorted(rng.choice(np.arange(1, ROWS), size=int(rng.integers(1, 5)), replace=False).tolist())
        ext = [min(int(rng.integers(1, 4)) if P[r] else 3, WIDTH - P[r]) for r in rows]
        rows += [0]  # a padding row
        ext += [0]
        ids, pos, loc = tokens_of(h_table, rows[:-1], P, ext[:-1])
        args = [xp.asarray(np.array(a, np.int64)) for a in (rows, [P[r] for r in rows], ext, ids, pos, loc)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KvCanaryWarning)
            mon.before_forward(*args[:3])
            pool.write(loc, ids, pos)
            mon.after_forward(*args[3:])
        ind.step(*args)
        for r, e in zip(rows, ext):
            P[r] += e
        assert_same_state(mon, ind, len(rows))
    assert ind.log.count > 0 and mon.stats()["violations"] == 0  # found rows, not yet polled
    if capacity == 9:
        assert mon.log.counters()["verifies_skipped"] > 0


def spy(monkeypatch, name, canary_at=0):
    """Count the calls of the op ``name`` (by its first argument, the canary or a plan; or by the
    argument at ``canary_at``)."""
    calls = []
    real = getattr(ops, name)

    def counted(*a, **k):
        calls.append(a[canary_at])
        return real(*a, **k)
    monkeypatch.setattr(ops, name, counted)
    return calls


def test_before_forward_plans_and_verifies_each_group_in_one_op(monkeypatch):
    table, _ = layout()
    lut = ((np.arange(NUM_SLOTS) + 3) % (NUM_SLOTS + 4)).astype(np.int32)
    fused, plans, verifies = (spy(monkeypatch, n) for n in ("plan_and_verify", "plan", "verify"))
    for verify_after in (False, True):
        mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=table, max_batch=2, verify_after=verify_after,
                          swa=SwaGroup(window=3, lut=lut, num_slots=NUM_SLOTS + 4), policy="raise")
        fused.clear(), plans.clear(), verifies.clear()
        P = {1: 0}
        for e in (4, 1):
            ids, pos, loc = tokens_of(table, [1], P, [e])
            mon.before_forward(np.array([1]), np.array([P[1]]), np.array([e]))
            mon.after_forward(np.array(ids), np.array(pos), np.array(loc))
            P[1] += e
        assert mon.poll() == []
        if not verify_after:  # one op per group and step; the entries are not needed again
            assert len(fused) == 4 and plans == [] and verifies == []
        else:  # the verify after the write reads the entries: plan, verify before and after
            assert fused == [] and len(plans) == 4 and len(verifies) == 8


def test_a_repaired_cpu_step_leaves_the_counters_of_one_that_fit():
    """On the CPU an overflowing step is grown, planned and verified again at once: it leaves what
    a monitor whose plan never overflowed leaves (records, rows, every counter, sampler phase)."""
    h_table, h_exp = layout()

    def run(capacity):
        table, exp = h_table.copy(), h_exp.copy()
        pool = KvPool(layers=2, num_slots=NUM_SLOTS, page_size=1, bytes_per_token=32, device="cpu", salt=9)
        mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=table, max_batch=4, real_kv=[pool.source()],
                          real_kv_mode=kc.RealKvMode.ALL, expected_tokens=exp, fingerprint_sample_period=3,
                          verify_capacity=capacity, policy=lambda found: None)
        P, found = {r: 0 for r in range(ROWS)}, []
        for k, (rows, ext) in enumerate([([1, 2], [3, 2]), ([1, 2], [1, 1]), ([1, 2, 3], [1, 1, 4]),
                                         ([1, 2, 3], [1, 1, 1]), ([1, 3], [2, 1])]):
            if k == 3:
                pool.flip(int(table[2, 1]), 0, 7)
                table[3, 2] = table[1, 0]
            ids, pos, loc = tokens_of(h_table, rows, P, ext)
            mon.before_forward(np.array(rows), np.array([P[r] for r in rows]), np.array(ext))
            pool.write(loc, ids, pos)
            mon.after_forward(np.array(ids), np.array(pos), np.array(loc))
            for r, e in zip(rows, ext):
                P[r] += e
            found += mon.poll()
        return mon, found

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", KvCanaryWarning)
        small, found_small = run(2)
    fit, found_fit = run("max")
    assert sum("grown to" in str(w.message) for w in got) >= 2  # it did overflow, more than once
    assert small.stats()["overflows"] >= 2 and fit.stats()["overflows"] == 0
    np.testing.assert_array_equal(small.canary.host_records(), fit.canary.host_records())
    assert [str(v) for v in found_small] == [str(v) for v in found_fit] and found_fit
    assert small.log.counters() == fit.log.counters()
    assert small.log.counters()["verifies_skipped"] == 0
    assert small.main.sampler.phase() == fit.main.sampler.phase()


# --- prepared steps over bound buffers ----------------------------------------------------------
def bound_monitor(xp, device, **kw):
    table, _ = layout()
    t = xp.asarray(table)
    mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=t, max_batch=2, device=device, policy=lambda found: None,
                      **kw)
    bufs = {n: xp.zeros(2 if n in ("rpi", "pre", "ext") else 8, xp.int64)
            for n in ("rpi", "pre", "ext", "ids", "pos", "loc")}
    mon.bind_inputs(req_pool_indices=bufs["rpi"], prefix_lens=bufs["pre"], extend_lens=bufs["ext"],
                    input_ids=bufs["ids"], positions=bufs["pos"], out_cache_loc=bufs["loc"])
    return mon, t, table, bufs


def fill(xp, bufs, table, rows, P, ext):
    ids, pos, loc = tokens_of(table, rows, P, ext)
    for name, vals in (("rpi", rows), ("pre", [P[r] for r in rows]), ("ext", ext), ("ids", ids), ("pos", pos),
                       ("loc", loc)):
        bufs[name][:len(vals)] = xp.asarray(np.array(vals, np.int64))
    for r, e in zip(rows, ext):
        P[r] += e
    return len(rows), len(ids)


def test_prepared_steps_follow_new_bindings_and_rebinding(xp, device):
    mon, t, table, bufs = bound_monitor(xp, device)
    P = {r: 0 for r in range(ROWS)}
    for rows, ext in (([1], [3]), ([1], [1]), ([1], [1])):
        bs, n = fill(xp, bufs, table, rows, P, ext)
        mon.before_forward(batch_size=bs, request_ids=["a"])
        mon.after_forward(num_tokens=n)
    assert drain(mon, xp) == []
    # New buffers of another size: the same batch size now reads them.
    new = {k: xp.zeros(4 if k in ("rpi", "pre", "ext") else 8, xp.int64) for k in bufs}
    mon.bind_inputs(req_pool_indices=new["rpi"], prefix_lens=new["pre"], extend_lens=new["ext"],
                    input_ids=new["ids"], positions=new["pos"], out_cache_loc=new["loc"])
    bs, n = fill(xp, new, table, [2], P, [2])
    bufs["rpi"][:] = 1  # the old buffers hold row 1: it must not be read or stamped
    mon.before_forward(batch_size=bs, request_ids=["b"])
    mon.after_forward(num_tokens=n)
    rec = mon.canary.host_records()
    assert rec[table[2, :2], 0].tolist() == [2000, 2001] and rec[table[1, 5]].tolist() == [0, 0, 0, 0]
    # Rebinding the table: the prepared step reads the new one.
    t2 = xp.asarray(table)
    t2[2, 0] = int(table[1, 1])  # row 2's position 0 now points at row 1's position 1
    mon.rebind(req_to_token=t2)
    bs, n = fill(xp, new, table, [2], P, [1])
    mon.before_forward(batch_size=bs, request_ids=["b"])
    mon.after_forward(num_tokens=n)
    found = drain(mon, xp)
    assert found and {v.request for v in found} == {"b"}
    assert [(v.slot, v.reasons & F.POSITION) for v in found if v.slot == int(table[1, 1])] == [(int(table[1, 1]),
                                                                                                F.POSITION)]


def test_prepared_steps_still_refuse_misuse(xp, device):
    mon, t, table, bufs = bound_monitor(xp, device)
    P = {r: 0 for r in range(ROWS)}
    bs, n = fill(xp, bufs, table, [1], P, [2])
    mon.before_forward(batch_size=bs)
    mon.after_forward(num_tokens=n)
    for bad, exc in ((True, TypeError), (1.0, TypeError), (-1, ValueError), (3, ValueError)):
        with pytest.raises(exc, match="^kvcanary: (batch_size|req_pool_indices)"):
            mon.before_forward(batch_size=bad)
    with pytest.raises(ValueError, match="^kvcanary: request_ids"):
        mon.before_forward(batch_size=1, request_ids=["a", "b"])
    assert mon.stats()["steps"] == 1  # nothing refused was counted
    bs, n = fill(xp, bufs, table, [1], P, [1])
    mon.before_forward(batch_size=np.int64(bs))  # a NumPy integer is an integer
    for bad, exc in ((True, TypeError), (-2, ValueError), (9, ValueError)):
        with pytest.raises(exc, match="^kvcanary: (num_tokens|input_ids)"):
            mon.after_forward(num_tokens=bad)
    mon.after_forward(num_tokens=n)  # the refused calls left the step open
    assert drain(mon, xp) == [] and mon.stats()["slots_written"] == 3


def test_a_bound_step_that_overflows_grows_its_plan(xp, device):
    mon, t, table, bufs = bound_monitor(xp, device, verify_capacity=2)
    P = {r: 0 for r in range(ROWS)}
    found = []
    with pytest.warns(KvCanaryWarning, match="overflowed"):
        for rows, ext in (([1, 2], [3, 3]), ([1, 2], [1, 1]), ([1, 2], [1, 1]), ([1, 2], [1, 1])):
            bs, n = fill(xp, bufs, table, rows, P, ext)
            if P[1] == 6:
                t[1, 1] = 70  # caught only by a step whose plan holds it
            mon.before_forward(batch_size=bs, request_ids=["a", "b"])
            mon.after_forward(num_tokens=n)
            found += drain(mon, xp)
    assert mon.verify_plan.capacity >= 8
    assert any(v.slot == 70 and v.request == "a" for v in found)


@pytest.mark.parametrize("stamp", [False, True], ids=["after", "stamped"])
@pytest.mark.parametrize("swa", [None, "bound", "translated"])
def test_bound_steps_launch_their_ops_once_recorded_and_leave_what_passed_arrays_leave(
        xp, device, chain_kind, monkeypatch, stamp, swa):
    """A bound step of a shape seen before launches the ops it recorded the first time (no op
    is called again), and leaves byte for byte what the same steps passed as arrays leave."""
    h_table, h_exp = layout()
    lut = xp.asarray(((np.arange(NUM_SLOTS) + 3) % (NUM_SLOTS + 4)).astype(np.int32))

    def monitor():
        group = None if swa is None else SwaGroup(window=4, lut=lut, num_slots=NUM_SLOTS + 4)
        return kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=xp.asarray(h_table), max_batch=2, device=device,
                           expected_tokens=xp.asarray(h_exp), verify_capacity="max", swa=group, chain=chain_kind,
                           stamp_before_forward=stamp, policy=lambda found: None)
    bound, given = monitor(), monitor()
    bufs = {n: xp.zeros(2 if n in ("rpi", "pre", "ext") else 8, xp.int64)
            for n in ("rpi", "pre", "ext", "ids", "pos", "loc", "swa")}
    bound.bind_inputs(req_pool_indices=bufs["rpi"], prefix_lens=bufs["pre"], extend_lens=bufs["ext"],
                      input_ids=bufs["ids"], positions=bufs["pos"], out_cache_loc=bufs["loc"],
                      swa_out_cache_loc=bufs["swa"] if swa == "bound" else None)
    calls = {n: spy(monkeypatch, n, canary_at=0 if n == "write" else 2)
             for n in ("plan_and_verify", "plan_verify_write", "write")}
    P = {r: 0 for r in range(ROWS)}
    shapes = []
    for k, (rows, ext) in enumerate((([1, 2], [3, 2]), ([1, 2], [1, 1]), ([1, 2], [1, 1]), ([2], [1]),
                                     ([1, 2], [1, 1]), ([2], [1]), ([1, 2], [1, 1]), ([1, 2], [1, 1]))):
        if k == 5:  # a stray write into both canaries: every later step reports it
            for mon in (bound, given):
                mon.canary.records[int(h_table[1, 1]), 0] += 1
        if k == 6:
            bound.table[2, 0] = given.table[2, 0] = int(h_table[1, 2])  # a repointed entry, in both tables
        pre = [P[r] for r in rows]
        bs, n = fill(xp, bufs, h_table, rows, P, ext)
        if swa == "bound":
            bufs["swa"][:n] = lut[bufs["loc"][:n]]
        shapes.append((bs, n))
        arrays = [xp.asarray(np.array(a, np.int64)) for a in (rows, pre, ext)]
        writes = [bufs[k][:n].copy() for k in ("ids", "pos", "loc")]
        swa_loc = dict(swa_out_cache_loc=bufs["swa"][:n].copy()) if swa == "bound" else {}
        if stamp:
            bound.before_forward(batch_size=bs, num_tokens=n)
            bound.after_forward()
            given.before_forward(*arrays, **dict(zip(("input_ids", "positions", "out_cache_loc"), writes)),
                                 **swa_loc)
            given.after_forward()
        else:
            bound.before_forward(batch_size=bs)
            bound.after_forward(num_tokens=n)
            given.before_forward(*arrays)
            given.after_forward(*writes, **swa_loc)
    np.testing.assert_array_equal(bound.canary.host_records(), given.canary.host_records())
    if swa is not None:
        np.testing.assert_array_equal(bound.swa_canary.host_records(), given.swa_canary.host_records())
    assert rows_of(bound.log) == rows_of(given.log) and given.log.count > 0
    assert bound.log.counters() == given.log.counters()
    # The given monitor called the ops every step; the bound one only on the first step of each shape:
    # a batch size before the forward (with its token count, stamped), a token count after it. A step
    # that translates SWA slots does more than ops where it writes: that part calls its ops every step.
    fused = "plan_verify_write" if stamp else "plan_and_verify"
    every = len(shapes)
    before = every if stamp and swa == "translated" else len(set(shapes)) if stamp else len({b for b, _ in shapes})
    after = every if swa == "translated" else len({n for _, n in shapes})
    assert calls[fused].count(given.canary) == every and calls[fused].count(bound.canary) == before
    if not stamp:
        assert calls["write"].count(given.canary) == every and calls["write"].count(bound.canary) == after
    if swa is not None:  # the SWA group's write is in its fused launch (stamped, bound slots) or apart
        swa_calls = calls[fused] if stamp and swa == "bound" else calls["write"]
        assert swa_calls.count(bound.swa_canary) == (before if stamp else after)


def test_unnamed_steps_map_to_no_request_around_named_ones(xp, device):
    table, _ = layout()
    mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=xp.asarray(table), max_batch=2, device=device,
                      policy=lambda found: None)
    t = mon.table
    P = {r: 0 for r in range(ROWS)}

    def step(rows, ext, ids=None):
        i, p, loc = tokens_of(table, rows, P, ext)
        mon.before_forward(xp.asarray(rows), xp.asarray([P[r] for r in rows]), xp.asarray(ext), request_ids=ids)
        mon.after_forward(xp.asarray(i), xp.asarray(p), xp.asarray(loc))
        for r, e in zip(rows, ext):
            P[r] += e
    step([1, 2], [3, 3])
    step([1, 2], [1, 1])
    assert drain(mon, xp) == []
    t[2, 0] = 90  # row 2 now reads an unstamped slot every step
    step([2], [1], ["b"])
    step([2], [1])
    step([2], [1])
    step([1, 2], [1, 1], ["a", "b2"])
    step([2], [1])
    found = drain(mon, xp)  # one poll over all of them: each row maps to its own step
    assert [v.request for v in found if v.slot == 90] == ["b", None, None, "b2", None]
    step([2], [1], ["b3"])
    step([2], [1])
    assert [v.request for v in drain(mon, xp) if v.slot == 90] == ["b3", None]
