"""``python -m kvcanary_cupy selftest | info | report | --version``, also installed as the ``kvcanary`` command."""
from __future__ import annotations

import os
import sys

MODULE_PROG = "python -m kvcanary_cupy"

USAGE = """usage: {prog} {{selftest,info,report}} [options]
       {prog} --version

  selftest   clean run plus every fault class on a simulated engine, once per chain kind
             (exit 0: all caught, no false positives)
  info       version, kernel source directory, CuPy / GPU visibility
  report     summary of an events file (incidents per request and reason; --plot a timeline)

{prog} COMMAND --help lists a command's options.
The benchmarks are not part of the package: python -m bench, from the top of a checkout.
"""
BENCH_MOVED = ("kvcanary: bench: the benchmarks live in the repository's bench/ folder, not in the package; "
               "run them from a checkout with python -m bench")
INFO_DESCRIPTION = ("Print the package version, where the CUDA kernel sources are, and whether CuPy is installed "
                    "and sees a GPU.")


def program_name(argv0: str | None = None) -> str:
    """The name the user ran this as: the console script's (``kvcanary``), else ``python -m kvcanary_cupy``."""
    base = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    stem, ext = os.path.splitext(base)
    if ext.lower() == ".exe":
        base = stem
    if not base or base in ("-c", "-m") or base.endswith((".py", ".pyw")):
        return MODULE_PROG
    return base


def info() -> int:
    import kvcanary_cupy  # noqa: PLC0415

    pkg = os.path.dirname(os.path.abspath(kvcanary_cupy.__file__))
    try:
        from .backends.cuda_sources import kernels_dir  # noqa: PLC0415  (plain file lookup, no CuPy)

        kernels = str(kernels_dir())
    except ImportError:
        candidates = [os.path.join(pkg, "kernels_cu"), os.path.join(os.path.dirname(pkg), "kernels_cu")]
        kernels = next((c for c in candidates if os.path.isdir(c)), "not found in " + ", ".join(candidates))
    except FileNotFoundError as e:
        kernels = f"not found ({e})"
    print(f"kvcanary_cupy {kvcanary_cupy.__version__}")
    print(f"package:          {pkg}")
    print(f"kernel sources:   {kernels}")
    try:
        import cupy  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        print(f"cupy:             not importable ({type(e).__name__}: {e})")
        print("gpu:              not visible (the NumPy backend runs everything)")
        return 0
    print(f"cupy:             {cupy.__version__}")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        print(f"gpu:              not visible ({type(e).__name__}: {e})")
        return 0
    if n == 0:
        print("gpu:              none visible")
    for i in range(n):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        print(f"gpu {i}:            {name} (compute capability {props['major']}.{props['minor']})")
    return 0


def main(argv=None, prog: str | None = None) -> int:
    """Run a command; returns the exit status. ``prog`` names the program in usage lines
    (default: as invoked, when ``argv`` is None; else ``python -m kvcanary_cupy``)."""
    if prog is None:
        prog = program_name() if argv is None else MODULE_PROG
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = USAGE.format(prog=prog)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "--version":
        if rest:
            print(f"kvcanary: --version takes no arguments, got {' '.join(rest)}\n{usage}", file=sys.stderr, end="")
            return 2
        from . import __version__  # noqa: PLC0415

        print(f"kvcanary_cupy {__version__}")
        return 0
    if cmd == "selftest":
        from .selftest import main as selftest_main  # noqa: PLC0415

        return selftest_main(rest, prog=f"{prog} selftest")
    if cmd == "report":
        from .report import main as report_main  # noqa: PLC0415

        return report_main(rest, prog=f"{prog} report")
    if cmd == "bench":
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    if cmd == "info":
        from .cli import CliParser  # noqa: PLC0415

        CliParser(prog=f"{prog} info", command="info", description=INFO_DESCRIPTION).parse_args(rest)
        return info()
    what = "option" if cmd.startswith("-") else "command"
    print(f"kvcanary: unknown {what} {cmd!r}: expected selftest, info, report or --version\n{usage}", file=sys.stderr,
          end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
