"""Mixtures of experts against HF transformers on the same weights, and the sparse MLP against its dense
reference.

Tiny random models of each MoE family are built with transformers' own config classes and saved with
`save_pretrained` (one tensor per expert, the layout on the Hub), and once more in transformers 5's fused
layout (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]: the model's own state dict). They keep
what makes each family itself: Qwen2-MoE's shared expert with its sigmoid gate and q/k/v biases,
Qwen3-MoE's per-head q/k norms with renormalized top-k, Mixtral's always-renormalized router and its
`block_sparse_moe.experts.{e}.w1/w2/w3` names, OLMoE's q/k norms over the whole projection and `clip_qkv`.
The routers are drawn wider than the other weights (std 0.6) so that routing decisions are well apart.
"""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from conftest import scattered_blocks
from jpaged import LLM, SamplingParams, weights
from jpaged.device import moe
from jpaged.device.attention import get_backend
from jpaged.device.model import sequence_logits
from jpaged.device.quant import dequantize, float_rows, quantize
from test_families import hf_greedy

_COMMON = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
MOE_FAMILIES = {
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=2, clip_qkv=1.5, pad_token_id=0)),
}
PROMPTS = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the woods.",
           "Experts are chosen per token by a router.", "Hello"]


def build_moe(name: str, directory, tokenizer, **overrides):
    """Saves a tiny random HF model of MoE family `name` (and the tokenizer) in `directory`, in the
    one-tensor-per-expert layout `save_pretrained` writes; returns the HF model (float32, eval)."""
    config_class, model_class, extra = MOE_FAMILIES[name]
    torch.manual_seed(sum(map(ord, name)))
    model = model_class(config_class(vocab_size=len(tokenizer), **{**_COMMON, **extra, **overrides})).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.6 if param_name.endswith("mlp.gate.weight") else 0.15)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def save_fused(model, directory, tokenizer):
    """The same model in transformers 5's fused layout: its own state dict's names, one file."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    safetensors.torch.save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, default_model):
    """name -> (directory, fused-layout directory, HF model), built once for the module."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe")
    models = {}
    for name in MOE_FAMILIES:
        model = build_moe(name, root / name, default_model.tokenizer)
        save_fused(model, root / f"{name}-fused", default_model.tokenizer)
        models[name] = (root / name, root / f"{name}-fused", model)
    return models


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_moe_logits_match_hf_in_both_layouts(moe_models, default_model, name):
    """Prefill logits at every position of three prompts, both HF layouts, both attention paths of this
    machine, against HF's forward: float32, within 1e-4."""
    directory, fused, model = moe_models[name]
    ids = [list(default_model.tokenizer(p).input_ids) for p in PROMPTS]
    refs = []
    for prompt_ids in ids:
        with torch.no_grad():
            refs.append(model(torch.tensor([prompt_ids])).logits[0].float().numpy())
    backends = ["xla"] + (["native"] if get_backend("auto").name == "native" else [])
    for layout in (directory, fused):
        loaded = weights.load_model(layout)
        assert loaded.config.architecture == name and loaded.config.is_moe
        assert loaded.config.num_experts == model.config.to_dict().get("num_experts",
                                                                       model.config.to_dict().get("num_local_experts"))
        for backend in backends:
            ours = sequence_logits(loaded.params, ids, config=loaded.config, backend=get_backend(backend))
            for i, (logits, ref) in enumerate(zip(ours, refs)):
                assert np.abs(ref).max() > 1.0
                diff = np.abs(np.asarray(logits) - ref).max()
                assert diff <= 1e-4, f"{name} ({layout.name}), {backend}, prompt {i}: max abs logit diff {diff}"


