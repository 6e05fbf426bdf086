"""plan(), write(), verify(), plan_and_verify(), plan_verify_write(), scatter_expected_tokens(): validate,
then dispatch.

Every op checks what the host can see (types, dtypes, shapes, devices, which
arguments go together, that no input shares memory with what the op writes, that
the objects' arrays are still as they were validated) and raises ``kvcanary:``
errors for misuse, then hands already-imported views to the backend that owns the
buffers' device: the NumPy reference on ``"cpu"``, the CUDA backend on a GPU. Data
the host cannot see (indices out of range) is the backend's to count, never to
fault on.

The checks live in :mod:`kvcanary_cupy.ops_validate`; this module keeps each op's memo
of validated calls, prepares them (:func:`prepare`, :class:`Recording`) and runs them.
"""
from __future__ import annotations

from typing import Sequence

from . import arrays, runtime, scalars
from .backends import backend_for
from .canary import CanaryBuffer, RealKvSource
from .format import RealKvMode
from .launch_cache import LaunchCache
from .ops_validate import (  # noqa: F401  (the public names stay kvcanary_cupy.ops.<name>)
    MAX_ROW_POSITIONS,
    STEP_WRITE_TOKENS,
    _no_extra,
    _plan_and_verify_inputs,
    _plan_inputs,
    _plan_verify_write_inputs,
    _scatter_inputs,
    _verify_inputs,
    _write_inputs,
    check_sources,
    check_table_extent,
    real_kv_mode_of,
    slot_table,
    source_tuple,
)
from .plans import ExpectedTokens, FingerprintSampler, SwaWindow, VerifyPlan, WritePlan
from .violations import ViolationLog


class _Call:
    """A validated op call: its prepared launch, and how to find its stream.

    ``given`` are the caller's array arguments, ``views`` their imported views (named
    ``names``; ``written``: those the op writes); the call is *native* when every one was
    already a NumPy / CuPy array (nothing was imported), and only then may it be kept and
    run again for the same arguments.

    ``held``: on the CPU, the arrays the launch reads with their layouts as validated,
    checked before every launch of a kept or prepared call. The NumPy reference reads its
    arrays afresh at each launch, so a resize, reshape or read-only flag would otherwise
    fail inside it, halfway through its writes. A CUDA launch holds the addresses and
    extents it validated, of memory its objects keep alive, so nothing changed in place
    moves what it reads or writes (a new call validates again); it checks nothing more.
    """

    __slots__ = ("launch", "cpu", "foreign", "native", "stream", "stream_ptr", "held")

    def __init__(self, prepare, device, args, kwargs, stream, given=(), views=(), names=(), written=()):
        self.cpu = device == "cpu"
        self.native = all(g is v for g, v in zip(given, views))
        self.foreign = () if self.native else given  # they pick the default stream (PyTorch's)
        ptr = None if self.cpu else runtime.resolve_stream(stream, self.foreign)
        self.launch = prepare(*args, stream=ptr, **kwargs)
        # The last stream object given and its handle: a stream's handle never changes, and
        # holding the object keeps the handle from being reused by another stream.
        self.stream, self.stream_ptr = (stream, ptr) if stream is not None else (None, None)
        self.held = _held_of(args, kwargs, dict(zip(names, views)), written) if self.cpu else ()

    def run(self, stream) -> None:
        if stream is not None and stream is self.stream:
            self.launch(self.stream_ptr)
            return
        s = None if self.cpu else runtime.resolve_stream(stream, self.foreign)
        if stream is not None:
            self.stream, self.stream_ptr = stream, s
        self.launch(s)


