"""GGUF files of every family, written as llama.cpp's `convert_hf_to_gguf.py` writes them, against HF
transformers on the same weights.

Each tiny HF model of `test_families` (built with `build_family`) is written out again as a GGUF file
by `write_gguf` below, which mirrors the converter (its `LlamaModel`, `Qwen2Model`, `Qwen3Model`,
`Phi3MiniModel`, `Gemma2Model`, `Gemma3Model`): the metadata keys each one writes, tensor names
from gguf-py's own name map (independent of the loader's table), llama.cpp's q/k row permutation for
'llama' files, Gemma's +1 on every norm, Phi-3's fused tensors as they are, Llama 3's frequency factors
as a `rope_freqs` tensor, float32 tensors; and the default model's tokenizer metadata, so HF builds the
tokenizer from the file. `load_model` on that file must give HF's logits (XLA attention) and the
config read from the HF directory.

What a GGUF written by llama.cpp cannot carry, and so is compared differently here:
  - Llama 3's rule parameters: only the frequency factors are stored; the loader recovers a rule
    giving the same frequencies (`RULE_NOT_CARRIED`: the frequencies are compared instead).
  - dynamic NTK scaling: nothing is written (llama.cpp has none); the file loads unscaled, which
    matches HF only while a sequence is within `max_position_embeddings`.
  - Mistral's sliding window: its converter writes none (`attention.sliding_window` is honoured when a
    file has it; `EXTRA_KEYS`); Mistral is told from Llama by `general.name`, as HF does.
  - Gemma's `query_pre_attn_scalar` (llama.cpp derives it from the layer count: hidden / heads for the
    27B, else head_dim), Gemma 3's layer pattern (llama.cpp: every 6th layer global) and its local
    RoPE base (llama.cpp: 10000): the loader honours `attention.scale`,
    `attention.sliding_window_pattern` and `rope.freq_base_swa` when present, and the test writes
    the first two where the tiny models differ from llama.cpp's built-in values.
"""

from __future__ import annotations

