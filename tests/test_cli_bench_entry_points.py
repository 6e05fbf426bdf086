"""Every ``python -m bench...`` command on a machine without a GPU: one line that says what it
needs (and ``--device cpu`` where it has a CPU mode), never a traceback.

Stand-in ``cupy`` and ``torch`` packages on PYTHONPATH play "not installed" and "installed,
no CUDA device" whatever this machine really has.
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from tests.fake_cupy import NO_DEVICE, NOT_INSTALLED, ROOT, fake_cupy_env

TORCH_NOT_INSTALLED = "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
TORCH_CPU_ONLY = """
__version__ = "2.13.0+cpu"
class cuda:
    @staticmethod
    def is_available():
        return False
    @staticmethod
    def device_count():
        return 0
"""
SCENARIOS = {"not-installed": (NOT_INSTALLED, TORCH_NOT_INSTALLED), "no-device": (NO_DEVICE, TORCH_CPU_ONLY)}

# Each entry point, and whether it has a CPU mode its one line must point at.
ENTRY_POINTS = {
    "bench": True,
    "bench.monitor_host_overhead": True,
    "bench.step_phases": False,
    "bench.selfcheck": False,
    "bench.tp_agreement_cost": False,
    "bench.transformers_overhead": True,
    "bench.vllm_connector_overhead": False,
    "bench.vllm_gpu_host": False,
}


def entry_points() -> set[str]:
    """The modules of bench/ that run as ``python -m``: those with a ``__main__`` block."""
    found = set()
    for path in (pathlib.Path(ROOT) / "bench").glob("*.py"):
        if re.search(r"^if __name__ == ['\"]__main__['\"]:", path.read_text(), flags=re.M):
            found.add("bench" if path.stem in ("__init__", "__main__") else f"bench.{path.stem}")
    return found


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_bench_entry_point_without_a_gpu_is_one_line(tmp_path, scenario):
    assert entry_points() == set(ENTRY_POINTS)  # a new entry point gets its line here too
    cupy_source, torch_source = SCENARIOS[scenario]
    env = fake_cupy_env(tmp_path, cupy_source)
    torch_pkg = tmp_path / "fake" / "torch"
    torch_pkg.mkdir()
    (torch_pkg / "__init__.py").write_text(torch_source)
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for module in sorted(entry_points()):
        out = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (module, out.returncode, out.stderr[-2000:])
        assert len(lines) == 1 and "Traceback" not in out.stderr, (module, out.stderr[-2000:])
        assert lines[0].startswith(f"kvcanary: {module}: ") and "CUDA" in lines[0], (module, lines[0])
        assert ("--device cpu" in lines[0]) == ENTRY_POINTS[module], (module, lines[0])
        assert out.stdout == "", (module, out.stdout)
