"""16-bit parameters (issue 33): `dtype="bfloat16"` / `"float16"` stores the parameters in 16 bits (on a
CPU too, bfloat16 held by the runner as its bit patterns), every matmul accumulates in float32, and
float32 is what it was."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import chat_token_ids
from jpaged import SamplingParams
from jpaged.device.model import compute_logits
from jpaged.device.params import BF16_BITS, cast_params, num_params, to_storage

on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU storage form of bfloat16 parameters")
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def bf16_llm(make_llm):
    return make_llm(dtype="bfloat16", num_blocks=64)


@on_cpu
def test_bfloat16_parameters_are_stored_in_16_bits(bf16_llm, llm):
    engine = bf16_llm.engine
    leaves = jax.tree.leaves(engine.model.params)
    assert engine.param_dtype == jnp.bfloat16 and all(x.dtype == jnp.bfloat16 for x in leaves)
    assert sum(x.nbytes for x in leaves) == 2 * num_params(engine.model.config)
    stored = engine.runner.params  # the runner's: bit patterns, sharing the model's memory
    assert all(x.dtype == BF16_BITS for x in jax.tree.leaves(stored))
    assert stored.layers.w_up.unsafe_buffer_pointer() == engine.model.params.layers.w_up.unsafe_buffer_pointer()
    assert stored.embed.unsafe_buffer_pointer() == engine.model.params.embed.unsafe_buffer_pointer()
    f32 = llm.engine  # float32: the same arrays, untouched
    assert f32.param_dtype == jnp.float32 and f32.runner.params.layers.wq is f32.model.params.layers.wq
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(f32.runner.params))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_accumulates_and_returns_float32(default_model, dtype, tied):
    """Each logit is 575 x 4 + 5 = 2305: exact in float32, 2304 in either 16-bit dtype (8 / 11
    significant bits), so a 16-bit accumulation or result would show. 16-bit bfloat16 heads in their
    storage form, 49152 columns: on a CPU the chunked head."""
    config = default_model.config
    head = np.full((config.hidden_size, config.vocab_size), 4.0, np.float32)
    head[0] = 5.0
    params = default_model.params.replace(lm_head=None if tied else jnp.asarray(head),
                                          embed=jnp.asarray(head.T) if tied else default_model.params.embed)
    params = to_storage(cast_params(params, dtype))
    hidden = jnp.ones((3, config.hidden_size), jnp.float32)
    logits = jax.jit(lambda p, h: compute_logits(p, h, config=config))(params, hidden)
    assert logits.dtype == jnp.float32 and logits.shape == (3, config.vocab_size)
    np.testing.assert_array_equal(np.asarray(logits), 2305.0)


def test_bfloat16_greedy_agrees_with_float32(bf16_llm, llm, alpaca_prompts):
    """The same greedy requests: first-token log-probabilities close to float32's, and the tokens mostly
    float32's (measured: `bench/weights_dtype.py`)."""
    prompts = [chat_token_ids(llm.tokenizer, p) for p in alpaca_prompts[:4]]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    want, got = (m.generate(prompts, params, use_tqdm=False) for m in (llm, bf16_llm))
    prefixes = []
    for a, b in zip(want, got):
        ref, out = a.outputs[0], b.outputs[0]
        top_ref, top = ref.logprobs[0], out.logprobs[0]
        for token in set(top_ref) & set(top):  # float32 accumulation: log-probabilities within 0.15 nats
            assert abs(top_ref[token] - top[token]) < 0.15, (token, top_ref[token], top[token])
        assert ref.token_ids[0] == out.token_ids[0]
        prefixes.append(next((i for i, (x, y) in enumerate(zip(ref.token_ids, out.token_ids)) if x != y), NUM_TOKENS))
    assert sum(p == NUM_TOKENS for p in prefixes) >= len(prompts) // 2 and np.mean(prefixes) >= NUM_TOKENS / 2, prefixes
