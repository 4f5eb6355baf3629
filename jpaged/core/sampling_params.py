"""`SamplingParams`: what to generate for one request, validated on construction (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence

from jpaged.core.structured_output import StructuredOutputsParams


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Defaults follow vLLM: temperature 1.0, top_p 1.0, top_k 0 (off; -1, vLLM's other spelling, becomes 0),
    max_tokens 16.

    n: independent samples of the prompt (their prompt blocks are shared, refcount n).
    beam_width: > 1 switches to beam search (deterministic; temperature/top-k/top-p ignored);
      `length_penalty` and `early_stopping` follow HF transformers' beam search.
    seed: makes the request reproducible whatever shares its batch and however often it is preempted;
      sample i draws as a single-sample request with seed `seed + i`. None draws one from the engine.
    stop: strings that end a sample (not included in the text); stop_token_ids likewise.
    structured_outputs: constrain the output (`jpaged.core.structured_output.StructuredOutputsParams`, or
      a dict of its fields: a JSON schema, a regex, a choice of strings, a Lark/GBNF grammar, or any
      JSON object); the sequence ends ("stop") when the constraint is complete. Not with beam search.
    logprobs: return, for every generated token, the log-probabilities of the `logprobs` most likely
      tokens and of the token chosen (vLLM's and OpenAI's meaning; 0: the chosen token's alone); not
      with beam search, whose beams carry their cumulative_logprob.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a StructuredOutputsParams or a dict of its fields, got "
               f"{type(self.structured_outputs).__name__}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        _check(isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) for t in self.stop_token_ids),
               f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        if _is_int(self.top_k) and self.top_k == -1:  # vLLM's other spelling of off
            object.__setattr__(self, "top_k", 0)
        _check(_is_int(self.top_k) and 0 <= self.top_k < 2**31,
               f"top_k must be an integer in [0, 2**31) (0 or -1 = off), got {self.top_k!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**32),
               f"seed must be None or an integer in [0, 2**32), got {self.seed!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        _check(_is_int(self.beam_width) and self.beam_width >= 1,
               f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        _check(_is_number(self.length_penalty), f"length_penalty must be a number, got {self.length_penalty!r}")
        _check(self.early_stopping in (True, False, "never"),
               f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        for name in ("n", "top_k", "max_tokens", "seed", "logprobs", "beam_width"):  # NumPy's as Python's
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "length_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.use_beam_search:
            _check(self.structured_outputs is None, "structured outputs are not supported with beam search: "
                   "use n=1 (greedy or sampled) with structured_outputs")
            _check(self.n == 1, "use either n > 1 (sampling) or beam_width > 1 (beam search), not both")
            _check(not self.stop, "stop strings are not supported with beam search: use stop_token_ids")
            _check(self.logprobs is None, "logprobs are not returned with beam search (each beam's "
                   "cumulative_logprob is): leave logprobs unset")
            _check(self.temperature in (0, 1) and self.top_p == 1 and self.top_k == 0,
                   "beam search is deterministic: temperature, top_p and top_k do not apply to it (leave them "
                   f"at their defaults), got temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}")
        else:
            _check(self.n == 1 or self.temperature > 0,
                   f"n={self.n} with temperature=0 (greedy) gives {self.n} identical samples: set temperature > 0, "
                   "or n=1")

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def num_top_logprobs(self) -> int:
        """How many top log-probabilities the sampler must return for this request."""
        need = 2 * self.beam_width if self.use_beam_search else 1
        return max(need, self.logprobs or 0)


def _is_int(x) -> bool:
    """An integer, NumPy's included; not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite real number, NumPy's included; not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def as_list(sampling_params, num_prompts: int) -> Sequence[SamplingParams]:
    """One SamplingParams per prompt: a single one is shared; a list must match the prompts. Anything else
    (a dict of fields, a list holding one) raises TypeError."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, (dict, str, bytes)) or not hasattr(sampling_params, "__iter__"):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}" + (": pass SamplingParams(**it)" if isinstance(
                            sampling_params, dict) else ""))
    sampling_params = list(sampling_params)
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts: pass one, or one per prompt")
    bad = [type(p).__name__ for p in sampling_params if not isinstance(p, SamplingParams)]
    if bad:
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got a list holding {bad[0]}")
    return sampling_params
