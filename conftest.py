"""Collection rules for the whole tree (tests/ and the package's doctests)."""
import importlib.util

# Modules whose import needs CuPy are collected for doctests only where CuPy exists
# (bench/ holds scripts that import CuPy at import time, e.g. monitor_host_overhead.py).
collect_ignore_glob = [] if importlib.util.find_spec("cupy") else [
    "kvcanary_cupy/backends/cuda.py",
    "bench/*.py",
]
collect_ignore_glob += ["examples/*", "build/*", "dist/*", ".venv/*"]
# The torch.library ops import torch at import time: their doctests need it.
if not importlib.util.find_spec("torch"):
    collect_ignore_glob += ["kvcanary_cupy/integrations/torch_ops"]
# The vLLM connector's modules import vLLM at import time: their doctests need it.
if not importlib.util.find_spec("vllm"):
    collect_ignore_glob += ["kvcanary_cupy/integrations/vllm/*"]
