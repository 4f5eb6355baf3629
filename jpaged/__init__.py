"""jpaged: PagedAttention (the memory manager behind vLLM) in JAX and Pallas.

    from jpaged import LLM, SamplingParams

Layers, each importing only those below it (enforced by the import-linter contracts in
pyproject.toml):
  1. `jpaged.entrypoints`: `LLM` and the `jpaged` CLI;
  2. `jpaged.engine`: `LLMEngine`, one step at a time;
  3. `jpaged.weights` (model files and checkpoints) over `jpaged.device` (parameters, model,
     attention backends, KV pool, batching, runner, sampler), and beside them `jpaged.core`, the
     host core (KV cache managers, scheduler, sequences, beam search) that never imports JAX;
  4. `pallas_kernels`, which imports nothing of jpaged.
The public names below are imported lazily, so that `jpaged.core` can be used without JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "jpaged.entrypoints.llm",
    "LLMEngine": "jpaged.engine",
    "EngineConfig": "jpaged.engine",
    "StepRecord": "jpaged.engine",
    "RequestOutput": "jpaged.engine",
    "CompletionOutput": "jpaged.engine",
    "SamplingParams": "jpaged.core.sampling_params",
    "StructuredOutputsParams": "jpaged.core.structured_output",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
