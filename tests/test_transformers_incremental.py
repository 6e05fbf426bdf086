"""The adapter keeps its request tables up to date step by step, writing only what changed. At
every step of real engine runs (prefix sharing, CPU offload and restore, soft resets, forks,
sliding windows, chunked prefills, requests finishing and rows reused), the rows the step reads
equal what a rebuild from scratch out of the engine's own state gives: the block tables, the
sliding windows (and the positions each step writes), the expected tokens and the per-step arrays.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")  # the harness needs both; without them these tests skip
pytest.importorskip("transformers")

from tests.test_transformers_harness import cb, cpu_swap_pool_unpinned, greedy, hybrid, llama, prompts

from kvcanary_cupy.integrations.transformers import EngineCanary, watch

NEW = 16


def page_row(blocks: list, end: int, block_size: int, width: int) -> np.ndarray:
    """A full group's row from scratch: page ``b + 1`` per block, page 0 for a page read but missing."""
    need = min(-(-end // block_size), width)
    pages = [b + 1 for b in blocks[:width]]
    return np.array(pages + [0] * max(need - len(pages), 0), dtype=np.int32)


def token_row(state, end: int) -> np.ndarray:
    """The expected tokens of positions ``0 .. end - 1`` from scratch: prompt, generated, -1 if not known yet."""
    known = (state.initial_tokens + state.generated_tokens)[:end]
    return np.array(known + [-1] * (end - len(known)), dtype=np.int32)


def step_mismatches(eng) -> list:
    """Every way the tables of the step ``eng`` just prepared differ from a rebuild (empty: none)."""
    batch = eng.io.requests_in_batch
    out = []
    n = len(batch)
    rows = eng.steps.host["rows"][:n].tolist()
    states = [fs.state for fs in batch]
    ends = [st.position_offset for st in states]
    pre = [e - fs.query_length for e, fs in zip(ends, batch)]
    if eng.steps.host["prefix"][:n].tolist() != pre or eng.steps.host["valid"][:n].tolist() != ends:
        out.append(("step arrays", eng.step))
    if len(set(rows)) != n or 0 in rows:
        out.append(("rows", eng.step, rows))
    for row, st, end in zip(rows, states, ends):
        if not np.array_equal(eng.expected.table.host[row, :end], token_row(st, end)):
            out.append(("expected tokens", eng.step, st.request_id))
    for g in eng.groups:
        bs, width = eng.slot_map.block_size, g.table.width
        for row, st, p, end in zip(rows, states, pre, ends):
            rid, got = st.request_id, g.table.host[row]
            if g.sliding:
                lo, hi = max(p - g.window, 0), min(end, width)  # the window before p, and what the step writes
                want = np.zeros(width, dtype=np.int32)
                if hi > lo:
                    want[lo:hi] = g.slots_of(rid, np.arange(lo, hi))
                ok = np.array_equal(got, want)
            else:
                want = page_row(list(g.blocks(rid)), end, bs, width)
                ok = np.array_equal(got[:len(want)], want)
            if not ok:
                out.append((g.kind, eng.step, rid))
        slots = [int(s) for s in g.step_slots(np.array(pre, dtype=np.int64))]
        if slots != [int(g.slots_of(st.request_id, np.array([p]))[0]) for st, p in zip(states, pre)]:
            out.append(("step slots", g.kind, eng.step))
    return out


@pytest.fixture
def checked(monkeypatch):
    """Check every step's tables right after the adapter filled them; yields the mismatches found."""
    found = {"mismatches": [], "steps": 0}
    fill = EngineCanary.before_step

    def before_step(eng):
        fill(eng)
        if eng.io.requests_in_batch:
            found["steps"] += 1
            found["mismatches"] += step_mismatches(eng)

    monkeypatch.setattr(EngineCanary, "before_step", before_step)
    yield found


def run(model, inputs, config, gen=None, **opts):
    with watch(model, policy="raise", **opts) as w:
        out = model.generate_batch(inputs, generation_config=gen or greedy(NEW), continuous_batching_config=config)
    assert all(r.error is None for r in out.values())
    return w.stats()


def test_prefix_sharing_offload_and_finishing_requests(checked):
    inputs = prompts(32, seed=31, shared=16, families=4, min_len=3, max_len=30)
    with cpu_swap_pool_unpinned():
        stats = run(llama(), inputs, cb(num_blocks=40, cpu_offload_space=0.001))
    assert checked["mismatches"] == [] and checked["steps"] > NEW
    assert stats["offloaded_requests"] > 0 and stats["restored_requests"] > 0 and stats["violations"] == 0
    assert stats["slots_written"] < sum(map(len, inputs)) + len(inputs) * (NEW - 1)  # prefix hits


def test_soft_resets(checked):
    inputs = prompts(16, seed=32, min_len=10, max_len=18)
    stats = run(llama(), inputs, cb(num_blocks=24, cpu_offload_space=0.0, allow_block_sharing=False))
    assert checked["mismatches"] == [] and stats["violations"] == 0
    assert stats["slots_written"] > sum(map(len, inputs)) + len(inputs) * (NEW - 1)  # re-prefills


def test_sliding_windows_chunked_prefill_and_offload(checked):
    inputs = prompts(16, seed=33, min_len=10, max_len=40)
    with cpu_swap_pool_unpinned():
        stats = run(hybrid(), inputs, cb(num_blocks=30, cpu_offload_space=0.001, max_batch_tokens=32))
    assert checked["mismatches"] == [] and stats["violations"] == 0
    assert stats["offloaded_requests"] > 0
    assert {g["type"] for g in stats["engines"][0]["groups"].values()} == {"full_attention", "sliding_attention"}


def test_forks(checked):
    from transformers import GenerationConfig  # noqa: PLC0415

    gen = GenerationConfig(max_new_tokens=12, do_sample=True, top_k=1, num_return_sequences=3, eos_token_id=-1,
                           pad_token_id=0)
    stats = run(llama(), prompts(6, seed=34, min_len=10, max_len=30, shared=16, families=2), cb(), gen=gen)
    assert checked["mismatches"] == [] and stats["forked_blocks"] > 0 and stats["violations"] == 0


def test_a_block_list_changed_in_place_is_in_the_next_steps_table(checked):
    # An engine (or a fault) that rewrites a request's list in place, same length: the adapter
    # compares whole lists, so the row follows, whatever it held before.
    model = llama()
    state = {"done": False}

    def swap_first_two(eng):
        for blocks in eng.groups[0].allocator.block_table.values():
            if len(blocks) >= 2 and not state["done"]:
                blocks[0], blocks[1] = blocks[1], blocks[0]
                state["done"] = True

    fill = EngineCanary.before_step

    def before_step(eng):
        if eng.step == 6:
            swap_first_two(eng)
        fill(eng)

    found = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineCanary, "before_step", before_step)
        with watch(model, policy=found.extend):
            model.generate_batch(prompts(8, seed=35, min_len=17, max_len=30), generation_config=greedy(NEW),
                                 continuous_batching_config=cb())
    assert state["done"] and found  # the swapped pages were read and caught
    assert checked["mismatches"] == []
