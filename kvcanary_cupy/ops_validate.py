"""What each op of :mod:`kvcanary_cupy.ops` accepts: its arguments checked and imported.

For every op, the host-visible checks :mod:`kvcanary_cupy.ops` promises (types, dtypes,
shapes, devices, which arguments go together, that no input shares memory with what the
op writes, that the objects' arrays are still as they were validated), raising
``kvcanary:`` errors, and the arguments the backend's ``prepare_*`` takes, as imported
views: ``_plan_inputs``, ``_verify_inputs``, ``_write_inputs``, ``_plan_and_verify_inputs``,
``_plan_verify_write_inputs``, ``_scatter_inputs``. Also the checks the monitor makes up
front with the same rules (:func:`real_kv_mode_of`, :func:`source_tuple`,
:func:`check_sources`, :func:`slot_table`, :func:`check_table_extent`); ``kvcanary_cupy.ops``
re-exports them.
"""
from __future__ import annotations

from . import arrays, runtime, scalars
from .canary import CanaryBuffer, RealKvSource
from .format import RealKvMode
from .plans import ExpectedTokens, FingerprintSampler, SwaWindow, VerifyPlan, WritePlan
from .violations import ViolationLog


def _expect(obj, cls, name):
    if not isinstance(obj, cls):
        raise TypeError(f"kvcanary: {name}: expected a {cls.__name__}, got {type(obj).__name__}")
    return obj


def _canary_device(canary, **objects) -> str:
    """Type-check the canary and its companions (name=(obj, class)), require them on the
    canary's device, which is returned, and their arrays as they were validated."""
    _expect(canary, CanaryBuffer, "canary")
    canary._held.check()
    for name, (obj, cls) in objects.items():
        _expect(obj, cls, name)
        if obj.device != canary.device:
            raise ValueError(f"kvcanary: {name}: expected it on {canary.device} like the canary, got {obj.device}")
        obj._held.check()
    return canary.device


def _fields(name: str, obj) -> dict:
    """The arrays of a plan or sampler by their names in errors (``verify_plan.offsets``)."""
    return {} if obj is None else {f"{name}.{f}": getattr(obj, f) for f in obj.FIELDS}


def _log_arrays(log) -> dict:
    return {"log.ring": log.ring, "log.head": log.head, "log.counters": log.counter_array}


def _source_arrays(srcs) -> dict:
    return {f"real_kv[{i}]": s.data for i, s in enumerate(srcs)}


def _no_extra(op: str, extra: dict) -> None:
    if not extra:
        return
    name = next(iter(extra))
    if "capacity" in name:
        raise TypeError(f"kvcanary: {op}() takes no {name}: capacities are read off the plan's own arrays "
                        "(allocate the plan with the capacity you need)")
    raise TypeError(f"kvcanary: {op}() got an unexpected keyword argument {name!r}")


def real_kv_mode_of(real_kv_mode, name: str = "real_kv_mode") -> RealKvMode:
    """A :class:`RealKvMode` from the enum or its integer value (not a bool or a float)."""
    try:
        return RealKvMode(scalars.check_int(real_kv_mode, name))
    except (TypeError, ValueError):
        raise ValueError(f"kvcanary: {name}: expected RealKvMode NONE, PARTIAL or ALL, got {real_kv_mode!r}") from None


def source_tuple(real_kv, name: str = "real_kv") -> tuple:
    """``real_kv`` as a tuple of :class:`RealKvSource`: one source, a list or tuple of
    them, or ``None`` / ``()`` for none. A bare array is refused with what to pass."""
    if real_kv is None:
        return ()
    if isinstance(real_kv, RealKvSource):
        return (real_kv,)
    if not isinstance(real_kv, (tuple, list)):
        raise TypeError(f"kvcanary: {name}: expected a RealKvSource or a list of them, got {type(real_kv).__name__}; "
                        "wrap the KV pool as RealKvSource(pool, page_size=..., bytes_per_token=...)")
    for i, s in enumerate(real_kv):
        _expect(s, RealKvSource, f"{name}[{i}]")
    return tuple(real_kv)


