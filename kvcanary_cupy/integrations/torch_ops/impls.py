"""The ops' real implementations: flattened op arguments back to library calls.

Each ``_*_impl`` takes its op's arguments in :mod:`.schemas`' order, finds the library
objects again by their tensors (:mod:`.objects`) and the per-step index tensors as
cached views (:mod:`.views`), and calls the library's op of the same name on PyTorch's
current stream of the tensors' device. They are registered for every device
(``CompositeExplicitAutograd``) by :mod:`.register`: the library dispatches on the arrays.
"""
from __future__ import annotations

import kvcanary_cupy as kc

from .objects import _canary, _expected, _log, _sampler, _sources, _swa, _verify_plan, _write_plan
from .views import _stream, _view


def _plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size, swa_size,
                 swa_lut, expected_table, expected_valid_lens, expected_offset) -> dict:
    """A plan's inputs, as the library's ops take them."""
    return dict(req_pool_indices=_view(req_pool_indices, "req_pool_indices"),
                prefix_lens=_view(prefix_lens, "prefix_lens"), extend_lens=_view(extend_lens, "extend_lens"),
                req_to_token=_view(req_to_token, "req_to_token"), block_table=_view(block_table, "block_table"),
                page_size=page_size, swa=_swa(swa_size, swa_lut),
                expected=_expected(expected_table, expected_valid_lens, expected_offset))


def _plan_impl(verify_plan, write_plan, req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table,
               page_size, swa_size, swa_lut, expected_table, expected_valid_lens, expected_offset) -> None:
    kc.plan(_verify_plan(verify_plan), _write_plan(write_plan),
            **_plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size,
                           swa_size, swa_lut, expected_table, expected_valid_lens, expected_offset),
            stream=_stream((verify_plan or write_plan or [req_pool_indices])[0]))


def _verify_impl(canary, chain, verify_plan, log, tag, real_kv, real_kv_layout, real_kv_mode, check_tokens,
                 sample_state, sample_period) -> None:
    kc.verify(_canary(canary, chain), _verify_plan(verify_plan), log=_log(log), tag=tag,
              real_kv=_sources(real_kv, real_kv_layout), real_kv_mode=real_kv_mode, check_tokens=check_tokens,
              sample=_sampler(sample_period, sample_state), stream=_stream(canary))


def _token_inputs(input_ids, positions, out_cache_loc, expected_input_ids, expected_positions) -> dict:
    """A write's token inputs, as the library's ops take them."""
    expected_inputs = None
    if expected_input_ids is not None or expected_positions is not None:
        expected_inputs = (_view(expected_input_ids, "expected_input_ids"),
                           _view(expected_positions, "expected_positions"))
    return dict(input_ids=_view(input_ids, "input_ids"), positions=_view(positions, "positions"),
                out_cache_loc=_view(out_cache_loc, "out_cache_loc"), expected_inputs=expected_inputs)


def _write_impl(canary, chain, write_plan, input_ids, positions, out_cache_loc, log, tag, real_kv, real_kv_layout,
                real_kv_mode, expected_input_ids, expected_positions, max_row_tokens=None) -> None:
    kc.write(_canary(canary, chain), _write_plan(write_plan),
             **_token_inputs(input_ids, positions, out_cache_loc, expected_input_ids, expected_positions),
             log=_log(log), tag=tag, real_kv=_sources(real_kv, real_kv_layout), real_kv_mode=real_kv_mode,
             max_row_tokens=max_row_tokens, stream=_stream(canary))


def _library_plan_and_verify():
    """The library's fused op, where this version of it has one."""
    fused = getattr(kc, "plan_and_verify", None)
    return fused if fused is not None else getattr(kc.ops, "plan_and_verify", None)


def _plan_and_verify_impl(verify_plan, write_plan, canary, chain, req_pool_indices, prefix_lens, extend_lens,
                          req_to_token, block_table, page_size, swa_size, swa_lut, expected_table,
                          expected_valid_lens, expected_offset, log, tag, real_kv, real_kv_layout, real_kv_mode,
                          check_tokens, sample_state, sample_period) -> None:
    vp, wp, cb = _verify_plan(verify_plan), _write_plan(write_plan), _canary(canary, chain)
    planned = _plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table, page_size,
                           swa_size, swa_lut, expected_table, expected_valid_lens, expected_offset)
    checks = dict(log=_log(log), tag=tag, real_kv=_sources(real_kv, real_kv_layout), real_kv_mode=real_kv_mode,
                  check_tokens=check_tokens, sample=_sampler(sample_period, sample_state))
    stream = _stream(canary)
    fused = _library_plan_and_verify()
    if fused is not None:
        fused(vp, wp, cb, **planned, **checks, stream=stream)
    else:  # the same results, in two launches
        kc.plan(vp, wp, **planned, stream=stream)
        kc.verify(cb, vp, **checks, stream=stream)


def _plan_verify_write_impl(verify_plan, write_plan, canary, chain, req_pool_indices, prefix_lens, extend_lens,
                            req_to_token, block_table, page_size, swa_size, swa_lut, expected_table,
                            expected_valid_lens, expected_offset, input_ids, positions, out_cache_loc,
                            expected_input_ids, expected_positions, log, tag, write_tag, check_tokens) -> None:
    kc.plan_verify_write(_verify_plan(verify_plan), _write_plan(write_plan), _canary(canary, chain),
                         **_plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, block_table,
                                        page_size, swa_size, swa_lut, expected_table, expected_valid_lens,
                                        expected_offset),
                         **_token_inputs(input_ids, positions, out_cache_loc, expected_input_ids,
                                         expected_positions),
                         log=_log(log), tag=tag, write_tag=write_tag, check_tokens=check_tokens,
                         stream=_stream(canary))
