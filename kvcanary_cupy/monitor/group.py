"""One watched pool: its canary buffer, plans, sources, sampler and launch tags.

A monitor watches the full KV pool and, optionally, a sliding-window pool next to
it; each is a :class:`Group`. A group's device scalars (those of its verify plan,
then those of its write plan) are slices of one int64 array, so the host reads a
group in one copy; the layout is defined by the plans' own field names. Every
group of a monitor chains its records the same way (its ``chain`` kind, see
:class:`~kvcanary_cupy.CanaryBuffer`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .. import arrays, ops, runtime, scalars
from ..canary import CanaryBuffer, RealKvSource
from ..digest import Digest, DigestRow
from ..format import ENTRY_DIGEST_SALTS, INPUT_ERROR_WORDS, LaunchTag, RealKvMode
from ..plans import FingerprintSampler, SwaWindow, VerifyPlan, WritePlan, decode_input_error

# The group's scalar array: VerifyPlan's scalars, then WritePlan's, each named (plan, field).
VERIFY_SCALARS = VerifyPlan.SCALAR_FIELDS
WRITE_SCALARS = WritePlan.SCALAR_FIELDS
SCALAR_LAYOUT = tuple(("verify", f) for f in VERIFY_SCALARS) + tuple(("write", f) for f in WRITE_SCALARS)
_AT = {name: i for i, name in enumerate(SCALAR_LAYOUT)}
# Then the verify plan's first input error (format.INPUT_ERROR_FIELDS), read with the scalars.
_FIRST_ERROR = slice(len(SCALAR_LAYOUT), len(SCALAR_LAYOUT) + INPUT_ERROR_WORDS)
SCALAR_WORDS = _FIRST_ERROR.stop
# Cumulative counters, discarded with warm-up results (end_warmup).
COUNTERS = (("verify", "input_errors"), ("verify", "overflows"), ("verify", "max_requested"),
            ("write", "input_errors"))
# Those a poll warns about when they grow (the largest request only describes an overflow).
_REPORTED = tuple(_AT[k] for k in (("verify", "input_errors"), ("verify", "overflows"), ("write", "input_errors")))


@dataclasses.dataclass(frozen=True, eq=False)
class SwaGroup:
    """A sliding-window KV pool watched next to the full pool.

    Args:
        window: window length in tokens (>= 1): a step reads the last ``window``
            prefix positions of each request (and the record before them, whose
            link the window's first record continues).
        lut: int32 / int64 ``[num_full_slots]``, full-pool slot -> SWA-pool slot
            (negative: no SWA slot). Bound once; the engine mutates it in place.
        num_slots: slots of the SWA pool (its own canary buffer holds as many).
        real_kv: :class:`RealKvSource` s over the SWA pool's K/V (its own slot space).
        real_kv_mode: defaults to the monitor's mode.
        verify_capacity: like the monitor's, for this group.

    Example::

        >>> import numpy as np
        >>> g = SwaGroup(window=128, lut=np.full(4096, -1, np.int32), num_slots=1024)
        >>> g.window, g.num_slots
        (128, 1024)
    """

    window: int
    lut: object
    num_slots: int
    real_kv: Sequence[RealKvSource] = ()
    real_kv_mode: RealKvMode | None = None
    verify_capacity: int | str = "pool"


def capacity_rule(spec, *, max_batch: int, width: int, num_slots: int, window: int | None,
                  name: str) -> tuple[int, int]:
    """(capacity, hard bound) of a verify plan; see :class:`KvCanary` ("Verify capacity").

    Example::

        >>> capacity_rule("pool", max_batch=8, width=100, num_slots=500, window=None, name="verify_capacity")
        (500, 800)
    """
    # A healthy row reads each of its positions' slots once: never more than the pool holds.
    # A step that asks for more is corrupt, and overflows (counted) rather than allocates for it.
    per_row = min(width, window or width, num_slots)
    hard = max_batch * per_row
    if spec == "max":
        return max(hard, 1), hard
    if spec == "pool":
        return max(min(hard, num_slots), 1), hard
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool) and int(spec) >= 1:
        return int(spec), hard
    raise ValueError(f"kvcanary: {name}: expected a positive int, 'pool' or 'max', got {spec!r}")


class Group:
    """One canary buffer with the plans, sources and tags that go with it."""

    def __init__(self, name: str, *, num_slots: int, device: str, max_batch: int, capacity: int,
                 hard_capacity: int, swa: SwaWindow | None, sources, mode, sample_period, tags, chain: str,
                 sc=None):
        self.name = name
        self.device = device
        self.canary = CanaryBuffer.allocate(num_slots=num_slots, device=device, chain=chain)
        # The plans' scalars, int64 [SCALAR_WORDS] (a view of the monitor's polled block, or its own).
        self.sc = runtime.empty((SCALAR_WORDS,), np.int64, device, fill=0) if sc is None else sc
        self._verify_scalars = {f: self._scalar("verify", f) for f in VERIFY_SCALARS}
        write = {f: self._scalar("write", f) for f in WRITE_SCALARS}
        write["position_check"].fill(1)
        write["num_rows"].fill(-1)  # never planned, like WritePlan.allocate
        self.sc[_FIRST_ERROR].fill(-1)  # no input error, like VerifyPlan.allocate
        self.hard_capacity = hard_capacity
        self.vp = self._verify_plan(capacity, offsets=runtime.empty((max_batch + 1,), np.int64, device, fill=0))
        # Whether a step can ask for more entries than the plan holds (see capacity_rule: no step
        # asks for more than the hard bound), so the CPU's repair needs to look at all.
        self.may_overflow = capacity < hard_capacity
        self.wp = WritePlan.from_buffers(offsets=runtime.empty((max_batch + 1,), np.int64, device, fill=0),
                                         seed_slots=runtime.empty((max_batch,), np.int64, device, fill=-1), **write)
        self.swa = swa
        self.sources = tuple(sources)
        self.mode = mode
        self.sampler = FingerprintSampler.allocate(period=sample_period, device=device) if sample_period else None
        self.tag_verify, self.tag_write, self.tag_after = tags
        # The digest of each step's verify entries, for tensor-parallel agreement (None: not kept).
        self.entry_digest = None
        self._entry_digester = None  # (verify plan, Digest) for steps that write the entries
        self._hold = None

    def keep_entry_digest(self, hold) -> None:
        """Keep the digest of every step's verify entries in ``entry_digest`` (int64 [1]);
        ``hold(obj)`` keeps a dropped digest launch alive while queued work may read it."""
        self.entry_digest = runtime.empty((1,), np.int64, self.device, fill=0)
        self._hold = hold

    def digest_entries(self, stream) -> None:
        """``entry_digest`` from the entry arrays a plan wrote: the value
        :func:`~kvcanary_cupy.plan_and_verify` leaves there when it plans the step itself."""
        if self._entry_digester is None or self._entry_digester[0] is not self.vp:
            rows = [DigestRow(getattr(self.vp, f), count=self.vp.num_valid, gate=self.vp.enable, salt=salt)
                    for f, salt in zip(VerifyPlan.ENTRY_FIELDS, ENTRY_DIGEST_SALTS)]
            if self._entry_digester is not None:
                self._hold(self._entry_digester[1])
            self._entry_digester = (self.vp, Digest(rows, out=self.entry_digest))
        self._entry_digester[1].run(stream)

    def _scalar(self, plan: str, field: str):
        i = _AT[(plan, field)]
        return self.sc[i:i + 1]

    def _verify_plan(self, capacity: int, offsets) -> VerifyPlan:
        e = {f: runtime.empty((capacity,), np.int64, self.device, fill=-1) for f in VerifyPlan.ENTRY_FIELDS}
        return VerifyPlan.from_buffers(**e, offsets=offsets, **self._verify_scalars,
                                       first_input_error=self.sc[_FIRST_ERROR])

    def check_sources(self) -> None:
        """Refuse sources that are not on the device or do not cover the pool."""
        ops.check_sources(self.sources, self.mode, self.device, self.canary.num_slots)

    def replace_sources(self, real_kv, name: str) -> None:
        """Fingerprint ``real_kv`` (:class:`RealKvSource` s, ``name`` in errors) from now on,
        refused like :meth:`check_sources` refuses."""
        srcs = ops.source_tuple(real_kv, name)
        ops.check_sources(srcs, self.mode, self.device, self.canary.num_slots)
        self.sources = srcs

    def grow(self, requested: int) -> int:
        """Reallocate the entry arrays for at least ``requested`` entries; returns the new capacity."""
        # Double past the request so a growing batch does not overflow again on the next step.
        new = max(2 * int(requested), 2 * self.vp.capacity, 1)
        if self.hard_capacity:
            # Never past the hard bound: a request beyond it is corrupt and keeps overflowing, counted.
            new = max(min(new, self.hard_capacity), self.vp.capacity)
        self.vp = self._verify_plan(new, offsets=self.vp.offsets)
        self.may_overflow = new < self.hard_capacity
        return new

    def plan(self, args: dict, *, repair: bool, stream) -> tuple[int, int, int] | None:
        """Plan a step into both plans (``args``: :func:`kvcanary_cupy.plan`'s, but the plans and
        the stream), writing the verify entries.

        With ``repair`` (the CPU, where reading the plan costs nothing) a verify plan that
        overflowed is grown and planned again at once; returns ``(requested, old capacity,
        new capacity)`` then, else None. The first plan counted the overflow and the step's
        bad rows; the re-plan counts nothing again.
        """
        ops.plan(self.vp, self.wp, stream=stream, **args)
        if not repair:
            return None
        vp = self.vp
        requested, capacity = int(vp.requested[0]), vp.capacity
        if requested <= capacity:
            return None
        return requested, capacity, self._replan(args, requested, stream)

    def plan_verify_only(self, args: dict, *, repair: bool, stream) -> tuple[int, int, int] | None:
        """:meth:`plan` into the verify plan alone: the write plan (the step's, already written
        with) stays as it is."""
        ops.plan(self.vp, None, stream=stream, **args)
        if not repair:
            return None
        requested, capacity = int(self.vp.requested[0]), self.vp.capacity
        if requested <= capacity:
            return None
        return requested, capacity, self._replan(args, requested, stream)

    def _replan(self, args: dict, requested: int, stream) -> int:
        """Grow the verify plan for ``requested`` entries and plan its entries again (CPU); the
        counters the first plan kept (input errors, overflows, largest request) stay as they
        were. Returns the new capacity."""
        grown = self.grow(requested)
        counted = {f: int(getattr(self.vp, f)[0]) for f in ("input_errors", "overflows", "max_requested")}
        ops.plan(self.vp, None, stream=stream, **args)
        for f, v in counted.items():
            getattr(self.vp, f)[0] = v
        return grown

    def reset_counters(self) -> None:
        """Zero the cumulative counters (on the current stream)."""
        for plan, field in COUNTERS:
            self._scalar(plan, field).fill(0)

    def reported(self) -> tuple:
        """The cumulative counters of :attr:`sc` that a poll warns about when they grow (read
        in place: a CPU group's; see :meth:`counts`)."""
        return tuple(map(self.sc.item, _REPORTED))

    @staticmethod
    def counts(sc: np.ndarray) -> dict:
        """``overflows``, ``input_errors`` (the verify plan's: live rows not verified),
        ``rows_unstamped`` (the write plan's: live rows whose tokens were not stamped),
        ``max_requested`` and ``first_input_error`` (the latest plan's, decoded: see
        :meth:`~kvcanary_cupy.VerifyPlan.host_first_input_error`) from a host copy of :attr:`sc`."""
        return {"overflows": int(sc[_AT["verify", "overflows"]]), "input_errors": int(sc[_AT["verify", "input_errors"]]),
                "rows_unstamped": int(sc[_AT["write", "input_errors"]]),
                "max_requested": int(sc[_AT["verify", "max_requested"]]),
                "first_input_error": decode_input_error(sc[_FIRST_ERROR])}


def main_group(*, num_slots: int, device: str, max_batch: int, width: int, verify_capacity, sources, mode,
               sample_period, draft: bool, chain: str, sc=None, window: int | None = None) -> Group:
    """The full pool's group (``sc``: see :class:`Group`; ``window``: see :class:`KvCanary`)."""
    cap, hard = capacity_rule(verify_capacity, max_batch=max_batch, width=width, num_slots=num_slots,
                              window=window, name="verify_capacity")
    tags = ((LaunchTag.VERIFY_DRAFT, LaunchTag.WRITE_DRAFT, LaunchTag.VERIFY_AFTER) if draft else
            (LaunchTag.VERIFY, LaunchTag.WRITE, LaunchTag.VERIFY_AFTER))
    swa = None if window is None else SwaWindow(window)  # the pool's own slots: no translation
    return Group("main", num_slots=num_slots, device=device, max_batch=max_batch, capacity=cap, hard_capacity=hard,
                 swa=swa, sources=sources, mode=mode, sample_period=sample_period, tags=tags, chain=chain,
                 sc=sc)


def swa_group(spec: SwaGroup, *, device: str, max_batch: int, width: int, mode, sample_period, chain: str,
              sc=None) -> Group:
    """The sliding-window pool's group, from its :class:`SwaGroup` (``mode``, ``chain``: the monitor's;
    ``sc``: see :class:`Group`)."""
    if not isinstance(spec, SwaGroup):
        raise TypeError(f"kvcanary: swa: expected a SwaGroup, got {type(spec).__name__}")
    window = SwaWindow(scalars.check_int(spec.window, "swa.window", minimum=1),
                       arrays.as_index_array(spec.lut, "swa.lut", device=device))
    num_slots = scalars.check_int(spec.num_slots, "swa.num_slots", minimum=1)
    sources = ops.source_tuple(spec.real_kv, "swa.real_kv")
    smode = ops.real_kv_mode_of(spec.real_kv_mode, "swa.real_kv_mode") if spec.real_kv_mode is not None else (
        mode if sources else RealKvMode.NONE)
    cap, hard = capacity_rule(spec.verify_capacity, max_batch=max_batch, width=width, num_slots=num_slots,
                              window=window.size, name="swa.verify_capacity")
    return Group("swa", num_slots=num_slots, device=device, max_batch=max_batch, capacity=cap, hard_capacity=hard,
                 swa=window, sources=sources, mode=smode, sample_period=sample_period,
                 tags=(LaunchTag.VERIFY_SWA, LaunchTag.WRITE_SWA, LaunchTag.VERIFY_SWA), chain=chain, sc=sc)