def _held_of(args, kwargs, inputs: dict, written) -> tuple:
    """The :class:`~kvcanary_cupy.arrays.Held` arrays of a call: its library objects' and its
    array inputs' (see :class:`_Call`)."""
    held = []
    for x in (*args, *kwargs.values()):
        for obj in (x if type(x) is tuple else (x,)):
            h = getattr(obj, "_held", None)
            if isinstance(h, arrays.Held):
                held.append(h)
    if inputs:
        held.append(arrays.Held("", inputs, "pass it to the op again (a prepared call: prepare it again)",
                                written))
    return tuple(held)


def _run(cache: LaunchCache, key, keep, prepare, args, stream) -> None:
    """Run the call ``cache`` keeps under ``key``, else ``prepare(args, stream)``, kept
    (with ``keep``: every object whose id is in ``key``) when its arguments are native.
    A :class:`Recording` stream also hands the call to its recording."""
    rec = None
    if type(stream) is Recording:
        rec, stream = stream, stream.stream
    try:
        call = cache.get(key)
    except TypeError:  # an unhashable scalar argument: validation refuses it below
        call, cache = None, _UNCACHED
    if call is None:
        call = prepare(args, stream)
        if call.native:
            cache.keep(key, keep, call)
    else:
        for h in call.held:
            h.check()
    if rec is None or rec.run:
        call.run(stream)
    if rec is not None:
        rec.ops.append(PreparedOp(call, keep))


class PreparedOp:
    """An op call validated and laid out once: calling it launches the op again with the
    same arguments, and does nothing else (no validation, no lookup).

    Made by :func:`prepare`. Its arrays are read in place at every launch, as by a
    CUDA graph: refill them in place between launches, and keep their shapes and
    dtypes (a changed shape needs a new ``prepare``; on the CPU a launch refuses it). It
    holds every object it was prepared with, so none goes away while it can launch.
    """

    __slots__ = ("_call", "_keep")

    def __init__(self, call: _Call, keep: tuple):
        self._call, self._keep = call, keep

    def __call__(self, stream=None) -> None:
        """Launch on ``stream`` (default: as the op's own default, see :func:`prepare`).

        On the CPU the arrays are checked first: one resized, reshaped or made read-only
        since the call was prepared is refused (see :class:`_Call`)."""
        call = self._call
        for h in call.held:
            h.check()
        if stream is not None and stream is call.stream:  # the stream of the last launch: no lookup
            call.launch(call.stream_ptr)
            return
        call.run(stream)


class Recording:
    """A stream argument that also records: an op called with ``stream=Recording(s)``
    runs on ``s`` as usual (or, with ``run=False``, only validates and lays out its
    launch) and appends its :class:`PreparedOp` to ``ops``.

    A caller that makes the same calls step after step (the monitor, an engine's own
    step function) records them once and then launches ``ops`` directly.
    """

    __slots__ = ("stream", "run", "ops")

    def __init__(self, stream=None, *, run: bool = True):
        self.stream, self.run, self.ops = stream, run, []


