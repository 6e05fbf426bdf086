"""The friendly functions: :func:`plan`, :func:`verify`, :func:`write`,
:func:`plan_and_verify` and :func:`plan_verify_write`, traceable by Dynamo.

Each takes the keyword arguments of the library's op of the same name, with the library
objects replaced by their ``Torch*`` twins (:mod:`.twins`), checks them, flattens them
into the op's arguments in :mod:`.schemas`' order (tensors, lists of tensors, ints, bools,
strings) and calls ``torch.ops.kvcanary.<op>``, on ``stream`` if one is given.
"""
from __future__ import annotations

import torch

import kvcanary_cupy as kc
from kvcanary_cupy import scalars
from kvcanary_cupy.format import RealKvMode

from . import register  # noqa: F401  (defines the torch.ops.kvcanary ops called here)
from .twins import (
    TorchCanaryBuffer,
    TorchExpectedTokens,
    TorchFingerprintSampler,
    TorchRealKvSource,
    TorchSwaWindow,
    TorchVerifyPlan,
    TorchViolationLog,
    TorchWritePlan,
)


def _holder(obj, cls, name: str):
    if obj is None or isinstance(obj, cls):
        return obj
    lib_cls = cls.LIBRARY_CLASS
    if isinstance(obj, lib_cls):
        raise TypeError(f"kvcanary: {name}: expected a {cls.__name__}, got a {lib_cls.__name__}; wrap it once, "
                        f"outside the step, with {cls.__name__}.from_library(...) (zero copy) and pass that")
    raise TypeError(f"kvcanary: {name}: expected a {cls.__name__}, got {type(obj).__name__}")


def _int(value, name: str, optional: bool = False):
    if optional and value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return scalars.check_int(value, name)  # a NumPy integer, or a kvcanary: error


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"kvcanary: {name}: expected True or False, got {type(value).__name__} {value!r}")
    return value


def _tensor(value, name: str, optional: bool = False):
    if optional and value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"kvcanary: {name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _plan_args(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa, expected):
    swa = _holder(swa, TorchSwaWindow, "swa")
    expected = _holder(expected, TorchExpectedTokens, "expected")
    return [_tensor(req_pool_indices, "req_pool_indices"), _tensor(prefix_lens, "prefix_lens"),
            _tensor(extend_lens, "extend_lens"), _tensor(req_to_token, "req_to_token", True),
            _tensor(block_table, "block_table", True), _int(page_size, "page_size", True),
            0 if swa is None else swa.size, None if swa is None else swa.lut,
            None if expected is None else expected.table, None if expected is None else expected.valid_lens,
            0 if expected is None else expected.offset]


def _token_args(input_ids, positions, out_cache_loc, expected_inputs=None) -> list:
    """A write's token tensors, then its expected ones (or None each)."""
    exp_ids = exp_pos = None
    if expected_inputs is not None:
        if not isinstance(expected_inputs, (tuple, list)) or len(expected_inputs) != 2:
            raise TypeError("kvcanary: expected_inputs: expected a pair (tokens, positions), either may be None")
        exp_ids = _tensor(expected_inputs[0], "expected_inputs[0]", True)
        exp_pos = _tensor(expected_inputs[1], "expected_inputs[1]", True)
    return [_tensor(input_ids, "input_ids"), _tensor(positions, "positions"), _tensor(out_cache_loc, "out_cache_loc"),
            exp_ids, exp_pos]


def _check_args(tag, real_kv, real_kv_mode):
    if real_kv is None:
        real_kv = ()
    elif isinstance(real_kv, (TorchRealKvSource, kc.RealKvSource)):
        real_kv = (real_kv,)
    sources = [_holder(s, TorchRealKvSource, f"real_kv[{i}]") for i, s in enumerate(real_kv)]
    layout = []
    for s in sources:
        layout += s.layout()
    return [_int(tag, "tag"), [s.tensor for s in sources], layout, _int(real_kv_mode, "real_kv_mode")]


def _sample_args(sample):
    sample = _holder(sample, TorchFingerprintSampler, "sample")
    return [None, 1] if sample is None else [sample.state, sample.period]


def _run(op, stream, args) -> None:
    if stream is None:
        op(*args)
    else:
        with torch.cuda.stream(stream):
            op(*args)


