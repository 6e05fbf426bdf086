"""The connector inside vLLM's real in-process engine (CPU): clean runs token-identical to
runs without it, and faults injected through vLLM's own state caught and, under
``policy="cancel"``, failing only the damaged request.

Engines one after the other (vLLM keeps one connector per process): one without the
connector computes every workload's reference tokens, then one with it runs them again,
clean and with faults, once per CPU backend of the connector's checks (the NumPy reference,
numba's compiled ops). Both have a small KV pool (preemption), short
chunks (chunked prefill) and 32-token blocks (prefix hits).
"""
from __future__ import annotations

import json
import logging

import pytest

from tests.test_vllm_harness import (BLOCK, close, connector, core, drive, flip_kv, free_block_for_next_request,
                                     make_llm, prompts, rebalance, req_blocks, running_with_blocks, swap_blocks)

ENGINE = dict(kv_bytes=24 * 32 * 1024, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)  # 24 blocks
NEW = 16

# name -> (prompts, arrivals): the workloads, run alike on both engines, in this order.
WORKLOADS = {
    "clean": (prompts(12, seed=1, shared=70, families=3, min_len=10, max_len=90), {6: [9, 10, 11], 14: [8]}),
    "swap": (prompts(6, seed=2, min_len=70, max_len=100), {}),
    "freed": (prompts(5, seed=3, min_len=70, max_len=100), {10: [4]}),
    "prefix": (prompts(5, seed=4, min_len=40, max_len=60), {30: [4]}),
    "kv": (prompts(5, seed=5, min_len=40, max_len=70), {}),
}


@pytest.fixture(scope="module")
def reference():
    """Each workload's tokens without the connector."""
    llm = make_llm(connector=False, **ENGINE)
    try:
        return {name: drive(llm, p, new=NEW, arrivals=a).tokens for name, (p, a) in WORKLOADS.items()}
    finally:
        close(llm)


@pytest.fixture(scope="module", params=["numpy", "numba"])
def engine(request, reference, tmp_path_factory):
    """The engine with the connector, its checks on each CPU backend in turn."""
    if request.param == "numba":
        pytest.importorskip("numba")
    events = tmp_path_factory.mktemp("vllm-events") / "events.jsonl"
    llm = make_llm(policy="cancel", events=str(events), cpu_backend=request.param, **ENGINE)
    llm.events_path = events
    assert connector().worker.cpu_backend == request.param
    yield llm
    close(llm)


def _by_given(run) -> dict:
    """Tokens by the id the test gave (r0, r1, ...)."""
    back = {v: k for k, v in run.ids.items()}
    return {back.get(k, k): v for k, v in run.tokens.items()}


def _failed(run) -> set:
    back = {v: k for k, v in run.ids.items()}
    return {back.get(k, k) for k in run.failed}


def _others_identical(run, ref: dict, victims: set) -> None:
    got = _by_given(run)
    for rid, tokens in ref.items():
        if rid not in victims:
            assert got[rid] == tokens, f"{rid} differs from the run without the connector"


def test_clean_run_is_token_identical_and_checks_every_read_slot(engine, reference):
    p, arrivals = WORKLOADS["clean"]
    before = connector().stats()
    run = drive(engine, p, new=NEW, arrivals=arrivals)
    after = connector().stats()
    assert _by_given(run) == reference["clean"] and not run.failed
    assert after["violations"] == 0 and after["rows_unmatched"] == 0
    grown = {k: after[k] - before[k] for k in ("slots_checked", "slots_read", "slots_written", "preempted",
                                              "prefix_hits", "chunked_prefills", "steps")}
    assert grown["slots_checked"] == grown["slots_read"] > 0  # every slot attention read was checked
    assert grown["slots_written"] > 0
    # The workload went through vLLM's bookkeeping paths: preemption, prefix hits, chunked prefill.
    assert grown["preempted"] > 0 and grown["prefix_hits"] > 0 and grown["chunked_prefills"] > 0, grown
    g = after["groups"][0]
    assert g["input_errors"] == 0 and g["rows_unstamped"] == 0 and g["slots_gathered"] > 0


def _caught(run, victim_given: str, since: int, *, reasons=None) -> list:
    found = [v for v in connector().violations[since:] if v.request_id == run.ids[victim_given]]
    assert found, f"no violation names {victim_given}"
    if reasons is not None:
        assert any(v.reasons & reasons for v in found)
    return found


def test_swapped_blocks_caught_and_only_that_request_fails(engine, reference):
    from kvcanary_cupy import FailReason

    p, arrivals = WORKLOADS["swap"]
    since, state = len(connector().violations), {}

    def inject(step, llm, run):
        if "victim" not in state and step >= 6:
            rid = running_with_blocks(llm, 2)
            if rid is not None:
                state["victim"], state["step"] = rid, connector().worker.steps
                swap_blocks(llm, rid, 0, 1)
    run = drive(engine, p, new=NEW, arrivals=arrivals, inject=inject)
    victim = next(k for k, v in run.ids.items() if v == state["victim"])
    found = _caught(run, victim, since, reasons=FailReason.POSITION)
    assert min(v.step for v in found) <= state["step"] + 1  # the first step that read the swapped table
    assert {v.request_id for v in connector().violations[since:]} == {state["victim"]}
    assert _failed(run) == {victim}
    _others_identical(run, reference["swap"], {victim})


