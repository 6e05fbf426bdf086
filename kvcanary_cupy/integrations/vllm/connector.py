"""KvCanaryConnector: the KV-cache canary as a vLLM v1 KV connector.

vLLM builds one connector per role from ``kv_transfer_config`` (see
:func:`~kvcanary_cupy.integrations.vllm.kv_transfer_config`): the scheduler's
(:mod:`.scheduler_side`) and each worker's (:mod:`.worker_side`). The connector loads and
saves no KV: it only watches the KV vLLM keeps. It never reports a remote hit
(``get_num_new_matched_tokens`` is 0).
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from .config import EXTRA_KEY, parse_options
from .meta import CanaryStepMeta
from .scheduler_side import SchedulerSide
from .version import check_version
from .worker_side import WorkerSide


class KvCanaryConnector(KVConnectorBase_V1):
    """vLLM's handle on the canary. Args as every ``KVConnectorBase_V1``: ``(vllm_config, role,
    kv_cache_config)``; the options come from ``kv_connector_extra_config["kvcanary"]``."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        check_version()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.options = parse_options(dict(extra.get(EXTRA_KEY, {})))
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, self.options)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.scheduler.admitted(request)

    def build_connector_meta(self, scheduler_output) -> CanaryStepMeta:
        return self.scheduler.build(scheduler_output)

    def request_finished(self, request, block_ids):
        self.scheduler.finished(request)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches):
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        self.worker.before_forward(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        self.worker.after_forward()

    def get_block_ids_with_load_errors(self) -> set:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self):
        if self.worker is not None:
            self.worker.close()

    # ------------------------------------------------------------------ results
    def stats(self) -> dict:
        """The worker side's counters (see :meth:`~.worker_side.WorkerSide.stats`)."""
        return self.worker.stats() if self.worker is not None else {}

    @property
    def violations(self) -> list:
        """Every :class:`~kvcanary_cupy.integrations.engine.violations.EngineViolation` found."""
        return list(self.worker.found) if self.worker is not None else []
