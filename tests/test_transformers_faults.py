"""Faults injected through the engine's own state (never through the canary) are caught no
later than 2 steps after the first step that reads them, and attributed to the right request.

Every fault goes in after a step's update, from the engine's generation thread, into the
structures the engine itself reads: a request's block table, the free-block list, the prefix
cache's hash table, the key/value cache tensors, the CPU swap pool.
"""
from __future__ import annotations

import functools

import pytest

pytest.importorskip("torch")  # the harness needs both; without them these tests skip
pytest.importorskip("transformers")

from tests.test_transformers_harness import (assert_caught, cb, corrupt_host_copy, cpu_swap_pool_unpinned, drive,
                                             flip_kv_bytes, greedy, hybrid, llama, prompts, steal_block,
                                             swap_block_table_entries, wrong_prefix_hit)

from kvcanary_cupy import FailReason
from kvcanary_cupy.integrations.transformers import watch

NEW = 24


def run(model, inject, *, inputs=None, config=None, **opts):
    found = []
    with watch(model, policy=found.extend, **opts) as w:
        d = drive(model, inputs or prompts(16, seed=1, min_len=10, max_len=20), gen=greedy(NEW),
                  config=config or cb(), max_new_tokens=NEW, inject=inject)
    assert len(d.results) == len(d.request_ids)  # the engine went on to the end
    # The policy saw each incident once: the first row of each request, group, slot and reasons.
    first = {}
    for v in w.violations:
        first.setdefault((v.request_id, v.group, v.violation.slot, int(v.reasons)), v)
    assert found == list(first.values())
    return d, w.violations


def reasons(found, rid) -> FailReason:
    out = FailReason(0)
    for v in found:
        if v.request_id == rid:
            out |= v.reasons
    return out


def test_swapped_block_table_entries():
    d, found = run(llama(), swap_block_table_entries)
    assert_caught(d, found)
    assert FailReason.POSITION in reasons(found, d.victim)


def test_block_freed_in_use_then_taken():
    d, found = run(llama(), steal_block, config=cb(allow_block_sharing=False))
    assert_caught(d, found)
    assert reasons(found, d.victim) & (FailReason.TOKEN | FailReason.CHAIN | FailReason.POSITION)


def test_prefix_lookup_returns_another_prefix():
    d, found = run(llama(), wrong_prefix_hit, inputs=prompts(16, seed=2, shared=16, families=4, min_len=4))
    assert_caught(d, found)
    assert FailReason.TOKEN in reasons(found, d.victim)


@pytest.mark.parametrize("value", [False, True], ids=["key", "value"])
def test_flipped_kv_bytes(value):
    d, found = run(llama(), functools.partial(flip_kv_bytes, value=value))
    assert_caught(d, found)
    assert reasons(found, d.victim) == FailReason.REAL_KV
    assert {v.engine_row for v in found} == {d.detail["row"]}


def flip_engine_row_zero(bp, d):
    """Bytes flipped in engine cache row 0 (block 0, offset 0: a live slot) while a request reads it."""
    from tests.test_transformers_harness import holders, running  # noqa: PLC0415

    rid = running(bp)
    if rid is None or 0 not in bp.cache.group_cache_managers[0].block_table[rid]:
        return None
    bp.cache.key_cache[1][0].view(-1)[0] += 1.0
    d.detail.update(affected=holders(bp, 0))
    return rid


def test_engine_row_zero_is_watched_fingerprints_included():
    # The canary reserves its slot 0; the engine's row 0 holds a real token. The shift maps it
    # to a real canary slot, and the fingerprints follow it (last layer's keys here).
    d, found = run(llama(), flip_engine_row_zero)
    assert_caught(d, found)
    assert {(v.engine_row, v.position, v.reasons) for v in found} == {(0, 0, FailReason.REAL_KV)}


def test_host_copy_corrupted_while_offloaded():
    with cpu_swap_pool_unpinned():
        d, found = run(llama(), corrupt_host_copy, config=cb(num_blocks=20, cpu_offload_space=0.001))
    assert_caught(d, found)
    assert FailReason.REAL_KV in reasons(found, d.victim)


def test_host_copy_corrupted_sampled_fingerprints_caught_at_restore():
    # With sampled fingerprints the restore sweeps every fingerprint of the restored blocks.
    with cpu_swap_pool_unpinned():
        d, found = run(llama(), corrupt_host_copy, config=cb(num_blocks=20, cpu_offload_space=0.001),
                       fingerprint_sample_period=7)
    step = assert_caught(d, found, within=0)
    assert any(v.launch == "sweep" and v.step == step for v in found)


@pytest.mark.parametrize("fault", ["swap", "flip"])
def test_sliding_window_group_faults(fault):
    inject = (functools.partial(swap_block_table_entries, group=1) if fault == "swap"
              else functools.partial(flip_kv_bytes, group=1))
    d, found = run(hybrid(), inject, inputs=prompts(12, seed=3, min_len=14, max_len=24), config=cb(max_batch_tokens=32))
    assert_caught(d, found)
    assert {v.group_type for v in found if v.request_id == d.victim} == {"sliding_attention"}
