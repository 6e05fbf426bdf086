"""What every engine adapter shares, engine-neutral (no engine is imported here).

- ``tables``: request rows (:class:`RowPool`) and host-mirrored tables: slots, expected tokens.
- ``staging``: what travels to the device each step (one launch on CUDA).
- ``violations``: :class:`EngineViolation` (a row in the engine's terms: request id,
  position, layer group) and :class:`RequestTag`, the request a monitor reports.
- ``policy``: :class:`IncidentPolicy`, ``"log"`` / ``"raise"`` / ``"cancel"`` / a callable,
  each incident once.
- ``options``: the checks of an adapter's options and of the KvCanary options it passes on.
- ``block_table``: :class:`BlockTableCanary`, one KvCanary over a block-table (vLLM-style)
  KV pool driven by what attention reads each step, on NumPy or torch (CPU or CUDA) arrays.
- ``step_arrays``: the few array operations a step needs, on NumPy (CPU) or torch (CUDA).
- ``kv_layout``: real-KV fingerprint sources over an engine's KV tensors, for layouts whose
  slots are contiguous and for those that must be gathered first.
"""