@pytest.mark.parametrize("block_size", [16, 4, 1])
@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_moe_greedy_matches_hf_generate(moe_models, default_model, name, block_size):
    """Greedy tokens of `LLM(model=dir)` (scattered blocks) are HF `generate`'s: a prefill, then decode
    steps of 1-3 rows (the unrolled layers and the layer scan), every block size."""
    directory, _, model = moe_models[name]
    ids = [list(default_model.tokenizer(p).input_ids) for p in PROMPTS]
    llm = LLM(model=str(directory), num_blocks=160 // block_size + 8, block_size=block_size,
              kv_cache_manager=scattered_blocks(block_size))
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt_ids, out in zip(ids, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt_ids, 12), f"{name}, block {block_size}"
    llm.engine.scheduler.block_manager.check_invariants()


def _random_experts(num_experts=8, hidden=32, inter=24, layers=2, seed=0):
    rng = np.random.default_rng(seed)
    stack = lambda *shape: jnp.asarray(rng.normal(0, 0.3, shape), jnp.float32)  # noqa: E731
    return (stack(layers, num_experts, hidden, inter), stack(layers, num_experts, hidden, inter),
            stack(layers, num_experts, inter, hidden), jnp.asarray(rng.normal(0, 1, (64, hidden)), jnp.float32),
            jnp.asarray(rng.normal(0, 1, (hidden, num_experts)), jnp.float32))


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
def test_tiled_and_grouped_experts_match_the_dense_reference(num_tokens):
    """The tiled scan (a CPU's path) and `ragged_dot` (the others') against every expert on every token,
    masked: one layer's experts, a layer of a stack, and two devices' halves (expert parallelism) summed.
    Experts 5-7 get no token (every token's first feature is 10, their router weights on it -10): they cost
    nothing, break nothing."""
    gate, up, down, h, router = _random_experts()
    h = h[:num_tokens].at[:, 0].set(10.0)
    router = router.at[0, 5:].set(-10.0)
    weights, experts = moe.route(h, router, top_k=2, renormalize=False)
    assert not np.isin(np.asarray(experts), [5, 6, 7]).any()
    ref = moe.dense_reference(h, weights, experts, gate[1], up[1], down[1], jax.nn.silu)
    for path in (moe.tiled_experts, moe.grouped_experts):
        one = path(h, weights, experts, gate[1], up[1], down[1], jax.nn.silu)
        stacked = jax.jit(lambda *a: path(*a, jax.nn.silu, layer=jnp.int32(1)))(h, weights, experts, gate, up, down)
        halves = sum(path(h, weights, experts, gate[1, r * 4:(r + 1) * 4], up[1, r * 4:(r + 1) * 4],
                          down[1, r * 4:(r + 1) * 4], jax.nn.silu, first_expert=r * 4) for r in range(2))
        for got in (one, stacked, halves):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [2, 40])
