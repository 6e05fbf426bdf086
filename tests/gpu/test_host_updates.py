"""HostUpdates: a host's rows and table changes applied by one launch that reads pinned memory in place."""
from __future__ import annotations

import numpy as np
import pytest

from kvcanary_cupy.backends.cuda import MAX_UPDATE_TARGETS, HostUpdates

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


def _pinned(cp, n, dtype):
    return np.frombuffer(cp.cuda.alloc_pinned_memory(n * np.dtype(dtype).itemsize), dtype, n)


def test_rows_copied_and_changes_scattered_like_numpy(cp):
    rng = np.random.default_rng(7)
    words = _pinned(cp, 300, np.int64)
    words[:] = rng.integers(-2**40, 2**40, 300)
    copy_to = cp.full(300, -777, dtype=cp.int64)  # poisoned: an unwritten word shows
    tables = [cp.full(n, -5, dtype=cp.int32) for n in (50, 1000, 7)]
    expect = [np.full(n, -5, dtype=np.int32) for n in (50, 1000, 7)]
    counts = (20, 400, 0)
    index, value = _pinned(cp, 420, np.int64), _pinned(cp, 420, np.int32)
    at, ends = 0, []
    for t, n in enumerate(counts):
        idx = rng.choice(len(expect[t]), n, replace=False)  # distinct: the last value would be arbitrary
        val = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
        index[at:at + n], value[at:at + n] = idx, val
        expect[t][idx] = val
        at += n
        ends.append(at)
    index[5] = 50  # outside table 0: skipped, never written, counted
    index[6] = -1  # likewise
    expect[0] = np.full(50, -5, dtype=np.int32)
    for k in range(20):
        if 0 <= index[k] < 50:
            expect[0][index[k]] = value[k]
    up = HostUpdates(words=words.ctypes.data, copy_to=copy_to.data.ptr,
                     targets=[(t.data.ptr, t.size) for t in tables], device=0)
    stream = cp.cuda.Stream()
    up(copy_words=250, index=index.ctypes.data, value=value.ctypes.data, ends=ends, stream=stream.ptr)
    stream.synchronize()
    got = copy_to.get()
    assert got[:250].tolist() == words[:250].tolist() and (got[250:] == -777).all()
    for t, e in zip(tables, expect):
        assert t.get().tolist() == e.tolist()
    assert up.skipped() == 2
    up(copy_words=0, index=index.ctypes.data, value=value.ctypes.data, ends=ends, stream=stream.ptr)
    assert up.skipped() == 4, "the counter adds up over launches"


def test_launchers_share_a_counter(cp):
    counter = cp.zeros(1, dtype=cp.int64)
    table = cp.zeros(4, dtype=cp.int32)
    index, value = _pinned(cp, 3, np.int64), _pinned(cp, 3, np.int32)
    index[:], value[:] = [0, 9, 3], [7, 8, 9]
    ups = [HostUpdates(words=0, copy_to=0, targets=[(table.data.ptr, 4)], device=0, skipped=counter.data.ptr)
           for _ in range(2)]
    for up in ups:
        up(copy_words=0, index=index.ctypes.data, value=value.ctypes.data, ends=[3],
           stream=cp.cuda.get_current_stream().ptr)
    assert table.get().tolist() == [7, 0, 0, 9] and int(counter.get()[0]) == 2 == ups[0].skipped()


def test_device_words_copied_with_a_shift(cp):
    src = cp.arange(10, dtype=cp.int64)
    dst = cp.full(10, -777, dtype=cp.int64)
    up = HostUpdates(words=src.data.ptr, copy_to=dst.data.ptr, device=0)
    up(copy_words=6, shift=3, stream=cp.cuda.get_current_stream().ptr)
    assert dst.get().tolist() == [3, 4, 5, 6, 7, 8] + [-777] * 4


def test_too_many_targets_refused(cp):
    a = cp.zeros(1, dtype=cp.int32)
    with pytest.raises(ValueError, match="kvcanary: targets"):
        HostUpdates(words=0, copy_to=0, targets=[(a.data.ptr, 1)] * (MAX_UPDATE_TARGETS + 1), device=0)


def test_table_rows_copied_to_the_rows_the_words_name(cp):
    rng = np.random.default_rng(11)
    words = _pinned(cp, 6, np.int64)
    words[:] = [3, 0, 7, 2, -1, 5]  # batch row i goes to table row words[i]; -1 and 7 are outside
    copy_to = cp.full(6, -777, dtype=cp.int64)
    src = cp.asarray(rng.integers(-2**31, 2**31, (8, 40), dtype=np.int64).astype(np.int32))
    view = src[:, 3:33]  # rows of unit stride 40 apart: 30 elements each
    to = cp.full((7, 32), -5, dtype=cp.int32)  # poisoned
    up = HostUpdates(words=words.ctypes.data, copy_to=copy_to.data.ptr, device=0,
                     rows_to=(to.data.ptr, 7, 32))
    stream = cp.cuda.Stream()
    up(copy_words=6, stream=stream.ptr, rows_from=(view.data.ptr, 40, 6, 30))
    stream.synchronize()
    expect = np.full((7, 32), -5, dtype=np.int32)
    host = view.get()
    for i, r in enumerate(words.tolist()):
        if 0 <= r < 7:
            expect[r, :30] = host[i]
    assert to.get().tolist() == expect.tolist()
    assert copy_to.get().tolist() == words.tolist()
    assert up.skipped() == 2, "the two rows outside the table count one each"
    up(copy_words=0, stream=stream.ptr, rows_from=(src.data.ptr, 40, 2, 40))  # wider than the table: 32 go
    stream.synchronize()
    expect[3], expect[0] = src.get()[0, :32], src.get()[1, :32]
    assert to.get().tolist() == expect.tolist()
    up(copy_words=0, stream=stream.ptr)  # no rows_from: the table is left alone
    stream.synchronize()
    assert to.get().tolist() == expect.tolist()


def test_rows_from_needs_a_table_to_copy_into(cp):
    up = HostUpdates(words=0, copy_to=0, device=0)
    with pytest.raises(ValueError, match="kvcanary: rows_from"):
        up(copy_words=0, stream=cp.cuda.get_current_stream().ptr, rows_from=(0, 1, 1, 1))
