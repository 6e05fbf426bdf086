"""The options of :func:`watch`: the adapter's own and those it hands to every KvCanary.

Everything is checked when ``watch()`` is called, in the caller's thread: a
monitor is built later, inside the engine's generation thread, where an error
would only fail the requests.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import numpy as np

# KvCanary arguments the adapter derives from the engine itself.
OWNED = frozenset({"num_slots", "req_to_token", "block_table", "page_size", "max_batch", "real_kv", "swa",
                   "expected_tokens", "token_offset", "draft", "policy", "max_tokens", "process_group", "window",
                   "name"})
POLICIES = ("log", "raise", "cancel")


@dataclasses.dataclass(frozen=True)
class WatchOptions:
    """Parsed options.

    Attributes:
        policy: ``"log"``, ``"raise"``, ``"cancel"`` or a callable taking a list of
            :class:`~kvcanary_cupy.integrations.transformers.EngineViolation`.
        max_len: longest request (prompt plus generated tokens) the token-level
            tables cover; None: derived from the engine (see :func:`watch`).
        device: the device asked for (None: the engine's cache device).
        monitor: keyword arguments for every :class:`~kvcanary_cupy.KvCanary`.
    """

    policy: object = "log"
    max_len: int | None = None
    device: str | None = None
    monitor: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, options: dict) -> "WatchOptions":
        """Split and check ``watch(**options)``.

        Example::

            >>> o = WatchOptions.parse({"policy": "cancel", "verify_after": True})
            >>> o.policy, o.monitor
            ('cancel', {'verify_after': True})
            >>> WatchOptions.parse({"block_table": None})  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: kvcanary: block_table: watch() derives it from the engine; pass only policy, max_len and ...
        """
        from ...monitor import KvCanary  # noqa: PLC0415

        opts = dict(options)
        policy = check_policy(opts.pop("policy", "log"))
        max_len = opts.pop("max_len", None)
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer))
                                    or max_len < 1):
            raise ValueError(f"kvcanary: max_len: expected a positive int or None, got {max_len!r}")
        params = inspect.signature(KvCanary.__init__).parameters
        passthrough = sorted(p for p in params if p not in OWNED and p != "self")
        for name in opts:
            if name not in params or name in OWNED:
                why = "watch() derives it from the engine" if name in OWNED else "not an option"
                raise ValueError(f"kvcanary: {name}: {why}; pass only policy, max_len and KvCanary's options "
                                 f"({', '.join(passthrough)})")
        device = opts.pop("device", None)
        if device is not None and not isinstance(device, str):
            raise TypeError(f"kvcanary: device: expected a device string such as 'cpu' or 'cuda:0', got "
                            f"{type(device).__name__}")
        _try_monitor(opts)
        return cls(policy=policy, max_len=None if max_len is None else int(max_len), device=device, monitor=opts)


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


def _try_monitor(opts: dict) -> None:
    """Build tiny CPU monitors with ``opts``, configured as the engine's are (a full group's and
    a sliding group's, real K/V fingerprinted), so a bad value or combination fails now with
    KvCanary's own message rather than later, in the engine's generation thread."""
    from ...canary import RealKvSource  # noqa: PLC0415
    from ...monitor import KvCanary  # noqa: PLC0415

    kv = RealKvSource(np.zeros((8, 16), np.uint8), bytes_per_token=16)
    for table in (dict(block_table=np.zeros((2, 2), np.int32), page_size=4),
                  dict(req_to_token=np.zeros((2, 8), np.int32), window=3)):
        KvCanary(num_slots=8, max_batch=1, real_kv=kv, policy=lambda found: None, **table, **opts)
