"""Records that move with the engine's blocks: CPU offload, restore, fork.

When the engine offloads a request, it copies the request's blocks (every group)
to its host swap pool and frees them; on restore it copies them into whichever
blocks it allocates then (``block_table[request][:n]`` per group). The records of
those blocks travel the same way: exported when the blocks leave, imported into
the new blocks when they come back, on the engine's compute stream. The restore
step's verify then checks the restored blocks (chain, positions and tokens
against the request's own table, fingerprints against the bytes that came back)
before the model reads them; with sampled fingerprints, a sweep first checks
every fingerprint of the restored blocks. A fork copies blocks: records copy too.
"""
from __future__ import annotations

import numpy as np

from ..engine.violations import RequestTag


class RecordMoves:
    """Export, keep and import the records of moving blocks for one engine.

    Args:
        engine: the :class:`~kvcanary_cupy.integrations.transformers.engine.EngineCanary`.
    """

    def __init__(self, engine):
        self.engine = engine
        self.saved: dict = {}  # request id -> [(blocks offloaded, records) per group]
        self.offloaded = 0
        self.restored = 0
        self.forked_blocks = 0
        self.swept = 0

    def clear(self) -> None:
        self.saved.clear()

    def offloaded_to_cpu(self, victims, offloaded_ids) -> None:
        """After the engine copied ``offloaded_ids``' blocks to the host (they are still in its tables)."""
        eng = self.engine
        pool = getattr(eng.bp.offloading_manager, "_request_id_to_cpu_blocks", {})
        for rid in [r for r in self.saved if r not in pool]:  # freed while offloaded (cancelled, reset)
            del self.saved[rid]
        for state in victims:
            rid = state.request_id
            if rid not in offloaded_ids:
                continue
            per_group = []
            for g in eng.groups:
                blocks = list(g.blocks(rid))
                recs = g.monitor.export_slots(eng.slot_map.block_slots(blocks), stream=eng.ptr) if blocks else None
                per_group.append((len(blocks), recs))
            self.saved[rid] = per_group
            self.offloaded += 1

    def restored_from_cpu(self, states) -> None:
        """After the engine copied ``states``' blocks back into the blocks it just allocated."""
        eng = self.engine
        for state in states:
            per_group = self.saved.pop(state.request_id, None)
            if per_group is None:
                continue  # offloaded before the watch saw it: the restore step's verify reports it
            for g, (n, recs) in zip(eng.groups, per_group):
                if recs is not None and n:
                    blocks = list(g.blocks(state.request_id))[:n]
                    g.monitor.import_slots(eng.slot_map.block_slots(blocks), recs, stream=eng.ptr)
            self.restored += 1
            if eng.sampled:
                self._sweep(state)

    def _sweep(self, state) -> None:
        """Check every record and fingerprint of a restored request now (the step's verify samples them)."""
        from ...monitor import SweepChain  # noqa: PLC0415

        eng = self.engine
        end = int(state.position_offset)
        tokens = np.asarray((state.initial_tokens + state.generated_tokens)[:end], dtype=np.int64)
        for g in eng.groups:
            lo = max(0, end - g.window) if g.sliding else 0
            if end <= lo:
                continue
            pos = np.arange(lo, end)
            chain = SweepChain(g.slots_of(state.request_id, pos), first_position=lo, prev_slot=-1 if lo == 0 else 0,
                               tokens=tokens[lo:end], key=RequestTag(state.request_id, eng.step + 1))
            covered = 0
            while covered < len(chain):
                covered += g.monitor.sweep([chain], stream=eng.ptr)
            self.swept += covered

    def copied(self, source_blocks, forked_blocks) -> None:
        """After the engine copied whole blocks (a fork): the records follow, in every group."""
        eng = self.engine
        if not len(source_blocks):
            return
        src = eng.slot_map.block_slots(source_blocks)
        dst = eng.slot_map.block_slots(forked_blocks)
        for g in eng.groups:  # a block belongs to one group; the others' records there are never read
            g.monitor.import_slots(dst, g.monitor.export_slots(src, stream=eng.ptr), stream=eng.ptr)
        self.forked_blocks += len(forked_blocks)
