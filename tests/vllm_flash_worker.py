"""The vLLM connector's worker side as a GPU vLLM worker drives it, without vLLM.

vLLM's GPU engine is not installed where the GPU tests run, so this stands in for the
parts of it the worker side reads: a ``VllmConfig`` and ``KVCacheConfig`` of one
full-attention group of ``FLASH_ATTN`` layers, the layers' KV tensors in that backend's
shape (``[2, num_blocks, block_size, kv_heads, head_dim]``), and per step the connector
metadata and the forward context's attention metadata (an int32 block table padded to
the widest row, int32 ``seq_lens`` and ``query_start_loc``, an int64 ``slot_mapping``),
rows in the worker's order (here the scheduler's, reversed). The "model" writes random
K/V at every slot the step maps. Everything else is the connector's own code:
:class:`~kvcanary_cupy.integrations.vllm.worker_side.WorkerSide` with its row naming,
mirror, canaries and policies, on whatever device the tensors live on (``"cpu"``
runs the NumPy reference, ``"cuda:0"`` the CUDA backend).

Used by ``tests/test_vllm_flash_worker.py`` and ``bench/vllm_gpu_host.py``.
"""
from __future__ import annotations

import random
from types import SimpleNamespace


class FullAttentionSpec(SimpleNamespace):
    """A stand-in for vLLM's spec class of a full-attention group (the group's type name)."""


class FlashWorker:
    """Requests served step by step through the worker side, vLLM's GPU way.

    Args:
        device: where the KV tensors and the attention metadata live (``"cpu"`` or ``"cuda:N"``).
        layers, kv_heads, head_dim, block_size, num_blocks: the pool (block 0 is vLLM's null block).
        max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits.
        dtype: the KV dtype (a torch dtype).
        seed: the tokens and K/V drawn.
        options: the connector's options (:func:`~kvcanary_cupy.integrations.vllm.kv_transfer_config`'s).
    """

    def __init__(self, *, device: str = "cpu", layers: int = 2, kv_heads: int = 2, head_dim: int = 64,
                 block_size: int = 16, num_blocks: int = 256, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 1024, dtype=None, seed: int = 0,
                 **options):
        import torch  # noqa: PLC0415

        from kvcanary_cupy.integrations.vllm.config import parse_options  # noqa: PLC0415
        from kvcanary_cupy.integrations.vllm.worker_side import WorkerSide  # noqa: PLC0415

        self.torch, self.device, self.bs = torch, device, block_size
        self.rng = random.Random(seed)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        backend = SimpleNamespace(get_name=lambda: "FLASH_ATTN")
        static = {n: SimpleNamespace(attn_backend=backend) for n in self.names}
        cfg = SimpleNamespace(
            speculative_config=None, compilation_config=SimpleNamespace(static_forward_context=static),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            model_config=SimpleNamespace(max_model_len=max_model_len))
        kv_cfg = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=FullAttentionSpec(block_size=block_size), layer_names=self.names)])
        dtype = dtype or torch.float16
        self.kv = {n: torch.zeros((2, num_blocks, block_size, kv_heads, head_dim), dtype=dtype, device=device)
                   for n in self.names}
        # A GPU worker's stand-in: on the CPU its checks stay on the reference (the choice is the
        # process's, and this worker is never closed).
        options.setdefault("cpu_backend", "numpy")
        self.worker = WorkerSide(cfg, kv_cfg, parse_options(options))
        self.worker.register(self.kv)
        self.width = -(-max_model_len // block_size)
        self.free = list(range(1, num_blocks))
        self.requests: dict = {}  # id -> SimpleNamespace(tokens, blocks, computed, sent, new)
        self.finished: set = set()
        self.step_no = 0

    # ------------------------------------------------------------------ requests
    def add(self, rid: str, prompt: list) -> None:
        self.requests[rid] = SimpleNamespace(tokens=list(prompt), blocks=[], computed=0, sent=0, prompt=len(prompt),
                                             new=True)

    def finish(self, rid: str) -> None:
        r = self.requests.pop(rid)
        self.free.extend(r.blocks)
        self.finished.add(rid)

    def prompt(self, n: int) -> list:
        return [self.rng.randrange(1, 30000) for _ in range(n)]

    # ------------------------------------------------------------------ a step
    def step(self, tamper=None) -> list:
        """One step of every live request (its whole prompt first, then one token); ``tamper(md)``
        may change the attention metadata before the worker sees it. Returns the violations found."""
        torch, bs = self.torch, self.bs
        self.step_no += 1
        entries, rows = [], []
        for rid, r in self.requests.items():
            sched = len(r.tokens) - r.computed
            end = r.computed + sched
            fresh = []
            while (len(r.blocks) + len(fresh)) * bs < end:
                fresh.append(self.free.pop(0))
            r.blocks.extend(fresh)
            entries.append(SimpleNamespace(
                request_id=rid, computed=r.computed, scheduled=sched, tokens=r.tokens[r.sent:end],
                blocks=(list(r.blocks),) if r.new else None, new_blocks=None if r.new else (fresh,),
                prompt_len=r.prompt if r.new else 0))
            r.sent, r.new = end, False
            rows.append((rid, r, sched))
        meta = SimpleNamespace(requests=entries, finished=self.finished, preempted=set(), step=self.step_no)
        self.finished = set()
        rows.reverse()  # the worker's order is its own
        bt, seq, qsl, slots = [], [], [0], []
        for _, r, sched in rows:
            bt.append(r.blocks + [0] * (self.width - len(r.blocks)))
            seq.append(r.computed + sched)
            qsl.append(qsl[-1] + sched)
            slots += [r.blocks[p // bs] * bs + p % bs for p in range(r.computed, r.computed + sched)]
        dev = self.device
        md = SimpleNamespace(block_table=torch.tensor(bt, dtype=torch.int32, device=dev),
                             seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
                             slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev))
        if tamper is not None:
            tamper(md)
        n0 = len(self.worker.found)
        self.worker.before_forward(meta, SimpleNamespace(attn_metadata={n: md for n in self.names}))
        self.forward(md.slot_mapping)
        self.worker.after_forward()
        for _, r, sched in rows:
            r.computed += sched
            r.tokens.append(self.rng.randrange(1, 30000))
        return self.worker.found[n0:]

    def forward(self, slot_mapping) -> None:
        """The model's KV writes: random K and V at every mapped slot of every layer."""
        torch = self.torch
        s = slot_mapping.to(torch.int64)
        for t in self.kv.values():
            flat = t.view(2, -1, *t.shape[3:])
            flat[:, s] = torch.randn((2, s.numel(), *t.shape[3:]), generator=self.gen, device=self.device,
                                     dtype=torch.float32).to(t.dtype)

    def block_of(self, rid: str, i: int) -> int:
        return self.requests[rid].blocks[i]
