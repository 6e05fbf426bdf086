"""The ops as torch.library custom ops (kvcanary_cupy.integrations.torch_ops), on the CPU.

A small paged-KV decode loop runs three ways side by side: the library's ops on NumPy
arrays, the custom ops through torch_ops on torch tensors, and the same step compiled with
``torch.compile(fullgraph=True)``. Every byte each one writes (records, plans, log rows and
counters, sampler state) must agree, and the faults injected on the way must be found.
tests/gpu/test_torch_ops_gpu.py runs the same harness on CUDA tensors.
"""
from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason, LaunchTag, RealKvMode
from kvcanary_cupy.integrations import torch_ops as kt

NUM_SLOTS = 64
NUM_REQUESTS = 4  # table rows; row 0 is the padding row
MAX_LEN = 16
BATCH = 3  # rows 1..3
MAX_TOKENS = 16  # per-step input buffers, padded (a graph-captured engine's static buffers)
HEAD_DIM = 16  # float16 K/V: 32 bytes per slot
PREFILL = (4, 3, 5)
FAULT_TOKEN_STEP, FAULT_KV_STEP = 3, 5  # after these steps, a record and K/V bytes change


# --- the workload: what an engine would do, on the host --------------------------------
@dataclass
class Step:
    """One step's inputs, as NumPy (the padding of the token buffers is slot 0)."""

    rpi: np.ndarray  # int64 [BATCH]
    prefix: np.ndarray  # int64 [BATCH]
    extend: np.ndarray  # int64 [BATCH]
    ids: np.ndarray  # int64 [MAX_TOKENS]
    pos: np.ndarray  # int64 [MAX_TOKENS]
    loc: np.ndarray  # int64 [MAX_TOKENS]
    kv_new: np.ndarray  # float16 [MAX_TOKENS, HEAD_DIM]: what the forward writes at loc
    exp_table: np.ndarray  # int64 [NUM_REQUESTS, MAX_LEN]: the tokens each request holds
    valid_lens: np.ndarray  # int64 [BATCH]
    rec_fault: np.ndarray  # int64 [NUM_SLOTS, 4]: added to the records after the step
    kv_fault_slot: np.ndarray  # int64 [1]: slot whose K/V a stray write replaces (0: none)
    kv_fault_value: np.ndarray  # float16 [1, HEAD_DIM]


