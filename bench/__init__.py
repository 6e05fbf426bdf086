"""``python -m bench``: time plan / verify / plan_and_verify / write and whole monitor steps
against the memory floor, a random gather, a bare kernel launch, a PyTorch baseline and
SGLang's figures, on one GPU.

Not part of the installed package: run it from the top of a checkout (which puts
both ``bench`` and ``kvcanary_cupy`` on the import path), with the package installed
or not::

    python -m bench [--quick] [--json PATH] [--markdown PATH] [--runs N]
                    [--no-baseline] [--only REGEX] [--device cuda|cpu]

Writes a JSON file of every figure, a markdown report (spliced between the
``<!-- bench:begin -->`` / ``<!-- bench:end -->`` markers of ``--markdown``), prints
the report and, last, the table of targets: each figure as measured, its limit,
their ratio and SGLang's figure for the same case (``targets.py``). ``--device cpu``
runs the harness on the NumPy reference and CPU torch: a check of the harness
itself, whose figures mean nothing.

Also here: ``python -m bench.monitor_host_overhead`` (host time of the monitor's step
with bound buffers) and ``python -m bench.selfcheck`` (host time per op against a bare
launch, verify bandwidth against a copy), both on a GPU, and ``python -m bench.step_phases``
(a stamped decode step's device time phase by phase); ``probes.cu`` holds the kernels
the bench times beside the library's, ``torch_baseline.py`` the PyTorch baseline (both
chain kinds), ``monitor_steps.py`` the monitor the monitor cases run, and ``README.md`` /
``results.json`` the figures of the last full run.

Nothing here imports CuPy or PyTorch until a run starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from kvcanary_cupy.cli import CliParser

__all__ = ["main"]


DESCRIPTION = ("Time plan / verify / plan_and_verify / write and whole monitor steps against the memory floor, "
               "a random gather, a bare kernel launch, a PyTorch baseline and SGLang's figures, on one GPU. Writes "
               "every figure as JSON, prints a markdown report and, last, the table of targets. Needs a CUDA device "
               "visible to CuPy; --device cpu runs the harness on the NumPy reference and CPU torch instead, a check "
               "of the harness whose figures mean nothing.")


def _parser() -> argparse.ArgumentParser:
    ap = CliParser(prog="python -m bench", command="bench", description=DESCRIPTION)
    ap.add_argument("--quick", action="store_true", help="a tiny subset (seconds): the smoke test")
    ap.add_argument("--json", metavar="PATH", default="kvcanary_bench.json",
                    help="where the JSON results go (default: %(default)s)")
    ap.add_argument("--markdown", metavar="PATH", default=None,
                    help="markdown file whose bench block is rewritten (created if missing)")
    ap.add_argument("--runs", type=int, default=None, metavar="N",
                    help="timed runs per figure (default 50; 5 with --quick or --device cpu)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument("--only", metavar="REGEX", default=None,
                    help="only the cases whose name matches the regular expression (re.search)")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="wall-clock budget: the baseline stops at 85%% of it, the remaining cases at 100%%")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default): the current CUDA device through CuPy; cpu: a dry run of the harness "
                         "on the NumPy reference, whose figures mean nothing and whose targets do not apply (the "
                         "full suite's cases with batches and token counts divided by 16, more where memory is "
                         "short)")
    return ap


def main(argv=None) -> int:
    """Run the bench; returns the exit status (1 when a measurement failed, else 0)."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        raise SystemExit(f"kvcanary: --runs: expected >= 1, got {args.runs}")
    if args.only is not None:
        import re  # noqa: PLC0415

        try:
            re.compile(args.only)
        except re.error as e:
            ap.error(f"--only {args.only!r}: not a regular expression ({e}); expected a Python regular "
                     "expression matched against the case names")

    from . import cases, report  # noqa: PLC0415
    from .platforms import NoCudaDevice, make_platform  # noqa: PLC0415
    from .runner import Runner, cpu_sized  # noqa: PLC0415

    suite = cases.quick_suite() if args.quick else cases.full_suite()
    if args.device == "cpu" and not args.quick:
        suite = cpu_sized(suite)
    if args.runs is not None:
        suite = dataclasses.replace(suite, runs=args.runs)
    if args.budget is not None:
        suite = dataclasses.replace(suite, soft_deadline_s=0.85 * args.budget, hard_deadline_s=args.budget)
    suite = cases.select(suite, args.only)
    try:
        platform = make_platform(args.device)
    except NoCudaDevice as e:
        print(f"kvcanary: bench: {e}; the bench measures a GPU: run with --device cpu for a dry run of the "
              "harness on the NumPy reference", file=sys.stderr)
        return 2
    try:
        results = Runner(suite, platform, baseline=not args.no_baseline).run()
    finally:
        platform.close()

    body = report.markdown(results)
    if args.json:
        report.write_json(results, args.json)
    if args.markdown:
        report.update_markdown(args.markdown, body)
    print(body)
    print(report.summary(results))
    failed = [c["name"] for c in results["cases"] if c.get("error")]
    failed += [k for k in ("copy", "host") if (results.get(k) or {}).get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
