"""A violation row points at the damage: hand-made cases with known answers.

A CHAIN row names the predecessor record (its slot and the position it holds), a REAL_KV
row both fingerprints (stored, and the live bytes'), a write row the token's index, its
row's span of the step's token arrays and how many tokens those arrays hold. Each case runs
through the three step paths on NumPy and, where a GPU is visible, on CuPy, small and padded
past the kernels' small route.
"""
from __future__ import annotations

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
# The three step paths and the two routes (small, padded past the small route) as there.
from tests.test_trust_layout import Step, pad, path  # noqa: F401  (fixtures)
from tests.workloads import host

M64 = (1 << 64) - 1


def test_a_chain_row_names_the_predecessor_and_the_position_it_holds(xp, device, path, pad):
    s = Step(xp, device, path, pad=pad)
    s([1], [0], [4], [101, 102, 103, 104], [0, 1, 2, 3], [16, 17, 18, 19])  # slots 16 + position
    s.canary.records[17, 0] = 999  # a stray write changes slot 17's token
    s([1], [4], [1], [105], [4], [20])
    (v,) = s.log.read()
    assert (v.slot, v.reasons, v.prev_slot, v.prev_position) == (18, F.CHAIN, 17, 1)
    assert (v.token_index, v.span_start, v.span_end, v.tokens_given) == (-1, -1, -1, -1)
    assert "its predecessor, slot 17 (expected position 1), holds position 1" in str(v)


def test_a_moved_predecessor_shows_the_position_it_holds(xp, device, path, pad):
    s = Step(xp, device, path, pad=pad)
    s([1], [0], [3], [101, 102, 103], [0, 1, 2], [16, 17, 18])
    s.canary.records[17, 1] = 40  # slot 17 now claims position 40: its own row and its successor's
    s([1], [3], [1], [104], [3], [19])
    rows = {v.slot: v for v in s.log.read()}
    assert (rows[17].reasons, rows[17].prev_slot, rows[17].prev_position) == (F.POSITION, 16, 0)
    assert (rows[18].reasons, rows[18].prev_slot, rows[18].prev_position) == (F.CHAIN, 17, 40)


def test_the_first_record_of_a_sequence_has_no_predecessor(xp, device, path, pad):
    s = Step(xp, device, path, pad=pad)
    s([1], [0], [2], [101, 102], [0, 1], [16, 17])
    s.canary.records[16, 2] ^= 1  # the first record's link
    s([1], [2], [1], [103], [2], [18])
    first = [v for v in s.log.read() if v.slot == 16]
    assert [(v.prev_slot, v.prev_position) for v in first] == [(-1, -1)]
    assert "the first record of its sequence" in str(first[0])


def test_a_write_row_names_its_token_and_its_span(xp, device, path, pad):
    s = Step(xp, device, path, pad=pad)
    s([1, 2], [0, 0], [2, 2], [101, 102, 201, 202], [0, 1, 0, 1], [16, 17, 32, 33])
    # Batch row 1's second token jumps from position 2 to 5: token 2 of the step, in its span [1, 3).
    s([1, 2], [2, 2], [1, 2], [103, 203, 204], [2, 2, 5], [18, 34, 35])
    (v,) = [v for v in s.log.read() if v.reasons & F.WRITE_POSITION]
    assert (v.slot, v.batch_row, v.token_index, v.span_start, v.span_end, v.tokens_given) == (35, 1, 2, 1, 3, 3)
    assert (v.position, v.expected_position, v.prev_position, v.prev_slot) == (5, 3, 2, -1)
    assert "token 2 of the step's token arrays, in the row's span [1, 3); it follows position 2" in str(v)


def test_a_real_kv_row_shows_both_fingerprints(xp, device):
    canary = kc.CanaryBuffer.allocate(num_slots=8, device=device)
    kv = xp.zeros((8, 16), dtype=xp.uint8)
    kv[3] = xp.arange(16, dtype=xp.uint8)
    src = dict(real_kv=[kc.RealKvSource(kv, bytes_per_token=16)], real_kv_mode=kc.RealKvMode.ALL)
    vp = kc.VerifyPlan.allocate(capacity=8, max_batch=1, device=device)
    wp = kc.WritePlan.allocate(max_batch=1, device=device)
    log = kc.ViolationLog.allocate(capacity=8, device=device)
    table = xp.asarray([[0, 0], [3, 4]], dtype=xp.int32)
    rows = dict(req_pool_indices=xp.asarray([1]), req_to_token=table)
    kc.plan(vp, wp, prefix_lens=xp.asarray([0]), extend_lens=xp.asarray([1]), **rows)
    kc.write(canary, wp, input_ids=xp.asarray([7]), positions=xp.asarray([0]), out_cache_loc=xp.asarray([3]),
             log=log, tag=kc.LaunchTag.WRITE, **src)
    kv[3, 0] ^= 0xFF  # a K/V byte flips
    kc.plan(vp, wp, prefix_lens=xp.asarray([1]), extend_lens=xp.asarray([1]), **rows)
    kc.verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY, **src)
    (v,) = log.read()

    def fp(b: bytes) -> int:  # one source, one 16-byte chunk (DESIGN: the real-KV fold)
        lo, hi = int.from_bytes(b[:8], "little"), int.from_bytes(b[8:], "little")
        acc = int(kc.splitmix64(int(kc.splitmix64(lo)) ^ hi))
        return int(kc.splitmix64(acc))

    before = bytes(range(16))
    after = bytes([0xFF]) + before[1:]
    assert v.reasons == F.REAL_KV
    assert (v.stored_fingerprint & M64, v.expected_fingerprint & M64) == (fp(before), fp(after))
    assert v.stored_fingerprint == int(host(canary.records)[3, 3])
    assert f"stored {fp(before):#018x}, the slot's K/V bytes now hash to {fp(after):#018x}" in str(v)


