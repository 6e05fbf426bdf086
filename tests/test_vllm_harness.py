"""Shared harness of the vLLM connector's tests: a tiny random Llama served by vLLM's real
in-process engine (CPU), driven step by step, and fault injectors that act on vLLM's own
bookkeeping and KV tensors, never on the canary.

The other ``test_vllm_*`` files import it as ``tests.test_vllm_harness``; its own tests
check the harness. Everything skips where vLLM is not installed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import tempfile

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvcanary_cupy.integrations.vllm import kv_transfer_config  # noqa: E402

BLOCK = 32  # the CPU backend's blocks must be a multiple of 32; 32 gives prefix hits on short prompts
_ROOT = tempfile.mkdtemp(prefix="kvcanary-vllm-")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_ROOT, "vllm-cache"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_ROOT, "inductor"))
_MODEL = None


def model_dir() -> str:
    """A random 2-layer Llama (head_dim 32, 2 KV heads), saved once per process."""
    global _MODEL
    if _MODEL is None:
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024)
        _MODEL = os.path.join(_ROOT, "llama")
        LlamaForCausalLM(cfg).save_pretrained(_MODEL)
    return _MODEL


def make_llm(*, connector: bool = True, kv_bytes: int = 64 << 20, max_num_seqs: int = 16,
             max_num_batched_tokens: int = 256, max_model_len: int = 1024, **options):
    """vLLM's ``LLM`` over the tiny model, in process, eager, on the CPU; with the connector
    (``kv_transfer_config(**options)``) unless ``connector=False``."""
    from vllm import LLM  # noqa: PLC0415

    kw = dict(kv_transfer_config=kv_transfer_config(**options)) if connector else {}
    with _llvmlite_hidden():
        return LLM(model_dir(), skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=kv_bytes,
                   block_size=BLOCK, distributed_executor_backend="uni", dtype="float32", async_scheduling=False,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                   max_model_len=max_model_len, enable_chunked_prefill=True, seed=0, **kw)


@contextlib.contextmanager
def _llvmlite_hidden():
    """vLLM 0.32's CPU worker, as it starts, scans the globals of every module in ``sys.modules``
    and fails on llvmlite's library object (whose ``__getattr__`` answers even ``__dict__``).
    llvmlite is loaded once an engine's connector has run on the numba backend, so a later
    engine of this process would not start: its module stays out of ``sys.modules`` (loaded,
    and in use, all the same) while an engine starts."""
    import sys  # noqa: PLC0415

    hidden = sys.modules.pop("llvmlite.binding.ffi", None)
    try:
        yield
    finally:
        if hidden is not None:
            sys.modules["llvmlite.binding.ffi"] = hidden


def close(llm) -> None:
    """Shut the engine down, and the process-wide connector with it (a later engine makes its own)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown  # noqa: PLC0415

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    gc.collect()


def connector():
    """The worker's connector of the engine alive now."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

    return get_kv_transfer_group()


def core(llm):
    """vLLM's engine core (scheduler and executor) of ``llm``."""
    return llm.llm_engine.engine_core.engine_core


def runner(llm):
    """The worker's model runner (its input batch: the block table attention reads)."""
    return core(llm).model_executor.driver_worker.worker.model_runner


