"""The vLLM connector's worker side over a flash-attention pool, as a GPU vLLM worker drives it
(``tests/vllm_flash_worker.py``: vLLM's configs, KV tensors and attention metadata stood in
for, rows in the worker's own order). Once on the CPU (NumPy reference, CPU torch tensors) and
once on CUDA (the CUDA backend, CUDA tensors: the connector's GPU path end to end, rows named
from device metadata); the CUDA run skips where CuPy finds no device.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvcanary_cupy import FailReason  # noqa: E402

from tests.vllm_flash_worker import FlashWorker  # noqa: E402


def _cuda() -> bool:
    try:
        import cupy  # noqa: PLC0415

        return cupy.cuda.runtime.getDeviceCount() > 0 and torch.cuda.is_available()
    except Exception:  # noqa: BLE001  (no CuPy, no driver)
        return False


DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda:0", id="cuda", marks=[pytest.mark.gpu,
                                                    pytest.mark.skipif(not _cuda(), reason="CuPy finds no CUDA device")])]


def _engine(device, **kw) -> FlashWorker:
    eng = FlashWorker(device=device, seed=kw.pop("seed", 0), **kw)
    for i, n in enumerate((37, 20, 50)):
        eng.add(f"req-{i}", eng.prompt(n))
    return eng


def _steps(eng, n: int) -> list:
    return [v for _ in range(n) for v in eng.step()]


@pytest.mark.parametrize("device", DEVICES)
def test_clean_steps_silent_every_read_slot_checked_rows_named(device):
    eng = _engine(device)
    found = _steps(eng, 6)
    eng.add("req-3", eng.prompt(29))  # joins mid-run
    found += _steps(eng, 4)
    eng.finish("req-1")  # its blocks go back to the pool
    eng.add("req-4", eng.prompt(40))  # and are handed to another request
    found += _steps(eng, 6)
    assert found == []
    s = eng.worker.stats()
    assert s["rows_unmatched"] == 0 and s["steps"] == 16
    assert s["slots_checked"] == s["slots_read"] > 0
    assert s["groups"][0]["input_errors"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_swapped_block_table_entries_caught_for_their_request(device):
    eng = _engine(device, seed=1)
    assert _steps(eng, 4) == []

    def swap(md):  # the worker's table sends req-2's first two blocks to each other's place
        row = 0  # the worker's rows are the scheduler's reversed: req-2 first
        a, b = int(md.block_table[row, 0]), int(md.block_table[row, 1])
        md.block_table[row, 0], md.block_table[row, 1] = b, a

    found = eng.step(tamper=swap) + _steps(eng, 2)
    assert found and {v.request_id for v in found} == {"req-2"}
    assert any(v.reasons & FailReason.POSITION for v in found)


@pytest.mark.parametrize("device", DEVICES)
def test_flipped_key_byte_in_the_last_layer_caught_for_its_request(device):
    eng = _engine(device, seed=2)
    assert _steps(eng, 4) == []
    slot = eng.block_of("req-0", 0) * eng.bs + 3
    kv = eng.kv[eng.names[-1]]
    kv[0, slot // eng.bs, slot % eng.bs, 0, 0] += 1.0  # key, head 0, dim 0: among the sampled bytes
    found = _steps(eng, 2)
    assert found and {v.request_id for v in found} == {"req-0"}
    assert any(v.reasons & FailReason.REAL_KV and v.violation.slot == slot for v in found)


@pytest.mark.parametrize("device", DEVICES)
def test_cancel_charges_one_block_of_the_damaged_request_alone(device):
    eng = _engine(device, seed=3, policy="cancel")
    assert _steps(eng, 4) == []
    slot = eng.block_of("req-1", 1) * eng.bs
    eng.kv[eng.names[0]][1, slot // eng.bs, 0, 0, 0] += 1.0  # value, head 0, dim 0
    blocks = set()
    for _ in range(2):
        eng.step()
        blocks |= eng.worker.load_errors()
    assert blocks and blocks <= set(eng.requests["req-1"].blocks)
    assert eng.worker.stats()["cancelled"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_of_more_tokens_than_sized_for_grows_its_buffers_and_stays_clean(device):
    eng = _engine(device, seed=4, max_num_batched_tokens=16)  # the prefill writes 107 tokens
    assert _steps(eng, 5) == []
    s = eng.worker.stats()
    assert s["slots_written"] == 107 + 4 * 3 and s["slots_checked"] == s["slots_read"] > 0


@pytest.mark.parametrize("multiprocessing, expected", [("1", "numba"), ("0", "numpy")])
def test_auto_cpu_backend_follows_where_the_engine_core_runs(monkeypatch, multiprocessing, expected):
    """``cpu_backend="auto"`` on a CPU worker: numba where vLLM runs the engine core in a process of
    its own, the reference in the caller's process; the worker's close puts the choice back."""
    if expected == "numba":
        pytest.importorskip("numba")
    import kvcanary_cupy as kc

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    before = kc.cpu_backend()
    eng = _engine("cpu", cpu_backend="auto")
    try:
        assert eng.worker.cpu_backend == expected and kc.cpu_backend() == expected
        # numba's ops were compiled at the start, on a spare canary: this one has seen nothing yet
        mon = eng.worker.stats()
        assert (mon["slots_checked"], mon["slots_written"], mon["violations"]) == (0, 0, 0)
        assert _steps(eng, 3) == [] and eng.worker.stats()["cpu_backend"] == expected
    finally:
        eng.worker.close()
    assert kc.cpu_backend() == before
