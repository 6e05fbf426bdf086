"""The CUDA sources of the kernels and how each module is compiled.

Imports no CuPy: the NVRTC compile check (``tests/test_kernels_compile.py``)
uses this table on machines without a GPU.

The sources live in ``kernels_cu/`` at the top of a checkout; a wheel places
them at ``kvcanary_cupy/kernels_cu/``. :func:`source` returns a module's text
with the common header inlined, so the compiled text (and CuPy's on-disk
kernel cache key) covers the header too and no ``-I`` path is needed.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = "kvcanary_common.cuh"
_INCLUDE = f'#include "{HEADER}"'
ENV_DIR = "KVCANARY_KERNELS_DIR"  # optional override: a folder holding the .cu files


@dataclass(frozen=True)
class KernelModule:
    """One kernel family: its source file, NVRTC options and kernel names.

    Attributes:
        file: the ``.cu`` file in ``kernels_cu/``.
        options: NVRTC options (CuPy adds the architecture itself).
        name_expressions: every kernel (template instance) the backend launches.
    """

    file: str
    options: tuple[str, ...]
    name_expressions: tuple[str, ...]


OPTIONS = ("-std=c++17",)


def _instances(kernel: str, more: str = "") -> tuple[str, ...]:
    """``kernel<kFp, kScan>`` for both values of each: with and without real-KV sources,
    scan or sglang chain (``more``: further template arguments, the same in each)."""
    return tuple(f"{kernel}<{fp}, {scan}{more}>" for fp in ("false", "true") for scan in ("false", "true"))

MODULES: dict[str, KernelModule] = {
    "plan": KernelModule("plan.cu", OPTIONS, ("kvc::plan_step", *_instances("kvc::plan_verify_step"))),
    # kLong true; false: the scan chain's writes of at most WARP_ROW_MAX input tokens (decode steps).
    "write": KernelModule("write.cu", OPTIONS, _instances("kvc::write_tokens", ", true")
                          + ("kvc::write_tokens<false, true, false>", "kvc::write_tokens<true, true, false>")),
    "step": KernelModule("step.cu", OPTIONS, ("kvc::plan_verify_write_step<false>",
                                              "kvc::plan_verify_write_step<true>")),
    "verify": KernelModule("verify.cu", OPTIONS, _instances("kvc::verify_entries")),
    "scatter": KernelModule("scatter.cu", OPTIONS, ("kvc::scatter_expected_tokens", "kvc::apply_updates")),
    "digest": KernelModule("digest.cu", OPTIONS, ("kvc::digest_rows", "kvc::compare_digests")),
}


def kernels_dir() -> Path:
    """The folder holding the ``.cu`` files: ``$KVCANARY_KERNELS_DIR``, the
    wheel's ``kvcanary_cupy/kernels_cu`` or the checkout's ``kernels_cu``."""
    env = os.environ.get(ENV_DIR)
    here = Path(__file__).resolve().parent  # kvcanary_cupy/backends
    candidates = ([Path(env)] if env else []) + [here.parent / "kernels_cu", here.parent.parent / "kernels_cu"]
    for c in candidates:
        if (c / HEADER).is_file():
            return c
    raise FileNotFoundError(
        "kvcanary: the CUDA kernel sources (kernels_cu/) were not found; looked in "
        + ", ".join(str(c) for c in candidates))


@functools.lru_cache(maxsize=None)
def source(family: str) -> str:
    """The full text of a kernel family's module: its file with every ``#include`` of
    another file of ``kernels_cu/`` inlined (each once; a module may build on another
    family's file, as ``step.cu`` on ``plan.cu``, and a file may keep a route in a part of
    its own, as ``plan.cu`` its small route in ``plan_small.cuh``), the common header
    among them."""
    if family not in MODULES:
        raise KeyError(f"kvcanary: no kernel family {family!r}; known: {sorted(MODULES)}")
    file = MODULES[family].file
    text = (kernels_dir() / file).read_text()
    if _INCLUDE not in text and not _LOCAL.search(text):
        raise ValueError(f"kvcanary: {file} does not include {HEADER}")
    return _inline_local(text, {file})


# An include of another kernel file (X.cu) or of a part of one (X.cuh), not the common header.
_LOCAL = re.compile(r'^#include "(?!%s")([\w.]+\.cuh?)"\n' % re.escape(HEADER), re.M)


def files() -> tuple[str, ...]:
    """Every file of ``kernels_cu/`` the modules are made of: each module's file, the files
    and parts it includes, and the common header (what a wheel must ship)."""
    found = {HEADER}
    todo = [m.file for m in MODULES.values()]
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += _LOCAL.findall((kernels_dir() / name).read_text())
    return tuple(sorted(found))


def _inline_local(text: str, seen: set) -> str:
    """``text`` with each ``#include "X.cu"`` or ``#include "X.cuh"`` replaced by X's text
    (recursively, once per file) and the common header inlined once."""
    def one(m):
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _inline_local((kernels_dir() / name).read_text(), seen)

    text = _LOCAL.sub(one, text)
    if _INCLUDE not in text:
        return text
    if HEADER in seen:
        return text.replace(_INCLUDE + "\n", "", 1)
    seen.add(HEADER)
    return inline_header(text)


def inline_header(text: str, *, what: str = "the source") -> str:
    """``text``, CUDA source that includes the common header, with the header inlined.

    What :func:`source` does to each kernel family; CUDA code outside the library
    that includes ``kvcanary_common.cuh`` gets the same compiled text this way.
    ``what`` names the source in the error raised when it does not include the header.
    """
    if _INCLUDE not in text:
        raise ValueError(f"kvcanary: {what} does not include {HEADER}")
    header = (kernels_dir() / HEADER).read_text()
    header = header.replace("#pragma once\n", "", 1)  # meaningless once inlined
    return text.replace(_INCLUDE, header, 1)
