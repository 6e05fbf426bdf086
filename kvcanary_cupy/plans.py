"""VerifyPlan, WritePlan and the options that travel with a plan.

Plans own their output buffers. Every capacity is a property read off the
arrays, so a capacity computed from one pool can never be paired with arrays
allocated for another.
"""
from __future__ import annotations


from dataclasses import dataclass, field

import numpy as np

from . import arrays, runtime, scalars
from .format import INPUT_ERROR_FIELDS, INPUT_ERROR_WORDS
from .launch_cache import LaunchCache

_I64 = arrays.INT64


def _own_fields(obj, lengths: dict) -> None:
    """Import and check every array field of a plan object, in place (the one code path
    of its constructor, ``allocate`` and ``from_buffers``).

    ``lengths`` maps each field to the length it must have. Every field is a writable,
    C-contiguous int64 vector on one device, and no two fields share memory: the kernels
    write all of them at raw addresses, so a short, strided, read-only or aliased array
    would be read and written past its end or race with another field.
    """
    cls_name = type(obj).__name__
    views = {}
    for name in lengths:
        views[name] = arrays.as_array(getattr(obj, name), f"{cls_name}.{name}", dtypes=_I64, ndim=1)
    device = runtime.device_of(next(iter(views.values())))
    for name, v in views.items():
        arrays.check_array(v, f"{cls_name}.{name}", device=device, writable=True)
    bad = [f"{name} has length {views[name].shape[0]}, expected {want}"
           for name, want in lengths.items() if views[name].shape[0] != want]
    if bad:
        raise ValueError(f"kvcanary: {cls_name}: arrays disagree: " + "; ".join(bad))
    arrays.check_disjoint(cls_name, views)
    for name, v in views.items():
        object.__setattr__(obj, name, v)
    arrays.hold(obj, cls_name, views)


def _length(obj, name: str, cls_name: str) -> int:
    """The length of a vector field before it is imported (it sets the others' lengths)."""
    v = arrays.as_array(getattr(obj, name), f"{cls_name}.{name}", dtypes=_I64, ndim=1)
    return int(v.shape[0])


def decode_input_error(words) -> dict | None:
    """A plan's ``first_input_error`` words as a dict of ``format.INPUT_ERROR_FIELDS``, or None
    when the plan dropped no row.

    Example::

        >>> decode_input_error([2, 5, 40, 1, -1, -1])["prefix_len"], decode_input_error([-1] * 6)
        (40, None)
    """
    if int(words[0]) < 0:  # every clean plan: no row dropped
        return None
    return dict(zip(INPUT_ERROR_FIELDS, (int(w) for w in words)))


def describe_input_error(e: dict, *, request=None, page_size: int = 1) -> str:
    """One line on a dropped row: which batch row (and request, when known), and what of its
    input was out of range (the table entry at fault, when its lengths were in range).

    Example::

        >>> describe_input_error(dict(batch_row=1, request_row=3, prefix_len=4, extend_len=1, position=2,
        ...                           table_value=-1), request="b")
        "batch row 1 (request 'b'), request-table row 3, prefix 4, extend 1: the table entry for position 2 is -1 (unreadable)"
    """
    who = f"batch row {e['batch_row']}" + (f" (request {request!r})" if request is not None else "")
    head = f"{who}, request-table row {e['request_row']}, prefix {e['prefix_len']}, extend {e['extend_len']}"
    if e["position"] < 0:
        return head + ": the request-table row or the lengths lie outside the tables"
    entry = "table entry" if page_size == 1 else f"block-table entry (page {e['position'] // page_size})"
    return head + f": the {entry} for position {e['position']} is {e['table_value']} (unreadable)"


