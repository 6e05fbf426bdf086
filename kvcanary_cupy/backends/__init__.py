"""The backends, and the interface both implement.

``reference`` (NumPy, the oracle) and ``cuda`` (CuPy RawModule launches) each
provide the functions of :class:`Backend`. ops.py validates and imports every
argument, then asks the backend of the buffers' device to *prepare* the call; the
prepared :class:`Launch` runs it on a stream as often as the caller repeats the
call with the same arguments. The backends share no code but
:mod:`kvcanary_cupy.format`.
"""
from __future__ import annotations

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


def backend_for(device: str) -> Backend:
    """The backend of a device string: the NumPy reference on ``"cpu"``, CUDA otherwise
    (importing CuPy)."""
    if device == "cpu":
        from . import reference  # noqa: PLC0415

        return reference
    from . import cuda  # noqa: PLC0415

    return cuda
