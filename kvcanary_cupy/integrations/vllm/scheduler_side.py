"""The connector's scheduler side: what each step schedules, for the worker side.

vLLM hands the scheduler-side connector every request it admits
(``update_state_after_alloc``: the live ``Request``) and every step's
``SchedulerOutput`` (``build_connector_meta``). The metadata built here carries, per
scheduled request, its counts, the token ids the worker has not seen yet and its
block-list changes; the worker checks each step against what attention reads.
It asks vLLM to call the worker's check before the forward (``has_sync_kv_loads``).
"""
from __future__ import annotations

from .meta import CanaryStepMeta, ScheduledRequest


class SchedulerSide:
    """Per-request token cursors and the per-step metadata.

    Args:
        vllm_config: the engine's ``VllmConfig`` (async scheduling is refused: the scheduler
            then plans a step before it knows the token the step writes).
    """

    def __init__(self, vllm_config):
        if getattr(vllm_config.scheduler_config, "async_scheduling", False):
            raise ValueError("kvcanary: async_scheduling: vLLM's asynchronous scheduling plans each step before the "
                             "token it writes is known, and the connector stamps every slot with its token; start the "
                             "engine with async_scheduling=False (vllm serve --no-async-scheduling)")
        self.requests: dict = {}  # request id -> the scheduler's live Request
        self.sent: dict = {}  # request id -> tokens sent to the worker side
        self.step = 0

    def admitted(self, request) -> None:
        """``update_state_after_alloc``: the request was (re)admitted with blocks."""
        self.requests[request.request_id] = request

    def finished(self, request) -> None:
        """``request_finished``: its blocks are about to be freed."""
        self.requests.pop(request.request_id, None)
        self.sent.pop(request.request_id, None)

    def build(self, so) -> CanaryStepMeta:
        """The step's metadata from ``SchedulerOutput`` ``so``."""
        self.step += 1
        so.has_sync_kv_loads = True  # the worker's check runs before the forward reads the KV
        out = []
        sched = so.num_scheduled_tokens
        requests, sent = self.requests, self.sent
        for nr in so.scheduled_new_reqs:
            out.append(self._entry(nr.req_id, sched[nr.req_id], blocks=nr.block_ids))
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            if rid in resumed:
                out.append(self._entry(rid, sched[rid], blocks=new))
            else:
                out.append(self._entry(rid, sched[rid], new_blocks=new))
        preempted = set(so.preempted_req_ids or ())
        for rid in so.finished_req_ids:
            requests.pop(rid, None)
            sent.pop(rid, None)
        return CanaryStepMeta(requests=out, finished=set(so.finished_req_ids), preempted=preempted, step=self.step)

    def _entry(self, rid: str, scheduled: int, blocks=None, new_blocks=None) -> ScheduledRequest:
        req = self.requests[rid]
        computed = int(req.num_computed_tokens)
        have = self.sent.get(rid, 0)
        end = computed + scheduled
        tokens = req.all_token_ids[have:end] if end > have else []  # a slice: a list of its own
        self.sent[rid] = have + len(tokens)
        return ScheduledRequest(rid, computed, int(scheduled), tokens,
                                None if blocks is None else tuple(map(list, blocks)),
                                None if new_blocks is None else tuple(map(list, new_blocks)),
                                int(req.num_prompt_tokens) if blocks is not None else 0)
