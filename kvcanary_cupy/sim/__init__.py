"""A small paged-KV engine simulator with fault injectors, for the selftest and the tests.

``PagedKvSim`` runs admission with prefix-cache hits, chunked prefill, decode, a
sliding-window pool, a draft pool and eviction, with a :class:`~kvcanary_cupy.KvCanary`
on all of it; :mod:`.faults` breaks it in the ways real engines break.
"""
from .config import SimConfig
from .engine import PagedKvSim, Request, StepRecord
from .faults import FAULTS, Fault

__all__ = ["FAULTS", "Fault", "PagedKvSim", "Request", "SimConfig", "StepRecord"]