@pytest.mark.parametrize("kind", ["int8", "float_rows"])
def test_int8_and_float_row_experts_compute_with_their_weights(num_tokens, kind):
    """`quantization="int8"` stores each expert int8 with a scale per output channel, and a CPU engine its float
    experts as float rows (`float_row_params`), [L, E, out, in], which the native kernels read in place (2 rows:
    the decode path) or XLA (40 rows: more than a native call takes); both paths, on the stack and on one
    layer's experts (the unrolled layers), give the dense reference on the weights they hold."""
    gate, up, down, h, router = _random_experts()
    h = h[:num_tokens]
    weights, experts = moe.route(h, router, top_k=3, renormalize=True)
    convert = quantize if kind == "int8" else float_rows
    q = [convert(w, w.shape[2:], (0,)) for w in (gate, up, down)]
    assert q[0].values.dtype == (jnp.int8 if kind == "int8" else jnp.float32) and q[0].values.shape == (2, 8, 24, 32)
    ref = moe.dense_reference(h, weights, experts, *(dequantize(w)[0] for w in q), jax.nn.silu)
    exact = float(jnp.abs(ref - moe.dense_reference(h, weights, experts, gate[0], up[0], down[0], jax.nn.silu)).max())
    assert exact > 0 if kind == "int8" else exact == 0
    for path in (moe.tiled_experts, moe.grouped_experts):
        stacked = path(h, weights, experts, *q, jax.nn.silu, layer=jnp.int32(0))
        one = path(h, weights, experts, *(w.replace(values=w.values[0], scales=None if w.scales is None else w.scales[0])
                                          for w in q), jax.nn.silu)
        for got in (stacked, one):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_a_router_tie_gives_hfs_output():
    """Two experts with the same router row tie on every token. Where both are in the top k their order does
    not matter; where they tie for the k-th place jpaged takes the lower expert id (`lax.top_k`), and
    `torch.topk` whichever its selection algorithm leaves there (not always the lower id: top-2 of
    [.1, .5, .2, .5, .5] is ids 1 and 4), so HF's answer is defined only where the tied experts are the same
    expert: a duplicated expert (sparse upcycling starts from copies). Against HF's own sparse block: the
    routing weights with the tied pair's columns summed, and the block's output."""
    config = transformers.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=12, num_experts=6, num_experts_per_tok=3,
                                         norm_topk_prob=True)
    torch.manual_seed(5)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
        block.gate.weight[4] = block.gate.weight[1]
        block.experts.gate_up_proj[4] = block.experts.gate_up_proj[1]
        block.experts.down_proj[4] = block.experts.down_proj[1]
    h = torch.randn(32, 16)
    with torch.no_grad():
        ref = block(h[None])[0].numpy()
        _, ref_w, ref_e = block.gate(h)
    router = jnp.asarray(block.gate.weight.detach().numpy().T)
    weights, experts = moe.route(jnp.asarray(h.numpy()), router, top_k=3, renormalize=True)

    def dense(w, e):  # [N, E] routing weights, the tied pair's columns summed
        d = np.zeros((w.shape[0], 6), np.float32)
        np.put_along_axis(d, np.asarray(e), np.asarray(w), axis=1)
        d[:, 1] += d[:, 4]
        return np.delete(d, 4, axis=1)

    ties = (np.asarray(ref_e) == 4).any(1) != (np.asarray(experts) == 4).any(1)
    assert ties.any()  # some token's k-th place is a tie that torch and lax resolve apart
    np.testing.assert_allclose(dense(weights, experts), dense(ref_w.numpy(), ref_e.numpy()), atol=1e-6)
    gate_up = block.experts.gate_up_proj.detach().numpy()
    layer = type("P", (), dict(router=router, shared_w_gate=None,
                               experts_gate=jnp.asarray(gate_up[:, :12].transpose(0, 2, 1)),
                               experts_up=jnp.asarray(gate_up[:, 12:].transpose(0, 2, 1)),
                               experts_down=jnp.asarray(block.experts.down_proj.detach().numpy().transpose(0, 2, 1))))
    ours, routed = moe.sparse_mlp(jnp.asarray(h.numpy()), layer, weights_config(config), jax.nn.silu)
    assert (np.asarray(routed) == np.asarray(experts)).all()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)


def weights_config(hf):
    """The routing fields of a `ModelConfig` for `moe.sparse_mlp` (a stand-in with those fields alone)."""
    return type("C", (), dict(num_experts_per_tok=hf.num_experts_per_tok, norm_topk_prob=hf.norm_topk_prob))


def _config(directory):
    return json.loads((directory / "config.json").read_text())


def _write_config(directory, **changes):
    (directory / "config.json").write_text(json.dumps({**_config(directory), **changes}))