def plan(verify_plan: TorchVerifyPlan | None, write_plan: TorchWritePlan | None, *, req_pool_indices,
         prefix_lens, extend_lens, req_to_token=None, block_table=None, page_size: int | None = None,
         swa: TorchSwaWindow | None = None, expected: TorchExpectedTokens | None = None, stream=None) -> None:
    """:func:`kvcanary_cupy.plan` through ``torch.ops.kvcanary.plan``.

    Args:
        verify_plan: :class:`TorchVerifyPlan` receiving one entry per record the step
            reads; None to plan writes only.
        write_plan: :class:`TorchWritePlan` receiving per-row write offsets and seeds;
            None to plan verification only.
        req_pool_indices: int32 / int64 ``[bs]`` tensor, each row's request-table row
            (0: padding).
        prefix_lens: int32 / int64 ``[bs]`` tensor, tokens already cached per row.
        extend_lens: int32 / int64 ``[bs]`` tensor, tokens this step writes per row.
        req_to_token: int32 / int64 ``[num_requests, max_len]`` token-level slot table; or
        block_table: int32 / int64 ``[num_requests, max_pages]`` with ``page_size`` (int).
        swa: :class:`TorchSwaWindow`: verify the window only, slots through its LUT.
        expected: :class:`TorchExpectedTokens`: fill the plan's expected tokens.
        stream: a ``torch.cuda.Stream`` to run on; None (and always inside a compiled
            region): PyTorch's current stream.

    Example::

        >>> vp, wp = TorchVerifyPlan.allocate(capacity=64, max_batch=2), TorchWritePlan.allocate(max_batch=2)
        >>> table = torch.arange(1, 33, dtype=torch.int32).reshape(2, 16)
        >>> plan(vp, wp, req_pool_indices=torch.tensor([1, 0]), prefix_lens=torch.tensor([3, 7]),
        ...      extend_lens=torch.tensor([1, 9]), req_to_token=table)
        >>> vp.slot_indices[:3].tolist(), wp.seed_slots.tolist()
        ([17, 18, 19], [19, -2])
    """
    vp = _holder(verify_plan, TorchVerifyPlan, "verify_plan")
    wp = _holder(write_plan, TorchWritePlan, "write_plan")
    _run(torch.ops.kvcanary.plan.default, stream,
         [[] if vp is None else vp.tensors(), [] if wp is None else wp.tensors(),
          *_plan_args(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa,
                      expected)])


def verify(canary: TorchCanaryBuffer, verify_plan: TorchVerifyPlan, *, log: TorchViolationLog, tag: int,
           real_kv=(), real_kv_mode=RealKvMode.NONE, check_tokens: bool = False,
           sample: TorchFingerprintSampler | None = None, stream=None) -> None:
    """:func:`kvcanary_cupy.verify` through ``torch.ops.kvcanary.verify``.

    Args:
        canary: :class:`TorchCanaryBuffer`, the records (read).
        verify_plan: :class:`TorchVerifyPlan` from :func:`plan` for this step (read).
        log: :class:`TorchViolationLog` receiving violation rows and counters.
        tag: an int (e.g. :class:`~kvcanary_cupy.LaunchTag`) naming this launch in rows.
        real_kv: a :class:`TorchRealKvSource` or a sequence of them, whose bytes the
            fingerprints cover, in order.
        real_kv_mode: :class:`~kvcanary_cupy.RealKvMode` (or its int value).
        check_tokens: also compare stored tokens with the plan's expected tokens.
        sample: :class:`TorchFingerprintSampler`: fingerprints of a rotating
            ``1/period`` of the slots only (its state is written).
        stream: as for :func:`plan`.

    Example::

        >>> canary, log = TorchCanaryBuffer.allocate(num_slots=64), TorchViolationLog.allocate(capacity=4)
        >>> vp = TorchVerifyPlan.allocate(capacity=8, max_batch=1)
        >>> verify(canary, vp, log=log, tag=kc.LaunchTag.VERIFY)   # never planned: skipped, counted
        >>> log.counters()["verifies_skipped"]
        1
    """
    cb = _holder(canary, TorchCanaryBuffer, "canary")
    vp = _holder(verify_plan, TorchVerifyPlan, "verify_plan")
    lg = _holder(log, TorchViolationLog, "log")
    if vp is None:
        raise TypeError("kvcanary: verify_plan: expected a TorchVerifyPlan, got None")
    _run(torch.ops.kvcanary.verify.default, stream,
         [cb.records, cb.chain, vp.tensors(), lg.tensors(), *_check_args(tag, real_kv, real_kv_mode),
          _flag(check_tokens, "check_tokens"), *_sample_args(sample)])


