"""Bench inputs, built directly on the device with the array module ``xp``.

The same code runs with NumPy (a CPU dry run, and the tests) and CuPy (the
measurement). An :class:`Instance` is one engine step's inputs: a token-level
slot table whose slots are drawn at random from a large pool (so accesses
scatter like a real pool), the step's rows, new tokens and plans. Several
instances of one case share a canary; :func:`populate` stamps the records of
their prefixes through ``write``, so a clean verify finds nothing to report.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import CanaryBuffer, LaunchTag, RealKvMode, RealKvSource, SwaWindow, VerifyPlan, WritePlan

from .cases import Case

VOCAB = 152_064  # a large vocabulary's token ids
TABLE_DTYPE = np.int32  # SGLang's req_to_token is int32
INDEX_DTYPE = np.int64  # its req_pool_indices, lengths, positions and slots are int64
LUT_DTYPE = np.int32


@dataclass(eq=False)
class Instance:
    """One step's inputs and outputs (arrays of module ``xp``).

    Attributes:
        req_pool_indices, prefix_lens, extend_lens: int64 ``[batch]``.
        table: int32 ``[batch + 1, prefix + extend]``; row 0 is the padding row.
        swa: the window (its LUT translates full-pool slots) or None.
        input_ids, positions, out_cache_loc: int64 ``[batch * extend]``, the step's
            new tokens, row after row (``out_cache_loc`` already translated by the LUT).
        vp, wp: plans sized for this step.
    """

    case: Case
    req_pool_indices: object
    prefix_lens: object
    extend_lens: object
    table: object
    swa: SwaWindow | None
    input_ids: object
    positions: object
    out_cache_loc: object
    vp: VerifyPlan
    wp: WritePlan

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays this instance owns (inputs and plans)."""
        arrs = (self.req_pool_indices, self.prefix_lens, self.extend_lens, self.table, self.input_ids,
                self.positions, self.out_cache_loc, self.vp.slot_indices, self.vp.prev_slot_indices,
                self.vp.expected_positions, self.vp.expected_tokens, self.vp.offsets, self.wp.offsets,
                self.wp.seed_slots)
        return int(sum(a.nbytes for a in arrs))


def random_state(xp, seed: int):
    """A seeded ``RandomState`` of module ``xp`` (NumPy and CuPy share this API)."""
    return xp.random.RandomState(seed)


def draw_slots(xp, rs, n: int, high: int):
    """``n`` distinct slots drawn at random from ``[1, high]`` (int64)."""
    if n > high:
        raise ValueError(f"kvcanary: bench: cannot draw {n} distinct slots from [1, {high}]")
    return rs.permutation(high)[:n].astype(np.int64) + 1


def make_lut(xp, rs, num_slots: int):
    """A SWA LUT ``[num_slots]``: a random permutation of ``[1, num_slots)``, 0 kept at 0."""
    lut = xp.zeros(num_slots, dtype=LUT_DTYPE)
    lut[1:] = (rs.permutation(num_slots - 1) + 1).astype(LUT_DTYPE)
    return lut


def make_kv(xp, layers: int, num_slots: int, bytes_per_token: int):
    """A KV pool ``[layers, num_slots, bytes_per_token // 8]`` of uint64 filled with distinct words.

    The content is irrelevant to speed; it is filled layer by layer in place so
    no temporary of the pool's size is made.
    """
    words = bytes_per_token // 8
    kv = xp.empty((layers, num_slots, words), dtype=np.uint64)
    per_layer = num_slots * words
    for layer in range(layers):
        v = kv[layer].reshape(-1)
        v[...] = xp.arange(layer * per_layer, (layer + 1) * per_layer, dtype=np.uint64)
        v *= np.uint64(0x9E3779B97F4A7C15)
    return kv


def kv_source(kv) -> RealKvSource:
    """The RealKvSource over a pool made by :func:`make_kv`."""
    layers, _, words = kv.shape
    if layers == 1:
        return RealKvSource(kv[0], page_size=1, bytes_per_token=words * 8)
    return RealKvSource(kv, page_size=1, bytes_per_token=words * 8, layer_axis=True)


