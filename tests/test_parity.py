"""Parity of the paged engine with references nobody here wrote: HF transformers on the same GGUF
file, and a dense, cacheless forward pass (`dense_reference.py`).

- prefill logits at every position vs HF (and the dense reference vs HF, which validates it);
- greedy continuations of a batch vs HF `generate`, one prompt at a time, at block sizes 16 and 4
  (the latter with a shuffled free list, so every sequence's blocks are scattered over the pool);
- every decode step's logits, read through the paged cache, vs the dense forward over the same tokens;
- a small random Llama saved by HF as safetensors, loaded through `LLM(model=dir)`;
- the model knows the capital of France.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from conftest import chat_token_ids, scattered_blocks
from dense_reference import dense_logits
from jpaged import LLM, SamplingParams
from jpaged.device.attention.xla import XLABackend
from jpaged.device.batch import pack_rows
from jpaged.core.kv_cache_manager import slot_ids
from jpaged.device.kv_cache import KVCache
from jpaged.device.model import compute_logits, forward
from jpaged.core.scheduler import Row

PREFILL_PROMPTS = (0, 3, 8, 9, 10)  # chat lengths 58, 42, 73, 100, 54 tokens
GREEDY_PROMPTS = tuple(range(8))  # chat lengths 37..58 tokens; the Paris question is added (it ends at EOS)
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY_TOKENS = 32
HF_ATOL = 1e-3  # jpaged (and the dense reference) vs HF/torch, float32 logits of magnitude ~40
# Paged vs dense, both float32 XLA: the two only differ in summation order (decode vs prefill
# matmul shapes, gathered blocks), which moves logits of magnitude ~40 by up to ~1.1e-4 over 30
# layers (measured); a wrong block, slot, position or mask moves them by 0.1 or more.
DENSE_ATOL = 2e-4


def max_abs_diff(x, y) -> float:
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert x.shape == y.shape, (x.shape, y.shape)
    return float(np.max(np.abs(x - y)))


def shuffled_block_ids(num_blocks: int, seed: int) -> tuple[int, ...]:
    """Every block but the null block, in a random order."""
    return tuple(int(b) for b in np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))


def paged_prefill_logits(params, config, token_id_lists, *, block_size: int, seed: int) -> list[np.ndarray]:
    """Prefills all sequences in one packed batch through `jpaged.device.model.forward`, each into blocks
    drawn at random from a fresh pool, and returns each sequence's logits f32[len, vocab] at every
    position. Block tables and slots are drawn here; `pack_rows` lays the rows end to end, with
    small query and key tiles so that every row spans several of both."""
    lengths = [len(ids) for ids in token_id_lists]
    num_blocks = 1 + sum(-(-n // block_size) for n in lengths) + 7  # a few blocks nobody uses
    free = list(shuffled_block_ids(num_blocks, seed))
    rows = []
    for ids in token_id_lists:
        table = [free.pop() for _ in range(-(-len(ids) // block_size))]
        rows.append(Row(token_ids=list(ids), start_position=0, slots=slot_ids(table, 0, len(ids), block_size),
                        block_table=table))
    inputs = pack_rows(rows, block_size=block_size, q_tile=8, k_tile=2 * block_size)
    cache = KVCache.create(config, num_blocks, block_size, np.float32)

    @jax.jit
    def run(params, cache, inputs):
        cache, hidden = forward(params, cache, inputs, config=config, backend=XLABackend())
        return compute_logits(params, hidden, config=config)

    logits = np.asarray(run(params, cache, inputs))
    starts = np.cumsum([0] + lengths)
    return [logits[s:s + n] for s, n in zip(starts, lengths)]


def hf_logits(model, token_ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


def hf_greedy(model, token_ids, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF greedy decoding of one prompt (no padding): the new token ids (through EOS, if reached)
    and each one's log-probability under the model."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(token_ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0].double(), -1)[t]) for step, t in zip(out.logits, new)]
    return new, logprobs


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def greedy_token_ids(default_model, alpaca_prompts) -> list[list[int]]:
    tokenizer = default_model.tokenizer
    paris = tokenizer.apply_chat_template(PARIS, tokenize=False, add_generation_prompt=True)
    return ([chat_token_ids(tokenizer, alpaca_prompts[i]) for i in GREEDY_PROMPTS]
            + [list(tokenizer(paris, add_special_tokens=False).input_ids)])


@pytest.fixture(scope="module")
def hf_greedy_outputs(hf_default_model, greedy_token_ids) -> list[tuple[list[int], list[float]]]:
    """HF's greedy continuations, one prompt at a time (left padding would shift HF's numerics)."""
    return [hf_greedy(hf_default_model, ids, GREEDY_TOKENS) for ids in greedy_token_ids]


@pytest.fixture(scope="module")
def llm_bs4(make_llm) -> LLM:
    """Block size 4 with a shuffled free list: consecutive blocks of a sequence are scattered."""
    return make_llm(block_size=4, num_blocks=256, kv_cache_manager=scattered_blocks(seed=4))


# ---------------------------------------------------------------- prefill

def test_prefill_logits_match_hf_at_every_position(default_model, hf_default_model, alpaca_prompts):
    tokenizer, params, config = default_model.tokenizer, default_model.params, default_model.config
    token_id_lists = [chat_token_ids(tokenizer, alpaca_prompts[i]) for i in PREFILL_PROMPTS]
    assert len({len(ids) for ids in token_id_lists}) == len(token_id_lists)  # padding is exercised
    paged = paged_prefill_logits(params, config, token_id_lists, block_size=16, seed=0)
    for i, (ids, logits) in enumerate(zip(token_id_lists, paged)):
        ref = hf_logits(hf_default_model, ids)
        diff = max_abs_diff(logits, ref)
        assert diff <= HF_ATOL, f"prompt {i} ({len(ids)} tokens): jpaged vs HF max abs diff {diff}"
        # the dense reference used below is itself checked against HF here
        diff = max_abs_diff(dense_logits(params, config, ids), ref)
        assert diff <= HF_ATOL, f"prompt {i} ({len(ids)} tokens): dense reference vs HF max abs diff {diff}"


# ---------------------------------------------------------------- greedy generation

@pytest.mark.parametrize("which", ["block16", "block4_shuffled"])
def test_greedy_batch_matches_hf_one_at_a_time(which, request, greedy_token_ids, hf_greedy_outputs):
    llm = request.getfixturevalue({"block16": "llm", "block4_shuffled": "llm_bs4"}[which])
    eos_ids = set(llm.engine.eos_token_ids)
    assert any(len(tokens) < GREEDY_TOKENS for tokens, _ in hf_greedy_outputs)  # the EOS case is exercised
    outs = llm.generate(greedy_token_ids, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS), use_tqdm=False)
    assert len(outs) == len(greedy_token_ids)
    for i, (ids, out, (hf_tokens, hf_logprobs)) in enumerate(zip(greedy_token_ids, outs, hf_greedy_outputs)):
        got = out.outputs[0]
        assert out.prompt_token_ids == ids
        assert got.token_ids == hf_tokens, f"prompt {i}: jpaged and HF greedy continuations differ"
        hf_stopped = len(hf_tokens) < GREEDY_TOKENS or hf_tokens[-1] in eos_ids
        assert got.finish_reason == ("stop" if hf_stopped else "length"), f"prompt {i}"
        assert got.cumulative_logprob == pytest.approx(sum(hf_logprobs), abs=2e-3), f"prompt {i}"
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == llm.engine.num_blocks - 1 and stats["running"] == 0


# ---------------------------------------------------------------- decode steps vs a dense forward

def test_every_decode_step_matches_dense_forward(llm_bs4, default_model, alpaca_prompts):
    """Prefill three sequences of different lengths into scattered 4-token blocks, then decode
    greedily; at every step the paged logits equal the dense forward's over the same tokens."""
    runner, bs = llm_bs4.engine.runner, llm_bs4.engine.config.block_size
    assert bs == 4 and not llm_bs4.engine.has_unfinished()  # the engine is idle: every block is ours
    params, config = default_model.params, default_model.config
    tokenizer = default_model.tokenizer
    seqs = [chat_token_ids(tokenizer, alpaca_prompts[0])[:45], chat_token_ids(tokenizer, alpaca_prompts[1]),
            chat_token_ids(tokenizer, alpaca_prompts[2])[:30]]
    assert len({len(s) for s in seqs}) == 3
    free = list(shuffled_block_ids(llm_bs4.engine.num_blocks, seed=11))
    tables: list[list[int]] = [[] for _ in seqs]

    def row(b: int, start: int) -> Row:
        """The row computing tokens start.. of sequence b, allocating blocks as it grows."""
        end = len(seqs[b])
        while len(tables[b]) * bs < end:
            tables[b].append(free.pop())
        return Row(token_ids=seqs[b][start:], start_position=start, slots=slot_ids(tables[b], start, end, bs),
                   block_table=list(tables[b]))

    prompt_lens = [len(s) for s in seqs]
    num_decode_steps = 9  # crosses at least two block boundaries per sequence
    logits = np.asarray(runner.execute([row(b, 0) for b in range(len(seqs))], decode=False))
    paged = [[logits[b]] for b in range(len(seqs))]  # paged[b][k]: logits at position prompt_lens[b] - 1 + k
    for _ in range(num_decode_steps):
        for b, seq in enumerate(seqs):
            seq.append(int(np.argmax(logits[b])))
        logits = np.asarray(runner.execute([row(b, len(s) - 1) for b, s in enumerate(seqs)], decode=True))
        for b in range(len(seqs)):
            paged[b].append(logits[b])
    # causal attention: the dense logits at position p depend on tokens 0..p only, so one dense pass
    # over each final sequence gives the reference for the prefill and every decode step
    for b, seq in enumerate(seqs):
        ref = dense_logits(params, config, seq)
        for step, got in enumerate(paged[b]):
            position = prompt_lens[b] - 1 + step
            diff = max_abs_diff(got, ref[position])
            assert diff <= DENSE_ATOL, f"sequence {b}, step {step} (position {position}): max abs diff {diff}"
    # the tolerance discriminates: one changed context token moves the last logits far more
    changed = list(seqs[0])
    changed[len(changed) // 2] += 1
    assert max_abs_diff(paged[0][-1], dense_logits(params, config, changed)[-1]) > 100 * DENSE_ATOL
    assert all(len(t) > 1 and len(set(t)) == len(t) for t in tables)


# ---------------------------------------------------------------- a HF safetensors checkpoint

def test_random_hf_llama_loads_and_matches(tmp_path, default_model):
    """A small randomly initialised Llama saved by HF (untied head, GQA) runs through `LLM(model=dir)`:
    prefill logits at every position and greedy tokens match HF's."""
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=default_model.config.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # large enough weights that the logits are O(1)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path)
    default_model.tokenizer.save_pretrained(tmp_path)

    llm = LLM(model=str(tmp_path), block_size=4, num_blocks=64, kv_cache_manager=scattered_blocks(seed=2))
    assert llm.engine.model.config.num_layers == 2 and llm.engine.model.params.lm_head is not None
    prompts = ["The quick brown fox jumps over the lazy dog.", "Hello", "Paged attention splits the KV cache into blocks."]
    token_id_lists = [list(llm.tokenizer(p).input_ids) for p in prompts]
    paged = paged_prefill_logits(llm.engine.model.params, llm.engine.model.config, token_id_lists, block_size=4, seed=3)
    for i, (ids, logits) in enumerate(zip(token_id_lists, paged)):
        ref = hf_logits(model, ids)
        assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero numbers
        diff = max_abs_diff(logits, ref)
        assert diff <= 1e-4, f"prompt {i}: max abs diff {diff}"

    outs = llm.generate(token_id_lists, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(token_id_lists, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=8, min_new_tokens=8)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


# ---------------------------------------------------------------- the model itself

def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