def write(canary: TorchCanaryBuffer, write_plan: TorchWritePlan, *, input_ids, positions, out_cache_loc,
          log: TorchViolationLog, tag: int, real_kv=(), real_kv_mode=RealKvMode.NONE, expected_inputs=None,
          max_row_tokens: int | None = None, stream=None) -> None:
    """:func:`kvcanary_cupy.write` through ``torch.ops.kvcanary.write``.

    Args:
        canary: :class:`TorchCanaryBuffer`, the records (written).
        write_plan: :class:`TorchWritePlan` from :func:`plan` for this step (read).
        input_ids: int32 / int64 ``[>= total]`` tensor, the tokens written, rows back to back.
        positions: int32 / int64 ``[>= total]`` tensor, their positions.
        out_cache_loc: int32 / int64 ``[>= total]`` tensor, their slots (negative: skipped).
        log: :class:`TorchViolationLog` receiving violation rows and counters.
        tag: an int (e.g. :class:`~kvcanary_cupy.LaunchTag`) naming this launch in rows.
        real_kv, real_kv_mode: as for :func:`verify`; the fingerprints stored.
        expected_inputs: optional pair ``(tokens, positions)`` of int32 / int64
            ``[>= total]`` tensors (either may be None; -1 skips an element):
            WRITE_TOKEN / WRITE_POSITION violations where they differ.
        max_row_tokens: optional int, a bound on every row's tokens (1 for a decode
            step), as :func:`kvcanary_cupy.write` takes it: a route, never other bytes.
        stream: as for :func:`plan`.

    Example::

        >>> canary, log = TorchCanaryBuffer.allocate(num_slots=8), TorchViolationLog.allocate(capacity=4)
        >>> wp = TorchWritePlan.allocate(max_batch=1)
        >>> plan(None, wp, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]),
        ...      extend_lens=torch.tensor([2]), req_to_token=torch.tensor([[0, 0], [5, 6]]))
        >>> write(canary, wp, input_ids=torch.tensor([7, 8]), positions=torch.tensor([0, 1]),
        ...       out_cache_loc=torch.tensor([5, 6]), log=log, tag=kc.LaunchTag.WRITE)
        >>> canary.records[5:7, :2].tolist()
        [[7, 0], [8, 1]]
    """
    cb = _holder(canary, TorchCanaryBuffer, "canary")
    wp = _holder(write_plan, TorchWritePlan, "write_plan")
    lg = _holder(log, TorchViolationLog, "log")
    if wp is None:
        raise TypeError("kvcanary: write_plan: expected a TorchWritePlan, got None")
    tokens = _token_args(input_ids, positions, out_cache_loc, expected_inputs)
    _run(torch.ops.kvcanary.write.default, stream,
         [cb.records, cb.chain, wp.tensors(), *tokens[:3], lg.tensors(), *_check_args(tag, real_kv, real_kv_mode),
          *tokens[3:], _int(max_row_tokens, "max_row_tokens", optional=True)])


def plan_and_verify(verify_plan: TorchVerifyPlan, write_plan: TorchWritePlan | None,
                    canary: TorchCanaryBuffer, *, req_pool_indices, prefix_lens, extend_lens, req_to_token=None,
                    block_table=None, page_size: int | None = None, swa: TorchSwaWindow | None = None,
                    expected: TorchExpectedTokens | None = None, log: TorchViolationLog, tag: int,
                    real_kv=(), real_kv_mode=RealKvMode.NONE, check_tokens: bool = False,
                    sample: TorchFingerprintSampler | None = None, stream=None) -> None:
    """A step's plan and verify, through ``torch.ops.kvcanary.plan_and_verify``.

    The results are those of :func:`plan` followed by :func:`verify` with the same
    arguments: the same log rows (as a multiset) and counters, the verify plan's
    scalars and ``offsets``, the whole write plan, the sampler's state. It runs the
    library's one-launch :func:`kvcanary_cupy.plan_and_verify`, which on CUDA does not
    write the verify plan's per-entry arrays (``slot_indices``, ``prev_slot_indices``,
    ``expected_positions``, ``expected_tokens``; the NumPy backend does); against a
    library version without it, ``plan`` then ``verify``, which write them. The op
    declares the whole verify plan as written either way.

    Args:
        verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens,
            req_to_token, block_table, page_size, swa, expected: as for :func:`plan`
            (``verify_plan`` is required).
        canary, log, tag, real_kv, real_kv_mode, check_tokens, sample: as for
            :func:`verify`.
        stream: as for :func:`plan`.

    Example::

        >>> canary, log = TorchCanaryBuffer.allocate(num_slots=8), TorchViolationLog.allocate(capacity=4)
        >>> vp, wp = TorchVerifyPlan.allocate(capacity=8, max_batch=1), TorchWritePlan.allocate(max_batch=1)
        >>> plan_and_verify(vp, wp, canary, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]),
        ...                 extend_lens=torch.tensor([2]), req_to_token=torch.tensor([[0, 0], [5, 6]]),
        ...                 log=log, tag=kc.LaunchTag.VERIFY)
        >>> wp.offsets.tolist(), log.count
        ([0, 2], 0)
    """
    vp = _holder(verify_plan, TorchVerifyPlan, "verify_plan")
    wp = _holder(write_plan, TorchWritePlan, "write_plan")
    cb = _holder(canary, TorchCanaryBuffer, "canary")
    lg = _holder(log, TorchViolationLog, "log")
    if vp is None:
        raise TypeError("kvcanary: verify_plan: expected a TorchVerifyPlan, got None")
    _run(torch.ops.kvcanary.plan_and_verify.default, stream,
         [vp.tensors(), [] if wp is None else wp.tensors(), cb.records, cb.chain,
          *_plan_args(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa,
                      expected),
          lg.tensors(), *_check_args(tag, real_kv, real_kv_mode), _flag(check_tokens, "check_tokens"),
          *_sample_args(sample)])


