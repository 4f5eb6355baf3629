"""Layer 2, the engine: requests in, outputs out, one step at a time.

`LLMEngine` (add_request / step / abort / stats) applies what the layer below decides: the host
core's scheduler and KV cache manager choose what runs, the device side runs it, and the engine
turns samples into tokens, text, stops and beam-search moves. `EngineConfig` is its static
configuration; `StepRecord` is what its observers see of every step; `RequestOutput` /
`CompletionOutput` are what it returns. Imports the host core, the device side and weights I/O;
nothing above it.
"""

from jpaged.engine.config import DTYPES, EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.engine.observer import StepRecord
from jpaged.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["DTYPES", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestMetrics", "RequestOutput", "StepRecord"]
