"""Draft-token proposers for speculative decoding (host side, no JAX).

Speculative decoding: a decoding sequence proposes up to k draft tokens, and one step computes its
last token and the drafts together (each a row of one token at a lookahead slot past the sequence,
`jpaged.core.scheduler`), so that the target model scores all k + 1 positions at once; the sampler
accepts a prefix of the drafts and draws one more token (`jpaged.device.sampler`), and the block
manager gives back the slots of the rejected ones (`commit_lookahead`).

A proposer (`Proposer`) sees one sequence's tokens (prompt + generated) and returns at most
`num_tokens` draft tokens, possibly none. Its proposals are deterministic (a point mass), which is
what makes the sampler's acceptance rule exact: a draft d is accepted with the target's probability
p(d), and a rejected position draws from p with d removed, so every emitted token follows the target
distribution (Leviathan et al., 2023, with q = the point mass on d).

`NgramProposer`: prompt lookup (vLLM's `ngram` method; llama.cpp's lookup decoding): the longest
suffix of the sequence, between `prompt_lookup_min` and `prompt_lookup_max` tokens, that occurred
earlier in it, and the tokens that followed its latest earlier occurrence. Free, and right often
where the output copies its input (editing, summarizing, code).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence as Seq

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class Proposer(Protocol):
    """Draft tokens for one sequence: at most `num_tokens`, deterministic in `token_ids`."""

    name: str

    def propose(self, token_ids: Seq[int], num_tokens: int) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: see the module docstring. `prompt_lookup_min` <= `prompt_lookup_max`, both >= 1."""

    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    name: str = "ngram"

    def __post_init__(self):
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, "
                             f"got {lo!r} and {hi!r}")

    def propose(self, token_ids: Seq[int], num_tokens: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        n_total = len(tokens)
        if num_tokens <= 0 or n_total < 2:
            return []
        for n in range(min(self.prompt_lookup_max, n_total - 1), self.prompt_lookup_min - 1, -1):
            # windows starting before the suffix itself: start + n <= n_total - 1, so a token follows
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest earlier occurrence
                return tokens[start:start + num_tokens].tolist()
        return []


SPECULATIVE_METHODS = ("ngram",)


def make_proposer(method: str, *, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> Proposer:
    """The proposer of a `--speculative-method` (vLLM's names)."""
    if method == "ngram":
        return NgramProposer(prompt_lookup_min, prompt_lookup_max)
    raise ValueError(f"speculative_method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}, "
                     f"got {method!r}")