def prompts(n: int, *, seed: int = 0, min_len: int = 20, max_len: int = 120, shared: int = 0, families: int = 1,
            vocab: int = 256) -> list[list[int]]:
    """``n`` random prompts; with ``shared``, prompt i starts with family ``i % families``'s
    ``shared``-token prefix (its complete blocks are prefix-cache hits)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, vocab) for _ in range(shared)] for _ in range(families)]
    return [heads[i % families] + [rng.randrange(1, vocab) for _ in range(rng.randint(min_len, max_len))]
            for i in range(n)]


@dataclasses.dataclass
class Run:
    """A driven run: tokens per request id (the ids given), which failed, the steps taken."""

    tokens: dict
    failed: set
    steps: int
    ids: dict  # given id -> the scheduler's request id


def drive(llm, inputs: list, *, new: int = 16, inject=None, arrivals: dict | None = None, max_steps: int = 2000) -> Run:
    """Run ``inputs`` greedily, ``new`` tokens each, one engine step at a time.

    ``arrivals``: {step: [indices]} added at that step (the rest at step 0).
    ``inject(step, llm, run)``: called before each step, on vLLM's own state.
    """
    from vllm import SamplingParams  # noqa: PLC0415

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    arrivals = arrivals or {}
    later = {i for idx in arrivals.values() for i in idx}
    run = Run(tokens={}, failed=set(), steps=0, ids={})

    def add(i):
        rid = f"r{i}"
        run.ids[rid] = engine.add_request(rid, {"prompt_token_ids": list(inputs[i])}, params) or rid
    for i in range(len(inputs)):
        if i not in later:
            add(i)
    step = 0
    while step < max_steps:
        for i in arrivals.get(step, ()):
            add(i)
        if inject is not None:
            inject(step, llm, run)
        if not engine.has_unfinished_requests() and all(s < step for s in arrivals):
            break
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                run.tokens[out.request_id] = list(c.token_ids)
                if c.finish_reason not in ("length", "stop"):
                    run.failed.add(out.request_id)
        step += 1
    run.steps = step
    return run


def scheduler_id(llm, given: str) -> str:
    """The scheduler's id of the request added as ``given`` (vLLM may suffix it)."""
    reqs = core(llm).scheduler.requests
    if given in reqs:
        return given
    return next(r for r in reqs if r.startswith(given + "-") or r.split("-")[0] == given)


def running_with_blocks(llm, min_blocks: int = 3, exclude=()) -> str | None:
    """A running request with at least ``min_blocks`` computed blocks (decoding), else None."""
    sched = core(llm).scheduler
    for req in sched.running:
        if req.request_id in exclude:
            continue
        if req.num_computed_tokens >= min_blocks * BLOCK and req.num_computed_tokens >= req.num_prompt_tokens:
            return req.request_id
    return None


def req_blocks(llm, rid: str) -> list:
    """The scheduler's KVCacheBlock list of ``rid`` (group 0)."""
    return core(llm).scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[rid]


def swap_blocks(llm, rid: str, i: int = 0, j: int = 1) -> tuple:
    """Swap entries ``i`` and ``j`` of ``rid``'s blocks in the scheduler's bookkeeping and in the
    worker's block table (what attention reads); returns the two block ids."""
    blocks = req_blocks(llm, rid)
    blocks[i], blocks[j] = blocks[j], blocks[i]
    ib = runner(llm).input_batch
    row = ib.req_id_to_index[rid]
    bt = ib.block_table[0].block_table.np
    bt[row, i], bt[row, j] = bt[row, j], bt[row, i]
    state = runner(llm).requests[rid]
    ids = state.block_ids[0]
    ids[i], ids[j] = ids[j], ids[i]
    return blocks[i].block_id, blocks[j].block_id


def free_block_for_next_request(llm, rid: str, index: int = 0):
    """Hand block ``index`` of running ``rid`` to the next allocation while ``rid`` still holds
    it (a use-after-free in the block pool); returns the block. Call :func:`rebalance` with it
    once the next request took it, so the pool's reference counts stay whole."""
    pool = core(llm).scheduler.kv_cache_manager.block_pool
    block = req_blocks(llm, rid)[index]
    block.ref_cnt = 0
    pool.free_block_queue.prepend_n([block])
    return block


def rebalance(block) -> None:
    """The block now has two holders: the request it was freed under and the one it went to."""
    block.ref_cnt = 2


def flip_kv(llm, rid: str, *, layer: int = -1, position: int = 5, value: bool = False) -> int:
    """Change the first sampled K (or V) element of ``rid``'s ``position`` in ``layer``'s KV tensor,
    where the CPU backend keeps it (the connector's learned layout); returns the slot."""
    conn = connector()
    fp = conn.worker.groups[0].canary.fingerprints
    blocks = req_blocks(llm, rid)
    slot = blocks[position // BLOCK].block_id * BLOCK + position % BLOCK
    names = conn.worker.groups[0].layers
    kv = runner(llm).kv_caches[layer] if hasattr(runner(llm), "kv_caches") else None
    if kv is None or isinstance(kv, dict):
        kv = runner(llm).compilation_config.static_forward_context[names[layer]].kv_cache[0]
    flat = kv.view(-1)
    off = fp._offsets[slot % BLOCK, fp.width if value else 0]
    flat[slot // BLOCK * fp.block_elems + off] += 1.0
    return slot


def test_prompts_share_prefixes_by_family():
    p = prompts(4, shared=40, families=2)
    assert p[0][:40] == p[2][:40] and p[0][:40] != p[1][:40]
