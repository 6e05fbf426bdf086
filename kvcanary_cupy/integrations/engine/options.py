"""Options an engine adapter takes: its policy, and the KvCanary options it hands to every monitor.

Everything is checked when the adapter is configured, in the caller's thread: a
monitor is built later, inside the engine (its generation thread, its worker),
where an error would only fail requests.
"""
from __future__ import annotations

import inspect
from typing import Callable

import numpy as np

# KvCanary arguments an adapter derives from the engine itself.
OWNED = frozenset({"num_slots", "req_to_token", "block_table", "page_size", "max_batch", "real_kv", "swa",
                   "expected_tokens", "token_offset", "draft", "policy", "max_tokens", "process_group", "window",
                   "name"})
POLICIES = ("log", "raise", "cancel")


def check_policy(policy) -> str | Callable:
    """``"log"``, ``"raise"``, ``"cancel"`` or a callable, else a ``kvcanary:`` error.

    Example::

        >>> check_policy("cancel")
        'cancel'
    """
    if callable(policy) or (isinstance(policy, str) and policy in POLICIES):
        return policy
    raise ValueError(f"kvcanary: policy: expected 'log', 'raise', 'cancel' or a callable taking the list of "
                     f"violations, got {policy!r}")


def monitor_passthrough(owned=OWNED) -> list[str]:
    """The KvCanary options an adapter passes through (every one it does not derive), sorted."""
    from ...monitor import KvCanary  # noqa: PLC0415

    params = inspect.signature(KvCanary.__init__).parameters
    return sorted(p for p in params if p not in owned and p != "self")


def check_monitor_options(opts: dict, *, adapter: str, own: str, owned=OWNED) -> None:
    """Refuse any key of ``opts`` that is not a KvCanary option or that the adapter derives.

    ``adapter`` names the entry point in messages (``"watch()"``), ``own`` lists the
    adapter's own options (``"policy, max_len"``).

    Example::

        >>> check_monitor_options({"verify_after": True}, adapter="watch()", own="policy")
        >>> check_monitor_options({"block_table": 1}, adapter="watch()", own="policy")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: kvcanary: block_table: watch() derives it from the engine; pass only policy and KvCanary's ...
    """
    passthrough = monitor_passthrough(owned)
    for name in opts:
        if name not in passthrough:
            why = f"{adapter} derives it from the engine" if name in owned else "not an option"
            raise ValueError(f"kvcanary: {name}: {why}; pass only {own} and KvCanary's options "
                             f"({', '.join(passthrough)})")


def check_positive_int(value, name: str, *, allow_none: bool = True):
    """``value`` as an int >= 1 (or None where allowed), else a ``kvcanary:`` error naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"kvcanary: {name}: expected a positive int{' or None' if allow_none else ''}, "
                         f"got {value!r}")
    return int(value)


def try_monitor(opts: dict, tables=None) -> None:
    """Build tiny CPU monitors with ``opts``, configured as the engine's are (real K/V
    fingerprinted; by default a page-table pool and a sliding token-table pool), so a bad
    value or combination fails now with KvCanary's own message rather than inside the engine.

    ``tables``: the slot-table keyword sets to try (default: both kinds the adapters use).
    """
    from ...canary import RealKvSource  # noqa: PLC0415
    from ...monitor import KvCanary  # noqa: PLC0415

    kv = RealKvSource(np.zeros((8, 16), np.uint8), bytes_per_token=16)
    if tables is None:
        tables = (dict(block_table=np.zeros((2, 2), np.int32), page_size=4),
                  dict(req_to_token=np.zeros((2, 8), np.int32), window=3))
    for table in tables:
        KvCanary(num_slots=8, max_batch=1, real_kv=kv, policy=lambda found: None, **table, **opts)