def plan_verify_write(verify_plan: TorchVerifyPlan, write_plan: TorchWritePlan, canary: TorchCanaryBuffer, *,
                      req_pool_indices, prefix_lens, extend_lens, req_to_token=None, block_table=None,
                      page_size: int | None = None, swa: TorchSwaWindow | None = None,
                      expected: TorchExpectedTokens | None = None, input_ids, positions, out_cache_loc,
                      expected_inputs=None, log: TorchViolationLog, tag: int, write_tag: int,
                      check_tokens: bool = False, stream=None) -> None:
    """A small step's plan, verify and write, through ``torch.ops.kvcanary.plan_verify_write``.

    The library's one-launch :func:`kvcanary_cupy.plan_verify_write`: what
    :func:`plan_and_verify` followed by :func:`write` leave (no real-KV fingerprints), for
    an engine that has the step's token inputs before its forward. At most
    ``kvcanary_cupy.STEP_WRITE_TOKENS`` (256) tokens; a larger step raises.

    Args:
        verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens,
            req_to_token, block_table, page_size, swa, expected: as for :func:`plan`
            (both plans are required).
        canary, log, check_tokens: as for :func:`verify`; the canary's records are written.
        input_ids, positions, out_cache_loc, expected_inputs: as for :func:`write`.
        tag: the verify's rows' tag; ``write_tag``: the write's.
        stream: as for :func:`plan`.

    Example::

        >>> canary, log = TorchCanaryBuffer.allocate(num_slots=8), TorchViolationLog.allocate(capacity=4)
        >>> vp, wp = TorchVerifyPlan.allocate(capacity=8, max_batch=1), TorchWritePlan.allocate(max_batch=1)
        >>> plan_verify_write(vp, wp, canary, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]),
        ...                   extend_lens=torch.tensor([2]), req_to_token=torch.tensor([[0, 0], [5, 6]]),
        ...                   input_ids=torch.tensor([7, 8]), positions=torch.tensor([0, 1]),
        ...                   out_cache_loc=torch.tensor([5, 6]), log=log, tag=kc.LaunchTag.VERIFY,
        ...                   write_tag=kc.LaunchTag.WRITE)
        >>> canary.records[5:7, :2].tolist(), log.count
        ([[7, 0], [8, 1]], 0)
    """
    vp = _holder(verify_plan, TorchVerifyPlan, "verify_plan")
    wp = _holder(write_plan, TorchWritePlan, "write_plan")
    cb = _holder(canary, TorchCanaryBuffer, "canary")
    lg = _holder(log, TorchViolationLog, "log")
    for given, name, cls in ((vp, "verify_plan", "TorchVerifyPlan"), (wp, "write_plan", "TorchWritePlan")):
        if given is None:
            raise TypeError(f"kvcanary: {name}: expected a {cls}, got None")
    _run(torch.ops.kvcanary.plan_verify_write.default, stream,
         [vp.tensors(), wp.tensors(), cb.records, cb.chain,
          *_plan_args(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa,
                      expected),
          *_token_args(input_ids, positions, out_cache_loc, expected_inputs), lg.tensors(),
          _int(tag, "tag"), _int(write_tag, "write_tag"), _flag(check_tokens, "check_tokens")])
