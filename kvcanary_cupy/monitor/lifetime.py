"""Keeping arrays alive until the device is done with them.

A kernel queued on a stream may run long after the Python call that queued it
returned. An array imported for one call, or replaced by ``rebind``, must not be
freed (and its memory reused by its producer) before the work that reads it is
done: a producer whose allocator is not ordered with our stream (JAX) could
otherwise hand the memory to something else under a queued kernel. On the CPU
every op has finished when it returns, so nothing is kept.
"""
from __future__ import annotations

import collections

from .. import runtime

_MAX_HELD = 1024  # arrays held between polls before the device is settled instead
_MAX_RETIRED = 2  # rebind generations waiting for their event


class Keepalive:
    """Holds per-call imports until a poll proves the device past them, and rebind-replaced arrays until an event.

    Example::

        >>> k = Keepalive("cpu")
        >>> k.hold(object())  # the CPU keeps nothing
        >>> k.held
        0
    """

    def __init__(self, device: str):
        self.device = device
        self._gpu = not runtime.is_cpu(device)
        self._old: list = []  # held before the previous poll
        self._new: list = []  # held since
        self._retired: collections.deque = collections.deque()  # (event, arrays) replaced by rebind()

    @property
    def held(self) -> int:
        return len(self._old) + len(self._new)

    def hold(self, obj) -> None:
        """Keep ``obj`` (and so the producer's buffer) alive until the work queued so far is known
        done: released by the poll that waits for the copy queued after it (see :meth:`polled`)."""
        if not self._gpu:
            return
        self._new.append(obj)
        if len(self._new) > _MAX_HELD:  # nobody polls: settle once rather than grow without bound
            runtime.synchronize(self.device)
            self._new.clear()
            self._old = []

    def polled(self, *, waited: bool, queued: bool) -> None:
        """After a poll. ``waited``: it waited for the copy queued by an earlier poll, which was
        queued after everything held before it: release those. ``queued``: it queued a copy,
        after everything held so far: those are released once a later poll waits for it."""
        if waited:
            self._old = []
        if queued:
            self._old, self._new = self._old + self._new, []

    def retire(self, old, ptr) -> None:
        """Keep arrays replaced by ``rebind`` alive until the work queued on ``ptr`` before the
        rebind is done, and no longer: an event marks that point, and at most two generations
        wait (a JAX engine rebinds a new KV pool every step, so holding them until a poll could
        keep many pools alive)."""
        if not self._gpu:
            return
        self._retired.append((runtime.mark(self.device, ptr), old))
        while len(self._retired) > _MAX_RETIRED:
            runtime.wait(self._retired.popleft()[0])
