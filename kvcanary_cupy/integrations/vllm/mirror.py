"""The worker side's mirror of the scheduler's bookkeeping: each live request's tokens and blocks.

Filled from the per-step metadata only (the scheduler's own objects live in another
process). Tokens are what the request holds (prompt, then outputs), the canary's expected
tokens; block lists are what the scheduler allocated, used to name the requests of the
worker's rows, to find rows that read what another row writes in the same step, and to
pick a block vLLM's failure path charges to one request alone.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(eq=False)
class RequestTokens:
    """One live request, in the shape the shared expected-token table reads.

    Attributes:
        request_id: vLLM's request id.
        initial_tokens: every token id known so far (prompt, then outputs): grows each step.
        generated_tokens: empty (the outputs are appended to ``initial_tokens``).
        blocks: per KV-cache group, the request's block ids, as allocated.
        computed, scheduled: this step's counts (see :class:`~.meta.ScheduledRequest`).
        admitted: whether this step (re)admitted it (its blocks were all handed over).
        prompt_len: its prompt's length.
    """

    request_id: str
    initial_tokens: list = dataclasses.field(default_factory=list)
    generated_tokens: tuple = ()
    blocks: tuple = ()
    computed: int = 0
    scheduled: int = 0
    admitted: bool = False
    prompt_len: int = 0


class RequestMirror:
    """Live requests by id, updated from each step's metadata.

    Example::

        >>> from kvcanary_cupy.integrations.vllm.meta import CanaryStepMeta, ScheduledRequest
        >>> m = RequestMirror(groups=1)
        >>> m.apply(CanaryStepMeta([ScheduledRequest("a", 0, 3, [7, 8, 9], blocks=([4],))], set(), set(), 1))
        []
        >>> r = m.live["a"]; r.initial_tokens, r.blocks, r.admitted
        ([7, 8, 9], ([4],), True)
        >>> m.apply(CanaryStepMeta([ScheduledRequest("a", 3, 1, [10], new_blocks=([5],))], set(), set(), 2))
        []
        >>> r.initial_tokens, r.blocks, r.admitted
        ([7, 8, 9, 10], ([4, 5],), False)
        >>> m.apply(CanaryStepMeta([], {"a"}, set(), 3)), "a" in m.live
        (['a'], False)
    """

    def __init__(self, groups: int):
        self.groups = int(groups)
        self.live: dict = {}
        self.scheduled: list = []  # this step's RequestTokens, scheduler order
        # What the steps so far exercised: requests (re)admitted with prefix-cache hits, and
        # prefill steps that left part of their prompt for a later step.
        self.prefix_hits = self.chunked_prefills = 0

    def apply(self, meta) -> list:
        """Take a step's metadata; returns the ids that left (finished or preempted) before it."""
        gone = []
        for rid in meta.finished:
            if self.live.pop(rid, None) is not None:
                gone.append(rid)
        for rid in meta.preempted:
            r = self.live.get(rid)
            if r is not None:
                r.blocks = tuple([] for _ in range(self.groups))
                gone.append(rid)
        step = []
        for e in meta.requests:
            r = self.live.get(e.request_id)
            if r is None:
                r = self.live[e.request_id] = RequestTokens(e.request_id,
                                                            blocks=tuple([] for _ in range(self.groups)))
            r.initial_tokens.extend(e.tokens)
            if e.prompt_len:
                r.prompt_len = e.prompt_len
            r.computed, r.scheduled = e.computed, e.scheduled
            r.admitted = e.blocks is not None
            if r.prompt_len > e.computed + e.scheduled:
                self.chunked_prefills += 1
            if e.blocks is not None:
                self.prefix_hits += e.computed > 0
                r.blocks = tuple(list(b) for b in e.blocks)
            elif e.new_blocks is not None:
                for mine, new in zip(r.blocks, e.new_blocks):
                    mine.extend(new)
            step.append(r)
        self.scheduled = step
        return gone
