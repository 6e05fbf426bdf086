"""The vLLM connector's worker-side host time per decode step on a GPU, in vLLM's GPU shapes.

    python -m bench.vllm_gpu_host [--batches 1,8,32] [--context 4096] [--steps 64] [--json PATH]

A GPU vLLM engine is stood in for by ``tests/vllm_flash_worker.py`` (vLLM's configs and
per-step metadata, a flash-attention pool of a Llama-3-8B's shape: 32 layers, 8 KV heads of
128, bf16, blocks of 16), so the connector's own worker side runs as in vLLM's GPU worker:
the metadata's rows named (one device-to-host copy), the tables staged, the CUDA checks
launched. Per batch size, ``--context``-token prompts are prefilled, then ``--steps``
decode steps are taken; reported are medians over the decode steps of the connector's
host time (``start_load_kv`` + ``wait_for_save``) and of that, naming the rows (the
device is idle when each step starts, as after vLLM's sampler sync). The canary kernels'
device time is the main bench's (``python -m bench``). Needs CuPy with a CUDA device and
PyTorch with CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench.connector_runs import run_batches, timed_calls


def run(batch: int, context: int, steps: int, device: str = "cuda:0") -> dict:
    import torch  # noqa: PLC0415

    import kvcanary_cupy.integrations.vllm.worker_side as ws  # noqa: PLC0415
    from tests.vllm_flash_worker import FlashWorker  # noqa: PLC0415

    bs = 16
    width = -(-(context + steps + 1) // bs)
    eng = FlashWorker(device=device, layers=32, kv_heads=8, head_dim=128, block_size=bs,
                      num_blocks=batch * width + 2, max_num_seqs=batch, max_num_batched_tokens=batch * context,
                      max_model_len=width * bs, dtype=torch.bfloat16, seed=batch)
    naming = [0.0]
    # The row naming's share of the host time: reading the keys, then matching them.
    with timed_calls(eng.worker.row_keys, ("read",), naming), timed_calls(ws, ("match_rows",), naming):
        for i in range(batch):
            eng.add(f"r{i}", eng.prompt(context))
        eng.step()  # the prefill
        rows = []
        for _ in range(steps):
            h0, n0 = eng.worker.host_seconds, naming[0]
            if device != "cpu":
                torch.cuda.synchronize()
            found = eng.step()
            assert not found, found
            rows.append((eng.worker.host_seconds - h0, naming[0] - n0))
    warm = rows[4:] or rows  # the first steps of a batch size prepare the monitor's calls
    med = lambda i: statistics.median(r[i] for r in warm) * 1e6  # noqa: E731
    stats = eng.worker.stats()
    eng.worker.close()
    return {"batch": batch, "context": context, "decode_steps": len(warm), "connector_host_us": med(0),
            "row_naming_us": med(1), "violations": stats["violations"],
            "slots_checked": stats["slots_checked"], "slots_read": stats["slots_read"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_gpu_host", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import cupy  # noqa: PLC0415
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available() or cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001  (no GPU here: one line, no traceback)
        print(f"kvcanary: bench.vllm_gpu_host: needs CuPy and PyTorch with a CUDA device: {type(e).__name__}: {e}"
              .splitlines()[0], file=sys.stderr)
        return 2
    return run_batches(args.batches, lambda b: run(b, args.context, args.steps), _line, args.json)


def _line(r: dict) -> str:
    return (f"batch {r['batch']:>3} (context {r['context']}): connector host {r['connector_host_us']:7.1f} us per "
            f"decode step, of which row naming {r['row_naming_us']:6.1f} us; {r['decode_steps']} steps, "
            f"{r['violations']} violations, {r['slots_checked']} of {r['slots_read']} read slots checked")


if __name__ == "__main__":
    sys.exit(main())
