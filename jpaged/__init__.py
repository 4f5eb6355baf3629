"""jpaged: PagedAttention (the memory manager behind vLLM) in JAX and Pallas.

    from jpaged import LLM, SamplingParams
"""

from jpaged.engine import EngineConfig, LLMEngine
from jpaged.llm import LLM
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
