"""Beam search against HF transformers' `generate(num_beams=k)` on the same GGUF weights.

Matched settings: transformers 5.x `GenerationMixin._beam_search` with `do_sample=False`,
`num_return_sequences=k`, and HF's defaults `length_penalty=1.0`, `early_stopping=False` (plus
one run with `early_stopping=True`). Prompts run one at a time in HF (no padding). The best beam
must always match; all k beams must match where HF's ranking is well defined (consecutive
sequence scores more than 1e-4 apart).
"""

from __future__ import annotations

import pytest
import torch

from conftest import scattered_blocks
from jpaged import LLM, SamplingParams

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def beam_llm(default_model):
    return LLM(loaded=default_model, num_blocks=512, block_size=4, kv_cache_manager=scattered_blocks(seed=0))


@pytest.fixture(scope="module")
def beam_prompts(beam_llm, alpaca_prompts):
    return [beam_llm.chat_prompt([{"role": "user", "content": p}]) for p in alpaca_prompts[10:14]]


def hf_beams(hf_model, prompt_ids, k, length_penalty, early_stopping):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), num_beams=k, num_return_sequences=k, do_sample=False,
                                max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
                                early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=hf_model.config.eos_token_id)
    eos = hf_model.config.eos_token_id
    beams = []
    for seq in out.sequences[:, len(prompt_ids):].tolist():
        if eos in seq:  # HF pads finished beams after their EOS
            seq = seq[:seq.index(eos) + 1]
        beams.append(seq)
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize("k, length_penalty, early_stopping", [(2, 1.0, False), (4, 1.0, False), (4, 0.5, True)])
def test_beam_search_matches_hf(beam_llm, beam_prompts, hf_default_model, k, length_penalty, early_stopping):
    params = SamplingParams(beam_width=k, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    outs = beam_llm.generate(beam_prompts, params, use_tqdm=False)  # all prompts decoded together
    for prompt, out in zip(beam_prompts, outs):
        expected, scores = hf_beams(hf_default_model, prompt["prompt_token_ids"], k, length_penalty, early_stopping)
        got = [o.token_ids for o in out.outputs]
        assert len(got) == k
        assert got[0] == expected[0], "best beam differs from HF"
        for i in range(1, k):
            well_defined = abs(scores[i] - scores[i - 1]) > 1e-4 and (i + 1 == k or abs(scores[i + 1] - scores[i]) > 1e-4)
            if well_defined:
                assert got[i] == expected[i], f"beam {i} differs from HF"
    stats = beam_llm.engine.stats()
    assert stats["num_free_blocks"] == beam_llm.engine.num_blocks - 1
    beam_llm.engine.scheduler.block_manager.check_invariants()


def test_beams_share_blocks_as_a_tree(beam_llm, beam_prompts):
    """While decoding, beams forked from one parent hold the prompt's blocks once (refcount > 1)."""
    engine = beam_llm.engine
    engine.add_request("tree", beam_prompts[0], SamplingParams(beam_width=4, max_tokens=MAX_TOKENS))
    shared_seen = False
    while engine.has_unfinished():
        engine.step()
        bm = engine.scheduler.block_manager
        if engine.scheduler.running:
            group = engine.scheduler.running[0]
            tables = [bm.block_table(s.seq_id) for s in group.seqs]
            first = tables[0][0]
            if len(tables) > 1 and all(t[0] == first for t in tables):
                assert bm.refcount(first) == len(tables)
                shared_seen = True
            bm.check_invariants()
    assert shared_seen
    assert engine.stats()["num_free_blocks"] == engine.num_blocks - 1


@pytest.mark.parametrize("length_penalty", [400.0, -400.0])
def test_length_penalties_past_the_float_range_do_not_fail_the_step(beam_llm, beam_prompts, length_penalty):
    """gen_len ** length_penalty overflows (or underflows to 0) here: the scores follow float arithmetic
    (-0.0, or -inf) instead of raising in the step, which would fail every request in it."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = beam_llm.generate([beam_prompts[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    beams, plain = beam_llm.generate(beam_prompts[:2], [
        SamplingParams(beam_width=2, length_penalty=length_penalty, max_tokens=8), greedy], use_tqdm=False)
    assert len(beams.outputs) == 2 and all(o.token_ids and o.finish_reason in ("stop", "length")
                                           for o in beams.outputs), beams.outputs
    assert plain.outputs[0].token_ids == alone and plain.outputs[0].finish_reason == "length"
    assert beam_llm.engine.stats()["num_free_blocks"] == beam_llm.engine.num_blocks - 1
