"""Self-drafting: the served model's first layers as its own draft model (speculative decoding's
`draft-layers` method, the early exit of LayerSkip and of "draft & verify"), needing no other weights.

The draft of a sequence is the model cut after its first `num_layers` layers, with the model's own
final norm and LM head, run greedily (so that its proposals are a point mass: the sampler's
acceptance stays exact, `jpaged.core.proposer`). Drafting k tokens is k decode-shaped steps of those
layers over every requesting sequence at once (`ModelRunner.draft`): step j reads the sequence's last
token (j = 0) or its draft j - 1, at the slot the scheduler gave it (`DraftRequest.slots[j]`: the
last token's own slot, then the lookahead slots), and writes the first layers' K/V there. Those
layers' K/V of the context are the served model's own (the same weights on the same tokens), so the
draft needs no cache of its own; the verification step that follows writes every layer at the same
slots again, and the slots of rejected drafts are given back (`commit_lookahead`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence as Seq

from jpaged.core.proposer import DraftRequest
from jpaged.core.scheduler import Row
from jpaged.device.batch import StepShapes
from jpaged.device.runner import ModelRunner


@dataclasses.dataclass
class SelfDraftProposer:
    """A `jpaged.core.proposer.Proposer` over `runner`'s model: its first `num_layers` layers.
    `shapes`: the engine's step buckets (decode steps), so that drafting meets only warmed shapes."""

    runner: ModelRunner
    num_layers: int
    shapes: Optional[StepShapes] = None
    name: str = "draft-layers"

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        for j in range(max((r.num_tokens for r in requests), default=0)):
            active = [i for i, r in enumerate(requests) if r.num_tokens > j]
            rows = []
            for i in active:
                r = requests[i]
                position = r.seq.num_tokens - 1 + j
                token = r.seq.last_token_id if j == 0 else drafts[i][-1]
                rows.append(Row(token_ids=[token], start_position=position, slots=[r.slots[j]],
                                block_table=r.block_table))
            tokens = self.runner.draft(rows, num_layers=self.num_layers, shapes=self.shapes)
            for i, token in zip(active, tokens.tolist()):
                drafts[i].append(int(token))
        return drafts
