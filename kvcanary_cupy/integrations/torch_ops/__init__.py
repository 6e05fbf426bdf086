"""The ops as ``torch.library`` custom ops, callable inside ``torch.compile(fullgraph=True)``.

Engines that compile their forward (vLLM does by default) cannot call :func:`kvcanary_cupy.plan`
and friends inside the compiled region: the library objects hold NumPy / CuPy views that
Dynamo does not trace, so the call breaks the graph. This package registers the ops under the
``kvcanary`` namespace of ``torch.ops``, each with a fake (meta) implementation, declared as
mutating exactly the buffers it writes and returning nothing:

- ``torch.ops.kvcanary.plan``: writes the verify and write plans;
- ``torch.ops.kvcanary.verify``: writes the violation log (and a fingerprint sampler's state);
- ``torch.ops.kvcanary.write``: writes the canary records and the violation log;
- ``torch.ops.kvcanary.plan_and_verify``: writes both plans and the log (and the sampler);
- ``torch.ops.kvcanary.plan_verify_write``: writes both plans, the canary records and the log.

Their arguments are tensors, lists of tensors, ints, bools and strings only: the library
objects are flattened into their tensors at the boundary. The friendly way in is one level
up: :func:`plan`, :func:`verify`, :func:`write`, :func:`plan_and_verify` and
:func:`plan_verify_write` here take the
keyword arguments of the library's ops, with the library objects replaced by their
``Torch*`` twins, frozen dataclasses that hold ``torch.Tensor`` s:

========================  ===========================================================
here                      library object it stands for (``.library``)
========================  ===========================================================
TorchCanaryBuffer         :class:`~kvcanary_cupy.CanaryBuffer`
TorchVerifyPlan           :class:`~kvcanary_cupy.VerifyPlan`
TorchWritePlan            :class:`~kvcanary_cupy.WritePlan`
TorchViolationLog         :class:`~kvcanary_cupy.ViolationLog` (``read``, ``poll``, ...)
TorchRealKvSource         :class:`~kvcanary_cupy.RealKvSource`
TorchFingerprintSampler   :class:`~kvcanary_cupy.FingerprintSampler`
TorchSwaWindow            :class:`~kvcanary_cupy.SwaWindow`
TorchExpectedTokens       :class:`~kvcanary_cupy.ExpectedTokens`
========================  ===========================================================

Each ``Torch*`` object builds its library object once, at construction, zero copy through
DLPack (so every check of the library's constructors runs there, with its ``kvcanary:``
errors), and keeps it. Build them outside the compiled region, like any long-lived buffer:
``.allocate(...)`` makes new tensors with torch's allocator, the constructor wraps tensors
the caller owns, ``.from_library(obj)`` wraps an existing library object (zero copy, the
same object underneath).

Inside an op, the library objects are found again by the identity of their tensors
(address, shape, strides, dtype, device), so a step pays neither a DLPack import nor a
validation per argument: per-step index tensors (``req_pool_indices``, ``input_ids``, ...)
are imported once per buffer and kept in a bounded cache, and the library's own launch
cache then runs the prepared launch. Cached views keep their tensors' memory alive, which
is what makes the identity safe; :func:`clear_cache` lets go of them, :func:`cache_info`
counts them.

Streams: on CUDA every op runs on PyTorch's current stream of the tensors' device (the
library's objects alone would default to CuPy's), so ``with torch.cuda.stream(s):`` and a
``torch.cuda.graph`` capture take the ops with the rest of the step.

The ops are defined with :class:`torch.library.Library` and an explicit schema, whose
``Tensor(a!)`` annotations are what ``torch.library.custom_op(mutates_args=...)`` writes:
measured on a CPU, a call through ``custom_op``'s Python wrappers costs about 60 us of host
time, one through the plain schema about 12 us, for the same semantics under
``torch.compile`` and ``torch.library.opcheck``.

Modules, one job each; a newcomer reads ``functions`` (what a call does), then ``twins``:

- ``functions``: :func:`plan`, :func:`verify`, ... : check the keyword arguments and
  flatten the twins into the op's arguments, then call ``torch.ops.kvcanary.<op>``.
- ``twins``: the ``Torch*`` twins, each pinning its library object in the cache.
- ``schemas``: each op's schema, :data:`SCHEMAS` (what it takes, what it writes).
- ``register``: defines the ops from the schemas, with their real and fake implementations.
- ``impls``: the real implementations: the op's arguments back to library objects, the
  library's op on PyTorch's current stream.
- ``fakes``: the fake (meta) implementation: the ops return nothing.
- ``objects``: per kind of library object, its cache key, its builder and its finder.
- ``views``: tensors as the library sees them (identity key, DLPack form, stream) and the
  caches of objects and per-step index views (:func:`cache_info`, :func:`clear_cache`).

Imports point one way: ``views`` <- ``objects`` <- ``impls`` / ``twins``; ``schemas``,
``impls``, ``fakes`` <- ``register``; ``twins``, ``register`` <- ``functions``. Importing
the package registers the ops (through ``functions``).

Example (CPU; the same code runs on CUDA tensors with ``device="cuda"``)::

    >>> import torch, kvcanary_cupy as kc
    >>> from kvcanary_cupy.integrations import torch_ops as kt
    >>> canary = kt.TorchCanaryBuffer.allocate(num_slots=64)
    >>> vplan = kt.TorchVerifyPlan.allocate(capacity=64, max_batch=2)
    >>> wplan = kt.TorchWritePlan.allocate(max_batch=2)
    >>> log = kt.TorchViolationLog.allocate(capacity=16)
    >>> table = torch.zeros(2, 16, dtype=torch.int32)
    >>> table[1, :6] = torch.tensor([9, 4, 17, 30, 2, 11])
    >>> @torch.compile(fullgraph=True)
    ... def step(rpi, prefix, extend, ids, pos, loc):
    ...     kt.plan_and_verify(vplan, wplan, canary, req_pool_indices=rpi, prefix_lens=prefix,
    ...                        extend_lens=extend, req_to_token=table, log=log, tag=kc.LaunchTag.VERIFY)
    ...     kt.write(canary, wplan, input_ids=ids, positions=pos, out_cache_loc=loc,
    ...              log=log, tag=kc.LaunchTag.WRITE)
    >>> one = torch.ones(1, dtype=torch.int64)
    >>> step(one, 0 * one, 4 * one, torch.arange(101, 105), torch.arange(4), table[1, :4].long())
    >>> step(one, 4 * one, one, torch.tensor([105]), torch.tensor([4]), table[1, 4:5].long())
    >>> log.count
    0
    >>> canary.records[17, 0] = 999  # a stray write changes slot 17's token
    >>> step(one, 5 * one, one, torch.tensor([106]), torch.tensor([5]), table[1, 5:6].long())
    >>> [(v.slot, v.reasons) for v in log.read()]  # the successor's chain no longer matches
    [(30, <FailReason.CHAIN: 1>)]
    >>> torch.compiler.reset()  # drop the compiled step (and what its guards hold)
"""

from .functions import plan, plan_and_verify, plan_verify_write, verify, write
from .schemas import SCHEMAS  # noqa: F401  (public, as before, outside __all__)
from .twins import (
    TorchCanaryBuffer,
    TorchExpectedTokens,
    TorchFingerprintSampler,
    TorchRealKvSource,
    TorchSwaWindow,
    TorchVerifyPlan,
    TorchViolationLog,
    TorchWritePlan,
)
from .views import cache_info, clear_cache

__all__ = [
    "TorchCanaryBuffer", "TorchExpectedTokens", "TorchFingerprintSampler", "TorchRealKvSource", "TorchSwaWindow",
    "TorchVerifyPlan", "TorchViolationLog", "TorchWritePlan", "cache_info", "clear_cache", "plan",
    "plan_and_verify", "plan_verify_write", "verify", "write",
]

