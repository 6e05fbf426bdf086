"""Records that travel with their KV: export_records and import_records.

When KV moves (offload to the host and back, a prefill handed to a decode
instance, a rank sending KV to another), its canary records move with it. A
record's link is computed from its predecessor's *record* alone (token,
position, link), never from slot ids, so records copied with their KV into
other slots, pools, hosts or processes still chain: the receiver's next verify
checks the chain and positions against its own slot table, and the real-KV
fingerprints that travelled against the KV bytes that arrived. A byte corrupted
in transit shows as REAL_KV; KV landing in the wrong slots (or records imported
in another order than the KV) shows as CHAIN / POSITION.

Fingerprints compare only when the receiver fingerprints the same bytes per
slot as the sender (the same sources, layers, ``read_bytes`` and mode: e.g. the
same tensor-parallel shard of the heads).

Slots are host integers (a NumPy array, a list, a CPU tensor): the scheduler's
own slot list, checked in full before any record moves (each in
``[1, num_slots)``, since slot 0 is the reserved padding slot; no slot twice in
an import). On a CUDA canary they reach the device through a pinned staging copy
on the op's stream; the gather and the scatter run on that stream, in order
with every other op on it, and nothing waits for the device.
"""
from __future__ import annotations

import numpy as np

from . import arrays, runtime
from .canary import CanaryBuffer
from .format import RECORD_WORDS


def _canary(canary) -> CanaryBuffer:
    if not isinstance(canary, CanaryBuffer):
        raise TypeError(f"kvcanary: canary: expected a CanaryBuffer, got {type(canary).__name__}")
    return canary


def host_slots(slots, num_slots: int, *, unique: bool, name: str = "slots") -> np.ndarray:
    """``slots`` as an int64 NumPy vector, every value in ``[1, num_slots)`` (and, with
    ``unique``, none twice), or a ``kvcanary:`` error naming ``name``."""
    if isinstance(slots, (list, tuple)):
        if not all(isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) for s in slots):
            raise TypeError(f"kvcanary: {name}: expected integers, got {slots!r}")
        a = np.asarray(slots, dtype=np.int64).reshape(-1)
    else:
        if slots is None:
            raise TypeError(f"kvcanary: {name}: expected host integers (a NumPy array, a list, a CPU tensor), got None")
        a = arrays.as_view(slots, name)
        if not isinstance(a, np.ndarray):
            raise ValueError(f"kvcanary: {name}: expected host integers (a NumPy array, a list, a CPU tensor), got an "
                             f"array on {runtime.device_of(a)}: every slot is checked before a record moves, and "
                             "reading a device array would stall the stream")
        arrays.check_array(a, name, dtypes=arrays.INDEX_DTYPES, ndim=1, contiguous=False)
        a = a.astype(np.int64, copy=False)
    if a.size:
        bad = np.nonzero((a < 1) | (a >= num_slots))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"kvcanary: {name}: expected slots in [1, num_slots = {num_slots}) (slot 0 is the reserved "
                             f"padding slot), got {int(a[i])} at index {i}")
        if unique:
            values, first, counts = np.unique(a, return_index=True, return_counts=True)
            if (counts > 1).any():
                k = int(np.nonzero(counts > 1)[0][0])
                raise ValueError(f"kvcanary: {name}: slot {int(values[k])} appears {int(counts[k])} times (first at "
                                 f"index {int(first[k])}); expected each imported record to get its own slot")
    return np.ascontiguousarray(a)


def _device_slots(s: np.ndarray, device: str, ptr):
    """The slots on the canary's device, staged on stream ``ptr`` (CuPy copies a host array through
    pinned memory it keeps until the copy is done, so this neither blocks nor waits)."""
    if runtime.is_cpu(device):
        return s
    with runtime.on_stream(device, ptr):
        return runtime.cupy().asarray(s)


def export_records(canary: CanaryBuffer, slots, *, stream=None):
    """A copy of the records of ``slots``: int64 ``[n, 4]`` on the canary's device.

    Send them wherever the KV of those slots goes and :func:`import_records` them
    with it (into any slots). The link of each record was derived from its
    predecessor's record, not from its slot, so the chain survives the move.

    Args:
        canary: the sender's :class:`CanaryBuffer`.
        slots: host integers ``[n]``, each in ``[1, num_slots)``.
        stream: CUDA stream the gather runs on (default: the current one).

    Returns:
        int64 ``[n, 4]`` (token, position, link, fingerprint per slot, in ``slots``
        order): NumPy on ``"cpu"``, CuPy on CUDA, allocated on ``stream``.

    Example::

        >>> import numpy as np, kvcanary_cupy as kc
        >>> canary = kc.CanaryBuffer.allocate(num_slots=8)
        >>> canary.records[3:5] = kc.make_records([101, 102], [0, 1])
        >>> export_records(canary, [3, 4])[:, :2].tolist()
        [[101, 0], [102, 1]]
    """
    canary = _canary(canary)
    s = host_slots(slots, canary.num_slots, unique=False)
    if runtime.is_cpu(canary.device):
        return canary.records[s]
    ptr = runtime.resolve_stream(stream, ())
    idx = _device_slots(s, canary.device, ptr)
    with runtime.on_stream(canary.device, ptr):
        return canary.records[idx]


def import_records(canary: CanaryBuffer, slots, records, *, stream=None) -> None:
    """Write travelled records into ``slots`` of ``canary``, in stream order.

    ``records[i]`` goes to ``slots[i]``: the slot where the KV of that record
    landed. The receiver's next verify then checks them like records it stamped
    itself: the chain and positions against its own slot table, the fingerprints
    against the KV bytes that arrived.

    Args:
        canary: the receiver's :class:`CanaryBuffer`.
        slots: host integers ``[n]``, each in ``[1, num_slots)``, none twice.
        records: int64 ``[n, 4]`` on the canary's device (any framework, zero copy),
            e.g. from :func:`export_records` on the sender; keep it alive until
            ``stream`` has run the import.
        stream: CUDA stream the scatter runs on (default: PyTorch's current stream
            for a PyTorch tensor, else CuPy's).

    Example::

        >>> import numpy as np, kvcanary_cupy as kc
        >>> sender, receiver = kc.CanaryBuffer.allocate(num_slots=8), kc.CanaryBuffer.allocate(num_slots=16)
        >>> sender.records[3:5] = kc.make_records([101, 102], [0, 1])
        >>> import_records(receiver, [12, 9], export_records(sender, [3, 4]))
        >>> receiver.records[[12, 9], :2].tolist()
        [[101, 0], [102, 1]]
    """
    canary = _canary(canary)
    s = host_slots(slots, canary.num_slots, unique=True)
    r = arrays.as_array(records, "records", dtypes=arrays.INT64, ndim=2, device=canary.device)
    if tuple(r.shape) != (s.shape[0], RECORD_WORDS):
        raise ValueError(f"kvcanary: records: expected shape [n, {RECORD_WORDS}] with n = {s.shape[0]} slots, got "
                         f"{tuple(r.shape)}")
    arrays.check_disjoint("import_records", {"canary.records": canary.records, "records": r})
    if s.shape[0] == 0:
        return
    if runtime.is_cpu(canary.device):
        canary.records[s] = r
        return
    ptr = runtime.resolve_stream(stream, (records,))
    idx = _device_slots(s, canary.device, ptr)
    with runtime.on_stream(canary.device, ptr):
        canary.records[idx] = r
