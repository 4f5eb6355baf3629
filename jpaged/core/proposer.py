"""Draft-token proposers for speculative decoding (host side, no JAX).

Speculative decoding: a decoding sequence proposes up to k draft tokens, and one step computes its
last token and the drafts together (each a row of one token at a lookahead slot past the sequence,
`jpaged.core.scheduler`), so that the target model scores all k + 1 positions at once; the sampler
accepts a prefix of the drafts and draws one more token (`jpaged.device.sampler`), and the block
manager gives back the slots of the rejected ones (`commit_lookahead`).

A proposer (`Proposer`) is asked, once a step, for the drafts of every sequence granted lookahead
slots (`DraftRequest`: the sequence, the most drafts it may take, and where the K/V of the draft
inputs goes: a proposer that runs a model, such as self-drafting, `jpaged.engine.draft`, writes its
layers' K/V there, and the verification rewrites them); it returns at most that many draft tokens per
sequence, possibly none. Proposers are asked once the step's block operations (swaps, copies) are
applied on the device (`Scheduler.propose_drafts`), so one that runs the model reads the pool as the
step does. Its proposals are deterministic (a point mass), which is what makes the sampler's
acceptance rule exact: a position draws its token from the target distribution p as it would without
a draft, and the draft d is accepted when it is that token, with probability p(d); a rejection emits a
token of p with d removed, so every emitted token follows p (Leviathan et al., 2023, with q = the point
mass on d, coupled to the draw made without speculation).

`NgramProposer`: prompt lookup (vLLM's `ngram` method; llama.cpp's lookup decoding): the longest
suffix of the sequence, between `prompt_lookup_min` and `prompt_lookup_max` tokens, that occurred
earlier in it, and the tokens that followed its latest earlier occurrence. Free, and right often
where the output copies its input (editing, summarizing, code).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence as Seq

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """A decoding sequence's request for at most `num_tokens` drafts. The drafts' inputs are its last
    token and then its drafts but the last, at positions num_tokens_before - 1, ... where
    num_tokens_before = len(seq.token_ids); `slots[j]` is where input j's K/V goes (the last token's
    slot, then the lookahead slots) and `block_table` the sequence's table, lookahead blocks included."""

    seq: Any  # jpaged.core.sequence.Sequence
    num_tokens: int
    slots: tuple[int, ...]
    block_table: tuple[int, ...]


class Proposer(Protocol):
    """Draft tokens for each request: at most its `num_tokens`, deterministic in its sequence."""

    name: str

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]: ...


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

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        return [self.lookup(r.seq.token_ids, r.num_tokens) for r in requests]

    def lookup(self, token_ids: Seq[int], num_tokens: int) -> list[int]:
        """At most `num_tokens` drafts for a sequence of these tokens."""
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


# "draft-layers": self-drafting, the served model's first layers as the draft (`jpaged.engine.draft`)
SPECULATIVE_METHODS = ("ngram", "draft-layers")


def check_method(method: str) -> None:
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}, "
                         f"got {method!r}")
