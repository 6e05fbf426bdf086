"""IncidentFolder: the rows of one piece of damage fold into one incident, reported once."""
from __future__ import annotations

import dataclasses

import pytest

from kvcanary_cupy import FailReason, LaunchTag, Violation
from kvcanary_cupy.monitor.incidents import Incident, IncidentFolder, incident_key


def row(slot=30, request="r1", reasons=FailReason.CHAIN, *, tag=LaunchTag.VERIFY, batch_row=0, position=4):
    return Violation(tag=int(tag), slot=slot, position=position, stored_token=7, expected_token=7, stored_link=1,
                     expected_link=2, reasons=reasons, batch_row=batch_row, expected_position=position,
                     request=request)


def divergence(rank, *, round_=3):
    """A RANK_DIVERGENCE row of the tensor-parallel agreement: ranks, not a slot."""
    return Violation(tag=int(LaunchTag.TP_AGREE), slot=-1, position=round_, stored_token=rank, expected_token=0,
                     stored_link=11, expected_link=22, reasons=FailReason.RANK_DIVERGENCE, batch_row=-1,
                     expected_position=3)


def test_a_repeated_row_is_reported_once_and_counted():
    folder = IncidentFolder()
    new = folder.fold([("main", row())], step=12)
    assert len(new) == 1 and isinstance(new[0], Incident)
    first = new[0]
    assert (first.request, first.group, first.slot, first.reasons) == ("r1", "main", 30, FailReason.CHAIN)
    assert (first.first_step, first.last_step, first.count) == (12, 12, 1)
    for step in range(13, 19):
        assert folder.fold([("main", row())], step=step) == []
    (now,) = folder.incidents
    assert (now.first_step, now.last_step, now.count) == (12, 18, 7)
    assert now.violation == row() and folder.raw_rows == 7 and len(folder) == 1
    # Immutable: the incident handed out at step 12 is as it was then.
    assert (first.count, first.last_step) == (1, 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        now.count = 0


def test_rows_of_one_call_fold_and_the_new_incident_counts_them_all():
    folder = IncidentFolder()
    new = folder.fold([("main", row()), ("main", row(31)), ("main", row())], step=5)
    assert [(i.slot, i.count) for i in new] == [(30, 2), (31, 1)]  # first-seen order, counted to the call's end
    assert folder.raw_rows == 3


def test_each_part_of_the_key_makes_its_own_incident():
    folder = IncidentFolder()
    rows = [("main", row()), ("main", row(31)), ("main", row(request="r2")),
            ("main", row(reasons=FailReason.CHAIN | FailReason.TOKEN)), ("swa", row())]
    assert len(folder.fold(rows, step=1)) == 5
    # What is not in the key (the launch, the batch row, the position) folds.
    again = [("main", row(tag=LaunchTag.SWEEP)), ("main", row(batch_row=3)), ("main", row(position=9))]
    assert folder.fold(again, step=2) == []
    assert [i.count for i in folder.incidents] == [4, 1, 1, 1, 1]
    assert [i.group for i in folder.incidents] == ["main", "main", "main", "main", "swa"]


def test_without_request_ids_the_slot_is_the_identity_not_the_batch_row():
    folder = IncidentFolder()
    assert len(folder.fold([("main", row(request=None, batch_row=0))], step=1)) == 1
    # The batch shifted: the same damage now sits in batch row 2; still the same incident.
    assert folder.fold([("main", row(request=None, batch_row=2))], step=2) == []
    assert folder.incidents[0].count == 2 and folder.incidents[0].request is None
    assert incident_key("main", row(request=None, batch_row=0)) == incident_key("main", row(request=None, batch_row=5))
    # A request id sets it apart from the id-less incident at the same slot.
    assert len(folder.fold([("main", row(request="r1"))], step=3)) == 1


def test_forget_drops_a_finished_request_so_a_reused_slot_reports_again():
    folder = IncidentFolder()
    folder.fold([("main", row()), ("main", row(31)), ("main", row(40, request="r2"))], step=1)
    folder.fold([("main", row())], step=2)
    dropped = folder.forget("r1")
    assert sorted((i.slot, i.count, i.last_step) for i in dropped) == [(30, 2, 2), (31, 1, 1)]
    assert [i.request for i in folder.incidents] == ["r2"]
    assert folder.forget("r1") == [] and folder.forget("never seen") == []
    assert folder.raw_rows == 4  # forgetting keeps the tally of rows folded
    (again,) = folder.fold([("main", row())], step=9)
    assert (again.first_step, again.count) == (9, 1)


def test_forget_none_and_forget_slots_serve_an_engine_without_ids():
    folder = IncidentFolder()
    folder.fold([("main", row(5, None)), ("swa", row(5, None)), ("main", row(6, "r1")), ("tp", divergence(1))],
                step=1)
    assert [i.group for i in folder.forget_slots([5], group="swa")] == ["swa"]
    assert len(folder.forget_slots([5, 6])) == 2  # any request, every group
    assert [i.group for i in folder.incidents] == ["tp"]
    folder.fold([("main", row(5, None)), ("main", row(6, None))], step=2)
    assert len(folder.forget(None)) == 2
    assert [i.is_agreement for i in folder.incidents] == [True]  # agreement incidents stay


def test_tensor_parallel_rows_are_their_own_incidents():
    folder = IncidentFolder()
    # A slot row that looks like an agreement row (slot -1, the same reason bits) stays apart.
    lookalike = row(slot=-1, request=None, reasons=FailReason.RANK_DIVERGENCE, batch_row=-1)
    new = folder.fold([("main", divergence(1)), ("main", lookalike), ("main", divergence(2))], step=4)
    assert [(i.is_agreement, i.violation.stored_token) for i in new] == [(True, 1), (False, 7), (True, 2)]
    # The same rank diverging again, at a later agreement round, is the same incident.
    assert folder.fold([("main", divergence(1, round_=4))], step=5) == []
    assert folder.incidents[0].count == 2 and folder.incidents[0].slot == -1
    notice = Violation.group_notice(other_rows=3, unheld_divergences=0, agreement_step=5)
    assert len(folder.fold([("main", notice)], step=5)) == 1
    assert folder.fold([("main", Violation.group_notice(other_rows=1, unheld_divergences=0, agreement_step=6))],
                       step=6) == []
    slot_rows = [i for i in folder.incidents if not i.is_agreement]
    assert folder.forget(None) == slot_rows and len(folder) == 3  # the lookalike goes; agreement ones stay


def test_str_is_one_line_with_the_row_and_how_often():
    folder = IncidentFolder()
    folder.fold([("main", row())], step=12)
    assert str(folder.incidents[0]) == f"{row()} [group main, first seen at step 12, 1 row]"
    for step in range(13, 19):
        folder.fold([("main", row())], step=step)
    text = str(folder.incidents[0])
    assert "\n" not in text
    assert text.startswith(str(row())) and "request 'r1'" in text and "slot 30" in text
    assert text.endswith("[group main, first seen at step 12, 7 rows to step 18]")


def test_clear_and_a_clean_step():
    folder = IncidentFolder()
    assert folder.fold([], step=1) == [] and folder.raw_rows == 0
    folder.fold([("main", row())], step=2)
    folder.clear()
    assert folder.incidents == [] and folder.raw_rows == 0
    assert len(folder.fold([("main", row())], step=3)) == 1


def test_an_unhashable_request_id_folds_instead_of_crashing():
    folder = IncidentFolder()
    assert len(folder.fold([("main", row(request=["a", 1]))], step=1)) == 1
    assert folder.fold([("main", row(request=["a", 1]))], step=2) == []
    assert len(folder.forget(["a", 1])) == 1


@pytest.mark.parametrize("rows, step, match", [
    ([("main", row())], 1.0, "kvcanary: step"),
    ([("main", row())], True, "kvcanary: step"),
    ([row()], 1, "kvcanary: rows: item 0"),
    ([(1, row())], 1, "kvcanary: rows: item 0: expected the group's name"),
    ([("main", row()), ("main", (1, 2))], 1, "kvcanary: rows: item 1: expected a Violation"),
])
def test_bad_arguments_are_refused_by_name(rows, step, match):
    with pytest.raises(TypeError, match=match):
        IncidentFolder().fold(rows, step=step)
