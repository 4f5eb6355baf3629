"""Sequences and sequence groups: the host-side record of each request (no JAX).

One request is one `SequenceGroup`: its n parallel samples, or its beam candidates. A group is
scheduled, preempted and resumed as a whole.

Owners. The scheduler (`jpaged.core.scheduler`) owns every group's lifecycle: it alone sets a
group's `status`, its timestamps of scheduling and finishing, which sequences it holds (`seqs`:
forks, prunes) and every `Sequence.finish_reason`. The engine owns what is generated: it appends
sampled tokens (`Sequence.append_token`), detokenizes them (`text`, the offsets) and keeps the
beam-search state (`beam_state`) and the time of the first token.

KV invariant: a RUNNING sequence has every token but the last in the KV cache, and its last token
is written by the next decode step, except while its group's prompt is being prefilled in chunks
(`SequenceGroup.num_computed_tokens`: the first tokens computed so far of each sequence being
prefilled). A WAITING sequence has nothing cached (recompute re-prefills prompt + generated tokens).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Optional

from jpaged.core.sampling_params import SamplingParams


class GroupStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclasses.dataclass
class Sequence:
    """One sample (or beam candidate): prompt + generated tokens, and the text detokenized so far."""

    seq_id: int
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    output_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    text: str = ""
    # incremental detokenization offsets into output_token_ids
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def token_ids(self) -> list[int]:
        return list(self.prompt_token_ids) + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`token_ids[start:end]` (0 <= start <= end), without copying the whole history."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return list(self.prompt_token_ids[start:end]) + self.output_token_ids[:max(0, end - num_prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int, logprob: float, top_logprobs: Optional[dict[int, float]] = None) -> None:
        self.output_token_ids.append(int(token_id))
        self.cumulative_logprob += float(logprob)
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def fork(self, seq_id: int) -> "Sequence":
        """A copy sharing this sequence's history under a new id (beam search)."""
        return dataclasses.replace(self, seq_id=seq_id, output_token_ids=list(self.output_token_ids),
                                   output_logprobs=list(self.output_logprobs))


@dataclasses.dataclass
class SequenceGroup:
    """A request: its sampling parameters, live sequences, finished sequences and timestamps."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    seqs: list[Sequence]
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    status: GroupStatus = GroupStatus.WAITING
    beam_state: Any = None  # jpaged.core.beam_search.BeamState, for beam-search groups
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    error: Optional[str] = None  # why a step that ran it failed (its sequences then finish with "error")
    rank: Optional[int] = None  # data parallel: the partition of the pool it was placed on (kept when preempted)
    # chunked prefill: seq_id -> tokens whose K/V is in the cache or written by the steps scheduled so
    # far, for each sequence whose prompt (+ generated tokens, after a recompute) is being prefilled;
    # empty once the group decodes (and always under the prefill-first policy)
    num_computed_tokens: dict = dataclasses.field(default_factory=dict)

    @property
    def is_finished(self) -> bool:
        return self.status == GroupStatus.FINISHED

    @property
    def live_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:  # (most groups: one sample)
            return [] if seqs[0].finish_reason is not None else [seqs[0]]
        return [s for s in seqs if s.finish_reason is None]  # (`not s.finished`, without a call a sequence)
