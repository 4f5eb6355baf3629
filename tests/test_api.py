"""The public Python API (`LLM`, `SamplingParams`): input validation, output shape and order,
finish reasons, max_tokens, seeded sampling, stop strings, block accounting and the number of
compiled executables over a mixed run. (The CLI has its own tests.)"""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import LLM_NUM_BLOCKS, chat_token_ids
from jpaged import LLM, RequestOutput, SamplingParams

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
GOOD = ["The capital of France is", "List three colors:"]


def assert_idle(llm: LLM) -> None:
    """Nothing queued, running or swapped, and every block but the null block is free."""
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished()
    assert (stats["waiting"], stats["running"], stats["swapped"], stats["num_seqs"]) == (0, 0, 0, 0)
    assert stats["num_free_blocks"] == llm.engine.num_blocks - 1


def assert_rejected_then_recovers(llm: LLM, bad_prompt, match: str, params=None) -> None:
    """A batch with one bad prompt (index 1) raises ValueError saying what to change, runs nothing
    (not even the good prompts), and the same LLM then completes a valid batch normally."""
    params = params or SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    steps_before = llm.engine.stats()["num_steps"]
    with pytest.raises(ValueError, match=match) as e:
        llm.generate([GOOD[0], bad_prompt, GOOD[1]], params, use_tqdm=False)
    assert str(e.value).startswith("prompt 1: ")
    assert llm.engine.stats()["num_steps"] == steps_before  # the good prompts were not run either
    assert_idle(llm)
    outs = llm.generate(GOOD, params, use_tqdm=False)
    assert [o.prompt for o in outs] == GOOD  # only this batch's requests come back
    assert all(o.finished and len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    assert_idle(llm)


# ---------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("bad_prompt, match", [
    ("", "prompt is empty: give at least one non-blank character"),
    ("   ", "prompt is empty: give at least one non-blank character"),
    ([], "prompt is empty: give at least one token id"),
    ([1, 2, 10**6], r"token id 1000000 is outside the vocabulary \[0, 49152\)"),
    (3.5, "a prompt must be a string or a list of token ids, got float"),
], ids=["empty", "blank", "no_tokens", "token_out_of_vocab", "not_a_prompt"])
def test_bad_prompt_is_rejected_and_nothing_runs(llm, bad_prompt, match):
    assert_rejected_then_recovers(llm, bad_prompt, match)


def test_prompt_longer_than_context_is_rejected(llm):
    max_len = llm.engine.max_model_len
    assert max_len == llm.engine.model.config.max_position_embeddings
    long_prompt = [42] * max_len
    n = max_len - 1
    assert_rejected_then_recovers(llm, long_prompt, f"prompt is {max_len} tokens but the model's context is "
                                                    f"{max_len}: shorten it to at most {n} tokens")


def test_prompt_larger_than_kv_pool_is_rejected(make_llm):
    """num_blocks=3 is two usable blocks of 4 tokens: a 20-token prompt can never fit."""
    small = make_llm(block_size=4, num_blocks=3)
    prompt = list(range(100, 120))
    with pytest.raises(ValueError, match=r"prompt 0: prompt of 20 tokens needs 5 KV blocks of 4 tokens but "
                                         r"the pool has 2: raise num_blocks / kv_cache_memory"):
        small.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: prompt of 20 tokens needs 5 KV blocks"):
        small.generate([[100, 101], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert small.engine.stats()["num_steps"] == 0
    assert_idle(small)
    outs = small.generate([[100, 101, 102]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4 and outs[0].outputs[0].finish_reason == "length"
    assert_idle(small)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(temperature=-1), r"temperature must be a number >= 0 \(0 = greedy\), got -1"),
    (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-2), r"top_k must be an integer in \[0, 2\*\*31\) \(0 or -1 = off\), got -2"),
    (dict(top_k=2**31), r"top_k must be an integer in \[0, 2\*\*31\)"),
    (dict(seed=-3), r"seed must be None or an integer in \[0, 2\*\*32\)"),
    (dict(n=0), "n must be an integer >= 1"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_scalars_are_numbers_in_sampling_params(llm):
    """NumPy's integers and floats pass where Python's do and are kept as Python's: the same request."""
    ours = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int32(20),
                          max_tokens=np.int64(6), seed=np.uint32(3), n=np.int16(2), logprobs=np.int8(1))
    python = SamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_tokens=6, seed=3, n=2, logprobs=1)
    assert ours == python and type(ours.max_tokens) is int and type(ours.temperature) is float
    outputs = [[c.token_ids for c in llm.generate(["Name a color."], p, use_tqdm=False)[0].outputs]
               for p in (ours, python)]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 2
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.float64(4.0))


