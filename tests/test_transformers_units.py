"""The adapter's pieces without an engine: slot shift, request rows, host tables, layer-group
tables (full and sliding window), violations in the engine's terms, hooks, version check.
Fast, and needs neither torch nor transformers."""
from __future__ import annotations

import types

import numpy as np
import pytest

from kvcanary_cupy import FailReason, Violation
from kvcanary_cupy.integrations.transformers.groups import LayerGroup
from kvcanary_cupy.integrations.transformers.hooks import Hooks
from kvcanary_cupy.integrations.transformers.slots import SlotMap
from kvcanary_cupy.integrations.engine.tables import ExpectedTable, MirroredTable, RowPool, flatten, spans
from kvcanary_cupy.integrations.transformers.version import check_version
from kvcanary_cupy.integrations.engine.violations import EngineViolation, RequestTag, cancel_message

BS = 4


def group(block_table: dict, *, window=None, rows=4, width=16):
    alloc = types.SimpleNamespace(block_table=block_table)
    return LayerGroup(index=1 if window else 0, kind="sliding_attention" if window else "full_attention",
                      layers=(0, 2), allocator=alloc, window=window,
                      slot_map=SlotMap(block_size=BS, engine_rows=12 * BS), table=MirroredTable(rows, width, "cpu"))


def state(prompt, generated=()):
    return types.SimpleNamespace(initial_tokens=list(prompt), generated_tokens=list(generated))


def test_slot_map_shifts_by_one_block_so_engine_row_0_is_a_real_slot():
    m = SlotMap(block_size=BS, engine_rows=12 * BS)
    assert m.num_slots == 13 * BS
    assert m.slots([0, 5]).tolist() == [4, 9] and m.engine_row(4) == 0
    assert m.block_slots([0]).tolist() == [4, 5, 6, 7]  # engine block 0 -> canary page 1
    assert m.pages([0, 11]).tolist() == [1, 12]


def test_spans_and_flatten_edge_cases():
    owner, value = spans([3, 3], [3, 5])
    assert owner.tolist() == [1, 1] and value.tolist() == [3, 4]
    values, starts, lens = flatten([])
    assert values.size == starts.size == lens.size == 0


def test_row_pool_keeps_rows_per_state_and_reuses_the_oldest():
    pool = RowPool(4)
    a, b, c, d = object(), object(), object(), object()
    assert [pool.acquire(s, set())[0] for s in (a, b, c)] == [1, 2, 3]
    assert pool.acquire(b, set()) == (2, False)
    assert pool.acquire(d, {1}) == (3, True)  # a's row is busy this step; c is the oldest free owner
    assert pool.acquire(c, {1, 3}) == (2, True)
    with pytest.raises(ValueError, match="kvcanary: the step holds more requests than the 3 table rows"):
        pool.acquire(object(), {1, 2, 3})
    pool.clear()
    assert pool.acquire(a, set()) == (1, True)


def test_expected_tokens_follow_prompt_then_generated_and_grow():
    t = ExpectedTable(3, 4, "cpu", valid_lens=np.zeros(2, np.int64))
    s = state([5, 6, 7], [8])
    t.fill(np.array([1]), [s], np.array([4]), np.array([True]))
    assert t.table.host[1].tolist() == [5, 6, 7, 8]
    s.generated_tokens += [9, 10]
    t.reserve(6)
    assert t.width == 8 and t.table.host[1, :4].tolist() == [5, 6, 7, 8]  # widening keeps rows
    t.fill(np.array([1]), [s], np.array([7]), np.array([False]))  # position 6 not sampled yet
    assert t.table.host[1, :7].tolist() == [5, 6, 7, 8, 9, 10, -1]
    s.generated_tokens.append(11)
    t.fill(np.array([1]), [s], np.array([7]), np.array([False]))
    assert t.table.host[1, 6] == 11
    other = state([1, 2])
    t.fill(np.array([1]), [other], np.array([2]), np.array([True]))  # a new owner of the row
    assert t.table.host[1, :2].tolist() == [1, 2]
    assert t.tokens().table is t.table.array


def test_row_pool_gives_a_repeated_batch_its_rows_again():
    pool = RowPool(5)
    a, b, c = object(), object(), object()
    assert pool.rows_of([a, b]) == ((1, 2), (True, True))
    assert pool.rows_of([a, b]) == ((1, 2), (False, False))  # the same states, in order: nothing moves
    assert pool.rows_of([b, a, c]) == ((2, 1, 3), (False, False, True))
    pool.clear()
    assert pool.rows_of([b, a, c]) == ((1, 2, 3), (True, True, True))