def build(xp, device: str, case: Case, slots, rs, lut=None) -> Instance:
    """One instance of ``case`` whose table holds ``slots`` (int64 ``[case.slots]``, distinct).

    ``lut`` is the pool's SWA LUT (int ``[num_slots]``). A case with a window needs it:
    its table holds full-pool slots and every slot it reads or writes goes through the
    LUT. A case without a window ignores it: its step writes the table's own slots at
    positions ``[prefix, prefix + extend)``, as its verify plan and ``populate`` read them.
    """
    if case.window is None:
        # A pool shared with a window case has a LUT; translating this case's new slots
        # would send its writes to random slots, possibly another instance's prefix.
        lut = None
    elif lut is None:
        raise ValueError(f"kvcanary: bench: lut: case {case.name!r} has a window and needs the pool's LUT, got None")
    B, P, E, W = case.batch, case.prefix, case.extend, case.width
    table = xp.zeros((B + 1, W), dtype=TABLE_DTYPE)
    table[1:] = slots.reshape(B, W).astype(TABLE_DTYPE)
    new_slots = table[1:, P:].reshape(-1).astype(INDEX_DTYPE)
    if lut is not None:
        new_slots = lut[new_slots].astype(INDEX_DTYPE)
    return Instance(
        case=case,
        req_pool_indices=xp.arange(1, B + 1, dtype=INDEX_DTYPE),
        prefix_lens=xp.full(B, P, dtype=INDEX_DTYPE),
        extend_lens=xp.full(B, E, dtype=INDEX_DTYPE),
        table=table,
        swa=SwaWindow(case.window, lut) if case.window is not None else None,
        input_ids=rs.randint(0, VOCAB, size=B * E, dtype=INDEX_DTYPE),
        positions=xp.tile(xp.arange(P, W, dtype=INDEX_DTYPE), B),
        out_cache_loc=xp.ascontiguousarray(new_slots),
        vp=VerifyPlan.allocate(capacity=max(case.entries, 1), max_batch=B, device=device),
        wp=WritePlan.allocate(max_batch=B, device=device),
    )


def populate(xp, device: str, inst: Instance, canary: CanaryBuffer, log, rs, *, sources=(),
             mode=RealKvMode.NONE, stream=None) -> None:
    """Stamp the records of every prefix token of ``inst`` (one write of the whole prefix).

    The prefix is written as a prefill from position 0 (seed -1), so the step's
    verify finds consistent chains, positions and fingerprints.
    """
    c = inst.case
    if c.prefix == 0:
        return
    fill = WritePlan.allocate(max_batch=c.batch, device=device)
    kc.plan(None, fill, req_pool_indices=inst.req_pool_indices, prefix_lens=xp.zeros(c.batch, dtype=INDEX_DTYPE),
             extend_lens=inst.prefix_lens, req_to_token=inst.table, stream=stream)
    loc = inst.table[1:, : c.prefix].reshape(-1).astype(INDEX_DTYPE)
    if inst.swa is not None:
        loc = inst.swa.lut[loc].astype(INDEX_DTYPE)
    kc.write(canary, fill, input_ids=rs.randint(0, VOCAB, size=c.batch * c.prefix, dtype=INDEX_DTYPE),
              positions=xp.tile(xp.arange(c.prefix, dtype=INDEX_DTYPE), c.batch),
              out_cache_loc=xp.ascontiguousarray(loc), log=log, tag=LaunchTag.SWEEP, real_kv=sources,
              real_kv_mode=mode, stream=stream)


