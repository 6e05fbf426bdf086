"""Shared harness of the transformers adapter's tests: tiny random models, configs, a
step-by-step driven engine and fault injectors that act on the engine's own state.

The other ``test_transformers_*`` files (and ``tests/gpu/test_transformers_gpu.py``)
import it as ``tests.test_transformers_harness``; its own tests check the harness.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import transformers.generation.continuous_batching.offloading_manager as offloading_module  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=1024)


def llama(seed: int = 0, device: str = "cpu", dtype=None, **overrides):
    """A random-initialized 2-layer Llama (all full attention: prefix sharing on)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()
    return model.to(device=device, dtype=dtype or torch.float32)


def hybrid(seed: int = 0, window: int = 12, device: str = "cpu", dtype=None):
    """A random Qwen2 with one full-attention and one sliding-window layer (two layer groups)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    cfg = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=window,
                      layer_types=["full_attention", "sliding_attention"])
    return Qwen2ForCausalLM(cfg).eval().to(device=device, dtype=dtype or torch.float32)


def all_sliding(seed: int = 0, window: int = 12, device: str = "cpu", dtype=None):
    """A random Mistral whose every layer has a sliding window (sliding-window groups only)."""
    from transformers import MistralConfig, MistralForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**TINY, sliding_window=window)).eval().to(device=device,
                                                                                     dtype=dtype or torch.float32)


def greedy(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb(**kw) -> ContinuousBatchingConfig:
    """A small continuous-batching config (block size 8; override anything)."""
    base = dict(block_size=8, num_blocks=64, max_batch_tokens=64)
    return ContinuousBatchingConfig(**{**base, **kw})


def prompts(n: int, *, seed: int = 0, min_len: int = 5, max_len: int = 30, shared: int = 0, families: int = 1,
            vocab: int = 128) -> list[list[int]]:
    """``n`` random prompts; with ``shared``, request i starts with the ``shared``-token prefix of
    family ``i % families`` (complete blocks of it are shared by the prefix cache)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, vocab) for _ in range(shared)] for _ in range(families)]
    return [heads[i % families] + [rng.randrange(1, vocab) for _ in range(rng.randint(min_len, max_len))]
            for i in range(n)]


@contextlib.contextmanager
def cpu_swap_pool_unpinned():
    """Let the engine's CPU swap pool work on CPU-only torch: it asks for pinned memory, which
    needs an accelerator. Only the pool's allocation loses ``pin_memory``."""

    class NoPin:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, pin_memory=False, **kwargs):
            return torch.empty(*args, **kwargs)

    saved = offloading_module.torch
    offloading_module.torch = NoPin()
    try:
        yield
    finally:
        offloading_module.torch = saved


@dataclasses.dataclass
class Drive:
    """What :func:`drive` observed: each step's batch (request ids), the results, the injection."""

    batches: list = dataclasses.field(default_factory=list)
    results: dict = dataclasses.field(default_factory=dict)
    request_ids: list = dataclasses.field(default_factory=list)
    injected_at: int | None = None  # the step after whose update the fault went in
    victim: object = None
    detail: dict = dataclasses.field(default_factory=dict)

    def first_read(self, rid, after: int) -> int | None:
        """The first step after ``after`` whose batch holds ``rid``."""
        return next((s for s, ids in enumerate(self.batches, 1) if s > after and rid in ids), None)

    def tokens(self) -> dict:
        return {rid: r.generated_tokens for rid, r in self.results.items()}


