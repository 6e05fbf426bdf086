"""The simulator's knobs, in one place."""
from __future__ import annotations

from dataclasses import dataclass

from ..format import DEFAULT_CHAIN, RealKvMode, check_chain


@dataclass
class SimConfig:
    """Geometry and traffic of a :class:`~kvcanary_cupy.sim.PagedKvSim`.

    Pool geometry:
        device: ``"cpu"`` (NumPy backend) or ``"cuda"``.
        page_size: slots per page; 1 gives a token-level ``req_to_token`` table,
            more a page-level ``block_table`` (the monitor is bound to whichever).
        num_pages: pages of the full pool (page 0 is reserved: it holds slot 0).
        max_requests: rows of the request table (row 0 is the padding row).
        max_len: positions per request (table width).
        max_batch: batch rows per step.
        layers, bytes_per_token: the toy model's K and V pools, each
            ``[layers, slots, bytes_per_token]`` bytes.
        swa_window, swa_slots: a sliding-window group (None: none); its pool
            has ``swa_slots`` token slots and one layer.
        draft: a draft pool (one layer) that stores, at position ``p``, token ``p + 1``.

    Traffic:
        chunk: prefill chunk length.
        block: prefix-cache block length (a multiple of page_size).
        concurrency: requests kept running.
        system_prompts, system_blocks: shared prompt heads (in blocks) that make prefix hits.
        suffix_len, output_len: inclusive ranges of a prompt's own tail and of its output.
        vocab: token ids are drawn from [1, vocab).

    Monitor:
        real_kv_mode, sample_period, sweep_budget, verify_after, stamp_before_forward:
            passed to the monitors (stamping before the forward needs real_kv_mode NONE).
        chain: the monitors' chain kind, ``"scan"`` (default) or ``"sglang"``.
        events: the monitors' ``events`` (see :class:`~kvcanary_cupy.KvCanary`): a path or a
            callable that receives each incident they open; None: nowhere.
        name: the monitors' ``name`` (the draft pool's monitor adds ``.draft``).
    """

    device: str = "cpu"
    page_size: int = 1
    num_pages: int = 320
    max_requests: int = 16
    max_len: int = 96
    max_batch: int = 8
    layers: int = 2
    bytes_per_token: int = 32
    swa_window: int | None = 12
    swa_slots: int = 256
    draft: bool = True
    chunk: int = 16
    block: int = 8
    concurrency: int = 6
    system_prompts: int = 3
    system_blocks: tuple = (1, 3)
    suffix_len: tuple = (2, 20)
    output_len: tuple = (3, 24)
    vocab: int = 50_000
    real_kv_mode: RealKvMode = RealKvMode.ALL
    sample_period: int | None = None
    sweep_budget: int = 96
    verify_after: bool = False
    stamp_before_forward: bool = False
    chain: str = DEFAULT_CHAIN
    seed: int = 0
    events: object = None
    name: str = ""

    def __post_init__(self):
        check_chain(self.chain, "SimConfig.chain")
        if self.page_size < 1 or self.block % self.page_size:
            raise ValueError(f"kvcanary: SimConfig.block: expected a multiple of page_size {self.page_size}, "
                             f"got {self.block}")
        if self.max_len % self.page_size:
            raise ValueError(f"kvcanary: SimConfig.max_len: expected a multiple of page_size {self.page_size}, "
                             f"got {self.max_len}")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size
