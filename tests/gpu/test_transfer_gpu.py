"""Offload round trip on one GPU: KV and records device -> host (NumPy) -> device, into other
slots of the pool, all on one side stream with no host sync between the import and the verify
that reads it. Clean, the verify finds nothing; a byte flipped in the host copy of the KV is
REAL_KV; records put back in another order than their KV are CHAIN / POSITION. Records may also
come back as a PyTorch CUDA tensor (zero copy through DLPack)."""
from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason as F
from kvcanary_cupy.sim.model import KvPool

pytestmark = pytest.mark.gpu

N, WIDTH = 256, 32
HOME = [11, 40, 7, 99, 100, 3, 64, 65, 66, 20]  # row 1 before the offload
BACK = [200, 150, 151, 9, 230, 231, 17, 18, 19, 250]  # where the allocator put it after
TOKENS = list(range(501, 511))


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


def round_trip(cp, *, corrupt=False, order=None, torch_records=False):
    stream = cp.cuda.Stream(non_blocking=True)
    table_h = np.zeros((2, WIDTH), np.int32)
    table = cp.asarray(table_h)
    pool = KvPool(layers=3, num_slots=N, page_size=1, bytes_per_token=64, device="cuda", salt=9)
    mon = kc.KvCanary(num_slots=N, req_to_token=table, max_batch=1, device="cuda", real_kv=pool.source(),
                      policy=lambda found: None)
    n = len(TOKENS)
    table_h[1, :n] = HOME
    table.set(table_h)
    with stream:
        mon.before_forward(cp.asarray([1]), cp.asarray([0]), cp.asarray([n]), stream=stream)
    pool.write(np.array(HOME), np.array(TOKENS), np.arange(n))
    cp.cuda.Device().synchronize()
    with stream:  # the step's inputs are copied on the monitor's stream: ordered before its launches
        mon.after_forward(cp.asarray(TOKENS), cp.arange(n), cp.asarray(HOME), stream=stream)

    # Offload: records and K/V bytes to the host.
    rec_dev = mon.export_slots(np.array(HOME), stream=stream)
    stream.synchronize()
    rec_host = rec_dev.get()
    kv_host = pool.flat[:, cp.asarray(HOME)].get()
    pool.flat[:, cp.asarray(HOME)] = 0  # the slots are reused by someone else
    mon.canary.records[cp.asarray(HOME)] = 0
    cp.cuda.Device().synchronize()
    if corrupt:
        kv_host[2, 6, 5] ^= 0x08  # layer 2, position 6, byte 5: inside PARTIAL's 16 bytes

    # Back in: other slots, the records on the device again, then a decode step on the same stream.
    land = BACK if order is None else [BACK[j] for j in order]
    pool.flat[:, cp.asarray(BACK)] = cp.asarray(kv_host)
    cp.cuda.Device().synchronize()
    if torch_records:
        import torch  # noqa: PLC0415

        records = torch.from_numpy(rec_host).cuda()
        torch.cuda.synchronize()
    else:
        records = cp.asarray(rec_host)
        cp.cuda.Device().synchronize()
    table_h[1, :n] = BACK
    table_h[1, n] = 120
    with stream:  # the table and the step's inputs too
        table.set(table_h)
        mon.import_slots(np.array(land), records, stream=stream)
        mon.before_forward(cp.asarray([1]), cp.asarray([n]), cp.asarray([1]), request_ids=["req"], stream=stream)
        mon.after_forward(cp.asarray([511]), cp.asarray([n]), cp.asarray([120]), stream=stream)
        found = mon.poll(stream=stream)
    stream.synchronize()
    return found + mon.poll(stream=stream), mon


def test_offload_round_trip_is_clean(cp):
    found, mon = round_trip(cp)
    assert found == []
    assert mon.stats()["slots_checked"] == len(TOKENS)  # the decode step read the moved prefix


def test_offload_round_trip_with_torch_records_is_clean(cp):
    pytest.importorskip("torch")
    found, _ = round_trip(cp, torch_records=True)
    assert found == []


def test_a_byte_corrupted_on_the_host_is_real_kv(cp):
    found, _ = round_trip(cp, corrupt=True)
    assert [(v.slot, v.reasons, v.request) for v in found] == [(BACK[6], F.REAL_KV, "req")]


def test_records_back_in_the_wrong_order_are_caught(cp):
    found, _ = round_trip(cp, order=[1, 0] + list(range(2, len(BACK))))
    assert {BACK[0], BACK[1]} <= {v.slot for v in found}
    assert all(v.reasons & (F.CHAIN | F.POSITION) for v in found)
