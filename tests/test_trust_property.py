"""A random run mixing healthy rows with rows that cannot be planned, over many steps.

Every step batches some healthy requests with bad rows of four kinds, at random places:
a prefix past the table, an extend length that is no span (negative or past the table),
a negative table entry inside a prefix, and a live prefix entry repointed to the reserved
slot 0. The same run without the bad rows is the reference. After every step:
- every healthy request's records equal the reference's;
- no violation names a healthy request;
- every bad row is counted (the plans' input errors) or reported (slot 0, naming it).
Rows after an extend length that is no span are verified but not stamped (the layout
after it is unknown) and counted; their requests are not stamped from a guess, so the
run takes them out, as an engine would fail them.

Runs the three step paths of the ops and the monitor (stamping after the forward and
before it), on NumPy and, where a GPU is visible, on CuPy.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from tests.test_trust_layout import Step
from tests.workloads import host

WIDTH = 24  # positions per request
HEALTHY = 6  # request-table rows 1..6
BAD_ROWS = 40  # fresh rows for bad requests, one per bad row
NUM_SLOTS = (1 + HEALTHY + BAD_ROWS) * WIDTH + 1
STEPS = 14
KINDS = ("prefix", "extend", "entry", "slot0")


def make_run(rng):
    """The steps: per step a list of rows (rp, P, E, request id, kind, tokens), the table
    edits made before it (row, position, value) and the requests it takes out."""
    slots = 1 + rng.permutation(NUM_SLOTS - 1)
    table = slots[: (1 + HEALTHY + BAD_ROWS) * WIDTH].reshape(-1, WIDTH).astype(np.int64)
    table[0] = 0
    done = np.zeros(1 + HEALTHY, dtype=np.int64)
    out = set()
    fresh = iter(range(1 + HEALTHY, 1 + HEALTHY + BAD_ROWS))
    steps = []
    for _ in range(STEPS):
        live = [r for r in range(1, 1 + HEALTHY) if r not in out and done[r] < WIDTH]
        if not live:
            break
        pick = [int(r) for r in rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]]
        rows, edits = [], []
        for r in pick:
            E = 1 if done[r] and rng.random() < 0.5 else int(rng.integers(1, min(5, WIDTH - done[r]) + 1))
            rows.append(dict(rp=r, P=int(done[r]), E=E, id=f"h{r}", kind="healthy",
                             tokens=rng.integers(1, 1000, size=E)))
        idle = [r for r in range(1, 1 + HEALTHY) if r not in out and r not in pick and done[r] >= 2]
        for _ in range(int(rng.integers(0, 3))):
            kind = str(rng.choice(KINDS))
            if kind == "slot0":
                if not idle:
                    continue
                r = idle.pop(int(rng.integers(0, len(idle))))
                edits.append((r, int(rng.integers(0, done[r])), 0))
                bad = dict(rp=r, P=int(done[r]), E=1, id=f"h{r}")
            else:
                x = next(fresh)
                if kind == "prefix":
                    bad = dict(rp=x, P=WIDTH + int(rng.integers(1, 4)), E=int(rng.integers(1, 3)))
                elif kind == "extend":
                    bad = dict(rp=x, P=0, E=int(rng.choice([-1, -5, WIDTH + 1, 1 << 40])))
                else:
                    P = int(rng.integers(1, 6))
                    edits.append((x, int(rng.integers(0, P)), -1))
                    bad = dict(rp=x, P=P, E=1)
                bad["id"] = f"x{x}"
            bad.update(kind=kind, tokens=rng.integers(1, 1000, size=max(0, min(bad["E"], 3))))
            rows.insert(int(rng.integers(0, len(rows) + 1)), bad)
        taken = set()
        unknown = False
        for row in rows:
            if unknown and row["kind"] in ("healthy", "slot0"):
                row["after_unknown"] = True
                taken.add(row["rp"])
            unknown |= row["kind"] == "extend"
            if row["kind"] == "slot0":
                taken.add(row["rp"])
            if row["kind"] == "healthy" and not row.get("after_unknown"):
                done[row["rp"]] += row["E"]
        out |= taken
        steps.append(dict(rows=rows, edits=edits, taken=taken))
    return table, steps, out


def tokens_of(rows, table):
    """The step's token arrays in the engine's layout: each row's span, in batch order. A
    span that is no span (a bad extend) gets a few tokens: nothing after it may read them."""
    ids, pos, loc = [], [], []
    for row in rows:
        n = len(row["tokens"])
        ids += row["tokens"].tolist()
        pos += list(range(row["P"], row["P"] + n))
        loc += [int(table[row["rp"], p]) if 0 <= p < WIDTH else 1 for p in range(row["P"], row["P"] + n)]
    return ids, pos, loc


class OpsRun:
    """A Step driver (tests.test_trust_layout) with its table, and the request of each row found."""

    def __init__(self, xp, device, path, table):
        self.s = Step(xp, device, path, table=table, pad=0, num_slots=NUM_SLOTS)
        self.s.vp = kc.VerifyPlan.allocate(capacity=4096, max_batch=16, device=device)
        self.s.wp = kc.WritePlan.allocate(max_batch=16, device=device)
        self.s.log = kc.ViolationLog.allocate(capacity=4096, device=device)
        self.found, self.seen = [], 0

    @property
    def table(self):
        return self.s.table

    def step(self, rows):
        ids, pos, loc = tokens_of(rows, host(self.s.table))
        self.s([r["rp"] for r in rows], [r["P"] for r in rows], [r["E"] for r in rows], ids, pos, loc)
        got = self.s.log.read()
        self.found += [(rows[v.batch_row]["id"], v.reasons) for v in got[self.seen:]]
        self.seen = len(got)

    def finish(self):
        pass

    def errors(self):
        return self.s.errors()

    def records(self):
        return self.s.records()


class MonitorRun:
    def __init__(self, xp, device, stamp, table):
        self.xp, self.stamp, self.raw = xp, stamp, []
        self._table = xp.asarray(table)
        self.m = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=self._table, max_batch=16, device=device,
                             policy=self.raw.extend, stamp_before_forward=stamp, ring_capacity=4096)

    @property
    def table(self):
        return self._table

    @property
    def found(self):
        return [(v.request, v.reasons) for v in self.raw]

    def step(self, rows):
        xp = self.xp
        a = lambda v: xp.asarray(v, dtype=xp.int64)  # noqa: E731
        ids, pos, loc = tokens_of(rows, host(self._table))
        toks = dict(input_ids=a(ids), positions=a(pos), out_cache_loc=a(loc))
        plan = (a([r["rp"] for r in rows]), a([r["P"] for r in rows]), a([r["E"] for r in rows]))
        request_ids = [r["id"] for r in rows]
        if self.stamp:
            self.m.before_forward(*plan, request_ids=request_ids, **toks)
            self.m.after_forward()
        else:
            self.m.before_forward(*plan, request_ids=request_ids)
            self.m.after_forward(**toks)
        self.m.poll()

    def finish(self):
        self.m.poll()
        self.m.poll()

    def errors(self):
        return (int(host(self.m.verify_plan.input_errors)[0]), int(host(self.m.write_plan.input_errors)[0]))

    def records(self):
        return host(self.m.canary.records)


RUNNERS = ["split", "fused", "one_launch", "monitor", "monitor-stamped"]


def _runner(kind, xp, device, table):
    if kind.startswith("monitor"):
        return MonitorRun(xp, device, kind.endswith("stamped"), table)
    return OpsRun(xp, device, kind, table)


@pytest.mark.filterwarnings("ignore::kvcanary_cupy.KvCanaryWarning")
@pytest.mark.parametrize("kind", RUNNERS)
@pytest.mark.parametrize("seed", range(6))
def test_bad_rows_never_touch_healthy_ones(xp, device, kind, seed):
    rng = np.random.default_rng(seed)
    table, steps, out = make_run(rng)
    run, ref = _runner(kind, xp, device, table), _runner(kind, xp, device, table)
    gone = set()
    want_errors = [0, 0]
    for st in steps:
        for r, p, v in st["edits"]:
            run.table[r, p] = v
        run.step(st["rows"])
        ref.step([r for r in st["rows"] if r["kind"] == "healthy"])
        # Counted: every bad row the plan cannot take; the write also counts live rows it skips.
        bad = sum(r["kind"] in ("prefix", "extend", "entry") for r in st["rows"])
        want_errors[0] += bad
        want_errors[1] += bad + sum(bool(r.get("after_unknown")) for r in st["rows"])
        assert list(run.errors()) == want_errors
        gone |= st["taken"]
        got, want = run.records(), ref.records()
        for r in range(1, 1 + HEALTHY):
            if r not in gone:
                s = table[r]
                assert (got[s] == want[s]).all(), (r, st)
    run.finish()
    ref.finish()
    assert ref.found == []
    # Reported: every live read of slot 0, naming its request, and nothing about any other.
    slot0 = {r["id"] for st in steps for r in st["rows"] if r["kind"] == "slot0"}
    assert {rid for rid, reasons in run.found if reasons & F.RESERVED_SLOT} == slot0
    assert [f for f in run.found if f[0] not in slot0] == []
