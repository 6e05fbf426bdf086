"""A tiny radix cache of fixed-size token blocks (one node per block)."""
from __future__ import annotations

import itertools

import numpy as np

from ..monitor import SweepChain


class Node:
    """One cached block: ``block`` tokens at positions ``[depth*block, (depth+1)*block)``.

    Attributes:
        key: the block's token ids (tuple).
        pages: full-pool pages holding it (owned by the cache).
        slots: int64 ``[block]`` slots of its positions.
        next_token: the token that followed the block when it was cached (a
            draft pool's record of the block's last position holds it).
        ref: running requests reading the node.
    """

    _ids = itertools.count(1)

    def __init__(self, key, parent, pages, slots, depth, next_token):
        self.id = next(Node._ids)
        self.key = key
        self.parent = parent
        self.children: dict = {}
        self.pages = list(pages)
        self.slots = np.asarray(slots, dtype=np.int64)
        self.depth = depth
        self.next_token = next_token
        self.ref = 0
        self.last_used = 0
        self.pinned = False
        self._chain = None

    @property
    def first_position(self) -> int:
        return self.depth * len(self.key)

    def chain(self) -> SweepChain:
        """This node as a sweep chain (built once: a node never changes)."""
        if self._chain is None:
            prev = int(self.parent.slots[-1]) if self.depth > 0 else -1
            self._chain = SweepChain(self.slots, self.first_position, prev, np.asarray(self.key, dtype=np.int64),
                                     key=f"node{self.id}")
        return self._chain


class PrefixCache:
    """Blocks of finished requests, shared by later requests with the same token prefix."""

    def __init__(self, block: int):
        self.block = block
        self.root = Node((), None, (), np.zeros(0, np.int64), -1, None)
        self.nodes: dict[int, Node] = {}

    def match(self, tokens, limit: int, clock: int) -> list[Node]:
        """The longest path of cached blocks equal to ``tokens[:k*block]``, ``k*block <= limit``."""
        path, node, b = [], self.root, self.block
        for d in range(limit // b):
            child = node.children.get(tuple(tokens[d * b:(d + 1) * b]))
            if child is None:
                break
            path.append(child)
            node = child
        for n in path:
            n.last_used = clock
        return path

    def insert(self, parent: Node, key: tuple, pages, slots, next_token, clock: int) -> Node:
        n = Node(key, parent, pages, slots, parent.depth + 1, next_token)
        n.last_used = clock
        parent.children[key] = n
        self.nodes[n.id] = n
        return n

    def evictable(self) -> list[Node]:
        """Idle leaves, least recently used first."""
        leaves = [n for n in self.nodes.values() if not n.children and n.ref == 0 and not n.pinned]
        return sorted(leaves, key=lambda n: (n.last_used, n.id))

    def remove(self, n: Node) -> None:
        del n.parent.children[n.key]
        del self.nodes[n.id]

    def idle(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.ref == 0]

    def paths(self) -> list[list[Node]]:
        """Every root path (for faults that need a whole cached prefix)."""
        out = []

        def walk(node, path):
            for c in node.children.values():
                out.append(path + [c])
                walk(c, path + [c])
        walk(self.root, [])
        return out
