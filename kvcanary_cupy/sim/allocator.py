"""Free lists for the full pool (pages) and the SWA pool (token slots)."""
from __future__ import annotations

from collections import deque


class FreeList:
    """A LIFO free list of ids ``[first, count)``; freeing a free id is ignored.

    LIFO on purpose: a freed id is handed out next, as in real engines, so a
    premature free shows at once.
    """

    def __init__(self, count: int, first: int = 1):
        self._stack = deque(range(count - 1, first - 1, -1))
        self._free = set(self._stack)

    def __len__(self) -> int:
        return len(self._stack)

    def alloc(self) -> int | None:
        while self._stack:
            i = self._stack.pop()
            if i in self._free:
                self._free.discard(i)
                return i
        return None

    def free(self, i: int) -> None:
        if i not in self._free:
            self._free.add(i)
            self._stack.append(i)

    def is_free(self, i: int) -> bool:
        return i in self._free
