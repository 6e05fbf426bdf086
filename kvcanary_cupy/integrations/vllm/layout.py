"""Where each slot's K/V bytes live in vLLM's KV tensors, per attention backend.

- ``CPU_ATTN``: a layer's tensor is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``,
  and inside a (block, head) the backend's write op decides the order (keys may be
  stored transposed, ``[head_dim, block_size]``, for its vector units). The order is not
  assumed: it is learned once, at registration, by running the backend's own write op
  (``cpu_attn_reshape_and_cache``, with the layer's ISA and cache dtype) on a scratch
  block and reading back where each key and value element landed. The fingerprints then
  gather those elements (:class:`~kvcanary_cupy.integrations.engine.kv_layout.GatheredSlots`).
- ``FLASH_ATTN``: ``[2, num_blocks, block_size, kv_heads, head_dim]``: a slot's K (and V)
  is contiguous; sources read the engine's tensors directly
  (:class:`~kvcanary_cupy.integrations.engine.kv_layout.ContiguousSlots`).

Any other backend is refused: its layout is not known to the connector.
"""
from __future__ import annotations

import numpy as np

from ...format import RealKvMode
from ..engine.kv_layout import ContiguousSlots, GatheredSlots

KNOWN_BACKENDS = ("CPU_ATTN", "FLASH_ATTN")


def backend_name(layer) -> str:
    backend = getattr(layer, "attn_backend", None)
    return backend.get_name() if backend is not None else type(getattr(layer, "impl", layer)).__name__


def group_fingerprints(layers: dict, kv_caches: dict, *, block_size: int, num_blocks: int, mode: RealKvMode):
    """The fingerprint sources of one KV-cache group, or None with ``mode`` NONE.

    Args:
        layers: layer name -> vLLM's attention layer (the static forward context's entries).
        kv_caches: layer name -> its KV tensor (``register_kv_caches``' argument).
        block_size, num_blocks: the group's block size and the pool's blocks.
        mode: the monitors' :class:`~kvcanary_cupy.RealKvMode`.
    """
    names = [n for n in layers if n in kv_caches]
    backends = {backend_name(layers[n]) for n in names}
    if len(backends) != 1 or next(iter(backends)) not in KNOWN_BACKENDS:
        raise ValueError(f"kvcanary: attention backend: the connector knows the KV layout of "
                         f"{', '.join(KNOWN_BACKENDS)}, got {', '.join(sorted(backends)) or 'none'}; this engine "
                         f"cannot be watched")
    backend = backends.pop()
    tensors = [kv_caches[n] for n in names]
    if backend == "FLASH_ATTN":
        for t in tensors:
            if t.dim() != 5 or t.shape[0] != 2 or t.shape[2] != block_size or not t.is_contiguous():
                raise ValueError(f"kvcanary: attention backend FLASH_ATTN: expected contiguous KV tensors "
                                 f"[2, num_blocks, {block_size}, kv_heads, head_dim], got {tuple(t.shape)}")
        return None if mode == RealKvMode.NONE else ContiguousSlots([(t[0], t[1]) for t in tensors],
                                                                    block_size=block_size)
    for t in tensors:
        if t.dim() != 4 or t.shape[2] != block_size or t.device.type != "cpu":
            raise ValueError(f"kvcanary: attention backend CPU_ATTN: expected CPU KV tensors "
                             f"[num_blocks, kv_heads, {block_size}, 2 * head_dim], got {tuple(t.shape)}")
    if mode == RealKvMode.NONE:
        return None
    first = layers[names[0]]
    k_off, v_off = probe_cpu_layout(first, tensors[0])
    return GatheredSlots([t.numpy() for t in tensors], block_size=block_size, key_offsets=k_off,
                         value_offsets=v_off, mode=mode, num_slots=num_blocks * block_size)


def probe_cpu_layout(layer, like) -> tuple[np.ndarray, np.ndarray]:
    """Learn where CPU_ATTN's write op puts each slot's K and V elements inside a block.

    Returns ``(key_offsets, value_offsets)``, int64 ``[block_size, kv_heads * head_dim]``:
    the element offset, inside a block of ``like``'s geometry, of element ``(head, dim)``
    of the key (value) of the slot at each block offset. Each probe writes, through the
    backend's op, 2.0 where bit ``b`` of an element's index is set and 1.0 where it is
    clear (exact in every cache dtype), so every element's index reads back from where it
    landed; an element that lands nowhere, or twice, refuses the layout.
    """
    import torch  # noqa: PLC0415
    from vllm import _custom_ops as ops  # noqa: PLC0415

    _, heads, bs, two_dim = like.shape
    dim = two_dim // 2
    n = bs * heads * dim
    bits = max(1, int(n - 1).bit_length())
    index = torch.arange(n, dtype=torch.int64).view(bs, heads, dim)
    found = {}
    for which in ("key", "value"):
        code = np.zeros(heads * bs * two_dim, dtype=np.int64)
        touched = None
        for b in range(bits):
            scratch = torch.zeros((1, heads, bs, two_dim), dtype=like.dtype)
            data = (((index >> b) & 1) + 1).to(torch.float32).to(_compute_dtype(layer, like))
            zero = torch.zeros_like(data)
            k, v = (data, zero) if which == "key" else (zero, data)
            view = scratch.view(1, heads, 2 * bs, dim)
            kc, vc = view.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(bs, dtype=torch.int64), layer.isa,
                                           k_scale=getattr(layer, "_k_scale_float", 1.0),
                                           v_scale=getattr(layer, "_v_scale_float", 1.0),
                                           kv_cache_dtype=getattr(layer, "kv_cache_dtype", "auto"))
            got = scratch.reshape(-1).to(torch.float32).numpy()
            mark = got != 0
            touched = mark if touched is None else touched & mark
            code |= (got > 1.5).astype(np.int64) << b
        where = np.flatnonzero(touched)
        if where.size != n or np.unique(code[where]).size != n:
            raise ValueError(f"kvcanary: attention backend CPU_ATTN: the layout of ISA {layer.isa!r} could not be "
                             f"learned ({where.size} of {n} {which} elements found once); this engine cannot be "
                             f"watched with real-KV fingerprints (real_kv_mode='none' watches it without)")
        offsets = np.empty(n, dtype=np.int64)
        offsets[code[where]] = where
        found[which] = offsets.reshape(bs, heads * dim)
    return found["key"], found["value"]


def _compute_dtype(layer, like):
    """The dtype of the K/V the layer writes (its cache's, unless the cache is quantized)."""
    import torch  # noqa: PLC0415

    return like.dtype if like.dtype.is_floating_point and like.dtype.itemsize > 1 else torch.float32
