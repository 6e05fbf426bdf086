"""Records that travel with their KV: export_slots / import_slots and the op-level
export_records / import_records, on NumPy and (through ``xp``) CuPy.

A record's link comes from its predecessor's record, never from a slot id, so records
moved with their KV into other slots of another pool still chain: the receiver's next
verify is clean. What goes wrong on the way is caught there: a flipped K/V byte is
REAL_KV, records imported in another order than their KV (KV in the wrong slots) is
CHAIN / POSITION. Misuse is refused before any record moves.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from kvcanary_cupy.sim.model import KvPool

N, WIDTH = 96, 16
SENDER_SLOTS = [5, 9, 2, 30, 17, 8, 40, 41]  # request row 1 on the sender
RECEIVER_SLOTS = [70, 61, 88, 12, 13, 50, 77, 3]  # where the receiver's allocator put them
TOKENS = [101, 102, 103, 104, 105, 106, 107, 108]


def host(a):
    return a if isinstance(a, np.ndarray) else a.get()


class Side:
    """One engine: a slot table, a K/V pool and a monitor, on ``device``."""

    def __init__(self, xp, device, **mon_kw):
        self.xp = xp
        self.table_h = np.zeros((3, WIDTH), np.int32)
        self.table = xp.asarray(self.table_h)
        self.pool = KvPool(layers=2, num_slots=N, page_size=1, bytes_per_token=32, device=device, salt=5)
        self.mon = kc.KvCanary(num_slots=N, req_to_token=self.table, max_batch=2, device=device,
                               real_kv=self.pool.source(), policy=lambda found: None, **mon_kw)

    def set_row(self, row, slots):
        self.table_h[row, :len(slots)] = slots
        self.table[...] = self.xp.asarray(self.table_h)

    def step(self, row, prefix, tokens, slots):
        xp = self.xp
        n = len(tokens)
        pos = np.arange(prefix, prefix + n)
        self.set_row(row, list(self.table_h[row, :prefix]) + list(slots))
        self.mon.before_forward(xp.asarray([row]), xp.asarray([prefix]), xp.asarray([n]), request_ids=["req"])
        self.pool.write(np.asarray(slots), np.asarray(tokens), pos)
        self.mon.after_forward(xp.asarray(tokens), xp.asarray(pos), xp.asarray(np.asarray(slots, np.int64)))

    def drain(self):
        out = self.mon.poll()
        if self.xp is not np:
            self.xp.cuda.Device().synchronize()
            out += self.mon.poll()
        return out


def move(xp, device, *, corrupt=None, order=None):
    """Prefill on a sender, move KV + records into other slots of a receiver, decode one token there;
    returns what the receiver's verify found."""
    a, b = Side(xp, device), Side(xp, device)
    a.step(1, 0, TOKENS, SENDER_SLOTS)
    assert a.drain() == []
    records = a.mon.export_slots(np.array(SENDER_SLOTS))
    kv_k = a.pool.flat[:, xp.asarray(SENDER_SLOTS)].copy()  # what the transport carries
    if corrupt is not None:
        layer, i, byte = corrupt
        kv_k[layer, i, byte] ^= np.uint8(0x21)
    b.pool.flat[:, xp.asarray(RECEIVER_SLOTS)] = kv_k
    land = RECEIVER_SLOTS if order is None else [RECEIVER_SLOTS[j] for j in order]
    b.mon.import_slots(np.array(land), records)
    b.set_row(2, RECEIVER_SLOTS)  # the receiver's table: the KV's new home, in position order
    b.step(2, len(TOKENS), [109], [60])
    return b, b.drain()


def test_moved_records_verify_clean_in_other_slots(xp, device):
    b, found = move(xp, device)
    assert found == []
    assert b.mon.stats()["slots_checked"] == len(TOKENS)
    # The chain went on from the moved records: the new token's record links to them.
    rec = host(b.mon.canary.records)
    assert rec[60, 1] == len(TOKENS)
    assert int(rec[60, 2]) == int(kc.next_link(rec[RECEIVER_SLOTS[-1]], chain=b.mon.canary.chain).view(np.int64))


def test_a_flipped_kv_byte_in_transit_is_real_kv(xp, device):
    _, found = move(xp, device, corrupt=(1, 4, 3))  # layer 1, the 5th token, byte 3 (inside PARTIAL's 16)
    assert [(v.slot, v.reasons) for v in found] == [(RECEIVER_SLOTS[4], F.REAL_KV)]
    assert found[0].request == "req"


def test_records_imported_in_the_wrong_order_are_caught(xp, device):
    order = [0, 1, 2, 4, 3, 5, 6, 7]  # two records swapped against their KV
    _, found = move(xp, device, order=order)
    slots = {v.slot for v in found}
    assert {RECEIVER_SLOTS[3], RECEIVER_SLOTS[4]} <= slots
    assert all(v.reasons & (F.CHAIN | F.POSITION) for v in found)
    assert any(v.reasons & F.POSITION for v in found)


def test_export_is_a_copy_on_the_monitors_device(xp, device):
    a = Side(xp, device)
    a.step(1, 0, TOKENS[:3], SENDER_SLOTS[:3])
    rec = a.mon.export_slots([SENDER_SLOTS[2], SENDER_SLOTS[0]])
    assert isinstance(rec, xp.ndarray) and rec.dtype == np.int64 and rec.shape == (2, 4)
    assert host(rec)[:, :2].tolist() == [[103, 2], [101, 0]]
    rec[...] = 0
    assert host(a.mon.canary.records)[SENDER_SLOTS[0], 0] == 101
    assert a.mon.export_slots(np.zeros(0, np.int64)).shape == (0, 4)


