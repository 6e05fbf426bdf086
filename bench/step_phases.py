"""Where the device time of a stamped decode step goes, phase by phase.

    python -m bench.step_phases [--batches 1,64] [--runs 60] [--rounds 2] [--json PATH]

A monitor made with ``stamp_before_forward=True`` runs a decode step as one launch of
``plan_verify_write`` (``kernels_cu/step.cu``). On the small route every block reads the
rows' inputs, its warps check their tiles (table, records), the block leaves through the
exit atomic, and the last block out finishes the plan (offsets, scalars) and runs the
write's tail (its rows' seed states and chain walk, then each token's checks and store).
This times that step, as ``python -m bench`` times its monitor cases (prefix 4096, a
token-level table over 16Mi slots, every run queued behind a device-side hold, with an L2
flush before each run and, as "warm", without), for kernels with the phases cut off one
after another from the end: each variant is a copy of ``kernels_cu/`` edited at run time
(the library's own sources are not touched) and runs in a process of its own. The cuts
apply to the step's launch only; the prefill that stamps the prefixes runs whole kernels.
The difference between two neighbouring variants is the time of the phase cut between
them; the cut kernels compute wrong results, only their time means anything.

    python -m bench.step_phases --code-in-l2 [--batches 1,64] [--runs 60] [--rounds 2]

times the library's kernel alone three ways: flushed, flushed with its code in L2 (a
one-token step of the same kernel on another monitor runs between the flush and the timed
step), and warm. Their first difference is what fetching the kernel's own instructions
from DRAM costs the step, as a real engine's forward leaves it.

Needs CuPy and a CUDA device.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PREFIX, NUM_SLOTS = 4096, 1 << 24
MAX_BATCH = 256  # a decode step of more rows has more tokens than plan_verify_write stamps

# The cuts, in order: (variant, file, anchor, replacement). Variant k applies the first k
# of them, so each variant leaves out more than the one before it.
_TAIL_END = "        // 3. Each token: checks, then the store of its slot's last write.\n"
_TAIL_INIT = "            sh.last[k] = -1;\n        }\n        __syncthreads();\n"
_TILES = "        small_tiles<kVerify, kFp, kScan, Tail::kSeeds>(a, c, s_small, kVerify ? s_phase : -1, checked);\n"
_CUTS = [
    ("tail_walk", "step.cu", _TAIL_END, "        return;\n" + _TAIL_END),
    ("tail_start", "step.cu", _TAIL_INIT, _TAIL_INIT + "        return;\n"),
    ("no_tail", "plan.cu", "    tail.last_block(a, c, small ? &s_small : nullptr);\n}",
     "    if constexpr (!Tail::kSeeds) tail.last_block(a, c, small ? &s_small : nullptr);\n}"),
    ("no_finish", "plan.cu", "        first_error = small_finish<kVerify>(a, c, s_small, s_invalid, sh);\n",
     "        first_error = Tail::kSeeds ? -1 : small_finish<kVerify>(a, c, s_small, s_invalid, sh);\n"),
    ("no_tiles", "plan.cu", _TILES, "        if constexpr (!Tail::kSeeds)" + _TILES[7:]),
    ("empty", "plan.cu", "const Tail& tail = Tail{}) {\n",
     "const Tail& tail = Tail{}) {\n    if constexpr (Tail::kSeeds) return;\n"),
]
VARIANTS = ["whole"] + [name for name, *_ in _CUTS]
# What each variant leaves out beyond the one before it.
PHASES = {
    "tail_walk": "tail: each token's checks and store, the counters",
    "tail_start": "tail: the rows' seeds, offsets and chain walk",
    "no_tail": "tail: its start (acquire, the slot table's reset)",
    "no_finish": "finish: the plan's offsets and scalars",
    "no_tiles": "tiles: table, records, checks",
    "empty": "rows' inputs, block sums, exit atomic",
}


def build_variants(src: Path, dest: Path) -> dict:
    """``{variant: folder}``: a copy of the kernel sources in ``src`` per variant, under ``dest``."""
    out = {}
    for i, name in enumerate(VARIANTS):
        d = dest / name
        shutil.copytree(src, d)
        for cut, file, old, new in _CUTS[:i]:
            path = d / file
            text = path.read_text()
            if text.count(old) != 1:
                raise RuntimeError(f"kvcanary: bench.step_phases: the anchor of cut {cut!r} is not found once in "
                                   f"{file}: the kernel changed, update _CUTS")
            path.write_text(text.replace(old, new))
        out[name] = d
    return out


def time_steps(batches: list, runs: int, code_in_l2: bool = False) -> dict:
    """Device us of the stamped step at each batch, with and without the L2 flush (this process's
    kernels); with ``code_in_l2``, also flushed with the kernel's code brought back into L2 first."""
    from . import monitor_steps, workloads  # noqa: PLC0415
    from .platforms import CudaPlatform  # noqa: PLC0415

    p = CudaPlatform()
    try:
        setup = monitor_steps.build(p.cp, p.device, batch=max(batches), prefix=PREFIX, num_slots=NUM_SLOTS,
                                    rs=workloads.random_state(p.cp, 31337 + PREFIX), stamp=True, stream=p.stream)
        # A one-token step of the same kernel over a small pool of its own: between the flush and
        # the timed step it brings the kernel's instructions into L2, and none of the step's data.
        fetch = monitor_steps.build(p.cp, p.device, batch=1, prefix=64, num_slots=1 << 16,
                                    rs=workloads.random_state(p.cp, 7), stamp=True,
                                    stream=p.stream) if code_in_l2 else None
        out = {}
        for bs in batches:
            step = setup.step(bs)
            for flush in (True, False):
                t = p.timer.device(lambda _i: step(), runs=runs, warmup=5, flush=flush)
                out[f"{bs}/{'flushed' if flush else 'warm'}"] = t.device_us
            if fetch is not None:
                t = p.timer.device(lambda _i: step(), runs=runs, warmup=5, flush=True, before=fetch.step(1))
                out[f"{bs}/code in L2"] = t.device_us
        out["violations"] = setup.checks()["violations"] + (fetch.checks()["violations"] if fetch else 0)
        return out
    finally:
        p.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_phases", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64", help=f"comma-separated batch sizes (default 1,64; at most {MAX_BATCH})")
    ap.add_argument("--runs", type=int, default=60, help="timed runs per figure (default 60)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the variants, interleaved; with --code-in-l2, rounds of its three timings (default 2)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--code-in-l2", action="store_true",
                    help="time the library's kernel alone, flushed, flushed with its code in L2, and warm")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a variant's own process
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or not all(1 <= b <= MAX_BATCH for b in batches):
        print(f"kvcanary: --batches: expected comma-separated batch sizes in 1..{MAX_BATCH} (a decode step the "
              f"monitor stamps in one launch), got {args.batches!r}", file=sys.stderr)
        return 2
    for name in ("runs", "rounds"):
        if getattr(args, name) < 1:
            print(f"kvcanary: --{name}: expected >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    from .platforms import NoCudaDevice, cuda_device_count  # noqa: PLC0415

    try:
        cuda_device_count()
    except NoCudaDevice as e:
        print(f"kvcanary: bench.step_phases: {e}; it times CUDA kernels and needs CuPy and a CUDA device",
              file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(time_steps(batches, args.runs)))
        return 0
    if args.code_in_l2:
        rounds = [time_steps(batches, args.runs, code_in_l2=True) for _ in range(args.rounds)]
        print(report_code(rounds, batches))
        if args.json:
            Path(args.json).write_text(json.dumps(rounds, indent=2))
        return 0
    from kvcanary_cupy.backends import cuda_sources  # noqa: PLC0415

    results = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="kvcanary-phases-") as tmp:
        dirs = build_variants(cuda_sources.kernels_dir(), Path(tmp))
        for _ in range(args.rounds):
            for v in VARIANTS:
                env = dict(os.environ, **{cuda_sources.ENV_DIR: str(dirs[v])})
                cmd = [sys.executable, "-m", "bench.step_phases", "--one", "--batches", args.batches,
                       "--runs", str(args.runs)]
                got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if got.returncode != 0:
                    print(got.stderr[-2000:], file=sys.stderr)
                    return got.returncode
                results[v].append(json.loads(got.stdout.strip().splitlines()[-1]))
    print(report(results, batches))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def report(results: dict, batches: list) -> str:
    """A table: each variant's median over rounds, then what each phase took (the differences)."""
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "violations"}
           for v, rs in results.items()}
    keys = [f"{b}/{w}" for b in batches for w in ("flushed", "warm")]
    lines = ["| variant | " + " | ".join(f"bs {k} us" for k in keys) + " |",
             "|---|" + "---:|" * len(keys)]
    lines += [f"| {v} | " + " | ".join(f"{med[v][k]:.2f}" for k in keys) + " |" for v in VARIANTS]
    lines += ["", "| phase (left out by) | " + " | ".join(f"bs {k} us" for k in keys) + " |",
              "|---|" + "---:|" * len(keys)]
    for before, v in zip(VARIANTS, VARIANTS[1:]):
        lines.append(f"| {PHASES[v]} ({v}) | " + " | ".join(f"{med[before][k] - med[v][k]:.2f}" for k in keys) + " |")
    lines.append("| the launch of an empty step (empty) | " + " | ".join(f"{med['empty'][k]:.2f}" for k in keys) + " |")
    lines.append("")
    lines.append("violations of the whole kernel's runs: " + ", ".join(str(r["violations"]) for r in results["whole"]))
    return "\n".join(lines)


def report_code(rounds: list, batches: list) -> str:
    """A table of ``--code-in-l2``: per batch, the medians over rounds and what the code's fetch costs."""
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "violations"}
    lines = ["| batch | flushed us | flushed, code in L2 us | warm us | the code's fetch from DRAM us |",
             "|---:|---:|---:|---:|---:|"]
    for b in batches:
        f, c, w = med[f"{b}/flushed"], med[f"{b}/code in L2"], med[f"{b}/warm"]
        lines.append(f"| {b} | {f:.2f} | {c:.2f} | {w:.2f} | {f - c:.2f} |")
    lines += ["", "violations: " + ", ".join(str(r["violations"]) for r in rounds)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
