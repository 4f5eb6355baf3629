"""jpaged: PagedAttention (the memory manager behind vLLM) in JAX and Pallas.

    from jpaged import LLM, SamplingParams

The public names are imported lazily, so that the host-side modules (block manager, scheduler,
reservation) can be imported without JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "jpaged.llm",
    "LLMEngine": "jpaged.engine",
    "EngineConfig": "jpaged.engine",
    "SamplingParams": "jpaged.sampling_params",
    "RequestOutput": "jpaged.outputs",
    "CompletionOutput": "jpaged.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
