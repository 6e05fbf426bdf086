"""kvcanary_cupy: a KV-cache integrity monitor for LLM inference engines.

A 32-byte canary record per KV slot; ``write`` stamps the records of the tokens a
step writes, ``verify`` checks every record a step reads against the engine's own
tables, and violations land in a device-side ring read without stalling.
Records travel with KV that moves (``export_records`` / ``import_records``), and
tensor-parallel ranks agree every step (``KvCanary(process_group=...)``,
:mod:`kvcanary_cupy.distributed`, over torch.distributed).

``import kvcanary_cupy`` imports neither CuPy, PyTorch nor JAX.
"""
from .arrays import as_view
from .backends import cpu_backend, use_cpu_backend
from .canary import CanaryBuffer, RealKvSource
from .digest import Digest, DigestRow, RankCompare
from .format import (ANCHOR, ANCHOR_HASH, P61, SCAN_ANCHOR, SCAN_MUL, SEED_SKIP, FailReason, LaunchTag, RealKvMode,
                     chain_links, make_records, mix3, next_link, scan_term, splitmix64)
from .ops import (PreparedOp, Recording, plan, plan_and_verify, plan_verify_write, prepare, scatter_expected_tokens,
                  verify, write)
from .plans import ExpectedTokens, FingerprintSampler, SwaWindow, VerifyPlan, WritePlan
from .transfer import export_records, import_records
from .violations import Violation, ViolationLog

__version__ = "0.1.0"

__all__ = [
    "ANCHOR", "ANCHOR_HASH", "P61", "SCAN_ANCHOR", "SCAN_MUL", "SEED_SKIP", "CanaryBuffer", "Digest", "DigestRow", "ExpectedTokens", "FailReason",
    "FingerprintSampler", "LaunchTag", "PreparedOp", "RankCompare", "Recording", "RealKvMode", "RealKvSource", "SwaWindow", "VerifyPlan",
    "Violation", "ViolationLog", "WritePlan", "as_view", "chain_links", "cpu_backend", "export_records", "import_records",
    "make_records", "mix3", "next_link", "plan", "plan_and_verify", "plan_verify_write", "prepare", "scan_term", "scatter_expected_tokens",
    "splitmix64", "use_cpu_backend", "verify", "write",
    # the monitor, loaded on first use (see __getattr__)
    "KvCanary", "KvCanaryError", "KvCanaryWarning", "SwaGroup", "SweepChain",
]


# The monitor package (kvcanary_cupy.monitor) pulls in more: load it on first use of one of these.
_MONITOR_NAMES = ("KvCanary", "KvCanaryError", "KvCanaryWarning", "SwaGroup", "SweepChain")


def __getattr__(name):
    if name in _MONITOR_NAMES:
        from . import monitor  # noqa: PLC0415

        return getattr(monitor, name)
    raise AttributeError(f"module 'kvcanary_cupy' has no attribute {name!r}")
