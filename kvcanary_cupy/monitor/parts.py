"""The parts a monitor is built of, from its checked options.

:func:`build_parts` imports the slot table and the expected-token table (zero copy, read
in place every step), allocates the groups (canary, plans), the block every poll copies,
the violation log and, with a process group, the tensor-parallel agreement, and sets up
what a step hands its work to: the bound inputs, the step layout, the SWA translation,
the sweep planner, the request map, the poll's reader and reports, and the incidents'
outputs. :class:`KvCanary` keeps them and runs the steps.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import arrays, ops, runtime
from ..format import NUM_COUNTERS
from .group import SCALAR_WORDS, Group, main_group, swa_group
from .inputs import StepInputs
from .lifetime import Keepalive
from .options import Options
from .outputs import Outputs
from .plan_counters import PlanCounters
from .policy import Reporter
from .requests import MonitorLog, RequestMap
from .steps import StepLayout
from .swa import SwaTranslation
from .sweep import SweepPlanner


@dataclasses.dataclass(eq=False)
class Parts:
    """What :func:`build_parts` returns (each described where :class:`KvCanary` keeps it)."""

    outputs: Outputs
    main: Group
    swa: Group | None
    groups: list
    log: MonitorLog
    keepalive: Keepalive
    inputs: StepInputs
    layout: StepLayout
    swa_map: SwaTranslation
    sweep: SweepPlanner
    requests: RequestMap
    reporter: Reporter
    plan_counters: PlanCounters
    agreement: object
    reader: runtime.HostReader


def build_parts(opts: Options, *, req_to_token, block_table, page_size, expected_tokens, swa, verify_capacity,
                process_group, events, metrics, incident_quiet_steps, name) -> Parts:
    """A monitor's parts for ``opts`` and the constructor's other arguments (see :class:`KvCanary`)."""
    outputs = Outputs(events=events, metrics=metrics, quiet_steps=incident_quiet_steps, name=name)
    device = opts.device

    # --- the slot table, bound once -------------------------------------
    table_kw, table, page_size = ops.slot_table(req_to_token, block_table, page_size, opts.num_slots)
    bound_table = arrays.as_index_array(table, table_kw, ndim=2, device=device)
    width = min(int(bound_table.shape[1]) * page_size, (1 << 63) - 1)

    # --- expected tokens --------------------------------------------------
    valid_lens = runtime.empty((opts.max_batch,), np.int64, device, fill=0)
    expected_table = None
    if expected_tokens is not None:
        expected_table = arrays.as_index_array(expected_tokens, "expected_tokens", ndim=2, device=device)

    # --- groups -----------------------------------------------------------
    # What every poll reads lives in one block, so one copy moves it: each group's plan
    # scalars, the log head snapshots, the log's counters and (without an agreement, which
    # sends it) the log's head.
    history = opts.history
    polled = runtime.empty((2 * SCALAR_WORDS + history + NUM_COUNTERS + 1,), np.int64, device, fill=0)
    main = main_group(num_slots=opts.num_slots, device=device, max_batch=opts.max_batch, width=width,
                      verify_capacity=verify_capacity, sources=opts.sources, mode=opts.mode,
                      sample_period=opts.sample_period, draft=opts.draft, chain=opts.chain,
                      sc=polled[:SCALAR_WORDS], window=opts.window)
    swa_g = None if swa is None else swa_group(swa, device=device, max_batch=opts.max_batch, width=width,
                                               mode=opts.mode, sample_period=opts.sample_period,
                                               chain=opts.chain, sc=polled[SCALAR_WORDS:2 * SCALAR_WORDS])
    groups = [g for g in (main, swa_g) if g is not None]
    for g in groups:  # misuse shows here, not in the first step
        g.check_sources()
    send = None
    if process_group is not None:
        from ..distributed import Agreement  # noqa: PLC0415  (imports PyTorch)

        send = Agreement.allocate_send(device)  # its word 1 is the log's head: sent without a copy
    log = MonitorLog.allocate(capacity=opts.ring_capacity, device=device,
                              head=polled[-1:] if send is None else send[1:],
                              counters=polled[2 * SCALAR_WORDS + history:-1])

    # --- what a step hands work to ----------------------------------------
    keepalive = Keepalive(device)
    inputs = StepInputs(device, keepalive, torch_inputs=runtime.is_torch(table))
    swa_map = SwaTranslation(device, keepalive)
    if swa_g is not None and opts.max_tokens:
        swa_map.reserve(opts.max_tokens, swa_g.swa.lut)
    sweep = SweepPlanner(budget=opts.sweep_budget, max_chains=opts.sweep_max_chains, device=device)
    requests = RequestMap(history=history, device=device, log=log,
                          heads=polled[2 * SCALAR_WORDS:2 * SCALAR_WORDS + history])
    reporter = Reporter(g.name for g in groups)
    agreement = None
    if process_group is not None:
        agreement = Agreement(process_group, device=device, log=log, send=send, keepalive=keepalive)
        for g in groups:
            g.keep_entry_digest(keepalive.hold)
    # One pinned copy per poll: every group's scalars, the head snapshots, the log's counters
    # (and the agreement's state), the log's head and the ring rows after those polled.
    reader = runtime.HostReader(device, [g.sc for g in groups] + [requests.heads, log.counter_array]
                                + ([agreement.state] if agreement is not None else []) + [log.head, log.ring])
    # Prepared op arguments per shape of step (see .steps); dropped when what they hold changes.
    layout = StepLayout(inputs=inputs, groups=groups, swa=swa_g, log=log, max_batch=opts.max_batch, device=device,
                        table_kw=table_kw, table=bound_table, page_size=page_size, expected_table=expected_table,
                        token_offset=opts.token_offset, valid_lens=valid_lens,
                        window_rows=opts.window is not None and opts.verify_after)
    plan_counters = PlanCounters(groups=groups, reporter=reporter, requests=requests, keepalive=keepalive,
                                 device=device, grow_on_overflow=opts.grow_on_overflow, page_size=page_size)
    return Parts(outputs=outputs, main=main, swa=swa_g, groups=groups, log=log, keepalive=keepalive, inputs=inputs,
                 layout=layout, swa_map=swa_map, sweep=sweep, requests=requests, reporter=reporter,
                 plan_counters=plan_counters, agreement=agreement, reader=reader)
