"""Clean runs of 64 requests, with prefix sharing and offloading, produce no violation."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")  # the harness needs both; without them these tests skip
pytest.importorskip("transformers")

from tests.test_transformers_harness import cb, cpu_swap_pool_unpinned, greedy, hybrid, llama, prompts

from kvcanary_cupy.integrations.transformers import watch

N = 64
NEW = 16


def test_64_requests_prefix_sharing_and_cpu_offload_are_clean():
    model = llama()
    inputs = prompts(N, seed=21, shared=16, families=8, min_len=3, max_len=20)
    with cpu_swap_pool_unpinned(), watch(model, policy="raise") as w:
        out = model.generate_batch(inputs, generation_config=greedy(NEW),
                                   continuous_batching_config=cb(num_blocks=48, cpu_offload_space=0.001))
    assert len(out) == N and all(r.error is None and len(r.generated_tokens) == NEW for r in out.values())
    stats = w.stats()
    assert stats["violations"] == 0 and stats["logged"] == 0 and stats["input_errors"] == 0
    assert stats["offloaded_requests"] > 0 and stats["restored_requests"] > 0
    processed = sum(len(p) for p in inputs) + N * (NEW - 1)
    assert stats["slots_written"] < processed  # prefix hits


def test_64_requests_sliding_window_soft_resets_are_clean():
    model = hybrid()
    inputs = prompts(N, seed=22, shared=16, families=4, min_len=3, max_len=24)
    with watch(model, policy="raise") as w:
        out = model.generate_batch(inputs, generation_config=greedy(NEW),
                                   continuous_batching_config=cb(num_blocks=40, max_batch_tokens=48))
    assert len(out) == N and all(r.error is None for r in out.values())
    stats = w.stats()
    assert stats["violations"] == 0 and stats["logged"] == 0 and stats["input_errors"] == 0
    processed = sum(len(p) for p in inputs) + N * (NEW - 1)
    full, sliding = stats["engines"][0]["groups"].values()
    assert full["slots_written"] == sliding["slots_written"] > processed  # soft resets prefilled requests again
