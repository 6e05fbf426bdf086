"""kv_transfer_config(...): the one argument that turns the connector on, checked up front.

The result is a plain JSON-able dict for ``LLM(..., kv_transfer_config=...)`` or
``vllm serve ... --kv-transfer-config '<json>'``; every option is checked here, in the
caller's process, so a mistake fails now rather than inside the engine's worker.
"""
from __future__ import annotations

import importlib.util
import json

from ...format import RealKvMode
from ..engine.options import check_monitor_options, check_policy, check_positive_int, try_monitor

CONNECTOR_NAME = "KvCanaryConnector"
CONNECTOR_MODULE = "kvcanary_cupy.integrations.vllm.connector"
EXTRA_KEY = "kvcanary"
# KvCanary options the connector passes on; the rest it derives from the engine or cannot honour
# (device: the engine's; stamp_before_forward: real K/V is fingerprinted after the forward;
# process_group: each tensor-parallel worker watches its own shard).
PASSED = ("fingerprint_sample_period", "real_kv_mode", "verify_capacity", "grow_on_overflow", "ring_capacity",
          "history", "chain", "events", "metrics", "incident_quiet_steps")
POLICIES = ("log", "raise", "cancel")
OWN = ("policy", "cpu_backend")  # the connector's own options; the rest are KvCanary's
CPU_BACKENDS = ("auto", "numpy", "numba")


def kv_transfer_config(policy: str = "log", **options) -> dict:
    """The ``kv_transfer_config`` that runs a KV-cache canary inside vLLM's engine.

    Args:
        policy: ``"log"`` (each new incident is one error line on the ``kvcanary`` logger:
            request id, position, layer group, reasons), ``"raise"``
            (:class:`~kvcanary_cupy.KvCanaryError` stops the engine), or ``"cancel"`` (only the
            requests whose KV failed the check fail, through vLLM's own KV-load failure
            path; the others go on, token for token as without the connector).
        events: a path: each incident (naming the vLLM request id) appended as a JSON line.
        metrics: True: Prometheus counters in prometheus_client's default registry.
        incident_quiet_steps: steps without a row after which an incident ends.
        cpu_backend: what runs the checks of a CPU engine (vLLM's CPU build): ``"numba"`` (the
            ops compiled by numba, which vLLM's CPU build installs: a few times less host time
            per step), ``"numpy"`` (the NumPy reference), or ``"auto"`` (the default): numba
            where it is installed and the engine core runs in a process of its own (vLLM's
            default), NumPy in an engine run in the caller's process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where vLLM 0.32's CPU worker would not
            start another engine once numba is loaded. A GPU engine's checks run on the GPU.
        fingerprint_sample_period, real_kv_mode, verify_capacity, grow_on_overflow,
            ring_capacity, history, chain: :class:`~kvcanary_cupy.KvCanary`'s options.

    Returns:
        dict: ``kv_connector``, ``kv_connector_module_path``, ``kv_role``,
        ``kv_load_failure_policy`` and ``kv_connector_extra_config`` (the checked options).

    Example::

        >>> cfg = kv_transfer_config(policy="cancel", incident_quiet_steps=8)
        >>> cfg["kv_connector"], cfg["kv_load_failure_policy"], cfg["kv_connector_extra_config"]["kvcanary"]
        ('KvCanaryConnector', 'fail', {'policy': 'cancel', 'incident_quiet_steps': 8})
        >>> kv_transfer_config(polcy="log")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: kvcanary: polcy: not an option; pass only policy, cpu_backend and KvCanary's options (...)
    """
    opts = parse_options({"policy": policy, **options})
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            # "fail": a request whose KV failed the check fails (only with policy="cancel" does the
            # connector report any block), never silently recomputed from KV that may be bad.
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {EXTRA_KEY: opts}}


def parse_options(options: dict) -> dict:
    """Check the connector's options; returns them JSON-able (``real_kv_mode`` as an int)."""
    opts = dict(options)
    if not isinstance(opts.get("policy", "log"), str):
        raise TypeError(f"kvcanary: policy: expected 'log', 'raise' or 'cancel' (a callable cannot travel to "
                        f"vLLM's engine process), got {type(opts['policy']).__name__}")
    check_policy(opts.get("policy", "log"))
    check_monitor_options({k: v for k, v in opts.items() if k not in OWN}, adapter="the vLLM connector",
                          own=", ".join(OWN))
    for name in opts:
        if name not in OWN and name not in PASSED:
            raise ValueError(f"kvcanary: {name}: not supported by the vLLM connector; pass only "
                             f"{', '.join(OWN + PASSED)}")
    if "cpu_backend" in opts:
        choice = opts["cpu_backend"]
        if not isinstance(choice, str) or choice not in CPU_BACKENDS:
            raise ValueError(f"kvcanary: cpu_backend: expected one of {', '.join(map(repr, CPU_BACKENDS))}, "
                             f"got {choice!r}")
        if choice == "numba" and importlib.util.find_spec("numba") is None:
            raise ValueError("kvcanary: cpu_backend: 'numba' needs numba installed (pip install numba); use 'auto' "
                             "or 'numpy'")
    if "events" in opts and opts["events"] is not None and not isinstance(opts["events"], str):
        raise TypeError(f"kvcanary: events: expected a file path (str) the engine appends incidents to, got "
                        f"{type(opts['events']).__name__}")
    if "metrics" in opts and not isinstance(opts["metrics"], bool):
        raise TypeError(f"kvcanary: metrics: expected True or False (prometheus_client's default registry), got "
                        f"{type(opts['metrics']).__name__}")
    if "incident_quiet_steps" in opts:
        check_positive_int(opts["incident_quiet_steps"], "incident_quiet_steps", allow_none=False)
    if "real_kv_mode" in opts:
        mode = opts["real_kv_mode"]
        if isinstance(mode, str):
            try:
                mode = RealKvMode[mode.upper()]
            except KeyError:
                raise ValueError(f"kvcanary: real_kv_mode: expected 'none', 'partial' or 'all', got {mode!r}") from None
        opts["real_kv_mode"] = int(mode)
    monitor = monitor_options(opts)
    monitor.pop("events", None)  # a path is opened by the engine's monitor, not by this check
    monitor.pop("metrics", None)  # counters are registered once, by the engine's monitors
    try_monitor(monitor, tables=(dict(block_table=_zeros_table(), page_size=4),))
    json.dumps(opts)  # everything must travel as JSON (vllm serve --kv-transfer-config)
    return opts


def monitor_options(opts: dict) -> dict:
    """The KvCanary keyword arguments among the connector's options."""
    out = {k: v for k, v in opts.items() if k not in OWN}
    if "real_kv_mode" in out:
        out["real_kv_mode"] = RealKvMode(int(out["real_kv_mode"]))
    return out


def _zeros_table():
    import numpy as np  # noqa: PLC0415

    return np.zeros((2, 2), np.int32)
