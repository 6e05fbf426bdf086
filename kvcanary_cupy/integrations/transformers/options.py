"""The options of :func:`watch`: the adapter's own and those it hands to every KvCanary.

Everything is checked when ``watch()`` is called, in the caller's thread: a
monitor is built later, inside the engine's generation thread, where an error
would only fail the requests.
"""
from __future__ import annotations

import dataclasses

from ..engine.options import OWNED, POLICIES, check_monitor_options, check_policy, check_positive_int, try_monitor

__all__ = ["OWNED", "POLICIES", "WatchOptions", "check_policy"]


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
        opts = dict(options)
        policy = check_policy(opts.pop("policy", "log"))
        max_len = check_positive_int(opts.pop("max_len", None), "max_len")
        check_monitor_options(opts, adapter="watch()", own="policy, max_len")
        device = opts.pop("device", None)
        if device is not None and not isinstance(device, str):
            raise TypeError(f"kvcanary: device: expected a device string such as 'cpu' or 'cuda:0', got "
                            f"{type(device).__name__}")
        try_monitor(opts)
        return cls(policy=policy, max_len=max_len, device=device, monitor=opts)
