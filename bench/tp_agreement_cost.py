"""Device µs a decode step gains from tensor-parallel agreement (digest + all_gather + compare), on 2 GPUs.

Each rank builds two identical monitors over the same slot table and pool, one with
``process_group=`` and one without, captures one decode step of each in a CUDA graph
(``before_forward`` + ``after_forward``, bound buffers: the monitor's whole device work,
no model), and replays the two graphs in alternating batches, timed with CUDA events.
The difference of the per-replay medians is what the agreement costs a step on the
device (the NCCL collective included, and any skew between the ranks it absorbs);
target <= 15 µs. The collective alone (16 bytes per rank, in a graph of its own) is
printed beside it. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).

    torchrun --nproc-per-node 2 -m bench.tp_agreement_cost      (from the top of a checkout)
    python -m bench.tp_agreement_cost                           (spawns the 2 ranks itself)

Options: ``--batch`` rows per step, ``--context`` cached tokens per row (the verify plan
holds batch x context entries, which the digest covers), ``--replays`` per batch,
``--batches``, ``--json PATH``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

TARGET_US = 15.0


def _graph(torch, fn):
    """fn() captured in a CUDA graph, after two eager runs on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    return g


def _time(torch, graph, replays: int) -> float:
    """µs per replay of ``graph`` over ``replays`` back-to-back replays (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / replays


def measure(args) -> dict:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import kvcanary_cupy as kc  # noqa: PLC0415

    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device(f"cuda:{local}")
    torch.cuda.set_device(dev)
    B, C = args.batch, args.context
    width = C + 8
    num_slots = 1 + B * width
    table = torch.zeros(B + 1, width, dtype=torch.int32, device=dev)
    table[1:] = (1 + torch.arange(B * width, device=dev, dtype=torch.int32)).view(B, width)
    pool = torch.zeros(2, num_slots, 64, dtype=torch.uint8, device=dev)
    rows = torch.arange(1, B + 1, device=dev)

    def monitor(pg):
        return kc.KvCanary(num_slots=num_slots, req_to_token=table, max_batch=B, device=f"cuda:{local}",
                           real_kv=kc.RealKvSource(pool, bytes_per_token=64, layer_axis=True),
                           verify_capacity="max", policy=lambda found: None, process_group=pg)

    # The decode step both monitors run: every row reads its C cached tokens and writes token C.
    rpi, pre, ext = rows.clone(), torch.full((B,), C, dtype=torch.int64, device=dev), torch.ones(B, dtype=torch.int64,
                                                                                                   device=dev)
    ids = (rows * 7 + C).to(torch.int64)
    pos = torch.full((B,), C, dtype=torch.int64, device=dev)
    loc = table[1:, C].to(torch.int64)
    mons = {"plain": monitor(None), "agree": monitor(dist.group.WORLD)}
    graphs = {}
    for name, mon in mons.items():
        prefill_ids = (rows[:, None] * 1000 + torch.arange(C, device=dev)).reshape(-1)
        mon.before_forward(rows, torch.zeros(B, dtype=torch.int64, device=dev),
                           torch.full((B,), C, dtype=torch.int64, device=dev))
        mon.after_forward(prefill_ids, torch.arange(C, device=dev).repeat(B), table[1:, :C].reshape(-1).to(torch.int64))
        mon.bind_inputs(req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, input_ids=ids, positions=pos,
                        out_cache_loc=loc)

        def step(mon=mon):
            s = torch.cuda.current_stream()
            mon.before_forward(batch_size=B, stream=s)
            mon.after_forward(num_tokens=B, stream=s)

        graphs[name] = _graph(torch, step)
    send = torch.zeros(2, dtype=torch.int64, device=dev)
    recv = torch.zeros(2 * world, dtype=torch.int64, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    graphs["collective"] = _graph(torch, lambda: gather(recv, send))

    times = {name: [] for name in graphs}
    for name, g in graphs.items():  # warm the replays up
        _time(torch, g, 50)
    for _ in range(args.batches):
        for name, g in graphs.items():
            times[name].append(_time(torch, g, args.replays))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    found = sum(len(m.poll()) for m in mons.values())  # on a GPU a poll returns the previous poll's copy
    torch.cuda.synchronize()
    found += sum(len(m.poll()) for m in mons.values())
    return {"rank": rank, "step_plain_us": med["plain"], "step_agree_us": med["agree"],
            "agreement_us": med["agree"] - med["plain"], "collective_us": med["collective"],
            "violations": found, "batch": B, "context": C, "verify_entries": B * C}


def _rank_main(args) -> int:
    import torch.distributed as dist  # noqa: PLC0415

    res = measure(args)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if res["rank"] == 0:
        for r in everyone:
            print(f"rank {r['rank']}: step {r['step_plain_us']:.1f} us without agreement, {r['step_agree_us']:.1f} us "
                  f"with: agreement adds {r['agreement_us']:.1f} us (the collective alone {r['collective_us']:.1f} us)")
        worst = max(r["agreement_us"] for r in everyone)
        ok = worst <= TARGET_US and not any(r["violations"] for r in everyone)
        print(f"tp agreement: {worst:.1f} us per step on {len(everyone)} GPUs, batch {args.batch} x context "
              f"{args.context} ({args.batch * args.context} verify entries digested); target <= {TARGET_US:.0f} us: "
              f"{'met' if ok else 'MISSED'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": everyone, "agreement_us": worst, "target_us": TARGET_US, "met": ok}, f, indent=2)
        return 0 if ok else 1
    return 0


def _spawned(rank, world, init, args, codes):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    os.environ["LOCAL_RANK"] = str(rank)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        codes[rank] = _rank_main(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=500)
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not run under torchrun")
    ap.add_argument("--json", help="write the figures here (rank 0)")
    args = ap.parse_args(argv)
    if min(args.batch, args.context, args.replays, args.batches, args.nproc) < 1:
        ap.error("kvcanary: --batch, --context, --replays, --batches and --nproc must be >= 1")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    need = 1 if "RANK" in os.environ else args.nproc  # under torchrun each rank needs its own device
    try:
        import torch  # noqa: PLC0415
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise
        print(f"kvcanary: bench.tp_agreement_cost: needs PyTorch with CUDA and {need} CUDA devices: PyTorch is not "
              "installed (pip install -e '.[torch]', a CUDA build)", file=sys.stderr)
        return 2
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < need:
        print(f"kvcanary: bench.tp_agreement_cost: needs {need} CUDA devices, PyTorch {torch.__version__} sees "
              f"{seen}; it measures NCCL between GPUs and has no CPU mode", file=sys.stderr)
        return 2
    import torch.distributed as dist  # noqa: PLC0415

    if "RANK" in os.environ:  # torchrun
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        try:
            return _rank_main(args)
        finally:
            dist.destroy_process_group()
    import torch.multiprocessing as mp  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-") as tmp:
        codes = mp.get_context("spawn").Manager().dict()
        mp.start_processes(_spawned, args=(args.nproc, f"file://{tmp}/rendezvous", args, codes), nprocs=args.nproc,
                           start_method="spawn")
        return max(codes.values()) if codes else 1


if __name__ == "__main__":
    sys.exit(main())
