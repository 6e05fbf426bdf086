"""Every option watch() accepts works on every model it accepts, or is refused at watch().

Each accepted option, value by value, runs a clean greedy generation on an all-full-attention
model, an all-sliding-window model and a hybrid (full + sliding) one: no violation, no
cancelled or failed request, nothing the plans could not read, and the outputs of a run
without the watch. Values that cannot work together are refused when ``watch()`` is called,
in the caller's thread, with a ``kvcanary:`` error, not later in the engine's generation
thread.
"""
from __future__ import annotations

import inspect
import logging

import pytest

pytest.importorskip("torch")  # the harness needs both; without them these tests skip
pytest.importorskip("transformers")

from tests.test_transformers_harness import all_sliding, cb, greedy, hybrid, llama, prompts, reference

import kvcanary_cupy as kc
from kvcanary_cupy.integrations.transformers import watch

NEW = 8
MODELS = {"full": llama, "sliding": all_sliding, "hybrid": hybrid}


def _none(found) -> None:
    assert not found, [str(v) for v in found]


# A case per value of every option watch() accepts but the defaults (policy "log", chain "scan",
# real_kv_mode PARTIAL), which every other case runs, plus pairs that meet on one code path.
# The prompts are longer than the window (12) and than a prefill chunk (32 tokens), so the
# sliding groups read full windows, chunks continue a prefix and decode steps slide.
def _registry():
    prometheus_client = pytest.importorskip("prometheus_client")
    return prometheus_client.CollectorRegistry()


CASES = {
    "policy=raise": dict(policy="raise"),
    "policy=cancel": dict(policy="cancel"),
    "policy=callable": dict(policy=_none),
    "max_len=96": dict(max_len=96),
    "device=cpu": dict(device="cpu"),
    "real_kv_mode=none": dict(real_kv_mode=kc.RealKvMode.NONE),
    "real_kv_mode=all": dict(real_kv_mode=kc.RealKvMode.ALL),
    "verify_capacity=pool": dict(verify_capacity="pool"),
    "verify_capacity=max": dict(verify_capacity="max"),
    "verify_capacity=8": dict(verify_capacity=8),  # overflows: the plans grow
    "grow_on_overflow=false": dict(grow_on_overflow=False, verify_capacity=8),  # overflows: verifies skipped
    "verify_after": dict(verify_after=True, policy="cancel"),
    "verify_after+verify_capacity=8": dict(verify_after=True, verify_capacity=8),
    "verify_after+fingerprint_sample_period=2": dict(verify_after=True, fingerprint_sample_period=2),
    "fingerprint_sample_period=3": dict(fingerprint_sample_period=3),
    "ring_capacity=1": dict(ring_capacity=1),
    "sweep_budget=1+sweep_max_chains=1": dict(sweep_budget=1, sweep_max_chains=1),
    "history=1": dict(history=1),
    "chain=sglang": dict(chain="sglang"),
    "stamp_before_forward": dict(stamp_before_forward=True, real_kv_mode=kc.RealKvMode.NONE),
    "stamp_before_forward+chain=sglang": dict(stamp_before_forward=True, real_kv_mode=kc.RealKvMode.NONE,
                                              chain="sglang", policy="cancel"),
    "events+metrics+incident_quiet_steps=1": dict(events=_none, metrics=_registry(), incident_quiet_steps=1),
}

INPUTS = prompts(3, seed=41, min_len=14, max_len=40)
CONFIG = dict(max_batch_tokens=32)


@pytest.fixture(scope="module")
def models():
    """Each model once, with its greedy outputs without the watch."""
    out = {}
    for name, make in MODELS.items():
        model = make()
        out[name] = (model, reference(model, INPUTS, gen=greedy(NEW), config=cb(**CONFIG)))
    return out


def accepted_options(model) -> set:
    """The names watch() takes: its own and every KvCanary argument it does not refuse."""
    names = set()
    for name, p in inspect.signature(kc.KvCanary.__init__).parameters.items():
        if name == "self":
            continue
        try:
            with watch(model, **{name: None if p.default is inspect.Parameter.empty else p.default}):
                pass
        except ValueError as e:
            assert str(e).startswith(f"kvcanary: {name}: watch() derives it from the engine"), e
            continue
        names.add(name)
    return names | {"max_len"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_option_runs_clean(models, kind, case, caplog):
    model, ref = models[kind]
    with caplog.at_level(logging.ERROR, logger="kvcanary"), watch(model, **CASES[case]) as w:
        out = model.generate_batch(INPUTS, generation_config=greedy(NEW), continuous_batching_config=cb(**CONFIG))
    assert len(out) == len(INPUTS) and all(r.error is None for r in out.values())
    assert {k: r.generated_tokens for k, r in out.items()} == ref
    stats = w.stats()
    assert w.violations == [] and stats["violations"] == 0 and stats["logged"] == 0
    assert stats["cancelled"] == 0 and stats["input_errors"] == 0 and stats["writes_skipped"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    groups = stats["engines"][0]["groups"].values()
    assert {g["type"] for g in groups} == ({"full_attention"} if kind == "full" else {"sliding_attention"}
                                           if kind == "sliding" else {"full_attention", "sliding_attention"})
    assert all(g["slots_written"] > 0 for g in groups)
    if CASES[case].get("grow_on_overflow") is False:
        assert stats["verifies_skipped"] > 0  # too small a plan, not grown: skipped, and counted
    else:
        assert all(g["slots_checked"] > 0 for g in groups) and stats["verifies_skipped"] == 0


# Refused by watch() itself: values that could only fail later, in the engine's thread.
REFUSED = [
    (dict(stamp_before_forward=True), "stamp_before_forward"),  # the engine's K/V is fingerprinted
    (dict(stamp_before_forward=True, real_kv_mode=kc.RealKvMode.NONE, verify_after=True), "stamp_before_forward"),
    (dict(window=4), "window"),  # the adapter derives it from the engine
    (dict(real_kv_mode="none"), "real_kv_mode"),
    (dict(verify_capacity=0), "verify_capacity"),
    (dict(device="cuda"), "device"),  # the model is on the CPU
]


def test_watch_refuses_at_once_what_cannot_work_and_the_cases_cover_the_rest(models):
    model = models["hybrid"][0]
    for opts, name in REFUSED:
        handle = watch(model, **opts)
        with pytest.raises(ValueError, match=f"^kvcanary: {name}: "):
            handle.__enter__()  # in this thread, before any engine runs
        with watch(model) as w:  # nothing stayed attached
            assert w.monitor is None
    covered = {k for opts in CASES.values() for k in opts}
    assert covered == accepted_options(model)
