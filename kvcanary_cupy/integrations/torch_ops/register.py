"""The registration of the ops under the ``kvcanary`` namespace of ``torch.ops``.

Each op is defined from its schema (:mod:`.schemas`), implemented for every device by
its ``_*_impl`` (:mod:`.impls`; the library dispatches on the arrays) and given its fake
implementation (:mod:`.fakes`). Importing this module registers them, once: the package
``__init__`` does.
"""
from __future__ import annotations

import torch

from .fakes import _no_result
from .impls import _plan_and_verify_impl, _plan_impl, _plan_verify_write_impl, _verify_impl, _write_impl
from .schemas import SCHEMAS

# The ops live as long as this object (this module). A fragment: other modules may add ops
# to the namespace.
_LIB = torch.library.Library("kvcanary", "FRAGMENT")

for _name, _impl in (("plan", _plan_impl), ("verify", _verify_impl), ("write", _write_impl),
                     ("plan_and_verify", _plan_and_verify_impl), ("plan_verify_write", _plan_verify_write_impl)):
    _LIB.define(SCHEMAS[_name])
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")  # every device: the library dispatches on it
    torch.library.register_fake(f"kvcanary::{_name}", _no_result, lib=_LIB)