def check_sources(real_kv, real_kv_mode, device: str, num_slots: int) -> tuple[tuple[RealKvSource, ...], RealKvMode]:
    """The sources and mode a write or verify fingerprints with: every source on
    ``device`` and covering ``num_slots`` slots; no sources, or mode NONE, give
    ``((), NONE)``."""
    mode = real_kv_mode_of(real_kv_mode)
    srcs = source_tuple(real_kv)
    for i, s in enumerate(srcs):
        _expect(s, RealKvSource, f"real_kv[{i}]")
        if s.device != device:
            raise ValueError(f"kvcanary: real_kv[{i}]: expected a source on {device}, got one on {s.device}")
        if s.num_slots < num_slots:
            raise ValueError(f"kvcanary: real_kv[{i}]: the source holds {s.num_slots} slots, expected at least "
                             f"the canary's num_slots = {num_slots}")
        s._held.check()
    if mode == RealKvMode.NONE or not srcs:
        return (), RealKvMode.NONE
    return srcs, mode


# The most positions a row of a slot table may span (its width times the page size).
# The attention kernels engines run hold a sequence's KV length in 32 bits
# (FlashAttention's cu_seqlens, FlashInfer's indptr), so no request reaches past it, and a
# wider row is no pool's extent. A plan's work per row is bounded by what the row spans,
# so an absurd page size is refused here rather than walked.
MAX_ROW_POSITIONS = 1 << 31


def check_table_extent(table_name: str, width: int, page_size: int, num_slots: int | None = None) -> None:
    """Refuse a slot table no pool can be addressed by: rows of ``width`` entries of
    ``page_size`` slots span more than :data:`MAX_ROW_POSITIONS` positions, or (with the
    canary's ``num_slots`` known) one page holds more slots than the whole pool."""
    if num_slots is not None and page_size > num_slots:
        raise ValueError(f"kvcanary: page_size: a page of {page_size} slots is larger than the canary's whole pool "
                         f"(num_slots = {num_slots}); expected page_size <= num_slots")
    if width * page_size > MAX_ROW_POSITIONS:
        if page_size > 1:
            raise ValueError(f"kvcanary: page_size: {table_name} rows of {width} pages of {page_size} slots span "
                             f"{width * page_size} positions, expected at most 2**31 = {MAX_ROW_POSITIONS} (no "
                             "attention kernel reaches further, and no pool is addressed by wider rows)")
        raise ValueError(f"kvcanary: {table_name}: rows of {width} positions, expected at most 2**31 = "
                         f"{MAX_ROW_POSITIONS}")


def slot_table(req_to_token, block_table, page_size, num_slots: int | None = None) -> tuple[str, object, int]:
    """Which slot table a call passes: ``(keyword, table, page size)``; exactly one of
    ``req_to_token`` (page size 1) and ``block_table`` with ``page_size`` (an integer
    >= 1). Where the table has a shape, its extent is checked too (see
    :func:`check_table_extent`, with the canary's ``num_slots`` when given), so no pool
    can be sized for a table no pool is addressed by."""
    if (req_to_token is None) == (block_table is None):
        raise ValueError("kvcanary: plan: pass exactly one slot table, req_to_token= or block_table= (with page_size=)")
    if req_to_token is not None:
        if page_size is not None and not (scalars.check_int(page_size, "page_size") == 1):
            raise ValueError(f"kvcanary: page_size: only meaningful with block_table=, got {page_size} with req_to_token=")
        name, table, page = "req_to_token", req_to_token, 1
    elif page_size is None:
        raise ValueError("kvcanary: page_size: block_table= needs page_size >= 1, got None")
    else:
        name, table, page = "block_table", block_table, scalars.check_int(page_size, "page_size", minimum=1)
    try:
        width = int(table.shape[1])
    except (AttributeError, IndexError, TypeError, ValueError):
        width = None  # not 2-D, or no shape yet: checked once imported
    if width is not None:
        check_table_extent(name, width, page, num_slots)
    return name, table, page


