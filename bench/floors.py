"""Bytes each op must move at least, and the floor time they imply.

An op's floor is ``bytes / copy bandwidth``, the copy bandwidth measured in the
same run (bytes read + bytes written per second of a device-to-device copy). A
ratio time/floor near 1 means the op runs at the memory system's speed.

Every count is of bytes that cannot be avoided by any implementation: each
table element, record, plan word or KV byte the op's result depends on is read
once, each output word written once. Scalars (a few words) are left out.
Records are 32 bytes (4 int64), plan entries are int64.
"""
from __future__ import annotations

import numpy as np

from kvcanary_cupy.format import KV_CHUNK_BYTES, RECORD_BYTES

PLAN_WORD = 8
ENTRY_ARRAYS = 4  # slot, prev slot, expected position, expected token


def kv_bytes_per_slot(mode: str, layers: int, bytes_per_token: int, read_bytes: int | None = None) -> int:
    """KV bytes hashed per slot: ``layers x`` (16 for PARTIAL, ``read_bytes`` for ALL, 0 for NONE)."""
    if mode == "NONE" or layers == 0:
        return 0
    if mode == "PARTIAL":
        return layers * KV_CHUNK_BYTES
    if mode == "ALL":
        return layers * (bytes_per_token if read_bytes is None else read_bytes)
    raise ValueError(f"kvcanary: mode: expected NONE, PARTIAL or ALL, got {mode!r}")


def plan_bytes(*, batch: int, entries: int, head_reads: int, index_itemsize: int, table_itemsize: int,
               lut_itemsize: int = 0, verify: bool = True, write: bool = True) -> int:
    """Plan: the row inputs and table elements read, the plans written.

    Args:
        batch: rows planned.
        entries: verify entries written (one table element read each).
        head_reads: extra table elements read (a window head's predecessor per row).
        index_itemsize: bytes of one element of req_pool_indices / prefix_lens / extend_lens.
        table_itemsize: bytes of one slot-table element.
        lut_itemsize: bytes of one SWA LUT element (0 without a window): each table
            element read goes through it.
        verify, write: which plans are produced.
    """
    b = 3 * batch * index_itemsize + (entries + head_reads) * (table_itemsize + lut_itemsize)
    if verify:
        b += entries * ENTRY_ARRAYS * PLAN_WORD + (batch + 1) * PLAN_WORD
    if write:
        b += (batch + 1) * PLAN_WORD + batch * PLAN_WORD  # offsets, seeds
    return b


def verify_bytes(*, entries: int, head_reads: int, check_tokens: bool = False, kv_per_slot: int = 0) -> int:
    """Verify: plan entries and records read, plus the KV bytes hashed.

    Each entry's slot, predecessor and expected position are read (its expected
    token too with ``check_tokens``); each entry's record is read, and a window
    head's predecessor record besides (inside a window the predecessor is the
    previous entry's record, already counted).
    """
    arrays = 4 if check_tokens else 3
    return entries * arrays * PLAN_WORD + (entries + head_reads) * RECORD_BYTES + entries * kv_per_slot


def fused_bytes(*, batch: int, entries: int, head_reads: int, index_itemsize: int, table_itemsize: int,
                lut_itemsize: int = 0, token_itemsize: int = 0, kv_per_slot: int = 0) -> int:
    """plan_and_verify: plan's reads and verify's records and KV bytes, without the per-entry
    arrays in between (the fused launch derives each entry where it checks it).

    Reads the row inputs, each table element (through the LUT with a window), each
    entry's record (a window head's predecessor's besides) and KV bytes, and with the
    token check (``token_itemsize`` > 0) each entry's expected token; writes the verify
    plan's offsets and the write plan (offsets and seeds).
    """
    reads = 3 * batch * index_itemsize + (entries + head_reads) * (table_itemsize + lut_itemsize + RECORD_BYTES)
    reads += entries * (token_itemsize + kv_per_slot)
    return reads + (batch + 1) * PLAN_WORD + (batch + 1) * PLAN_WORD + batch * PLAN_WORD


def write_bytes(*, batch: int, tokens: int, seeded_rows: int, index_itemsize: int, kv_per_slot: int = 0) -> int:
    """Write: token ids, positions and slots read, the write plan and seed records read,
    one record written per token, plus the KV bytes hashed."""
    return (3 * tokens * index_itemsize + (2 * batch + 1) * PLAN_WORD + seeded_rows * RECORD_BYTES
            + tokens * RECORD_BYTES + tokens * kv_per_slot)


def floor_us(nbytes: int, bandwidth_bytes_per_s: float) -> float:
    """Time to move ``nbytes`` at the measured copy bandwidth, in microseconds."""
    if bandwidth_bytes_per_s <= 0:
        return float("nan")
    return nbytes / bandwidth_bytes_per_s * 1e6


def case_bytes(case, pool, *, index_dtype=np.int64, table_dtype=np.int32, lut_dtype=np.int32,
               token_dtype=np.int64) -> dict:
    """``{"plan", "verify", "plan_and_verify", "write", "step"}``: minimum bytes of one step of
    ``case`` (a ``cases.Case``) on ``pool`` (a ``cases.Pool``), with the bench's array dtypes.
    ``step`` is a monitor's step: plan_and_verify, then write."""
    kv = kv_bytes_per_slot(case.mode, pool.kv_layers, pool.bytes_per_token)
    isz = np.dtype(index_dtype).itemsize
    tsz, lsz = np.dtype(table_dtype).itemsize, np.dtype(lut_dtype).itemsize if case.window else 0
    out = {
        "plan": plan_bytes(batch=case.batch, entries=case.entries, head_reads=case.head_reads, index_itemsize=isz,
                           table_itemsize=tsz, lut_itemsize=lsz),
        "verify": verify_bytes(entries=case.entries, head_reads=case.head_reads, check_tokens=case.check_tokens,
                               kv_per_slot=kv),
        "plan_and_verify": fused_bytes(batch=case.batch, entries=case.entries, head_reads=case.head_reads,
                                       index_itemsize=isz, table_itemsize=tsz, lut_itemsize=lsz, kv_per_slot=kv,
                                       token_itemsize=np.dtype(token_dtype).itemsize if case.check_tokens else 0),
        "write": write_bytes(batch=case.batch, tokens=case.tokens, seeded_rows=case.seeded_rows,
                             index_itemsize=isz, kv_per_slot=kv),
    }
    out["step"] = out["plan_and_verify"] + out["write"]
    return out