def test_expected_token_not_sampled_yet_is_written_once_known():
    t = ExpectedTable(2, 8, "cpu", valid_lens=np.zeros(1, np.int64))
    s = state([5, 6], [7])
    t.fill([1], [s], [3], [True])
    t.fill([1], [s], [4], [False])  # position 3: its token is still being sampled
    assert t.table.host[1, :4].tolist() == [5, 6, 7, -1]
    s.generated_tokens.append(8)
    t.fill([1], [s], [4], [False])
    assert t.table.host[1, :4].tolist() == [5, 6, 7, 8]


def test_full_group_follows_appended_swapped_and_replaced_block_lists():
    blocks = [3, 0]
    table = {"a": blocks, "b": [9]}
    g = group(table, width=8)
    g.fill([1], ["a"], [0], [8])
    assert g.table.host[1].tolist() == [4, 1, 0, 0, 0, 0, 0, 0]
    blocks.append(7)  # the engine appends a block for the next page
    g.fill([1], ["a"], [8], [9])
    assert g.table.host[1, :3].tolist() == [4, 1, 8]
    blocks[0], blocks[1] = blocks[1], blocks[0]  # changed in place: the row follows the next step
    g.fill([1], ["a"], [9], [10])
    assert g.table.host[1, :3].tolist() == [1, 4, 8]
    assert g.step_slots([9]) == g.slots_of("a", np.array([9])).tolist()
    g.fill([1], ["b"], [0], [12])  # another request on the row: its page, page 0 where it has none
    assert g.table.host[1, :2].tolist() == [10, 0]
    table["b"].append(5)
    g.fill([1], ["b"], [8], [12])
    assert g.table.host[1, :2].tolist() == [10, 6]


def test_sliding_group_slides_and_follows_a_changed_ring():
    blocks = [2, 5]
    g = group({"a": blocks}, window=6, width=32)
    for p in range(3, 20):  # a position per step, the window sliding once full
        g.fill([1], ["a"], [p], [p + 1])
        lo = max(p - 6, 0)
        assert np.flatnonzero(g.table.host[1]).tolist() == list(range(lo, p + 1))
        assert g.table.host[1, lo:p + 1].tolist() == g.slots_of("a", np.arange(lo, p + 1)).tolist()
    blocks[0], blocks[1] = blocks[1], blocks[0]
    g.fill([1], ["a"], [20], [21])
    assert g.table.host[1, 14:21].tolist() == g.slots_of("a", np.arange(14, 21)).tolist()
    assert g.step_slots([20]) == g.slots_of("a", np.array([20])).tolist()


def test_table_changes_reach_the_device_array():
    torch = pytest.importorskip("torch")
    from kvcanary_cupy.integrations.engine.staging import ChangeUpload  # noqa: PLC0415

    t = MirroredTable(3, 4, "cpu", fill=-1)
    t.cpu, t.array = False, torch.full((3, 4), -1, dtype=torch.int32)  # a device table, on the CPU
    upload = ChangeUpload("cpu")
    t.put_list([1, 6], [7, 8])
    t.put(np.array([2, 2]), np.array([0, 3]), np.array([9, 10]))
    t.put_list([1], [7])  # unchanged: nothing travels
    assert upload.flush([t]) == 4
    assert t.array.tolist() == t.host.tolist() == [[-1, 7, -1, -1], [-1, -1, 8, -1], [9, -1, -1, 10]]
    assert upload.flush([t]) == 0
    t.put_flat(np.arange(12, dtype=np.int64), np.arange(12, dtype=np.int32))
    assert upload.flush([t]) == 12 and t.array.view(-1).tolist() == list(range(12))


def test_full_group_row_is_the_page_table_plus_one():
    g = group({"a": [3, 0, 7]})
    g.fill(np.array([2]), ["a"], np.array([5]), np.array([10]))
    assert g.table.host[2, :3].tolist() == [4, 1, 8]
    g.table.host[2, 3:5] = 99
    g.fill(np.array([2]), ["a"], np.array([10]), np.array([18]))  # needs 5 pages, the engine has 3
    assert g.table.host[2, :5].tolist() == [4, 1, 8, 0, 0]
    assert g.slots_of("a", np.array([0, 5, 11, 12])).tolist() == [16, 5, 35, 1]