def drive(model, inputs, *, gen, config, max_new_tokens: int, inject=None, timeout: float = 120.0) -> Drive:
    """Run ``inputs`` through a manager made inside the current watch, step by step.

    ``inject(processor, drive)``, if given, is called after each step's update until it
    returns a request id (the victim), and records the step. Returns the :class:`Drive`.
    """
    d = Drive()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    manager.warmup()  # builds the batch processor (and so attaches the canary) in this thread
    bp = manager.batch_processor
    zero_cache(bp)
    inner = bp.update_batch

    def update_batch():
        ids = [fs.state.request_id for fs in bp.inputs_and_outputs.requests_in_batch]
        out = inner()
        d.batches.append(ids)
        if inject is not None and d.injected_at is None:
            victim = inject(bp, d)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the fault lands before the engine's next step, whichever stream reads it
            if victim is not None:
                d.injected_at, d.victim = len(d.batches), victim
        return out

    bp.update_batch = update_batch
    manager.start()
    try:
        d.request_ids = manager.add_requests(inputs, max_new_tokens=max_new_tokens)
        deadline = time.monotonic() + timeout
        while len(d.results) < len(d.request_ids) and time.monotonic() < deadline:
            r = manager.get_result(timeout=0.5)
            if r is not None and r.is_finished():
                d.results[r.request_id] = r
            elif r is None and not manager.is_running():
                break
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    return d


def zero_cache(bp) -> None:
    """Zero the engine's KV cache before its first step. The engine allocates it uninitialized, so it
    may hold NaN; a fault that makes one request attend over rows nothing wrote would then turn the
    whole packed batch to NaN (masked-out rows still enter the product: 0 * NaN), and whether the
    other requests' outputs survive would depend on the process's allocation history."""
    with torch.no_grad():
        for t in (*bp.cache.key_cache, *bp.cache.value_cache):
            t.zero_()


def reference(model, inputs, *, gen, config) -> dict:
    """Greedy outputs of ``generate_batch`` without any watch: request id -> tokens."""
    out = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=config)
    return {rid: r.generated_tokens for rid, r in out.items()}


def generate_both(model, inputs, config, *, new: int, **opts):
    """``generate_batch`` without, then with, the watch (``opts`` go to ``watch``):
    (reference tokens, watched tokens, watch stats, violations); no watched request failed."""
    from kvcanary_cupy.integrations.transformers import watch  # noqa: PLC0415

    ref = reference(model, inputs, gen=greedy(new), config=config)
    with watch(model, **opts) as w:
        out = model.generate_batch(inputs, generation_config=greedy(new), continuous_batching_config=config)
    assert all(r.error is None for r in out.values())
    return ref, {k: r.generated_tokens for k, r in out.items()}, w.stats(), w.violations


def tokens_processed(inputs, *, new: int) -> int:
    """Tokens the engine writes without any prefix hit or re-prefill (the last new token is never written)."""
    return sum(len(p) for p in inputs) + len(inputs) * (new - 1)


# --------------------------------------------------------------------------- faults
def running(bp, *, min_blocks: int = 1, group: int = 0, unshared: bool = False, decoding: bool = True):
    """A live request id holding at least ``min_blocks`` blocks in ``group`` (optionally none shared)."""
    from transformers.generation.continuous_batching.requests import RequestStatus  # noqa: PLC0415

    cache = bp.cache
    cm = cache.group_cache_managers[group]
    for rid, state in bp.scheduler.active_requests.items():
        blocks = cm.block_table.get(rid, [])
        if len(blocks) < min_blocks or (decoding and state.status != RequestStatus.DECODING):
            continue
        if state.generated_len() + 3 > state._new_tokens_limit:  # it must read again
            continue
        if unshared and any(b in cache._block_manager._id_to_block
                            and cache._block_manager._id_to_block[b].ref_count > 1 for b in blocks):
            continue
        return rid
    return None


def holders(bp, block: int, group: int = 0) -> set:
    """Live requests whose block table in ``group`` holds ``block``."""
    return {rid for rid, blocks in bp.cache.group_cache_managers[group].block_table.items() if block in blocks}


def swap_block_table_entries(bp, d: Drive, group: int = 0):
    """Two entries of a running request's block table swapped."""
    rid = running(bp, min_blocks=2, group=group)
    if rid is not None:
        table = bp.cache.group_cache_managers[group].block_table[rid]
        table[0], table[1] = table[1], table[0]
        d.detail["affected"] = {rid}
    return rid