def test_rows_keep_sglangs_ten_columns_first():
    """The first ten columns are SGLang's, in its order; the detail columns follow them."""
    assert kc.format.VIOLATION_COLUMNS[:kc.format.SGLANG_VIOLATION_WORDS] == (
        "tag", "slot", "position", "stored_token", "expected_token", "stored_link", "expected_link", "fail_bits",
        "batch_row", "expected_position")
    assert set(kc.format.VIOLATION_COLUMNS[kc.format.SGLANG_VIOLATION_WORDS:]) == set(kc.format.UNUSED_DETAIL)
    assert np.int64(0).itemsize * kc.format.VIOLATION_WORDS % 16 == 0  # rows stored as 16-byte pairs


def test_a_plan_names_its_first_dropped_row_and_the_table_entry_at_fault(xp, device, path, pad):
    table = np.arange(64, dtype=np.int32).reshape(4, 16)
    table[3, 2] = -1  # request row 3's position 2 has no slot
    s = Step(xp, device, path, table=table, pad=pad)
    # Batch rows: 0 healthy, 1 reads the hole at position 2, 2 names request row 9 (no such row), 3 the hole again.
    s([1, 3, 9, 3], [2, 4, 0, 5], [1, 1, 1, 1], [11, 12, 13, 14], [2, 4, 0, 5], [18, 52, 60, 53])
    assert s.vp.host_first_input_error() == dict(batch_row=1, request_row=3, prefix_len=4, extend_len=1, position=2,
                                                 table_value=-1)
    assert int(host(s.vp.input_errors)[0]) == 3
    s([9, 1], [0, 3], [1, 1], [13, 14], [0, 3], [60, 19])  # the request row itself is out of range
    assert s.vp.host_first_input_error() == dict(batch_row=0, request_row=9, prefix_len=0, extend_len=1, position=-1,
                                                 table_value=-1)
    s([1], [4], [1], [15], [4], [20])  # a clean plan: no row dropped
    assert s.vp.host_first_input_error() is None


def test_a_block_id_whose_last_offsets_overflow_drops_the_row_at_the_first_of_them(xp, device):
    """Page size 3: the largest block id whose slots at offsets 0 and 1 fit int64 has none at
    offset 2; a row reading only the first two is planned, one reading the third is dropped there."""
    big = (np.iinfo(np.int64).max - 1) // 3
    assert big * 3 + 1 <= np.iinfo(np.int64).max < big * 3 + 2
    bt = np.zeros((2, 3), np.int64)
    bt[1, :2] = [2, big]
    for prefix, error in ((5, None), (6, dict(batch_row=0, request_row=1, prefix_len=6, extend_len=1, position=5,
                                             table_value=big))):
        vp = kc.VerifyPlan.allocate(capacity=16, max_batch=1, device=device)
        kc.plan(vp, None, req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([prefix]),
                extend_lens=xp.asarray([1]), block_table=xp.asarray(bt), page_size=3)
        assert vp.host_first_input_error() == error
        planned = 0 if error else prefix
        assert int(host(vp.num_valid)[0]) == planned
        assert host(vp.slot_indices)[:planned].tolist() == [6, 7, 8, 3 * big, 3 * big + 1][:planned]


def test_a_page_table_names_the_block_entry(xp, device):
    bt = np.zeros((3, 4), np.int32)
    bt[1, :2] = [5, -7]  # request row 1's second block id is negative: unreadable
    vp = kc.VerifyPlan.allocate(capacity=16, max_batch=1, device=device)
    wp = kc.WritePlan.allocate(max_batch=1, device=device)
    kc.plan(vp, wp, req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([6]), extend_lens=xp.asarray([1]),
            block_table=xp.asarray(bt), page_size=4)
    got = vp.host_first_input_error()
    assert got == dict(batch_row=0, request_row=1, prefix_len=6, extend_len=1, position=4, table_value=-7)
    assert kc.plans.describe_input_error(got, request="a", page_size=4) == (
        "batch row 0 (request 'a'), request-table row 1, prefix 6, extend 1: the block-table entry (page 1) for "
        "position 4 is -7 (unreadable)")