@arrays.fixed
@dataclass(frozen=True, eq=False)
class VerifyPlan:
    """The records one step must check: one entry per (request, position) it reads.

    Arrays (int64; NumPy on ``"cpu"``, CuPy on CUDA):
        slot_indices, prev_slot_indices, expected_positions, expected_tokens:
            ``[capacity]``; entry i checks slot ``slot_indices[i]`` against its
            predecessor ``prev_slot_indices[i]`` (-1: the sequence's first token).
            Only the first ``num_valid`` are defined (the CUDA backend may use the rest
            as scratch on a step with unreadable rows); an overflowed plan writes none.
        offsets: ``[max_batch + 1]``, exclusive prefix sums of entries per batch row;
            rows past the batch repeat the total, so the array is monotone throughout.
        num_valid, enable, requested, input_errors, overflows, max_requested:
            device scalars ``[1]``: entries written, 1 unless the batch overflowed
            the capacity (0 too until the first plan), entries the batch asked for;
            then, cumulative over plans so a report read late loses nothing: rows
            dropped for out-of-range data, plans that overflowed, and the most
            entries any plan asked for (what the capacity must be to hold them all).
        first_input_error: ``[6]``, where the latest plan's first dropped row went wrong
            (``format.INPUT_ERROR_FIELDS``): its batch row (-1: no row was dropped),
            request-table row, prefix and extend lengths, and, when those were in range,
            the first position it reads whose table entry is unreadable and that entry
            (else -1, -1). Written by every plan; :meth:`host_first_input_error` reads it.
        launches: the prepared plan calls made with this plan as owner
            (:class:`~kvcanary_cupy.launch_cache.LaunchCache`); they go with it.

    Example::

        >>> vp = VerifyPlan.allocate(capacity=4096, max_batch=8, device="cpu")
        >>> vp.capacity, vp.max_batch
        (4096, 8)
    """

    slot_indices: object
    prev_slot_indices: object
    expected_positions: object
    expected_tokens: object
    offsets: object
    num_valid: object
    enable: object
    requested: object
    input_errors: object
    overflows: object
    max_requested: object
    first_input_error: object = None
    launches: LaunchCache = field(default_factory=LaunchCache, init=False, repr=False, compare=False)

    ENTRY_FIELDS = ("slot_indices", "prev_slot_indices", "expected_positions", "expected_tokens")
    SCALAR_FIELDS = ("num_valid", "enable", "requested", "input_errors", "overflows", "max_requested")
    FIELDS = ENTRY_FIELDS + ("offsets",) + SCALAR_FIELDS + ("first_input_error",)

    def __post_init__(self):
        cap = _length(self, "slot_indices", "VerifyPlan")
        mb = _length(self, "offsets", "VerifyPlan") - 1
        if mb < 1:
            raise ValueError(f"kvcanary: VerifyPlan: offsets has length {mb + 1}, expected max_batch + 1 >= 2")
        if self.first_input_error is None:  # not given: one of its own, beside the offsets
            dev = runtime.device_of(arrays.as_array(self.offsets, "VerifyPlan.offsets", dtypes=_I64))
            object.__setattr__(self, "first_input_error", runtime.empty((INPUT_ERROR_WORDS,), np.int64, dev, fill=-1))
        _own_fields(self, {f: cap for f in self.ENTRY_FIELDS} | {"offsets": mb + 1}
                    | {f: 1 for f in self.SCALAR_FIELDS} | {"first_input_error": INPUT_ERROR_WORDS})

    @classmethod
    def allocate(cls, *, capacity: int, max_batch: int, device: str = "cpu") -> "VerifyPlan":
        """A plan with ``capacity`` entries for batches of up to ``max_batch`` rows, never
        planned (``enable`` 0: a verify of it is counted in ``verifies_skipped``)."""
        capacity = scalars.check_int(capacity, "capacity", minimum=0)
        max_batch = scalars.check_int(max_batch, "max_batch", minimum=1)
        e = {f: runtime.empty((capacity,), np.int64, device, fill=-1) for f in cls.ENTRY_FIELDS}
        s = {f: runtime.empty((1,), np.int64, device, fill=0) for f in cls.SCALAR_FIELDS}
        return cls(offsets=runtime.empty((max_batch + 1,), np.int64, device, fill=0), **e, **s)

    @classmethod
    def from_buffers(cls, *, slot_indices, prev_slot_indices, expected_positions, expected_tokens,
                     offsets, num_valid, enable, requested, input_errors, overflows=None,
                     max_requested=None, first_input_error=None) -> "VerifyPlan":
        """Wrap caller-owned int64 arrays (e.g. from a graph pool) after checking they agree
        (the same checks as the constructor). ``overflows``, ``max_requested`` and
        ``first_input_error`` may be omitted: they are then allocated beside the caller's
        arrays (zeroed scalars; no input error)."""
        dev = runtime.device_of(arrays.as_array(offsets, "VerifyPlan.offsets", dtypes=_I64))
        return cls(slot_indices=slot_indices, prev_slot_indices=prev_slot_indices,
                   expected_positions=expected_positions, expected_tokens=expected_tokens, offsets=offsets,
                   num_valid=num_valid, enable=enable, requested=requested, input_errors=input_errors,
                   overflows=runtime.empty((1,), np.int64, dev, fill=0) if overflows is None else overflows,
                   max_requested=runtime.empty((1,), np.int64, dev, fill=0) if max_requested is None
                   else max_requested, first_input_error=first_input_error)

    @property
    def capacity(self) -> int:
        return int(self.slot_indices.shape[0])

    @property
    def max_batch(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def device(self) -> str:
        return runtime.device_of(self.offsets)

    def host_scalars(self) -> dict:
        """``num_valid``, ``enable``, ``requested``, ``input_errors`` as ints (synchronizes)."""
        return {f: int(runtime.to_host(getattr(self, f))[0]) for f in self.SCALAR_FIELDS}

    def host_first_input_error(self) -> dict | None:
        """Where the latest plan's first dropped row went wrong (see ``first_input_error``), as
        a dict of ``format.INPUT_ERROR_FIELDS``, or None when it dropped none (synchronizes)."""
        return decode_input_error(runtime.to_host(self.first_input_error))

    def host_entries(self) -> dict:
        """The first ``num_valid`` entries of each entry array, as NumPy (synchronizes)."""
        n = self.host_scalars()["num_valid"] if self.host_scalars()["enable"] else 0
        return {f: np.array(runtime.to_host(getattr(self, f)[:n])) for f in self.ENTRY_FIELDS}


@arrays.fixed
@dataclass(frozen=True, eq=False)
class WritePlan:
    """Where a step's new tokens go: per batch row, its span and its chain seed.

    Arrays (int64):
        offsets: ``[max_batch + 1]``, exclusive prefix sums of tokens written per row.
        seed_slots: ``[max_batch]``, the slot of the row's last prefix token (-1: none, the row starts
            its chain; SEED_SKIP: the row stamps nothing, see :func:`kvcanary_cupy.plan`).
        num_rows: device scalar ``[1]``, the batch size planned; -1 until the
            first plan (a write then stamps nothing and counts ``writes_skipped``).
        input_errors: device scalar ``[1]``, rows dropped for out-of-range data
            (cumulative, like ``VerifyPlan.input_errors``).
        position_check: device scalar ``[1]``; 1 turns on write's chain-position
            check. Device-resident, so a captured graph can be warmed up with it off
            and replayed with it on.
        launches: the prepared plan calls made with this plan as owner (when no
            verify plan is passed); they go with it.

    Example::

        >>> wp = WritePlan.allocate(max_batch=8, device="cpu")
        >>> wp.max_batch
        8
    """

    offsets: object
    seed_slots: object
    num_rows: object
    input_errors: object
    position_check: object
    launches: LaunchCache = field(default_factory=LaunchCache, init=False, repr=False, compare=False)

    SCALAR_FIELDS = ("num_rows", "input_errors", "position_check")
    FIELDS = ("offsets", "seed_slots") + SCALAR_FIELDS

    def __post_init__(self):
        mb = _length(self, "seed_slots", "WritePlan")
        if mb < 1:
            raise ValueError("kvcanary: WritePlan: seed_slots has length 0, expected max_batch >= 1")
        _own_fields(self, {"offsets": mb + 1, "seed_slots": mb, "num_rows": 1, "input_errors": 1,
                           "position_check": 1})

    @classmethod
    def allocate(cls, *, max_batch: int, device: str = "cpu") -> "WritePlan":
        """A write plan for up to ``max_batch`` rows, never planned (``num_rows`` -1: a
        write with it stamps nothing and is counted in ``writes_skipped``)."""
        max_batch = scalars.check_int(max_batch, "max_batch", minimum=1)
        return cls(offsets=runtime.empty((max_batch + 1,), np.int64, device, fill=0),
                   seed_slots=runtime.empty((max_batch,), np.int64, device, fill=-1),
                   num_rows=runtime.empty((1,), np.int64, device, fill=-1),
                   input_errors=runtime.empty((1,), np.int64, device, fill=0),
                   position_check=runtime.empty((1,), np.int64, device, fill=1))

    @classmethod
    def from_buffers(cls, *, offsets, seed_slots, num_rows, input_errors=None, position_check=None) -> "WritePlan":
        """Wrap caller-owned int64 arrays after checking they agree.

        ``input_errors`` and ``position_check`` may be omitted: device scalars (0 and
        1) are then allocated beside the caller's arrays.
        """
        dev = runtime.device_of(arrays.as_array(seed_slots, "WritePlan.seed_slots", dtypes=_I64))
        if input_errors is None:
            input_errors = runtime.empty((1,), np.int64, dev, fill=0)
        if position_check is None:
            position_check = runtime.empty((1,), np.int64, dev, fill=1)
        return cls(offsets=offsets, seed_slots=seed_slots, num_rows=num_rows, input_errors=input_errors,
                   position_check=position_check)

    @property
    def max_batch(self) -> int:
        return int(self.seed_slots.shape[0])

    @property
    def device(self) -> str:
        return runtime.device_of(self.offsets)

    def set_position_check(self, on: bool) -> None:
        """Flip the chain-position switch (an ordinary device write, no sync)."""
        on = scalars.check_flag(on, "on")
        self._held.check()
        self.position_check.fill(1 if on else 0)


@arrays.fixed
@dataclass(frozen=True, eq=False)
class SwaWindow:
    """A sliding window: only the last ``size`` prefix positions are read, and every
    slot read from the table goes through ``lut`` (full-pool slot -> SWA-pool slot).

    Args:
        size: window length in tokens, >= 1.
        lut: int32 / int64 ``[num_full_slots]`` translation table, at least one entry;
            or ``None``: the table's slots are the pool's own (a pool that is itself a
            window's), read as they are.
    """

    size: int
    lut: object = None

    def __post_init__(self):
        object.__setattr__(self, "size", scalars.check_int(self.size, "SwaWindow.size", minimum=1))
        if self.lut is None:
            arrays.hold(self, "SwaWindow", {}, written=())
            return
        lut = arrays.as_index_array(self.lut, "SwaWindow.lut")
        if lut.shape[0] < 1:
            raise ValueError("kvcanary: SwaWindow.lut: expected at least one entry (one per full-pool slot), got "
                             "an empty array")
        object.__setattr__(self, "lut", lut)
        arrays.hold(self, "SwaWindow", {"lut": lut}, written=())


@arrays.fixed
@dataclass(frozen=True, eq=False)
class ExpectedTokens:
    """Token ids each request must hold, for the token check.

    Args:
        table: int32 / int64 ``[num_requests, width]``, indexed like the slot table
            by ``req_pool_indices``; the expected token at position ``pos`` is
            ``table[rp, pos + offset]``.
        valid_lens: int32 / int64 ``[>= batch]``, per batch row: positions at or past
            ``valid_lens[r] - offset`` are not checked.
        offset: 0 (a target pool: slot ``pos`` holds token ``pos``) or 1 (an
            EAGLE-style draft pool whose slot ``pos`` holds token ``pos + 1``);
            nothing else.
    """

    table: object
    valid_lens: object
    offset: int = 0

    def __post_init__(self):
        table = arrays.as_index_array(self.table, "ExpectedTokens.table", ndim=2)
        valid_lens = arrays.as_index_array(self.valid_lens, "ExpectedTokens.valid_lens")
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "valid_lens", valid_lens)
        object.__setattr__(self, "offset", check_token_offset(self.offset, "ExpectedTokens.offset"))
        arrays.hold(self, "ExpectedTokens", {"table": table, "valid_lens": valid_lens}, written=())


