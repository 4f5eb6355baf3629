"""Beam search built only from fork / append / free, matching HF transformers' beam search.

A beam group's live sequences are its running beams (one, the prompt, before the first token).
Each step, for `k = beam_width`:
  1. candidates: the best `2k` of (beam score + log p(token)) over all beams and tokens;
  2. a candidate that hits a stopping condition (EOS / stop token, `max_tokens`, the context) and
     ranks among the first k becomes a finished hypothesis scored
     `sum_logprobs / num_generated_tokens ** length_penalty`; the best k hypotheses are kept;
  3. the best k candidates that did not stop become the next running beams: a beam chosen once
     continues in place, a beam chosen j > 1 times is forked j - 1 times (sharing all its blocks,
     copy-on-write on the next write), a beam not chosen is freed;
  4. the search ends when no running beam can beat the worst of k finished hypotheses (HF's
     `early_stopping=False` heuristic; `"never"` uses the best reachable length), when k
     hypotheses are finished and `early_stopping=True`, or when every candidate stopped.
This is the algorithm of transformers' `GenerationMixin._beam_search` (v4.50+ / v5), with the
same `length_penalty` and `early_stopping` semantics, rewritten over the paged block manager.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jpaged.sequence import Sequence, SequenceGroup


@dataclasses.dataclass
class BeamState:
    """Per-group search state: finished hypotheses (best first) and whether running beams can still improve."""

    finished: list[tuple[float, Sequence]] = dataclasses.field(default_factory=list)
    improvable: bool = True


def _state(group: SequenceGroup) -> BeamState:
    if group.beam_state is None:
        group.beam_state = BeamState()
    return group.beam_state


def step(engine, group: SequenceGroup, beams: list[tuple[Sequence, Any, Any]]) -> None:
    """Advances `group` by one token. `beams`: (running beam, top token ids, their log-probs), top >= 2k."""
    p = group.params
    k = p.beam_width
    state = _state(group)
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(engine.eos_token_ids))
    candidates = []
    for seq, top_ids, top_logprobs in beams:
        for token, logprob in zip(top_ids[:2 * k].tolist(), top_logprobs[:2 * k].tolist()):
            candidates.append((seq.cumulative_logprob + logprob, seq, token, logprob))
    candidates.sort(key=lambda c: -c[0])
    candidates = candidates[:2 * k]
    gen_len = len(beams[0][0].output_token_ids) + 1  # all beams have the same length

    def stops(seq: Sequence, token: int) -> bool:
        return token in stop_ids or gen_len >= p.max_tokens or seq.num_tokens + 1 >= engine.max_model_len

    # finished hypotheses from the top-k candidates
    all_full = len(state.finished) == k and p.early_stopping is True
    for score, seq, token, logprob in candidates[:k]:
        if stops(seq, token) and state.improvable and not all_full:
            hyp = seq.fork(-1)
            hyp.append_token(token, logprob)
            hyp.finish_reason = "stop" if token in stop_ids else "length"
            state.finished.append((score / gen_len ** p.length_penalty, hyp))
    state.finished.sort(key=lambda f: -f[0])
    del state.finished[k:]

    # next running beams: the best k candidates that did not stop
    chosen = [c for c in candidates if not stops(c[1], c[2])][:k]
    targets, seen = [], set()
    for _, parent, token, logprob in chosen:
        if parent.seq_id in seen:  # chosen again: fork before anything is appended to the parent
            child = parent.fork(engine.new_seq_id())
            engine.scheduler.fork_seq(parent, child)
            targets.append((child, token, logprob))
        else:
            seen.add(parent.seq_id)
            targets.append((parent, token, logprob))
    for seq, _, _ in beams:
        if seq.seq_id not in seen:
            engine.scheduler.free_seq(seq)
    for seq, token, logprob in targets:
        seq.append_token(token, logprob)
    group.seqs = [seq for seq, _, _ in targets]

    # can a running beam still beat the worst of k finished hypotheses? (HF's heuristic, sticky)
    if chosen:
        never = p.early_stopping == "never" and p.length_penalty > 0
        best_possible = chosen[0][0] / (p.max_tokens if never else gen_len) ** p.length_penalty
        worst = state.finished[-1][0] if len(state.finished) == k else -1e9
        state.improvable = state.improvable and best_possible > worst
    done = not chosen or not state.improvable or (len(state.finished) == k and p.early_stopping is True)
    if done:
        for seq in group.seqs:
            engine.scheduler.free_seq(seq)
        if not state.finished:  # nothing stopped properly: the running beams are the answer
            state.finished = [(s.cumulative_logprob / gen_len ** p.length_penalty, s) for s in group.seqs]
            for s in group.seqs:
                s.finish_reason = "length"
        for _, hyp in state.finished:
            hyp.text = engine.tokenizer.decode(hyp.output_token_ids, skip_special_tokens=True)
        group.seqs = []


def ranked(group: SequenceGroup) -> list[Sequence]:
    """The group's beams, best first: finished hypotheses once done, else the running beams."""
    state = _state(group)
    if not group.seqs:
        return [hyp for _, hyp in state.finished]
    return sorted(group.seqs, key=lambda s: -s.cumulative_logprob)
