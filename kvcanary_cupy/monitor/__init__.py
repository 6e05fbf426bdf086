"""KvCanary: the per-step orchestration an engine integrates.

One monitor watches one KV pool (plus, optionally, its sliding-window pool). The
engine calls :meth:`KvCanary.before_forward` once its batch is planned, lets the
model write its K/V, calls :meth:`KvCanary.after_forward`, and now and then
:meth:`KvCanary.poll` to collect what the checks found, without stalling the
stream. Everything per step runs on the device; the host reads results one step
late through pinned copies.

Modules, one job each:

- ``canary_monitor``: :class:`KvCanary`, the orchestration of a step.
- ``options``: the constructor's options, checked and normalized.
- ``parts``: the parts a monitor is built of, from its options.
- ``threads``: one thread at a time (the guard of every call).
- ``group``: one watched pool (canary, plans, device scalars, capacity rule) and :class:`SwaGroup`.
- ``inputs``: bound per-step buffers, per-call imports and the stream a call runs on.
- ``steps``: a step's op arguments, laid out and prepared once per shape of step (bound buffers).
- ``requests``: which request a violation row belongs to.
- ``swa``: SWA-pool slots of a step's tokens, through the LUT.
- ``lifetime``: keeping arrays alive until the device is done with them.
- ``policy``: :class:`KvCanaryError`, :class:`KvCanaryWarning`, the violation policy, warnings, stats.
- ``plan_counters``: what a poll does with the plans' counters (warnings, growing an overflowed plan).
- ``sweep``: :class:`SweepChain` and the planner of idle-chain sweeps.
"""
from .canary_monitor import KvCanary
from .group import SwaGroup
from .policy import KvCanaryError, KvCanaryWarning
from .sweep import SweepChain

__all__ = ["KvCanary", "KvCanaryError", "KvCanaryWarning", "SwaGroup", "SweepChain"]
