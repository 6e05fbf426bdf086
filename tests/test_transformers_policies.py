"""What a violation does under each policy: log, raise, a callable, cancel (only the affected
request fails, with an error naming the violation; the rest of the batch completes unchanged)."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("torch")  # the harness needs both; without them these tests skip
pytest.importorskip("transformers")

from tests.test_transformers_harness import cb, drive, greedy, llama, prompts, swap_block_table_entries

from kvcanary_cupy import KvCanaryError
from kvcanary_cupy.integrations.transformers import EngineViolation, watch

NEW = 20


def inputs():
    return prompts(12, seed=7, min_len=10, max_len=20)


def faulty_run(model, **opts):
    return drive(model, inputs(), gen=greedy(NEW), config=cb(), max_new_tokens=NEW, inject=swap_block_table_entries)


def _incidents(violations) -> list:
    """The first row of each request, group, slot and reasons: what a policy sees."""
    first = {}
    for v in violations:
        first.setdefault((v.request_id, v.group, v.violation.slot, int(v.reasons)), v)
    return list(first.values())


def test_log_policy_logs_each_incident_once(caplog):
    model = llama()
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        with watch(model) as w:
            d = faulty_run(model)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcanary"]
    assert len(lines) == len(_incidents(w.violations)) > 0
    assert len(lines) < len(w.violations)  # a damaged slot read at every step is logged once
    assert all(line.startswith("kvcanary violation") for line in lines)
    assert f"request {d.victim!r}" in lines[0]
    assert all(r.error is None for r in d.results.values())  # logging changes nothing


def test_callable_policy_gets_engine_violations():
    model = llama()
    calls = []
    with watch(model, policy=calls.append) as w:
        d = faulty_run(model)
    assert calls and all(isinstance(batch, list) and batch for batch in calls)
    flat = [v for batch in calls for v in batch]
    assert flat == _incidents(w.violations)
    assert all(isinstance(v, EngineViolation) for v in flat)
    assert flat[0].request_id == d.victim and flat[0].group == 0 and flat[0].layers == (0, 1)


def test_raise_policy_stops_the_engine_and_raises_on_exit():
    model = llama()
    with pytest.raises(KvCanaryError) as caught:
        with watch(model, policy="raise"):
            d = faulty_run(model)
    assert caught.value.violations[0].request_id == d.victim
    failed = [r for r in d.results.values() if r.error is not None]
    assert failed and all("kvcanary violation" in r.error for r in failed)  # the engine failed what was left
    assert len(d.results) == len(d.request_ids)


def test_raise_policy_poll_raises_once():
    model = llama()
    with watch(model, policy="raise") as w:
        faulty_run(model)
        with pytest.raises(KvCanaryError):
            w.poll()
        assert w.poll() == []  # raised once; the block then exits cleanly


def test_cancel_policy_fails_only_the_affected_request():
    model = llama()
    ref = drive(model, inputs(), gen=greedy(NEW), config=cb(), max_new_tokens=NEW).tokens()
    with watch(model, policy="cancel") as w:
        d = faulty_run(model)
    victim = d.results[d.victim]
    assert victim.error.startswith(f"kvcanary: request {d.victim!r} cancelled")
    assert "position" in victim.error and "layer group 0" in victim.error
    assert victim.status.name == "FAILED"
    others = {k: v for k, v in d.tokens().items() if k != d.victim}
    assert others == {k: v for k, v in ref.items() if k != d.victim}
    assert all(d.results[k].error is None for k in others)
    stats = w.stats()
    assert stats["cancelled"] == 1 and stats["violations"] > 0
    assert {v.request_id for v in w.violations} == {d.victim}  # cancelled at once: no step reads it again
    assert max(v.step for v in w.violations) == min(v.step for v in w.violations)
