"""The CPU half of the DLPack boundary: zero copy in, clear errors for misuse."""
import importlib.util

import numpy as np
import pytest

from kvcanary_cupy import arrays, runtime


def test_numpy_passes_through():
    a = np.arange(10, dtype=np.int64)
    assert arrays.as_index_array(a, "x") is a


def test_dlpack_object_zero_copy():
    class Wrapper:  # anything speaking DLPack
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    a = np.arange(6, dtype=np.int32)
    v = arrays.as_index_array(Wrapper(a), "w")
    assert v.ctypes.data == a.ctypes.data


def test_torch_cpu_zero_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    v = arrays.as_index_array(t, "req_to_token", ndim=2)
    assert isinstance(v, np.ndarray) and v.ctypes.data == t.data_ptr()
    t[1, 2] = -7  # a view, not a copy
    assert v[1, 2] == -7
    i32 = torch.arange(5, dtype=torch.int32)
    assert arrays.as_index_array(i32, "x").dtype == np.int32


def test_torch_cpu_byte_view_of_bf16():
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 16, dtype=torch.float32).to(torch.bfloat16)
    b = arrays.as_byte_view(t, "kv")
    assert b.dtype == np.uint8 and b.shape == (4 * 16 * 2,) and b.ctypes.data == t.data_ptr()


def test_jax_cpu_zero_copy():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jax.device_put(jnp.arange(8, dtype=jnp.int32), jax.devices("cpu")[0])
    v = arrays.as_index_array(x, "x")
    assert v.dtype == np.int32 and v.tolist() == list(range(8))
    assert v.ctypes.data == x.unsafe_buffer_pointer()


@pytest.mark.parametrize("bad, kind, words", [
    (np.arange(4, dtype=np.float32), TypeError, "expected dtype int32 or int64, got float32"),
    (np.zeros((2, 2), dtype=np.int64), ValueError, "expected 1-D array"),
    (np.arange(8, dtype=np.int64)[::2], ValueError, "C-contiguous"),
    ([1, 2, 3], TypeError, "expected an array"),  # a list would need a copy
    ("nope", TypeError, "expected"),
])
def test_misuse_names_the_argument(bad, kind, words):
    with pytest.raises(kind, match="kvcanary: prefix_lens") as e:
        arrays.as_index_array(bad, "prefix_lens")
    assert words in str(e.value)


def test_torch_requires_grad_is_a_clear_error():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, requires_grad=True)
    with pytest.raises(TypeError, match="kvcanary: kv"):
        arrays.as_array(t, "kv")


def test_device_strings():
    assert runtime.parse_device("cpu") == ("cpu", None)
    if importlib.util.find_spec("cupy") is None:  # says what to install, not ModuleNotFoundError
        with pytest.raises(ValueError, match=r"kvcanary: device: .*pip install"):
            runtime.parse_device("cuda:3")
    with pytest.raises(ValueError, match="kvcanary: device"):
        runtime.parse_device("tpu")
