"""The backends, and the interface both implement.

``reference`` (NumPy, the oracle), ``numba_cpu`` (the reference's ops compiled for the
CPU, picked with :func:`use_cpu_backend`) and ``cuda`` (CuPy RawModule launches) each
provide the functions of :class:`Backend`. ops.py validates and imports every
argument, then asks the backend of the buffers' device to *prepare* the call; the
prepared :class:`Launch` runs it on a stream as often as the caller repeats the
call with the same arguments. The backends share no code but
:mod:`kvcanary_cupy.format` (and the reference's, for what ``numba_cpu`` leaves to it).
"""
from __future__ import annotations

import functools
import os
from typing import Protocol


class Launch(Protocol):
    """A prepared op call: run it on a stream (a raw ``cudaStream_t``; ``None`` on the CPU)."""

    def __call__(self, stream: int | None) -> None: ...


class Backend(Protocol):
    """What ops.py calls. Arguments are already-validated NumPy / CuPy views and library
    objects on the backend's device (see the ops of the same names); ``stream`` is the
    stream the first launch will run on (for one-time uploads and zeroing)."""

    def prepare_plan(self, vp, wp, *, req_pool_indices, prefix_lens, extend_lens, table, page_size: int, swa,
                     expected, stream: int | None) -> Launch: ...

    def prepare_write(self, canary, wp, *, input_ids, positions, out_cache_loc, log, tag: int, sources, mode,
                      expected_tokens, expected_positions, max_row_tokens: int | None,
                      stream: int | None) -> Launch: ...

    def prepare_verify(self, canary, vp, *, log, tag: int, sources, mode, check_tokens: bool, sample,
                       stream: int | None) -> Launch: ...

    def prepare_plan_and_verify(self, vp, wp, canary, *, req_pool_indices, prefix_lens, extend_lens, table,
                                page_size: int, swa, expected, log, tag: int, sources, mode, check_tokens: bool,
                                sample, stream: int | None) -> Launch:
        """plan then verify in one launch (see ``ops.plan_and_verify``)."""
        ...

    def prepare_plan_verify_write(self, vp, wp, canary, *, req_pool_indices, prefix_lens, extend_lens, table,
                                  page_size: int, swa, expected, log, tag: int, write_tag: int, check_tokens: bool,
                                  input_ids, positions, out_cache_loc, expected_tokens, expected_positions,
                                  stream: int | None) -> Launch:
        """plan, verify and write (no real-KV folds) in one launch (see ``ops.plan_verify_write``)."""
        ...

    def prepare_scatter(self, table, *, tokens, offsets, req_pool_indices, stream: int | None) -> Launch: ...

    def prepare_digest(self, rows, *, out, carry, stream: int | None) -> Launch:
        """``rows``: ``(array, count, gate, salt)`` per row (count and gate: int64 ``[1]`` views or
        None); ``out``: int64 ``[1 + len(carry)]``; ``carry``: int64 view or None. See
        :class:`kvcanary_cupy.digest.Digest`. The launch owns whatever device state it needs."""
        ...

    def prepare_agree(self, gathered, *, rank: int, state, log, tag: int, stream: int | None) -> Launch:
        """``gathered``: int64 ``[world, words]``; ``state``: int64 ``[AGREE_STATE_WORDS]``. See
        :class:`kvcanary_cupy.digest.RankCompare`."""
        ...


CPU_BACKENDS = ("numpy", "numba")
_cpu_choice: list = []  # the CPU backend's name, once chosen (KVCANARY_CPU_BACKEND, else "numpy")


def use_cpu_backend(name: str) -> str:
    """Pick what runs the ops on CPU buffers, for this process; returns the previous choice.

    ``"numpy"`` (the default): the NumPy reference, the oracle. ``"numba"``: the same ops
    compiled by numba (:mod:`.numba_cpu`; the ``numba`` extra), byte for byte the reference's
    results at a fraction of its host time on small steps. The environment variable
    ``KVCANARY_CPU_BACKEND`` sets the choice a process starts with. An op call prepared
    before a change keeps the backend it was prepared with.

    Example::

        >>> import kvcanary_cupy as kc
        >>> previous = kc.use_cpu_backend("numpy")
        >>> kc.use_cpu_backend(previous)
        'numpy'
    """
    if not isinstance(name, str) or name not in CPU_BACKENDS:
        raise ValueError(f"kvcanary: name: expected one of {', '.join(map(repr, CPU_BACKENDS))}, got {name!r}")
    if name == "numba":
        _numba_backend()  # refused here, not at the first op, when numba is missing
    previous = cpu_backend()
    _cpu_choice[:] = [name]
    return previous


def cpu_backend() -> str:
    """The name of the backend that runs the ops on CPU buffers (see :func:`use_cpu_backend`)."""
    if not _cpu_choice:
        name = os.environ.get("KVCANARY_CPU_BACKEND", "numpy") or "numpy"
        if name not in CPU_BACKENDS:
            raise ValueError(f"kvcanary: KVCANARY_CPU_BACKEND: expected one of {', '.join(map(repr, CPU_BACKENDS))}, "
                             f"got {name!r}")
        _cpu_choice[:] = [name]
    return _cpu_choice[0]


@functools.cache  # a failed import is not kept: it is tried again
def _numba_backend():
    try:
        from . import numba_cpu  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"kvcanary: the 'numba' CPU backend needs numba (pip install 'kvcanary_cupy[numba]'): "
                          f"{e}") from e
    return numba_cpu


def backend_for(device: str) -> Backend:
    """The backend of a device string: on ``"cpu"`` the one :func:`use_cpu_backend` picked
    (the NumPy reference unless told otherwise), CUDA otherwise (importing CuPy)."""
    if device == "cpu":
        if cpu_backend() == "numba":
            return _numba_backend()
        from . import reference  # noqa: PLC0415

        return reference
    from . import cuda  # noqa: PLC0415

    return cuda
