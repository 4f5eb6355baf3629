"""Speculative decoding: the n-gram proposer, the block manager's lookahead slots (drafts take slots and
give back the rejected ones: no block leaks), the sampler's exact acceptance (a chi-square test that
fails when acceptance is broken), and the engine: greedy tokens identical with speculation on and off
over a mix with preemption in both modes, prefix caching, stop strings and beam search; seeded n = 2
sampling reproducible."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import SamplingParams
from jpaged.core.block_manager import BlockManager
from jpaged.core.proposer import NgramProposer, check_method
from jpaged.device.sampler import SamplingInputs, sample


# ---- the n-gram proposer -----------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert p.lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert p.lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], 2) == [7, 2]  # 2, 3 last seen before 7
    assert p.lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], 5) == [7, 2, 3]  # no further than the sequence
    assert p.lookup([5, 6, 7], 2) == [] and p.lookup([5], 2) == [] and p.lookup([1, 2, 1], 0) == []
    # the longest suffix wins: 8, 1 matched (-> 5), not 1 alone (-> 9, its latest occurrence)
    assert NgramProposer(1, 2).lookup([8, 1, 5, 1, 9, 8, 1], 1) == [5]
    assert NgramProposer(2, 2).lookup([1, 9, 1], 1) == []  # shorter suffixes than min are not tried


def test_bad_proposer_settings_are_refused():
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="speculative_method must be one of 'ngram', 'draft-layers'"):
        check_method("eagle")


# ---- lookahead slots -------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_lookahead_slots_come_back_whatever_is_accepted(seed):
    """Random appends with lookahead slots, forks sharing blocks (copy-on-write), prefix caching,
    accepted prefixes of every length: invariants after every operation, every block free at the end,
    and a committed token's block holds what a plain append would have put there."""
    rng = random.Random(seed)
    bm = BlockManager.create(256, 4, enable_prefix_caching=rng.random() < 0.5)
    plain = BlockManager.create(256, 4, enable_prefix_caching=bm.enable_prefix_caching)
    tokens = {}
    for sid in range(3):
        tokens[sid] = [rng.randrange(9) for _ in range(rng.randrange(1, 9))]
        bm, _ = bm.allocate(sid, tokens[sid])
        plain, _ = plain.allocate(sid, tokens[sid])
    bm, plain = bm.fork(0, 3), plain.fork(0, 3)
    tokens[3] = list(tokens[0])
    for _ in range(25):
        sids = rng.sample(sorted(tokens), rng.randrange(1, len(tokens) + 1))
        k = rng.randrange(0, 6)
        appends = [(s, rng.randrange(9)) for s in sids]
        need = bm.num_blocks_to_append(sids, lookahead=k)
        before = bm.num_free_blocks
        bm, _ = bm.append(appends, lookahead=k)
        assert before - bm.num_free_blocks == need
        bm.check_invariants()
        plain, _ = plain.append(appends)
        for s, t in appends:
            tokens[s].append(t)
            accepted = [rng.randrange(9) for _ in range(rng.randrange(0, k + 1))]
            assert len(bm.slot_mapping(s, 0, len(tokens[s]) + k)) == len(tokens[s]) + k
            bm = bm.commit_lookahead(s, accepted)
            bm.check_invariants()
            if accepted:
                plain, _ = plain.append([(s, accepted[0])])
                for t2 in accepted[1:]:
                    plain, _ = plain.append([(s, t2)])
            tokens[s] += accepted
            assert bm.num_tokens(s) == len(tokens[s]) == plain.num_tokens(s)
    assert bm.stats()["num_used_blocks"] == plain.stats()["num_used_blocks"]
    assert bm.stats()["num_cached_blocks"] == plain.stats()["num_cached_blocks"]
    bm = bm.free(list(tokens))
    bm.check_invariants()
    assert bm.num_free_blocks == 255


