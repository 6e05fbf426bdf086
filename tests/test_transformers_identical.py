"""Generation is unchanged under watch(): greedy outputs are token-identical with and without
the canary, and the watched run is clean, on the engine's main paths (CPU).

Each case also checks that the path it names was taken: prefix-cache hits (fewer slots
written than tokens processed), CPU offload and restore, soft resets (more slots written:
re-prefills), sliding-window groups.
"""
from __future__ import annotations

import functools

import pytest

pytest.importorskip("torch")  # the harness needs both; without them these tests skip
pytest.importorskip("transformers")

from tests.test_transformers_harness import (all_sliding, cb, cpu_swap_pool_unpinned, generate_both, hybrid,
                                             llama, prompts, tokens_processed)

from kvcanary_cupy.integrations.transformers import watch

NEW = 24


generate = functools.partial(generate_both, new=NEW)


def test_prefix_sharing_identical():
    inputs = prompts(24, shared=24, families=3, seed=1)
    ref, out, stats, found = generate(llama(), inputs, cb())
    assert out == ref and len(out) == 24
    assert found == [] and stats["violations"] == 0
    assert stats["slots_written"] < tokens_processed(inputs, new=NEW)  # prefix hits skipped writes
    (engine,) = stats["engines"]
    assert engine["fingerprints"] and engine["groups"][0]["type"] == "full_attention"


@pytest.mark.parametrize("make, blocks", [(llama, 24), (hybrid, 30)], ids=["full", "full+sliding"])
def test_cpu_offload_identical(make, blocks):
    inputs = prompts(16, seed=2, min_len=10, max_len=30 if make is hybrid else 18)
    with cpu_swap_pool_unpinned():
        ref, out, stats, found = generate(make(), inputs, cb(num_blocks=blocks, cpu_offload_space=0.001,
                                                             max_batch_tokens=32 if make is hybrid else 64))
    assert out == ref and found == []
    assert stats["offloaded_requests"] > 0 and stats["restored_requests"] > 0


def test_soft_reset_identical():
    inputs = prompts(16, seed=3, min_len=10, max_len=18)
    ref, out, stats, found = generate(llama(), inputs, cb(num_blocks=24, cpu_offload_space=0.0,
                                                          allow_block_sharing=False))
    assert out == ref and found == []
    assert stats["offloaded_requests"] == 0
    assert stats["slots_written"] > tokens_processed(inputs, new=NEW)  # soft-reset requests were prefilled again


@pytest.mark.parametrize("make", [hybrid, all_sliding], ids=["full+sliding", "sliding-only"])
def test_sliding_window_identical(make):
    # Prompts longer than the window (12) and than a prefill chunk (max_batch_tokens 32): the
    # first tokens of a chunk go to the engine's trash slot.
    inputs = prompts(12, seed=4, min_len=4, max_len=40)
    ref, out, stats, found = generate(make(), inputs, cb(max_batch_tokens=32))
    assert out == ref and found == []
    assert stats["input_errors"] == 0 and stats["overflows"] == 0
    groups = stats["engines"][0]["groups"].values()
    assert "sliding_attention" in {g["type"] for g in groups}
    assert all(g["slots_checked"] > 0 and g["slots_written"] > 0 for g in groups)


def test_long_prompts_in_chunks_identical():
    # Prompts of 300+ tokens: prefilled in chunks of max_batch_tokens, past the expected-token
    # table's first width (it widens), with a shared 200-token prefix.
    inputs = prompts(6, seed=8, shared=200, families=2, min_len=100, max_len=140)
    ref, out, stats, found = generate(llama(), inputs, cb(num_blocks=160, max_batch_tokens=128))
    assert out == ref and found == []
    assert stats["slots_written"] < tokens_processed(inputs, new=NEW)


def test_forked_sequences_identical():
    # num_return_sequences forks each request after its prefill: the engine copies the blocks
    # it cannot share, and their records move with them. top_k=1 keeps the sampling greedy.
    from transformers import GenerationConfig  # noqa: PLC0415

    gen = GenerationConfig(max_new_tokens=12, do_sample=True, top_k=1, num_return_sequences=3, eos_token_id=-1,
                           pad_token_id=0)
    model, inputs = llama(), prompts(6, seed=6, min_len=10, max_len=30, shared=16, families=2)
    ref = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb())
    with watch(model) as w:
        out = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb())
    assert {k: r.generated_tokens for k, r in out.items()} == {k: r.generated_tokens for k, r in ref.items()}
    stats = w.stats()
    assert stats["forked_blocks"] > 0 and stats["violations"] == 0


def test_sampled_fingerprints_and_verify_after_identical():
    inputs = prompts(16, seed=5, shared=16, families=2)
    with cpu_swap_pool_unpinned():
        ref, out, stats, found = generate(llama(), inputs, cb(num_blocks=24, cpu_offload_space=0.001),
                                          fingerprint_sample_period=3, verify_after=True)
    assert out == ref and found == []
    assert stats["restored_requests"] > 0 and stats["swept_records"] > 0