def test_sampling_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts: pass one, or one per prompt"):
        llm.generate(GOOD, [SamplingParams()], use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize("given, match", [
    ({"temperature": 0}, r"got dict: pass SamplingParams\(\*\*it\)"),
    ([{"temperature": 0}], "got a list holding dict"),
    (0.5, "got float"),
])
def test_sampling_params_of_another_type_are_refused(llm, given, match):
    """A dict of fields (or anything but SamplingParams) is a TypeError saying what to pass, before any request."""
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, " + match):
        llm.generate(GOOD[:1], given, use_tqdm=False)
    assert_idle(llm)


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_bad_engine_config(default_model):
    with pytest.raises(ValueError, match=r"block_size must be a power of two \(e.g. 16\), got 12"):
        LLM(loaded=default_model, block_size=12)
    with pytest.raises(ValueError, match=r"num_blocks must be an integer >= 2 \(block 0 is the reserved null block\)"):
        LLM(loaded=default_model, num_blocks=1)
    with pytest.raises(ValueError, match=r"block_size must be a power of two \(e.g. 16\), got True"):
        LLM(loaded=default_model, block_size=True)  # (a bool is no integer here)
    with pytest.raises(ValueError, match="max_num_seqs must be"):
        LLM(loaded=default_model, max_num_seqs=True)


def test_bad_model_paths(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=re.escape(f"{missing}: no such file or directory; expected a .gguf file")):
        LLM(model=str(missing), num_blocks=8)
    (tmp_path / "notes.txt").write_text("not a model\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: unsupported; expected a .gguf file or a "
                                                   f"directory with config.json and *.safetensors")):
        LLM(model=str(tmp_path), num_blocks=8)


# ---------------------------------------------------------------- outputs

def test_num_blocks_counts_the_null_block(llm):
    assert llm.engine.num_blocks == LLM_NUM_BLOCKS
    assert llm.engine.runner.cache.kv.shape[1] == LLM_NUM_BLOCKS  # the pool has exactly num_blocks blocks
    llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_blocks"] == LLM_NUM_BLOCKS and stats["num_free_blocks"] == LLM_NUM_BLOCKS - 1
    assert stats["peak_used_blocks"] >= 2


def test_outputs_in_input_order_with_finish_reasons(llm, alpaca_prompts):
    tokenizer = llm.tokenizer
    paris = llm.apply_chat_template(PARIS)
    story = llm.apply_chat_template([{"role": "user", "content": alpaca_prompts[3]}])
    ids = chat_token_ids(tokenizer, alpaca_prompts[5])
    prompts = [paris, story, ids]
    # the last request finishes first, the first one last: outputs still come in input order
    params = [SamplingParams(temperature=0, max_tokens=32), SamplingParams(temperature=0, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput] * 3
    assert len({o.request_id for o in outs}) == 3 and all(isinstance(o.request_id, str) for o in outs)
    assert [o.prompt for o in outs] == [paris, story, None]
    assert [o.prompt_token_ids for o in outs] == [list(tokenizer(paris).input_ids),
                                                  list(tokenizer(story).input_ids), ids]
    assert all(o.finished and len(o.outputs) == 1 for o in outs)

    stop, length7, length2 = (o.outputs[0] for o in outs)
    assert stop.finish_reason == "stop" and len(stop.token_ids) < 32
    assert stop.token_ids[-1] in llm.engine.eos_token_ids and "Paris" in stop.text
    assert "<|im_end|>" not in stop.text
    assert (length7.finish_reason, len(length7.token_ids)) == ("length", 7)
    assert (length2.finish_reason, len(length2.token_ids)) == ("length", 2)
    for out in (stop, length7, length2):
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.cumulative_logprob <= 0
    assert_idle(llm)


def test_max_tokens_is_exact_with_ignore_eos(llm):
    """With ignore_eos the model runs past <|im_end|>: exactly max_tokens tokens, finish 'length'."""
    paris = llm.apply_chat_template(PARIS)
    outs = llm.generate([paris] * 2, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 20)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 20]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert set(outs[1].outputs[0].token_ids) & set(llm.engine.eos_token_ids)  # it went through an EOS


