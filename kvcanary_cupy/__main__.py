"""``python -m kvcanary_cupy selftest | info``."""
from __future__ import annotations

import sys

USAGE = """usage: python -m kvcanary_cupy {selftest,info} [options]

  selftest   clean run plus every fault class on a simulated engine, once per chain kind
             (exit 0: all caught, no false positives)
  info       version, kernel source directory, CuPy / GPU visibility

python -m kvcanary_cupy COMMAND --help lists a command's options.
The benchmarks are not part of the package: python -m bench, from the top of a checkout.
"""
BENCH_MOVED = ("kvcanary: bench: the benchmarks live in the repository's bench/ folder, not in the package; "
               "run them from a checkout with python -m bench")


def info() -> int:
    import os  # noqa: PLC0415

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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "selftest":
        from .selftest import main as selftest_main  # noqa: PLC0415

        return selftest_main(rest)
    if cmd == "bench":
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    if cmd == "info":
        return info()
    print(f"kvcanary: unknown command {cmd!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