import dataclasses
import math

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jpaged import weights
from jpaged.device.attention import get_backend
from jpaged.device.config import RopeScaling, rope_inv_freq
from jpaged.device.model import sequence_logits
from jpaged.weights import gguf_file, gguf_tokenizer, loader
from test_families import FAMILIES, PROMPTS, build_family

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3_text": "gemma3"}
# llama.cpp's built-in values for Gemma (llama-model.cpp): the period of the sliding-window layers
GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
RULE_NOT_CARRIED = {"llama3": "rope_scaling", "llama-dynamic": "rope_scaling"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rows of each head from rotate-half to interleaved order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    """`LlamaModel.generate_extra_tensors`: the frequency factors of rope_type 'llama3'."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def start_gguf(path, arch: str, hp: dict):
    """A GGUF writer of architecture `arch` with the shape keys every converter writes (`TextModel.
    set_gguf_parameters`) from HF config dict `hp`; returns it and (layers, hidden, heads, KV heads, head_dim)."""
    n_layers, hidden, heads = hp["num_hidden_layers"], hp["hidden_size"], hp["num_attention_heads"]
    kv_heads = hp.get("num_key_value_heads") or heads
    head_dim = hp.get("head_dim") or hidden // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {hp['model_type']}")
    w.add_block_count(n_layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    return w, (n_layers, hidden, heads, kv_heads, head_dim)


def write_gguf(path, directory, hf_config, tokenizer_fields, extra_keys=True):
    """`directory`'s model (config.json + model.safetensors) as llama.cpp's converter writes it, plus the
    given tokenizer fields. `extra_keys`: also the keys llama.cpp's converter does not write for this
    family but the loader honours (Mistral's window, Gemma's attention scale and layer pattern)."""
    hp = hf_config.to_dict()
    model_type, arch = hp["model_type"], GGUF_ARCH[hp["model_type"]]
    rope_all = hp.get("rope_parameters") or {}
    rope = rope_all.get("full_attention", rope_all)
    w, (n_layers, hidden, heads, kv_heads, head_dim) = start_gguf(path, arch, hp)
    if arch not in ("phi3", "gemma2"):  # TextModel.set_gguf_parameters: RoPE base and scaling
        w.add_rope_freq_base(rope["rope_theta"])
        rope_type = rope.get("rope_type")
        if rope_type == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        elif rope_type == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for key, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                             ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
                if rope.get(key) is not None:
                    add(rope[key])
    if hp.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    elif arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                                 hp.get("original_max_position_embeddings")))
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(hp.get("sliding_window") or 0)
    elif arch == "gemma2":
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    elif arch == "gemma3":
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    if extra_keys and model_type == "mistral" and hp.get("sliding_window"):
        w.add_sliding_window(hp["sliding_window"])
    if extra_keys and arch in GEMMA_SWA_PERIOD:
        if hp["query_pre_attn_scalar"] != head_dim:
            w.add_float32(gguf.Keys.Attention.SCALE.format(arch=arch), hp["query_pre_attn_scalar"] ** -0.5)
        period = GEMMA_SWA_PERIOD[arch]
        builtin = [i % period < period - 1 for i in range(n_layers)]
        local = [t == "sliding_attention" for t in hp["layer_types"]]
        if local != builtin:
            w.add_sliding_window_pattern(local)
    if model_type == "mistral":
        w.add_name("Tiny Mistral")  # how HF (and the loader) tell Mistral from Llama

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layers)
    for name, tensor in load_file(directory / "model.safetensors").items():  # what the converter reads
        if arch.startswith("gemma") and name == "lm_head.weight":  # Gemma*Model.filter_tensors
            continue
        base, suffix = name.rsplit(".", 1)
        data = tensor.astype(np.float32)
        if arch == "llama" and base.endswith("q_proj"):
            data = _permute(data, heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = _permute(data, kv_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        w.add_tensor(f"{gguf_name}.{suffix}", data)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))

    return finish_gguf(w, path, tokenizer_fields)


def finish_gguf(w, path, tokenizer_fields):
    """Adds the tokenizer fields to writer `w` and writes its file at `path`; returns `path`."""
    for key, (value, vtype, sub_type) in tokenizer_fields.items():
        w.add_key_value(key, value, vtype, sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tokenizer_fields(default_model_path) -> dict:
    """Every `tokenizer.*` field of the default model's GGUF: key -> (value, type, array element type)."""
    reader = gguf.GGUFReader(default_model_path)
    return {key: (field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
            for key, field in reader.fields.items() if key.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory, default_model, tokenizer_fields):
    """name -> (HF directory, GGUF file, HF model), built once for the module."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("families_gguf")
    models = {}
    for name in FAMILIES:
        model = build_family(name, root / name, default_model.tokenizer)
        models[name] = (root / name, write_gguf(root / f"{name}.gguf", root / name, model.config, tokenizer_fields),
                        model)
    return models


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_gguf_matches_hf(gguf_models, default_model, name):
    """The GGUF file loads to HF's config (but for what a GGUF cannot carry) and HF's prefill logits at
    every position of three prompts (float32, XLA attention)."""
    directory, path, model = gguf_models[name]
    loaded = weights.load_model(path)
    config, ref = loaded.config, loader.hf_config(directory, loaded.tokenizer)
    assert config.architecture == model.config.model_type
    field = RULE_NOT_CARRIED.get(name)
    if field is not None:  # frequencies carried, not the rule
        assert config.rope_scaling != ref.rope_scaling
        config = dataclasses.replace(config, rope_scaling=ref.rope_scaling)
    assert config == ref
    if name == "llama3":
        ours = rope_inv_freq(config.head_dim, config.rope_theta, loaded.config.rope_scaling,
                             max_position_embeddings=config.max_position_embeddings)[0]
        hf = rope_inv_freq(ref.head_dim, ref.rope_theta, ref.rope_scaling,
                           max_position_embeddings=ref.max_position_embeddings)[0]
        np.testing.assert_allclose(ours, hf, rtol=1e-6)
    if name == "llama-dynamic":
        assert loaded.config.rope_scaling is None

    ids = [list(default_model.tokenizer(p).input_ids) for p in PROMPTS]
    assert [list(loaded.tokenizer(p).input_ids) for p in PROMPTS] == ids
    if name == "llama-dynamic":  # unscaled is dynamic NTK only within max_position_embeddings
        ids = [i for i in ids if len(i) <= ref.max_position_embeddings]
        assert ids
    logits = sequence_logits(loaded.params, ids, config=loaded.config, backend=get_backend("xla"))
    for i, (prompt_ids, ours) in enumerate(zip(ids, logits)):
        with torch.no_grad():
            hf = model(torch.tensor([prompt_ids])).logits[0].float().numpy()
        assert np.abs(hf).max() > 1.0
        diff = np.abs(np.asarray(ours) - hf).max()
        assert diff <= 1e-4, f"{name}, prompt {i}: max abs logit diff {diff}"


@pytest.mark.parametrize("name, differs", [
    ("mistral", dict(layer_windows=())),
    ("gemma2", dict(query_pre_attn_scalar=32)),
    ("gemma3", dict(query_pre_attn_scalar=32, layer_windows=(8, 8, 8))),
])
def test_what_llama_cpp_files_do_not_carry(gguf_models, tokenizer_fields, tmp_path, name, differs):
    """Written exactly as llama.cpp's converter writes them (no extra keys), these files load to what
    llama.cpp runs: Mistral without its window, Gemma with llama.cpp's built-in attention scale (head_dim)
    and layer pattern (every 6th layer global)."""
    directory, _, model = gguf_models[name]
    path = write_gguf(tmp_path / "plain.gguf", directory, model.config, tokenizer_fields, extra_keys=False)
    config, ref = weights.read_config(path), weights.read_config(directory)
    assert config == dataclasses.replace(ref, **differs)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rule_recovered_from_frequency_factors(factor):
    """Llama 3.1's (and 3.2's) rule comes back exactly from the factors the converter stores."""
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=factor, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)
    rule = loader._llama3_rule(_llama3_factors(rope, 128), 128, 500000.0, 131072, "f.gguf")
    assert rule == RopeScaling("llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)


# ---------------------------------------------------------------- what jpaged does not implement

def _tiny_gguf(path, arch, keys=(), tensors=()):
    """A metadata-only GGUF (tiny vocabulary) of architecture `arch`, plus `keys` (suffix -> value, type
    under `{arch}.`) and `tensors`."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_token_list(["a", "b", "c", "d"])
    for key, (value, vtype) in dict(keys).items():
        w.add_key_value(f"{arch}.{key}", value, vtype)
    for name, data in dict(tensors).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_STR, _U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("arch, keys, tensors, named", [
    ("mamba", {}, {}, "general.architecture 'mamba' is not supported"),
    ("llama", {"rope.scaling.type": ("longrope", _STR)}, {}, "llama.rope.scaling.type = 'longrope'"),
    ("qwen2", {"rope.scaling.type": ("su", _STR)}, {}, "qwen2.rope.scaling.type = 'su'"),
    ("qwen2", {"expert_count": (8, _U32)}, {}, "qwen2.expert_count = 8 (a mixture of experts) is not supported"),
    ("llama", {"expert_count": (8, _U32), "expert_used_count": (9, _U32)}, {},
     "num_experts_per_tok (9) must be between 1 and num_experts (8)"),
    ("llama", {"rope.dimension_count": (4, _U32)}, {}, "llama.rope.dimension_count = 4"),
    ("llama", {}, {"rope_freqs.weight": np.array([1.0, 3.0, 2.0, 5.0], np.float32)}, "tensor rope_freqs.weight"),
    ("phi3", {}, {"rope_factors_long.weight": np.ones(4, np.float32)}, "tensor rope_factors_long.weight"),
], ids=["architecture", "rope_type", "rope_type_qwen2", "moe", "moe_top_k", "partial_rope", "rope_freqs", "longrope"])
def test_unsupported_gguf_metadata_is_refused_naming_the_key(tmp_path, monkeypatch, arch, keys, tensors, named):
    """Refused by `read_config` and `load_model` before any weight or the tokenizer is read, in one
    line naming the key (or the tensor that stands for it)."""
    path = _tiny_gguf(tmp_path / "m.gguf", arch, keys, tensors)
    read = gguf_file.GGUFFile.tensor

    def only_rope_freqs(self, name):
        assert name == "rope_freqs.weight", f"read tensor {name}"
        return read(self, name)

    monkeypatch.setattr(gguf_file.GGUFFile, "tensor", only_rope_freqs)
    monkeypatch.setattr(gguf_tokenizer, "load_tokenizer", lambda *a, **k: pytest.fail("read the tokenizer"))
    for call in (weights.read_config, weights.load_model):
        with pytest.raises(ValueError) as error:
            call(path)
        message = str(error.value)
        assert named in message and str(path) in message and "\n" not in message, message


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q6_K"])
def test_gguf_reader_matches_gguf_py(tmp_path, qtype):
    """The loader's one-pass reader gives gguf-py's `GGUFReader` + `dequantize` values, shapes and metadata."""
    qt = gguf.GGMLQuantizationType[qtype]
    data = np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32)
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_float32("llama.rope.freq_base", 1e6)
    w.add_array("llama.attention.sliding_window_pattern", [True, False, True])
    w.add_token_list([f"t{i}" for i in range(5000)])  # long: kept as its length
    if qtype in ("F32", "F16"):
        stored = data.astype(np.float16 if qtype == "F16" else np.float32)
    elif qtype == "Q6_K":  # gguf-py dequantizes it but cannot quantize: random blocks
        stored = np.random.default_rng(1).integers(0, 256, gguf.quants.quant_shape_to_byte_shape(data.shape, qt),
                                                   dtype=np.uint8)
    else:
        stored = gguf.quants.quantize(data, qt)
    w.add_tensor("w", stored, raw_dtype=qt)
    w.add_tensor("v", data[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = gguf_file.read(path), gguf.GGUFReader(path)
    for t in ref.tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        np.testing.assert_array_equal(ours.tensor(t.name), expected.reshape(tuple(reversed(t.shape.tolist()))))
    assert ours.tensor("w").shape == (6, 256) and ours.tensors["w"][1] == qt
    assert ours.get("llama.rope.freq_base") == 1e6 and ours.get("llama.attention.sliding_window_pattern") == [
        True, False, True] and len(ours.get("tokenizer.ggml.tokens")) == 5000
