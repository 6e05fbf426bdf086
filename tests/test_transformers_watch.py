"""watch() as an API: the versions it accepts, the options it checks, which engines it attaches
to, what its handle reports, and that leaving the block takes every wrapper off."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")  # the harness needs both; without them these tests skip
pytest.importorskip("transformers")

from tests.test_transformers_harness import cb, drive, greedy, hybrid, llama, prompts

import kvcanary_cupy as kc
from kvcanary_cupy.integrations.transformers import version as version_module
from kvcanary_cupy.integrations.transformers import watch

NEW = 8


def small_run(model, n: int = 4, **kw):
    return model.generate_batch(prompts(n, seed=11), generation_config=greedy(NEW), continuous_batching_config=cb(),
                                **kw)


@pytest.mark.parametrize("installed", ["5.16.0", "5.18.0", "4.57.1"])
def test_other_transformers_versions_are_refused(monkeypatch, installed):
    monkeypatch.setattr(version_module, "installed_version", lambda: installed)
    with pytest.raises(ValueError, match=rf"kvcanary: transformers: .*5\.17\.0 only, got {installed}"):
        with watch(llama()):
            pass


def test_missing_transformers_is_reported(monkeypatch):
    monkeypatch.setattr(version_module, "installed_version", lambda: None)
    with pytest.raises(ImportError, match="kvcanary: transformers: not installed"):
        with watch(llama()):
            pass


@pytest.mark.parametrize("options, match", [
    (dict(policy="ignore"), "kvcanary: policy: expected 'log', 'raise', 'cancel' or a callable"),
    (dict(block_table=None), "kvcanary: block_table: watch\\(\\) derives it from the engine"),
    (dict(bogus=1), "kvcanary: bogus: not an option"),
    (dict(max_len=0), "kvcanary: max_len: expected a positive int"),
    (dict(verify_capacity="huge"), "kvcanary: verify_capacity"),
    (dict(fingerprint_sample_period=0), "kvcanary: fingerprint_sample_period"),
])
def test_bad_options_fail_at_the_call(options, match):
    with pytest.raises(ValueError, match=match):
        with watch(llama(), **options):
            pass


def test_device_must_be_the_caches():
    model = llama()
    with pytest.raises(ValueError, match="kvcanary: device: the engine's cache lives on cpu"):
        with watch(model, device="cuda:0"):
            small_run(model)


def test_a_model_without_continuous_batching_is_refused():
    with pytest.raises(TypeError, match="kvcanary: model: expected a transformers model with continuous batching"):
        with watch(object()):
            pass


def test_nested_watch_is_refused():
    model = llama()
    with watch(model):
        with pytest.raises(ValueError, match="kvcanary: model: already watched"):
            with watch(model):
                pass


def test_exit_takes_every_wrapper_off():
    model = llama()
    with watch(model) as w:
        small_run(model)
        assert "init_continuous_batching" in vars(model)
    steps = w.stats()["steps"]
    assert steps > 0 and "init_continuous_batching" not in vars(model)
    small_run(model)  # unwatched now
    assert w.stats()["steps"] == steps


def test_an_error_in_the_block_propagates_and_unhooks():
    model = llama()
    with pytest.raises(KeyError, match="mine"):
        with watch(model):
            raise KeyError("mine")
    assert "init_continuous_batching" not in vars(model)


def test_asynchronous_batching_is_refused_and_the_model_left_as_it_was():
    model = llama()
    before = model.config._attn_implementation
    with watch(model):
        with pytest.raises(ValueError, match="kvcanary: continuous_batching_config: asynchronous batching"):
            model.init_continuous_batching(generation_config=greedy(NEW),
                                           continuous_batching_config=cb(use_async_batching=True))
    assert model.config._attn_implementation == before


def test_a_manager_cached_before_the_watch_is_refused():
    model = llama()
    small_run(model, persistent_manager=True)
    with watch(model):
        with pytest.raises(ValueError, match="kvcanary: model: its cached continuous-batching manager"):
            small_run(model)
    model.destroy_cached_continuous_batching_manager()
    with watch(model) as w:
        small_run(model)
    assert w.stats()["steps"] > 0


def test_a_persistent_manager_is_watched_across_sessions():
    model = llama()
    inputs = prompts(6, seed=12, shared=16, families=2)
    with watch(model) as w:
        first = model.generate_batch(inputs, generation_config=greedy(NEW), continuous_batching_config=cb(),
                                     persistent_manager=True)
        steps = w.stats()["steps"]
        again = model.generate_batch(inputs, generation_config=greedy(NEW), continuous_batching_config=cb(),
                                     persistent_manager=True)
    stats = w.stats()
    assert len(stats["engines"]) == 1 and stats["steps"] > steps and stats["violations"] == 0
    assert [r.generated_tokens for r in first.values()] == [r.generated_tokens for r in again.values()]
    with watch(model):  # the cache it kept was watched by another watch
        with pytest.raises(ValueError, match="cached continuous-batching manager"):
            small_run(model)
    model.destroy_cached_continuous_batching_manager()


def test_without_warmup_the_canary_attaches_in_the_generation_thread():
    model = llama()
    ref = small_run(model, n=6)
    with watch(model) as w:
        out = small_run(model, n=6, warmup=False)
    assert [r.generated_tokens for r in out.values()] == [r.generated_tokens for r in ref.values()]
    assert w.stats()["steps"] > 0 and w.violations == []


def test_handle_monitors_poll_and_stats():
    model = hybrid()
    seen = {}

    def look(bp, d):
        seen.setdefault("monitors", dict(w.monitors))
        seen.setdefault("monitor", w.monitor)
        return None

    with watch(model, policy=lambda found: None) as w:
        assert w.monitor is None and w.monitors == {} and w.poll() == []
        drive(model, prompts(4, seed=13), gen=greedy(NEW), config=cb(), max_new_tokens=NEW, inject=look)
        assert w.monitor is None  # the engine stopped and let its cache go
    assert set(seen["monitors"]) == {0, 1} and seen["monitor"] is seen["monitors"][0]
    assert isinstance(seen["monitor"], kc.KvCanary)
    stats = w.stats()
    (engine,) = stats["engines"]
    assert [g["type"] for g in engine["groups"].values()] == ["full_attention", "sliding_attention"]
    assert [g["layers"] for g in engine["groups"].values()] == [(0,), (1,)]
    assert stats["steps"] == engine["steps"] > 0 and stats["host_us_per_step"] > 0
    assert stats["slots_checked"] == sum(g["slots_checked"] for g in engine["groups"].values())


def test_poll_returns_each_violation_once():
    from tests.test_transformers_harness import swap_block_table_entries  # noqa: PLC0415

    model = llama()
    with watch(model, policy=lambda found: None) as w:
        drive(model, prompts(8, seed=14, min_len=10), gen=greedy(NEW), config=cb(), max_new_tokens=NEW,
              inject=swap_block_table_entries)
        first = w.poll()
        assert first and first == w.violations and w.poll() == []


def test_a_forward_that_fails_closes_the_canarys_step():
    model = llama()
    forward, calls = model.forward, []

    def failing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    model.forward = failing_forward
    try:
        with watch(model) as w:
            out = small_run(model, n=4)
    finally:
        del model.forward
    assert out and all("device lost" in r.error for r in out.values() if r.error)
    (engine,) = w.stats()["engines"]
    assert engine["groups"][0]["aborted_steps"] == 1 and engine["steps"] == 3 and w.violations == []
