"""A step's op arguments, prepared once per shape of step.

An engine that binds its per-step buffers calls ``before_forward(batch_size=bs)`` and
``after_forward(num_tokens=n)`` with the same few sizes over and over. Everything a step
hands the ops (the views of the bound buffers, the slot table, each group's plans,
sources, tags) is then the same objects every time: it is validated and laid out once,
in a :class:`BeforeStep` / :class:`AfterStep`, and a later step of the same shape only
looks it up. Its op calls are then the same calls every time too: the first one records
them (:class:`~kvcanary_cupy.ops.Recording`), later ones launch what it recorded. The
monitor drops every prepared step when what they hold changes (``bind_inputs``,
``rebind``); the one thing that changes under them, a verify plan that grows, is read from
its group at each call, and a recording made with another plan is made again.
"""
from __future__ import annotations


class BeforeStep:
    """What :meth:`KvCanary.before_forward` hands the ops for one shape of step.

    Attributes:
        bs: batch rows.
        objs: the caller's own arrays (they may name the default stream).
        valid_lens: ``(valid lengths, None, out)`` to copy, ``(prefix_lens, extend_lens, out)``
            to add, or None: how the monitor's valid-length buffer (``out``, its first ``bs``
            rows) is filled for the expected-token table.
        check_tokens: whether the step's verify checks tokens.
        groups: per group ``(group, plan args, verify args, fused)``: the keyword arguments of
            :func:`~kvcanary_cupy.plan` and :func:`~kvcanary_cupy.verify` but the plans, the
            canary and the stream, and those of :func:`~kvcanary_cupy.plan_and_verify` as a
            tuple in the order the monitor passes them (req_pool_indices, prefix_lens,
            extend_lens, req_to_token, block_table, page_size, swa, expected, log, tag,
            real_kv, real_kv_mode, check_tokens, sample).
        launches: None unless the step is kept in a :class:`StepCache` (its arrays are the bound
            buffers); then a :class:`StepCache` of what it recorded, per stamp (the
            :class:`AfterStep` a monitor that stamps before the forward writes with, else None):
            ``(plans, launches)``, each group with its verify plan when it was recorded, and the
            step's :class:`~kvcanary_cupy.ops.PreparedOp` s.
    """

    __slots__ = ("bs", "objs", "valid_lens", "check_tokens", "groups", "launches")

    def __init__(self, *, bs: int, objs: tuple, valid_lens, check_tokens: bool, groups: tuple):
        self.bs, self.objs, self.valid_lens, self.check_tokens, self.groups = bs, objs, valid_lens, check_tokens, groups
        self.launches: StepCache | None = None


class AfterStep:
    """What :meth:`KvCanary.after_forward` hands the ops for one shape of step.

    Attributes:
        objs: the caller's own arrays (they may name the default stream); ``given``: whether
            any is not None.
        ids, pos, loc: the step's token ids, positions and full-pool slots.
        translate: whether the SWA group's slots are ``loc`` through the LUT (computed each step).
        groups: per group ``(group, out_cache_loc or None (translate), (log, tag, real_kv,
            real_kv_mode, expected_inputs))``: the rest of :func:`~kvcanary_cupy.write`'s
            keyword arguments.
        tokens: the shortest of the token inputs (what a write may read).
        kept: whether it is kept in a :class:`StepCache` (its arrays are the bound buffers).
        launches: once a kept step recorded them, its writes' :class:`~kvcanary_cupy.ops.PreparedOp` s.
    """

    __slots__ = ("objs", "given", "ids", "pos", "loc", "translate", "groups", "tokens", "kept", "launches")

    def __init__(self, *, objs: tuple, ids, pos, loc, translate: bool, groups: tuple, tokens: int):
        self.objs, self.given = objs, any(o is not None for o in objs)
        self.ids, self.pos, self.loc, self.translate, self.groups = ids, pos, loc, translate, groups
        self.tokens = tokens
        self.kept = False
        self.launches = None


class StepCache(dict):
    """Prepared steps by shape key, the most recent ``capacity`` of them (a dict: a step's
    lookup is one ``get``, no Python frame).

    A key holds the objects it names (e.g. a per-step :class:`ExpectedTokens`), so their
    ids cannot be reused while the entry exists.

    Example::

        >>> c = StepCache(capacity=2)
        >>> c.put(1, "a"); c.put(2, "b"); c.put(3, "c")
        >>> c.get(1), c.get(3)
        (None, 'c')
    """

    def __init__(self, capacity: int = 32):
        super().__init__()
        self.capacity = capacity

    def put(self, key, step) -> None:
        """Keep ``step`` under ``key``, dropping the oldest entry when full."""
        if len(self) >= self.capacity:
            del self[next(iter(self))]
        self[key] = step
