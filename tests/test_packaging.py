"""The wheel ships the CUDA sources, and an installed package finds them.

Builds a wheel of this checkout, installs it into a fresh virtual environment
outside the repository, and imports it there: the package must load without CuPy,
PyTorch or JAX and locate kernels_cu/ inside site-packages. The wheel holds no
benchmark code (bench/ stays in the checkout) and no CUDA source but the library's.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from kvcanary_cupy.backends import cuda_sources

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_checkout_finds_every_kernel_source():
    d = cuda_sources.kernels_dir()
    assert (d / cuda_sources.HEADER).is_file()
    for family, mod in cuda_sources.MODULES.items():
        assert (d / mod.file).is_file()
        assert f'#include "{cuda_sources.HEADER}"' not in cuda_sources.source(family)  # header inlined


def test_import_pulls_in_no_framework():
    code = ("import sys, kvcanary_cupy, kvcanary_cupy.ops, kvcanary_cupy.backends.reference;"
            "bad = [m for m in ('cupy', 'torch', 'jax') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_test_extra_brings_what_the_wheel_build_needs():
    """The wheel test builds without build isolation, so `pip install -e '.[test]'` (the README's
    test command) must bring the build backend pyproject.toml names: a fresh venv has an older
    setuptools and no wheel package."""
    import configparser  # noqa: PLC0415
    import re  # noqa: PLC0415

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    test = {re.split(r"[<>=!~ ;\[]", r.strip(), maxsplit=1)[0]: r.strip()
            for r in cfg["options.extras_require"]["test"].splitlines() if r.strip()}
    build = re.search(r"\[build-system\][^\[]*?requires\s*=\s*\[(.*?)\]", (ROOT / "pyproject.toml").read_text(),
                      flags=re.S)
    backend = re.findall(r'"([^"]+)"', build.group(1))
    assert backend, "pyproject.toml names no build requirement"
    for req in backend:
        name = re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0]
        assert name in test, f"the test extra lacks {req}"
        if req != name:
            assert test[name] == req, (test[name], req)


@pytest.mark.slow
def test_wheel_installs_and_finds_kernels(tmp_path):
    import importlib.util  # noqa: PLC0415

    missing = [m for m in ("setuptools", "wheel") if importlib.util.find_spec(m) is None]
    assert not missing, f"the wheel build needs {' and '.join(missing)}: pip install -e '.[test]' brings them"
    dist = tmp_path / "dist"
    # A copy of the sources without build outputs: setuptools puts into the wheel whatever an
    # earlier build left in build/lib, files since moved or deleted included.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache", ".venv", "gpu-out", "out", ".whl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True)
    (wheel,) = dist.glob("kvcanary_cupy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for mod in list(cuda_sources.MODULES.values()):
        assert f"kvcanary_cupy/kernels_cu/{mod.file}" in names
    assert f"kvcanary_cupy/kernels_cu/{cuda_sources.HEADER}" in names
    # No benchmark code: the harness, its probes and the PyTorch baseline stay in the checkout's bench/.
    bench = [n for n in names if any(w in n for w in ("bench", "probes.cu", "torch_baseline", "bench_probes"))]
    assert not bench, f"the wheel carries benchmark files: {bench}"
    # Every module of the package is in the wheel (a subpackage left out of setup.cfg would not be).
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvcanary_cupy").rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert [m for m in modules if m not in names] == [], "modules missing from the wheel"
    cuda = sorted(n for n in names if n.endswith((".cu", ".cuh")))
    library = sorted(f"kvcanary_cupy/kernels_cu/{name}" for name in cuda_sources.files())
    assert cuda == library, f"the wheel's CUDA sources are not exactly the library's kernels: {cuda}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    if subprocess.run([str(py), "-c", "import numpy"], capture_output=True).returncode:
        # Lend this interpreter's NumPy through a .pth line (no network needed); the
        # venv's own site-packages, where the wheel goes, still comes first.
        import numpy  # noqa: PLC0415

        site = next(venv.glob("lib/python*/site-packages"))
        (site / "numpy_from_host.pth").write_text(str(pathlib.Path(numpy.__file__).parents[1]) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], check=True)
    code = ("import kvcanary_cupy, sys;"
            "from kvcanary_cupy.backends import cuda_sources as c;"
            "d = c.kernels_dir(); print(d);"
            "assert 'site-packages' in str(d), d;"
            "assert all(len(c.source(f)) > 100 for f in c.MODULES);"
            "assert 'cupy' not in sys.modules;"
            "from kvcanary_cupy import KvCanary, SweepChain; from kvcanary_cupy import selftest, sim")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVCANARY_KERNELS_DIR")}
    out = subprocess.run([str(py), "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "site-packages" in out.stdout
