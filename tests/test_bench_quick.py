"""The bench harness (``bench/``): case sizes, byte counts, workloads, the report, and whole runs.

The pure parts run anywhere; ``test_cpu_dry_run`` drives the whole harness on the
NumPy reference (figures meaningless, plumbing real); the GPU-marked smoke test
runs ``--quick`` on a device and checks every figure came back clean.
"""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

import kvcanary_cupy as kc
from bench import cases as C
from bench import floors, main, report, workloads

H200_L2 = 60 << 20


# --- the suite ------------------------------------------------------------------------
def test_full_suite_covers_the_requested_grid():
    s = C.full_suite()
    names = [c.name for c in s.cases]
    assert len(names) == len(set(names))
    decode = {(c.batch, c.prefix) for c in s.cases if c.group == "decode"}
    assert decode == {(b, p) for b in (1, 64, 256, 1024) for p in (512, 4096, 16384)} | {(4096, 4096)}
    assert all(c.chain == C.SCAN and "plan_and_verify" in c.ops for c in s.cases if c.group in ("decode", "swa",
                                                                                                   "real_kv"))
    for chain in (C.SCAN, C.SGLANG):  # the serial v1 chain beside the scan wherever rows are long
        prefill = {(c.batch, c.extend) for c in s.cases if c.group == "prefill" and c.chain == chain}
        assert prefill == {(b, e) for b in (1, 32) for e in (2048, 16384)}
        rows = [c for c in s.cases if c.group == "write_row" and c.chain == chain]
        assert {(s.pool(c.pool).kv_layers, c.mode) for c in rows} == {(k, m) for k in (1, 32) for m in ("ALL", "NONE")}
    v1_base = {(c.batch, c.extend) for c in s.cases if c.chain == C.SGLANG and c.baseline}
    assert v1_base == {(1, 2048), (32, 2048)}  # the baseline's serial chain takes seconds on longer rows
    monitor = [c for c in s.cases if c.group == "monitor"]
    for mode, tokens in (("NONE", False), ("PARTIAL", True)):  # configured as SGLang's figures, then fully on
        steps = {(c.batch, c.prefix) for c in monitor if c.mode == mode and c.check_tokens == tokens}
        assert steps == {(b, 4096) for b in C.SGLANG_BATCHES}
    # Both monitors where the records hold no fingerprints: stamping after the forward and before it.
    assert all(c.ops == (("step", "stamped") if c.mode == "NONE" else ("step",)) and s.pool(c.pool).kv_layers == 1
               for c in monitor)
    entries = {c.entries for c in s.cases}
    assert 1024 * 4096 in entries and 1024 * 16384 in entries
    swa = [c for c in s.cases if c.group == "swa"]
    assert swa and all(c.window == 4096 and c.entries >= 1 << 20 for c in swa)
    for layers in (1, 32):
        kv = [c for c in s.cases if c.group == "real_kv" and s.pool(c.pool).kv_layers == layers]
        assert {c.mode for c in kv} == {"NONE", "PARTIAL", "ALL"}
        assert all(c.entries >= 1_000_000 for c in kv)
        rows = [c for c in s.cases if c.group == "write_row" and s.pool(c.pool).kv_layers == layers]
        assert {c.mode for c in rows} == {"ALL", "NONE"} and all(c.tokens == 16384 for c in rows)
    assert all(s.pool(c.pool) for c in s.cases)
    assert s.runs >= 50 and s.copy_bytes >= 1 << 30
    assert s.hard_deadline_s <= 300  # the whole run stays within a few minutes


def test_full_suite_fits_one_h200_and_draws_from_a_ten_million_slot_pool():
    s = C.full_suite()
    for pool in s.pools:
        n, sets = C.layout(s, pool, H200_L2)
        assert C.device_bytes(s, pool, H200_L2) < 40 << 30, pool.name
        for c in s.cases:
            if c.pool != pool.name:
                continue
            k, _ = sets[c.name]
            assert k * c.slots <= C.draw_range(c, k, pool) < n  # distinct slots fit, slot 0 stays free
    main_n, _ = C.layout(s, s.pool("main"), H200_L2)
    assert main_n > 10_000_000


def test_rotation_exceeds_twice_l2_or_flushes():
    assert C.rotation(200 << 20, H200_L2, 8) == (1, False)
    k, flush = C.rotation(40 << 20, H200_L2, 8)
    assert k == 3 and not flush and k * (40 << 20) >= 2 * H200_L2
    assert C.rotation(1000, H200_L2, 8) == (8, True)
    assert C.rotation(1000, 0, 8) == (1, False)  # no cache to defeat (CPU)


def _recording_timer(seen: list):
    """A wall-clock timer whose hold and flush append their names to ``seen``."""
    from bench.timing import WallTimer  # noqa: PLC0415

    class Recording(WallTimer):
        def hold(self):
            seen.append("hold")

        def flush(self):
            seen.append("flush")

    return Recording()


