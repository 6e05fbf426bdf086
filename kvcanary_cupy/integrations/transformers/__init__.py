"""A KvCanary inside Hugging Face transformers' continuous batching (transformers 5.17.0).

``watch(model, **options)`` is a context manager: every continuous-batching
engine the model runs inside it (``model.generate_batch(...)``, managers from
``model.init_continuous_batching()``) is watched, step by step, without editing
transformers (methods are wrapped on the engine's instances) and without changing
what the model generates. See :func:`watch`.

Modules, one job each (transformers and torch are imported only when a watch starts):

- ``watch``: :func:`watch` and the :class:`Watch` it yields; adopting managers.
- ``engine``: :class:`EngineCanary`, the monitors of one engine cache and the hooks that run them.
- ``groups``: a layer group, its request table and its monitor.
- ``slots``: engine rows and canary slots; real-KV sources over the engine's cache.
- ``moves``: records that move with offloaded, restored and forked blocks.
- ``options``: the options of :func:`watch`, checked up front.
- ``hooks``: wrapping instance methods and taking the wrappers off.
- ``version``: the supported transformers versions.

What it shares with the other engine adapters (request rows and host-mirrored tables,
staging to the device, violations in the engine's terms, the policies, option checks)
lives in :mod:`kvcanary_cupy.integrations.engine`.
"""
from .engine import EngineCanary
from .options import WatchOptions
from .version import SUPPORTED_VERSIONS, check_version
from ..engine.violations import EngineViolation, RequestTag
from .watch import Watch, watch

__all__ = ["SUPPORTED_VERSIONS", "EngineCanary", "EngineViolation", "RequestTag", "Watch", "WatchOptions",
           "check_version", "watch"]
