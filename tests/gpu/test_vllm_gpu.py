"""The vLLM connector's per-step check on CUDA, without vLLM: the engine-neutral
BlockTableCanary driven with CUDA torch tensors in vLLM's GPU shapes (a flash-attention pool
per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]`` fp16; an int32 block table,
int32 lengths and query starts, an int64 slot mapping), by a small paged engine that writes
K/V where vLLM's would. Clean steps are silent and check every read slot; a swapped block-table
entry and a flipped key byte in the last layer are caught and attributed to their request.
Skipped where CuPy finds no CUDA device.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
try:
    _DEVICES = cupy.cuda.runtime.getDeviceCount()
except Exception:  # noqa: BLE001  (no driver)
    _DEVICES = 0
if not _DEVICES or not torch.cuda.is_available():
    pytest.skip("CuPy finds no CUDA device", allow_module_level=True)

from kvcanary_cupy import FailReason  # noqa: E402
from kvcanary_cupy.integrations.engine.block_table import AttentionStep, BlockTableCanary  # noqa: E402
from kvcanary_cupy.integrations.engine.kv_layout import ContiguousSlots  # noqa: E402

DEV = "cuda:0"
BS, BLOCKS, HEADS, DIM, LAYERS, WIDTH = 16, 64, 2, 64, 3, 16


class PagedEngine:
    """Three requests on a flash-attention pool: prefill, then decode steps, vLLM's way."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.kv = [torch.zeros((2, BLOCKS, BS, HEADS, DIM), dtype=torch.float16, device=DEV) for _ in range(LAYERS)]
        self.free = list(range(1, BLOCKS))  # block 0: vLLM's null block
        self.reqs = []
        for i, n in enumerate((37, 20, 50)):
            self.reqs.append(SimpleNamespace(rid=f"req-{i}", initial_tokens=[self.rng.randrange(1, 500) for _ in range(n)],
                                             generated_tokens=[], blocks=[], done=0))
        self.canary = BlockTableCanary(num_blocks=BLOCKS, block_size=BS, rows=8, width=WIDTH, max_batch=4,
                                       device=DEV, fingerprints=ContiguousSlots([(k[0], k[1]) for k in self.kv],
                                                                                block_size=BS), name="gpu")
        self.first = True
        self.read = 0

    def step(self, *, deferred=None, settle: bool = True):
        """One step of every request: a prefill the first time, then one token each (``deferred``:
        rows checked after the writes). With ``settle``, the rows the queued copies hold too."""
        rows, seq, qsl, slots, tokens, bt = [], [], [0], [], [], []
        for i, r in enumerate(self.reqs):
            toks = r.initial_tokens + r.generated_tokens
            start, end = r.done, len(toks)
            while len(r.blocks) * BS < end:
                r.blocks.append(self.free.pop(0))
            for p in range(start, end):
                slot = r.blocks[p // BS] * BS + p % BS
                slots.append(slot)
                for k in self.kv:  # the "model" writes K and V of the token
                    k[:, slot // BS, slot % BS] = torch.randn((2, HEADS, DIM), dtype=torch.float16, device=DEV)
            tokens += toks[start:end]
            rows.append(i + 1)
            seq.append(end)
            qsl.append(qsl[-1] + end - start)
            bt.append(r.blocks + [0] * (WIDTH - len(r.blocks)))
            self.read += start
        step = AttentionStep(rows=rows, tags=[r.rid for r in self.reqs], states=self.reqs,
                             fresh=[self.first] * len(rows),
                             block_table=torch.tensor(bt, dtype=torch.int32, device=DEV),
                             seq_lens=torch.tensor(seq, dtype=torch.int32, device=DEV),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
                             slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), tokens=tokens,
                             host_seq_lens=seq, deferred=deferred)
        self.first = False
        found = self.canary.check_reads(step)
        found += self.canary.stamp_writes(step)
        for r in self.reqs:
            r.done = len(r.initial_tokens) + len(r.generated_tokens)
            r.generated_tokens.append(self.rng.randrange(1, 500))
        if not settle:
            return found
        torch.cuda.synchronize()
        return found + self.canary.poll() + self.canary.poll()  # rows the queued copies hold


def test_clean_steps_silent_and_every_read_slot_checked():
    eng = PagedEngine()
    found = [v for _ in range(12) for v in eng.step()]
    assert found == []
    s = eng.canary.stats()
    assert s["slots_checked"] == eng.read > 0 and s["input_errors"] == 0


def _swapped_after_clean_steps(seed: int, request: int, *, settle: bool = True) -> PagedEngine:
    """An engine after four clean steps, then its ``request``'s first two blocks swapped."""
    eng = PagedEngine(seed=seed)
    for _ in range(4):
        assert eng.step(settle=settle) == []
    r = eng.reqs[request]
    r.blocks[0], r.blocks[1] = r.blocks[1], r.blocks[0]
    return eng


def test_swapped_block_table_entries_caught_for_their_request():
    eng = _swapped_after_clean_steps(1, 2)
    found = eng.step() + eng.step()
    assert found and {v.request for v in found} == {"req-2"}
    assert any(v.reasons & FailReason.POSITION for v in found)


def test_flipped_key_byte_in_the_last_layer_caught():
    eng = PagedEngine(seed=2)
    for _ in range(4):
        assert eng.step() == []
    r = eng.reqs[0]
    slot = r.blocks[0] * BS + 3
    eng.kv[-1][0, slot // BS, slot % BS, 0, 0] += 1.0  # key, head 0, dim 0: the sampled bytes
    found = eng.step() + eng.step()
    assert found and {v.request for v in found} == {"req-0"}
    assert any(v.reasons & FailReason.REAL_KV and v.slot == slot for v in found)


def test_damage_read_before_the_forward_is_reported_by_the_same_steps_stamp():
    # An engine asks for the step's damaged requests after the stamp (vLLM: after wait_for_save):
    # the check's rows must be there, with no later poll.
    eng = _swapped_after_clean_steps(3, 1, settle=False)
    found = eng.step(settle=False)
    assert found and {v.request for v in found} == {"req-1"}


def test_a_deferred_rows_damage_found_after_the_writes_is_drained_at_the_end():
    eng = _swapped_after_clean_steps(4, 2, settle=False)
    found = eng.step(deferred=[False, False, True], settle=False)  # the last step: its row checked after
    found += eng.canary.drain()
    assert found and {v.request for v in found} == {"req-2"}
    assert eng.canary.drain() == [], "drained once"
