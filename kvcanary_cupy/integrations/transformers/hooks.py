"""Wrapping methods on engine objects' instances, and taking the wrappers off again.

The adapter never edits transformers: it shadows a method on one object (an
instance attribute named like the method) with a wrapper that calls the bound
original, and removes the shadow when the watch ends. Other objects of the same
class are untouched.
"""
from __future__ import annotations

from typing import Callable


class Hooks:
    """The wrappers installed on engine objects, in install order.

    Example::

        >>> class Engine:
        ...     def step(self):
        ...         return "step"
        >>> e = Engine()
        >>> hooks = Hooks()
        >>> hooks.wrap(e, "step", lambda orig: lambda: "watched " + orig())
        >>> e.step()
        'watched step'
        >>> hooks.remove_all()
        >>> e.step(), "step" in vars(e)
        ('step', False)
    """

    def __init__(self):
        self._installed: list[tuple[object, str, bool, object]] = []

    def wrap(self, obj, name: str, make: Callable[[Callable], Callable]) -> None:
        """Shadow ``obj.name`` with ``make(original)``; ``original`` is the bound method as it was."""
        original = getattr(obj, name)
        own = vars(obj)
        had, previous = name in own, own.get(name)
        setattr(obj, name, make(original))
        self._installed.append((obj, name, had, previous))

    def remove_all(self) -> None:
        """Take every wrapper off, newest first, restoring what each object held before."""
        while self._installed:
            obj, name, had, previous = self._installed.pop()
            if had:
                setattr(obj, name, previous)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:  # the engine dropped it itself
                    pass
