"""Whole monitor steps: ``KvCanary.before_forward`` + ``after_forward`` as an engine runs them.

One monitor per configuration (prefix, real-KV mode, token check), sized for the
largest batch of its cases: a token-level table whose rows hold distinct random
slots of the pool, every prefix stamped once through the monitor itself, and the
decode step's buffers bound once (``bind_inputs``), so a step of ``bs`` rows reads
table rows 1..bs and pays no DLPack import. Repeating a step changes nothing: it
verifies the same prefixes and stamps the same records at position ``prefix``
again, so every timed run is the same clean step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvMode

from .cases import Case
from .timing import median
from .workloads import INDEX_DTYPE, TABLE_DTYPE, VOCAB, draw_slots


def config_of(case: Case) -> tuple:
    """The cases that can share one monitor: same prefix, real-KV mode and token check."""
    return case.prefix, case.mode, case.check_tokens


@dataclass(eq=False)
class MonitorSetup:
    """A monitor whose prefixes are stamped and whose decode buffers are bound.

    Attributes:
        monitor: the :class:`kvcanary_cupy.KvCanary`.
        batch: table rows (the largest batch a step may take).
        prefix: cached tokens per row.
        stream: the stream every call runs on (None on the CPU).
        keep: arrays the monitor reads in place (the table, the bound buffers).
    """

    monitor: kc.KvCanary
    batch: int
    prefix: int
    stream: object
    keep: tuple

    def step(self, bs: int):
        """A zero-argument decode step of ``bs`` rows."""
        mon, stream = self.monitor, self.stream
        if mon.stamp_before_forward:  # a decode step: a token per row, the bound its caller knows
            def step():
                mon.before_forward(batch_size=bs, num_tokens=bs, max_row_tokens=1, stream=stream)
                mon.after_forward()
        else:
            def step():
                mon.before_forward(batch_size=bs, stream=stream)
                mon.after_forward(num_tokens=bs, max_row_tokens=1, stream=stream)

        return step

    def checks(self) -> dict:
        """Violations logged, overflows and plan input errors so far, and the verify plan's
        requested entries of the latest step (synchronizes)."""
        st = self.monitor.stats()
        main = st["groups"]["main"]
        return {"violations": st["logged"], "overflows": main["overflows"], "input_errors": main["input_errors"],
                "requested": self.monitor.verify_plan.host_scalars()["requested"],
                "slots_checked": st["slots_checked"]}


def build(xp, device: str, *, batch: int, prefix: int, num_slots: int, rs, sources=(), mode: str = "NONE",
          check_tokens: bool = False, stamp: bool = False, stream=None) -> MonitorSetup:
    """A monitor over ``num_slots`` slots, ``batch`` rows of ``prefix`` stamped tokens each.

    ``sources`` feed the fingerprints when ``mode`` is not NONE; ``check_tokens`` binds an
    expected-token table that holds every row's tokens, so the token check passes;
    ``stamp``: the monitor stamps before the forward (``stamp_before_forward``).
    """
    width = prefix + 1
    table = xp.zeros((batch + 1, width), dtype=TABLE_DTYPE)
    table[1:] = draw_slots(xp, rs, batch * width, num_slots - 1).reshape(batch, width).astype(TABLE_DTYPE)
    prefix_ids = rs.randint(0, VOCAB, size=batch * prefix, dtype=INDEX_DTYPE)
    step_ids = rs.randint(0, VOCAB, size=batch, dtype=INDEX_DTYPE)
    expected = _expected_table(xp, batch, prefix, prefix_ids, step_ids) if check_tokens else None
    real_kv = tuple(sources) if mode != "NONE" else ()
    mon = kc.KvCanary(num_slots=num_slots, req_to_token=table, max_batch=batch, device=device, real_kv=real_kv,
                      real_kv_mode=RealKvMode[mode], expected_tokens=expected, policy=lambda found: None,
                      stamp_before_forward=stamp)
    rows = xp.arange(1, batch + 1, dtype=INDEX_DTYPE)
    _stamp_prefixes(xp, mon, table, rows, prefix, prefix_ids, stream)
    step = dict(req_pool_indices=rows, prefix_lens=xp.full(batch, prefix, dtype=INDEX_DTYPE),
                extend_lens=xp.ones(batch, dtype=INDEX_DTYPE), input_ids=step_ids,
                positions=xp.full(batch, prefix, dtype=INDEX_DTYPE),
                out_cache_loc=xp.ascontiguousarray(table[1:, prefix].astype(INDEX_DTYPE)))
    mon.bind_inputs(**step)
    return MonitorSetup(mon, batch, prefix, stream, (table, expected, tuple(step.values())))


def _expected_table(xp, batch: int, prefix: int, prefix_ids, step_ids):
    """int64 ``[batch + 1, prefix + 1]``: each row's prefix tokens, then its decode token."""
    exp = xp.full((batch + 1, prefix + 1), -1, dtype=np.int64)
    exp[1:, :prefix] = prefix_ids.reshape(batch, prefix)
    exp[1:, prefix] = step_ids
    return exp


def _stamp_prefixes(xp, mon, table, rows, prefix: int, prefix_ids, stream) -> None:
    """One prefill step of every row from an empty prefix, through the monitor itself."""
    batch = int(rows.shape[0])
    plan = (rows, xp.zeros(batch, dtype=INDEX_DTYPE), xp.full(batch, prefix, dtype=INDEX_DTYPE))
    loc = xp.ascontiguousarray(table[1:, :prefix].reshape(-1).astype(INDEX_DTYPE))
    tokens = dict(input_ids=prefix_ids, positions=xp.tile(xp.arange(prefix, dtype=INDEX_DTYPE), batch),
                  out_cache_loc=loc)
    if mon.stamp_before_forward:
        mon.before_forward(*plan, **tokens, stream=stream)
        mon.after_forward()
    else:
        mon.before_forward(*plan, stream=stream)
        mon.after_forward(**tokens, stream=stream)
    # Two polls release what the step imported per call (the monitor holds it until then).
    mon.poll(stream=stream)
    mon.poll(stream=stream)


def host_figures(setup: MonitorSetup, bs: int, *, timer, calls: int, runs: int, capture) -> dict:
    """Host µs of an eager step of ``bs`` rows (bound buffers), and of a CUDA graph replay's
    launch call with the replay's device time (``capture(fn)`` returns ``launch()``, or raises
    ``NotImplementedError`` where there are no graphs)."""
    step = setup.step(bs)
    out = {"batch": bs, "prefix": setup.prefix, "calls": calls,
           "eager_step_us": median(timer.host(step, calls=calls))}
    try:
        replay = capture(step)
    except NotImplementedError as e:
        out["graph_error"] = str(e)
        return out
    out["graph_replay_host_us"] = median(timer.host(replay, calls=calls))
    out["graph_replay_device_us"] = timer.device(lambda _i: replay(), runs=runs, warmup=3).device_us
    return out
