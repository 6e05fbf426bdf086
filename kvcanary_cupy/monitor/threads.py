"""One thread at a time: the guard every call of a monitor passes.

A step (``before_forward`` through ``after_forward`` or ``abort_step``) belongs to the
thread that opened it, and a monitor takes one call at a time (see "Threads" in
:class:`~kvcanary_cupy.KvCanary`). :func:`guarded` wraps a method so that a call from
another thread is refused, before it does anything, with a ``kvcanary:``
:class:`RuntimeError` naming both threads; the method's object keeps its
:class:`CallGuard` as ``_guard``.
"""
from __future__ import annotations

import functools
import threading


def guarded(fn, name: str | None = None):
    """Run the method as one call of the monitor: refused, before it does anything, while
    another thread is inside a call or has a step open (see "Threads" in :class:`KvCanary`);
    ``name``: how errors name the call (default: the method's name). A step's calls pay a
    non-blocking lock and an attribute read."""
    name = name or fn.__name__

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        guard = self._guard
        me = threading.get_ident()
        # The thread whose step is open waits for the lock: while its step is open, any other
        # thread holding it is being refused and lets go at once. (Only this thread sets or
        # clears step_thread to itself, so it may read it without the lock.) Any other thread
        # that finds the lock held is refused (this one's own calls re-enter the RLock).
        if not guard.lock.acquire(guard.step_thread == me):
            guard.refuse(name, me)
        try:
            # Read under the lock: a step opens and closes inside guarded calls only.
            if guard.step_thread is not None and guard.step_thread != me:
                guard.refuse(name, me)
            outer = guard.depth == 0
            if outer:
                guard.inside, guard.inside_call = me, name
            guard.depth += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                guard.depth -= 1
                if outer:
                    guard.inside = guard.inside_call = None
        finally:
            guard.lock.release()
    return call


class CallGuard:
    """Which thread the monitor serves now: the one inside a call (holding ``lock``, an RLock,
    so a call may make others), and the one whose step is open."""

    __slots__ = ("lock", "depth", "inside", "inside_call", "step_thread")

    def __init__(self):
        self.lock = threading.RLock()
        self.depth = 0  # guarded calls the holder of the lock is inside
        self.inside = self.inside_call = None  # the holder and its outermost call, for errors
        self.step_thread = None  # ident of the thread whose step is open

    def refuse(self, name: str, me: int):
        owner = self.step_thread
        if owner is not None and owner != me:
            raise RuntimeError(f"kvcanary: {name}: called from thread {thread_name(me)} while the step "
                               f"thread {thread_name(owner)} opened (before_forward) is open on this monitor; a "
                               f"step belongs to the thread that opened it: call the monitor from that thread, "
                               f"or after its after_forward() / abort_step()")
        inside, call = self.inside, self.inside_call  # None: the holder is only entering (or being refused)
        where = (f"thread {thread_name(inside)} is inside {call}()" if inside is not None
                 else "another thread is entering a call")
        raise RuntimeError(f"kvcanary: {name}: called from thread {thread_name(me)} while {where} on this "
                           f"monitor; a monitor takes one call at a time: serialize the threads' calls (one lock "
                           f"around each step and poll)")


def thread_name(ident: int) -> str:
    """The name of the live thread ``ident`` (quoted), else the ident itself."""
    t = next((t for t in threading.enumerate() if t.ident == ident), None)
    return repr(t.name) if t is not None else str(ident)
