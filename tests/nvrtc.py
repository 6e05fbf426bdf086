"""NVRTC for the tests that compile kernels without a GPU.

NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel through ``cuda-bindings``
(``pip install "cuda-bindings>=13,<14" "nvidia-cuda-nvrtc>=13,<14"``); no driver is
needed. :func:`compile_cubin` compiles a text as CuPy would (no include path), and the
test skips where NVRTC cannot load.
"""
from __future__ import annotations

import pytest


def nvrtc():
    """``cuda.bindings.nvrtc``, or skip the test."""
    try:
        from cuda.bindings import nvrtc as mod  # noqa: PLC0415
    except ImportError:
        pytest.skip('cuda.bindings is not importable: pip install "cuda-bindings>=13,<14" "nvidia-cuda-nvrtc>=13,<14"')
    try:
        mod.nvrtcVersion()
    except Exception as e:  # noqa: BLE001  (bindings present, libnvrtc missing)
        pytest.skip(f"cuda.bindings cannot load NVRTC ({e}): pip install nvidia-cuda-nvrtc")
    return mod


def _ok(mod, result, what):
    err = result[0] if isinstance(result, tuple) else result
    assert err == mod.nvrtcResult.NVRTC_SUCCESS, f"{what}: {err}"
    return result[1:] if isinstance(result, tuple) else ()


def compile_cubin(src: str, file: str, options, name_expressions, arch: str) -> str:
    """Compile ``src`` (named ``file``) for ``arch`` with every name expression; asserts it
    compiles, lowers each name and makes a cubin. Returns the compile log."""
    mod = nvrtc()
    (prog,) = _ok(mod, mod.nvrtcCreateProgram(src.encode(), file.encode(), 0, [], []), "create")
    try:
        for ne in name_expressions:
            _ok(mod, mod.nvrtcAddNameExpression(prog, ne.encode()), f"add {ne}")
        opts = [o.encode() for o in options] + [f"-arch={arch}".encode()]
        (res,) = mod.nvrtcCompileProgram(prog, len(opts), opts)
        (size,) = _ok(mod, mod.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        mod.nvrtcGetProgramLog(prog, log)
        text = log.decode(errors="replace").strip(" \x00\n")
        assert res == mod.nvrtcResult.NVRTC_SUCCESS, f"{file} for {arch}:\n{text}"
        for ne in name_expressions:
            (lowered,) = _ok(mod, mod.nvrtcGetLoweredName(prog, ne.encode()), f"lowered {ne}")
            assert lowered, ne
        (cubin_size,) = _ok(mod, mod.nvrtcGetCUBINSize(prog), "cubin size")
        assert cubin_size > 0
        return text
    finally:
        mod.nvrtcDestroyProgram(prog)
