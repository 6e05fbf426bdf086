"""watch(model, **options): a KvCanary on every continuous-batching engine the model runs.

The watch shadows ``model.init_continuous_batching`` (which ``generate_batch`` and
``continuous_batching_context_manager`` go through) on the model instance. Each
new manager it returns is adopted: its ``_create_batch_processor`` is wrapped so
that, the moment the engine builds its cache, an
:class:`~kvcanary_cupy.integrations.transformers.engine.EngineCanary` attaches
to it (before the first forward, graph capture or compile), and its ``stop`` so
that, once the engine is done, the last violations are collected and the engine
is let go. Leaving the ``with`` block takes every wrapper off.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

from ...monitor.policy import KvCanaryError, KvCanaryWarning
from .engine import EngineCanary, device_name, same_device
from .hooks import Hooks
from .options import WatchOptions
from .version import check_version
from ..engine.policy import IncidentPolicy

_SUMMED = ("steps", "cancelled", "cancel_too_late", "outputs_dropped", "offloaded_requests", "restored_requests",
           "forked_blocks", "swept_records", "host_seconds", "updates_skipped")
_MONITOR_SUMMED = ("slots_checked", "slots_written", "kernel_runs", "logged", "dropped", "overflows", "input_errors",
                   "rows_unstamped",
                   "verifies_skipped", "writes_skipped", "tokens_skipped", "sweeps", "sweep_entries")


@contextlib.contextmanager
def watch(model, **options):
    """Watch every continuous-batching engine ``model`` runs inside the ``with`` block.

    Every step of the engine (``model.generate_batch(...)``, or a manager from
    ``model.init_continuous_batching()`` created inside the block) then verifies,
    for each layer group (full attention and sliding window), every KV slot its
    attention reads, against the requests' own block tables and token lists
    (prompt and generated tokens, so a wrong prefix-cache hit shows), fingerprints
    the real K/V of every layer in the engine's own cache tensors, and stamps every
    slot it writes. Records move with blocks the engine offloads to the host and
    restores, and with blocks a fork copies. Generation is unchanged.

    Args:
        model: a transformers model with continuous batching (transformers 5.17.0;
            other versions are refused).
        policy: what a violation does, in the engine's generation thread:
            ``"log"`` (default; the ``kvcanary`` logger, error level), ``"raise"``
            (:class:`~kvcanary_cupy.KvCanaryError` stops the engine, which fails
            every unfinished request; the error is raised again by
            :meth:`Watch.poll` and when the block exits), ``"cancel"`` (only the
            affected request is cancelled through the engine and its result
            delivered failed, with an error naming the violation; the others go
            on), or a callable taking the list of :class:`EngineViolation`. A damaged
            slot is found again at every step that reads it: the policy sees the
            first row of each (request, layer group, slot, reasons) once, and
            ``.violations`` keeps every row.
        events, metrics, incident_quiet_steps: passed to every monitor (see
            :class:`~kvcanary_cupy.KvCanary`), each monitor named after its layer group.
        max_len: the longest request (prompt plus generated tokens) the token
            tables of sliding-window groups cover. Default: the longest prompt
            plus ``max_new_tokens`` when ``generate_batch`` announces them, else
            the cache's capacity in tokens.
        **options: :class:`~kvcanary_cupy.KvCanary` options for every monitor
            (``fingerprint_sample_period``, ``real_kv_mode``, ``verify_after``,
            ``verify_capacity``, ``ring_capacity``, ``history``, ``chain``,
            ``stamp_before_forward``, ...), checked here, in the caller's thread.
            ``device`` must be the engine's cache device if given.
            ``stamp_before_forward`` needs ``real_kv_mode=RealKvMode.NONE`` (the
            engine's K/V is fingerprinted otherwise, and a record stamped before
            the forward cannot hold it). In a sliding-window group, whose step
            writes over the oldest positions of its ring, ``verify_after`` checks
            the window the step leaves.

    Yields:
        :class:`Watch`: ``.poll()``, ``.violations``, ``.stats()``, ``.monitor``,
        ``.monitors``.

    Engines whose manager was created before the block (a cached persistent
    manager) are refused: their cache holds KV the canary never saw. Asynchronous
    batching and tensor parallelism are refused too.

    Example (``model``: any small causal LM, e.g. a random ``LlamaForCausalLM``)::

        from kvcanary_cupy.integrations.transformers import watch

        with watch(model, policy="cancel") as w:
            out = model.generate_batch(prompts, generation_config=gen_config)
        print(w.stats()["steps"], w.violations)
    """
    check_version()
    opts = WatchOptions.parse(options)
    if not callable(getattr(model, "init_continuous_batching", None)):
        raise TypeError(f"kvcanary: model: expected a transformers model with continuous batching "
                        f"(init_continuous_batching), got {type(model).__name__}")
    if opts.device is not None and getattr(model, "device", None) is not None:
        # The engine builds its cache on the model's device: a mismatch is known now, not in its thread.
        cache = device_name(model.device)
        if not same_device(opts.device, cache):
            raise ValueError(f"kvcanary: device: the engine's cache lives on {cache} (the model's device), got "
                             f"device={opts.device!r}; leave it out to watch the cache where it is")
    w = Watch(model, opts)
    w.open()
    try:
        yield w
    except BaseException:
        w.close()
        raise
    w.close()
    w.raise_pending()


class Watch:
    """What :func:`watch` yields: the violations found so far, stats and the monitors.

    Attributes:
        violations: every :class:`EngineViolation` found so far (a copy).
        monitor: the :class:`~kvcanary_cupy.KvCanary` of layer group 0 of the engine
            attached now (the only group of an all-full-attention model); None before an
            engine starts and after it stopped and was let go (its cache freed).
        monitors: ``{group index: KvCanary}`` of the engine attached now.
    """

    def __init__(self, model, options: WatchOptions):
        self.model = model
        self.options = options
        self.lock = threading.RLock()
        self._hooks = Hooks()
        self._managers: dict = {}  # id(manager) -> manager
        self._engines: list = []  # live EngineCanary s
        self._latest = None
        self._found: list = []
        self._policy = IncidentPolicy(options.policy)  # the policy, each incident once
        self._unpolled = 0
        self._retired: list = []  # stats of engines let go
        self._error = None
        self._error_seen = False
        self._errors: list = []

    # ------------------------------------------------------------------ public
    @property
    def violations(self) -> list:
        with self.lock:
            return list(self._found)

    @property
    def monitors(self) -> dict:
        eng = self._latest
        return {} if eng is None or not eng.groups else {g.index: g.monitor for g in eng.groups}

    @property
    def monitor(self):
        return self.monitors.get(0)

    def poll(self) -> list:
        """The violations found since the previous ``poll()``. Under ``policy="raise"`` a
        violation found since raises :class:`~kvcanary_cupy.KvCanaryError` (once)."""
        with self.lock:
            new = self._found[self._unpolled:]
            self._unpolled = len(self._found)
            err = self._take_error()
        if err is not None:
            raise err
        return new

    def stats(self) -> dict:
        """Counters over every engine watched so far (synchronizes on CUDA).

        Returns a dict: ``violations`` (found), ``steps``, ``cancelled`` (requests the
        cancel policy failed), ``cancel_too_late`` (violations of requests already
        finished), ``outputs_dropped`` (outputs of cancelled requests the engine still
        produced), ``offloaded_requests`` / ``restored_requests`` (whose records moved to
        the host and back), ``forked_blocks``, ``swept_records``, ``updates_skipped`` (table
        changes and slot copies a device launch could not apply, their index outside the
        array: 0 unless the adapter has a bug), ``host_seconds`` (the
        watch's own host time inside the engine's steps) and ``host_us_per_step``; the
        monitors' counters summed over engines and layer groups (``slots_checked``,
        ``slots_written``, ``kernel_runs``, ``logged``, ``dropped``, ``overflows``,
        ``input_errors``, ...); and ``engines``: one dict per engine cache watched, in
        order, with its own counters, ``rehomed`` (its cache tensors were moved to give
        the fingerprints the slot shift), ``fingerprints`` (whether real K/V is
        fingerprinted), ``max_len`` and, per layer group index, ``groups[g]``: the
        group's ``type``, ``layers`` and its monitor's :meth:`~kvcanary_cupy.KvCanary.stats`.
        """
        with self.lock:
            per = self._retired + [e.stats() for e in self._engines if e.groups]
            out = {"violations": len(self._found)}
            for k in _SUMMED:
                out[k] = sum(p[k] for p in per)
            for k in _MONITOR_SUMMED:
                out[k] = sum(g.get(k, 0) for p in per for g in p["groups"].values())
            out["host_us_per_step"] = 1e6 * out["host_seconds"] / out["steps"] if out["steps"] else 0.0
            out["engines"] = per
            return out

    # ------------------------------------------------------------------ reports
    def report(self, engine, found: list) -> None:
        """Apply the policy to the incidents an engine's step opened (in the engine's thread): a
        damaged slot is found again at every step that reads it, and the policy sees the rows of
        one request, group, slot and reasons once (rows no request claims, every time)."""
        with self.lock:
            self._found.extend(found)
            new = self._policy.new(found)
        try:
            self._policy.apply(new, cancel=engine.cancel)
        except KvCanaryError as err:
            with self.lock:
                if self._error is None:
                    self._error = err
            raise

    def record_error(self, e: BaseException) -> None:
        """An error in a hook (it is raised in the engine, which fails its requests): raised again on exit."""
        with self.lock:
            if e is not self._error and not isinstance(e, KvCanaryError):
                self._errors.append(e)

    def _take_error(self):
        if self._error is not None and not self._error_seen:
            self._error_seen = True
            return self._error
        return None

    def raise_pending(self) -> None:
        """On a clean exit: raise what the engine thread could not raise in the caller's thread."""
        with self.lock:
            if self._errors:
                raise self._errors[0]
            err = self._take_error()
        if err is not None:
            raise err

    # ------------------------------------------------------------------ attach
    def open(self) -> None:
        if getattr(self.model, "_kvcanary_watch", None) is not None:
            raise ValueError("kvcanary: model: already watched; nest no second watch() on the same model")
        self.model._kvcanary_watch = self
        self._hooks.wrap(self.model, "init_continuous_batching", self._init_hook)

    def close(self) -> None:
        """Take every wrapper off; engines still running go on unwatched (warned)."""
        with self.lock:
            running = [m for m in self._managers.values() if m.is_running()]
            for eng in list(self._engines):
                self._retire(eng)
            self._hooks.remove_all()
            self._managers.clear()
        try:
            del self.model._kvcanary_watch
        except AttributeError:
            pass
        if running:
            warnings.warn(f"kvcanary: watch() exited while {len(running)} continuous-batching manager(s) it watched "
                          "still run; they go on unwatched (stop them inside the block)", KvCanaryWarning,
                          stacklevel=3)

    def _init_hook(self, orig):
        def init_continuous_batching(*args, **kwargs):
            cached = getattr(self.model, "_cached_continuous_batching_manager", None)
            if cached is not None and id(cached) not in self._managers:
                raise ValueError("kvcanary: model: its cached continuous-batching manager was created before watch(), "
                                 "so its cache holds KV the canary never saw; call "
                                 "model.destroy_cached_continuous_batching_manager() before watching")
            manager = orig(*args, **kwargs)
            if id(manager) not in self._managers:
                hints = kwargs.get("workload_hints", args[2] if len(args) > 2 else None)
                try:
                    self._adopt(manager, hints)
                except ValueError:
                    _discard(manager)
                    raise
            return manager
        return init_continuous_batching

    def _adopt(self, manager, hints) -> None:
        """Watch a new manager: attach when it builds its cache, collect and let go when it stops."""
        cfg = manager.continuous_batching_config
        if cfg.use_async_batching:
            raise ValueError("kvcanary: continuous_batching_config: asynchronous batching is not supported by "
                             "watch(); pass ContinuousBatchingConfig(use_async_batching=False)")
        if getattr(manager.distributed_helper, "tp_size", 1) > 1:
            raise ValueError("kvcanary: model: tensor-parallel continuous batching is not supported by watch()")
        if manager.batch_processor is not None:
            raise ValueError("kvcanary: model: the continuous-batching manager already built its cache before "
                             "watch(); create it inside the block")
        max_len = None
        if hints is not None and getattr(hints, "max_generated_length", 0) > 0:
            max_len = int(hints.max_prompt_length) + int(hints.max_generated_length) + 1
        self._managers[id(manager)] = manager
        self._hooks.wrap(manager, "_create_batch_processor", lambda orig: self._create_hook(orig, manager, max_len))
        self._hooks.wrap(manager, "stop", lambda orig: self._stop_hook(orig, manager))

    def _create_hook(self, orig, manager, max_len):
        def _create_batch_processor():
            bp = orig()
            try:
                with self.lock:
                    eng = next((e for e in self._engines if e.bp is bp), None)
                    if eng is None:
                        eng = EngineCanary(watch=self, manager=manager, processor=bp, options=self.options,
                                           max_len_hint=max_len)
                        eng.install()
                        self._engines.append(eng)
                    else:
                        eng.reset()
                    self._latest = eng
            except BaseException as e:
                self.record_error(e)
                raise
            return bp
        return _create_batch_processor

    def _stop_hook(self, orig, manager):
        def stop(*args, **kwargs):
            out = orig(*args, **kwargs)
            with self.lock:
                if manager.is_running():
                    return out
                for eng in [e for e in self._engines if e.manager is manager]:
                    try:
                        eng.flush()
                    except KvCanaryError:
                        pass  # kept for poll() and the block's exit
                    if manager.batch_processor is not eng.bp:  # the engine dropped its cache
                        self._retire(eng)
            return out
        return stop

    def _retire(self, eng) -> None:
        self._retired.append(eng.retire())
        self._engines.remove(eng)


def _discard(manager) -> None:
    """Undo what building a refused manager did: it switched the model to a paged attention
    implementation, which only its ``stop()`` of a started run switches back."""
    original = getattr(manager, "_original_attn_impl", None)
    if original is not None:
        manager.model.set_attn_implementation(original)
        manager._original_attn_impl = None
    manager.destroy()
