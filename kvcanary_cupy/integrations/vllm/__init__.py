"""The KV-cache canary inside vLLM's v1 engine, as a KV connector (vLLM 0.32.0).

One argument turns it on::

    from vllm import LLM
    from kvcanary_cupy.integrations.vllm import kv_transfer_config

    llm = LLM(model, kv_transfer_config=kv_transfer_config(policy="cancel"), async_scheduling=False)

or ``vllm serve MODEL --no-async-scheduling --kv-transfer-config '<the same dict as JSON>'``.
Every step then verifies every KV slot attention reads, in every KV-cache group,
against the worker's own block table and lengths (each violation naming its vLLM
request id), stamps every slot the step writes with its token and position, and
fingerprints the real K/V bytes of every layer, through vLLM's own KV-connector API:
nothing of vLLM is patched.

Modules, one job each (vLLM is imported only by the connector's own modules):

- ``config``: :func:`kv_transfer_config`, the options checked up front.
- ``connector``: :class:`KvCanaryConnector`, what vLLM loads; it hands each role its side.
- ``scheduler_side``: per step, what the scheduler scheduled (counts, tokens, blocks).
- ``meta``: that metadata.
- ``worker_side``: the canaries around the forward, the policies, the cancel path.
- ``mirror``: the worker's mirror of the scheduler's requests.
- ``rows``: naming the rows of the attention metadata; rows that wait for others' writes.
- ``layout``: each attention backend's KV layout, for the fingerprints.
- ``version``: the vLLM versions it was tested with.

The per-step check itself is engine-neutral:
:class:`~kvcanary_cupy.integrations.engine.block_table.BlockTableCanary`.
"""
from .config import CONNECTOR_MODULE, CONNECTOR_NAME, kv_transfer_config
from .version import SUPPORTED_VERSIONS

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "SUPPORTED_VERSIONS", "kv_transfer_config"]
