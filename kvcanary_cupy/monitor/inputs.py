"""A step's input arrays and its stream.

An engine either passes each step's arrays (imported zero copy, per call) or
binds its persistent per-step buffers once (``bind_inputs``) and lets the step
use views of them: the same view objects every step, so the ops see the same
arrays and skip their re-validation, and a step pays no DLPack import.
"""
from __future__ import annotations

import sys

from .. import arrays, runtime
from .lifetime import Keepalive


def check_len(a, name: str, n: int, what: str) -> None:
    """``a`` holds at least the ``n`` elements a step needs."""
    if int(a.shape[0]) < n:
        raise ValueError(f"kvcanary: {name}: the step needs {n} elements, but {what} {int(a.shape[0])}")


class StepInputs:
    """The bound buffers, per-call imports, and the stream a step runs on.

    Args:
        device: the monitor's device.
        keepalive: holds per-call imports until the device has read them.
        torch_inputs: whether the engine speaks PyTorch (its current stream is
            then the default stream).

    Example::

        >>> import numpy as np
        >>> from kvcanary_cupy.monitor.lifetime import Keepalive
        >>> s = StepInputs("cpu", Keepalive("cpu"), torch_inputs=False)
        >>> s.bind({"prefix_lens": np.arange(4)})
        >>> s.arg(None, "prefix_lens", 2).tolist(), "prefix_lens" in s
        ([0, 1], True)
    """

    def __init__(self, device: str, keepalive: Keepalive, *, torch_inputs: bool):
        self.device = device
        self.torch_inputs = torch_inputs
        self._cpu = runtime.is_cpu(device)
        self._keepalive = keepalive
        self._bound: dict = {}
        self._slices: dict = {}  # (name, n) -> the bound view's first n rows, made once
        # The last stream object a call passed and its handle: a stream's handle never changes,
        # and holding the object keeps the handle from going to another stream.
        self._last_stream = self._last_ptr = None
        self._current_ptr = None
        if not self._cpu:
            # Looked up once: a step asks for the current stream and the capture state every time.
            cp = runtime.cupy()
            self._current_stream = cp.cuda.get_current_stream
            self._stream_is_capturing = cp.cuda.runtime.streamIsCapturing

    def __contains__(self, name: str) -> bool:
        return name in self._bound

    def bound(self, name: str):
        """The buffer bound as ``name``, or None."""
        return self._bound.get(name)

    def bind(self, given: dict) -> None:
        """Import the buffers of ``given`` (name -> array or None) once, replacing earlier ones."""
        for name, obj in given.items():
            if obj is None:
                continue
            self._bound[name] = arrays.as_index_array(obj, name, device=self.device)
            self._slices.clear()
            if runtime.is_torch(obj):
                self.torch_inputs = True

    def arg(self, obj, name: str, n: int | None, min_len: int | None = None):
        """The step's array ``name``: ``obj`` imported, or the bound buffer; its first ``n``
        elements when ``n`` is given (a buffer shorter than ``n`` is an error, never a
        silently shorter step)."""
        if obj is None:
            a = self._bound.get(name)
            if a is None:
                raise ValueError(f"kvcanary: {name}: expected an array (or one bound with bind_inputs()), got None")
            if n is None:
                return a
            # The same slice object every step, so ops sees the same arrays and skips re-validation.
            key = (name, n)
            v = self._slices.get(key)
            if v is None:
                check_len(a, name, n, "the buffer bound with bind_inputs() holds")
                v = self._slices[key] = a[:n]
            return v
        a = arrays.as_index_array(obj, name, device=self.device, min_len=min_len)
        self._keepalive.hold(a)
        if n is None:
            return a
        check_len(a, name, n, "the array holds")
        return a[:n]

    def stream(self, stream, objs=()):
        """The raw stream a call runs on (None on the CPU): ``stream`` resolved, else PyTorch's
        current stream for a PyTorch engine, else the default of the inputs ``objs``."""
        if self._cpu:
            return None
        if stream is None:
            if self.torch_inputs and "torch" in sys.modules:
                ptr = sys.modules["torch"].cuda.current_stream().cuda_stream
            else:
                for o in objs:
                    if o is not None:  # a caller's array may name its own default stream (PyTorch's)
                        return runtime.resolve_stream(None, objs)
                ptr = self._current_stream().ptr
            if ptr != self._current_ptr:
                self._current_ptr = int(ptr)
            return self._current_ptr  # the same int object while the stream stays: ops then match it by identity
        if type(stream) is int:
            return stream
        if stream is self._last_stream:
            return self._last_ptr
        ptr = runtime.resolve_stream(stream, objs)
        self._last_stream, self._last_ptr = stream, ptr
        return ptr

    def capturing(self, ptr) -> bool:
        """Whether stream ``ptr`` is being captured into a CUDA graph (False on the CPU)."""
        if self._cpu:
            return False
        try:
            return bool(self._stream_is_capturing(ptr))
        except Exception:  # noqa: BLE001  (the runtime's own fallback asks PyTorch)
            return runtime.is_capturing(self.device, ptr)
