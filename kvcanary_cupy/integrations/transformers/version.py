"""Which transformers versions the adapter attaches to.

The adapter reads the continuous-batching engine's internals (its cache
allocators' block tables, the batch processor's per-step buffers, the
offloading manager's swap pool), which change between releases without notice.
It therefore attaches only to the versions it was tested with, pinned by the
``[transformers]`` extra, and refuses every other one.
"""
from __future__ import annotations

SUPPORTED_VERSIONS = ("5.17.0",)


def installed_version() -> str | None:
    """The installed transformers version, or None when it is not installed (never imports it)."""
    from importlib import metadata  # noqa: PLC0415

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def check_version(version: str | None = None) -> str:
    """``version`` (default: the installed one) if the adapter supports it, else a ``kvcanary:`` error.

    Example::

        >>> check_version("5.17.0")
        '5.17.0'
        >>> check_version("5.18.0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: kvcanary: transformers: this adapter supports transformers 5.17.0 only, got 5.18.0; ...
    """
    v = installed_version() if version is None else str(version)
    if v is None:
        raise ImportError("kvcanary: transformers: not installed; install the supported version with "
                          "pip install 'kvcanary_cupy[transformers]'")
    if v not in SUPPORTED_VERSIONS:
        raise ValueError(f"kvcanary: transformers: this adapter supports transformers {', '.join(SUPPORTED_VERSIONS)} "
                         f"only, got {v}; install the pinned version with pip install 'kvcanary_cupy[transformers]'")
    return v
