"""Shared test fixtures: the ``gpu`` marker, the array-module parameter ``xp``, the chain kind."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    try:
        import cupy  # noqa: PLC0415

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001  (no CuPy, no driver, no device: all mean "no GPU")
        return False


def pytest_configure(config):
    # Under compute-sanitizer, give every CuPy array its own allocation so memcheck sees any
    # overrun (the memory pool would hide one that stays inside a pooled block).
    if os.environ.get("KVCANARY_CUPY_POOL") == "0" and cuda_available():
        import cupy  # noqa: PLC0415

        cupy.cuda.set_allocator(None)


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device visible to CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["numpy", "numba", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module a test runs on: NumPy always, CuPy where a GPU is visible. NumPy runs
    twice: on the NumPy reference, and on the numba-compiled CPU backend (``"numba"``)."""
    if request.param == "cupy":
        import cupy  # noqa: PLC0415

        return cupy
    _use_cpu_backend(request, "numba" if request.param == "numba" else "numpy")
    return np


@pytest.fixture(params=["numpy", "numba"])
def cpu_backend(request):
    """Runs a test once per CPU backend (the NumPy reference, numba's compiled ops): a module
    opts in with ``pytestmark = pytest.mark.usefixtures("cpu_backend")``."""
    _use_cpu_backend(request, request.param)
    return request.param


def _use_cpu_backend(request, name: str) -> None:
    """The test runs with ``name`` as the CPU backend (skipped without numba where it is
    ``"numba"``); the previous choice comes back after it."""
    if name == "numba":
        pytest.importorskip("numba")
    from kvcanary_cupy import use_cpu_backend  # noqa: PLC0415

    previous = use_cpu_backend(name)
    request.addfinalizer(lambda: use_cpu_backend(previous))


@pytest.fixture
def device(xp):
    """The device string matching ``xp``."""
    return "cpu" if xp is np else "cuda"


@pytest.fixture(params=["scan", "sglang"])
def chain_kind(request):
    """Runs a test once per chain kind: the oracles and canaries of ``tests.workloads``
    follow it (a module opts in with ``pytestmark = pytest.mark.usefixtures("chain_kind")``)."""
    from tests import workloads  # noqa: PLC0415

    saved, workloads.CHAIN = workloads.CHAIN, request.param
    yield request.param
    workloads.CHAIN = saved
