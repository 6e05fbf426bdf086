"""Decode throughput of transformers' continuous batching with and without the canary.

``model.generate_batch`` on a Llama of hidden size 2048 and 16 layers with random bf16
weights, greedy, at batch 1, 8 and 64: decode tokens/s without and with
``kvcanary_cupy.integrations.transformers.watch``, the median of several runs each
(alternating), the overhead from those medians and as the median of each pair of runs
(a run without, then one with: a drift of the engine's speed over the runs cancels within
a pair; 20 pairs by default, with their quartiles, so that a 1 % overhead stands out of
the run-to-run spread), and the canary's own cost per step: host time (the
watch's hooks, monitor calls included, timed by the watch itself) and its share of a
step without the canary. This engine synchronizes the host with the device every
step, so that host time is added to the step whole: its share is the overhead, free of
the run-to-run noise of the engine's own step. One more watched run per batch, not
counted in the throughput (its wrappers cost host time of their own), splits the host
time into the monitors' own calls and the adapter's (tables, staging, bookkeeping) and
times the span of the canary's work on the engine's compute stream (CUDA events).

    python -m bench.transformers_overhead                       # CUDA (from the top of a checkout)
    python -m bench.transformers_overhead --cuda-graphs         # the engine's CUDA graphs on
    python -m bench.transformers_overhead --device cpu --small  # a dry run of the harness on the CPU

Decode tokens/s comes from the engine's per-token timestamps: tokens produced while
every request of the batch is decoding (after the last prefill, before the first
request finishes), over that window. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

BIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=1024)


def build_model(device: str, small: bool):
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    dtype = torch.float32 if small else torch.bfloat16
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**(SMALL if small else BIG)))
    finally:
        torch.set_default_dtype(saved)
    return model.eval()


def decode_rate(results) -> tuple[float, int]:
    """(decode tokens/s while every request decodes, tokens counted) from the per-token timestamps."""
    stamps = [r.timestamps for r in results.values() if r.timestamps]
    start = max(s[0] for s in stamps)
    end = min(s[-1] for s in stamps)
    n = sum(sum(1 for t in s if start < t <= end) for s in stamps)
    return (n / (end - start) if end > start else 0.0), n


class _Wrapped:
    """Wraps some methods of a class for the length of a ``with`` block (bench instrumentation):
    subclasses name the class and the methods, and say how to wrap one."""

    NAMES: tuple = ()

    @staticmethod
    def owner():
        raise NotImplementedError

    def wrap(self, fn):
        raise NotImplementedError

    def __enter__(self):
        cls = self.owner()
        self._saved = {n: getattr(cls, n) for n in self.NAMES}
        for n, fn in self._saved.items():
            setattr(cls, n, self.wrap(fn))
        return self

    def __exit__(self, *exc):
        cls = self.owner()
        for n, fn in self._saved.items():
            setattr(cls, n, fn)
        return False


class DeviceTimer(_Wrapped):
    """CUDA events around the canary's launches on the engine's compute stream."""

    NAMES = ("before_step", "after_forward", "poll")

    def __init__(self):
        self.pairs = []

    @staticmethod
    def owner():
        from kvcanary_cupy.integrations.transformers.engine import EngineCanary  # noqa: PLC0415

        return EngineCanary

    def wrap(self, fn):
        import torch  # noqa: PLC0415

        def run(eng, *args):
            if eng.stream is None:
                return fn(eng, *args)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(eng.stream)
            try:
                return fn(eng, *args)
            finally:
                b.record(eng.stream)
                self.pairs.append((a, b))
        return run

    def total_ms(self) -> float:
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs)


class HostSplit(_Wrapped):
    """Host time of the monitors' own calls while a run is watched: every monitor call of a run
    comes from the watch's hooks, so the rest of the watch's host time is the adapter's
    (tables, staging, bookkeeping)."""

    NAMES = ("before_forward", "after_forward", "poll", "export_slots", "import_slots", "sweep")

    def __init__(self):
        self.seconds = 0.0

    @staticmethod
    def owner():
        from kvcanary_cupy.monitor import KvCanary  # noqa: PLC0415

        return KvCanary

    def wrap(self, fn):
        def call(mon, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(mon, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return call


def one_run(model, prompts, gen, config, *, canary: bool, device: str, split: bool = False):
    """(decode tokens/s, tokens counted, canary host us/step, adapter us/step, canary device span us/step,
    steps) of one ``generate_batch``. Only a ``split`` run wraps the canary's calls to time them (CUDA
    events, host timers): those wrappers cost host time of their own, so the throughput of a split
    run is not used."""
    from kvcanary_cupy.integrations.transformers import watch  # noqa: PLC0415

    if not canary:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config,
                                   record_timestamps=True)
        return decode_rate(out) + (None, None, None, None)
    timer, hosts = (DeviceTimer(), HostSplit()) if split else (None, None)
    with watch(model, policy="raise") as w, timer or contextlib.nullcontext(), hosts or contextlib.nullcontext():
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config,
                                   record_timestamps=True)
    s = w.stats()
    if s["violations"]:
        raise RuntimeError(f"the canary found {s['violations']} violations in a clean run")
    n = s["steps"] or float("nan")
    dev_us = 1e3 * timer.total_ms() / n if split and device != "cpu" else float("nan")
    adapter_us = 1e6 * (s["host_seconds"] - hosts.seconds) / n if split else float("nan")
    return decode_rate(out) + (s["host_us_per_step"], adapter_us, dev_us, s["steps"])


def pair_spread(pairs: list) -> str:
    """The first and third quartiles of the pairs' overheads (percent), as a cell: half their
    distance over the square root of the pairs bounds how far the median moves between sessions.

    Example::

        >>> pair_spread([1.0, 2.0, 3.0, 4.0, 5.0])
        '+1.50 .. +4.50 %'
    """
    if len(pairs) < 2:
        return "-"
    q1, _, q3 = statistics.quantiles(pairs, n=4)
    return f"{q1:+.2f} .. {q3:+.2f} %"


def _missing_requirements(device: str) -> str | None:
    """What this machine lacks for a run on ``device`` (None: nothing), said before a model is built."""
    import importlib.util  # noqa: PLC0415

    try:
        import torch  # noqa: PLC0415
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise
        return ("needs PyTorch and transformers, and PyTorch is not installed: pip install -e '.[transformers]' "
                "(with a CUDA build of PyTorch for the default --device cuda; --device cpu --small runs on the CPU)")
    if device == "cuda" and not torch.cuda.is_available():
        return (f"--device cuda (the default) needs a CUDA device and a CUDA build of PyTorch; PyTorch "
                f"{torch.__version__} sees none: run with --device cpu --small for a dry run of the harness on the CPU")
    if importlib.util.find_spec("transformers") is None:
        return "needs transformers: it is not installed (pip install -e '.[transformers]')"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.transformers_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="a tiny model and short runs (a dry run of the harness)")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes (default %(default)s)")
    ap.add_argument("--runs", type=int, default=None,
                    help="interleaved pairs of timed runs (one without, one with) per batch (default 20; 2 with --small)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; 16 with --small)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 256; 16 with --small)")
    ap.add_argument("--cuda-graphs", action="store_true", help="ContinuousBatchingConfig(use_cuda_graph=True)")
    args = ap.parse_args(argv)
    problem = _missing_requirements(args.device)
    if problem:
        print(f"kvcanary: bench.transformers_overhead: {problem}", file=sys.stderr)
        return 2

    import random  # noqa: PLC0415

    from transformers import GenerationConfig  # noqa: PLC0415
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: PLC0415

    small = args.small
    runs = args.runs or (2 if small else 20)
    plen = args.prompt_len or (16 if small else 128)
    new = args.new_tokens or (16 if small else 256)
    batches = [int(b) for b in args.batches.split(",")]
    if small:
        batches = sorted({min(b, 8) for b in batches})
    model = build_model(args.device, small)
    vocab = model.config.vocab_size
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    bs = 16 if small else 256
    rows = []
    for batch in batches:
        rng = random.Random(batch)
        prompts = [[rng.randrange(1, vocab) for _ in range(plen)] for _ in range(batch)]
        blocks = batch * (-(-(plen + new) // bs) + 1) + 4
        extra = dict(use_cuda_graph=True, use_async_batching=False) if args.cuda_graphs else {}
        config = ContinuousBatchingConfig(block_size=bs, num_blocks=blocks, max_batch_tokens=max(batch * plen, 256),
                                          **extra)
        one_run(model, prompts, gen, config, canary=False, device=args.device)  # warm-up (allocator, kernels)
        one_run(model, prompts, gen, config, canary=True, device=args.device)
        plain, watched, host, pairs = [], [], [], []
        for _ in range(runs):
            plain.append(one_run(model, prompts, gen, config, canary=False, device=args.device)[0])
            rate, _, h, _, _, _ = one_run(model, prompts, gen, config, canary=True, device=args.device)
            watched.append(rate)
            host.append(h)
            pairs.append(100.0 * (plain[-1] - rate) / plain[-1] if plain[-1] else float("nan"))
            print(f"batch {batch}: {plain[-1]:.1f} / {watched[-1]:.1f} tok/s, canary host {h:.0f} us/step",
                  file=sys.stderr)
        _, _, _, adapter, dev, _ = one_run(model, prompts, gen, config, canary=True, device=args.device, split=True)
        p, w = statistics.median(plain), statistics.median(watched)
        step_ms = 1e3 * batch / p if p else float("nan")
        h = statistics.median(host)
        rows.append((batch, p, w, 100.0 * (p - w) / p if p else float("nan"), statistics.median(pairs),
                     pair_spread(pairs), h, 0.1 * h / step_ms, adapter, dev, step_ms))

    cmd = "python -m bench.transformers_overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    model_name = "tiny model (dry run)" if small else "Llama 2048 x 16 layers, bf16"
    print(f"\nDecode throughput of generate_batch, {model_name}"
          f", prompt {plen}, {new} new tokens, {runs} interleaved pairs of runs, device {args.device}"
          f"{', CUDA graphs' if args.cuda_graphs else ''} ({time.strftime('%Y-%m-%d')}; `{cmd.strip()}`)\n")
    print("| batch | tokens/s without | tokens/s with canary | overhead (tokens/s) | overhead, median of pairs | "
          "pairs' spread (quartiles) | canary host us/step | canary host / step | of which adapter us/step | "
          "canary span on the stream us/step | step ms without |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, p, w, ov, pov, spread, h, share, a, d, ms in rows:
        dev = "-" if d != d else f"{d:.0f}"  # no CUDA events on the CPU
        print(f"| {b} | {p:.1f} | {w:.1f} | {ov:+.2f} % | {pov:+.2f} % | {spread} | {h:.0f} | {share:.2f} % | {a:.0f} "
              f"| {dev} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
