"""plan and plan_and_verify on either side of the sizes where the CUDA backend plans a
step another way.

A step of at most 256 rows, none reading more than 8192 positions, whose entries fit
the plan (and 1Mi entries) is planned without a grid-wide wait, each warp on its own
32 entries; any larger step goes through the rows, scan and fill phases. Each case here
sits just inside or just outside one of those bounds (rows, positions per row,
capacity) and must leave exactly what the NumPy reference leaves: plan arrays up to
num_valid and scalars, the write plan, violation rows and counters. Rows that cannot be
read (a bad table entry at a row's far end, seen by only one of the row's warps;
padding rows; a request out of range; empty prefixes) are mixed in, with records that
fail every check, so a row's verdict must reach all of its entries: none of them is
reported or counted, and the entries of the rows after it move to their offsets.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.backends.cuda import SMALL_PLAN_ROW_POSITIONS as SMALL_ROW_POSITIONS
from kvcanary_cupy.backends.cuda import SMALL_PLAN_ROWS as SMALL_ROWS
from tests.workloads import host

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


def _step(rng, bs: int, prefix: int, *, long_row: int | None = None, spoil: bool = True) -> dict:
    """A token-level step of ``bs`` rows with prefixes up to ``prefix`` (row 0 exactly
    ``long_row`` when given); with more than one row, some are padding, empty, out of range
    or unreadable (the long row, when there is one)."""
    P = rng.integers(0, prefix + 1, size=bs)
    if long_row is not None:
        P[0] = long_row
    E = rng.integers(0, 3, size=bs)
    width = int(P.max()) + 4
    nreq = bs + 2
    num_slots = nreq * width + 1
    table = rng.permutation(np.arange(1, num_slots)).reshape(nreq, width).astype(np.int64)
    rpi = rng.permutation(np.arange(1, nreq))[:bs]
    if spoil and bs > 4:
        rpi[1] = 0            # padding
        P[2] = 0              # nothing to verify
        rpi[3] = nreq + 5     # out of range: an input error
    if spoil and bs > 1:
        r = 0 if long_row is not None else bs - 1  # unreadable at its last position only
        if P[r] > 0:
            table[rpi[r], P[r] - 1] = -1
    return dict(rpi=rpi, P=P, E=E, table=table, num_slots=num_slots)


def _records(rng, num_slots: int) -> np.ndarray:
    """Records that fail in every way: positions and tokens off, junk links."""
    rec = rng.integers(0, 1 << 40, size=(num_slots, 4)).astype(np.int64)
    rec[:, 1] = np.arange(num_slots) % 97
    return rec


def _run(xp, device, s, *, capacity: int, fused: bool, records):
    vp = kc.VerifyPlan.allocate(capacity=capacity, max_batch=len(s["rpi"]) + 3, device=device)
    wp = kc.WritePlan.allocate(max_batch=len(s["rpi"]) + 3, device=device)
    log = kc.ViolationLog.allocate(capacity=4 * capacity + 64, device=device)
    canary = kc.CanaryBuffer(xp.asarray(records))
    rows = dict(req_pool_indices=xp.asarray(s["rpi"]), prefix_lens=xp.asarray(s["P"]),
                extend_lens=xp.asarray(s["E"]), req_to_token=xp.asarray(s["table"]))
    if fused:
        kc.plan_and_verify(vp, wp, canary, log=log, tag=3, **rows)
    else:
        kc.plan(vp, wp, **rows)
        kc.verify(canary, vp, log=log, tag=3)
    out = {f: host(getattr(vp, f)).tolist() for f in kc.VerifyPlan.SCALAR_FIELDS + ("offsets",)}
    if not fused:
        n = int(host(vp.num_valid)[0])
        out.update({f: host(getattr(vp, f))[:n].tolist() for f in kc.VerifyPlan.ENTRY_FIELDS})
    out.update({"wp." + f: host(getattr(wp, f)).tolist() for f in kc.WritePlan.FIELDS})
    out["rows"] = sorted(tuple(int(x) for x in r) for r in log.rows())
    out["counters"] = log.counters()
    return out


CASES = {
    "one row at the position bound": dict(bs=1, prefix=8, long_row=SMALL_ROW_POSITIONS),
    "one row past it": dict(bs=1, prefix=8, long_row=SMALL_ROW_POSITIONS + 1),
    "a few rows, one long": dict(bs=7, prefix=600, long_row=3000),
    "rows at the row bound": dict(bs=SMALL_ROWS, prefix=40),
    "rows past it": dict(bs=SMALL_ROWS + 1, prefix=40),
}


@pytest.mark.parametrize("fused", [False, True], ids=["plan+verify", "plan_and_verify"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spare", [0, -1, 5], ids=["capacity=entries", "capacity=entries-1", "capacity=entries+5"])
def test_matches_the_reference(cp, case, fused, spare):
    rng = np.random.default_rng(list(CASES).index(case))
    s = _step(rng, **CASES[case])
    records = _records(rng, s["num_slots"])
    # The entries the step asks for (every row counted as if readable: the bound the plan must fit).
    asked = int(sum(p for p, r in zip(s["P"], s["rpi"]) if 0 < r < len(s["table"])))
    capacity = max(asked + spare, 0)
    ref = _run(np, "cpu", s, capacity=capacity, fused=fused, records=records)
    dev = _run(cp, "cuda", s, capacity=capacity, fused=fused, records=records)
    assert dev.keys() == ref.keys()
    for k in ref:
        assert dev[k] == ref[k], k
    assert ref["counters"]["slots_checked"] > 0 or spare < 0


def test_repeated_steps_leave_nothing_behind(cp):
    """Steps of alternating shapes on the same plans: each matches the reference alone."""
    rng = np.random.default_rng(11)
    shapes = [dict(bs=3, prefix=500), dict(bs=SMALL_ROWS + 4, prefix=30), dict(bs=2, prefix=9000),
              dict(bs=64, prefix=300), dict(bs=1, prefix=5)]
    steps = [_step(rng, **sh) for sh in shapes]
    width = max(s["table"].shape[1] for s in steps)
    nreq = max(s["table"].shape[0] for s in steps)
    num_slots = nreq * width + 1
    records = _records(rng, num_slots)
    for s in steps:  # one pool for all steps
        t = np.full((nreq, width), -1, np.int64)
        t[: s["table"].shape[0], : s["table"].shape[1]] = s["table"]
        s["table"], s["num_slots"] = t, num_slots
    cap = 40000
    sides = {}
    for name, xp, device in (("ref", np, "cpu"), ("dev", cp, "cuda")):
        vp = kc.VerifyPlan.allocate(capacity=cap, max_batch=SMALL_ROWS + 8, device=device)
        wp = kc.WritePlan.allocate(max_batch=SMALL_ROWS + 8, device=device)
        log = kc.ViolationLog.allocate(capacity=8 * cap, device=device)
        sides[name] = (xp, vp, wp, log, kc.CanaryBuffer(xp.asarray(records)))
    for i, s in enumerate(steps):
        outs = {}
        for name, (xp, vp, wp, log, canary) in sides.items():
            rows = dict(req_pool_indices=xp.asarray(s["rpi"]), prefix_lens=xp.asarray(s["P"]),
                        extend_lens=xp.asarray(s["E"]), req_to_token=xp.asarray(s["table"]))
            if i % 2:
                kc.plan_and_verify(vp, wp, canary, log=log, tag=i, **rows)
            else:
                kc.plan(vp, wp, **rows)
                kc.verify(canary, vp, log=log, tag=i)
            outs[name] = ({f: host(getattr(vp, f)).tolist() for f in kc.VerifyPlan.SCALAR_FIELDS + ("offsets",)},
                          {f: host(getattr(wp, f)).tolist() for f in kc.WritePlan.FIELDS},
                          sorted(tuple(int(x) for x in r) for r in log.rows()), log.counters())
        assert outs["dev"] == outs["ref"], f"step {i}"
