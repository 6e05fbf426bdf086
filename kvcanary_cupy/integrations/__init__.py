"""Adapters that attach kvcanary_cupy to real engines and frameworks without patching their source.

Each submodule imports its framework only when it is imported itself:
``kvcanary_cupy.integrations.transformers`` (Hugging Face continuous batching) and
``kvcanary_cupy.integrations.torch_ops`` (the ops as ``torch.library`` custom ops).
"""