def _plan_inputs(args, op: str = "plan", num_slots: int | None = None):
    """Validate plan's arguments: (device, the backend's keyword arguments, the caller's
    arrays, and every array the plan reads by name: first the views of those arrays, in
    their order, then the arrays of ``swa`` and ``expected``). ``num_slots``: the canary's,
    where a fused op knows it (see :func:`check_table_extent`)."""
    (verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size,
     swa, expected) = args
    if verify_plan is None and write_plan is None:
        raise ValueError("kvcanary: plan: expected a verify_plan, a write_plan or both, got neither")
    if verify_plan is not None:
        _expect(verify_plan, VerifyPlan, "verify_plan")._held.check()
    if write_plan is not None:
        _expect(write_plan, WritePlan, "write_plan")._held.check()
    device = (verify_plan or write_plan).device
    if verify_plan is not None and write_plan is not None and write_plan.device != device:
        raise ValueError(f"kvcanary: write_plan: expected it on {device} like verify_plan, got {write_plan.device}")

    table_name, table_obj, page = slot_table(req_to_token, block_table, page_size, num_slots)
    table = arrays.as_index_array(table_obj, table_name, ndim=2, device=device)
    check_table_extent(table_name, int(table.shape[1]), page, num_slots)
    rpi = arrays.as_index_array(req_pool_indices, "req_pool_indices", device=device)
    bs = int(rpi.shape[0])
    pre = arrays.as_index_array(prefix_lens, "prefix_lens", device=device, min_len=bs)
    ext = arrays.as_index_array(extend_lens, "extend_lens", device=device, min_len=bs)
    for p, pname in ((verify_plan, "verify_plan"), (write_plan, "write_plan")):
        if p is not None and bs > p.max_batch:
            raise ValueError(f"kvcanary: req_pool_indices: a batch of {bs} rows does not fit {pname}.max_batch = "
                             f"{p.max_batch}; allocate the plan with a larger max_batch")
    read = {"req_pool_indices": rpi, "prefix_lens": pre, "extend_lens": ext, table_name: table}
    if swa is not None:
        _expect(swa, SwaWindow, "swa")._held.check()
        if swa.lut is not None:
            arrays.check_array(swa.lut, "swa.lut", device=device)
            read["swa.lut"] = swa.lut
    if expected is not None:
        _expect(expected, ExpectedTokens, "expected")._held.check()
        arrays.check_array(expected.table, "expected.table", device=device)
        arrays.check_array(expected.valid_lens, "expected.valid_lens", device=device, min_len=bs)
        if verify_plan is None:
            raise ValueError("kvcanary: expected: expected tokens fill verify_plan.expected_tokens; pass a verify_plan")
        read.update({"expected.table": expected.table, "expected.valid_lens": expected.valid_lens})
    arrays.check_apart(op, {**_fields("verify_plan", verify_plan), **_fields("write_plan", write_plan)}, read)
    return (device, dict(req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, table=table, page_size=page,
                         swa=swa, expected=expected),
            (req_pool_indices, prefix_lens, extend_lens, table_obj), read)


def _write_digest(digest, device: str, canary, log):
    """``digest`` checked for running inside a write's launch (see :func:`write`)."""
    from .digest import Digest  # noqa: PLC0415  (digest imports the backends, as ops does)

    if not isinstance(digest, Digest):
        raise TypeError(f"kvcanary: digest: expected a kvcanary_cupy.digest.Digest, got {type(digest).__name__}")
    if digest.device != device:
        raise ValueError(f"kvcanary: digest: expected it on {device} like the canary, got {digest.device}")
    if digest.carry is not None:
        raise ValueError("kvcanary: digest: a digest run inside a write carries nothing (it would copy its carry "
                         "while the write appends to the log); make it with carry=None")
    changed = {"canary.records": canary.records, "log.ring": log.ring, "log.head": log.head,
               "log.counters": log.counter_array}
    for i, (data, count, gate, _) in enumerate(digest.rows):
        for name, a in ((f"digest.rows[{i}].array", data), (f"digest.rows[{i}].count", count),
                        (f"digest.rows[{i}].gate", gate)):
            if a is not None:
                arrays.check_disjoint("write", {**changed, name: a})
    arrays.check_disjoint("write", {**changed, "digest.out": digest.out})
    return digest


