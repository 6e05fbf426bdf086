"""GatheredSlots: the shadow holds, per slot and layer, exactly the K and V elements the
offsets name, in their order, for elements of 1, 2, 4 and 8 bytes.

Checked against a direct element-by-element read of the engine's blocks, with the slots'
elements at random places in their block: slots gathered once, again after the KV changed,
repeated within one call, outside the pool (left alone), and through a block table
(``gather_reads``), on either CPU backend.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvcanary_cupy import RealKvMode
from kvcanary_cupy.integrations.engine.kv_layout import GatheredSlots

DTYPES = (np.float16, np.float32, np.float64, np.uint8)
pytestmark = pytest.mark.usefixtures("cpu_backend")  # the NumPy gather and the compiled one


def _engine(rng, dtype, *, blocks, block_size, layers, n):
    """Random KV blocks and random distinct element offsets (K then V) inside a block."""
    elems = 2 * block_size * n + 5  # a block holds more than the slots' elements
    kv = [(rng.integers(0, 250, (blocks, elems))).astype(dtype) for _ in range(layers)]
    perm = rng.permutation(elems)[: 2 * block_size * n].reshape(2, block_size, n)
    return kv, perm[0], perm[1]


def _expected(kv, k_off, v_off, width, block_size, slot):
    """[layers, 2, width] raw words of slot's sampled K and V, read one element at a time."""
    b, i = divmod(slot, block_size)
    return np.array([[[t[b, k_off[i, j]] for j in range(width)], [t[b, v_off[i, j]] for j in range(width)]]
                     for t in kv])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [RealKvMode.PARTIAL, RealKvMode.ALL])
def test_shadow_holds_the_named_elements(dtype, mode):
    rng = np.random.default_rng(7)
    item = np.dtype(dtype).itemsize
    n = 32 // item  # a slot's K: 32 bytes, so PARTIAL keeps half of it
    blocks, block_size, layers = 6, 4, 3
    kv, k_off, v_off = _engine(rng, dtype, blocks=blocks, block_size=block_size, layers=layers, n=n)
    g = GatheredSlots(kv, block_size=block_size, key_offsets=k_off, value_offsets=v_off, mode=mode,
                      num_slots=blocks * block_size)
    width = n if mode == RealKvMode.ALL else 16 // item
    assert g.width == width and g.shadow.shape == (2 * layers, blocks * block_size, width)
    words = g.shadow.dtype

    slots = np.array([5, 0, 23, 5, 11, -1, 24, 1000], dtype=np.int64)  # a repeat; two outside the pool
    assert g.gather_slots(slots) == 5  # the repeat counts twice
    for s in (5, 0, 23, 11):
        want = _expected(kv, k_off, v_off, width, block_size, s)
        got = np.stack([g.shadow[0::2, s], g.shadow[1::2, s]], axis=1)  # [layers, K/V, width]
        np.testing.assert_array_equal(got, want.view(words) if want.dtype != words else want)
    untouched = np.setdiff1d(np.arange(blocks * block_size), [5, 0, 23, 11])
    assert not g.shadow[:, untouched].any()

    for t in kv:  # the live bytes change: a later gather reads them again
        t += 1
    g.gather_slots(np.array([23]))
    want = _expected(kv, k_off, v_off, width, block_size, 23)
    np.testing.assert_array_equal(np.stack([g.shadow[0::2, 23], g.shadow[1::2, 23]], axis=1), want.view(words))
    assert g.gathered == 6


def test_gather_reads_follows_the_table():
    rng = np.random.default_rng(3)
    blocks, block_size = 8, 4
    kv, k_off, v_off = _engine(rng, np.float32, blocks=blocks, block_size=block_size, layers=2, n=4)
    g = GatheredSlots(kv, block_size=block_size, key_offsets=k_off, value_offsets=v_off, mode=RealKvMode.PARTIAL,
                      num_slots=blocks * block_size)
    table = np.array([[6, 2, 7], [1, 0, 0], [3, 5, 4]], dtype=np.int32)  # row -> blocks
    assert g.gather_reads(table, rows=[2, 0], prefix=[6, 3]) == 9
    read = [3 * 4 + p for p in range(4)] + [5 * 4 + p for p in range(2)] + [6 * 4 + p for p in range(3)]
    for s in read:
        want = _expected(kv, k_off, v_off, 4, block_size, s).view(np.uint32)
        np.testing.assert_array_equal(np.stack([g.shadow[0::2, s], g.shadow[1::2, s]], axis=1), want)
    assert not g.shadow[:, np.setdiff1d(np.arange(blocks * block_size), read)].any()
    assert g.gather_reads(table, rows=[1], prefix=[0]) == 0


def test_gather_reads_of_forged_entries_reads_only_slots_of_the_pool():
    """Negative block ids and ids past the pool gather nothing; one whose slot number wraps
    int64 into the pool gathers the slot it wraps to (its own block's bytes, never another
    address). Both CPU backends count and copy alike."""
    rng = np.random.default_rng(5)
    blocks, block_size = 4, 4
    kv, k_off, v_off = _engine(rng, np.float32, blocks=blocks, block_size=block_size, layers=2, n=4)
    g = GatheredSlots(kv, block_size=block_size, key_offsets=k_off, value_offsets=v_off, mode=RealKvMode.PARTIAL,
                      num_slots=blocks * block_size)
    wraps = (1 << 62) + 2  # times 4: 2**64 + 8, slot 8 onwards once wrapped
    table = np.array([[-3, blocks, wraps, 1]], dtype=np.int64)
    assert g.gather_reads(table, rows=[0], prefix=[14]) == 6  # 4 of the wrapped block, 2 of block 1
    read = [8, 9, 10, 11, 4, 5]
    for s in read:
        want = _expected(kv, k_off, v_off, 4, block_size, s).view(np.uint32)
        np.testing.assert_array_equal(np.stack([g.shadow[0::2, s], g.shadow[1::2, s]], axis=1), want)
    assert not g.shadow[:, np.setdiff1d(np.arange(blocks * block_size), read)].any()