@dataclass
class Workload:
    table: np.ndarray  # int32 slot table: req_to_token [R, MAX_LEN] or block_table [R, pages]
    page_size: int  # 1 for req_to_token
    kv0: np.ndarray  # float16 [NUM_SLOTS, HEAD_DIM]
    steps: list
    token_fault_slot: int
    kv_fault_slot: int

    @property
    def paged(self) -> bool:
        return self.page_size > 1

    def slot(self, rp: int, pos: int) -> int:
        return int(self.table[rp, pos // self.page_size]) * self.page_size + pos % self.page_size


def make_workload(seed: int = 0, *, paged: bool = False, num_steps: int = 8) -> Workload:
    rng = np.random.default_rng(seed)
    if paged:
        page = 4
        pages = rng.permutation(np.arange(1, NUM_SLOTS // page))[: (NUM_REQUESTS - 1) * (MAX_LEN // page)]
        table = np.zeros((NUM_REQUESTS, MAX_LEN // page), np.int32)
        table[1:] = pages.reshape(NUM_REQUESTS - 1, -1)
    else:
        page = 1
        # Every position a request reaches has a slot of its own: rows writing one slot (slot 0)
        # in the same step would leave its record to the order of GPU threads.
        slots = rng.permutation(np.arange(1, NUM_SLOTS))[: (NUM_REQUESTS - 1) * MAX_LEN]
        table = np.zeros((NUM_REQUESTS, MAX_LEN), np.int32)
        table[1:] = slots.reshape(NUM_REQUESTS - 1, -1)
    kv0 = rng.uniform(0.5, 2.0, size=(NUM_SLOTS, HEAD_DIM)).astype(np.float16)
    wl = Workload(table, page, kv0, [], -1, -1)

    lens = np.zeros(NUM_REQUESTS, np.int64)
    exp_table = np.zeros((NUM_REQUESTS, MAX_LEN), np.int64)
    for k in range(num_steps):
        rows = np.array([1, 2, 3], np.int64)
        if k == 4:
            rows[2] = 0  # request 3 sits this step out: a padding row
        extend = np.array(PREFILL if k == 0 else (1, 1, 1), np.int64)
        extend[rows == 0] = 0
        prefix = np.where(rows > 0, lens[rows], 0)
        ids, pos, loc = (np.zeros(MAX_TOKENS, np.int64) for _ in range(3))
        t = 0
        for r, rp in enumerate(rows):
            for p in range(prefix[r], prefix[r] + extend[r]):
                ids[t], pos[t], loc[t] = 1000 * rp + 7 * p + 3, p, wl.slot(rp, p)
                exp_table[rp, p] = ids[t]
                t += 1
        lens[rows[rows > 0]] += extend[rows > 0]
        rec_fault = np.zeros((NUM_SLOTS, 4), np.int64)
        kv_fault_slot = np.zeros(1, np.int64)
        if k == FAULT_TOKEN_STEP:  # a stray write changes the token of request 1's second record
            wl.token_fault_slot = wl.slot(1, 1)
            rec_fault[wl.token_fault_slot, 0] = 5
        if k == FAULT_KV_STEP:  # a stray write lands in request 2's first slot
            wl.kv_fault_slot = kv_fault_slot[0] = wl.slot(2, 0)
        wl.steps.append(Step(rows, prefix, extend, ids, pos, loc,
                             rng.uniform(0.5, 2.0, size=(MAX_TOKENS, HEAD_DIM)).astype(np.float16),
                             exp_table.copy(), np.where(rows > 0, lens[rows], 0), rec_fault, kv_fault_slot,
                             np.full((1, HEAD_DIM), 3.0, np.float16)))
    return wl


# --- the three ways to run it ------------------------------------------------------------
class LibraryEngine:
    """The reference: the library's own ops on NumPy (or CuPy) arrays. ``fused``: the
    library's plan_and_verify where this version has one, else plan then verify."""

    def __init__(self, wl: Workload, *, xp=np, device: str = "cpu", fused: bool = False, sampler_period: int = 0,
                 stamp: bool = False):
        self.wl, self.xp, self.stamp = wl, xp, stamp
        self.fused = getattr(kc, "plan_and_verify", None) if fused else None
        self.canary = kc.CanaryBuffer.allocate(num_slots=NUM_SLOTS, device=device)
        self.vp = kc.VerifyPlan.allocate(capacity=64, max_batch=BATCH, device=device)
        self.wp = kc.WritePlan.allocate(max_batch=BATCH, device=device)
        self.log = kc.ViolationLog.allocate(capacity=64, device=device)
        self.kv = xp.asarray(wl.kv0.copy())
        self.src = kc.RealKvSource(self.kv, bytes_per_token=2 * HEAD_DIM)
        self.table = xp.asarray(wl.table)
        self.exp_table = xp.zeros((NUM_REQUESTS, MAX_LEN), np.int64)
        self.valid_lens = xp.zeros(BATCH, np.int64)
        self.expected = kc.ExpectedTokens(self.exp_table, self.valid_lens)
        self.sampler = kc.FingerprintSampler.allocate(period=sampler_period, device=device) if sampler_period \
            else None

    def step(self, s: Step) -> None:
        xp = self.xp
        self.exp_table[...] = xp.asarray(s.exp_table)
        self.valid_lens[...] = xp.asarray(s.valid_lens)
        table = {"block_table": self.table, "page_size": self.wl.page_size} if self.wl.paged \
            else {"req_to_token": self.table}
        rows = dict(req_pool_indices=xp.asarray(s.rpi), prefix_lens=xp.asarray(s.prefix),
                    extend_lens=xp.asarray(s.extend), expected=self.expected, **table)
        checks = dict(log=self.log, tag=LaunchTag.VERIFY, real_kv=self.src, real_kv_mode=RealKvMode.ALL,
                      check_tokens=True, sample=self.sampler)
        ids = xp.asarray(s.ids)
        tokens = dict(input_ids=ids, positions=xp.asarray(s.pos), out_cache_loc=xp.asarray(s.loc),
                      expected_inputs=(ids, None))
        if self.stamp:  # stamped before the forward: no fingerprints
            kc.plan_verify_write(self.vp, self.wp, self.canary, **rows, **tokens, log=self.log, tag=LaunchTag.VERIFY,
                                 write_tag=LaunchTag.WRITE, check_tokens=True)
        elif self.fused is not None:
            self.fused(self.vp, self.wp, self.canary, **rows, **checks)
        else:
            kc.plan(self.vp, self.wp, **rows)
            kc.verify(self.canary, self.vp, **checks)
        self.kv[xp.asarray(s.loc)] = xp.asarray(s.kv_new)  # the forward writes its K/V
        if not self.stamp:
            kc.write(self.canary, self.wp, **tokens, log=self.log, tag=LaunchTag.WRITE, real_kv=self.src,
                     real_kv_mode=RealKvMode.ALL)
        records = self.canary.records
        records += xp.asarray(s.rec_fault)
        self.kv[xp.asarray(s.kv_fault_slot)] = xp.asarray(s.kv_fault_value)

    def state(self) -> dict:
        out = {"records": self.canary.records, "log.ring": self.log.ring, "log.head": self.log.head,
               "log.counters": self.log.counter_array}
        out.update({f"vp.{f}": getattr(self.vp, f) for f in kc.VerifyPlan.FIELDS})
        out.update({f"wp.{f}": getattr(self.wp, f) for f in kc.WritePlan.FIELDS})
        if self.sampler is not None:
            out["sampler.state"] = self.sampler.state
        return {k: np.array(kc.runtime.to_host(v)) for k, v in out.items()}


class TorchEngine:
    """The custom ops through torch_ops; ``compiled``: the step under torch.compile(fullgraph=True).

    The per-step inputs live in persistent tensors refilled in place, as an engine that
    replays a captured step keeps them."""

    def __init__(self, wl: Workload, *, device: str = "cpu", fused: bool = True, compiled: bool = False,
                 sampler_period: int = 0, stamp: bool = False):
        self.wl, self.fused, self.stamp = wl, fused, stamp
        dev = torch.device(device)
        self.canary = kt.TorchCanaryBuffer.allocate(num_slots=NUM_SLOTS, device=dev)
        self.vp = kt.TorchVerifyPlan.allocate(capacity=64, max_batch=BATCH, device=dev)
        self.wp = kt.TorchWritePlan.allocate(max_batch=BATCH, device=dev)
        self.log = kt.TorchViolationLog.allocate(capacity=64, device=dev)
        self.kv = torch.from_numpy(wl.kv0.copy()).to(dev)
        self.src = kt.TorchRealKvSource(self.kv, bytes_per_token=2 * HEAD_DIM)
        self.table = torch.from_numpy(wl.table).to(dev)
        self.expected = kt.TorchExpectedTokens(torch.zeros(NUM_REQUESTS, MAX_LEN, dtype=torch.int64, device=dev),
                                               torch.zeros(BATCH, dtype=torch.int64, device=dev))
        self.sampler = kt.TorchFingerprintSampler.allocate(period=sampler_period, device=dev) \
            if sampler_period else None
        first = wl.steps[0]
        self.inputs = {name: torch.from_numpy(getattr(first, name).copy()).to(dev)
                       for name in ("rpi", "prefix", "extend", "ids", "pos", "loc", "kv_new", "rec_fault",
                                    "kv_fault_slot", "kv_fault_value")}
        self.run = torch.compile(self._step, fullgraph=True) if compiled else self._step

    def _step(self, rpi, prefix, extend, ids, pos, loc, kv_new, rec_fault, kv_fault_slot, kv_fault_value):
        table = {"block_table": self.table, "page_size": self.wl.page_size} if self.wl.paged \
            else {"req_to_token": self.table}
        rows = dict(req_pool_indices=rpi, prefix_lens=prefix, extend_lens=extend, expected=self.expected, **table)
        checks = dict(log=self.log, tag=LaunchTag.VERIFY, real_kv=self.src, real_kv_mode=RealKvMode.ALL,
                      check_tokens=True, sample=self.sampler)
        tokens = dict(input_ids=ids, positions=pos, out_cache_loc=loc, expected_inputs=(ids, None))
        if self.stamp:
            kt.plan_verify_write(self.vp, self.wp, self.canary, **rows, **tokens, log=self.log, tag=LaunchTag.VERIFY,
                                 write_tag=LaunchTag.WRITE, check_tokens=True)
        elif self.fused:
            kt.plan_and_verify(self.vp, self.wp, self.canary, **rows, **checks)
        else:
            kt.plan(self.vp, self.wp, **rows)
            kt.verify(self.canary, self.vp, **checks)
        self.kv.index_copy_(0, loc, kv_new)  # the forward writes its K/V
        if not self.stamp:
            kt.write(self.canary, self.wp, **tokens, log=self.log, tag=LaunchTag.WRITE, real_kv=self.src,
                     real_kv_mode=RealKvMode.ALL)
        self.canary.records.add_(rec_fault)
        self.kv.index_copy_(0, kv_fault_slot, kv_fault_value)

    def stage(self, s: Step) -> dict:
        """A step's inputs as new tensors on the engine's device."""
        return {name: torch.from_numpy(getattr(s, name).copy()).to(self.table.device)
                for name in (*self.inputs, "exp_table", "valid_lens")}

    def load(self, s, *, staged: bool = False) -> None:
        """Refill the persistent inputs in place, on the current stream, from a Step or
        (``staged``) from what :meth:`stage` made of one."""
        src = s if staged else self.stage(s)
        self.expected.table.copy_(src["exp_table"])
        self.expected.valid_lens.copy_(src["valid_lens"])
        for name, buf in self.inputs.items():
            buf.copy_(src[name])

    def step(self, s: Step) -> None:
        self.load(s)
        self.run(**self.inputs)

    def state(self) -> dict:
        out = {"records": self.canary.records, "log.ring": self.log.ring, "log.head": self.log.head,
               "log.counters": self.log.counter_array}
        out.update({f"vp.{f}": t for f, t in zip(kc.VerifyPlan.FIELDS, self.vp.tensors())})
        out.update({f"wp.{f}": t for f, t in zip(kc.WritePlan.FIELDS, self.wp.tensors())})
        if self.sampler is not None:
            out["sampler.state"] = self.sampler.state
        return {k: v.cpu().numpy().copy() for k, v in out.items()}


def _sorted_rows(a: np.ndarray) -> np.ndarray:
    return a[np.lexsort(a.T[::-1])]


def assert_same_state(ref: dict, got: dict, what: str, *, rows_as_multiset: bool = False) -> None:
    assert ref.keys() == got.keys()
    for k, a in ref.items():
        b = got[k]
        if rows_as_multiset and k == "log.ring":  # GPU rows land in any order
            a, b = _sorted_rows(a), _sorted_rows(b)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {k}"
        assert a.tobytes() == b.tobytes(), f"{what}: {k} differs:\n{a}\nvs\n{b}"


def assert_faults_found(wl: Workload, log_rows: np.ndarray, *, real_kv: bool = True) -> None:
    """The changed token and its successor's chain are found, and (``real_kv``) the stray K/V write."""
    found = [kc.Violation.from_row(r) for r in log_rows]
    token = [v for v in found if v.slot == wl.token_fault_slot and FailReason.TOKEN in v.reasons]
    chain = [v for v in found if FailReason.CHAIN in v.reasons]
    kv = [v for v in found if v.slot == wl.kv_fault_slot and FailReason.REAL_KV in v.reasons]
    assert token and chain and (kv or not real_kv), [str(v) for v in found]
    assert all(v.tag == LaunchTag.VERIFY for v in token + chain + kv)


def run_side_by_side(wl: Workload, engines: dict, *, rows_as_multiset: bool = False) -> dict:
    """Step every engine through the workload, comparing every state to the first one's
    after every step; returns the final states."""
    for k, s in enumerate(wl.steps):
        states = {}
        for name, eng in engines.items():
            eng.step(s)
            states[name] = eng.state()
        ref_name = next(iter(states))
        for name, st in states.items():
            assert_same_state(states[ref_name], st, f"step {k}: {name} vs {ref_name}",
                              rows_as_multiset=rows_as_multiset)
    return states


def flat_args(eng: TorchEngine, op: str) -> tuple:
    """The arguments of torch.ops.kvcanary.<op> for the engine's current step (see torch_ops.SCHEMAS)."""
    i = eng.inputs
    table = (None, eng.table, eng.wl.page_size) if eng.wl.paged else (eng.table, None, None)
    plan = (i["rpi"], i["prefix"], i["extend"], *table, 0, None, eng.expected.table, eng.expected.valid_lens, 0)
    checks = (int(LaunchTag.VERIFY), [eng.src.tensor], eng.src.layout(), int(RealKvMode.ALL))
    sample = (None, 1) if eng.sampler is None else (eng.sampler.state, eng.sampler.period)
    if op == "plan":
        return (eng.vp.tensors(), eng.wp.tensors(), *plan)
    if op == "verify":
        return (eng.canary.records, eng.canary.chain, eng.vp.tensors(), eng.log.tensors(), *checks, True, *sample)
    if op == "write":
        return (eng.canary.records, eng.canary.chain, eng.wp.tensors(), i["ids"], i["pos"], i["loc"],
                eng.log.tensors(), int(LaunchTag.WRITE), *checks[1:], i["ids"], None, 1)  # a bound rows may break
    if op == "plan_verify_write":
        return (eng.vp.tensors(), eng.wp.tensors(), eng.canary.records, eng.canary.chain, *plan, i["ids"], i["pos"],
                i["loc"], i["ids"], None, eng.log.tensors(), int(LaunchTag.VERIFY), int(LaunchTag.WRITE), True)
    return (eng.vp.tensors(), eng.wp.tensors(), eng.canary.records, eng.canary.chain, *plan, eng.log.tensors(),
            *checks, True, *sample)


# --- tests ---------------------------------------------------------------------------
def test_importing_the_library_does_not_import_torch():
    code = ("import sys, kvcanary_cupy, kvcanary_cupy.integrations; assert 'torch' not in sys.modules; "
            "import kvcanary_cupy.integrations.torch_ops; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("fused", [True, False], ids=["plan_and_verify", "plan+verify"])
@pytest.mark.parametrize("paged", [False, True], ids=["req_to_token", "block_table"])
def test_eager_custom_ops_write_the_bytes_of_the_library_ops(fused, paged):
    wl = make_workload(1, paged=paged)
    final = run_side_by_side(wl, {"library": LibraryEngine(wl, fused=fused, sampler_period=2),
                                  "torch_ops": TorchEngine(wl, fused=fused, sampler_period=2)})
    assert_faults_found(wl, final["library"]["log.ring"][: int(final["library"]["log.head"][0])])


def test_plan_and_verify_without_a_library_fused_op_runs_plan_then_verify(monkeypatch):
    """Against a library version without plan_and_verify, the op runs plan then verify: the
    same bytes."""
    monkeypatch.delattr(kc, "plan_and_verify", raising=False)
    monkeypatch.delattr(kc.ops, "plan_and_verify", raising=False)
    wl = make_workload(7)
    final = run_side_by_side(wl, {"library": LibraryEngine(wl, fused=False, sampler_period=2),
                                  "torch_ops": TorchEngine(wl, fused=True, sampler_period=2)})
    assert_faults_found(wl, final["torch_ops"]["log.ring"][: int(final["torch_ops"]["log.head"][0])])


@pytest.mark.parametrize("paged", [False, True], ids=["req_to_token", "block_table"])
def test_plan_verify_write_op_eager_and_compiled_writes_the_bytes_of_the_library_op(paged):
    """A step stamped before its forward (no fingerprints): the library's plan_verify_write,
    the custom op, and the custom op in a fullgraph-compiled step."""
    torch.compiler.reset()
    wl = make_workload(8, paged=paged)
    engines = {"library": LibraryEngine(wl, stamp=True), "eager": TorchEngine(wl, stamp=True),
               "compiled": TorchEngine(wl, stamp=True, compiled=True)}
    final = run_side_by_side(wl, engines)
    assert_faults_found(wl, final["compiled"]["log.ring"][: int(final["compiled"]["log.head"][0])], real_kv=False)
    assert engines["compiled"].log.counters()["slots_written"] == engines["library"].log.counters()["slots_written"] > 0


@pytest.mark.parametrize("fused", [True, False], ids=["plan_and_verify", "plan+verify"])
def test_compiled_fullgraph_step_matches_eager_and_library(fused):
    torch.compiler.reset()
    wl = make_workload(2)
    engines = {"library": LibraryEngine(wl, fused=fused), "eager": TorchEngine(wl, fused=fused),
               "compiled": TorchEngine(wl, fused=fused, compiled=True)}
    final = run_side_by_side(wl, engines)
    assert_faults_found(wl, final["compiled"]["log.ring"][: int(final["compiled"]["log.head"][0])])
    assert engines["compiled"].log.count == engines["library"].log.count > 0


def test_compiled_step_is_one_graph_that_hands_the_ops_the_callers_tensors():
    """fullgraph=True compiles the step without a break, and a steady step builds nothing
    (no library object, no import): the ops receive the engine's own tensors, not copies."""
    torch.compiler.reset()
    wl = make_workload(3, num_steps=6)
    eng = TorchEngine(wl, compiled=True)
    explanation = torch._dynamo.explain(eng._step)(**eng.inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    eng = TorchEngine(wl, compiled=True)
    for s in wl.steps[:2]:
        eng.step(s)
    before = kt.cache_info()["builds"]
    for s in wl.steps[2:]:
        eng.step(s)
    assert kt.cache_info()["builds"] == before


def test_calling_the_ops_with_plain_tensors_matches_the_library():
    """torch.ops.kvcanary.* called directly, with tensors no Torch* holder owns and new
    per-step input tensors every step."""
    wl = make_workload(4)
    ref = LibraryEngine(wl, fused=True)
    plain = {n: torch.from_numpy(a.copy()) for n, a in ref.state().items()}  # a fresh plan, log and records
    vp = [plain[f"vp.{f}"] for f in kc.VerifyPlan.FIELDS]
    wp = [plain[f"wp.{f}"] for f in kc.WritePlan.FIELDS]
    log = [plain["log.ring"], plain["log.head"], plain["log.counters"]]
    kv, table = torch.from_numpy(wl.kv0.copy()), torch.from_numpy(wl.table)
    layout = [1, 2 * HEAD_DIM, 2 * HEAD_DIM, 0]  # page_size, bytes_per_token, read_bytes, layer_axis
    for s in wl.steps:
        ref.step(s)
        t = {n: torch.from_numpy(np.array(v)) for n, v in vars(s).items()}
        torch.ops.kvcanary.plan_and_verify(
            vp, wp, plain["records"], None, t["rpi"], t["prefix"], t["extend"], table, None, None, 0, None,
            t["exp_table"], t["valid_lens"], 0, log, int(LaunchTag.VERIFY), [kv], layout, int(RealKvMode.ALL), True,
            None, 1)
        kv[t["loc"]] = t["kv_new"]
        torch.ops.kvcanary.write(plain["records"], None, wp, t["ids"], t["pos"], t["loc"], log, int(LaunchTag.WRITE),
                                 [kv], layout, int(RealKvMode.ALL), t["ids"], None)
        plain["records"] += t["rec_fault"]
        kv[t["kv_fault_slot"]] = t["kv_fault_value"]
        assert_same_state(ref.state(), {k: v.numpy() for k, v in plain.items()}, "plain tensors")
    assert_faults_found(wl, plain["log.ring"][: int(plain["log.head"][0])].numpy())


@pytest.mark.parametrize("op", ["plan", "verify", "write", "plan_and_verify", "plan_verify_write"])
def test_opcheck(op):
    """The registration: schema (what is declared mutated is all that changes), the fake
    implementation, autograd registration (a KV pool that requires grad is only read), and
    the op under AOT dispatch with dynamic shapes. All four default checks run."""
    wl = make_workload(5)
    eng = TorchEngine(wl, sampler_period=3, stamp=op == "plan_verify_write")
    for s in wl.steps[:3]:
        eng.step(s)
    args = flat_args(eng, op)
    torch.library.opcheck(getattr(torch.ops.kvcanary, op).default, args)
    if op in ("verify", "write", "plan_and_verify"):  # K/V that requires grad: read only, no autograd kernel needed
        kv = torch.from_numpy(wl.kv0.astype(np.float32)).requires_grad_()
        src = kt.TorchRealKvSource(kv, bytes_per_token=4 * HEAD_DIM)
        args = list(args)
        at = next(i for i, a in enumerate(args) if isinstance(a, list) and a and a[0] is eng.src.tensor)
        args[at], args[at + 1] = [src.tensor], src.layout()
        result = torch.library.opcheck(getattr(torch.ops.kvcanary, op).default, tuple(args))
        assert set(result.values()) == {"SUCCESS"}, result


def test_schemas_declare_exactly_what_each_op_writes():
    mutated = {op: sorted(a.name for a in getattr(torch.ops.kvcanary, op).default._schema.arguments
                          if a.alias_info is not None and a.alias_info.is_write)
               for op in ("plan", "verify", "write", "plan_and_verify", "plan_verify_write")}
    assert mutated == {"plan": ["verify_plan", "write_plan"], "verify": ["log", "sample_state"],
                       "write": ["canary", "log"],
                       "plan_and_verify": ["log", "sample_state", "verify_plan", "write_plan"],
                       "plan_verify_write": ["canary", "log", "verify_plan", "write_plan"]}
    for op in mutated:
        assert not getattr(torch.ops.kvcanary, op).default._schema.returns


def test_plan_options_match_the_library():
    """block_table with page_size, a sliding window with its LUT, expected tokens of a draft pool."""
    rng = np.random.default_rng(6)
    block_table = np.zeros((4, 4), np.int32)
    block_table[1:] = rng.permutation(np.arange(1, 16))[:12].reshape(3, 4)
    lut = rng.permutation(np.arange(64)).astype(np.int64)
    exp_table = rng.integers(0, 1000, size=(4, 16))
    valid = np.array([9, 7, 0])
    rows = dict(req_pool_indices=np.array([1, 3, 0]), prefix_lens=np.array([8, 6, 5]), extend_lens=np.array([1, 2, 4]))
    vp, wp = kc.VerifyPlan.allocate(capacity=32, max_batch=3), kc.WritePlan.allocate(max_batch=3)
    kc.plan(vp, wp, **rows, block_table=block_table, page_size=4, swa=kc.SwaWindow(3, lut),
            expected=kc.ExpectedTokens(exp_table, valid, offset=1))
    tvp, twp = kt.TorchVerifyPlan.allocate(capacity=32, max_batch=3), kt.TorchWritePlan.allocate(max_batch=3)
    kt.plan(tvp, twp, **{k: torch.from_numpy(v) for k, v in rows.items()}, block_table=torch.from_numpy(block_table),
            page_size=4, swa=kt.TorchSwaWindow(3, torch.from_numpy(lut)),
            expected=kt.TorchExpectedTokens(torch.from_numpy(exp_table), torch.from_numpy(valid), offset=1))
    for f, t in zip(kc.VerifyPlan.FIELDS, tvp.tensors()):
        assert t.numpy().tobytes() == getattr(vp, f).tobytes(), f
    for f, t in zip(kc.WritePlan.FIELDS, twp.tensors()):
        assert t.numpy().tobytes() == getattr(wp, f).tobytes(), f
    assert vp.host_scalars()["num_valid"] == 3 + 3 and (vp.expected_tokens[:6] != -1).any()


def test_write_only_and_verify_only_plans():
    table = torch.tensor([[0, 0, 0], [5, 6, 7]], dtype=torch.int32)
    rows = dict(req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([3]))
    canary, log = kt.TorchCanaryBuffer.allocate(num_slots=8), kt.TorchViolationLog.allocate(capacity=4)
    wp, vp = kt.TorchWritePlan.allocate(max_batch=1), kt.TorchVerifyPlan.allocate(capacity=4, max_batch=1)
    kt.plan(None, wp, **rows, req_to_token=table)
    kt.write(canary, wp, input_ids=torch.tensor([11, 12, 13]), positions=torch.arange(3),
             out_cache_loc=torch.tensor([5, 6, 7]), log=log, tag=LaunchTag.WRITE)
    kt.plan(vp, None, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([3]),
            extend_lens=torch.tensor([0]), req_to_token=table)
    kt.verify(canary, vp, log=log, tag=LaunchTag.VERIFY)
    assert log.count == 0 and log.counters()["slots_checked"] == 3
    canary.records[6, 1] = 9  # a wrong position
    kt.verify(canary, vp, log=log, tag=LaunchTag.VERIFY)
    found = {v.slot: v.reasons for v in log.read()}
    assert found == {6: FailReason.POSITION, 7: FailReason.CHAIN}  # the successor's link covers the position


def test_holders_allocate_like_the_library():
    pairs = [(kt.TorchVerifyPlan.allocate(capacity=5, max_batch=2), kc.VerifyPlan.allocate(capacity=5, max_batch=2)),
             (kt.TorchWritePlan.allocate(max_batch=2), kc.WritePlan.allocate(max_batch=2))]
    for mine, theirs in pairs:
        for f, t in zip(type(theirs).FIELDS, mine.tensors()):
            assert t.dtype == torch.int64 and t.numpy().tobytes() == getattr(theirs, f).tobytes(), f
    log, ref = kt.TorchViolationLog.allocate(capacity=3), kc.ViolationLog.allocate(capacity=3)
    assert [t.numpy().tobytes() for t in log.tensors()] == [
        a.tobytes() for a in (ref.ring, ref.head, ref.counter_array)]
    assert kt.TorchCanaryBuffer.allocate(num_slots=4).records.numpy().tobytes() == \
        kc.CanaryBuffer.allocate(num_slots=4).records.tobytes()
    s = kt.TorchFingerprintSampler.allocate(period=3)
    assert s.state.tolist() == kc.FingerprintSampler.allocate(period=3).state.tolist()


def test_library_objects_wrapped_zero_copy_keep_their_state():
    canary = kc.CanaryBuffer.allocate(num_slots=16)
    wp, vp = kc.WritePlan.allocate(max_batch=1), kc.VerifyPlan.allocate(capacity=8, max_batch=1)
    log = kc.ViolationLog.allocate(capacity=4)
    kv = np.zeros((16, 16), np.uint8)
    src = kc.RealKvSource(kv, bytes_per_token=16)
    sampler = kc.FingerprintSampler.allocate(period=1)
    t = {o: cls.from_library(o) for o, cls in ((canary, kt.TorchCanaryBuffer), (wp, kt.TorchWritePlan),
                                                 (vp, kt.TorchVerifyPlan), (log, kt.TorchViolationLog),
                                                 (src, kt.TorchRealKvSource), (sampler, kt.TorchFingerprintSampler))}
    assert all(h.library is o for o, h in t.items())
    table = torch.tensor([[0, 0, 0], [3, 4, 5]], dtype=torch.int32)
    kt.plan(None, t[wp], req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]),
            extend_lens=torch.tensor([2]), req_to_token=table)
    kv[[3, 4]] = 7
    kt.write(t[canary], t[wp], input_ids=torch.tensor([1, 2]), positions=torch.arange(2),
             out_cache_loc=torch.tensor([3, 4]), log=t[log], tag=LaunchTag.WRITE, real_kv=t[src],
             real_kv_mode=RealKvMode.ALL)
    assert canary.records[[3, 4], 0].tolist() == [1, 2]  # the library's own array was written
    kv[4, 0] ^= 1
    kt.plan_and_verify(t[vp], t[wp], t[canary], req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([2]),
                       extend_lens=torch.tensor([1]), req_to_token=table, log=t[log], tag=LaunchTag.VERIFY,
                       real_kv=[t[src]], real_kv_mode=RealKvMode.ALL, sample=t[sampler])
    (v,) = log.poll()  # the library's log, polled through its own object
    assert v.slot == 4 and v.reasons == FailReason.REAL_KV
    assert t[log].poll() == [] and t[log].count == 1 and sampler.state[0] == 1


def test_chain_kind_travels_with_the_canary():
    if "chain" not in inspect.signature(kc.CanaryBuffer.allocate).parameters:
        pytest.skip("this version of the library has one chain kind")
    for chain in ("scan", "sglang"):
        ref = kc.CanaryBuffer.allocate(num_slots=8, chain=chain)
        mine = kt.TorchCanaryBuffer.allocate(num_slots=8, chain=chain)
        assert mine.library.chain == chain
        for ops, c, to in ((kc, ref, np.array), (kt, mine, torch.tensor)):
            wp = ops.WritePlan.allocate(max_batch=1) if ops is kc else kt.TorchWritePlan.allocate(max_batch=1)
            log = ops.ViolationLog.allocate(capacity=2) if ops is kc else kt.TorchViolationLog.allocate(capacity=2)
            ops.plan(None, wp, req_pool_indices=to([1]), prefix_lens=to([0]), extend_lens=to([3]),
                     req_to_token=to([[0, 0, 0], [2, 3, 4]]))
            ops.write(c, wp, input_ids=to([5, 6, 7]), positions=to([0, 1, 2]), out_cache_loc=to([2, 3, 4]), log=log,
                      tag=LaunchTag.WRITE)
        assert mine.records.numpy().tobytes() == ref.records.tobytes()


def test_misuse_raises_kvcanary_errors_naming_the_argument():
    vp, wp = kt.TorchVerifyPlan.allocate(capacity=4, max_batch=1), kt.TorchWritePlan.allocate(max_batch=1)
    rows = dict(req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([1]))
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^kvcanary: verify_plan: .*TorchVerifyPlan.from_library"):
        kt.plan(kc.VerifyPlan.allocate(capacity=4, max_batch=1), wp, **rows, req_to_token=table)
    with pytest.raises(TypeError, match=r"^kvcanary: req_pool_indices: expected dtype int32 or int64"):
        kt.plan(vp, wp, **{**rows, "req_pool_indices": torch.tensor([1.0])}, req_to_token=table)
    with pytest.raises(ValueError, match=r"^kvcanary: plan: pass exactly one slot table"):
        kt.plan(vp, wp, **rows)
    with pytest.raises(TypeError, match=r"^kvcanary: page_size: expected an integer"):
        kt.plan(vp, wp, **rows, block_table=table, page_size=2.0)
    fields = dict(zip(kc.VerifyPlan.FIELDS, vp.tensors()))
    with pytest.raises(ValueError, match=r"^kvcanary: VerifyPlan: arrays disagree: prev_slot_indices has length 3"):
        kt.TorchVerifyPlan(**fields | {"prev_slot_indices": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"^kvcanary: VerifyPlan: slot_indices and prev_slot_indices share memory"):
        kt.TorchVerifyPlan(**fields | {"prev_slot_indices": fields["slot_indices"]})
    with pytest.raises(TypeError, match=r"^kvcanary: TorchCanaryBuffer.records: expected a torch.Tensor"):
        kt.TorchCanaryBuffer(np.zeros((4, 4), np.int64))
    with pytest.raises(ValueError, match=r"^kvcanary: bytes_per_token"):
        kt.TorchRealKvSource(torch.zeros(4, 16, dtype=torch.uint8))
    canary, log = kt.TorchCanaryBuffer.allocate(num_slots=4), kt.TorchViolationLog.allocate(capacity=2)
    with pytest.raises(TypeError, match=r"^kvcanary: check_tokens: expected True or False"):
        kt.verify(canary, vp, log=log, tag=1, check_tokens="yes")
    with pytest.raises(ValueError, match=r"^kvcanary: real_kv_layout"):
        torch.ops.kvcanary.verify(canary.records, None, vp.tensors(), log.tensors(), 1, [torch.zeros(64, 16)], [1],
                                  0, False, None, 1)
    with pytest.raises(ValueError, match=r"^kvcanary: log: expected the 3 tensors of a ViolationLog"):
        torch.ops.kvcanary.verify(canary.records, None, vp.tensors(), log.tensors()[:2], 1, [], [], 0, False,
                                  None, 1)
    tokens = dict(input_ids=torch.tensor([5]), positions=torch.tensor([0]), out_cache_loc=torch.tensor([1]))
    with pytest.raises(TypeError, match=r"^kvcanary: write_plan: expected a TorchWritePlan, got None"):
        kt.plan_verify_write(vp, None, canary, **rows, req_to_token=table, **tokens, log=log, tag=1, write_tag=2)
    with pytest.raises(TypeError, match=r"^kvcanary: write_tag: expected an integer"):
        kt.plan_verify_write(vp, wp, canary, **rows, req_to_token=table, **tokens, log=log, tag=1, write_tag=2.0)
    with pytest.raises(ValueError, match=r"^kvcanary: input_ids: plan_verify_write stamps at most 256 tokens"):
        many = {k: v.repeat(257) for k, v in tokens.items()}
        kt.plan_verify_write(vp, wp, canary, **rows, req_to_token=table, **many, log=log, tag=1, write_tag=2)
    with pytest.raises(TypeError, match=r"^kvcanary: max_row_tokens: expected an integer"):
        kt.write(canary, wp, **tokens, log=log, tag=1, max_row_tokens=1.0)
    with pytest.raises(ValueError, match=r"^kvcanary: max_row_tokens: expected an integer >= 0"):
        torch.ops.kvcanary.write(canary.records, None, wp.tensors(), *tokens.values(), log.tensors(), 1, [], [], 0,
                                 None, None, -1)


def test_cache_finds_objects_by_tensor_identity_and_lets_go():
    """A second call with the same tensors builds nothing; a view of the same memory is the
    same argument; clear_cache() drops what no holder owns."""
    canary, log = kt.TorchCanaryBuffer.allocate(num_slots=8), kt.TorchViolationLog.allocate(capacity=2)
    wp = kt.TorchWritePlan.allocate(max_batch=1)
    ids_buf = torch.zeros(8, dtype=torch.int64)
    table = torch.tensor([[0, 0], [2, 3]], dtype=torch.int32)
    rows = dict(req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([2]))

    def step():
        kt.plan(None, wp, **rows, req_to_token=table)
        kt.write(canary, wp, input_ids=ids_buf[:2], positions=torch.arange(2), out_cache_loc=torch.tensor([2, 3]),
                 log=log, tag=LaunchTag.WRITE)

    step()
    before = kt.cache_info()
    step()  # new tensors only for positions and out_cache_loc; ids_buf[:2] is a new view of the same memory
    after = kt.cache_info()
    assert after["builds"] - before["builds"] <= 2 and after["hits"] > before["hits"]
    kt.clear_cache()
    assert kt.cache_info()["views"] == 0
    step()  # the holders' objects survive a clear
    assert log.count == 0 and log.counters()["slots_written"] == 6
