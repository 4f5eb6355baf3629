"""Every model family against HF transformers on the same weights: tiny random models built with
transformers' own config classes, saved with `save_pretrained` (the default model's tokenizer
beside them), loaded by `LLM(model=dir)` and compared with HF's own forward and `generate`.

The models are small (3 layers, hidden 64) but keep what makes each family itself: Llama 3's RoPE
scaling (and linear, YaRN, dynamic NTK), Qwen2's q/k/v biases, Qwen3's q/k norms and a head_dim
apart from hidden / heads, Mistral's sliding window, Gemma 2's soft-caps, sandwich norms, GeGLU,
(1 + w) norms, scaled embeddings and local/global layers, Gemma 3's own RoPE base on its local layers
and linear scaling on the global ones, Phi-3's fused projections. Windows are 8 tokens, so every
context here is several windows long. Weights are drawn wide (std 0.15; norms around their identity)
so that the logits are O(1) and greedy decisions are not near-ties.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from conftest import scattered_blocks
from jpaged import LLM, SamplingParams, weights
from jpaged.core.kv_cache_manager import live_block_table
from jpaged.device.attention import get_backend
from jpaged.device.model import sequence_logits

WINDOW = 8
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-yarn": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    "llama-linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama-dynamic": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        max_position_embeddings=24, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=WINDOW, head_dim=16)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(pad_token_id=0)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        pad_token_id=0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=4.0)},
        pad_token_id=0)),
}
PROMPTS = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the woods.",
           "Paged attention splits the KV cache into fixed-size blocks.", "Hello"]


def build_family(name: str, directory, tokenizer):
    """Saves a tiny random HF model of family `name` (and the tokenizer) in `directory`; returns the
    HF model (float32, eval)."""
    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(sum(map(ord, name)))
    model = model_class(config_class(vocab_size=len(tokenizer), **{**_COMMON, **extra})).eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):  # Gemma's norms scale by (1 + w): identity at 0
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, default_model):
    """name -> (directory, HF model), built once for the module."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("families")
    return {name: (root / name, build_family(name, root / name, default_model.tokenizer)) for name in FAMILIES}


