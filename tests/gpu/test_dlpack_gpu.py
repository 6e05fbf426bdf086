"""The GPU half of the DLPack boundary: PyTorch, JAX and CuPy arrays in, zero copy.

Pointer equality proves zero copy; int32 / int64 both arrive as themselves;
non-contiguous, wrong-dtype and wrong-device inputs raise ``kvcanary:`` errors;
bf16 / fp8 pools become byte views for RealKvSource; streams resolve as
documented; JAX arrays are never written.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with CuPy and PyTorch

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy import arrays, runtime  # noqa: E402

try:  # imported at collection, before any test body runs (and before cuda.bindings is loaded)
    import torch as _torch  # noqa: E402
except ImportError:
    _torch = None

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


@pytest.fixture(scope="module")
def torch():
    t = _torch if _torch is not None else pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return t


@pytest.fixture(scope="module")
def jax():
    j = pytest.importorskip("jax")
    try:
        if not j.devices("gpu"):
            pytest.skip("JAX sees no GPU")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    j.config.update("jax_enable_x64", True)
    return j


# --- CuPy ----------------------------------------------------------------------
def test_cupy_passes_through(cp):
    a = cp.arange(10, dtype=cp.int32)
    assert arrays.as_index_array(a, "x") is a
    with pytest.raises(TypeError, match=r"^kvcanary: x: expected dtype int32 or int64, got float32"):
        arrays.as_index_array(cp.zeros(3, dtype=cp.float32), "x")
    with pytest.raises(ValueError, match=r"^kvcanary: t: expected a C-contiguous array"):
        arrays.as_index_array(cp.zeros((4, 6), dtype=cp.int64)[:, ::2], "t", ndim=2)


# --- PyTorch -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_torch_cuda_zero_copy(torch, dtype):
    t = torch.arange(12, dtype=getattr(torch, dtype), device="cuda").reshape(3, 4)
    v = arrays.as_index_array(t, "req_to_token", ndim=2)
    assert v.data.ptr == t.data_ptr() and v.dtype == np.dtype(dtype) and v.shape == (3, 4)
    t[1, 2] = -7
    assert int(v[1, 2]) == -7  # the same memory


def test_torch_misuse_raises(torch):
    with pytest.raises(ValueError, match=r"^kvcanary: t: expected a C-contiguous array"):
        arrays.as_index_array(torch.zeros((4, 6), dtype=torch.int64, device="cuda")[:, ::2], "t", ndim=2)
    with pytest.raises(TypeError, match=r"^kvcanary: x: expected dtype int32 or int64, got float32"):
        arrays.as_index_array(torch.zeros(3, device="cuda"), "x")
    with pytest.raises(TypeError, match=r"^kvcanary: x: expected dtype int32 or int64, got (torch\.)?bfloat16"):
        arrays.as_index_array(torch.zeros(3, device="cuda", dtype=torch.bfloat16), "x")
    vp = kc.VerifyPlan.allocate(capacity=8, max_batch=2, device="cuda")
    with pytest.raises(ValueError, match=r"^kvcanary: req_pool_indices: expected an array on cuda:0, got one on cpu"):
        kc.plan(vp, None, req_pool_indices=torch.ones(2, dtype=torch.int64), prefix_lens=torch.ones(2),
                extend_lens=torch.ones(2), req_to_token=torch.zeros((3, 4), dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float16"])
def test_torch_byte_view_for_real_kv(torch, dtype):
    if not hasattr(torch, dtype):
        pytest.skip(f"torch has no {dtype}")
    pool = torch.zeros((2, 64, 8, 16), dtype=getattr(torch, dtype), device="cuda")  # [layers, slots, heads, dim]
    src = kc.RealKvSource(pool, page_size=1, bytes_per_token=8 * 16 * pool.element_size(), layer_axis=True)
    assert src.data.data.ptr == pool.data_ptr() and src.data.dtype == np.uint8
    assert src.num_layers == 2 and src.num_slots == 64
    with pytest.raises(ValueError, match=r"^kvcanary: tensor: expected a (C-)?contiguous"):
        kc.RealKvSource(pool.transpose(1, 2), page_size=1, bytes_per_token=256, layer_axis=True)


def test_torch_stream_resolution(torch, cp):
    s = torch.cuda.Stream()
    t = torch.ones(2, device="cuda")
    with torch.cuda.stream(s):
        assert runtime.resolve_stream(None, [t]) == s.cuda_stream  # torch inputs: torch's current stream
    assert runtime.resolve_stream(s, []) == s.cuda_stream  # a torch stream object
    cs = cp.cuda.Stream()
    assert runtime.resolve_stream(cs, []) == cs.ptr
    with cs:
        assert runtime.resolve_stream(None, [cp.ones(2)]) == cs.ptr  # else CuPy's current stream
    assert runtime.resolve_stream(12345, []) == 12345

    class Proto:
        def __cuda_stream__(self):
            return (0, cs.ptr)

    assert runtime.resolve_stream(Proto(), []) == cs.ptr


def test_torch_inputs_run_on_torch_stream(torch, cp):
    """An op fed torch tensors lands on torch's current stream: queued behind a
    long kernel on that stream, its result is not there before that stream ends."""
    s = torch.cuda.Stream()
    table = torch.arange(1, 41, dtype=torch.int32, device="cuda").reshape(4, 10)
    vp = kc.VerifyPlan.allocate(capacity=64, max_batch=2, device="cuda")
    kc.plan(vp, None, req_pool_indices=torch.tensor([0, 0], device="cuda"), prefix_lens=torch.tensor([0, 0],
            device="cuda"), extend_lens=torch.tensor([0, 0], device="cuda"), req_to_token=table)  # first call
    rpi, pre, ext = (torch.tensor(v, device="cuda") for v in ([1, 2], [3, 4], [0, 0]))  # copies before the sleep
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on s
        kc.plan(vp, None, req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, req_to_token=table)
        done = torch.cuda.Event()
        done.record(s)
    assert not done.query()  # still queued behind the sleep
    s.synchronize()
    assert vp.host_scalars()["num_valid"] == 7


# --- JAX -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_jax_zero_copy_read_only(jax, cp, dtype):
    import jax.numpy as jnp  # noqa: PLC0415

    x = jnp.arange(12, dtype=getattr(jnp, dtype)).reshape(3, 4)
    v = arrays.as_index_array(x, "req_to_token", ndim=2)
    assert v.dtype == np.dtype(dtype)
    assert v.data.ptr == x.unsafe_buffer_pointer()
    assert np.array_equal(v.get(), np.arange(12).reshape(3, 4))
    assert arrays.is_readonly(v)
    with pytest.raises(ValueError, match=r"^kvcanary: table: expected a writable array"):
        kc.scatter_expected_tokens(x, tokens=cp.arange(4), offsets=cp.asarray([0, 4]),
                                   req_pool_indices=cp.asarray([1]))


def test_jax_byte_view_of_bf16(jax, cp):
    import jax.numpy as jnp  # noqa: PLC0415

    pool = jnp.ones((2, 32, 4, 16), dtype=jnp.bfloat16)
    src = kc.RealKvSource(pool, page_size=1, bytes_per_token=4 * 16 * 2, layer_axis=True)
    assert src.data.data.ptr == pool.unsafe_buffer_pointer() and src.num_slots == 32
    assert int(src.data[0, :2].get().view(np.uint16)[0]) == 0x3F80  # bf16 1.0, little endian


def test_jax_inputs_drive_the_ops(jax, cp):
    """A plan from JAX int32 inputs (JAX's default) equals the one from NumPy."""
    import jax.numpy as jnp  # noqa: PLC0415

    table = np.arange(1, 41, dtype=np.int32).reshape(4, 10)
    args = dict(req_pool_indices=[1, 0, 3], prefix_lens=[3, 9, 5], extend_lens=[1, 1, 2])
    out = {}
    for dev in ("cpu", "cuda"):
        vp = kc.VerifyPlan.allocate(capacity=32, max_batch=3, device=dev)
        wp = kc.WritePlan.allocate(max_batch=3, device=dev)
        if dev == "cpu":
            kc.plan(vp, wp, req_to_token=table, **{k: np.asarray(v, np.int32) for k, v in args.items()})
        else:
            kc.plan(vp, wp, req_to_token=jnp.asarray(table), **{k: jnp.asarray(v, jnp.int32) for k, v in args.items()})
        out[dev] = (vp.host_entries(), runtime.to_host(wp.seed_slots).tolist())
    for f in kc.VerifyPlan.ENTRY_FIELDS:
        assert np.array_equal(out["cpu"][0][f], out["cuda"][0][f]), f
    assert out["cpu"][1] == out["cuda"][1]
