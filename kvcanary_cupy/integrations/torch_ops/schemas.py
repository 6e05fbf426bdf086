"""The schema of each op in the ``kvcanary`` namespace of ``torch.ops``.

One string per op, in ``torch.library``'s schema language: its arguments (tensors, lists
of tensors, ints, bools and strings: the library objects flattened into their tensors)
and, as ``Tensor(x!)``, exactly the buffers it writes, which is what
``torch.library.custom_op(mutates_args=...)`` would write. No op returns anything.
:mod:`.register` defines the ops from these strings; :mod:`.functions` builds the
arguments in this order.
"""

_PLAN_ARGS = ("Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, Tensor? req_to_token, "
              "Tensor? block_table, int? page_size, int swa_size, Tensor? swa_lut, Tensor? expected_table, "
              "Tensor? expected_valid_lens, int expected_offset")
_CHECK_ARGS = "int tag, Tensor[] real_kv, int[] real_kv_layout, int real_kv_mode"
SCHEMAS = {
    "plan": f"plan(Tensor(a!)[] verify_plan, Tensor(b!)[] write_plan, {_PLAN_ARGS}) -> ()",
    "verify": ("verify(Tensor canary, str? chain, Tensor[] verify_plan, Tensor(a!)[] log, "
               f"{_CHECK_ARGS}, bool check_tokens, Tensor(b!)? sample_state, int sample_period) -> ()"),
    "write": ("write(Tensor(a!) canary, str? chain, Tensor[] write_plan, Tensor input_ids, Tensor positions, "
              f"Tensor out_cache_loc, Tensor(b!)[] log, {_CHECK_ARGS}, Tensor? expected_input_ids, "
              "Tensor? expected_positions, int? max_row_tokens=None) -> ()"),
    "plan_and_verify": (f"plan_and_verify(Tensor(a!)[] verify_plan, Tensor(b!)[] write_plan, Tensor canary, "
                        f"str? chain, {_PLAN_ARGS}, Tensor(c!)[] log, {_CHECK_ARGS}, bool check_tokens, "
                        "Tensor(d!)? sample_state, int sample_period) -> ()"),
    "plan_verify_write": (f"plan_verify_write(Tensor(a!)[] verify_plan, Tensor(b!)[] write_plan, "
                          f"Tensor(c!) canary, str? chain, {_PLAN_ARGS}, Tensor input_ids, Tensor positions, "
                          "Tensor out_cache_loc, Tensor? expected_input_ids, Tensor? expected_positions, "
                          "Tensor(d!)[] log, int tag, int write_tag, bool check_tokens) -> ()"),
}
"""The schema of each op: ``Tensor(x!)`` marks what it writes (``mutates_args``)."""
