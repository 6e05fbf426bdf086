"""Collection rules for the whole tree (tests/ and the package's doctests)."""
import importlib.util

# Modules whose import needs CuPy are collected for doctests only where CuPy exists.
collect_ignore_glob = [] if importlib.util.find_spec("cupy") else [
    "kvcanary_cupy/backends/cuda.py",
    "kvcanary_cupy/bench/*.py",
]
collect_ignore_glob += ["examples/*", "build/*", "dist/*", ".venv/*"]