def test_sliding_group_row_holds_the_window_the_record_before_it_and_what_the_step_writes():
    # window 6, block size 4: a ring of 2 blocks (8 slots, 6 used); position p at ring index p % 6
    g = group({"a": [2, 5]}, window=6, width=32)
    g.fill(np.array([1]), ["a"], np.array([9]), np.array([10]))
    row = g.table.host[1]
    assert np.flatnonzero(row).tolist() == [3, 4, 5, 6, 7, 8, 9]  # positions 9 - 6 .. 8, and 9 (written)
    expect = [(2 * BS + i) + BS if i < BS else (5 * BS + i - BS) + BS for i in (3, 4, 5, 0, 1, 2)]
    assert row[3:9].tolist() == expect
    assert row[9] == expect[0] == 2 * BS + 3 + BS  # position 9 takes position 3's ring slot
    g.fill(np.array([1]), ["a"], np.array([10]), np.array([11]))  # the window slides by one
    assert np.flatnonzero(g.table.host[1]).tolist() == [4, 5, 6, 7, 8, 9, 10]
    assert g.table.host[1, 10] == expect[1]
    assert g.slots_of("a", np.array([9])).tolist() == [expect[0]]
    g.forget_rows()  # the engine reset its requests: no row points anywhere
    assert not g.table.host.any()
    g2 = group({"b": [6]}, window=6)  # a ring missing its second block
    assert g2.slots_of("b", np.array([0, 4])).tolist() == [6 * BS + BS, 1]


def test_engine_violation_names_request_group_and_row():
    row = Violation(tag=1, slot=2, position=3, stored_token=1, expected_token=-1, stored_link=0, expected_link=0,
                    reasons=FailReason.CHAIN | FailReason.POSITION, batch_row=0, expected_position=-1,
                    request=None)
    v = EngineViolation.from_row(row, group=1, group_type="sliding_attention", layers=(1,), shift=BS)
    assert v.request_id is None and v.step is None and v.engine_row == -1 and v.position == 3
    tagged = EngineViolation.from_row(Violation(**{**row.__dict__, "slot": 9, "request": RequestTag("r", 5)}),
                                      group=0, group_type="full_attention", layers=(0,), shift=BS)
    text = str(tagged)
    assert "request 'r'" in text and "layer group 0 (full_attention, layers 0)" in text and "engine cache row 5" in text
    assert "chain+position" in text and "step 5" in text
    assert cancel_message([tagged, tagged]).startswith("kvcanary: request 'r' cancelled")
    assert cancel_message([tagged, tagged]).endswith("(and 1 more)")


def test_hooks_restore_an_instance_attribute_that_was_there():
    obj = types.SimpleNamespace(f=lambda: 1)
    hooks = Hooks()
    hooks.wrap(obj, "f", lambda orig: lambda: orig() + 1)
    hooks.wrap(obj, "f", lambda orig: lambda: orig() * 10)
    assert obj.f() == 20
    hooks.remove_all()
    assert obj.f() == 1


def test_version_check_accepts_only_the_pinned_release():
    assert check_version("5.17.0") == "5.17.0"
    with pytest.raises(ValueError, match="kvcanary: transformers: .* got 5.17.1"):
        check_version("5.17.1")


@pytest.mark.parametrize("extend", [[1, 1, 1], [2, 0, 1], [3, 1, 2], [0, 0, 3], [], [1]])
def test_token_positions_run_from_each_rows_prefix(extend):
    from kvcanary_cupy.integrations.engine.step_arrays import positions  # noqa: PLC0415

    prefix = [5, 0, 9][:len(extend)]
    want = [p + j for p, e in zip(prefix, extend) for j in range(e)]
    got = positions(np.array(prefix, dtype=np.int64), np.array(extend, dtype=np.int64), sum(extend))
    assert got.dtype == np.int64 and got.tolist() == want


def test_table_rows_are_refused_where_no_launch_can_carry_them():
    torch = pytest.importorskip("torch")
    from kvcanary_cupy.integrations.engine.staging import ChangeUpload  # noqa: PLC0415

    upload = ChangeUpload("cpu", rows_to=torch.zeros((2, 4), dtype=torch.int32))
    with pytest.raises(ValueError, match="kvcanary: rows_from"):
        upload.flush([], rows_from=(torch.zeros((1, 4), dtype=torch.int32), 1))
