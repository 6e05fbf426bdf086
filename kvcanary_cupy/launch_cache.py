"""LaunchCache: the prepared launches of an object's recent op calls.

A step that passes the very same arguments again (bound buffers, long-lived
plans, one input set per captured batch size) should pay only the kernel
launch: no validation, no DLPack import, no packing. ops.py finds such a call
again by the identity of its arguments (with the shape and dtype it validated)
and the value of its scalars, and keeps it in the cache of the object that owns
the call: the canary for write and verify, the plan for plan.

Lifetime, stated once: an entry lives as long as its owner, and at most
``capacity`` entries per owner are kept (the oldest goes first). An entry holds
the objects whose ids are in its key, so none of those ids can be reused by
another object while it is there. Dropping an entry is always safe: a prepared
launch owns only host memory (the driver copies its arguments at launch, and a
graph capture copies them into the graph); device memory a launch points at
has its own owner (see the backends).
"""
from __future__ import annotations


class LaunchCache:
    """Recent prepared calls of one owner, plus per-owner backend state.

    Attributes:
        state: device memory a backend keeps for this owner and no longer (e.g.
            the CUDA plan kernel's launch state); freed with the owner.
    """

    CAPACITY = 8
    __slots__ = ("calls", "capacity", "state")

    def __init__(self, capacity: int = CAPACITY):
        self.calls: dict = {}
        self.capacity = capacity
        self.state: dict = {}

    def get(self, key):
        """The call kept under ``key``, or None."""
        hit = self.calls.get(key)
        return None if hit is None else hit[1]

    def keep(self, key, objects, call) -> None:
        """Keep ``call`` under ``key``, with ``objects``: every object whose id is in it."""
        if self.capacity <= 0:
            return
        if len(self.calls) >= self.capacity:
            del self.calls[next(iter(self.calls))]
        self.calls[key] = (objects, call)

    def __len__(self) -> int:
        return len(self.calls)

    def __reduce__(self):
        # Prepared launches and device state belong to the process (and device) that made
        # them: a pickled cache comes back empty, which is always safe (see above).
        return LaunchCache, (self.capacity,)
