"""Digest and RankCompare: the two device ops tensor-parallel agreement is made of.

A :class:`Digest` folds a fixed set of device arrays into one int64 digest, on the
device, into a preallocated scalar: the wrapping sum, over every element, of
``mix3(salt, index, value)`` (plus ``mix3(salt, -1, count)`` per row). A sum does
not depend on the order parallel blocks add into it, so the CUDA kernel and the
NumPy reference write the same bytes; the per-element hash makes a changed, moved,
missing or extra element change the digest (two different inputs collide with
probability about 2**-64). Values are read as int64, so an int32 and an int64 copy
of the same numbers digest alike.

A :class:`RankCompare` reads what the ranks of a group gathered from each other
(per rank: its digest, then its violation log's head) and, on the device, names
every rank whose digest differs from the majority's in a RANK_DIVERGENCE row of
the log (tag TP_AGREE by default, layout in ``format.DIVERGENCE_COLUMNS``), and
keeps the group's tally (``format.AGREE_STATE_FIELDS``).

Both are prepared once and then cost one launch per :meth:`run`: no allocation,
no host sync, a grid that never depends on data, so a step that runs them can be
captured in a CUDA graph (run each once before the capture: the first run
uploads the descriptor table). :mod:`kvcanary_cupy.distributed` puts them around
one collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import arrays, runtime, scalars
from .backends import backend_for
from .format import AGREE_STATE_FIELDS, AGREE_STATE_WORDS, MAX_DIGEST_ROWS, MAX_RANKS, LaunchTag
from .violations import ViolationLog

_INT64_MIN = -(1 << 63)


@dataclass(frozen=True, eq=False)
class DigestRow:
    """One array a :class:`Digest` covers.

    Args:
        array: int32 / int64 ``[n]``, C-contiguous, on the digest's device.
        count: an int64 ``[1]`` device scalar holding how many leading elements count
            (clamped to ``[0, n]``); None: all ``n``. E.g. a verify plan's ``num_valid``.
        gate: an int64 ``[1]`` device scalar; the row counts no element unless it holds 1
            (e.g. a verify plan's ``enable``: an overflowed plan wrote no entries). None: no gate.
        salt: an int64 that tells this row from the others (the same values in two rows
            with different salts digest differently); default: the row's position + 1.
    """

    array: object
    count: object = None
    gate: object = None
    salt: int | None = None


class Digest:
    """An order-independent digest of a fixed set of device arrays, into ``out[0]``.

    Args:
        rows: :class:`DigestRow` s (or bare arrays); salts must differ.
        out: int64 ``[1 + len(carry)]``, writable: receives the digest (the uint64
            sum's bits), then ``carry`` verbatim.
        carry: optional int64 ``[k]`` copied after the digest by the same launch (the
            agreement carries the log head, so one collective moves both).

    Example::

        >>> import numpy as np
        >>> out = np.zeros(1, np.int64)
        >>> d = Digest([np.array([1, 2, 3]), np.array([7], np.int32)], out=out)
        >>> d.run(); first = int(out[0])
        >>> d2 = Digest([np.array([1, 2, 3], np.int32), np.array([7])], out=np.zeros(1, np.int64))
        >>> d2.run(); first == int(d2.out[0])  # the values matter, not their width
        True
    """

    def __init__(self, rows: Sequence, *, out, carry=None):
        if not isinstance(rows, (list, tuple)):
            raise TypeError(f"kvcanary: rows: expected a list of DigestRow, got {type(rows).__name__}")
        if len(rows) > MAX_DIGEST_ROWS:
            raise ValueError(f"kvcanary: rows: expected at most {MAX_DIGEST_ROWS} rows, got {len(rows)}")
        self.out = arrays.as_array(out, "out", dtypes=arrays.INT64, ndim=1, writable=True)
        self.device = runtime.device_of(self.out)
        self.carry = None
        if carry is not None:
            self.carry = arrays.as_array(carry, "carry", dtypes=arrays.INT64, ndim=1, device=self.device)
        words = 1 + (0 if self.carry is None else int(self.carry.shape[0]))
        if self.out.shape[0] != words:
            raise ValueError(f"kvcanary: out: expected length 1 + len(carry) = {words}, got {self.out.shape[0]}")
        views, seen, named = [], {}, {"out": self.out}
        for i, row in enumerate(rows):
            if not isinstance(row, DigestRow):
                row = DigestRow(row)
            name = f"rows[{i}]"
            data = arrays.as_index_array(row.array, f"{name}.array", device=self.device)
            count = None if row.count is None else _device_scalar(row.count, f"{name}.count", self.device)
            gate = None if row.gate is None else _device_scalar(row.gate, f"{name}.gate", self.device)
            salt = i + 1 if row.salt is None else scalars.check_int(row.salt, f"{name}.salt", minimum=_INT64_MIN)
            if salt in seen:
                raise ValueError(f"kvcanary: {name}.salt: {salt} is also rows[{seen[salt]}]'s; expected a salt per row "
                                 "(rows that share one can trade values unseen)")
            seen[salt] = i
            views.append((data, count, gate, salt))
            named.update({f"{name}.array": data, f"{name}.count": count, f"{name}.gate": gate})
        # The digest's own output must not be one of its inputs: the launch would read what it writes.
        for name, a in named.items():
            if name != "out" and a is not None:
                arrays.check_disjoint("Digest", {"out": self.out, name: a})
        if self.carry is not None:
            arrays.check_disjoint("Digest", {"out": self.out, "carry": self.carry})
        self.rows = tuple(views)
        self._given = tuple(rows)  # the caller's objects: their memory must outlive every launch
        self._launch = None

    def run(self, stream=None) -> None:
        """Digest the rows as they are now (on CUDA: in stream order on ``stream``)."""
        ptr = None if runtime.is_cpu(self.device) else runtime.resolve_stream(stream, ())
        if self._launch is None:
            self._launch = backend_for(self.device).prepare_digest(self.rows, out=self.out, carry=self.carry,
                                                                   stream=ptr)
        self._launch(ptr)


class RankCompare:
    """Compare the digests a group gathered; report divergent ranks in ``log``.

    Args:
        gathered: int64 ``[world, words]`` (``words >= 2``), per rank its digest then its
            log head; ``1 <= world <= format.MAX_RANKS``.
        rank: this rank's index in ``gathered``.
        state: int64 ``[format.AGREE_STATE_WORDS]`` (see :meth:`allocate_state`), kept across
            runs: ``group_rows``, ``divergences``, ``agreement_steps``, ``agreed_head``,
            ``own_rows`` (``format.AGREE_STATE_FIELDS``).
        log: the :class:`ViolationLog` divergence rows go to.
        tag: the rows' tag (default ``LaunchTag.TP_AGREE``).

    The majority digest is the one most ranks hold, the lowest rank's on a tie (two
    ranks that disagree: rank 0's). Each rank holding another digest gets a row.

    Example::

        >>> import numpy as np, kvcanary_cupy as kc
        >>> log = kc.ViolationLog.allocate(capacity=8)
        >>> gathered = np.array([[11, 0], [99, 0], [11, 0]])  # rank 1 digested something else
        >>> RankCompare(gathered, rank=0, state=RankCompare.allocate_state("cpu"), log=log).run()
        >>> v = log.read()[0]
        >>> v.rank, v.reference_rank, v.agreement_step
        (1, 0, 1)
    """

    def __init__(self, gathered, *, rank: int, state, log: ViolationLog, tag: int = LaunchTag.TP_AGREE):
        self.gathered = arrays.as_array(gathered, "gathered", dtypes=arrays.INT64, ndim=2)
        self.device = runtime.device_of(self.gathered)
        world, words = (int(x) for x in self.gathered.shape)
        if not 1 <= world <= MAX_RANKS or words < 2:
            raise ValueError(f"kvcanary: gathered: expected shape [world in [1, {MAX_RANKS}], words >= 2] (per rank "
                             f"its digest and its log head), got {tuple(self.gathered.shape)}")
        self.rank = scalars.check_int(rank, "rank", minimum=0, maximum=world - 1)
        self.state = arrays.as_array(state, "state", dtypes=arrays.INT64, ndim=1, device=self.device, writable=True)
        if self.state.shape[0] != AGREE_STATE_WORDS:
            raise ValueError(f"kvcanary: state: expected length {AGREE_STATE_WORDS} ({', '.join(AGREE_STATE_FIELDS)}), "
                             f"got {self.state.shape[0]}")
        if not isinstance(log, ViolationLog):
            raise TypeError(f"kvcanary: log: expected a ViolationLog, got {type(log).__name__}")
        if log.device != self.device:
            raise ValueError(f"kvcanary: log: expected it on {self.device} like gathered, got {log.device}")
        self.log = log
        self.tag = scalars.check_tag(tag)
        arrays.check_disjoint("RankCompare", {"gathered": self.gathered, "state": self.state, "log.ring": log.ring,
                                              "log.head": log.head, "log.counters": log.counter_array})
        self._launch = None

    @staticmethod
    def allocate_state(device: str = "cpu"):
        """A zeroed state array for ``device``."""
        return runtime.empty((AGREE_STATE_WORDS,), np.int64, device, fill=0)

    def run(self, stream=None) -> None:
        """Compare what ``gathered`` holds now (on CUDA: in stream order on ``stream``)."""
        ptr = None if runtime.is_cpu(self.device) else runtime.resolve_stream(stream, ())
        if self._launch is None:
            self._launch = backend_for(self.device).prepare_agree(self.gathered, rank=self.rank, state=self.state,
                                                                  log=self.log, tag=self.tag, stream=ptr)
        self._launch(ptr)


def _device_scalar(obj, name: str, device: str):
    a = arrays.as_array(obj, name, dtypes=arrays.INT64, ndim=1, device=device)
    if a.shape[0] != 1:
        raise ValueError(f"kvcanary: {name}: expected a device scalar (int64 [1]), got shape {tuple(a.shape)}")
    return a