def test_every_timed_run_waits_behind_a_hold():
    """The device timer queues a hold (and the flush, when asked) before each timed run,
    so a run's launches are never timed at the host's pace; warm-up runs need none."""
    seen = []
    t = _recording_timer(seen).device(lambda i: seen.append(i), runs=3, warmup=2, flush=True)
    assert seen == [0, 1, "hold", "flush", 0, "hold", "flush", 1, "hold", "flush", 2] and t.runs == 3


def test_work_queued_before_a_run_lies_between_its_flush_and_its_interval():
    """``before`` runs once per timed run, after its hold and flush, and never in a warm-up;
    on the CUDA timer it is queued before the run's start event."""
    from bench.timing import CudaTimer  # noqa: PLC0415

    seen = []
    _recording_timer(seen).device(lambda i: seen.append(i), runs=2, warmup=2, flush=True,
                                  before=lambda: seen.append("before"))
    assert seen == [0, 1, "hold", "flush", "before", 0, "hold", "flush", "before", 1]
    cp = _FakeCupy()
    stream = type("S", (), {"synchronize": lambda self: None})()
    CudaTimer(cp, stream, flush_bytes=1 << 20).device(lambda i: None, runs=3, warmup=1, flush=True,
                                                      before=lambda: cp.log.append(("before", None)))
    assert [k for k, _ in cp.log] == ["flush", "before", "record", "record"] * 3


def test_select_filters_by_regex():
    s = C.select(C.full_suite(), r"^decode b1024")
    assert {c.batch for c in s.cases} == {1024} and len(s.cases) == 3


# --- byte counts -------------------------------------------------------------------------
def test_floor_formulas_by_hand():
    # 2 rows, 10 entries, int64 row inputs, int32 table, no window.
    assert floors.plan_bytes(batch=2, entries=10, head_reads=0, index_itemsize=8, table_itemsize=4) == (
        3 * 2 * 8 + 10 * 4 + 10 * 32 + 3 * 8 + 3 * 8 + 2 * 8)
    assert floors.plan_bytes(batch=2, entries=10, head_reads=2, index_itemsize=8, table_itemsize=4,
                             lut_itemsize=4, verify=False) == 3 * 2 * 8 + 12 * 8 + 3 * 8 + 2 * 8
    assert floors.verify_bytes(entries=10, head_reads=0) == 10 * 24 + 10 * 32
    assert floors.verify_bytes(entries=10, head_reads=1, check_tokens=True, kv_per_slot=256) == (
        10 * 32 + 11 * 32 + 10 * 256)
    assert floors.write_bytes(batch=2, tokens=6, seeded_rows=2, index_itemsize=8, kv_per_slot=16) == (
        6 * 24 + 5 * 8 + 2 * 32 + 6 * 32 + 6 * 16)
    # The fused op: plan's reads, records and KV, no per-entry arrays; its token check reads an int64 per entry.
    assert floors.fused_bytes(batch=2, entries=10, head_reads=0, index_itemsize=8, table_itemsize=4) == (
        3 * 2 * 8 + 10 * (4 + 32) + 3 * 8 + 3 * 8 + 2 * 8)
    assert floors.fused_bytes(batch=2, entries=10, head_reads=2, index_itemsize=8, table_itemsize=4, lut_itemsize=4,
                              token_itemsize=8, kv_per_slot=16) == (
        3 * 2 * 8 + 12 * (4 + 4 + 32) + 10 * (8 + 16) + 3 * 8 + 3 * 8 + 2 * 8)
    assert floors.kv_bytes_per_slot("NONE", 32, 256) == 0
    assert floors.kv_bytes_per_slot("PARTIAL", 32, 256) == 32 * 16
    assert floors.kv_bytes_per_slot("ALL", 32, 256) == 32 * 256
    assert floors.kv_bytes_per_slot("ALL", 1, 256, read_bytes=128) == 128
    with pytest.raises(ValueError, match="kvcanary: mode"):
        floors.kv_bytes_per_slot("SOME", 1, 256)
    assert floors.floor_us(4_000_000, 4e12) == pytest.approx(1.0)
    assert math.isnan(floors.floor_us(1, 0))


def test_case_bytes_of_a_large_decode_step():
    c = C.Case("d", "decode", 1024, 4096, 1)
    b = floors.case_bytes(c, C.Pool("main", 10_000_000))
    n = 1024 * 4096
    assert b["verify"] == n * 24 + n * 32
    assert n * (4 + 32) < b["plan"] < n * (4 + 32) + 100_000
    assert b["plan_and_verify"] < b["plan"] + b["verify"] - n * 4 * 8  # no per-entry arrays written or read
    assert b["step"] == b["plan_and_verify"] + b["write"]
    kv = floors.case_bytes(C.Case("k", "real_kv", 1024, 4096, 1, pool="kv", mode="ALL"),
                           C.Pool("kv", 10_000_000, kv_layers=32))
    assert kv["verify"] == n * (24 + 32 + 32 * 256)
    mon = floors.case_bytes(C.Case("m", "monitor", 4, 100, 1, mode="PARTIAL", check_tokens=True),
                            C.Pool("m", 1000, kv_layers=1))
    assert mon["verify"] == 400 * (32 + 32 + 16) and mon["step"] == mon["plan_and_verify"] + mon["write"]