def test_a_sequence_holding_lookahead_slots_is_not_forked_swapped_or_appended_to():
    bm = BlockManager.create(16, 4, num_cpu_blocks=8)
    bm, _ = bm.allocate("a", [1, 2, 3])
    bm, _ = bm.append([("a", 4)], lookahead=3)
    for op in (lambda: bm.fork("a", "b"), lambda: bm.swap_out(["a"]), lambda: bm.append([("a", 5)])):
        with pytest.raises(ValueError, match="lookahead slots"):
            op()
    with pytest.raises(ValueError, match="holds 3 lookahead slots"):
        bm.commit_lookahead("a", [1, 2, 3, 4])


# ---- exact acceptance ----------------------------------------------------------------------------

VOCAB = 8
CRITICAL_CHI2_7_DF = 24.32  # chi-square, 7 degrees of freedom, p = 0.001


def _target(logits, temperature, top_k):
    scaled = np.asarray(logits, np.float64) / temperature
    if top_k:
        scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


def _chi2(counts, p):
    n = counts.sum()
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    return float(((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())


def _draw_with_draft(logits, draft, temperature, top_k, n, break_acceptance=False):
    rows = jnp.zeros(n, jnp.int32)
    params = SamplingInputs(temperature=jnp.full(n, temperature, jnp.float32), top_k=jnp.full(n, top_k, jnp.int32),
                            top_p=jnp.ones(n, jnp.float32), seed=jnp.arange(n, dtype=jnp.uint32) * 7919,
                            sample_index=jnp.zeros(n, jnp.int32), step=jnp.arange(n, dtype=jnp.int32),
                            draft=jnp.full(n, draft, jnp.int32))
    out = sample(jnp.asarray(logits, jnp.float32)[None], rows, params, num_top=0, use_filter=top_k > 0,
                 use_random=True)
    tokens = np.asarray(out.token_ids)
    if break_acceptance:  # a broken rule: every rejected draw replaced by the draft (always accept)
        tokens = np.full_like(tokens, draft)
    return tokens, np.asarray(out.accepted)


@pytest.mark.parametrize("temperature, top_k, draft", [(1.0, 0, 1), (0.7, 0, 5), (1.3, 5, 0), (1.0, 4, 7)])
def test_sampled_tokens_with_a_draft_follow_the_target_distribution(temperature, top_k, draft):
    logits = np.array([2.0, 1.5, 0.3, -0.5, 1.0, 0.0, -1.0, 0.8])
    p = _target(logits, temperature, top_k)
    tokens, accepted = _draw_with_draft(logits, draft, temperature, top_k, 20000)
    counts = np.bincount(tokens, minlength=VOCAB)
    assert _chi2(counts, p) < CRITICAL_CHI2_7_DF, (counts / counts.sum(), p)
    # a draft is accepted with the target's probability of it (outside the support: never)
    assert abs(accepted.mean() - p[draft]) < 4 * np.sqrt(max(p[draft] * (1 - p[draft]), 1e-9) / len(accepted))
    assert np.all(tokens[accepted] == draft)


def test_the_chi_square_test_fails_when_acceptance_is_broken():
    logits = np.array([2.0, 1.5, 0.3, -0.5, 1.0, 0.0, -1.0, 0.8])
    p = _target(logits, 1.0, 0)
    tokens, _ = _draw_with_draft(logits, 1, 1.0, 0, 20000, break_acceptance=True)
    assert _chi2(np.bincount(tokens, minlength=VOCAB), p) > CRITICAL_CHI2_7_DF
    # and so does a sampler that draws the residual without removing the draft: over-represents it
    tokens, accepted = _draw_with_draft(logits, 1, 1.0, 0, 20000)
    rng = np.random.default_rng(0)
    redrawn = np.where(accepted, 1, rng.choice(VOCAB, size=len(tokens), p=p))  # p itself, draft not removed
    assert _chi2(np.bincount(redrawn, minlength=VOCAB), p) > CRITICAL_CHI2_7_DF


def test_greedy_rows_accept_the_argmax_only_and_rows_without_drafts_draw_as_before():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 50)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    n = 4
    base = dict(temperature=jnp.asarray([0.0, 0.0, 1.0, 1.0], jnp.float32), top_k=jnp.zeros(n, jnp.int32),
                top_p=jnp.ones(n, jnp.float32), seed=jnp.arange(n, dtype=jnp.uint32),
                sample_index=jnp.zeros(n, jnp.int32), step=jnp.full(n, 3, jnp.int32))
    rows = jnp.arange(n, dtype=jnp.int32)
    plain = sample(logits, rows, SamplingInputs(**base), num_top=0)
    none = sample(logits, rows, SamplingInputs(**base, draft=jnp.full(n, -1, jnp.int32)), num_top=0)
    assert np.array_equal(plain.token_ids, none.token_ids) and not np.asarray(none.accepted).any()
    drafts = jnp.asarray([argmax[0], (argmax[1] + 1) % 50, -1, -1], jnp.int32)
    out = sample(logits, rows, SamplingInputs(**base, draft=drafts), num_top=0)
    assert list(np.asarray(out.accepted)[:2]) == [True, False]
    assert list(np.asarray(out.token_ids)[:2]) == list(argmax[:2])
    assert np.array_equal(np.asarray(out.token_ids)[2:], np.asarray(plain.token_ids)[2:])


# ---- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def copy_mix(alpaca_prompts):
    """(prompts, params): requests whose outputs copy their prompts (the n-gram proposer's case) and
    plain chat ones; greedy, a stop string, beam search (which drafts nothing)."""
    passage = " ".join(alpaca_prompts[:6])
    copy = [f"{passage}\n\nRepeat the text above word for word:", f"Text: {alpaca_prompts[7]} {alpaca_prompts[8]}\n"
            f"Again: {alpaca_prompts[7]}"]
    chat = alpaca_prompts[10:14]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = copy + chat
    params = [greedy, greedy, SamplingParams(temperature=0, max_tokens=24, stop=["answer"]), greedy,
              SamplingParams(beam_width=2, max_tokens=12, ignore_eos=True), greedy]
    return prompts, params


def _run(llm, mix):
    prompts, params = mix
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def plain_outputs(make_llm, copy_mix):
    return _run(make_llm(num_blocks=512), copy_mix)


@pytest.mark.parametrize("blocks, mode, caching", [(512, "recompute", True), (18, "recompute", False),
                                                    (18, "swap", True)])
def test_greedy_tokens_are_identical_with_speculation_on_and_off(make_llm, copy_mix, plain_outputs, blocks, mode,
                                                                 caching):
    llm = make_llm(num_blocks=blocks, speculative_method="ngram", num_speculative_tokens=4, preemption_mode=mode,
                   swap_space=0.25 if mode == "swap" else 0.0, enable_prefix_caching=caching, watermark=0.0)
    outputs = _run(llm, copy_mix)
    assert outputs == plain_outputs
    assert outputs[2][0][2] == "stop" and "answer" not in outputs[2][0][1]
    stats = llm.engine.stats()
    spec = stats["spec_decode"]
    assert spec["num_accepted"] > 0 and 0 < spec["acceptance_rate"] < 1, spec
    if blocks < 512:
        assert stats["num_preemptions"] > 0, "the pool was meant to be too small"
    assert stats["num_free_blocks"] == llm.engine.num_blocks - 1 and stats["num_used_cpu_blocks"] == 0
    llm.engine.scheduler.block_manager.check_invariants()


def test_speculation_takes_fewer_steps_on_a_copy_and_seeded_sampling_is_reproducible(make_llm, copy_mix):
    prompts = copy_mix[0][:1]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    steps = {}
    for k in (0, 4):
        llm = make_llm(num_blocks=128, **({"speculative_method": "ngram", "num_speculative_tokens": k} if k else {}))
        llm.generate(prompts, greedy, use_tqdm=False)
        steps[k] = llm.engine.num_steps
    assert steps[4] < steps[0] * 0.8, steps
    seeded = SamplingParams(temperature=0.8, seed=42, n=2, max_tokens=24, ignore_eos=True)
    runs = [[c.token_ids for c in llm.generate(prompts, seeded, use_tqdm=False)[0].outputs] for _ in range(2)]
    assert runs[0] == runs[1] and [len(t) for t in runs[0]] == [24, 24] and runs[0][0] != runs[0][1]
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.num_blocks - 1


def test_seeded_samples_are_the_same_with_speculation_on_or_off_alone_or_in_a_batch(make_llm, copy_mix):
    """A sampled position draws its token with its own key whether a draft sits there or not (the draft
    is accepted when it is that token): a seeded request's tokens depend neither on how many drafts it
    gets, which the other requests' blocks and the token budget decide, nor on speculation itself."""
    prompts = [copy_mix[0][1], copy_mix[0][0], *copy_mix[0][2:]]  # the first: a copy its samples follow
    seeded = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def samples(llm, with_others: bool):
        outs = llm.generate(prompts if with_others else prompts[:1],
                            [seeded] + [greedy] * (len(prompts) - 1) if with_others else seeded, use_tqdm=False)
        return [c.token_ids for c in outs[0].outputs]

    plain = samples(make_llm(num_blocks=256), False)
    assert len(plain) == 2 and plain[0] != plain[1]
    spec = make_llm(num_blocks=256, speculative_method="ngram", num_speculative_tokens=4)
    assert samples(spec, False) == plain
    assert spec.engine.stats()["spec_decode"]["num_accepted"] > 0
    tight = make_llm(num_blocks=48, max_num_batched_tokens=64, speculative_method="ngram",
                     num_speculative_tokens=4, watermark=0.0)
    assert samples(tight, True) == plain
    assert tight.engine.stats()["num_free_blocks"] == tight.engine.num_blocks - 1


def test_bad_speculative_settings_are_refused_before_loading(make_llm):
    with pytest.raises(ValueError, match="num_speculative_tokens >= 1"):
        make_llm(speculative_method="ngram")
    with pytest.raises(ValueError, match="needs a speculative_method"):
        make_llm(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        make_llm(speculative_method="medusa", num_speculative_tokens=3)


def test_self_drafting_keeps_the_greedy_tokens_under_preemption_and_leaks_no_block(make_llm, copy_mix,
                                                                                  plain_outputs):
    llm = make_llm(num_blocks=18, speculative_method="draft-layers", num_speculative_tokens=2,
                   speculative_draft_layers=24, watermark=0.0)
    assert _run(llm, copy_mix) == plain_outputs
    stats = llm.engine.stats()
    assert stats["spec_decode"]["method"] == "draft-layers" and stats["spec_decode"]["num_accepted"] > 0
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small"
    assert stats["num_free_blocks"] == llm.engine.num_blocks - 1
    llm.engine.scheduler.block_manager.check_invariants()


def test_the_warm_up_covers_speculative_steps(make_llm):
    llm = make_llm(max_num_seqs=2, max_model_len=48, max_num_batched_tokens=32, num_blocks=8,
                   speculative_method="draft-layers", num_speculative_tokens=2, speculative_draft_layers=4)
    summary = llm.engine.warm_up()
    assert summary.executables["draft_step"] == summary.executables["decode_step"] > 0
    ids = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(100, 125))]
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=1, ignore_eos=True)]
    outs = llm.generate(ids, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 10]
    assert llm.engine.stats()["spec_decode"]["num_proposed"] > 0
    assert llm.engine.stats()["num_compilations_after_warm_up"] == 0


def test_self_drafting_with_too_many_layers_is_refused(make_llm):
    with pytest.raises(ValueError, match="fewer layers than the model's 30"):
        make_llm(speculative_method="draft-layers", num_speculative_tokens=2, speculative_draft_layers=30)
