"""Bad input of one batch row never stamps, reports or hides another row's records.

The step's token arrays are the engine's layout: every row keeps its span of
``extend_lens`` tokens whether or not it can be planned. A row that cannot be planned
stamps nothing and is counted; no other row stamps its tokens. After a row whose own
length is out of range the layout is unknown: later rows stamp nothing and are counted.
A live row that reads the reserved slot 0 inside its prefix is reported.

Each case runs through the three step paths (plan, verify, write; plan_and_verify, write;
plan_verify_write) on NumPy and, where a GPU is visible, on CuPy, once with a batch small
enough for the kernels' small route and once padded past it (the block-per-row route), and
through the monitor with and without ``stamp_before_forward``.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from tests.workloads import host

PATHS = ("split", "fused", "one_launch")
V, W = kc.LaunchTag.VERIFY, kc.LaunchTag.WRITE
TABLE = np.arange(64, dtype=np.int32).reshape(4, 16)  # row r, position p -> slot 16 r + p
PAD_ROWS = 300  # padding rows after the batch: past the small route's 256 rows


class Step:
    """One canary, plan pair and log, stepped through one of the three paths."""

    def __init__(self, xp, device, path, table=TABLE, pad=0, num_slots=64):
        self.xp, self.path, self.pad = xp, path, pad
        self.table = xp.asarray(table)
        self.canary = kc.CanaryBuffer.allocate(num_slots=num_slots, device=device)
        self.vp = kc.VerifyPlan.allocate(capacity=256, max_batch=4 + pad, device=device)
        self.wp = kc.WritePlan.allocate(max_batch=4 + pad, device=device)
        self.log = kc.ViolationLog.allocate(capacity=64, device=device)

    def __call__(self, rp, P, E, ids, pos, loc):
        xp, pad = self.xp, self.pad
        i64 = lambda v, fill=0: xp.asarray(list(v) + [fill] * pad, dtype=xp.int64)  # noqa: E731
        rows = dict(req_pool_indices=i64(rp), prefix_lens=i64(P), extend_lens=i64(E), req_to_token=self.table)
        toks = dict(input_ids=xp.asarray(ids, dtype=xp.int64), positions=xp.asarray(pos, dtype=xp.int64),
                    out_cache_loc=xp.asarray(loc, dtype=xp.int64))
        if self.path == "split":
            kc.plan(self.vp, self.wp, **rows)
            kc.verify(self.canary, self.vp, log=self.log, tag=V)
            kc.write(self.canary, self.wp, **toks, log=self.log, tag=W)
        elif self.path == "fused":
            kc.plan_and_verify(self.vp, self.wp, self.canary, **rows, log=self.log, tag=V)
            kc.write(self.canary, self.wp, **toks, log=self.log, tag=W)
        else:
            kc.plan_verify_write(self.vp, self.wp, self.canary, **rows, **toks, log=self.log, tag=V, write_tag=W)

    def records(self):
        return host(self.canary.records)

    def rows(self):
        return sorted((int(v.tag), v.slot, int(v.reasons), v.batch_row) for v in self.log.read())

    def errors(self):
        return int(host(self.vp.input_errors)[0]), int(host(self.wp.input_errors)[0])


@pytest.fixture(params=PATHS)
def path(request):
    return request.param


@pytest.fixture(params=[0, PAD_ROWS], ids=["small", "padded"])
def pad(request):
    return request.param


def _prefill(s):
    """Requests A (table row 1) and B (row 2): A holds positions 0-2, B 0-1."""
    s([1, 2], [0, 0], [3, 2], [1, 2, 3, 7, 8], [0, 1, 2, 0, 1], [16, 17, 18, 32, 33])
    assert s.rows() == []


def test_a_row_that_cannot_be_planned_keeps_its_span(xp, device, path, pad):
    s = Step(xp, device, path, pad=pad)
    _prefill(s)
    before = s.records()
    s([1, 2], [20, 2], [1, 1], [4, 9], [20, 2], [19, 34])  # A's prefix is past the table
    recs = s.records()
    assert recs[34, :2].tolist() == [9, 2]  # B stamped its own token in its own slot
    assert (recs[19] == before[19]).all()  # A's token is stamped by no one
    assert s.rows() == []
    assert s.errors() == (1, 1)
    s([2], [3], [0], [], [], [])  # B's next read: clean
    assert s.rows() == []


@pytest.mark.parametrize("bad_extend", [-1, 1 << 40])
def test_rows_after_an_unknown_span_stamp_nothing(xp, device, path, pad, bad_extend):
    s = Step(xp, device, path, pad=pad)
    _prefill(s)
    before = s.records()
    s([1, 2], [3, 2], [bad_extend, 1], [4, 9], [3, 2], [19, 34])
    assert (s.records() == before).all()  # no row is stamped from a guess
    assert s.rows() == []
    assert s.errors() == (1, 2)  # A cannot be planned; B is verified, not stamped


def test_a_row_before_the_bad_one_still_stamps(xp, device, path, pad):
    s = Step(xp, device, path, pad=pad)
    _prefill(s)
    s([2, 1], [2, 3], [1, -3], [9, 4], [2, 3], [34, 19])
    assert s.records()[34, :2].tolist() == [9, 2]
    assert s.rows() == []
    assert s.errors() == (1, 1)


def test_a_padding_row_keeps_its_span(xp, device, path, pad):
    s = Step(xp, device, path, pad=pad)
    _prefill(s)
    s([1, 0, 2], [3, 0, 2], [1, 2, 1], [4, 0, 0, 9], [3, 0, 0, 2], [19, 0, 0, 34])
    recs = s.records()
    assert recs[19, :2].tolist() == [4, 3] and recs[34, :2].tolist() == [9, 2]
    assert (recs[0] == 0).all()
    assert s.rows() == [] and s.errors() == (0, 0)


def test_the_reserved_slot_inside_a_prefix_is_reported(xp, device, path, pad):
    t = np.zeros((2, 8), np.int32)
    t[1, :6] = [9, 4, 17, 30, 2, 11]
    s = Step(xp, device, path, table=t, pad=pad)
    s([1], [0], [5], [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [9, 4, 17, 30, 2])
    s.table[1, 2] = 0  # the engine's table now maps a live position to slot 0
    checked = s.log.counters()["slots_checked"]
    s([1], [5], [1], [6], [5], [11])
    # The entry is reported; its successor's chain is not checked against slot 0's record.
    assert s.rows() == [(int(V), 0, int(F.RESERVED_SLOT), 0)]
    assert s.log.counters()["slots_checked"] - checked == 5
    assert (s.records()[0] == 0).all()


def test_a_position_after_the_largest_breaks_the_chain(xp, device, path, pad):
    big = np.iinfo(np.int64).max
    s = Step(xp, device, path, pad=pad)
    s([1], [0], [2], [5, 6], [big, -big - 1], [16, 17])
    assert s.rows() == [(int(W), 17, int(F.WRITE_POSITION), 0)]


# --- the monitor -----------------------------------------------------------------------
def _monitor(xp, device, table, stamp):
    found = []
    m = kc.KvCanary(num_slots=64, req_to_token=table, max_batch=2, device=device, policy=found.extend,
                    stamp_before_forward=stamp)
    return m, found


def _run(m, xp, stamp, rp, P, E, ids, pos, loc, request_ids):
    a = lambda v: xp.asarray(v, dtype=xp.int64)  # noqa: E731
    toks = dict(input_ids=a(ids), positions=a(pos), out_cache_loc=a(loc))
    if stamp:
        m.before_forward(a(rp), a(P), a(E), request_ids=request_ids, **toks)
        m.after_forward()
    else:
        m.before_forward(a(rp), a(P), a(E), request_ids=request_ids)
        m.after_forward(**toks)
    m.poll()


@pytest.mark.parametrize("stamp", [False, True], ids=["after", "stamped"])
def test_monitor_a_bad_row_never_reports_its_neighbour(xp, device, stamp):
    m, found = _monitor(xp, device, xp.asarray(TABLE), stamp)
    ids = ["A", "B"]
    _run(m, xp, stamp, [1, 2], [0, 0], [3, 2], [1, 2, 3, 7, 8], [0, 1, 2, 0, 1], [16, 17, 18, 32, 33], ids)
    with pytest.warns(kc.KvCanaryWarning):
        _run(m, xp, stamp, [1, 2], [20, 2], [1, 1], [4, 9], [20, 2], [19, 34], ids)  # A's prefix is bad
        _run(m, xp, stamp, [2], [3], [1], [10], [3], [35], ["B"])
        m.poll()
        m.poll()
    assert [v for v in found if v.request == "B"] == []
    assert host(m.canary.records)[34, :2].tolist() == [9, 2]


@pytest.mark.parametrize("stamp", [False, True], ids=["after", "stamped"])
def test_monitor_reports_a_live_prefix_on_the_reserved_slot(xp, device, stamp):
    t = xp.zeros((2, 8), dtype=xp.int32)
    t[1, :6] = xp.asarray([9, 4, 17, 30, 2, 11], dtype=xp.int32)
    m, found = _monitor(xp, device, t, stamp)
    _run(m, xp, stamp, [1], [0], [5], [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [9, 4, 17, 30, 2], ["R"])
    t[1, 2] = 0
    _run(m, xp, stamp, [1], [5], [1], [6], [5], [11], ["R"])
    m.poll()
    m.poll()
    assert [(v.request, v.slot, v.reasons, v.expected_position) for v in found] == [("R", 0, F.RESERVED_SLOT, 2)]
    assert m.stats()["slots_checked"] == 5


def test_scatter_counts_the_rows_it_skips(xp, device):
    table = xp.zeros((3, 4), dtype=xp.int64)
    err = xp.zeros(1, dtype=xp.int64)
    # rows: fine; padding; outside the table; span past the tokens; reversed span; negative row
    kc.scatter_expected_tokens(table, tokens=xp.arange(1, 7), offsets=xp.asarray([0, 2, 2, 3, 9, 4, 1]),
                               req_pool_indices=xp.asarray([1, 0, 7, 2, 2, -1]), input_errors=err)
    assert host(table).tolist() == [[0] * 4, [1, 2, 0, 0], [0] * 4]
    assert int(host(err)[0]) == 4
    kc.scatter_expected_tokens(table, tokens=xp.arange(1, 7), offsets=xp.asarray([0, 0]),
                               req_pool_indices=xp.asarray([2]), input_errors=err)  # an empty span
    assert int(host(err)[0]) == 4
    with pytest.raises(ValueError, match="kvcanary: input_errors"):
        kc.scatter_expected_tokens(table, tokens=xp.arange(1, 7), offsets=xp.asarray([0, 0]),
                                   req_pool_indices=xp.asarray([2]), input_errors=xp.zeros(2, dtype=xp.int64))


def test_rows_of_bad_input_say_what_was_wrong(xp, device, path):
    s = Step(xp, device, path)
    s([1, 2], [0, 0], [3, 2], [1, 2, 3], [0, 1, 2], [16, 17, 18])  # B's span is past the token arrays
    (short,) = s.log.read()
    assert (short.reasons, short.batch_row) == (F.INPUT_OUT_OF_RANGE, 1)
    assert (short.span_start, short.span_end, short.tokens_given) == (3, 5, 3)
    assert "span [3, 5) of the step's token arrays" in str(short) and "which hold 3 token(s)" in str(short)
    t = np.zeros((2, 8), np.int32)
    t[1, :3] = [0, 4, 17]
    s = Step(xp, device, path, table=t)
    s([1], [3], [0], [], [], [])  # (its slots 4 and 17 were never stamped: reported too)
    (reserved,) = [v for v in s.log.read() if v.reasons == F.RESERVED_SLOT]
    assert "maps position 0 to slot 0, the reserved padding slot" in str(reserved)
