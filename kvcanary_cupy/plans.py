"""VerifyPlan, WritePlan and the options that travel with a plan.

Plans own their output buffers. Every capacity is a property read off the
arrays, so a capacity computed from one pool can never be paired with arrays
allocated for another.
"""
from __future__ import annotations


from dataclasses import dataclass

import numpy as np

from . import arrays

_I64 = arrays.INT64


def _check_fields(cls_name: str, fields: dict, lengths: dict, device_hint=None):
    """Import every field, check dtype/rank/device, and name each length that disagrees."""
    views = {}
    for name, obj in fields.items():
        views[name] = arrays.as_array(obj, f"{cls_name}.{name}", dtypes=_I64, ndim=1)
    device = arrays.device_of(next(iter(views.values()))) if device_hint is None else device_hint
    for name, v in views.items():
        arrays.check_array(v, f"{cls_name}.{name}", device=device, contiguous=False)
    bad = [f"{name} has length {views[name].shape[0]}, expected {want}"
           for name, want in lengths.items() if views[name].shape[0] != want]
    if bad:
        raise ValueError(f"kvcanary: {cls_name}.from_buffers: arrays disagree: " + "; ".join(bad))
    return views


@dataclass(frozen=True, eq=False)
class VerifyPlan:
    """The records one step must check: one entry per (request, position) it reads.

    Arrays (int64; NumPy on ``"cpu"``, CuPy on CUDA):
        slot_indices, prev_slot_indices, expected_positions, expected_tokens:
            ``[capacity]``; entry i checks slot ``slot_indices[i]`` against its
            predecessor ``prev_slot_indices[i]`` (-1: the sequence's first token).
        offsets: ``[max_batch + 1]``, exclusive prefix sums of entries per batch row;
            rows past the batch repeat the total, so the array is monotone throughout.
        num_valid, enable, requested, input_errors: device scalars ``[1]``:
            entries written, 1 unless the batch overflowed the capacity, entries the
            batch asked for, and rows dropped for out-of-range data (cumulative over
            plans, so a report read late loses nothing).

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

    ENTRY_FIELDS = ("slot_indices", "prev_slot_indices", "expected_positions", "expected_tokens")
    SCALAR_FIELDS = ("num_valid", "enable", "requested", "input_errors")

    @classmethod
    def allocate(cls, *, capacity: int, max_batch: int, device: str = "cpu") -> "VerifyPlan":
        capacity, max_batch = int(capacity), int(max_batch)
        if capacity < 0:
            raise ValueError(f"kvcanary: capacity: expected >= 0, got {capacity}")
        if max_batch < 1:
            raise ValueError(f"kvcanary: max_batch: expected >= 1, got {max_batch}")
        e = {f: arrays.empty((capacity,), np.int64, device, fill=-1) for f in cls.ENTRY_FIELDS}
        s = {f: arrays.empty((1,), np.int64, device, fill=0) for f in cls.SCALAR_FIELDS}
        return cls(offsets=arrays.empty((max_batch + 1,), np.int64, device, fill=0), **e, **s)

    @classmethod
    def from_buffers(cls, *, slot_indices, prev_slot_indices, expected_positions, expected_tokens,
                     offsets, num_valid, enable, requested, input_errors) -> "VerifyPlan":
        """Wrap caller-owned int64 arrays (e.g. from a graph pool) after checking they agree."""
        fields = dict(slot_indices=slot_indices, prev_slot_indices=prev_slot_indices,
                      expected_positions=expected_positions, expected_tokens=expected_tokens,
                      offsets=offsets, num_valid=num_valid, enable=enable, requested=requested,
                      input_errors=input_errors)
        cap = int(getattr(slot_indices, "shape", [0])[0])
        lengths = {f: cap for f in cls.ENTRY_FIELDS} | {f: 1 for f in cls.SCALAR_FIELDS}
        views = _check_fields("VerifyPlan", fields, lengths)
        if views["offsets"].shape[0] < 2:
            raise ValueError(
                f"kvcanary: VerifyPlan.from_buffers: offsets has length {views['offsets'].shape[0]}, "
                "expected max_batch + 1 >= 2")
        return cls(**views)

    @property
    def capacity(self) -> int:
        return int(self.slot_indices.shape[0])

    @property
    def max_batch(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def device(self) -> str:
        return arrays.device_of(self.offsets)

    def host_scalars(self) -> dict:
        """``num_valid``, ``enable``, ``requested``, ``input_errors`` as ints (synchronizes)."""
        return {f: int(arrays.to_host(getattr(self, f))[0]) for f in self.SCALAR_FIELDS}

    def host_entries(self) -> dict:
        """The first ``num_valid`` entries of each entry array, as NumPy (synchronizes)."""
        n = self.host_scalars()["num_valid"] if self.host_scalars()["enable"] else 0
        return {f: np.array(arrays.to_host(getattr(self, f)[:n])) for f in self.ENTRY_FIELDS}


@dataclass(frozen=True, eq=False)
class WritePlan:
    """Where a step's new tokens go: per batch row, its span and its chain seed.

    Arrays (int64):
        offsets: ``[max_batch + 1]``, exclusive prefix sums of tokens written per row.
        seed_slots: ``[max_batch]``, the slot of the row's last prefix token (-1: none).
        num_rows: device scalar ``[1]``, the batch size planned.
        input_errors: device scalar ``[1]``, rows dropped for out-of-range data
            (cumulative, like ``VerifyPlan.input_errors``).
        position_check: device scalar ``[1]``; 1 turns on write's chain-position
            check. Device-resident, so a captured graph can be warmed up with it off
            and replayed with it on.

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

    @classmethod
    def allocate(cls, *, max_batch: int, device: str = "cpu") -> "WritePlan":
        max_batch = int(max_batch)
        if max_batch < 1:
            raise ValueError(f"kvcanary: max_batch: expected >= 1, got {max_batch}")
        return cls(offsets=arrays.empty((max_batch + 1,), np.int64, device, fill=0),
                   seed_slots=arrays.empty((max_batch,), np.int64, device, fill=-1),
                   num_rows=arrays.empty((1,), np.int64, device, fill=0),
                   input_errors=arrays.empty((1,), np.int64, device, fill=0),
                   position_check=arrays.empty((1,), np.int64, device, fill=1))

    @classmethod
    def from_buffers(cls, *, offsets, seed_slots, num_rows, input_errors=None, position_check=None) -> "WritePlan":
        """Wrap caller-owned int64 arrays after checking they agree.

        ``input_errors`` and ``position_check`` may be omitted: device scalars (0 and
        1) are then allocated beside the caller's arrays.
        """
        given = dict(offsets=offsets, seed_slots=seed_slots, num_rows=num_rows,
                     input_errors=input_errors, position_check=position_check)
        fields = {k: v for k, v in given.items() if v is not None}
        mb = int(getattr(seed_slots, "shape", [0])[0])
        lengths = {"offsets": mb + 1, "seed_slots": mb, "num_rows": 1, "input_errors": 1, "position_check": 1}
        views = _check_fields("WritePlan", fields, {k: v for k, v in lengths.items() if k in fields})
        if mb < 1:
            raise ValueError("kvcanary: WritePlan.from_buffers: seed_slots has length 0, expected max_batch >= 1")
        dev = arrays.device_of(views["offsets"])
        views.setdefault("input_errors", arrays.empty((1,), np.int64, dev, fill=0))
        views.setdefault("position_check", arrays.empty((1,), np.int64, dev, fill=1))
        return cls(**views)

    @property
    def max_batch(self) -> int:
        return int(self.seed_slots.shape[0])

    @property
    def device(self) -> str:
        return arrays.device_of(self.offsets)

    def set_position_check(self, on: bool) -> None:
        """Flip the chain-position switch (an ordinary device write, no sync)."""
        self.position_check.fill(1 if on else 0)


