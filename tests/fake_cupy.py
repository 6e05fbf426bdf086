"""Stand-in ``cupy`` packages for testing what the CLIs say when CuPy cannot run.

Each is a package put first on PYTHONPATH in a subprocess: one installed on a machine
without a device, one that is not installed at all.
"""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NO_DEVICE = """
__version__ = "14.0.0"
class CUDARuntimeError(RuntimeError):
    pass
class _Runtime:
    @staticmethod
    def getDeviceCount():
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
class cuda:
    runtime = _Runtime
"""
NOT_INSTALLED = "raise ModuleNotFoundError(\"No module named 'cupy'\", name='cupy')\n"


def fake_cupy_env(tmp_path, source: str) -> dict:
    """The environment of a subprocess whose ``import cupy`` runs ``source``."""
    pkg = tmp_path / "fake" / "cupy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(source)
    path = os.pathsep.join([str(tmp_path / "fake"), ROOT, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}
