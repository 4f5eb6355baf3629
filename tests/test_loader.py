"""The loader against HF transformers: config, every weight (layout and q/k permutation), HF
checkpoint directories, bad paths."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jpaged import weights
from jpaged.weights import checkpoint, loader
from jpaged.device.config import ModelConfig


def expected_params(sd: dict, c: ModelConfig) -> dict[str, np.ndarray]:
    """A HF state dict in the layout of params.py, written out leaf by leaf (flattened names)."""
    sd = {k: v.float().numpy() for k, v in sd.items()}
    layer = lambda i, name: sd[f"model.layers.{i}.{name}.weight"]  # noqa: E731
    stack = lambda f: np.stack([f(i) for i in range(c.num_layers)])  # noqa: E731
    h, hd = c.hidden_size, c.head_dim
    out = {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "layers.attn_norm": stack(lambda i: layer(i, "input_layernorm")),
        "layers.mlp_norm": stack(lambda i: layer(i, "post_attention_layernorm")),
        "layers.wq": stack(lambda i: layer(i, "self_attn.q_proj").T.reshape(h, c.num_heads, hd)),
        "layers.wk": stack(lambda i: layer(i, "self_attn.k_proj").T.reshape(h, c.num_kv_heads, hd)),
        "layers.wv": stack(lambda i: layer(i, "self_attn.v_proj").T.reshape(h, c.num_kv_heads, hd)),
        "layers.wo": stack(lambda i: layer(i, "self_attn.o_proj").T.reshape(c.num_heads, hd, h)),
        "layers.w_gate": stack(lambda i: layer(i, "mlp.gate_proj").T),
        "layers.w_up": stack(lambda i: layer(i, "mlp.up_proj").T),
        "layers.w_down": stack(lambda i: layer(i, "mlp.down_proj").T),
    }
    if not c.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    return out


def flat_params(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k, simple=True, separator="."): np.asarray(v, np.float32)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}


def assert_close(x: np.ndarray, ref: np.ndarray, atol: float, name: str):
    """max |x - ref| <= atol (a cheaper assert_allclose for the 135M-parameter model)."""
    assert x.shape == ref.shape, (name, x.shape, ref.shape)
    diff = float(np.max(np.abs(x - ref)))
    assert diff <= atol, f"{name}: max abs diff {diff} > {atol}"


def assert_params_match(loaded: loader.LoadedModel, hf_model, atol=1e-6):
    """Every leaf equals the HF weights (layout conversion), and each projection computes what
    the HF module computes on a random input (pins which axis is heads, in, out)."""
    c, p = loaded.config, loaded.params
    ours, ref = flat_params(p), expected_params(hf_model.state_dict(), c)
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert_close(ours[name], ref[name], atol, name)

    rng = np.random.default_rng(0)
    x = rng.standard_normal(c.hidden_size).astype(np.float32)
    i = c.num_layers - 1
    block = hf_model.model.layers[i]
    with torch.no_grad():
        run = lambda module, v: module(torch.from_numpy(v)).numpy()  # noqa: E731
        np.testing.assert_allclose(np.einsum("d,dnk->nk", x, np.asarray(p.layers.wq[i], np.float32)),
                                   run(block.self_attn.q_proj, x).reshape(c.num_heads, c.head_dim), atol=1e-3)
        np.testing.assert_allclose(np.einsum("d,dnk->nk", x, np.asarray(p.layers.wk[i], np.float32)),
                                   run(block.self_attn.k_proj, x).reshape(c.num_kv_heads, c.head_dim), atol=1e-3)
        heads = rng.standard_normal((c.num_heads, c.head_dim)).astype(np.float32)
        np.testing.assert_allclose(np.einsum("nk,nkd->d", heads, np.asarray(p.layers.wo[i], np.float32)),
                                   run(block.self_attn.o_proj, heads.reshape(-1)), atol=1e-3)
        hidden_mlp = x @ np.asarray(p.layers.w_gate[i], np.float32)
        np.testing.assert_allclose(hidden_mlp, run(block.mlp.gate_proj, x), atol=1e-3)
        np.testing.assert_allclose(hidden_mlp @ np.asarray(p.layers.w_down[i], np.float32),
                                   run(block.mlp.down_proj, hidden_mlp), atol=1e-2)
        head = p.embed.T if p.lm_head is None else p.lm_head
        np.testing.assert_allclose(x @ np.asarray(head, np.float32), run(hf_model.lm_head, x), atol=1e-3)


def assert_config_matches(c: ModelConfig, hf_config, generation_config):
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_theta": hf_config.rope_theta}
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.num_attention_heads,
        hf_config.num_key_value_heads, hf_config.head_dim)
    assert (c.intermediate_size, c.vocab_size, c.tie_word_embeddings, c.max_position_embeddings) == (
        hf_config.intermediate_size, hf_config.vocab_size, hf_config.tie_word_embeddings,
        hf_config.max_position_embeddings)
    assert c.rope_theta == rope["rope_theta"]
    assert c.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-7)
    assert c.bos_token_id == hf_config.bos_token_id
    eos = generation_config.eos_token_id
    assert set(np.atleast_1d(eos).tolist()) <= set(c.eos_token_ids)


# ---------------------------------------------------------------- the default model (GGUF)

def test_default_model_config_matches_hf(default_model, hf_default_model):
    c = default_model.config
    assert_config_matches(c, hf_default_model.config, hf_default_model.generation_config)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.eos_token_ids == (hf_default_model.generation_config.eos_token_id,)  # <|im_end|> is the GGUF eos
    assert default_model.path == loader.default_model_path()


def test_default_model_params_match_hf(default_model, hf_default_model):
    assert default_model.params.lm_head is None
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(default_model.params))
    assert_params_match(default_model, hf_default_model)


def test_default_model_tokenizer_chat_template(default_model):
    tok = default_model.tokenizer
    assert isinstance(tok, transformers.PreTrainedTokenizerBase)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 2 and im_end in default_model.config.eos_token_ids


def test_checkpoint_roundtrip(default_model, tmp_path):
    path = checkpoint.save(default_model, tmp_path / "ckpt")
    again = weights.load_model(path, dtype=jnp.bfloat16)
    assert again.config == default_model.config and again.path == path
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(again.params))
    ref = flat_params(default_model.params)
    for name, x in flat_params(again.params).items():  # float32 -> bfloat16 rounds to nearest even
        assert np.array_equal(x, ref[name].astype(jnp.bfloat16).astype(np.float32)), name
    chat = [{"role": "user", "content": "hi"}]
    assert again.tokenizer.apply_chat_template(chat) == default_model.tokenizer.apply_chat_template(chat)
    # the saved tokenizer comes back as the class the GGUF loader built (not through AutoTokenizer), alike
    assert type(again.tokenizer) is type(default_model.tokenizer)
    text = "<|im_start|>user\nCafé, naïve 42 tokens!\t<|im_end|> <|endoftext|>"
    assert again.tokenizer(text).input_ids == default_model.tokenizer(text).input_ids
    assert again.tokenizer.all_special_tokens == default_model.tokenizer.all_special_tokens


# ---------------------------------------------------------------- HF checkpoint directories

@pytest.mark.parametrize("tied, shard, torch_dtype", [
    (False, None, torch.float32), (True, None, torch.float32), (False, "2MB", torch.bfloat16)],
    ids=["untied", "tied", "untied-sharded-bf16"])
def test_hf_directory_loads(default_model, tmp_path, tied, shard, torch_dtype):
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=default_model.config.vocab_size, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0,
        rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(hf_config).to(torch_dtype).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1: randomise everything so nothing matches by luck
            p.normal_()
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    default_model.tokenizer.save_pretrained(tmp_path)
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == bool(shard)

    loaded = weights.load_model(tmp_path)
    assert_config_matches(loaded.config, model.config, model.generation_config)
    assert loaded.config.tie_word_embeddings == tied and (loaded.params.lm_head is None) == tied
    assert loaded.tokenizer.chat_template is not None
    assert_params_match(loaded, model.float(), atol=0)


def test_hf_directory_without_tokenizer(tmp_path):
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizer") as e:
        weights.load_model(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_hf_directory_rejects_other_architectures(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama, ") as e:
        weights.load_model(tmp_path)
    assert str(tmp_path) in str(e.value)


# ---------------------------------------------------------------- bad paths

@pytest.mark.parametrize("kind", ["missing", "empty_dir", "text_file", "bad_gguf"])
def test_bad_paths(tmp_path, kind):
    path = {"missing": tmp_path / "nope", "empty_dir": tmp_path, "text_file": tmp_path / "notes.txt",
            "bad_gguf": tmp_path / "model.gguf"}[kind]
    if kind in ("text_file", "bad_gguf"):
        path.write_text("not a model\n")
    with pytest.raises(ValueError) as e:
        weights.load_model(str(path))
    message = str(e.value)
    assert str(path) in message and "\n" not in message
    if kind != "bad_gguf":
        assert "expected a .gguf file or a directory with config.json" in message


def test_missing_default_model(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == loader.DEFAULT_MODEL_PACKAGE else real(name, *a))
    for call in (loader.default_model_path, weights.load_model):
        with pytest.raises(ValueError, match="not installed") as e:
            call()
        assert loader.DEFAULT_MODEL_INSTALL in str(e.value)


# ---------------------------------------------------------------- corrupt files: a clear error naming the file

def tiny_hf_dir(path, tokenizer, **overrides):
    config = dict(vocab_size=tokenizer.vocab_size + len(tokenizer.get_added_vocab()), hidden_size=16,
                  intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides})).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def assert_names(error, path) -> None:
    message = str(error.value)
    assert str(path) in message and "\n" not in message and "Traceback" not in message, message


@pytest.mark.parametrize("keep", [16, 4096, 1 << 20, 40 << 20])
def test_a_truncated_gguf_file(default_model_path, tmp_path, keep):
    path = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        path.write_bytes(f.read(keep))
    for call in (weights.read_config, weights.load_model):
        with pytest.raises(ValueError) as e:
            call(path)
        assert_names(e, path)


def test_a_model_directory_with_a_broken_config(default_model, tmp_path):
    hf = tiny_hf_dir(tmp_path / "hf", default_model.tokenizer)
    (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": ')  # cut short
    for call in (weights.read_config, weights.load_model):
        with pytest.raises(ValueError, match="not a readable JSON file") as e:
            call(hf)
        assert_names(e, hf / "config.json")
    (hf / "config.json").write_text('["a list"]')
    with pytest.raises(ValueError, match="expected a JSON object") as e:
        weights.load_model(hf)
    (hf / "config.json").unlink()  # missing: not a model directory any more
    with pytest.raises(ValueError, match="expected a .gguf file or a directory with config.json") as e:
        weights.load_model(hf)
    assert_names(e, hf)


def test_a_model_directory_with_a_truncated_or_mismatched_weights_file(default_model, tmp_path):
    hf = tiny_hf_dir(tmp_path / "hf", default_model.tokenizer)
    weights_file = hf / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable safetensors file") as e:
        weights.load_model(hf)
    assert_names(e, weights_file)
    hf = tiny_hf_dir(tmp_path / "hf2", default_model.tokenizer)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))  # the tensors say 32
    with pytest.raises(ValueError, match=r"tensor layers.0.w_gate has shape \(32, 16\), expected \(48, 16\)") as e:
        weights.load_model(hf)
    assert_names(e, hf)


def test_a_checkpoint_with_a_broken_manifest_or_parameters(default_model, tmp_path):
    path = checkpoint.save(default_model, tmp_path / "ckpt")
    manifest = path / checkpoint.MANIFEST
    good = manifest.read_text()
    for text, match in (("{not json", "not a readable jpaged checkpoint manifest"),
                        ('{"format": "other"}', "not a jpaged checkpoint manifest"),
                        (good.replace('"version": 1', '"version": 99'), "checkpoint version 99, expected 1"),
                        (good.replace('"num_layers"', '"layers"'), "a malformed model config")):
        manifest.write_text(text)
        with pytest.raises(ValueError, match=match) as e:
            weights.load_model(path)
        assert_names(e, manifest)
    manifest.write_text(good)
    # issue 32: the largest file under params/ cut to half: one line naming the checkpoint and the array,
    # and nothing after it (orbax's reads still in flight used to print "Event loop is closed" tracebacks)
    largest = max((f for f in (path / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:largest.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cannot restore the parameters \(array '[a-z_.]+' is unreadable: .*\): "
                       r"the checkpoint is damaged: convert the model again \(jpaged convert\)") as e:
        weights.load_model(path)
    assert_names(e, path / "params")
    assert len(str(e.value)) - len(str(path)) < 250, str(e.value)  # not TensorStore's whole spec
    result = subprocess.run([sys.executable, "-m", "jpaged.entrypoints.cli", "generate", "Hi", "--model", str(path),
                             "--max-tokens", "4", "--num-blocks", "16"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: {path / 'params'}: cannot restore"), \
        result.stderr
    for array in (path / "params").rglob("*"):  # the saved arrays, cut short
        if array.is_file() and array.stat().st_size > 4096:
            array.write_bytes(array.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot restore the parameters") as e:
        weights.load_model(path)
    assert_names(e, path / "params")


def test_half_a_hf_directory_says_what_is_missing(tmp_path):
    """Issue 32: a HF directory without safetensors, or with a broken config.json, is told what is missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text('{"model_type": "llama"}')
    (bin_dir / "pytorch_model.bin").write_bytes(b"")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", ')
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(b"")
    for path, match in (
            (bin_dir, r"a HF model directory without its \*\.safetensors weights \(found pytorch_model.bin\): "
                      r"download the model's \*\.safetensors files into it; jpaged reads safetensors, not PyTorch"),
            (broken, r"without its \*\.safetensors weights: download .*; and .*config.json is not readable JSON "
                     r"\(.*\): restore the model's config.json"),
            (bare, r"\*\.safetensors weights without config.json: put the model's config.json beside them")):
        for call in (weights.read_config, weights.load_model):
            with pytest.raises(ValueError, match=match) as e:
                call(path)
            assert_names(e, path)
