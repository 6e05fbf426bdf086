"""The ops' fake (meta) implementation, what ``torch.compile`` and ``opcheck`` trace.

Every op only writes into buffers it is given (``Tensor(x!)`` in :mod:`.schemas`) and
returns nothing, so on fake tensors there is nothing to allocate nor compute: one
implementation serves all five, registered by :mod:`.register`.
"""
from __future__ import annotations


def _no_result(*args, **kwargs) -> None:
    """The fake (meta) implementation: the ops only write into their arguments."""
