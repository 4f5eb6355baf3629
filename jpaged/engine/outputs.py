"""What the engine returns: vLLM's `RequestOutput` / `CompletionOutput` shapes."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: Optional[str]  # "stop", "length", "abort", "error" (see RequestOutput.error) or None while running
    logprobs: Optional[list[dict[int, float]]] = None


@dataclasses.dataclass
class RequestMetrics:
    """Monotonic-clock timestamps (seconds)."""

    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    finished_time: Optional[float]
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: Optional[str] = None  # why the request failed (a step that ran it raised), else None

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "error": self.error,
            "outputs": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                         "cumulative_logprob": o.cumulative_logprob} for o in self.outputs],
        }
