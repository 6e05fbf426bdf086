"""Scalar arguments: sizes, switches and tags, taken exactly or refused.

``int()`` would turn ``2.9`` into 2 and ``"lots"`` into a bare ValueError, and
``bool()`` would take ``"no"`` for True; every scalar a caller passes goes
through one of these instead.
"""
from __future__ import annotations

import numpy as np

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_int(x, name: str, *, minimum: int | None = None, maximum: int = _INT64_MAX) -> int:
    """A size, count or offset: a Python or NumPy integer (never a float, a bool or a
    string, which ``int()`` would silently truncate or parse) in ``[minimum, maximum]``."""
    if not _is_int(x):
        raise TypeError(f"kvcanary: {name}: expected an integer, got {type(x).__name__} {x!r}")
    v = int(x)
    if (minimum is not None and v < minimum) or v > maximum:
        lo = "" if minimum is None else f">= {minimum}"
        hi = "" if maximum == _INT64_MAX else f"<= {maximum}"
        raise ValueError(f"kvcanary: {name}: expected an integer {' and '.join(w for w in (lo, hi) if w)}, got {v}")
    return v


def bound_key(x):
    """A bound on a count (e.g. ``max_row_tokens``) as calls are kept by: a Python int >= 1
    rounded up to a power of two, which is still a bound and one of few values, so a cache
    of prepared calls keeps one call for many bounds; anything else as given (it is checked
    where it is used)."""
    if type(x) is int and 1 < x <= 1 << 62:  # above, the power of two would not fit an int64
        return 1 << (x - 1).bit_length()
    return x


def check_flag(x, name: str) -> bool:
    """A switch: ``True`` or ``False`` (a string such as ``'no'`` is truthy, so none is taken)."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"kvcanary: {name}: expected True or False, got {type(x).__name__} {x!r}")
    return bool(x)


def check_tag(x, name: str = "tag") -> int:
    """A launch tag: an integer (e.g. a :class:`~kvcanary_cupy.LaunchTag`) that fits the
    int64 column of a violation row."""
    if not _is_int(x):
        raise TypeError(f"kvcanary: {name}: expected an integer such as a LaunchTag, got {type(x).__name__} {x!r}")
    return check_int(x, name, minimum=_INT64_MIN)