def test_op_level_functions_for_callers_without_a_monitor(xp, device):
    """A plain CanaryBuffer: write with the ops, move with export_records / import_records, verify."""
    src = kc.CanaryBuffer.allocate(num_slots=N, device=device)
    dst = kc.CanaryBuffer.allocate(num_slots=N, device=device)
    log = kc.ViolationLog.allocate(capacity=16, device=device)
    vp = kc.VerifyPlan.allocate(capacity=32, max_batch=1, device=device)
    wp = kc.WritePlan.allocate(max_batch=1, device=device)
    t_src = np.zeros((2, WIDTH), np.int64)
    t_src[1, :4] = SENDER_SLOTS[:4]
    t_dst = np.zeros((2, WIDTH), np.int64)
    t_dst[1, :4] = RECEIVER_SLOTS[:4]
    row = dict(req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([0]), extend_lens=xp.asarray([4]))
    kc.plan(None, wp, req_to_token=xp.asarray(t_src), **row)
    kc.write(src, wp, input_ids=xp.asarray(TOKENS[:4]), positions=xp.arange(4), out_cache_loc=xp.asarray(t_src[1, :4]),
             log=log, tag=kc.LaunchTag.WRITE)
    kc.import_records(dst, RECEIVER_SLOTS[:4], kc.export_records(src, SENDER_SLOTS[:4]))
    kc.plan(vp, None, req_to_token=xp.asarray(t_dst), req_pool_indices=xp.asarray([1]),
            prefix_lens=xp.asarray([4]), extend_lens=xp.asarray([0]))
    kc.verify(dst, vp, log=log, tag=kc.LaunchTag.VERIFY)
    assert log.count == 0 and log.counters()["slots_checked"] == 4
    t_dst[1, 2] = 80  # the table now sends position 2 elsewhere
    kc.plan(vp, None, req_to_token=xp.asarray(t_dst), req_pool_indices=xp.asarray([1]),
            prefix_lens=xp.asarray([4]), extend_lens=xp.asarray([0]))
    kc.verify(dst, vp, log=log, tag=kc.LaunchTag.VERIFY)
    assert {v.slot for v in log.read()} == {80, RECEIVER_SLOTS[3]}


def test_misuse_is_refused_before_any_record_moves(xp, device):
    a = Side(xp, device)
    a.step(1, 0, TOKENS[:3], SENDER_SLOTS[:3])
    good = a.mon.export_slots(SENDER_SLOTS[:3])
    before = host(a.mon.canary.records).copy()
    cases = [
        (dict(slots=[0, 70, 71], records=good), ValueError, r"kvcanary: slots: .*\[1, num_slots = 96\).*got 0 at index 0"),
        (dict(slots=[70, 96, 71], records=good), ValueError, r"kvcanary: slots: .*got 96 at index 1"),
        (dict(slots=[70, 71, 70], records=good), ValueError, r"kvcanary: slots: slot 70 appears 2 times"),
        (dict(slots=[70, 71], records=good), ValueError, r"kvcanary: records: expected shape \[n, 4\] with n = 2"),
        (dict(slots=[70, 71, 72], records=good.astype(np.int32)), TypeError, r"kvcanary: records: expected dtype int64"),
        (dict(slots=[70, 71, 72], records=xp.ascontiguousarray(good[:, :3])), ValueError, r"kvcanary: records: expected shape"),
        (dict(slots=[70, 71, 72], records=good[:, :3]), ValueError, r"kvcanary: records: expected a C-contiguous"),
        (dict(slots=[70, 71, 72], records=good.reshape(-1)), ValueError, r"kvcanary: records: expected 2-D"),
        (dict(slots=[70.0, 71, 72], records=good), TypeError, r"kvcanary: slots: expected integers"),
        (dict(slots=np.array([[70, 71, 72]]), records=good), ValueError, r"kvcanary: slots: expected 1-D"),
        (dict(slots=np.array([70, 71, 72], np.uint8), records=good), TypeError, r"kvcanary: slots: expected dtype"),
        (dict(slots=[70, 71, 72], records=a.mon.canary.records[1:4]), ValueError,
         r"kvcanary: import_records: canary.records and records share memory"),
    ]
    if xp is not np:
        cases += [(dict(slots=[70, 71, 72], records=host(good)), ValueError, r"kvcanary: records: expected an array on cuda"),
                  (dict(slots=xp.asarray([70, 71, 72]), records=good), ValueError,
                   r"kvcanary: slots: expected host integers")]
    for kw, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            a.mon.import_slots(**kw)
    with pytest.raises(ValueError, match=r"kvcanary: slots: .*got 0 at index 1"):
        a.mon.export_slots([5, 0])
    with pytest.raises(ValueError, match="kvcanary: group: expected 'main'"):
        a.mon.export_slots([5], group="swa")
    with pytest.raises(TypeError, match="kvcanary: canary: expected a CanaryBuffer"):
        kc.export_records(a.mon, [5])
    with pytest.raises(TypeError, match="kvcanary: slots: expected host integers"):
        kc.import_records(a.mon.canary, None, good)
    assert np.array_equal(host(a.mon.canary.records), before)


def test_swa_group_records_travel_too(xp, device):
    lut = xp.asarray(np.arange(N, dtype=np.int32))
    a = Side(xp, device, swa=kc.SwaGroup(window=4, lut=lut, num_slots=N))
    a.step(1, 0, TOKENS[:3], SENDER_SLOTS[:3])
    rec = a.mon.export_slots(SENDER_SLOTS[:3], group="swa")
    assert host(rec)[:, :2].tolist() == [[101, 0], [102, 1], [103, 2]]
    a.mon.import_slots([70, 71, 72], rec, group="swa")
    assert host(a.mon.swa_canary.records)[[70, 71, 72], 0].tolist() == [101, 102, 103]
