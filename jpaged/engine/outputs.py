"""What the engine returns: vLLM's `RequestOutput` / `CompletionOutput` shapes.

A step returns a cumulative `RequestOutput` for every request that progressed, but most are never
read (`LLM.generate` keeps only the final ones; a stream reads the newest text). So the engine builds
them *deferred* (`RequestOutput.deferred`): the cheap fields at once, and `prompt_token_ids`,
`outputs` and `metrics` from a snapshot taken at the step (references to append-only lists and their
lengths, immutable strings, numbers) the first time any of them is read. A deferred output is a
plain `RequestOutput` to every reader (equality, repr, `dataclasses.asdict`, pickling): its values
are those it would have had if built at the step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional


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

    @classmethod
    def deferred(cls, request_id: str, prompt: Optional[str], finished: bool, error: Optional[str],
                 build: Callable[..., tuple[list[int], list[CompletionOutput], RequestMetrics]],
                 snapshot: tuple) -> RequestOutput:
        """A `RequestOutput` whose (prompt_token_ids, outputs, metrics) are `build(*snapshot)`'s, called when
        one of them is first read (in whichever thread reads it: `snapshot` must not change meanwhile)."""
        out = cls.__new__(cls)
        out.__dict__ = {"request_id": request_id, "prompt": prompt, "finished": finished, "error": error,
                        "_build": (build, snapshot)}
        return out

    def __getattr__(self, name):  # only for attributes not set: a deferred output's fields, until built
        build = self.__dict__.get("_build")
        if build is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._materialize(build)
        return getattr(self, name)

    def _materialize(self, build) -> None:
        # built before `_build` goes, so that a reader in another thread never sees neither (building twice is harmless)
        self.prompt_token_ids, self.outputs, self.metrics = build[0](*build[1])
        self.__dict__.pop("_build", None)

    def __getstate__(self):  # pickle and copy: the built fields, never the snapshot
        build = self.__dict__.get("_build")
        if build is not None:
            self._materialize(build)
        return self.__dict__

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "error": self.error,
            "outputs": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                         "cumulative_logprob": o.cumulative_logprob} for o in self.outputs],
        }