def prepare(op, *args, stream=None, **kwargs) -> PreparedOp:
    """Validate an op's call once and return it ready to launch, for a step that repeats.

    Args:
        op: one of :func:`plan`, :func:`verify`, :func:`write`, :func:`plan_and_verify`,
            :func:`plan_verify_write`, :func:`scatter_expected_tokens`.
        *args, **kwargs: that op's arguments, but ``stream``.
        stream: the stream the preparation itself may use (e.g. to zero a plan's launch
            state, once); each launch takes its own.

    Returns:
        a :class:`PreparedOp`: ``prepared(stream=None)`` launches the op with these
        arguments, read in place (refill them between launches, as for a CUDA graph).
        Calling ``op(...)`` again with the same arrays costs a lookup of its memo
        besides the launch; a prepared op costs the launch alone.

    Example::

        >>> import numpy as np, kvcanary_cupy as kc
        >>> canary, wp = kc.CanaryBuffer.allocate(num_slots=32), kc.WritePlan.allocate(max_batch=1)
        >>> log = kc.ViolationLog.allocate(capacity=4)
        >>> table = np.arange(32, dtype=np.int32).reshape(2, 16)  # row 1 lives in slots 16..31
        >>> rpi, pre, ext = np.array([1]), np.array([0]), np.array([1])
        >>> ids, pos, loc = np.array([7]), np.array([0]), np.array([16])
        >>> steps = [kc.prepare(kc.plan, None, wp, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext,
        ...                     req_to_token=table),
        ...          kc.prepare(kc.write, canary, wp, input_ids=ids, positions=pos, out_cache_loc=loc, log=log,
        ...                     tag=kc.LaunchTag.WRITE)]
        >>> for launch in steps: launch()
        >>> pre[0], ids[0], pos[0], loc[0] = 1, 8, 1, 17  # the next decode step, refilled in place
        >>> for launch in steps: launch()
        >>> canary.records[16:18, :2].tolist(), log.count  # chained from slot 16's record
        ([[7, 0], [8, 1]], 0)
    """
    if op not in _PREPARABLE:
        raise TypeError(f"kvcanary: op: expected one of {', '.join(f.__name__ for f in _PREPARABLE)}, got {op!r}")
    if isinstance(stream, Recording):
        raise TypeError("kvcanary: stream: expected a CUDA stream, a raw pointer or None, got a Recording")
    rec = Recording(stream, run=False)
    op(*args, stream=rec, **kwargs)
    return rec.ops[0]


_UNCACHED = LaunchCache(capacity=0)  # for owners of the wrong type: validation then raises
_SCATTER = LaunchCache(capacity=1)  # scatter has no owner object: its last call only


def _cache_of(owner, cls) -> LaunchCache:
    return owner.launches if isinstance(owner, cls) else _UNCACHED


def _array(x):
    """An array argument's part of a memo key: its id, and the shape and dtype that
    validation checked. Both can be changed in place (``a.shape = ...``,
    ``a.dtype = ...`` are legal on NumPy and CuPy arrays), so an entry validated for
    the old ones must not be found for the new ones.

    A scalar argument's part is its value and its type, written into the key inline
    (this runs on every call): ``True`` must not find an entry made for ``1``, nor
    ``2.0`` one made for ``2``, though they hash and compare equal."""
    if x is None:
        return None
    try:
        return (id(x), x.shape, x.dtype)
    except AttributeError:  # None, or not an array (then the op rejects it)
        return id(x)