@arrays.fixed
@dataclass(frozen=True, eq=False)
class FingerprintSampler:
    """Sampled real-KV verification: each verify checks fingerprints of the slots with
    ``slot % period == phase`` and then advances the phase, on the device, so a
    captured graph covers every slot over ``period`` replays. Chain, position and
    token checks still run on every entry.

    Arrays: ``state`` int64 ``[2]`` (phase counter, completion ticket).
    """

    period: int
    state: object

    FIELDS = ("state",)

    def __post_init__(self):
        object.__setattr__(self, "period", scalars.check_int(self.period, "period", minimum=1))
        _own_fields(self, {"state": 2})

    @classmethod
    def allocate(cls, *, period: int, device: str = "cpu") -> "FingerprintSampler":
        period = scalars.check_int(period, "period", minimum=1)
        return cls(period, runtime.empty((2,), np.int64, device, fill=0))

    @property
    def device(self) -> str:
        return runtime.device_of(self.state)

    def phase(self) -> int:
        """The phase the next verify uses (synchronizes)."""
        return int(runtime.to_host(self.state)[0]) % self.period


def check_token_offset(offset, name: str) -> int:
    """The expected-token offset: 0 or 1 (see :class:`ExpectedTokens`)."""
    v = scalars.check_int(offset, name)
    if v not in (0, 1):
        raise ValueError(f"kvcanary: {name}: expected 0 (target pool) or 1 (draft pool holding the next token), "
                         f"got {v}")
    return v
