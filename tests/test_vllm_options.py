"""kv_transfer_config(...): every option checked when the config is built, errors naming it;
engines the connector cannot watch refused when vLLM builds it."""
from __future__ import annotations

import json

import pytest

from kvcanary_cupy.integrations.vllm import CONNECTOR_MODULE, CONNECTOR_NAME, kv_transfer_config


def test_default_config_is_json_and_loads_the_connector():
    cfg = kv_transfer_config()
    assert json.loads(json.dumps(cfg)) == cfg
    assert cfg["kv_connector"] == CONNECTOR_NAME and cfg["kv_connector_module_path"] == CONNECTOR_MODULE
    assert cfg["kv_role"] == "kv_both" and cfg["kv_load_failure_policy"] == "fail"


def test_options_pass_through():
    cfg = kv_transfer_config(policy="cancel", events="/tmp/e.jsonl", metrics=True, incident_quiet_steps=4,
                             fingerprint_sample_period=2, real_kv_mode="all", chain="sglang")
    opts = cfg["kv_connector_extra_config"]["kvcanary"]
    assert opts == {"policy": "cancel", "events": "/tmp/e.jsonl", "metrics": True, "incident_quiet_steps": 4,
                    "fingerprint_sample_period": 2, "real_kv_mode": 2, "chain": "sglang"}


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(policy="drop"), ValueError, "policy"),
    (dict(policy=print), TypeError, "policy"),
    (dict(polcy="log"), ValueError, "polcy"),
    (dict(block_table=1), ValueError, "block_table"),
    (dict(device="cuda"), ValueError, "device"),
    (dict(stamp_before_forward=True), ValueError, "stamp_before_forward"),
    (dict(events=3), TypeError, "events"),
    (dict(metrics="yes"), TypeError, "metrics"),
    (dict(incident_quiet_steps=0), ValueError, "incident_quiet_steps"),
    (dict(incident_quiet_steps=True), ValueError, "incident_quiet_steps"),
    (dict(real_kv_mode="most"), ValueError, "real_kv_mode"),
    (dict(fingerprint_sample_period=0), ValueError, "fingerprint_sample_period"),
    (dict(chain="md5"), ValueError, "chain"),
    (dict(ring_capacity=-1), ValueError, "ring_capacity"),
    (dict(cpu_backend="fast"), ValueError, "cpu_backend"),
    (dict(cpu_backend=True), ValueError, "cpu_backend"),
])
def test_bad_option_refused_naming_it(kwargs, exc, name):
    with pytest.raises(exc) as err:
        kv_transfer_config(**kwargs)
    assert str(err.value).startswith(f"kvcanary: {name}:")


@pytest.mark.parametrize("choice", ["auto", "numpy", "numba"])
def test_cpu_backend_passes_through(choice):
    if choice == "numba":
        pytest.importorskip("numba")
    assert kv_transfer_config(cpu_backend=choice)["kv_connector_extra_config"]["kvcanary"]["cpu_backend"] == choice


def test_cpu_backend_numba_refused_without_numba(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba" else find(name, *a))
    with pytest.raises(ValueError, match="^kvcanary: cpu_backend: 'numba' needs numba"):
        kv_transfer_config(cpu_backend="numba")
    assert kv_transfer_config(cpu_backend="auto")  # auto then takes the NumPy reference


def test_async_scheduling_refused():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvcanary_cupy.integrations.vllm.scheduler_side import SchedulerSide

    with pytest.raises(ValueError, match="^kvcanary: async_scheduling:"):
        SchedulerSide(SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True)))


def test_untested_version_warned():
    from kvcanary_cupy import KvCanaryWarning
    from kvcanary_cupy.integrations.vllm.version import check_version

    with pytest.warns(KvCanaryWarning, match="tested with vLLM 0.32.0 only"):
        check_version("0.33.1")


def test_unknown_attention_backend_refused():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvcanary_cupy import RealKvMode
    from kvcanary_cupy.integrations.vllm.layout import group_fingerprints

    layer = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "FLASHINFER"))
    with pytest.raises(ValueError, match="^kvcanary: attention backend:.*FLASHINFER"):
        group_fingerprints({"l0": layer}, {"l0": object()}, block_size=16, num_blocks=4, mode=RealKvMode.PARTIAL)
