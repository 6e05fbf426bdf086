"""The simulator: clean traffic is silent, its bookkeeping holds, every fault is caught
by the detector it is tied to."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary_cupy import RealKvMode, selftest
from kvcanary_cupy.sim import FAULTS, PagedKvSim, SimConfig
from kvcanary_cupy.sim.allocator import FreeList
from kvcanary_cupy.sim.model import KvPool, kv_bytes
from kvcanary_cupy.sim.prefix_cache import PrefixCache


def _violations(recs):
    return [(r.step, m, str(v)) for r in recs for m, v in r.violations]


def check_bookkeeping(sim: PagedKvSim) -> None:
    """Every page has one owner; tables, LUT and free lists agree with the requests."""
    ps, B = sim.cfg.page_size, sim.cfg.block
    owners: dict = {}
    for r in sim.running:
        for p in r.pages:
            assert p not in owners, f"page {p} owned twice"
            owners[p] = r.rid
        for pos in range(r.P):
            s = r.slot(pos, ps, B)
            entry = sim.table.host[r.row, pos // ps]
            assert (entry if ps == 1 else entry * ps + pos % ps) == s
            assert sim.expected.host[r.row, pos] == r.tokens[pos]
        if sim.lut is not None:
            for pos in range(max(0, r.P - sim.cfg.swa_window - 1), r.P):
                assert sim.lut.host[r.slot(pos, ps, B)] >= 0
    for n in sim.cache.nodes.values():
        for p in n.pages:
            assert p not in owners, f"page {p} owned by a request and node {n.id}"
            owners[p] = n.id
        assert n.ref == sum(n in r.nodes for r in sim.running)
    assert not any(sim.pages.is_free(p) for p in owners)
    used = sim.swa_of[sim.swa_of >= 0]
    if sim.lut is not None:
        assert len(set(used.tolist())) == used.size, "an SWA slot mapped twice"
        assert not any(sim.swa_free.is_free(int(t)) for t in used)
        np.testing.assert_array_equal(sim.lut.host[1:], np.where(sim.swa_of >= 0, sim.swa_of, -1)[1:])


@pytest.mark.parametrize("page_size,num_pages", [(1, 320), (4, 80)])
def test_clean_run_is_silent_and_exercises_everything(page_size, num_pages):
    sim = PagedKvSim(SimConfig(page_size=page_size, num_pages=num_pages, seed=11))
    recs = []
    for _ in range(250):
        recs.append(sim.step())
        check_bookkeeping(sim)
    assert _violations(recs) == []
    for mon in sim.monitors.values():
        s = mon.stats()
        assert s["input_errors"] == 0 and s["overflows"] == 0 and s["dropped"] == 0
        assert s["slots_checked"] > 0 and s["slots_written"] > 0
    s = sim.monitor.stats()
    assert s["sweep_entries"] > 0 and s["groups"]["swa"]["max_requested"] > 0
    assert sim.stats_prefix_hits > 10 and sim.stats_evictions > 10


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 2, 4]),
       window=st.sampled_from([None, 1, 5, 12, 40]), draft=st.booleans(), chunk=st.sampled_from([1, 5, 16]),
       sample=st.sampled_from([None, 3]))
def test_random_engines_are_silent(seed, page_size, window, draft, chunk, sample):
    cfg = SimConfig(page_size=page_size, num_pages=320 // page_size, swa_window=window, draft=draft, chunk=chunk,
                    sample_period=sample, verify_after=bool(seed % 2), seed=seed)
    sim = PagedKvSim(cfg)
    assert _violations(sim.run(40)) == []
    check_bookkeeping(sim)
    assert all(m.stats()["input_errors"] == 0 for m in sim.monitors.values())


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f.number}")
@pytest.mark.parametrize("variant", [0, 1], ids=["token-table", "page-table"])
def test_each_fault_is_caught_by_its_detector(fault, variant):
    res = selftest.ClassResult(fault.number, fault.name, fault.detector, requested=2)
    for i in range(2):
        selftest.inject_once(fault, "cpu", 500 + 10 * fault.number + i, variant, res)
    assert res.injected == 2 and res.detected == 2, res.misses
    assert res.false_positives == 0


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f.number}")
def test_each_fault_is_caught_with_the_sglang_chain(fault):
    res = selftest.ClassResult(fault.number, fault.name, fault.detector, requested=2)
    for variant in (0, 1):
        selftest.inject_once(fault, "cpu", 700 + 10 * fault.number + variant, variant, res, chain="sglang")
    assert res.injected == 2 and res.detected == 2, res.misses
    assert res.false_positives == 0


def test_the_chain_kind_reaches_every_monitor():
    for kind in ("scan", "sglang"):
        sim = PagedKvSim(SimConfig(seed=3, chain=kind))
        assert {m.canary.chain for m in sim.monitors.values()} == {kind} and sim.monitor.swa_canary.chain == kind
    assert SimConfig().chain == "scan"


def test_faults_wait_for_a_target():
    sim = PagedKvSim(SimConfig(seed=2))
    rng = np.random.default_rng(0)
    by_number = {f.number: f for f in FAULTS}
    assert not by_number[4](rng).arm(sim)  # no cached block yet
    assert not by_number[9](rng).arm(sim)
    assert not by_number[1](rng).arm(sim)  # no running request
    no_swa = PagedKvSim(SimConfig(seed=2, swa_window=None))
    no_swa.run(5)
    assert not by_number[5](rng).arm(no_swa)


def test_position_fault_hits_the_target_pass_without_a_draft_pool():
    res = selftest.ClassResult(6, "", "", requested=1)
    cfgs = selftest.configs

    def no_draft(device, seed):
        return [SimConfig(device=device, draft=False, seed=seed)]
    selftest.configs = no_draft
    try:
        selftest.inject_once(FAULTS[5], "cpu", 3, 0, res)
    finally:
        selftest.configs = cfgs
    assert res.detected == 1


def test_kv_bytes_are_a_function_of_token_and_position():
    a = kv_bytes([5, 6, 5], [0, 1, 0], 2, 32, salt=1)
    assert a.shape == (2, 3, 32) and a.dtype == np.uint8
    np.testing.assert_array_equal(a[:, 0], a[:, 2])
    assert not np.array_equal(a[:, 0], a[:, 1]) and not np.array_equal(a[0, 0], a[1, 0])
    assert not np.array_equal(a, kv_bytes([5, 6, 5], [0, 1, 0], 2, 32, salt=2))


def test_paged_pool_writes_through_its_flat_view():
    p = KvPool(layers=2, num_slots=16, page_size=4, bytes_per_token=32, device="cpu", salt=1)
    p.data[...] = 0xAA  # poison
    p.write([5, -1, 9], [3, 7, 4], [0, 1, 1])
    np.testing.assert_array_equal(p.data[:, 1, 1], kv_bytes([3], [0], 2, 32, 1)[:, 0])
    np.testing.assert_array_equal(p.data[:, 2, 1], kv_bytes([4], [1], 2, 32, 1)[:, 0])
    assert (p.flat[:, [0, 1, 2, 3, 4, 6, 7, 8, 10]] == 0xAA).all()
    src = p.source()
    assert src.num_slots == 16 and src.num_layers == 2 and src.page_size == 4
    p.flip(9, 1, 3, 0x01)
    assert p.data[1, 2, 1, 3] == kv_bytes([4], [1], 2, 32, 1)[1, 0, 3] ^ 1


def test_free_list_is_lifo_and_ignores_double_free():
    f = FreeList(5, first=1)
    assert [f.alloc() for _ in range(4)] == [1, 2, 3, 4] and f.alloc() is None
    f.free(3)
    f.free(3)
    f.free(2)
    assert len(f) == 2 and f.alloc() == 2 and f.alloc() == 3 and f.alloc() is None


def test_prefix_cache_match_and_chains():
    c = PrefixCache(block=2)
    n1 = c.insert(c.root, (1, 2), [7], [14, 15], 3, clock=1)
    n2 = c.insert(n1, (3, 4), [8], [16, 17], 9, clock=2)
    assert c.match([1, 2, 3, 4, 5], 5, clock=3) == [n1, n2]
    assert c.match([1, 2, 3, 4], 3, clock=3) == [n1]  # a hit must leave a token to compute
    assert c.match([1, 9, 3, 4], 4, clock=3) == []
    ch = n2.chain()
    assert ch.first_position == 2 and ch.prev_slot == 15 and ch.key == f"node{n2.id}"
    assert n1.chain().prev_slot == -1
    assert c.evictable() == [n2]
    c.remove(n2)
    assert c.evictable() == [n1] and c.paths() == [[n1]]


@pytest.mark.parametrize("page_size,num_pages", [(1, 320), (4, 80)])
def test_stamping_before_the_forward_leaves_what_stamping_after_it_does(page_size, num_pages):
    """Twin engines without fingerprints, one whose monitors stamp in before_forward: by the
    time the forward writes its K/V the step's records hold its tokens, and after every step
    both leave the same records and statistics, silently."""
    cfg = SimConfig(page_size=page_size, num_pages=num_pages, seed=5, real_kv_mode=RealKvMode.NONE)
    after, before = PagedKvSim(cfg), PagedKvSim(dataclasses.replace(cfg, stamp_before_forward=True))
    forward_write, seen = before.k.write, []

    def forward(loc, ids, pos):  # the forward's K write, between before_forward and after_forward
        seen.append(np.array_equal(before.monitor.canary.host_records()[loc, 0], ids))
        forward_write(loc, ids, pos)

    before.k.write = forward
    for _ in range(120):
        assert _violations([after.step()]) == [] and _violations([before.step()]) == []
        for name, mon in after.monitors.items():
            twin = before.monitors[name]
            np.testing.assert_array_equal(mon.canary.host_records(), twin.canary.host_records())
            assert mon.stats() == twin.stats()
        np.testing.assert_array_equal(after.monitor.swa_canary.host_records(), before.monitor.swa_canary.host_records())
    assert len(seen) == 120 and all(seen)
    assert before.monitor.stats()["slots_written"] > 0 and before.stats_prefix_hits > 0


def test_config_validation():
    with pytest.raises(ValueError, match="kvcanary: SimConfig.block"):
        SimConfig(page_size=4, block=6)
    with pytest.raises(ValueError, match="kvcanary: SimConfig.max_len"):
        SimConfig(page_size=4, max_len=30)


@pytest.mark.gpu
def test_cuda_sim_matches_the_cpu_sim():
    cpu = PagedKvSim(SimConfig(seed=4))
    gpu = PagedKvSim(SimConfig(seed=4, device="cuda"))
    assert _violations(cpu.run(60)) == [] and _violations(gpu.run(60)) == []
    for m in ("main", "draft"):
        np.testing.assert_array_equal(cpu.monitors[m].canary.host_records(), gpu.monitors[m].canary.host_records())
    np.testing.assert_array_equal(cpu.monitor.swa_canary.host_records(), gpu.monitor.swa_canary.host_records())
    assert cpu.monitor.stats()["slots_checked"] == gpu.monitor.stats()["slots_checked"]


@pytest.mark.gpu
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f.number}")
def test_each_fault_is_caught_on_cuda(fault):
    res = selftest.ClassResult(fault.number, fault.name, fault.detector, requested=2)
    for i in range(2):
        selftest.inject_once(fault, "cuda", 900 + i, i, res)
    assert res.injected == 2 and res.detected == 2, res.misses