def plan(verify_plan: VerifyPlan | None, write_plan: WritePlan | None, *, req_pool_indices, prefix_lens,
         extend_lens, req_to_token=None, block_table=None, page_size: int | None = None,
         swa: SwaWindow | None = None, expected: ExpectedTokens | None = None, stream=None, **extra) -> None:
    """Derive, on the device, the records a step reads and where its new tokens go.

    Args:
        verify_plan: receives one entry per (active row, prefix position in the
            window); ``None`` to plan writes only.
        write_plan: receives per-row write offsets and chain seeds; ``None`` to plan
            verification only. The step's token arrays are the engine's layout:
            every row keeps its span of ``extend_lens[r]`` tokens in ``offsets``
            whether or not it stamps it. A padding row, or a row that cannot be
            planned, gets seed :data:`SEED_SKIP` and stamps nothing; after a row
            whose extend length is no span (negative, or past the table's width)
            the layout is unknown, and every later row gets ``SEED_SKIP`` too.
            Each live row that stamps nothing is added to ``write_plan.input_errors``.
        req_pool_indices: int32 / int64 ``[bs]``, each row's request-table row
            (0: a padding row, which produces nothing).
        prefix_lens: int32 / int64 ``[bs]``, tokens already cached per row.
        extend_lens: int32 / int64 ``[bs]``, tokens this step writes per row.
        req_to_token: int32 / int64 ``[num_requests, max_len]``, token-level table
            (SGLang); or
        block_table: int32 / int64 ``[num_requests, max_pages]`` with ``page_size``
            (vLLM): slot = ``block_table[rp, pos // page_size] * page_size + pos % page_size``.
            A row may span at most ``max_pages * page_size <= 2**31`` positions
            (:data:`MAX_ROW_POSITIONS`: the attention kernels engines run count a
            sequence's KV length in 32 bits, so no pool is addressed by wider rows); a
            larger page size is refused, so a plan's work per row stays bounded by what a
            real table spans.
        swa: :class:`SwaWindow`: verify only the window and translate slots by its LUT.
        expected: :class:`ExpectedTokens`: fill ``expected_tokens`` for the token check.
        stream: CUDA stream (see :func:`kvcanary_cupy.runtime.resolve_stream`).

    No input may share memory with the plans' arrays (the plan would read what it writes);
    inputs may share memory with each other.

    A row that cannot be planned (its request-table row, lengths or a table / LUT
    entry it reads out of range) produces no verify entries and is added to
    ``verify_plan.input_errors``. A table entry that maps a live row's position to
    the reserved slot 0 is planned: :func:`verify` reports it.

    Example::

        >>> import numpy as np, kvcanary_cupy as kc
        >>> vp = kc.VerifyPlan.allocate(capacity=64, max_batch=2)
        >>> wp = kc.WritePlan.allocate(max_batch=2)
        >>> table = np.arange(1, 33, dtype=np.int32).reshape(2, 16)
        >>> kc.plan(vp, wp, req_pool_indices=np.array([1, 0]), prefix_lens=np.array([3, 7]),
        ...         extend_lens=np.array([1, 9]), req_to_token=table)
        >>> vp.host_entries()["slot_indices"].tolist(), wp.seed_slots.tolist()
        ([17, 18, 19], [19, -2])
    """
    if extra:
        _no_extra("plan", extra)
    objs = (verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table,
            page_size, swa, expected)
    key = _plan_key(objs)
    owner = verify_plan if verify_plan is not None else write_plan
    _run(_cache_of(owner, (VerifyPlan, WritePlan)), key, objs, _prepare_plan, objs, stream)


def _plan_key(objs) -> tuple:
    """The memo key of plan's arguments (see :func:`_array`)."""
    (verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size,
     swa, expected) = objs
    key = (id(verify_plan), id(write_plan), _array(req_pool_indices), _array(prefix_lens), _array(extend_lens),
           _array(req_to_token), _array(block_table), page_size, type(page_size), id(swa), id(expected))
    if swa is not None or expected is not None:  # the arrays they hold were validated too
        key += (_array(getattr(swa, "lut", None)), _array(getattr(expected, "table", None)),
                _array(getattr(expected, "valid_lens", None)))
    return key


def _prepare_plan(args, stream) -> _Call:
    verify_plan, write_plan = args[:2]
    device, inputs, given, read = _plan_inputs(args)
    return _Call(backend_for(device).prepare_plan, device, (verify_plan, write_plan), inputs, stream,
                 given=given, views=tuple(read.values())[:len(given)], names=tuple(read)[:len(given)])