# --- workloads on the reference ----------------------------------------------------------------
@pytest.mark.parametrize("chain", kc.format.CHAINS)
@pytest.mark.parametrize("case,kv_layers", [
    (C.Case("d", "decode", 3, 40, 1), 0),
    (C.Case("p", "prefill", 2, 0, 9, ops=("plan", "write")), 0),
    (C.Case("w", "swa", 3, 40, 2, window=7), 0),
    (C.Case("k", "real_kv", 2, 24, 1, mode="ALL"), 2),
    (C.Case("k", "real_kv", 2, 24, 1, mode="PARTIAL"), 1),
])
def test_bench_steps_are_clean_and_sized_as_counted(case, kv_layers, chain):
    xp, dev = np, "cpu"
    rs = workloads.random_state(xp, 5)
    num_slots = 2000
    lut = workloads.make_lut(xp, rs, num_slots) if case.window else None
    canary = kc.CanaryBuffer.allocate(num_slots=num_slots, device=dev, chain=chain)
    log = kc.ViolationLog.allocate(capacity=64, device=dev)
    sources = ()
    if kv_layers:
        kv = workloads.make_kv(xp, kv_layers, num_slots, 32)
        assert np.unique(kv).shape[0] == kv.size  # distinct words, never all zeros
        sources = (workloads.kv_source(kv),)
    mode = kc.RealKvMode[case.mode]
    insts = []
    slots = workloads.draw_slots(xp, rs, 2 * case.slots, num_slots - 1)
    assert np.unique(slots).shape[0] == slots.shape[0] and slots.min() >= 1 and slots.max() < num_slots
    for i in range(2):  # two sets on one canary, as the timer rotates them
        inst = workloads.build(xp, dev, case, slots[i * case.slots:(i + 1) * case.slots], rs, lut)
        workloads.populate(xp, dev, inst, canary, log, rs, sources=sources, mode=mode)
        insts.append(inst)
    assert log.count == 0
    for inst in insts:
        calls = workloads.op_calls(inst, canary, log, sources=sources, mode=mode)
        for op in ("plan", "verify", "plan_and_verify", "write", "verify"):
            calls[op]()
        sc = inst.vp.host_scalars()
        assert sc == {"num_valid": case.entries, "enable": 1, "requested": case.entries, "input_errors": 0,
                      "overflows": 0, "max_requested": case.entries}
        assert log.count == 0
        written = canary.records[inst.out_cache_loc]
        assert np.array_equal(written[:, kc.format.FIELD_POSITION], inst.positions)
        assert np.array_equal(written[:, kc.format.FIELD_TOKEN], inst.input_ids)
        if mode != kc.RealKvMode.NONE:
            assert np.all(written[:, kc.format.FIELD_FINGERPRINT] != 0)
    b = floors.case_bytes(case, C.Pool("p", num_slots, kv_layers=kv_layers, bytes_per_token=32))
    vp = insts[0].vp
    assert b["plan"] >= case.entries * 32 + vp.offsets.nbytes  # at least what the plan writes
    assert b["write"] >= case.tokens * 32  # at least the records written
    # A verify of the prefix corrupted in one record must now report it.
    canary.records[int(insts[0].vp.slot_indices[case.entries // 2]), kc.format.FIELD_POSITION] += 1
    workloads.op_calls(insts[0], canary, log, sources=sources, mode=mode)["verify"]()
    assert case.entries == 0 or log.count >= 1


@pytest.mark.parametrize("mode,tokens", [("NONE", False), ("PARTIAL", True)])
def test_monitor_steps_are_clean_repeatable_and_see_corruption(mode, tokens):
    """The monitor of the bench's monitor cases: every prefix stamped, any batch up to its rows
    steps cleanly again and again, and a record changed under it is reported."""
    from bench import monitor_steps  # noqa: PLC0415
    from bench.platforms import CpuPlatform  # noqa: PLC0415

    xp, rs, num_slots, prefix = np, workloads.random_state(np, 3), 3000, 40
    kv = workloads.make_kv(xp, 1, num_slots, 32)
    setup = monitor_steps.build(xp, "cpu", batch=4, prefix=prefix, num_slots=num_slots, rs=rs,
                                sources=(workloads.kv_source(kv),), mode=mode, check_tokens=tokens)
    assert monitor_steps.config_of(C.Case("m", "monitor", 2, prefix, 1, mode=mode, check_tokens=tokens)) == (
        prefix, mode, tokens)
    assert setup.monitor.canary.chain == C.SCAN and (setup.monitor.expected_table is not None) == tokens
    for bs in (1, 4, 4, 2):
        setup.step(bs)()
        chk = setup.checks()
        assert (chk["violations"], chk["overflows"], chk["input_errors"]) == (0, 0, 0)
        assert chk["requested"] == bs * prefix
    host = monitor_steps.host_figures(setup, 2, timer=CpuPlatform().timer, calls=5, runs=2,
                                      capture=CpuPlatform().capture)
    assert host["eager_step_us"] > 0 and "graph" in host["graph_error"]
    table = setup.keep[0]
    setup.monitor.canary.records[int(table[2, 7]), kc.format.FIELD_POSITION] += 1
    setup.step(4)()
    assert setup.checks()["violations"] >= 1


def test_only_a_window_sends_the_step_through_the_lut():
    """A pool shared with a window case has a LUT; a case without a window must still
    write the table's own slots (the next positions of its rows), never LUT images that
    may be another instance's prefix."""
    xp, rs = np, workloads.random_state(np, 11)
    num_slots = 4000
    lut = workloads.make_lut(xp, rs, num_slots)
    assert not np.array_equal(lut[1:], np.arange(1, num_slots))  # a real permutation, not the identity
    decode = C.Case("d", "decode", 3, 40, 2)
    swa = C.Case("w", "swa", 3, 40, 2, window=7)
    slots = workloads.draw_slots(xp, rs, decode.slots, num_slots - 1)
    d = workloads.build(xp, "cpu", decode, slots, rs, lut)
    assert d.swa is None
    assert np.array_equal(d.out_cache_loc, d.table[1:, 40:].reshape(-1))
    w = workloads.build(xp, "cpu", swa, slots, rs, lut)
    assert w.swa is not None and w.swa.lut is lut
    assert np.array_equal(w.out_cache_loc, lut[w.table[1:, 40:].reshape(-1)])
    with pytest.raises(ValueError, match="kvcanary: bench: lut"):
        workloads.build(xp, "cpu", swa, slots, rs, None)


# --- report ----------------------------------------------------------------------------
def _fake_results():
    def ops(plan, verify, write, xf):
        return {op: {"device_us": t, "host_us": 5.0, "runs": 50, "bytes": 1, "floor_us": t / xf, "x_floor": xf}
                for op, t in (("plan", plan), ("verify", verify), ("write", write))}

    def case(name, group, entries, o, base=None, mode="NONE", layers=0, label="none",
             timed=("plan", "verify", "write")):
        return {"name": name, "group": group, "entries": entries, "tokens": 1024, "mode": mode, "kv_layers": layers,
                "pool_label": label, "timed_ops": list(timed), "ops": o, "error": None, "chain": "scan",
                "baseline": {"ops": base} if base else {"skipped": "n/a"}}

    cases = [
        case("decode b1024 p4096", "decode", 1 << 22, ops(100.0, 200.0, 10.0, 1.2), ops(900.0, 1800.0, 90.0, 1)),
        case("decode b1024 p16384", "decode", 1 << 24, ops(400.0, 800.0, 10.0, 1.25), ops(2000.0, 4000.0, 50.0, 1)),
        case("decode b1 p512", "decode", 512, ops(5.0, 5.0, 5.0, 40.0)),
        case("real-kv ALL", "real_kv", 1 << 20, ops(30.0, 300.0, 5.0, 1.4), mode="ALL", layers=1, label="1x256B"),
        case("row ALL", "write_row", 0, {"write": {"device_us": 900.0}}, mode="ALL", layers=1, label="1x256B",
             timed=("write",)),
        case("row NONE", "write_row", 0, {"write": {"device_us": 700.0}}, mode="NONE", layers=1, label="1x256B",
             timed=("write",)),
        {"name": "broken", "group": "decode", "entries": 5, "tokens": 1, "error": "RuntimeError: boom"},
    ]
    host = {"case": "decode b64 p512", "calls": 2000, "bare_launch_us": 4.0, "bare_launch_args_us": 5.0,
            "plan_us": 5.5, "verify_us": 7.0, "write_us": 5.0, "step_us": 18.0, "step_device_us": 12.0,
            "graph_replay_host_us": 3.0, "graph_replay_device_us": 9.0,
            "baseline": {"plan_us": 300.0, "verify_us": 200.0, "write_us": 250.0, "step_us": 800.0}}
    return {"meta": {"device": "NVIDIA H200", "platform": "cuda", "suite": "full", "runs": 50, "date": "today",
                     "notes": ["a note"]},
            "copy": {"buffer_bytes": 1 << 30, "bytes_moved": 2 << 30, "time_us": 500.0,
                     "bandwidth_bytes_per_s": 4.3e12},
            "host": host, "cases": cases}


def test_standing_checks_from_a_made_up_result():
    t = {x["target"]: x for x in report.standing_checks(_fake_results())}
    assert t["plan <= 1.3x floor at >= 1M entries"]["result"] == "PASS"
    assert t["plan <= 1.3x floor at >= 1M entries"]["value"] == pytest.approx(1.25)
    assert "p16384" in t["plan <= 1.3x floor at >= 1M entries"]["detail"]
    kv = t["verify, real-KV ALL 256 B/token, <= 1.3x floor at >= 1M entries"]
    assert kv["result"] == "MISS" and kv["value"] == pytest.approx(1.4)
    assert t["host: plan <= 1.5x a bare launch"]["result"] == "PASS"
    assert t["host: verify <= 1.5x a bare launch"]["result"] == "MISS"  # 7 / 4 = 1.75
    assert t["host: plan + verify + write <= 30 us of CPU"]["result"] == "PASS"
    base = t["baseline >= 5x slower (device time of a step) at >= 1M entries"]
    assert base["value"] == pytest.approx(6050 / 1210) and base["result"] == "PASS"
    assert t["baseline takes more host time per step"]["result"] == "PASS"
    empty = report.standing_checks({"cases": [], "host": {}})
    assert {x["result"] for x in empty} == {"n/a"}


def _fake_target_results():
    """A GPU result holding what the targets read: monitor steps, decode p4096 ops, prefill writes."""
    def case(name, group, batch, ops, entries=0, **kw):
        return {"name": name, "group": group, "batch": batch, "entries": entries, "tokens": batch, "mode": "NONE",
                "chain": "scan", "check_tokens": False, "timed_ops": list(ops), "error": None,
                "ops": {op: {"device_us": t} for op, t in ops.items()}, **kw}

    cases = [case(f"monitor b{b} p4096 NONE", "monitor", b, {"step": t, "stamped": t - 2.0}, entries=b * 4096,
                  gather={"time_us": g}) for b, t, g in ((1, 12.0, 2.0), (64, 30.0, 9.0), (256, 40.0, 33.0),
                                                         (1024, 150.0, 110.0), (4096, 600.0, 420.0))]
    cases += [case(f"decode b{b} p4096", "decode", b, {"plan": p, "write": w}) for b, p, w in
              ((1, 12.7, 6.0), (64, 20.0, 8.0), (256, 30.0, 7.0), (1024, 80.0, 7.0), (4096, 300.0, 9.0))]
    cases.append(case("decode b64 p512", "decode", 64, {"plan": 10.0, "write": 6.5}))
    cases += [case("prefill b1 e16384", "prefill", 1, {"write": 25.0}),
              case("prefill b32 e16384", "prefill", 32, {"write": 250.0}),
              case("prefill b32 e16384 sglang", "prefill", 32, {"write": 3000.0}, chain="sglang")]
    return {"meta": {"platform": "cuda", "device": "NVIDIA H200", "runs": 50}, "copy": {}, "host": {},
            "monitor_host": {"case": "monitor b64 p4096 NONE", "eager_step_us": 20.0, "graph_replay_host_us": 2.5,
                             "graph_replay_device_us": 30.0, "calls": 2000},
            "cases": cases}


def test_targets_from_a_made_up_result():
    rows = report.evaluate(_fake_target_results())
    by = {(r["id"], r["case"]): r for r in rows}
    # Each monitor step twice: stamped before the forward, then after it.
    t1 = {(r["case"], r["target"].rsplit(", ", 1)[1]): r for r in rows if r["id"] == "1"}
    step1 = t1["monitor b1 p4096 NONE", "stamped after the forward"]
    assert (step1["value"], step1["limit"], step1["sglang_us"], step1["result"]) == (12.0, 13.0, 26.7, "PASS")
    assert step1["ratio"] == pytest.approx(12 / 13)
    assert t1["monitor b1 p4096 NONE", "stamp_before_forward"]["value"] == 10.0
    assert t1["monitor b64 p4096 NONE", "stamped after the forward"]["result"] == "MISS"  # 30 > 25
    assert t1["monitor b64 p4096 NONE", "stamp_before_forward"]["result"] == "MISS"  # 28 > 25
    assert t1["monitor b4096 p4096 NONE", "stamp_before_forward"]["sglang_us"] == pytest.approx(1248.9)
    gather = [r for r in rows if r["id"] == "2"]
    assert [r["case"] for r in gather] == [f"monitor b{b} p4096 NONE" for b in (256, 1024, 4096) for _ in "ab"]
    assert gather[0]["limit"] == pytest.approx(1.25 * 33.0) and gather[0]["result"] == "PASS"
    assert gather[4]["result"] == "MISS" and "1.43x gather" in gather[4]["detail"]  # 600 / 420
    assert "stamped = 1.42x gather" in gather[5]["detail"]  # 598 / 420
    assert by["3", "prefill b1 e16384"]["result"] == "PASS"
    row32 = by["3", "prefill b32 e16384"]
    assert row32["result"] == "MISS" and row32["sglang_us"] == 5282.0 and "3,000" in row32["detail"]
    plan = {r["case"]: r for r in rows if r["id"] == "4"}
    assert plan["decode b1 p4096"]["result"] == "MISS"  # equal is not faster
    assert {plan[f"decode b{b} p4096"]["result"] for b in (64, 256, 1024, 4096)} == {"PASS"}
    host = [r for r in rows if r["id"] == "5"]
    assert [r["result"] for r in host] == ["PASS", "MISS", "n/a"]
    assert "python -m bench.monitor_host_overhead" in host[2]["case"]
    write = {r["case"]: r for r in rows if r["id"] == "6"}
    assert "decode b64 p512" not in write and write["decode b64 p4096"]["value"] == 8.0  # the worst of bs 64
    assert write["decode b64 p4096"]["result"] == "MISS" and write["decode b1 p4096"]["result"] == "PASS"
    assert write["decode b1024 p4096"]["sglang_us"] == 7.7
    assert len(rows) == 10 + 6 + 2 + 5 + 3 + 4
    out = report.summary(_fake_target_results())
    assert out.splitlines()[-1].split()[-1] == "PASS" and "MISS" in out  # the result ends each line
    md = report.markdown(_fake_target_results())
    assert "| 1 | 12.7 | 7.0 | 7.0 | 26.7 | 12.7 |" in md  # beside SGLang: its figures, then kvcanary's
    assert "median of 60 runs" in md and "| 32 x 16384 | 5,282 | 250.0 | 0.05x | 3,000 |" in md


def test_markdown_and_summary_of_a_made_up_result():
    r = _fake_results()
    r["targets"] = report.evaluate(r)
    md = report.markdown(r)
    assert "NVIDIA H200" in md and "4,300 GB/s" in md
    assert "| decode b1024 p4096 | 4Mi | 1024 | plan | 100.0 |" in md
    assert "| broken |" in md and "error" in md
    assert "| 1x256B | scan | 1024 | 900.0 | 700.0 | 200.0 |" in md  # total, chain alone, fingerprint part
    assert "**MISS**" in md and "**PASS**" in md and "- a note" in md
    out = report.summary(r)
    assert out.splitlines()[0].startswith("copy bandwidth: 4,300 GB/s")
    assert "cases with errors (1): broken" in out.splitlines()[-1]


def test_splice_replaces_appends_or_creates(tmp_path):
    assert report.splice(None, "T") == f"{report.BEGIN}\nT\n{report.END}\n"
    text = f"# Title\n\nintro\n\n{report.BEGIN}\nold\ntable\n{report.END}\n\nafter\n"
    new = report.splice(text, "NEW\n")
    assert new == f"# Title\n\nintro\n\n{report.BEGIN}\nNEW\n{report.END}\n\nafter\n"
    assert report.splice(new, "NEW") == new  # idempotent
    assert report.splice("# Title\n", "T").endswith(f"# Title\n\n{report.BEGIN}\nT\n{report.END}\n")
    p = tmp_path / "sub" / "README.md"
    report.update_markdown(str(p), "one")
    report.update_markdown(str(p), "two")
    assert p.read_text() == f"{report.BEGIN}\ntwo\n{report.END}\n"


def test_json_is_strict(tmp_path):
    p = tmp_path / "r.json"
    report.write_json({"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": (1, 2)},
                       "e": np.int64(3), "f": np.float64("nan")}, str(p))
    assert json.loads(p.read_text()) == {"a": None, "b": [1.5, None], "c": {"d": [1, 2]}, "e": 3, "f": None}


class _FakeCupy:
    """Just enough of CuPy for CudaTimer: events stamp a shared clock, scratch reads are logged."""

    def __init__(self):
        self.clock = 0.0
        self.log = []
        fake = self

        class Event:
            def record(self, stream):
                fake.log.append(("record", stream))
                self.t = fake.clock

        class Scratch:
            def __init__(self, n):
                self.n = n

            def sum(self):
                fake.log.append(("flush", self.n * 8))

        self.int64 = np.int64
        self.ones = lambda n, dtype: Scratch(n)
        self.cuda = type("cuda", (), {"Event": Event,
                                      "get_elapsed_time": staticmethod(lambda a, b: b.t - a.t)})


def test_cuda_timer_brackets_each_run_and_flushes_between_runs():
    from bench.timing import CudaTimer  # noqa: PLC0415

    cp = _FakeCupy()
    stream = type("S", (), {"synchronize": lambda self: None})()
    calls = []

    def fn(i):
        calls.append(i)
        cp.clock += 0.001 * (1 + i % 3)  # a run takes 1, 2 or 3 us of "device" time

    t = CudaTimer(cp, stream, flush_bytes=1 << 20).device(fn, runs=7, warmup=3, flush=True)
    assert calls == [0, 1, 2] + list(range(7))  # warm-up runs, then the timed ones, indices for rotation
    assert t.runs == 7 and t.device_samples == pytest.approx([1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0])
    assert t.device_us == pytest.approx(2.0)
    kinds = [k for k, _ in cp.log]
    assert kinds == ["flush", "record", "record"] * 7  # the flush lies outside each bracketed run
    assert {size for k, size in cp.log if k == "flush"} == {1 << 20}
    slow = CudaTimer(cp, stream, flush_bytes=0).device(lambda i: time.sleep(0.002), runs=50, warmup=3,
                                                       budget_s=0.001)
    assert slow.runs == 3  # over budget: the fewest runs allowed


def test_main_rejects_bad_runs():
    with pytest.raises(SystemExit, match="kvcanary: --runs"):
        main(["--runs", "0"])


def test_bench_uses_only_the_public_api_of_the_package():
    """bench/ stands outside the package: it imports kvcanary_cupy's public names (and
    backends.cuda_sources, for the header it inlines into its probes), no private name."""
    import ast  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    bad = []
    for path in sorted((pathlib.Path(__file__).resolve().parents[1] / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = set()  # names bound to kvcanary_cupy modules or objects
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom):
                if node.level > 1:
                    bad.append(f"{where}: relative import out of bench/")
                if node.level or not (node.module or "").startswith("kvcanary_cupy"):
                    continue
                parts = node.module.split(".") + [a.name for a in node.names]
                aliases |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                mods = [a for a in node.names if a.name.startswith("kvcanary_cupy")]
                parts = [p for a in mods for p in a.name.split(".")]
                aliases |= {a.asname or a.name.split(".")[0] for a in mods}
            else:
                continue
            bad += [f"{where}: {'.'.join(parts)}" for p in parts if p.startswith("_")]
            if "backends" in parts and parts[parts.index("backends") + 1:] != ["cuda_sources"]:
                bad.append(f"{where}: {'.'.join(parts)} (of the backends, only cuda_sources)")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, bad


def test_bench_launches_only_the_probes_it_compiles():
    import pathlib  # noqa: PLC0415
    import re  # noqa: PLC0415

    from bench import probes  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parents[1] / "bench"
    used = {n for f in root.glob("*.py") if f.name != "probes.py" for n in re.findall(r'"(kvc::[^"]+)"', f.read_text())}
    assert used == set(probes.NAME_EXPRESSIONS)
    text = probes.source()
    assert "#include" not in text and "inline constexpr" in text  # the library's header, inlined
    kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", text))
    assert {n.split("::")[1] for n in probes.NAME_EXPRESSIONS} <= kernels, kernels


def test_readme_has_the_markers():
    import pathlib  # noqa: PLC0415

    text = (pathlib.Path(__file__).resolve().parents[1] / "bench" / "README.md").read_text()
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert text.index(report.BEGIN) < text.index(report.END)


# --- whole runs ---------------------------------------------------------------------------
def _check_run(res, md_text, *, expect_baseline: bool, expect_graph: bool):
    assert not res["copy"].get("error") and res["copy"]["bandwidth_bytes_per_s"] > 0
    host = res["host"]
    assert not host.get("error"), host.get("traceback")
    assert host["violations"] == 0
    for k in ("bare_launch_us", "plan_us", "verify_us", "write_us", "step_us"):
        assert host[k] > 0
    if expect_graph:
        assert not host.get("graph_error"), host.get("graph_traceback")
        assert host["graph_replay_device_us"] > 0
    assert res["cases"]
    for c in res["cases"]:
        assert not c["error"], f"{c['name']}: {c.get('traceback')}"
        assert c["checks"]["violations"] == 0, c["name"]
        assert c["checks"].get("violations_after_write", 0) == 0, c["name"]  # the writes left every prefix intact
        if "verify" in c["timed_ops"]:
            assert c["checks"]["requested"] == c["checks"]["expected_entries"] == c["entries"]
            assert c["checks"]["enable"] == 1 and c["checks"]["input_errors"] == 0
        if c["group"] == "monitor":  # the latest step planned every entry, no overflow, no bad row
            for op in c["timed_ops"]:  # the monitor that stamps after the forward, and the one before
                ck = c["checks" if op == "step" else f"checks_{op}"]
                assert ck["violations"] == 0, (c["name"], op)
                assert ck["requested"] == ck["expected_entries"] == c["entries"] > 0
                assert ck["overflows"] == 0 and ck["input_errors"] == 0
            assert ("stamped" in c["timed_ops"]) == (c["mode"] == "NONE")
            assert c["gather"]["time_us"] > 0 and c["gather"]["entries"] == c["entries"]
        for op in c["timed_ops"]:
            o = c["ops"][op]
            assert o["device_us"] > 0 and o["bytes"] > 0 and o["runs"] >= 1
        b = c["baseline"]
        if expect_baseline and "skipped" not in b:
            assert not b.get("error"), f"{c['name']}: {b.get('traceback')}"
            assert all(b["agrees"][k] is True for k in ("plan", "write")), (c["name"], b["agrees"])
            assert b["agrees"].get("verify", True) is True, (c["name"], b["agrees"])
    assert {t["result"] for t in res["targets"]} <= {"PASS", "MISS", "n/a"}
    assert report.BEGIN in md_text and "**Targets**" in md_text


def _torch_available(cuda: bool) -> bool:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return torch.cuda.is_available() if cuda else True


def test_cpu_dry_run(tmp_path, capsys):
    """The harness end to end on the NumPy reference and CPU torch (figures meaningless)."""
    j, md = tmp_path / "b.json", tmp_path / "README.md"
    md.write_text(f"# Bench\n\n{report.BEGIN}\nold\n{report.END}\n\ntail\n")
    rc = main(["--quick", "--device", "cpu", "--runs", "2", "--json", str(j), "--markdown", str(md),
               "--only", r"decode b4|swa|PARTIAL|write row 1x|prefill|monitor b4"])
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(j.read_text())
    text = md.read_text()
    assert text.startswith("# Bench\n\n") and text.endswith("\n\ntail\n") and "old" not in text
    _check_run(res, text, expect_baseline=_torch_available(False), expect_graph=False)
    assert {c["group"] for c in res["cases"]} == {"decode", "swa", "real_kv", "write_row", "prefill", "monitor"}
    assert {c["chain"] for c in res["cases"]} == {"scan", "sglang"}
    assert {c["name"] for c in res["cases"] if c["group"] == "monitor"} == {
        "monitor b4 p256 NONE", "monitor b2 p256 PARTIAL+tokens", "monitor b4 p256 PARTIAL+tokens"}
    assert res["monitor_host"]["eager_step_us"] > 0 and res["monitor_host"]["case"] == "monitor b4 p256 NONE"
    last = out.rstrip().splitlines()
    assert last[-1].startswith("6 ") and any(r.startswith("1 ") for r in last[-25:])  # the targets table is last
    assert "**Targets**" in text and "Beside SGLang" in text and "**Monitor steps**" in text


def test_cpu_dry_run_rotating_input_sets(tmp_path, monkeypatch):
    """As on a GPU, tiny cases rotate over several input sets on one canary (a CPU has no
    L2 to defeat, so an H200's size is assumed): the sets must not disturb each other."""
    from bench import platforms  # noqa: PLC0415

    monkeypatch.setattr(platforms.CpuPlatform, "rotation_l2", lambda self: H200_L2)
    j, md = tmp_path / "b.json", tmp_path / "README.md"
    rc = main(["--quick", "--device", "cpu", "--runs", "2", "--json", str(j), "--markdown", str(md),
               "--only", r"decode|swa|PARTIAL b4"])  # monitor steps flush L2 instead: not here
    assert rc == 0
    res = json.loads(j.read_text())
    _check_run(res, md.read_text(), expect_baseline=_torch_available(False), expect_graph=False)
    assert {c["group"] for c in res["cases"]} == {"decode", "swa", "real_kv"}
    assert all(c["sets"] == 2 and c["l2_flush"] for c in res["cases"])  # the quick suite's most sets
    assert all("violations_after_write" in c["checks"] for c in res["cases"])


def test_an_op_that_fails_keeps_the_other_ops_figures(tmp_path, monkeypatch, capsys):
    """A backend without one op (a fused kernel not written yet, say) costs that op's figure,
    not the case's: the others are timed and reported, the error is named, the exit status is 1."""
    real = workloads.op_calls

    def without_fused(*args, **kw):
        calls = real(*args, **kw)

        def missing():
            raise NotImplementedError("no fused kernel here")

        return calls | {"plan_and_verify": missing}

    monkeypatch.setattr(workloads, "op_calls", without_fused)
    j = tmp_path / "b.json"
    rc = main(["--quick", "--device", "cpu", "--runs", "1", "--no-baseline", "--json", str(j), "--only", "decode b4"])
    out = capsys.readouterr().out
    assert rc == 1
    (c,) = json.loads(j.read_text())["cases"]
    assert c["error"].startswith("plan_and_verify: NotImplementedError")
    assert all(c["ops"][op]["device_us"] > 0 for op in ("plan", "verify", "write"))
    assert "| decode b4 p256 | 1024 | 4 | plan_and_verify: error |" in out and "| decode b4 p256 | 1024 | 4 | plan |" in out
    assert "cases with errors (1): decode b4 p256" in out


@pytest.mark.gpu
def test_quick_bench_on_the_gpu(tmp_path):
    """``--quick`` on a GPU: every case runs clean, the baseline agrees, a step (ops and monitor)
    replays as a graph."""
    j, md = tmp_path / "b.json", tmp_path / "README.md"
    rc = main(["--quick", "--runs", "3", "--json", str(j), "--markdown", str(md)])
    res = json.loads(j.read_text())
    _check_run(res, md.read_text(), expect_baseline=_torch_available(True), expect_graph=True)
    assert rc == 0
    assert res["meta"]["platform"] == "cuda"
    mh = res["monitor_host"]
    assert not mh.get("graph_error"), mh.get("graph_error")
    assert mh["eager_step_us"] > 0 and mh["graph_replay_host_us"] > 0 and mh["graph_replay_device_us"] > 0
    assert any(c["l2_flush"] for c in res["cases"])  # tiny cases: the timer evicted L2 between runs