def flip_kv_bytes(bp, d: Drive, *, value: bool = False, group: int = 0):
    """Bytes flipped in the key (or value) cache, in a slot a running request reads next step:
    position 0 in a full-attention group, the latest position in a sliding-window group."""
    rid = running(bp, min_blocks=1, group=group)
    if rid is None:
        return None
    cache = bp.cache
    cm = cache.group_cache_managers[group]
    blocks, bs = cm.block_table[rid], cache.block_size
    if hasattr(cm, "sliding_window"):
        ring = (bp.scheduler.active_requests[rid].position_offset - 1) % cm.sliding_window
        block, row = blocks[ring // bs], blocks[ring // bs] * bs + ring % bs
    else:
        block, row = blocks[0], blocks[0] * bs
    t = (cache.value_cache if value else cache.key_cache)[0]
    with torch.no_grad():
        t[row].view(torch.uint8).reshape(-1)[:4] ^= 0x5A
    d.detail.update(row=row, affected=holders(bp, block, group))
    return rid


def steal_block(bp, d: Drive):
    """A block freed while a running request still uses it: it goes back to the free list,
    first in line, and the next allocation (another request's) takes it."""
    rid = running(bp, min_blocks=2, unshared=True)
    if rid is not None and bp.scheduler.waiting_requests:
        block = bp.cache.group_cache_managers[0].block_table[rid][0]
        bp.cache._block_manager._uninit_block_ids.appendleft(block)
        d.detail.update(block=block, affected={rid})
        return rid
    return None


def wrong_prefix_hit(bp, d: Drive):
    """The prefix cache answers a waiting request's first block with another prefix's block."""
    bm = bp.cache._block_manager
    bs = bp.cache.block_size
    complete = [b for b in bm._id_to_block.values() if b.is_complete and b.parent_id is None]
    for rid in list(bp.scheduler.waiting_requests):
        state = bp.scheduler.waiting_requests[rid]
        toks = state.remaining_prefill_tokens
        if len(toks) < 2 * bs or not complete:
            continue
        h = bm.compute_hash(None, toks[:bs], group_id=0)
        if h in bm._hash_to_id:
            continue  # a real hit
        bm._hash_to_id[h] = complete[0].id
        same = {r for r, st in bp.scheduler.waiting_requests.items() if st.remaining_prefill_tokens[:bs] == toks[:bs]}
        d.detail.update(block=complete[0].id, affected=same)
        return rid
    return None


def corrupt_host_copy(bp, d: Drive):
    """A block corrupted in its host copy while its request is offloaded."""
    om = bp.offloading_manager
    for rid, cpu_blocks in om._request_id_to_cpu_blocks.items():
        if cpu_blocks:
            with torch.no_grad():
                om._cpu_key_cache[0][cpu_blocks[0], 0].view(torch.uint8).reshape(-1)[:4] ^= 0x5A
            d.detail.update(cpu_block=cpu_blocks[0], affected={rid})
            return rid
    return None


def assert_caught(d: Drive, found: list, *, within: int = 2) -> int:
    """The fault was caught no later than ``within`` steps after the first step that read the
    victim again, and the earliest violations name only requests the fault touched, the victim
    among them. Returns the detection step."""
    assert d.victim is not None, "the fault was never injected"
    first = d.first_read(d.victim, d.injected_at)
    assert first is not None, "the victim never ran again"
    mine = [v for v in found if v.request_id == d.victim]
    assert mine, f"nothing reported for {d.victim}; found {[str(v) for v in found[:3]]}"
    step = min(v.step for v in mine)
    assert step <= first + within, (step, first)
    earliest = min(v.step for v in found)
    named = {v.request_id for v in found if v.step == earliest}
    assert d.victim in named and named <= d.detail["affected"], (named, d.detail)
    return step


# --------------------------------------------------------------------------- the harness's own tests
def test_prompts_share_prefixes_by_family():
    p = prompts(6, shared=16, families=2, seed=3)
    assert p[0][:16] == p[2][:16] == p[4][:16] and p[1][:16] == p[3][:16] and p[0][:16] != p[1][:16]


def test_unpinned_swap_pool_allocates_on_cpu():
    with cpu_swap_pool_unpinned():
        assert offloading_module.torch.empty((2, 3), dtype=torch.float32, pin_memory=True).shape == (2, 3)
    assert offloading_module.torch is torch