def hf_greedy(model, ids, max_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_logits_match_hf(family_models, default_model, name):
    """Prefill logits at every position of three prompts, both attention paths of this machine
    (the XLA path, and the native kernel where it was built), against HF's forward: float32."""
    directory, model = family_models[name]
    loaded = weights.load_model(directory)
    config = loaded.config
    assert config.architecture == model.config.model_type
    ids = [list(default_model.tokenizer(p).input_ids) for p in PROMPTS]
    assert max(map(len, ids)) > 2 * WINDOW
    backends = ["xla"] + (["native"] if get_backend("auto").name == "native" else [])
    for backend in backends:
        ours = sequence_logits(loaded.params, ids, config=config, backend=get_backend(backend))
        for i, (prompt_ids, logits) in enumerate(zip(ids, ours)):
            with torch.no_grad():
                ref = model(torch.tensor([prompt_ids])).logits[0].float().numpy()
            assert np.abs(ref).max() > 1.0  # not a comparison of near-zero numbers
            diff = np.abs(np.asarray(logits) - ref).max()
            assert diff <= 1e-4, f"{name}, {backend}, prompt {i}: max abs logit diff {diff}"


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_greedy_matches_hf_generate(family_models, default_model, name, block_size):
    """Greedy tokens of `LLM(model=dir)` (scattered blocks, the machine's default attention backend)
    are HF `generate`'s, over contexts several sliding windows long."""
    directory, model = family_models[name]
    llm = LLM(model=str(directory), block_size=block_size, num_blocks=96, kv_cache_manager=scattered_blocks(seed=5))
    ids = [list(default_model.tokenizer(p).input_ids) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt_ids, 20), f"{name}: prompt {prompt_ids[:4]}..."


@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_self_drafting_under_swap_preemption_gives_hfs_greedy_tokens(family_models, default_model, name):
    """Self-drafting runs the model's first layers on the pool: it drafts only once the step's swaps and
    copies are applied (a block swapped out this step may already be another sequence's lookahead
    block, written by the draft). Swap preemption in a pool too small for the four requests."""
    directory, model = family_models[name]
    llm = LLM(model=str(directory), block_size=4, num_blocks=40, preemption_mode="swap", swap_space=0.01,
              speculative_method="draft-layers", num_speculative_tokens=4, watermark=0.0)
    prompts = ["Hi", *PROMPTS[:2], " ".join(["one two three four five six seven eight nine ten"] * 5)]
    ids = [list(default_model.tokenizer(p).input_ids) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode"]["num_proposed"] > 0, stats
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt_ids, 40), f"{name}: prompt {prompt_ids[:4]}..."
    assert stats["num_free_blocks"] == llm.engine.num_blocks - 1 and stats["num_used_cpu_blocks"] == 0


# ---------------------------------------------------------------- what jpaged does not implement

def _config_dir(tmp_path, config: dict):
    """A directory with this config.json and a safetensors file that is not one: a load that got past
    the config would fail on it with another message."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    return tmp_path


_LLAMA = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1).to_dict()


@pytest.mark.parametrize("config, field", [
    (dict(_LLAMA, rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 4,
                                      long_factor=[1.0] * 4, original_max_position_embeddings=64)),
     "rope_parameters.rope_type 'longrope'"),
    (dict(_LLAMA, mlp_bias=True), "mlp_bias = True"),
    (dict(_LLAMA, attention_bias=True), "attention_bias = True"),
    (dict(_LLAMA, num_local_experts=8), "num_local_experts = 8 (a mixture of experts, in a family jpaged runs dense)"),
    (dict(_LLAMA, model_type="deepseek_v3"), "multi-head latent attention"),
    (dict(_LLAMA, model_type="gemma3", vision_config={}), "vision tower (vision_config)"),
    (dict(transformers.Phi3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, pad_token_id=0).to_dict(), partial_rotary_factor=0.5),
     "partial_rotary_factor"),
], ids=["longrope", "mlp_bias", "attention_bias", "moe", "mla", "vision", "partial_rope"])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, config, field):
    directory = _config_dir(tmp_path, config)
    with pytest.raises(ValueError) as error:
        weights.read_config(directory)
    message = str(error.value)
    assert field in message and str(directory) in message and "\n" not in message
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        LLM(model=str(directory))


# ---------------------------------------------------------------- blocks that slid out of the window

def test_windowed_blocks_return_to_the_pool(family_models, default_model):
    """Mistral (every layer windowed, W = 8) at block size 4, contexts 8x the window in a pool that
    could not hold them whole: after every step each running sequence holds at most ceil(W /
    block_size) + 1 live blocks, nothing is preempted, and the tokens are HF's."""
    directory, model = family_models["mistral"]
    block_size, max_tokens = 4, 8 * WINDOW
    llm = LLM(model=str(directory), block_size=block_size, num_blocks=24, kv_cache_manager=scattered_blocks(seed=7))
    assert llm.engine.model.config.kv_window == WINDOW
    records = []
    llm.engine.add_observer(records.append)
    ids = [list(default_model.tokenizer(p).input_ids) for p in PROMPTS]
    assert 3 * (max(map(len, ids)) + max_tokens) > 24 * block_size  # whole contexts would not fit
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    bound = -(-WINDOW // block_size) + 1
    held = [[len(live_block_table(r.kv, s)) for s in r.kv.seq_ids] for r in records if r.kind == "decode" and r.kv.seq_ids]
    assert max(map(max, held)) <= bound and max(map(max, held)) == bound, held
    assert llm.engine.stats()["num_preemptions"] == 0
    for prompt_ids, out in zip(ids, outs):
        assert len(prompt_ids) + len(out.outputs[0].token_ids) >= 8 * WINDOW
        assert out.outputs[0].token_ids == hf_greedy(model, prompt_ids, max_tokens)


def test_family_checkpoint_round_trip(family_models, tmp_path):
    """A jpaged checkpoint of a family with every kind of declaration (Gemma 3: per-layer windows, a
    local RoPE base, scaling on the global layers, q/k and sandwich norms) restores the same config
    and parameters."""
    from jpaged.weights import checkpoint

    directory, _ = family_models["gemma3"]
    loaded = weights.load_model(directory)
    saved = checkpoint.save(loaded, tmp_path / "ckpt")
    assert weights.read_config(saved) == loaded.config
    restored = weights.load_model(saved)
    assert restored.config == loaded.config and restored.config.rope_scaling.rope_type == "linear"
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text, chat = "Name three colors, <start_of_turn> please.", [{"role": "user", "content": "hi"}]
    assert restored.tokenizer(text).input_ids == loaded.tokenizer(text).input_ids
    assert restored.tokenizer.apply_chat_template(chat) == loaded.tokenizer.apply_chat_template(chat)


def test_cli_generates_from_a_family_directory(family_models, default_model, capsys):
    """`jpaged generate --model DIR` on a Gemma 2 directory: the chat template from its tokenizer
    files, HF's greedy tokens (windows, soft-caps and all)."""
    from jpaged.entrypoints import cli

    directory, model = family_models["gemma2"]
    prompt = "Name three colors."
    code = cli.main(["generate", prompt, "--model", str(directory), "--json", "--max-tokens", "12",
                     "--num-blocks", "32", "--block-size", "4"])
    out = capsys.readouterr()
    assert code == 0, out.err
    record = json.loads(out.out.strip().splitlines()[0])
    ids = default_model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                      add_generation_prompt=True)
    ids = list(getattr(ids, "input_ids", ids))
    (output,) = record["outputs"]
    assert output["token_ids"] == hf_greedy(model, ids, 12)[:len(output["token_ids"])] and output["token_ids"]


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_pallas_kernels_in_the_interpreter_give_hfs_tokens(family_models, default_model, name):
    """The Pallas backend (its decode and ragged kernels in the Pallas interpreter) on a soft-capped,
    mixed-window family and on one whose windows release blocks (null entries before the window): HF's
    tokens."""
    directory, model = family_models[name]
    llm = LLM(model=str(directory), block_size=4, num_blocks=64, attention_backend="pallas", interpret=True)
    ids = [list(default_model.tokenizer(p).input_ids) for p in PROMPTS[:2]]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt_ids, 10)
