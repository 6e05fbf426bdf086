"""Hugging Face transformers' continuous batching with a KvCanary on every step.

A small Llama with random weights (no download) generates greedily for a batch of prompts
with ``model.generate_batch``, first as shipped, then inside ``watch(model)``: the outputs
are token-identical and the canary's stats show what it checked. Then a manager runs the
same prompts under ``policy="cancel"`` while a stray write flips bytes in the key cache of
one request: the canary catches it at the next step, the engine cancels that request with
an error naming the violation, and the other requests complete unchanged.

    python examples/transformers_generate.py               # CUDA when PyTorch sees a GPU
    python examples/transformers_generate.py --device cpu  # the same on the CPU (NumPy backend)

Needs ``pip install -e '.[transformers]'`` (transformers 5.17.0, torch, psutil); on a GPU,
also the CuPy extra that matches the driver (``.[cuda12]`` or ``.[cuda13]``).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvcanary_cupy.integrations.transformers import watch


def build(device: str, seed: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval().to(device)


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 256) for _ in range(32)]  # a shared prefix: the prefix cache reuses its blocks
    return [system + [rng.randrange(1, 256) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def flip_key_bytes(processor):
    """The stray write: flip bytes of the first key slot of one decoding request (engine state only)."""
    for rid, blocks in processor.cache.group_cache_managers[0].block_table.items():
        state = processor.scheduler.active_requests.get(rid)
        if state is not None and state.generated_len() >= 2 and state.generated_len() + 3 < state.max_new_tokens:
            row = blocks[-1] * processor.cache.block_size  # a block no other request shares
            with torch.no_grad():
                processor.cache.key_cache[0][row].view(torch.uint8).reshape(-1)[:8] ^= 0xA5
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return rid
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = build(args.device, args.seed)
    prompts = make_prompts(args.requests, args.seed)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(block_size=16, num_blocks=256, max_batch_tokens=256)

    ref = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config)
    t0 = time.perf_counter()
    with watch(model) as w:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config)
    took = time.perf_counter() - t0
    for rid in list(out)[:4]:
        print(f"{rid}: {out[rid].generated_tokens}")
    same = all(out[k].generated_tokens == ref[k].generated_tokens for k in ref)
    print(f"token-identical with and without the canary: {same} ({len(out)} requests, {took:.2f} s watched)")
    s = w.stats()
    print(f"canary: {s['steps']} steps, {s['slots_checked']} slots verified, {s['slots_written']} stamped, "
          f"{s['violations']} violations, {s['host_us_per_step']:.0f} us host time per step")
    if not same or s["violations"]:
        return 1

    # A stray write into the KV cache, caught and contained by the cancel policy.
    with watch(model, policy="cancel") as w:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
        manager.warmup()  # builds the engine (and attaches the canary) here
        processor, hit = manager.batch_processor, []
        update = processor.update_batch

        def update_batch():  # the engine's own update, then (once) the fault
            update()
            if not hit:
                rid = flip_key_bytes(processor)
                if rid is not None:
                    hit.append(rid)

        processor.update_batch = update_batch
        manager.start()
        ids = manager.add_requests(prompts, max_new_tokens=args.new_tokens)
        results = {}
        while len(results) < len(ids) and manager.is_running():
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
        manager.stop(block=True)
    failed = {k: r.error for k, r in results.items() if r.error}
    print(f"fault: key bytes flipped in a slot of request {hit[0]!r}")
    for k, err in failed.items():
        print(f"{k} failed: {err}")
    fine = sum(results[k].generated_tokens == ref[k].generated_tokens for k in results if k not in failed)
    print(f"the other {len(results) - len(failed)} requests completed, {fine} token-identical to the clean run")
    print(f"canary: {w.stats()['violations']} violation(s), {w.stats()['cancelled']} request(s) cancelled")
    return 0 if list(failed) == hit and fine == len(results) - len(failed) else 1


if __name__ == "__main__":
    sys.exit(main())