def test_seeded_sampling_is_reproducible_in_any_batch(llm, alpaca_prompts):
    prompt = llm.apply_chat_template([{"role": "user", "content": alpaca_prompts[7]}])
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=1234)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) >= 2
    others = [llm.apply_chat_template([{"role": "user", "content": alpaca_prompts[i]}]) for i in (1, 2)]
    batch = llm.generate([others[0], prompt, others[1], prompt],
                         [SamplingParams(temperature=1.0, max_tokens=16), seeded,
                          SamplingParams(temperature=0.7, max_tokens=5, seed=7), seeded], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert batch[3].outputs[0].token_ids == alone
    reseeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=1235)
    assert llm.generate(prompt, reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone  # the seed matters
    assert_idle(llm)


def test_stop_string_cuts_text_and_finishes(llm, alpaca_prompts):
    prompt = llm.apply_chat_template([{"role": "user", "content": alpaca_prompts[4]}])
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    words = text.split()
    assert len(words) >= 6, text
    stop = words[len(words) // 2]
    cut = text.index(stop)
    assert cut > 0
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "@@never@@"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and stop not in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids == free.outputs[0].token_ids[:len(out.token_ids)] and len(out.token_ids) < 24
    assert_idle(llm)


# ---------------------------------------------------------------- compilations

def test_mixed_run_compiles_a_bounded_number_of_executables(make_llm, default_model, alpaca_prompts):
    """50 requests of mixed prompt lengths (7..32 tokens) and max_tokens (4..24): every padded shape
    is compiled once, so the count stays far below one per request (17 measured)."""
    tokenizer = default_model.tokenizer
    prompts = [p for p in alpaca_prompts if len(tokenizer(p).input_ids) <= 32][:50]
    assert len(prompts) == 50
    params = [SamplingParams(temperature=0, max_tokens=4 + (5 * i) % 21, ignore_eos=True) for i in range(50)]
    assert {p.max_tokens for p in params} == set(range(4, 25))
    engine_llm = make_llm(block_size=16)
    outs = engine_llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    stats = engine_llm.engine.stats()
    print(f"num_compilations={stats['num_compilations']} compile_s={stats['compile_seconds']:.1f} "
          f"steps={stats['num_steps']} preemptions={stats['num_preemptions']}")
    assert 3 <= stats["num_compilations"] <= 20
    assert_idle(engine_llm)


# ---- serving another parameter pytree (LLM(params=...), e.g. fine-tuned) ---------------------------

def test_sequence_logits_match_the_dense_forward_at_every_position(default_model):
    import numpy as np

    from dense_reference import dense_logits
    from jpaged.device.model import sequence_logits

    short, long = [1, 9690, 198, 504, 3575], list(range(100, 140))  # two sequences packed in one pass
    logits = sequence_logits(default_model.params, [short, long], config=default_model.config)
    for ids, got in zip([short, long], logits):
        assert got.shape == (len(ids), default_model.config.vocab_size)
        np.testing.assert_allclose(np.asarray(got), dense_logits(default_model.params, default_model.config, ids),
                                   rtol=2e-3, atol=2e-3)


def test_llm_serves_the_params_it_is_given(llm, make_llm, default_model):
    """A pytree of the model's layout is served as given: here the final norm negated, so greedy
    decoding picks what `sequence_logits` of those parameters ranks first, not what the model does."""
    import jax.numpy as jnp

    from jpaged.device.model import sequence_logits

    prompt = chat_token_ids(llm.tokenizer, "What is the capital of France?")
    flipped = default_model.params.replace(final_norm=-default_model.params.final_norm)
    params = SamplingParams(temperature=0, max_tokens=1)
    tuned = make_llm(params=flipped, num_blocks=16)
    assert tuned.engine.model.params is not default_model.params and tuned.tokenizer is llm.tokenizer
    first = tuned.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids[0]
    base = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids[0]
    expected = [int(jnp.argmax(sequence_logits(p, [prompt], config=default_model.config)[0][-1]))
                for p in (flipped, default_model.params)]
    assert [first, base] == expected and first != base
    assert_idle(tuned)


@pytest.mark.parametrize("change, match", [
    (lambda p: p.replace(final_norm=p.final_norm[:-1]), r"params.final_norm has shape \(575,\), this model's is \(576,\)"),
    (lambda p: p.replace(layers=p.layers.replace(wq=p.layers.wq.astype("int32"))), "params.layers.wq has dtype int32"),
    (lambda p: p.replace(lm_head=p.embed.T), "params have an lm_head, but this model's embeddings are tied"),
    (lambda p: {"embed": p.embed}, "params must be a LlamaParams"),
])
def test_params_of_another_layout_are_refused_before_anything_is_built(default_model, change, match):
    with pytest.raises(ValueError, match=match):
        LLM(loaded=default_model, num_blocks=16, params=change(default_model.params))
    with pytest.raises(ValueError, match="give params or runner, not both"):
        LLM(loaded=default_model, num_blocks=16, params=default_model.params, runner=object())