def write(canary: CanaryBuffer, write_plan: WritePlan, *, input_ids, positions, out_cache_loc,
          log: ViolationLog, tag: int, real_kv: Sequence[RealKvSource] = (),
          real_kv_mode: RealKvMode = RealKvMode.NONE, expected_inputs=None, digest=None, max_row_tokens=None,
          stream=None, **extra) -> None:
    """Stamp records for the tokens a step writes, chained from each row's seed.

    Args:
        canary: the records.
        write_plan: from :func:`plan` for this step.
        input_ids: int32 / int64 ``[>= total]``, token ids, rows back to back.
        positions: int32 / int64 ``[>= total]``, their positions.
        out_cache_loc: int32 / int64 ``[>= total]``, the slots they were written to;
            a negative slot is skipped (no store, the chain does not advance).
        log: where violations go (seed or slot out of range, failed checks).
        tag: an int (e.g. :class:`LaunchTag`) naming this launch in violation rows.
        real_kv: :class:`RealKvSource` s whose bytes the fingerprint covers, in order.
        real_kv_mode: :class:`RealKvMode`.
        expected_inputs: optional ``(tokens, positions)``, each int32 / int64
            ``[>= total]`` or ``None``; -1 skips an element. Mismatches raise
            WRITE_TOKEN / WRITE_POSITION violations.
        digest: optional :class:`~kvcanary_cupy.digest.Digest` computed by the same
            launch, in one extra block beside the write (e.g. a step's tensor-parallel
            agreement: one launch less per step). It runs concurrently with the write,
            so it may carry nothing and read none of what the write changes (the
            records, the log).
        max_row_tokens: optional int >= 0, a bound the caller knows on every row's token
            count (1 for a decode step, the draft length + 1 for a speculative one). The
            CUDA write then takes its route for short rows even when the step has many
            tokens in all; a row longer than the bound is stamped all the same, only
            slower. It is rounded up to a power of two, so calls whose bounds round alike
            are the same call (prepared once). ``None``: no bound but the step's token
            count.
        stream: CUDA stream.

    No input (the token inputs, the write plan, the sources' bytes) may share memory
    with the records or the log, which the write changes.
    """
    if extra:
        _no_extra("write", extra)
    srcs = tuple(real_kv) if isinstance(real_kv, (tuple, list)) else (real_kv,)
    exp = tuple(expected_inputs) if isinstance(expected_inputs, (tuple, list)) else (expected_inputs,)
    objs = (canary, write_plan, input_ids, positions, out_cache_loc, log, *exp, *srcs)
    max_row_tokens = scalars.bound_key(max_row_tokens)
    key = (id(canary), id(write_plan), _array(input_ids), _array(positions), _array(out_cache_loc), id(log), tag,
           type(tag), real_kv_mode, type(real_kv_mode), len(exp), *map(_array, exp), *map(id, srcs), id(digest),
           max_row_tokens, type(max_row_tokens))
    _run(_cache_of(canary, CanaryBuffer), key, (*objs, digest), _prepare_write, (
        canary, write_plan, input_ids, positions, out_cache_loc, log, tag, real_kv, real_kv_mode, expected_inputs,
        digest, max_row_tokens), stream)


def _prepare_write(args, stream) -> _Call:
    canary, write_plan = args[:2]
    device, inputs, given, views, names = _write_inputs(args)
    return _Call(backend_for(device).prepare_write, device, (canary, write_plan), inputs, stream, given=given,
                 views=views, names=names)


def verify(canary: CanaryBuffer, verify_plan: VerifyPlan, *, log: ViolationLog, tag: int,
           real_kv: Sequence[RealKvSource] = (), real_kv_mode: RealKvMode = RealKvMode.NONE,
           check_tokens: bool = False, sample: FingerprintSampler | None = None, stream=None, **extra) -> None:
    """Check every planned record against its predecessor, position, token and bytes.

    Args:
        canary: the records.
        verify_plan: from :func:`plan` for this step; does nothing if it overflowed.
        log: where violation rows and counters go.
        tag: an int naming this launch in violation rows.
        real_kv, real_kv_mode: the sources and mode the records were written with.
        check_tokens: also compare stored tokens with the plan's expected tokens.
        sample: :class:`FingerprintSampler`: check fingerprints on a rotating
            ``1/period`` of the slots only (chain, position and token: always all).
        stream: CUDA stream.

    Every entry counts as checked. One at the reserved slot 0 (a live row reads
    it) is a RESERVED_SLOT violation and its record is not read; its successor's
    chain is not checked against it. A slot outside the canary is SLOT_OUT_OF_RANGE.

    The plan, the records and the sources' bytes are read and may not share memory with
    the log or the sampler's state, which the verify changes.
    """
    if extra:
        _no_extra("verify", extra)
    objs = (canary, verify_plan, log, sample,
            *(real_kv if isinstance(real_kv, (tuple, list)) else (real_kv,)))
    key = (*map(id, objs), tag, type(tag), real_kv_mode, type(real_kv_mode), check_tokens, type(check_tokens))
    _run(_cache_of(canary, CanaryBuffer), key, objs, _prepare_verify, (
        canary, verify_plan, log, tag, real_kv, real_kv_mode, check_tokens, sample), stream)