def test_block_freed_and_reused_while_read_caught(engine, reference):
    p, arrivals = WORKLOADS["freed"]
    since, state = len(connector().violations), {}

    def inject(step, llm, run):
        if step == 10:  # request r4 arrives now and takes the block
            rid = running_with_blocks(llm, 2)
            state["victim"], state["step"] = rid, connector().worker.steps
            state["block"] = free_block_for_next_request(llm, rid, 1)
        elif step == 11:
            rebalance(state["block"])
    run = drive(engine, p, new=NEW, arrivals=arrivals, inject=inject)
    victim = next(k for k, v in run.ids.items() if v == state["victim"])
    assert state["block"].block_id in [b.block_id for b in req_blocks_or_none(engine, run.ids["r4"], state)]
    found = _caught(run, victim, since)
    assert min(v.step for v in found) <= state["step"] + 2  # the write lands in step +1, read again at +2
    assert {v.request_id for v in connector().violations[since:]} == {state["victim"]}
    assert _failed(run) == {victim}
    _others_identical(run, reference["freed"], {victim})


def req_blocks_or_none(llm, rid, state):
    """The blocks the new request took (recorded by the connector's mirror when it was admitted)."""
    r = connector().worker.mirror.live.get(rid)
    blocks = r.blocks[0] if r is not None else state.get("taken", [])
    from types import SimpleNamespace  # noqa: PLC0415

    return [SimpleNamespace(block_id=b) for b in blocks] or [SimpleNamespace(block_id=state["block"].block_id)]


def test_wrong_prefix_hit_caught(engine, reference):
    from kvcanary_cupy import FailReason

    p, arrivals = WORKLOADS["prefix"]
    since, state = len(connector().violations), {}

    def inject(step, llm, run):
        sched = core(llm).scheduler
        if step == 2:  # r1's first block is complete and cached: remember its hash
            state["hash"] = sched.requests[run.ids["r1"]].block_hashes[0]
        if step == 30:  # r4 was just added (r1 has finished): its first block now "hits" r1's
            req = sched.requests[run.ids["r4"]]
            req.block_hashes[0] = state["hash"]
            state["step"] = connector().worker.steps
    run = drive(engine, p, new=NEW, arrivals=arrivals, inject=inject)
    found = _caught(run, "r4", since, reasons=FailReason.TOKEN)
    assert min(v.step for v in found) <= state["step"] + 1
    assert {v.request_id for v in connector().violations[since:]} == {run.ids["r4"]}
    assert "r4" in _failed(run) and _failed(run) <= {"r4"}
    _others_identical(run, reference["prefix"], {"r4"})


def test_key_and_value_bytes_flipped_in_the_last_layer_caught(engine, reference):
    from kvcanary_cupy import FailReason

    p, arrivals = WORKLOADS["kv"]
    since, state = len(connector().violations), {}

    def inject(step, llm, run):
        if step == 8:
            a = running_with_blocks(llm, 1)
            b = running_with_blocks(llm, 1, exclude={a})
            flip_kv(llm, a, layer=-1, position=5, value=False)
            flip_kv(llm, b, layer=-1, position=7, value=True)
            state.update(a=a, b=b, step=connector().worker.steps)
    run = drive(engine, p, new=NEW, arrivals=arrivals, inject=inject)
    back = {v: k for k, v in run.ids.items()}
    for rid in (state["a"], state["b"]):
        found = _caught(run, back[rid], since, reasons=FailReason.REAL_KV)
        assert min(v.step for v in found) <= state["step"] + 1
    assert {v.request_id for v in connector().violations[since:]} == {state["a"], state["b"]}
    assert _failed(run) == {back[state["a"]], back[state["b"]]}
    _others_identical(run, reference["kv"], {back[state["a"]], back[state["b"]]})


def test_events_name_vllm_request_ids(engine):
    lines = [json.loads(x) for x in engine.events_path.read_text().splitlines() if x.strip()]
    opened = [e for e in lines if e.get("event") != "incident_end"]
    assert opened and all(isinstance(e["request"], str) and e["request"].startswith("r") for e in opened)


def test_log_policy_names_request_position_group_reasons(engine, caplog):
    from kvcanary_cupy.integrations.engine.policy import IncidentPolicy

    worker = connector().worker
    worker.policy = IncidentPolicy("log")
    p = prompts(3, seed=9, min_len=70, max_len=90)
    state = {}

    def inject(step, llm, run):
        if "victim" not in state and step >= 6:
            rid = running_with_blocks(llm, 2)
            if rid is not None:
                state["victim"] = rid
                swap_blocks(llm, rid, 0, 1)
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        run = drive(engine, p, new=8, inject=inject)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcanary"]
    assert lines and all(state["victim"] in x and "layer group 0" in x and "position" in x for x in lines)
    assert not run.failed  # logged, not cancelled


def test_raise_policy_stops_the_engine(engine):
    from kvcanary_cupy import KvCanaryError
    from kvcanary_cupy.integrations.engine.policy import IncidentPolicy

    connector().worker.policy = IncidentPolicy("raise")
    p = prompts(3, seed=10, min_len=70, max_len=90)

    def inject(step, llm, run):
        if step == 6:
            swap_blocks(llm, running_with_blocks(llm, 2), 0, 1)
    with pytest.raises(Exception) as err:
        drive(engine, p, new=8, inject=inject)
    chain = [err.value, err.value.__cause__, err.value.__context__]
    assert any(isinstance(e, KvCanaryError) or "kvcanary" in str(e) for e in chain if e is not None)
    assert BLOCK == 32
