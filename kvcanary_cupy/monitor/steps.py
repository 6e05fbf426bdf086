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

:class:`StepLayout` lays the steps out and keeps them: it holds what every step reads
(the slot table, the expected-token table and its valid lengths, the groups, the log).
"""
from __future__ import annotations

import numpy as np

from .. import runtime, scalars
from ..plans import ExpectedTokens
from .options import check_like


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

    def recorded(self, stamp):
        """The launches recorded for ``stamp`` (see ``launches``), None when there are none or
        a group's verify plan is no longer the one they were recorded with (it grew)."""
        recorded = self.launches.get(stamp)
        if recorded is None:
            return None
        for g, vp in recorded[0]:
            if g.vp is not vp:  # grown since: record the step again
                return None
        return recorded[1]

    def record(self, stamp, groups, launches) -> None:
        """Keep the ``launches`` recorded for ``stamp``, with each of ``groups``' verify plan."""
        self.launches.put(stamp, (tuple((g, g.vp) for g in groups), tuple(launches)))


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
        max_row_tokens: the caller's bound on a row's tokens, or None (see
            :func:`~kvcanary_cupy.write`).
        kept: whether it is kept in a :class:`StepCache` (its arrays are the bound buffers).
        launches: once a kept step recorded them, its writes' :class:`~kvcanary_cupy.ops.PreparedOp` s.
    """

    __slots__ = ("objs", "given", "ids", "pos", "loc", "translate", "groups", "tokens", "max_row_tokens", "kept",
                 "launches")

    def __init__(self, *, objs: tuple, ids, pos, loc, translate: bool, groups: tuple, tokens: int,
                 max_row_tokens: int | None):
        self.objs, self.given = objs, any(o is not None for o in objs)
        self.ids, self.pos, self.loc, self.translate, self.groups = ids, pos, loc, translate, groups
        self.tokens, self.max_row_tokens = tokens, max_row_tokens
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


class StepLayout:
    """A monitor's steps laid out: a step's arrays (or the bound buffers where None) imported,
    checked and turned into the ops' arguments, those of the bound buffers kept per shape.

    Args:
        inputs: the monitor's :class:`~kvcanary_cupy.monitor.inputs.StepInputs`.
        groups: the monitor's groups, the full pool's first; ``swa``: the SWA group or None.
        log: the monitor's violation log.
        max_batch: the most batch rows a step may have.
        table_kw, table, page_size: the slot table (``"req_to_token"`` or ``"block_table"``).
        expected_table: the expected-token table, or None (no token check).
        token_offset: see :class:`KvCanary`.
        valid_lens: int64 ``[max_batch]``, the expected-token table's valid lengths of a step.
        window_rows: whether the main group plans the window a step leaves (``verify_after``
            with a ``window``): then two int64 ``[max_batch]`` buffers of its rows.

    :meth:`rebind` replaces :attr:`table` and :attr:`expected_table`.
    """

    def __init__(self, *, inputs, groups, swa, log, max_batch: int, device: str, table_kw: str, table,
                 page_size: int, expected_table, token_offset: int, valid_lens, window_rows: bool):
        self._inputs, self.groups, self.swa, self.log = inputs, groups, swa, log
        self.max_batch, self.device = max_batch, device
        self.xp = runtime.array_module(device)
        self.table_kw, self.table, self.page_size = table_kw, table, page_size
        self.token_offset = token_offset
        self.valid_lens = valid_lens
        self.expected_table = self.expected = None
        if expected_table is not None:
            self.expect(expected_table)
        self._before_steps = StepCache()
        self._after_steps = StepCache()
        self._expected_with_bound = None  # the expected-token table with the bound valid lengths
        # The window a step leaves, planned after its write (verify_after with a window).
        self._window_rows = None if not window_rows else (
            runtime.empty((max_batch,), np.int64, device, fill=0),
            runtime.empty((max_batch,), np.int64, device, fill=0))
        self._window_views: dict = {}  # batch size -> views of _window_rows

    def expect(self, expected_table) -> None:
        """Check tokens against ``expected_table`` (bound once, read in place)."""
        self.expected_table = expected_table
        self.expected = ExpectedTokens(expected_table, self.valid_lens, self.token_offset)

    def forget(self) -> None:
        """Drop the prepared steps (what they hold was replaced)."""
        self._before_steps.clear()
        self._after_steps.clear()
        self._expected_with_bound = None

    def rebind(self, *, req_to_token, block_table, expected_tokens) -> None:
        """Drop the prepared steps and read the given tables from now on (None: keep that one):
        the slot table of the kind bound, the expected-token table; each must have the shape
        of the one it replaces."""
        self.forget()  # prepared steps hold the old table, LUT and sources
        kw = self.table_kw
        other = "block_table" if kw == "req_to_token" else "req_to_token"
        if (req_to_token if other == "req_to_token" else block_table) is not None:
            raise ValueError(f"kvcanary: {other}: this monitor was bound to a {kw}; rebind that instead")
        table = req_to_token if kw == "req_to_token" else block_table
        if table is not None:
            self.table = check_like(table, kw, self.table, self.device)
        if expected_tokens is not None:
            if self.expected_table is None:
                raise ValueError("kvcanary: expected_tokens: no expected-token table was bound at construction")
            self.expect(check_like(expected_tokens, "expected_tokens", self.expected_table, self.device))

    def before(self, req_pool_indices, prefix_lens, extend_lens, batch_size, expected_valid_lens,
               expected) -> BeforeStep:
        """A step's plan and verify arguments: prepared once per ``batch_size`` (and per-step
        ``expected``) for bound buffers."""
        if (req_pool_indices is None and prefix_lens is None and extend_lens is None and expected_valid_lens is None
                and (batch_size is None or type(batch_size) is int)
                and (expected is None or type(expected) is ExpectedTokens)):
            key = (batch_size, expected)
            step = self._before_steps.get(key)
            if step is None:
                step = self._before_step(None, None, None, batch_size, None, expected)
                step.launches = StepCache(capacity=8)  # kept: what it records, for a few stamps
                self._before_steps.put(key, step)
            return step
        return self._before_step(req_pool_indices, prefix_lens, extend_lens, batch_size, expected_valid_lens,
                                 expected)

    def after(self, input_ids, positions, out_cache_loc, num_tokens, swa_out_cache_loc, expected_input_ids,
              expected_positions, max_row_tokens=None) -> AfterStep:
        """The step's write arguments: prepared once per ``num_tokens`` and ``max_row_tokens``
        (rounded up to a power of two) for bound buffers."""
        max_row_tokens = scalars.bound_key(max_row_tokens)
        if (input_ids is None and positions is None and out_cache_loc is None and swa_out_cache_loc is None
                and expected_input_ids is None and expected_positions is None
                and (num_tokens is None or type(num_tokens) is int)
                and (max_row_tokens is None or type(max_row_tokens) is int)):
            key = (num_tokens, max_row_tokens)
            step = self._after_steps.get(key)
            if step is None:
                step = self._after_step(None, None, None, num_tokens, None, None, None, max_row_tokens)
                step.kept = True
                self._after_steps.put(key, step)
            return step
        return self._after_step(input_ids, positions, out_cache_loc, num_tokens, swa_out_cache_loc,
                                expected_input_ids, expected_positions, max_row_tokens)

    def fill_valid_lens(self, step: BeforeStep, ptr) -> None:
        """The bound expected-token table's valid lengths for this step: the given ones, else
        ``prefix_lens + extend_lens``."""
        a, b, out = step.valid_lens
        with runtime.on_stream(self.device, ptr):
            if b is None:
                self.xp.copyto(out, a, casting="same_kind")
            else:
                self.xp.add(a, b, out=out)

    def window_rows(self, bs: int) -> tuple:
        """The main group's rows for the window a step of ``bs`` rows leaves: ``(ends, zeros)``,
        the same views every step of a batch size (so the plan's prepared call is reused)."""
        rows = self._window_views.get(bs)
        if rows is None:
            rows = self._window_views[bs] = (self._window_rows[0][:bs], self._window_rows[1][:bs])
        return rows

    def _before_step(self, req_pool_indices, prefix_lens, extend_lens, batch_size, expected_valid_lens,
                     expected) -> BeforeStep:
        """Import and check a step's arguments (the bound buffers where None) and lay out the ops'."""
        if batch_size is not None:
            batch_size = scalars.check_int(batch_size, "batch_size", minimum=0)
        arg = self._inputs.arg
        rpi = arg(req_pool_indices, "req_pool_indices", batch_size)
        bs = int(rpi.shape[0])
        pre = arg(prefix_lens, "prefix_lens", bs, min_len=bs)
        ext = arg(extend_lens, "extend_lens", bs, min_len=bs)
        if bs > self.max_batch:
            raise ValueError(f"kvcanary: req_pool_indices: a batch of {bs} rows exceeds max_batch = {self.max_batch}")
        exp, valid_lens = expected, None
        if exp is None and self.expected is not None:
            exp = self.expected
            if expected_valid_lens is not None:  # this step's own: copied into the monitor's buffer
                valid_lens = (arg(expected_valid_lens, "expected_valid_lens", bs, min_len=bs), None,
                              self.valid_lens[:bs])
            elif "expected_valid_lens" in self._inputs:  # bound: the plan reads the buffer in place
                arg(None, "expected_valid_lens", bs)  # (it holds the batch's rows)
                exp = self._expected_bound()
            else:
                valid_lens = (pre, ext, self.valid_lens[:bs])
        table = {self.table_kw: self.table}
        if self.table_kw == "block_table":
            table["page_size"] = self.page_size
        groups = []
        for g in self.groups:
            args = dict(req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, expected=exp, swa=g.swa, **table)
            verify_args = dict(log=self.log, tag=g.tag_verify, real_kv=g.sources, real_kv_mode=g.mode,
                               check_tokens=exp is not None, sample=g.sampler)
            groups.append((g, args, verify_args, (rpi, pre, ext, args.get("req_to_token"), args.get("block_table"),
                                                  args.get("page_size"), g.swa, exp, self.log, g.tag_verify,
                                                  g.sources, g.mode, exp is not None, g.sampler)))
        return BeforeStep(bs=bs, objs=(req_pool_indices, prefix_lens, extend_lens), valid_lens=valid_lens,
                          check_tokens=exp is not None, groups=tuple(groups))

    def _expected_bound(self) -> ExpectedTokens:
        """The expected-token table with the bound ``expected_valid_lens`` buffer, made once per
        binding (the same object every step, so the plan's prepared launch is reused)."""
        if self._expected_with_bound is None:
            self._expected_with_bound = ExpectedTokens(self.expected_table, self._inputs.bound("expected_valid_lens"),
                                                       self.token_offset)
        return self._expected_with_bound

    def _after_step(self, input_ids, positions, out_cache_loc, num_tokens, swa_out_cache_loc, expected_input_ids,
                    expected_positions, max_row_tokens) -> AfterStep:
        """Import and check a step's write arguments (the bound buffers where None) and lay out the ops'."""
        if num_tokens is not None:
            num_tokens = scalars.check_int(num_tokens, "num_tokens", minimum=0)
        if max_row_tokens is not None:
            max_row_tokens = scalars.check_int(max_row_tokens, "max_row_tokens", minimum=0)
        arg = self._inputs.arg
        ids = arg(input_ids, "input_ids", num_tokens)
        pos = arg(positions, "positions", num_tokens)
        loc = arg(out_cache_loc, "out_cache_loc", num_tokens)
        exp_in = None
        if expected_input_ids is not None or expected_positions is not None:
            exp_in = (None if expected_input_ids is None else arg(expected_input_ids, "expected_input_ids", None),
                      None if expected_positions is None else arg(expected_positions, "expected_positions", None))
        translate, groups = False, []
        for g in self.groups:
            gloc = loc
            if g is self.swa:
                if swa_out_cache_loc is not None or "swa_out_cache_loc" in self._inputs:
                    gloc = arg(swa_out_cache_loc, "swa_out_cache_loc", int(loc.shape[0]))
                else:
                    gloc, translate = None, True
            groups.append((g, gloc, (self.log, g.tag_write, g.sources, g.mode, exp_in)))
        given = [ids, pos, loc, *(gl for _, gl, _ in groups if gl is not None), *(exp_in or ())]
        return AfterStep(objs=(input_ids, positions, out_cache_loc), ids=ids, pos=pos, loc=loc, translate=translate,
                         groups=tuple(groups), tokens=min(int(a.shape[0]) for a in given if a is not None),
                         max_row_tokens=max_row_tokens)