def _prepare_verify(args, stream) -> _Call:
    canary, verify_plan = args[:2]
    device, inputs, _ = _verify_inputs("verify", args)
    return _Call(backend_for(device).prepare_verify, device, (canary, verify_plan), inputs, stream)


def plan_and_verify(verify_plan: VerifyPlan, write_plan: WritePlan | None, canary: CanaryBuffer, *,
                    req_pool_indices, prefix_lens, extend_lens, req_to_token=None, block_table=None,
                    page_size: int | None = None, swa: SwaWindow | None = None, expected: ExpectedTokens | None = None,
                    log: ViolationLog, tag: int, real_kv: Sequence[RealKvSource] = (),
                    real_kv_mode: RealKvMode = RealKvMode.NONE, check_tokens: bool = False,
                    sample: FingerprintSampler | None = None, digest=None, stream=None, **extra) -> None:
    """:func:`plan` and :func:`verify` of one step in one launch: the hot path before a forward.

    Takes :func:`plan`'s arguments and :func:`verify`'s (see both) and leaves exactly
    what ``plan(...)`` followed by ``verify(...)`` leaves: the same violation rows
    (as a multiset) and counters, the verify plan's scalars and ``offsets``, the
    whole write plan, the sampler's state. On CUDA the per-entry arrays
    (``slot_indices``, ``prev_slot_indices``, ``expected_positions``,
    ``expected_tokens``) are *not* written: the launch reads the slot table and
    the records, and derives each entry where it checks it (call :func:`plan` for
    the entries, e.g. to inspect them). The NumPy backend writes them.

    A plan whose entries exceed ``verify_plan.capacity`` verifies nothing, counts
    ``verifies_skipped`` and keeps the requested total, exactly like ``plan``.

    The slot table is bounded as for :func:`plan`, and with the canary known a page may
    hold at most ``canary.num_slots`` slots (a page is ``page_size`` consecutive slots of
    the pool). No input may share memory with what the op writes (the plans, the log, the
    sampler's state, ``digest``); the records and the inputs are only read.

    ``digest`` (optional): int64 ``[1]``, writable, on the canary's device. Receives the
    digest of the step's verify entries, the value a :class:`~kvcanary_cupy.digest.Digest`
    computes over the four entry arrays ``plan`` writes (salts ``format.ENTRY_DIGEST_SALTS``,
    ``num_valid`` their count, ``enable`` their gate), without the entries being written:
    what tensor-parallel ranks compare.

    Example::

        >>> import numpy as np, kvcanary_cupy as kc
        >>> canary = kc.CanaryBuffer.allocate(num_slots=32)
        >>> vp, wp = kc.VerifyPlan.allocate(capacity=64, max_batch=2), kc.WritePlan.allocate(max_batch=2)
        >>> log = kc.ViolationLog.allocate(capacity=8)
        >>> table = np.arange(1, 33, dtype=np.int32).reshape(2, 16)
        >>> canary.records[[17, 18]] = kc.make_records([5, 6], [0, 1])
        >>> kc.plan_and_verify(vp, wp, canary, req_pool_indices=np.array([1]), prefix_lens=np.array([2]),
        ...                    extend_lens=np.array([1]), req_to_token=table, log=log, tag=kc.LaunchTag.VERIFY)
        >>> log.count, log.counters()["slots_checked"], int(wp.seed_slots[0])
        (0, 2, 18)
    """
    if extra:
        _no_extra("plan_and_verify", extra)
    pobjs = (verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table,
             page_size, swa, expected)
    vobjs = (canary, log, sample, *(real_kv if isinstance(real_kv, (tuple, list)) else (real_kv,)))
    key = ("plan_and_verify", *_plan_key(pobjs), *map(id, vobjs), tag, type(tag), real_kv_mode, type(real_kv_mode),
           check_tokens, type(check_tokens), _array(digest))
    vargs = (canary, verify_plan, log, tag, real_kv, real_kv_mode, check_tokens, sample)
    _run(_cache_of(canary, CanaryBuffer), key, (*pobjs, *vobjs, digest), _prepare_plan_and_verify,
         (pobjs, vargs, digest), stream)