def _token_inputs(device: str, input_ids, positions, out_cache_loc, expected_inputs):
    """Validate a write's token inputs: (the backend's keyword arguments, the caller's arrays,
    their imported views by name, in the same order)."""
    ids = arrays.as_index_array(input_ids, "input_ids", device=device)
    pos = arrays.as_index_array(positions, "positions", device=device)
    loc = arrays.as_index_array(out_cache_loc, "out_cache_loc", device=device)
    exp_tok = exp_pos = None
    given, read = [input_ids, positions, out_cache_loc], {"input_ids": ids, "positions": pos, "out_cache_loc": loc}
    if expected_inputs is not None:
        if not isinstance(expected_inputs, (tuple, list)) or len(expected_inputs) != 2:
            raise TypeError("kvcanary: expected_inputs: expected a pair (tokens, positions), either may be None")
        if expected_inputs[0] is not None:
            exp_tok = read["expected_inputs[0]"] = arrays.as_index_array(expected_inputs[0], "expected_inputs[0]",
                                                                         device=device)
            given.append(expected_inputs[0])
        if expected_inputs[1] is not None:
            exp_pos = read["expected_inputs[1]"] = arrays.as_index_array(expected_inputs[1], "expected_inputs[1]",
                                                                         device=device)
            given.append(expected_inputs[1])
    return (dict(input_ids=ids, positions=pos, out_cache_loc=loc, expected_tokens=exp_tok, expected_positions=exp_pos),
            tuple(given), read)


def _write_inputs(args):
    """Validate write's arguments: (device, the backend's keyword arguments, the caller's
    arrays, and their imported views and names, in the same order)."""
    (canary, write_plan, input_ids, positions, out_cache_loc, log, tag, real_kv, real_kv_mode, expected_inputs,
     digest, max_row_tokens) = args
    device = _canary_device(canary, write_plan=(write_plan, WritePlan), log=(log, ViolationLog))
    tag = scalars.check_tag(tag)
    if max_row_tokens is not None:
        max_row_tokens = scalars.check_int(max_row_tokens, "max_row_tokens", minimum=0)
    tokens, given, read = _token_inputs(device, input_ids, positions, out_cache_loc, expected_inputs)
    srcs, mode = check_sources(real_kv, real_kv_mode, device, canary.num_slots)
    arrays.check_apart("write", {"canary.records": canary.records, **_log_arrays(log)},
                       {**_fields("write_plan", write_plan), **read, **_source_arrays(srcs)})
    extra = {} if digest is None else {"digest": _write_digest(digest, device, canary, log)}
    return (device, dict(**tokens, log=log, tag=tag, sources=srcs, mode=mode, max_row_tokens=max_row_tokens,
                         **extra), given, tuple(read.values()), tuple(read))


def _verify_inputs(op: str, args):
    """Validate verify's arguments: (device, the backend's keyword arguments, the sources'
    arrays by name)."""
    canary, verify_plan, log, tag, real_kv, real_kv_mode, check_tokens, sample = args
    optional = {} if sample is None else {"sample": (sample, FingerprintSampler)}
    device = _canary_device(canary, verify_plan=(verify_plan, VerifyPlan), log=(log, ViolationLog), **optional)
    tag = scalars.check_tag(tag)
    check_tokens = scalars.check_flag(check_tokens, "check_tokens")
    srcs, mode = check_sources(real_kv, real_kv_mode, device, canary.num_slots)
    sources = _source_arrays(srcs)
    arrays.check_apart(op, {**_log_arrays(log), **_fields("sample", sample)},
                       {"canary.records": canary.records, **_fields("verify_plan", verify_plan), **sources})
    return device, dict(log=log, tag=tag, sources=srcs, mode=mode, check_tokens=check_tokens,
                        sample=sample if srcs else None), sources


def _plan_verify_inputs(op: str, pobjs, vargs):
    """Validate the plan and verify arguments of a fused op: (device, the plan's and the
    verify's backend keyword arguments, the buffers it writes by name and the arrays it reads
    by name, to check apart (the records are the caller's to add to one or the other), and
    the caller's arrays, whose views come first in what it reads, in their order)."""
    verify_plan, write_plan = pobjs[:2]
    canary = vargs[0]
    if verify_plan is None:
        raise ValueError(f"kvcanary: verify_plan: {op} needs a VerifyPlan (plan() alone plans writes only)")
    device, vinputs, sources = _verify_inputs(op, vargs)
    pdevice, pinputs, given, read = _plan_inputs(pobjs, op, canary.num_slots)
    if pdevice != device:
        raise ValueError(f"kvcanary: verify_plan: expected it on {device} like the canary, got {pdevice}")
    written = {**_fields("verify_plan", verify_plan), **_fields("write_plan", write_plan),
               **_log_arrays(vinputs["log"]), **_fields("sample", vargs[-1])}
    return device, pinputs, vinputs, written, {**read, **sources}, given


