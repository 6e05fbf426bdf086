"""Two tensor-parallel ranks whose canaries agree every step, over torch.distributed.

Each rank runs the same decode loop over its own share of the attention heads: the same
scheduler decisions (slot table, batch, tokens), its own K/V bytes. The monitor is made with
``process_group=``: at the end of every step the ranks digest, on the device, what they
planned and wrote (verify entries, plan scalars, write plan, write inputs) and compare the
digests with one small collective (16 bytes per rank). The K/V fingerprints stay rank-local:
each rank holds other heads. After a few clean steps rank 1's scheduler writes one slot-table
entry the other rank never sees; both ranks report it in the same step, naming rank 1.

    torchrun --nproc-per-node 2 examples/tp_agreement.py               # 2 GPUs, NCCL
    torchrun --nproc-per-node 2 examples/tp_agreement.py --graph       # the step in a CUDA graph
    torchrun --nproc-per-node 2 examples/tp_agreement.py --device cpu  # CPUs, gloo
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import kvcanary_cupy as kc

HEADS, DIM = 2, 16  # per rank
BATCH, MAX_LEN, PROMPT = 4, 32, 6
NUM_SLOTS = 1 + BATCH * MAX_LEN  # slot 0: padding


class Rank:
    """This rank's share of a paged KV cache, its slot table and the step's input buffers."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.dev = rank, device
        g = torch.Generator().manual_seed(0)  # the scheduler's decisions: the same on every rank
        self.slot_of = (torch.randperm(NUM_SLOTS - 1, generator=g) + 1).view(BATCH, MAX_LEN).to(device)
        self.req_to_token = torch.zeros(BATCH + 1, MAX_LEN, dtype=torch.int32, device=device)
        self.k = torch.zeros(1, NUM_SLOTS, HEADS, DIM, dtype=torch.float16, device=device)
        self.v = torch.zeros_like(self.k)
        self.rows = torch.arange(1, BATCH + 1, device=device)
        # Persistent per-step inputs, refilled in place (what a graph runner does).
        self.rpi = self.rows.clone()
        self.pre = torch.zeros(BATCH, dtype=torch.int64, device=device)
        self.ext = torch.ones(BATCH, dtype=torch.int64, device=device)
        self.ids = torch.zeros(BATCH, dtype=torch.int64, device=device)
        self.pos = torch.zeros(BATCH, dtype=torch.int64, device=device)
        self.loc = torch.zeros(BATCH, dtype=torch.int64, device=device)
        self.b = torch.arange(BATCH, device=device)

    def kv_of(self, ids, pos):
        """This rank's heads for each token: other ranks hold other numbers."""
        base = (ids * 31 + pos * 7 + 1000 * self.rank).float()
        j = torch.arange(HEADS * DIM, device=ids.device).float()
        k = torch.sin(base[:, None] * 0.01 + j).half().view(-1, HEADS, DIM)
        return k, (k * 0.5).half()

    def prefill(self, mon):
        ids = (self.rows[:, None] * 100 + torch.arange(PROMPT, device=self.dev)).reshape(-1)
        pos = torch.arange(PROMPT, device=self.dev).repeat(BATCH)
        loc = self.slot_of[:, :PROMPT].reshape(-1)
        self.req_to_token[1:, :PROMPT] = self.slot_of[:, :PROMPT].to(torch.int32)
        mon.before_forward(self.rows, torch.zeros(BATCH, dtype=torch.int64, device=self.dev),
                           torch.full((BATCH,), PROMPT, dtype=torch.int64, device=self.dev))
        k, v = self.kv_of(ids, pos)
        self.k[0].index_copy_(0, loc, k)
        self.v[0].index_copy_(0, loc, v)
        mon.after_forward(ids, pos, loc)
        self.ids.copy_(ids.view(BATCH, PROMPT)[:, -1] + 1)
        self.pos.fill_(PROMPT)
        self.pre.fill_(PROMPT)
        self.place()

    def place(self):
        """Give this step's tokens their slots (device ops only)."""
        self.loc.copy_(self.slot_of[self.b, self.pos])
        self.req_to_token[self.rows, self.pos] = self.loc.to(torch.int32)

    def forward(self):
        """The model's store of the step's K/V (attention itself is beside the point here)."""
        k, v = self.kv_of(self.ids, self.pos)
        self.k[0].index_copy_(0, self.loc, k)
        self.v[0].index_copy_(0, self.loc, v)

    def advance(self):
        self.ids.add_(1)
        self.pos.add_(1)
        self.pre.add_(1)
        self.place()