def _prepare_plan_and_verify(args, stream) -> _Call:
    pobjs, vargs, _ = args
    device, inputs, given, views, names = _plan_and_verify_inputs(args)
    return _Call(backend_for(device).prepare_plan_and_verify, device, (pobjs[0], pobjs[1], vargs[0]), inputs,
                 stream, given=given, views=views, names=names, written=("digest",))


def plan_verify_write(verify_plan: VerifyPlan, write_plan: WritePlan, canary: CanaryBuffer, *,
                      req_pool_indices, prefix_lens, extend_lens, req_to_token=None, block_table=None,
                      page_size: int | None = None, swa: SwaWindow | None = None,
                      expected: ExpectedTokens | None = None, input_ids, positions, out_cache_loc,
                      expected_inputs=None, log: ViolationLog, tag: int, write_tag: int, check_tokens: bool = False,
                      stream=None, **extra) -> None:
    """:func:`plan`, :func:`verify` and :func:`write` of a small step in one launch.

    For an engine that knows a step's token ids, positions and slots before its forward
    (SGLang's ``forward_batch``, vLLM's slot mapping) and keeps no real-KV fingerprints:
    a record without them holds nothing the forward writes, so it can be stamped before
    the forward. A decode step is then a single launch. The writes come after every read
    of the step's check, so a slot the step both reads and writes is checked as it was.

    Takes :func:`plan_and_verify`'s arguments but the real-KV ones (the mode is NONE)
    and :func:`write`'s token inputs, and leaves exactly what ``plan_and_verify(...)``
    followed by ``write(...)`` leaves (the same violation rows as a multiset, counters,
    plans, records; ``kernel_runs`` counts both). As with :func:`plan_and_verify`, CUDA
    does not write the verify plan's per-entry arrays.

    Args:
        verify_plan, write_plan, canary, req_pool_indices, prefix_lens, extend_lens,
        req_to_token, block_table, page_size, swa, expected, check_tokens: as for
            :func:`plan_and_verify`; the write plan is required.
        input_ids, positions, out_cache_loc, expected_inputs: as for :func:`write`:
            int32 / int64 ``[n]`` with ``n <= STEP_WRITE_TOKENS`` (256; the shortest of
            them is what the step may write). A larger step calls
            :func:`plan_and_verify`, then :func:`write`.
        log: where both checks' violation rows and counters go.
        tag: the verify's rows' tag (e.g. ``LaunchTag.VERIFY``); ``write_tag``: the
            write's (e.g. ``LaunchTag.WRITE``).
        stream: CUDA stream.

    The slot table and ``page_size`` are bounded as for :func:`plan_and_verify`. No input
    may share memory with what the op writes (the plans, the records, the log); the token
    inputs may be views of the slot table.

    Example::

        >>> import numpy as np, kvcanary_cupy as kc
        >>> canary = kc.CanaryBuffer.allocate(num_slots=32)
        >>> vp, wp = kc.VerifyPlan.allocate(capacity=64, max_batch=1), kc.WritePlan.allocate(max_batch=1)
        >>> log = kc.ViolationLog.allocate(capacity=8)
        >>> table = np.arange(1, 33, dtype=np.int32).reshape(2, 16)
        >>> step = dict(req_pool_indices=np.array([1]), req_to_token=table, log=log, tag=kc.LaunchTag.VERIFY,
        ...             write_tag=kc.LaunchTag.WRITE)
        >>> kc.plan_verify_write(vp, wp, canary, prefix_lens=np.array([0]), extend_lens=np.array([2]),
        ...                      input_ids=np.array([5, 6]), positions=np.array([0, 1]),
        ...                      out_cache_loc=table[1, :2], **step)
        >>> kc.plan_verify_write(vp, wp, canary, prefix_lens=np.array([2]), extend_lens=np.array([1]),
        ...                      input_ids=np.array([7]), positions=np.array([2]), out_cache_loc=table[1, 2:3],
        ...                      **step)
        >>> log.count, log.counters()["slots_checked"], canary.records[[17, 18, 19], 0].tolist()
        (0, 2, [5, 6, 7])
    """
    if extra:
        _no_extra("plan_verify_write", extra)
    pobjs = (verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table,
             page_size, swa, expected)
    exp = tuple(expected_inputs) if isinstance(expected_inputs, (tuple, list)) else (expected_inputs,)
    wobjs = (input_ids, positions, out_cache_loc, *exp)
    key = ("plan_verify_write", *_plan_key(pobjs), id(canary), id(log), tag, type(tag), write_tag, type(write_tag),
           check_tokens, type(check_tokens), len(exp), *map(_array, wobjs))
    _run(_cache_of(canary, CanaryBuffer), key, (*pobjs, canary, log, *wobjs), _prepare_plan_verify_write,
         (pobjs, (canary, verify_plan, log, tag, (), RealKvMode.NONE, check_tokens, None),
          (input_ids, positions, out_cache_loc, expected_inputs), write_tag), stream)


