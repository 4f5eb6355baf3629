"""GGUF files of the mixture-of-experts families, as llama.cpp writes them, against the HF directories and HF.

`write_moe_gguf` writes each tiny model of `tests/test_moe.py` as llama.cpp's `convert_hf_to_gguf.py`
(`Qwen2MoeModel`, `Qwen3MoeModel`, `OlmoeModel`, and `LlamaModel` for Mixtral) writes it: the metadata keys
each writes (`{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length`,
`expert_shared_feed_forward_length`), each layer's experts merged into one [E, out, in] tensor per projection
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), the router `ffn_gate_inp`, Qwen2-MoE's shared expert
(`ffn_*_shexp`, `ffn_gate_inp_shexp`), tensor names from gguf-py's own name map, llama.cpp's q/k permutation
for Mixtral's 'llama' files; the key set was checked against the real converter's output (the opt-in test
below runs that converter when `JPAGED_LLAMA_CPP` names a llama.cpp checkout).

What a llama.cpp file does not carry: HF's `norm_topk_prob` (llama.cpp renormalizes for qwen3moe and Mixtral,
not for qwen2moe or olmoe: `build_moe_ffn(..., norm_w)`; the loader takes the same built-in choice, or the
file's `expert_weights_norm`), and OLMoE's `clip_qkv` (its converter writes no `attention.clamp_kqv`): the
tiny models here use what the files can say (`CARRIED`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jpaged import weights
from jpaged.device.attention import get_backend
from jpaged.device.model import sequence_logits
from test_families_gguf import _permute, finish_gguf, start_gguf, tokenizer_fields  # noqa: F401  (a fixture)
from test_moe import MOE_FAMILIES, PROMPTS, build_moe

GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
# what a llama.cpp file can say: Qwen3-MoE renormalizes its top k, OLMoE has no clip_qkv
CARRIED = {"qwen3_moe": dict(norm_topk_prob=True), "olmoe": dict(clip_qkv=None)}
# an expert's projections, as HF names them in the one-tensor-per-expert layout
PROJECTIONS = {"mixtral": ("w1", "w2", "w3")}


def write_moe_gguf(path, directory, hf_config, tokenizer_fields):
    hp = hf_config.to_dict()
    model_type = hp["model_type"]
    arch = GGUF_ARCH[model_type]
    w, (n_layers, hidden, heads, kv_heads, head_dim) = start_gguf(path, arch, hp)
    w.add_rope_freq_base((hp.get("rope_parameters") or {}).get("rope_theta", hp.get("rope_theta", 10000.0)))
    w.add_expert_count(hp.get("num_experts") or hp.get("num_local_experts"))
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None and arch != "llama":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if hp.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(head_dim)

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layers)
    projections = PROJECTIONS.get(model_type, ("gate_proj", "up_proj", "down_proj"))
    experts = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        base, suffix = name.rsplit(".", 1)
        data = tensor.astype(np.float32)
        if ".experts." in base:  # model.layers.{i}.{block}.experts.{e}.{proj}: merged per layer and projection
            layer, rest = base.split(".experts.")
            e, proj = rest.split(".")
            experts.setdefault((layer, proj), {})[int(e)] = data
            continue
        if arch == "llama" and base.endswith("q_proj"):
            data = _permute(data, heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = _permute(data, kv_heads)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        w.add_tensor(f"{gguf_name}.{suffix}", data)
    for (layer, proj), by_expert in sorted(experts.items()):
        assert proj in projections
        merged = f"{layer}.experts.{proj}"  # model.layers.{i}.{block}.experts.{proj}, one [E, out, in] tensor
        gguf_name = names.get_name(merged)
        assert gguf_name is not None, merged
        w.add_tensor(f"{gguf_name}.weight", np.stack([by_expert[e] for e in sorted(by_expert)]))
    return finish_gguf(w, path, tokenizer_fields)


@pytest.fixture(scope="module")
def moe_ggufs(tmp_path_factory, default_model, tokenizer_fields):
    """name -> (HF directory, GGUF file, HF model)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe_gguf")
    out = {}
    for name in MOE_FAMILIES:
        model = build_moe(name, root / name, default_model.tokenizer, **CARRIED.get(name, {}))
        out[name] = (root / name, write_moe_gguf(root / f"{name}.gguf", root / name, model.config, tokenizer_fields),
                     model)
    return out


def _same_as_hf_dir(gguf_path, directory, model, default_model):
    loaded, ref = weights.load_model(gguf_path), weights.load_model(directory)
    differs = {f.name for f in dataclasses.fields(ref.config)
               if getattr(loaded.config, f.name) != getattr(ref.config, f.name)}
    assert not differs, {f: (getattr(loaded.config, f), getattr(ref.config, f)) for f in differs}
    ids = [list(default_model.tokenizer(p).input_ids) for p in PROMPTS]
    for prompt_ids, ours in zip(ids, sequence_logits(loaded.params, ids, config=loaded.config,
                                                     backend=get_backend("xla"))):
        with torch.no_grad():
            hf = model(torch.tensor([prompt_ids])).logits[0].numpy()
        assert np.abs(np.asarray(ours) - hf).max() <= 1e-4


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_moe_gguf_matches_the_hf_directory_and_hf(moe_ggufs, default_model, name):
    """The file loads to the HF directory's config, every field, and to HF's logits (float32, within 1e-4)."""
    _same_as_hf_dir(*moe_ggufs[name], default_model)


@pytest.mark.skipif(not os.environ.get("JPAGED_LLAMA_CPP"), reason="JPAGED_LLAMA_CPP names no llama.cpp checkout")
@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_files_of_llama_cpps_own_converter(moe_ggufs, default_model, tmp_path, name):
    """The same HF directories converted by llama.cpp's `convert_hf_to_gguf.py` (`--outtype f32`, its own
    gguf-py), where `JPAGED_LLAMA_CPP` names a checkout (e.g. the llama.cpp inside the llama-cpp-python sdist;
    Mixtral's 'llama' converter also imports sentencepiece)."""
    directory, _, model = moe_ggufs[name]
    root = pathlib.Path(os.environ["JPAGED_LLAMA_CPP"])
    out = tmp_path / f"{name}.gguf"
    run = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(directory), "--outfile", str(out),
                          "--outtype", "f32"], env={**os.environ, "PYTHONPATH": str(root / "gguf-py")},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    _same_as_hf_dir(out, directory, model, default_model)
