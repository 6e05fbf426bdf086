"""What the scheduler side tells the worker side each step (vLLM's connector metadata).

Plain values only: the metadata travels from the engine core to the workers.
"""
from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    """One request the step schedules, as the scheduler's bookkeeping has it.

    Attributes:
        request_id: vLLM's request id.
        computed: tokens already in the KV cache (prefix-cache hits included) before the step.
        scheduled: tokens the step computes (and whose K/V it writes).
        tokens: the request's token ids not sent before (prompt, then outputs), up to
            ``computed + scheduled``.
        blocks: per KV-cache group, the request's whole block list when it was (re)admitted
            this step; else None.
        new_blocks: per KV-cache group, blocks appended this step (None: none).
        prompt_len: the prompt's length (sent when the request is (re)admitted, else 0).
    """

    request_id: str
    computed: int
    scheduled: int
    tokens: list
    blocks: tuple | None = None
    new_blocks: tuple | None = None
    prompt_len: int = 0


@dataclasses.dataclass
class CanaryStepMeta(KVConnectorMetadata):
    """The step: its scheduled requests, and those that left since the previous step.

    Attributes:
        requests: :class:`ScheduledRequest` s (scheduler order; the worker's may differ).
        finished: ids of requests that finished (their blocks are freed).
        preempted: ids of requests preempted (blocks freed; they resume from scratch).
        step: the scheduler's step number.
    """

    requests: list
    finished: set
    preempted: set
    step: int
