"""runtime.on_cupy_stream: CuPy work inside runs on the op's stream, and the caller's
current stream survives it, also with a CuPy whose ``with stream:`` falls back to the
null stream on exit (a stream made current with ``.use()`` is then forgotten).

A fake CuPy stands in here, so this runs without a GPU; tests/gpu/test_current_stream.py
checks the same through the public API on a real device.
"""
from __future__ import annotations

import itertools
import sys
import types

import pytest

from kvcanary_cupy import runtime


class _Stream:
    def __init__(self, cuda, ptr):
        self.cuda, self.ptr, self.entered = cuda, ptr, 0

    def use(self):
        self.cuda.current = self
        self.cuda.uses += 1
        return self

    def __enter__(self):
        self.entered += 1
        self.cuda.stack.append(self.cuda.current)
        self.cuda.current = self
        return self

    def __exit__(self, *exc):
        prev = self.cuda.stack.pop()
        # The faulty release restores the null stream, not what was current before.
        self.cuda.current = self.cuda.null if self.cuda.forgets_use else prev
        return False


def _fake_cupy(forgets_use: bool):
    cuda = types.SimpleNamespace(stack=[], uses=0, forgets_use=forgets_use)
    cuda.null = _Stream(cuda, 0)
    cuda.current = cuda.null
    cuda.get_current_stream = lambda: cuda.current

    class Stream:
        null = cuda.null

        @staticmethod
        def from_external(handle):
            return _Stream(cuda, handle.__cuda_stream__()[1])

    cuda.Stream = Stream
    return types.SimpleNamespace(cuda=cuda)


_BASES = itertools.count(1 << 40, 1 << 20)  # stream handles no other test used: the library caches its wrappers


def _install(monkeypatch, cp):
    """``cp`` as the ``cupy`` module; returns two stream handles, ``mine`` and ``op``."""
    monkeypatch.setitem(sys.modules, "cupy", cp)
    base = next(_BASES)
    return base + 0x1000, base + 0x2000


@pytest.fixture(params=[True, False], ids=["cupy-forgets-use", "cupy-restores"])
def fake(request, monkeypatch):
    cp = _fake_cupy(forgets_use=request.param)
    cp.cuda.mine_ptr, cp.cuda.op_ptr = _install(monkeypatch, cp)
    return cp.cuda


def test_the_callers_used_stream_is_current_again(fake):
    mine = _Stream(fake, fake.mine_ptr).use()
    with runtime.on_cupy_stream(fake.op_ptr, 0) as s:
        assert fake.get_current_stream() is s and s.ptr == fake.op_ptr
    assert fake.get_current_stream() is mine


def test_no_switch_when_the_op_runs_on_the_current_stream(fake):
    mine = _Stream(fake, fake.mine_ptr).use()
    uses = fake.uses
    with runtime.on_cupy_stream(fake.mine_ptr, 0) as s:
        assert s is mine
    assert fake.get_current_stream() is mine and fake.uses == uses and mine.entered == 0


def test_restored_when_the_block_raises(fake):
    mine = _Stream(fake, fake.mine_ptr).use()
    with pytest.raises(RuntimeError, match="boom"):
        with runtime.on_cupy_stream(fake.op_ptr, 0):
            raise RuntimeError("boom")
    assert fake.get_current_stream() is mine


def test_inside_the_callers_own_stream_context(fake):
    outer = _Stream(fake, fake.mine_ptr)
    with outer:
        with runtime.on_cupy_stream(fake.op_ptr, 0):
            pass
        assert fake.get_current_stream() is outer
    assert fake.get_current_stream() is (fake.null)


def test_a_cupy_that_restores_needs_no_use_call(monkeypatch):
    cp = _fake_cupy(forgets_use=False)
    mine_ptr, op_ptr = _install(monkeypatch, cp)
    mine = _Stream(cp.cuda, mine_ptr).use()
    uses = cp.cuda.uses
    with runtime.on_cupy_stream(op_ptr, 0):
        pass
    assert cp.cuda.get_current_stream() is mine and cp.cuda.uses == uses
