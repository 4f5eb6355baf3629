"""Beam search decisions, matching HF transformers' beam search (no JAX, no engine).

`step(state, params, beams, ...)` is a pure function: given a beam group's search state and, for
each running beam, its most likely next tokens, it returns a `BeamDecision`: which candidates
become the next running beams (a parent chosen j > 1 times is forked j - 1 times, sharing all its
blocks, copy-on-write on the next write; a beam not chosen is freed) and the new search state
(finished hypotheses). The engine applies the decision with the KV cache manager's fork / free and
appends the tokens. For `k = beam_width`, one step:
  1. candidates: the best `2k` of (beam score + log p(token)) over all beams and tokens;
  2. a candidate that hits a stopping condition (EOS / stop token, `max_tokens`, the context) and
     ranks among the first k becomes a finished hypothesis scored
     `sum_logprobs / num_generated_tokens ** length_penalty`; the best k hypotheses are kept;
  3. the best k candidates that did not stop become the next running beams;
  4. the search ends (no next beams) when no running beam can beat the worst of k finished
     hypotheses (HF's `early_stopping=False` heuristic; `"never"` uses the best reachable length),
     when k hypotheses are finished and `early_stopping=True`, or when every candidate stopped.
This is the algorithm of transformers' `GenerationMixin._beam_search` (v4.50+ / v5), with the
same `length_penalty` and `early_stopping` semantics, rewritten over the paged block manager.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence as Seq
from typing import Any

from jpaged.core.sampling_params import SamplingParams
from jpaged.core.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens, their summed log-probability, its length-penalised
    score and why it ended ("stop" or "length")."""

    score: float
    output_token_ids: tuple[int, ...]
    cumulative_logprob: float
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class BeamState:
    """A group's search state: finished hypotheses (best first, at most k) and whether running beams
    can still improve on them (sticky: once False, the search ends)."""

    finished: tuple[Hypothesis, ...] = ()
    improvable: bool = True


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A running beam extended by one token; `score` is the extended beam's summed log-probability."""

    parent: Sequence
    token_id: int
    logprob: float
    score: float

    def hypothesis(self, gen_len: int, length_penalty: float, reason: str) -> Hypothesis:
        return Hypothesis(length_normalized(self.score, gen_len, length_penalty),
                          (*self.parent.output_token_ids, self.token_id), self.score, reason)


def length_normalized(score: float, length: int, length_penalty: float) -> float:
    """`score / length ** length_penalty` (HF's), as float arithmetic has it where the power leaves the
    float range (a large |length_penalty|): past it, the power is inf and the result -0.0 (scores are
    sums of log-probabilities, <= 0); under it, the power is 0.0 and the result -inf."""
    try:
        power = float(length) ** length_penalty
    except OverflowError:
        power = math.inf
    return score / power if power else -math.inf


@dataclasses.dataclass(frozen=True)
class BeamDecision:
    """What one step of beam search decided (see the module docstring).

    beams: the next running beams, best first; the first candidate of each parent continues the
      parent in place, every later one forks it. Empty when the search is done.
    state: the group's new search state.
    """

    beams: tuple[Candidate, ...]
    state: BeamState

    @property
    def done(self) -> bool:
        return not self.beams


def step(state: BeamState, params: SamplingParams, beams: Seq[tuple[Sequence, Any, Any]],
         stop_token_ids: Collection[int], max_model_len: int) -> BeamDecision:
    """One token of beam search for a group. `beams`: (running beam, its top token ids, their
    log-probabilities), at least 2k of each, best first. `stop_token_ids`: the tokens that end a
    beam (EOS unless ignored, and the request's stop tokens)."""
    k = params.beam_width
    candidates = []
    for seq, top_ids, top_logprobs in beams:
        for token, logprob in zip(top_ids[:2 * k].tolist(), top_logprobs[:2 * k].tolist()):
            candidates.append(Candidate(seq, token, logprob, seq.cumulative_logprob + logprob))
    candidates.sort(key=lambda c: -c.score)
    candidates = candidates[:2 * k]
    gen_len = len(beams[0][0].output_token_ids) + 1  # all beams have the same length

    def stops(c: Candidate) -> bool:
        return c.token_id in stop_token_ids or gen_len >= params.max_tokens or c.parent.num_tokens + 1 >= max_model_len

    def reason(c: Candidate) -> str:
        return "stop" if c.token_id in stop_token_ids else "length"

    # finished hypotheses from the top-k candidates
    finished = list(state.finished)
    all_full = len(finished) == k and params.early_stopping is True
    for c in candidates[:k]:
        if stops(c) and state.improvable and not all_full:
            finished.append(c.hypothesis(gen_len, params.length_penalty, reason(c)))
    finished.sort(key=lambda h: -h.score)
    del finished[k:]

    # next running beams: the best k candidates that did not stop
    chosen = [c for c in candidates if not stops(c)][:k]

    # can a running beam still beat the worst of k finished hypotheses? (HF's heuristic, sticky)
    improvable = state.improvable
    if chosen:
        never = params.early_stopping == "never" and params.length_penalty > 0
        best_possible = length_normalized(chosen[0].score, params.max_tokens if never else gen_len,
                                          params.length_penalty)
        worst = finished[-1].score if len(finished) == k else -1e9
        improvable = improvable and best_possible > worst
    done = not chosen or not improvable or (len(finished) == k and params.early_stopping is True)
    if not done:
        return BeamDecision(tuple(chosen), BeamState(tuple(finished), improvable))
    if not finished:  # nothing stopped properly: the running beams, one token longer, are the answer
        finished = [c.hypothesis(gen_len, params.length_penalty, "length") for c in chosen]
    return BeamDecision((), BeamState(tuple(finished), improvable))