@dataclass(frozen=True, eq=False)
class SwaWindow:
    """A sliding window: only the last ``size`` prefix positions are read, and every
    slot read from the table goes through ``lut`` (full-pool slot -> SWA-pool slot).

    Args:
        size: window length in tokens, >= 1.
        lut: int32 / int64 ``[num_full_slots]`` translation table.
    """

    size: int
    lut: object

    def __post_init__(self):
        if int(self.size) < 1:
            raise ValueError(f"kvcanary: SwaWindow.size: expected >= 1, got {self.size}")
        object.__setattr__(self, "size", int(self.size))
        object.__setattr__(self, "lut", arrays.as_index_array(self.lut, "SwaWindow.lut"))


@dataclass(frozen=True, eq=False)
class ExpectedTokens:
    """Token ids each request must hold, for the token check.

    Args:
        table: int32 / int64 ``[num_requests, width]``, indexed like the slot table
            by ``req_pool_indices``; the expected token at position ``pos`` is
            ``table[rp, pos + offset]``.
        valid_lens: int32 / int64 ``[>= batch]``, per batch row: positions at or past
            ``valid_lens[r] - offset`` are not checked.
        offset: 0, or +1 for a draft pool that stores the next token.
    """

    table: object
    valid_lens: object
    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "table", arrays.as_index_array(self.table, "ExpectedTokens.table", ndim=2))
        object.__setattr__(self, "valid_lens", arrays.as_index_array(self.valid_lens, "ExpectedTokens.valid_lens"))
        object.__setattr__(self, "offset", int(self.offset))


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

    @classmethod
    def allocate(cls, *, period: int, device: str = "cpu") -> "FingerprintSampler":
        if int(period) < 1:
            raise ValueError(f"kvcanary: period: expected >= 1, got {period}")
        return cls(int(period), arrays.empty((2,), np.int64, device, fill=0))

    @property
    def device(self) -> str:
        return arrays.device_of(self.state)

    def phase(self) -> int:
        """The phase the next verify uses (synchronizes)."""
        return int(arrays.to_host(self.state)[0]) % self.period


