"""A toy attention decode loop over a paged KV cache in PyTorch, with the canary inside
a CUDA graph.

The engine part is plain PyTorch: a K/V pool ``[layers, slots, heads, dim]`` in fp16,
a token-level ``req_to_token`` table, persistent per-step input buffers, one decode
step (write the new token's K/V, attend over the request's slots, pick the next
token). The canary part is four calls: ``bind_inputs`` once, ``before_forward`` /
``after_forward`` around the model inside the captured graph, ``poll`` after each
replay. After a few steps a stray write flips one byte of a cached K vector; the
fingerprint check catches it and names the request.

    python examples/torch_decode_loop.py                # CUDA: capture once, refill in place, replay
    python examples/torch_decode_loop.py --device cpu   # the same loop, eager, NumPy backend
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

import kvcanary_cupy as kc

HEADS, DIM, VOCAB = 2, 16, 97
BATCH, MAX_LEN, PROMPT = 4, 48, 5
NUM_SLOTS = 1 + BATCH * MAX_LEN  # slot 0: padding


class ToyEngine:
    """A paged KV cache, its table, the step's input buffers and a one-layer toy model."""

    def __init__(self, device: str, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        dev = torch.device(device)
        self.dev = dev
        self.emb = (torch.randn(VOCAB, HEADS * DIM, generator=g) / math.sqrt(DIM)).half().to(dev)
        self.k = torch.zeros(1, NUM_SLOTS, HEADS, DIM, dtype=torch.float16, device=dev)
        self.v = torch.zeros_like(self.k)
        self.req_to_token = torch.zeros(BATCH + 1, MAX_LEN, dtype=torch.int32, device=dev)
        # The allocator: a shuffled slot for every (request, position), as a paged pool hands them out.
        self.slot_of = (torch.randperm(NUM_SLOTS - 1, generator=g) + 1).view(BATCH, MAX_LEN).to(dev)
        self.rows = torch.arange(1, BATCH + 1, device=dev)
        # Persistent per-step inputs (what a graph runner refills in place).
        self.rpi = self.rows.clone()
        self.pre = torch.zeros(BATCH, dtype=torch.int64, device=dev)
        self.ext = torch.ones(BATCH, dtype=torch.int64, device=dev)
        self.ids = torch.zeros(BATCH, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(BATCH, dtype=torch.int64, device=dev)
        self.loc = torch.zeros(BATCH, dtype=torch.int64, device=dev)
        self.next_ids = torch.zeros(BATCH, dtype=torch.int64, device=dev)
        self.arange = torch.arange(MAX_LEN, device=dev)

    def kv_of(self, ids, pos):
        e = self.emb[ids].float()
        k = (e + 0.01 * pos[:, None].float()).half().view(-1, HEADS, DIM)
        v = (0.5 * e - 0.01 * pos[:, None].float()).half().view(-1, HEADS, DIM)
        return k, v

    def prefill(self, mon, prompts):
        """Eager: write every prompt token's K/V, with per-call inputs."""
        n = prompts.shape[1]
        pos = torch.arange(n, device=self.dev).repeat(BATCH)
        loc = self.slot_of[:, :n].reshape(-1)
        self.req_to_token[1:, :n] = self.slot_of[:, :n].to(torch.int32)
        mon.before_forward(self.rows, torch.zeros(BATCH, dtype=torch.int64, device=self.dev),
                           torch.full((BATCH,), n, dtype=torch.int64, device=self.dev),
                           request_ids=[f"req-{i}" for i in range(BATCH)])
        k, v = self.kv_of(prompts.reshape(-1), pos)
        self.k[0].index_copy_(0, loc, k)
        self.v[0].index_copy_(0, loc, v)
        mon.after_forward(prompts.reshape(-1), pos, loc)
        self.ids.copy_(prompts[:, -1])  # toy: the first decode input is the last prompt token
        self.pos.fill_(n)
        self.pre.fill_(n)
        self._place()

    def _place(self):
        """Give this step's tokens their slots (device ops only: no host sync)."""
        self.loc.copy_(self.slot_of[torch.arange(BATCH, device=self.dev), self.pos])
        self.req_to_token[self.rows, self.pos] = self.loc.to(torch.int32)

    def forward(self):
        """The model: store the new K/V, attend over each request's slots, pick the next token."""
        k, v = self.kv_of(self.ids, self.pos)
        self.k[0].index_copy_(0, self.loc, k)
        self.v[0].index_copy_(0, self.loc, v)
        slots = self.req_to_token[self.rpi].long()  # [B, MAX_LEN]
        K, V = self.k[0][slots].float(), self.v[0][slots].float()  # [B, MAX_LEN, H, D]
        q = self.emb[self.ids].float().view(BATCH, HEADS, DIM)
        scores = torch.einsum("bhd,blhd->bhl", q, K) / math.sqrt(DIM)
        mask = self.arange[None, :] <= self.pos[:, None]
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        out = torch.einsum("bhl,blhd->bhd", torch.softmax(scores, -1), V)
        self.next_ids.copy_((out.reshape(BATCH, -1) @ self.emb.float().T).argmax(-1))

    def advance(self):
        """Refill the step's inputs in place for the next decode step."""
        self.ids.copy_(self.next_ids)
        self.pos += 1
        self.pre += 1
        self._place()


def decode_step(eng, mon, stream=None):
    mon.before_forward(batch_size=BATCH, stream=stream)
    eng.forward()
    mon.after_forward(num_tokens=BATCH, stream=stream)


def print_incidents(mon) -> None:
    """Each incident once: every later step that reads the broken slot finds it again, and the
    monitor folds those rows into one incident (first step, rows, last step)."""
    for incident in mon.incidents:
        print("caught:", incident)


def run(device: str, steps: int = 12, inject_at: int = 5) -> int:
    cuda = device.startswith("cuda")
    eng = ToyEngine(device)
    names = [f"req-{i}" for i in range(BATCH)]
    nbytes = HEADS * DIM * 2
    mon = kc.KvCanary(
        num_slots=NUM_SLOTS, req_to_token=eng.req_to_token, max_batch=BATCH, device="cuda" if cuda else "cpu",
        real_kv=[kc.RealKvSource(eng.k, bytes_per_token=nbytes, layer_axis=True),
                 kc.RealKvSource(eng.v, bytes_per_token=nbytes, layer_axis=True)],
        real_kv_mode=kc.RealKvMode.ALL, verify_capacity="max", policy=lambda found: None)
    mon.bind_inputs(req_pool_indices=eng.rpi, prefix_lens=eng.pre, extend_lens=eng.ext, input_ids=eng.ids,
                    positions=eng.pos, out_cache_loc=eng.loc)
    prompts = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1)).to(eng.dev)
    eng.prefill(mon, prompts)

    replay = None
    if cuda:
        # Warm up on a side stream (compiles every kernel), then capture one decode step. Inside
        # warmup() the write's position check is off and what warm-up finds is discarded after.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with mon.warmup(stream=side):
            with torch.cuda.stream(side):
                for _ in range(2):  # the same first decode step, twice: idempotent
                    decode_step(eng, mon, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode_step(eng, mon, stream=torch.cuda.current_stream())
        eng.advance()

        def replay():
            graph.replay()
            mon.note_step(request_ids=names)

    found, injected = [], None
    for t in range(steps):
        if replay is not None:
            replay()
        else:
            mon.before_forward(batch_size=BATCH, request_ids=names)
            eng.forward()
            mon.after_forward(num_tokens=BATCH)
        new = mon.poll(stream=torch.cuda.current_stream() if cuda else None)
        if new and injected is None:
            print(f"kvcanary: {len(new)} violation(s) on a clean step:", *new, sep="\n  ")
            return 1
        found += new
        if t == inject_at:
            # A stray write: one byte of request 2's cached K at position 1 flips.
            slot = int(eng.req_to_token[3, 1])
            eng.k.view(torch.uint8)[0, slot, 0, 0] ^= 0x20
            injected = (t, slot)
            print(f"step {t}: flipped one K byte of slot {slot} (req-2, position 1)")
        eng.advance()
    if cuda:
        torch.cuda.synchronize()
    found += mon.poll() + (mon.poll() if cuda else [])
    print_incidents(mon)
    ok = bool(found) and all(v.request == "req-2" and v.slot == injected[1] and kc.FailReason.REAL_KV in v.reasons
                             for v in found)
    s = mon.stats()
    kind = " (graph replays)" if cuda else ""
    print(f"{s['steps']} steps{kind}, {s['slots_checked']} records checked, {s['slots_written']} written: "
          f"{'fault caught' if ok else 'FAULT MISSED'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (graph capture) or cpu (eager, NumPy backend)")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    return run(args.device, steps=args.steps)


if __name__ == "__main__":
    sys.exit(main())
