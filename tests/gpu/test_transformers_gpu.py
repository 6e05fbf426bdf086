"""The transformers adapter on CUDA: the CPU suite's checks with the model and its cache on the
GPU, the engine's CPU offload as shipped (pinned swap pool), and the engine's CUDA graphs on.

Token-identical greedy outputs with and without the canary (prefix sharing, forced offload,
soft resets, sliding-window layers, CUDA graphs, flash attention's decode fast path when
installed); clean runs of 64 requests; each fault caught within 2 steps of the first step that
reads it and attributed to its request; the cancel policy. Skipped without a CUDA device.
"""
from __future__ import annotations

import functools

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA device", allow_module_level=True)

from tests.test_transformers_harness import (all_sliding, assert_caught, cb, corrupt_host_copy, drive,  # noqa: E402
                                             flip_kv_bytes, generate_both, greedy, hybrid, llama, prompts,
                                             steal_block, swap_block_table_entries, tokens_processed,
                                             wrong_prefix_hit)

from kvcanary_cupy import FailReason  # noqa: E402
from kvcanary_cupy.integrations.transformers import watch  # noqa: E402

NEW = 24
CUDA = "cuda"
GRAPHS = dict(use_cuda_graph=True, use_async_batching=False)


generate = functools.partial(generate_both, new=NEW, device=CUDA)


# --------------------------------------------------------------------------- generation unchanged
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_prefix_sharing_identical(graphs):
    inputs = prompts(24, shared=24, families=3, seed=1)
    ref, out, stats, found = generate(llama(device=CUDA), inputs, cb(**(GRAPHS if graphs else {})))
    assert out == ref and found == []
    assert stats["slots_written"] < tokens_processed(inputs, new=NEW)
    (engine,) = stats["engines"]
    assert engine["fingerprints"]


@pytest.mark.parametrize("make, blocks", [(llama, 24), (hybrid, 30)], ids=["full", "full+sliding"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_cpu_offload_as_shipped_identical(make, blocks, graphs):
    inputs = prompts(16, seed=2, min_len=10, max_len=30 if make is hybrid else 18)
    ref, out, stats, found = generate(make(device=CUDA), inputs,
                                      cb(num_blocks=blocks, cpu_offload_space=0.001,
                                         max_batch_tokens=32 if make is hybrid else 64, **(GRAPHS if graphs else {})))
    assert out == ref and found == []
    assert stats["offloaded_requests"] > 0 and stats["restored_requests"] > 0


def test_soft_reset_identical():
    inputs = prompts(16, seed=3, min_len=10, max_len=18)
    ref, out, stats, found = generate(llama(device=CUDA), inputs,
                                      cb(num_blocks=24, cpu_offload_space=0.0, allow_block_sharing=False))
    assert out == ref and found == [] and stats["slots_written"] > tokens_processed(inputs, new=NEW)


@pytest.mark.parametrize("make", [hybrid, all_sliding], ids=["full+sliding", "sliding-only"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_sliding_window_identical(make, graphs):
    inputs = prompts(12, seed=4, min_len=4, max_len=40)
    ref, out, stats, found = generate(make(device=CUDA), inputs, cb(max_batch_tokens=32, **(GRAPHS if graphs else {})))
    assert out == ref and found == []
    groups = stats["engines"][0]["groups"].values()
    assert "sliding_attention" in {g["type"] for g in groups} and all(g["slots_checked"] > 0 for g in groups)


def test_flash_attention_decode_fast_path_identical():
    pytest.importorskip("flash_attn")
    model = llama(device=CUDA, dtype=torch.bfloat16)
    model.set_attn_implementation("flash_attention_2")
    inputs = prompts(16, seed=5, shared=16, families=2)
    ref, out, stats, found = generate(model, inputs, cb(block_size=256, num_blocks=16, max_batch_tokens=256,
                                                        **GRAPHS))
    assert out == ref and found == [] and stats["steps"] > 0


def test_sampled_fingerprints_identical_and_restores_swept():
    inputs = prompts(16, seed=6, shared=16, families=2)
    ref, out, stats, found = generate(llama(device=CUDA), inputs, cb(num_blocks=24, cpu_offload_space=0.001),
                                      fingerprint_sample_period=3, verify_after=True)
    assert out == ref and found == [] and stats["swept_records"] > 0


def test_64_requests_prefix_sharing_and_offload_clean():
    model = llama(device=CUDA)
    inputs = prompts(64, seed=21, shared=16, families=8, min_len=3, max_len=20)
    with watch(model, policy="raise") as w:
        out = model.generate_batch(inputs, generation_config=greedy(16),
                                   continuous_batching_config=cb(num_blocks=48, cpu_offload_space=0.001))
    assert len(out) == 64 and all(r.error is None for r in out.values())
    stats = w.stats()
    assert stats["violations"] == 0 and stats["logged"] == 0 and stats["offloaded_requests"] > 0
    assert stats["updates_skipped"] == 0 and stats["slots_written"] > 0


# --------------------------------------------------------------------------- faults
def run_fault(model, inject, *, inputs=None, config=None, **opts):
    found = []
    with watch(model, policy=found.extend, **opts):
        d = drive(model, inputs or prompts(16, seed=1, min_len=10, max_len=20), gen=greedy(NEW),
                  config=config or cb(), max_new_tokens=NEW, inject=inject)
    assert len(d.results) == len(d.request_ids)
    return d, found


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("fault", ["swap", "steal", "prefix", "flip-key", "flip-value"])
def test_faults_caught_within_two_steps(fault, graphs):
    inject = {"swap": swap_block_table_entries, "steal": steal_block, "prefix": wrong_prefix_hit,
              "flip-key": flip_kv_bytes, "flip-value": functools.partial(flip_kv_bytes, value=True)}[fault]
    kw = dict(allow_block_sharing=False) if fault == "steal" else {}
    inputs = prompts(16, seed=2, shared=16, families=4, min_len=4) if fault == "prefix" else None
    d, found = run_fault(llama(device=CUDA), inject, inputs=inputs, config=cb(**kw, **(GRAPHS if graphs else {})))
    assert_caught(d, found)


def test_host_copy_corrupted_in_the_pinned_pool():
    d, found = run_fault(llama(device=CUDA), corrupt_host_copy, config=cb(num_blocks=20, cpu_offload_space=0.001))
    assert_caught(d, found)
    assert any(FailReason.REAL_KV in v.reasons for v in found if v.request_id == d.victim)


@pytest.mark.parametrize("fault", ["swap", "flip"])
def test_sliding_window_group_faults(fault):
    inject = (functools.partial(swap_block_table_entries, group=1) if fault == "swap"
              else functools.partial(flip_kv_bytes, group=1))
    d, found = run_fault(hybrid(device=CUDA), inject, inputs=prompts(12, seed=3, min_len=14, max_len=24),
                         config=cb(max_batch_tokens=32))
    assert_caught(d, found)


def test_cancel_policy_fails_only_the_victim():
    model = llama(device=CUDA)
    inputs = prompts(12, seed=7, min_len=10, max_len=20)
    ref = drive(model, inputs, gen=greedy(20), config=cb(), max_new_tokens=20).tokens()
    with watch(model, policy="cancel") as w:
        d = drive(model, inputs, gen=greedy(20), config=cb(), max_new_tokens=20, inject=swap_block_table_entries)
    assert d.results[d.victim].error.startswith(f"kvcanary: request {d.victim!r} cancelled")
    assert {k: v for k, v in d.tokens().items() if k != d.victim} == {k: v for k, v in ref.items() if k != d.victim}
    assert w.stats()["cancelled"] == 1