def _plan_and_verify_inputs(args):
    """Validate plan_and_verify's arguments (and its ``digest``): (device, the backend's
    keyword arguments, the caller's arrays, and their imported views and names, in the
    same order)."""
    pobjs, vargs, digest = args
    device, pinputs, vinputs, written, read, given = _plan_verify_inputs("plan_and_verify", pobjs, vargs)
    names = tuple(read)[:len(given)]
    views = tuple(read[n] for n in names)
    if digest is not None:
        view = arrays.as_array(digest, "digest", dtypes=arrays.INT64, ndim=1, device=device, writable=True)
        if view.shape[0] != 1:
            raise ValueError(f"kvcanary: digest: expected an int64 [1] device scalar, got shape {tuple(view.shape)}")
        written["digest"] = view
        vinputs["digest"] = view
        given, views, names = (*given, digest), (*views, view), (*names, "digest")
    arrays.check_apart("plan_and_verify", written, {"canary.records": vargs[0].records, **read})
    return device, {**pinputs, **vinputs}, given, views, names


STEP_WRITE_TOKENS = 256  # the most input tokens plan_verify_write stamps in its launch


def _plan_verify_write_inputs(args):
    """Validate plan_verify_write's arguments: (device, the backend's keyword arguments, the
    caller's arrays, and their imported views and names, in the same order)."""
    pobjs, vargs, wargs, write_tag = args
    if pobjs[1] is None:
        raise ValueError("kvcanary: write_plan: plan_verify_write writes the step; pass its WritePlan")
    device, pinputs, vinputs, written, read, given = _plan_verify_inputs("plan_verify_write", pobjs, vargs)
    write_tag = scalars.check_tag(write_tag, "write_tag")
    tokens, wgiven, wread = _token_inputs(device, *wargs)
    names = tuple(read)[:len(given)] + tuple(wread)
    read.update(wread)
    arrays.check_apart("plan_verify_write", {"canary.records": vargs[0].records, **written}, read)
    n = min(int(v.shape[0]) for v in wread.values())
    if n > STEP_WRITE_TOKENS:
        raise ValueError(f"kvcanary: input_ids: plan_verify_write stamps at most {STEP_WRITE_TOKENS} tokens in its "
                         f"launch, got {n} (the shortest of the token inputs); slice them to the step's tokens, "
                         "or call plan_and_verify, then write")
    del vinputs["sources"], vinputs["mode"], vinputs["sample"]
    return (device, {**pinputs, **vinputs, **tokens, "write_tag": write_tag}, given + wgiven,
            tuple(read[k] for k in names), names)


def _scatter_inputs(args):
    """Validate scatter_expected_tokens' arguments: (device, the table's view, the backend's
    keyword arguments, the imported views of the caller's arrays and their names, in order)."""
    table, tokens, offsets, req_pool_indices, input_errors = args
    t = arrays.as_index_array(table, "table", ndim=2)
    arrays.check_array(t, "table", writable=True)
    device = runtime.device_of(t)
    tok = arrays.as_index_array(tokens, "tokens", device=device)
    rpi = arrays.as_index_array(req_pool_indices, "req_pool_indices", device=device)
    off = arrays.as_index_array(offsets, "offsets", device=device, min_len=int(rpi.shape[0]) + 1)
    err = None
    if input_errors is not None:
        err = arrays.as_array(input_errors, "input_errors", dtypes=arrays.INT64, ndim=1, device=device,
                              writable=True)
        if err.shape[0] != 1:
            raise ValueError(f"kvcanary: input_errors: expected a device scalar of shape (1,), got {tuple(err.shape)}")
    views = (t, tok, off, rpi) + ((err,) if err is not None else ())
    names = ("table", "tokens", "offsets", "req_pool_indices", "input_errors")[:len(views)]
    arrays.check_apart("scatter_expected_tokens", {"table": t, "input_errors": err},
                       {"tokens": tok, "offsets": off, "req_pool_indices": rpi})
    return device, t, dict(tokens=tok, offsets=off, req_pool_indices=rpi, input_errors=err), views, names