def step(eng, mon, stream=None):
    mon.before_forward(batch_size=BATCH, stream=stream)
    eng.forward()
    mon.after_forward(num_tokens=BATCH, stream=stream)


def run(device: str, graph: bool, steps: int, inject_at: int) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device != "cpu"
    dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    eng = Rank(rank, dev)
    nbytes = HEADS * DIM * 2
    mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=eng.req_to_token, max_batch=BATCH,
                      device=f"cuda:{dev.index}" if cuda else "cpu",
                      real_kv=[kc.RealKvSource(eng.k, bytes_per_token=nbytes, layer_axis=True),
                               kc.RealKvSource(eng.v, bytes_per_token=nbytes, layer_axis=True)],
                      verify_capacity="max", policy=lambda found: None, process_group=dist.group.WORLD)
    mon.bind_inputs(req_pool_indices=eng.rpi, prefix_lens=eng.pre, extend_lens=eng.ext, input_ids=eng.ids,
                    positions=eng.pos, out_cache_loc=eng.loc)
    eng.prefill(mon)
    poll_stream = torch.cuda.current_stream() if cuda else None

    run_step = lambda: step(eng, mon)  # noqa: E731
    if graph:
        # Warm up on a side stream (compiles the kernels, uploads the digest's table, starts NCCL), then
        # capture one decode step, the agreement's collective included. Every rank does the same.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with mon.warmup(stream=side):
            with torch.cuda.stream(side):
                for _ in range(2):
                    step(eng, mon, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                step(eng, mon, stream=torch.cuda.current_stream())

        def run_step():
            g.replay()
            mon.note_step()

    seen, first = [], None
    for t in range(steps):
        if t == inject_at and rank == 1:
            # Rank 1's scheduler repoints request 2's position 1; rank 0's table never hears of it.
            eng.req_to_token[2, 1] = eng.slot_of[3, MAX_LEN - 1].to(torch.int32)
            print(f"[rank {rank}] step {t}: slot-table entry (request 2, position 1) changed on this rank only",
                  flush=True)
        run_step()
        found = mon.poll(stream=poll_stream)
        if cuda and t == steps - 1:
            torch.cuda.synchronize()
            found += mon.poll(stream=poll_stream)
        div = [v for v in found if kc.FailReason.RANK_DIVERGENCE in v.reasons]
        if found and t < inject_at:
            print(f"[rank {rank}] violations on a clean step:", *found, sep="\n  ", flush=True)
            return 1
        if div and first is None:
            first = div[0]
            print(f"[rank {rank}] caught: {first}", flush=True)
        seen += found
        eng.advance()
    s = mon.stats()
    steps_seen = [None] * world
    dist.all_gather_object(steps_seen, None if first is None else (first.agreement_step, first.rank))
    ok = all(x is not None and x == steps_seen[0] and x[1] == 1 for x in steps_seen)
    print(f"[rank {rank}] {s['agreement_steps']} steps agreed over {world} ranks, {s['divergences']} divergence(s), "
          f"{s['group_violations']} violation row(s) in the group", flush=True)
    if rank == 0:
        when = f"agreement step {steps_seen[0][0]}" if ok else f"{steps_seen}"
        print(f"{'both ranks reported rank 1 in the same step' if ok else 'DIVERGENCE MISSED'} ({when})", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (NCCL, one GPU per rank) or cpu (gloo)")
    ap.add_argument("--graph", action="store_true", help="CUDA only: capture the decode step in a CUDA graph")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--inject-at", type=int, default=5)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        print("run it with torchrun: torchrun --nproc-per-node 2 examples/tp_agreement.py [--device cpu]",
              file=sys.stderr)
        return 2
    cuda = args.device != "cpu"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    if args.graph and not cuda:
        print("--graph needs CUDA", file=sys.stderr)
        return 2
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return run(args.device, args.graph, args.steps, args.inject_at)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