def test_contradicting_moe_configs_are_refused_before_any_weight_loads(moe_models, tmp_path, default_model):
    """top-k above the experts, dense layers among sparse ones, MLA: each a ValueError naming the field,
    from the config alone (`read_config` reads no weight)."""
    directory, _, _ = moe_models["qwen3_moe"]
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    _write_config(bad, num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be between 1 and num_experts \(8\)"):
        weights.read_config(bad)
    _write_config(bad, num_experts_per_tok=2, mlp_only_layers=[1])
    with pytest.raises(ValueError, match=r"dense MLP layers \[1\] among sparse ones"):
        weights.read_config(bad)
    _write_config(bad, mlp_only_layers=[], model_type="deepseek_v3")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        weights.read_config(bad)


def test_a_missing_or_misshapen_expert_tensor_is_refused_naming_it(moe_models, tmp_path, default_model):
    directory, _, model = moe_models["mixtral"]
    state = {k: v.contiguous() for k, v in safetensors.torch.load_file(str(directory / "model.safetensors")).items()}
    for case, change in (("missing", lambda s: s.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight")),
                         ("shape", lambda s: s.update({"model.layers.0.block_sparse_moe.experts.0.w1.weight":
                                                       torch.zeros(47, 64)}))):
        bad = tmp_path / case
        bad.mkdir()
        for f in directory.iterdir():
            if f.name != "model.safetensors":
                (bad / f.name).write_bytes(f.read_bytes())
        broken = dict(state)
        change(broken)
        safetensors.torch.save_file(broken, str(bad / "model.safetensors"), metadata={"format": "pt"})
        expected = "missing tensor of expert 2" if case == "missing" else r"experts of layers.0.experts_gate differ"
        with pytest.raises(ValueError, match=expected):
            weights.load_model(bad)


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused(moe_models):
    """Refused naming both numbers, before any weight is read (one device: the check needs no mesh of 3)."""
    directory, _, _ = moe_models["qwen2_moe"]
    from jpaged.device.sharding import expert_parallel
    config = weights.read_config(directory)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1] * 1).reshape(1, 1), ("data", "model"))
    expert_parallel().check(mesh, config)  # 1 divides 8
    fake = type("FakeMesh", (), {"axis_names": ("data", "model"), "shape": {"data": 1, "model": 3}})()
    with pytest.raises(ValueError, match=r"expert parallel size 3 does not divide the model's 8 experts"):
        expert_parallel().check(fake, config)
    with pytest.raises(ValueError, match="expert_parallel_size 2 and tensor_parallel_size 4"):
        LLM(model=str(directory), tensor_parallel_size=4, expert_parallel_size=2)


def test_an_moe_model_runs_under_every_engine_feature(moe_models, default_model, tmp_path):
    """Qwen2-MoE (shared expert, biases) through what dense models have, each against HF's greedy tokens:
    prefix caching on a shared prefix, chunked prefill under a small token budget, swap preemption in a pool
    too small for all at once, ngram speculation, a structured-output request (its regex matched),
    and an engine paused mid-run and restored (`save` / `restore`) that finishes with the same tokens."""
    from jpaged.engine import LLMEngine

    directory, _, model = moe_models["qwen2_moe"]
    shared = "You are a helpful assistant who answers briefly and precisely. "
    prompts = [shared + p for p in PROMPTS] + PROMPTS
    ids = [list(default_model.tokenizer(p).input_ids) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [hf_greedy(model, p, 10) for p in ids]
    settings = dict(model=str(directory), block_size=4, num_blocks=20, enable_prefix_caching=True,
                    max_num_batched_tokens=24, preemption_mode="swap", swap_space=0.01,
                    speculative_method="ngram", num_speculative_tokens=2)
    llm = LLM(**settings)
    outs = llm.generate(ids, greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0, stats
    llm.engine.scheduler.block_manager.check_invariants()

    pattern = r"(yes|no), [0-9]{2}!"
    out = llm.generate([ids[2]], SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": pattern}),
                       use_tqdm=False)[0]
    assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text

    engine = LLMEngine(**settings)
    for i, p in enumerate(ids):
        engine.add_request(str(i), p, greedy)
    for _ in range(4):
        engine.step()
    engine.save(tmp_path / "paused")
    restored = LLMEngine.restore(tmp_path / "paused")
    finished = {}
    while restored.has_unfinished():
        for o in restored.step():
            if o.finished:
                finished[o.request_id] = list(o.outputs[0].token_ids)
    assert [finished[str(i)] for i in range(len(ids)) if str(i) in finished] == \
        [e for i, e in enumerate(expected) if str(i) in finished]
    assert len(finished) >= 1