def _prepare_plan_verify_write(args, stream) -> _Call:
    pobjs, vargs = args[:2]
    device, inputs, given, views, names = _plan_verify_write_inputs(args)
    return _Call(backend_for(device).prepare_plan_verify_write, device, (pobjs[0], pobjs[1], vargs[0]), inputs,
                 stream, given=given, views=views, names=names)


def scatter_expected_tokens(table, *, tokens, offsets, req_pool_indices, input_errors=None, stream=None,
                            **extra) -> None:
    """Copy each request's token ids into its row of the expected-token table.

    Args:
        table: int32 / int64 ``[num_requests, width]``, writable; row ``rp`` receives
            ``tokens[offsets[r]:offsets[r + 1]]``, truncated to ``width``.
        tokens: int32 / int64 ``[>= offsets[bs]]``, rows back to back.
        offsets: int32 / int64 ``[bs + 1]``, exclusive prefix sums.
        req_pool_indices: int32 / int64 ``[bs]``; row 0 (padding) and empty spans
            are skipped.
        input_errors: optional int64 ``[1]`` device scalar: every other row that is
            skipped (a row outside the table, a span reversed or outside ``tokens``)
            is added to it.

    ``tokens``, ``offsets`` and ``req_pool_indices`` may not share memory with ``table``
    or ``input_errors``, which the op writes.
    """
    if extra:
        _no_extra("scatter_expected_tokens", extra)
    objs = (table, tokens, offsets, req_pool_indices, input_errors)
    key = (*map(_array, objs), getattr(getattr(table, "flags", None), "writeable", None))
    _run(_SCATTER, key, objs, _prepare_scatter, objs, stream)


def _prepare_scatter(args, stream) -> _Call:
    device, table, inputs, views, names = _scatter_inputs(args)
    return _Call(backend_for(device).prepare_scatter, device, (table,), inputs, stream, given=args, views=views,
                 names=names, written=("table", "input_errors"))


_PREPARABLE = (plan, verify, write, plan_and_verify, plan_verify_write, scatter_expected_tokens)