def op_calls(inst: Instance, canary: CanaryBuffer, log, *, sources=(), mode=RealKvMode.NONE, stream=None) -> dict:
    """``{"plan", "verify", "plan_and_verify", "write"}``: zero-argument calls of one step's ops
    on ``inst`` (the canary's chain kind is the one every op follows)."""
    rows = dict(req_pool_indices=inst.req_pool_indices, prefix_lens=inst.prefix_lens,
                extend_lens=inst.extend_lens, req_to_token=inst.table, swa=inst.swa)

    def plan():
        kc.plan(inst.vp, inst.wp, **rows, stream=stream)

    def verify():
        kc.verify(canary, inst.vp, log=log, tag=LaunchTag.VERIFY, real_kv=sources, real_kv_mode=mode, stream=stream)

    def plan_and_verify():
        kc.plan_and_verify(inst.vp, inst.wp, canary, **rows, log=log, tag=LaunchTag.VERIFY, real_kv=sources,
                           real_kv_mode=mode, stream=stream)

    def write():  # every row of a case writes case.extend tokens: the bound a caller knows
        kc.write(canary, inst.wp, input_ids=inst.input_ids, positions=inst.positions,
                  out_cache_loc=inst.out_cache_loc, log=log, tag=LaunchTag.WRITE, real_kv=sources,
                  real_kv_mode=mode, max_row_tokens=inst.case.extend, stream=stream)

    return {"plan": plan, "verify": verify, "plan_and_verify": plan_and_verify, "write": write}


def prepared_step(inst: Instance, canary: CanaryBuffer, log, *, sources=(), mode=RealKvMode.NONE, stream=None):
    """A zero-argument step of ``inst``: plan_and_verify + write prepared once (``kc.prepare``),
    so each call costs the two launches alone."""
    launches = (
        kc.prepare(kc.plan_and_verify, inst.vp, inst.wp, canary, req_pool_indices=inst.req_pool_indices,
                   prefix_lens=inst.prefix_lens, extend_lens=inst.extend_lens, req_to_token=inst.table, swa=inst.swa,
                   log=log, tag=LaunchTag.VERIFY, real_kv=sources, real_kv_mode=mode, stream=stream),
        kc.prepare(kc.write, canary, inst.wp, input_ids=inst.input_ids, positions=inst.positions,
                   out_cache_loc=inst.out_cache_loc, log=log, tag=LaunchTag.WRITE, real_kv=sources,
                   real_kv_mode=mode, max_row_tokens=inst.case.extend, stream=stream))

    def step():
        for launch in launches:
            launch(stream)

    return step


# --- the same step through the PyTorch baseline --------------------------------------
@dataclass(eq=False)
class TorchInstance:
    """An :class:`Instance` seen by the baseline: zero-copy torch views plus its own plans."""

    views: dict
    vp: object
    wp: object


def torch_instance(inst: Instance, device) -> TorchInstance:
    """Torch views (DLPack, zero copy) of ``inst``'s inputs and baseline-owned plans."""
    import torch  # noqa: PLC0415

    from . import torch_baseline as tb  # noqa: PLC0415

    names = ("req_pool_indices", "prefix_lens", "extend_lens", "table", "input_ids", "positions", "out_cache_loc")
    views = {n: torch.from_dlpack(getattr(inst, n)) for n in names}
    views["lut"] = torch.from_dlpack(inst.swa.lut) if inst.swa is not None else None
    c = inst.case
    return TorchInstance(views, tb.TorchVerifyPlan.allocate(capacity=max(c.entries, 1), max_batch=c.batch,
                                                            device=device),
                         tb.TorchWritePlan.allocate(max_batch=c.batch, device=device))


def torch_calls(ti: TorchInstance, records, log, *, sources=(), mode=RealKvMode.NONE, window=None,
                chain: str = "scan") -> dict:
    """``{"plan", "verify", "write"}``: zero-argument baseline calls of one step on ``records``
    of chain kind ``chain``. The baseline has no fused op: its plan and verify are the step's."""
    from . import torch_baseline as tb  # noqa: PLC0415

    v = ti.views
    m = int(mode) if sources else 0

    def plan():
        tb.plan(ti.vp, ti.wp, req_pool_indices=v["req_pool_indices"], prefix_lens=v["prefix_lens"],
                extend_lens=v["extend_lens"], table=v["table"], swa_size=window, lut=v["lut"])

    def verify():
        tb.verify(records, ti.vp, log=log, tag=int(LaunchTag.VERIFY), sources=sources, mode=m, chain=chain)

    def write():
        tb.write(records, ti.wp, input_ids=v["input_ids"], positions=v["positions"], out_cache_loc=v["out_cache_loc"],
                 log=log, tag=int(LaunchTag.WRITE), sources=sources, mode=m, chain=chain)

    return {"plan": plan, "verify": verify, "write": write}
