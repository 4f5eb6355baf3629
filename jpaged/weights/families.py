"""The model families jpaged runs, as declarations: how each one's HF config maps onto
`jpaged.device.config.ModelConfig` and how its tensors are named. No forward pass lives here: the
one decoder (`jpaged.device.model`) runs every family from its `ModelConfig`.

A family is a `Family`: the `ModelConfig` fields it fixes (norm offset, sandwich norms, q/k norms,
biases), whether its embeddings are scaled, its tensor names where they differ from Llama's, and
the fused tensors it splits (Phi-3), and for a mixture of experts its `Experts` (the config fields
that count and size them, its routing rule, a shared expert, the experts' tensor names). Everything a
config spells the same way in every family (shapes, RoPE and its scaling, sliding windows and layer
types, soft-caps, the attention scalar, the activation, `num_experts_per_tok`, `mlp_only_layers`) is
read once, by `model_config`. Adding a family is adding an entry to `FAMILIES`.

What jpaged does not implement is refused before anything loads, naming the config field
(`unsupported_fields`, `REFUSED`): experts in a family it runs dense, multi-head latent attention, a
vision tower, an unknown RoPE type, partial RoPE, biases on the output or MLP projections,
bidirectional attention; `ModelConfig` itself refuses dense layers among sparse ones.

GGUF files (llama.cpp's) are declared alike, per GGUF `general.architecture`: `GGUF_ARCHS` maps each
onto its HF family with what llama.cpp's converter does to its tensors (q/k permutation, Gemma's +1
on norms, fused tensors) and what llama.cpp assumes rather than stores (activation, Gemma's layer
pattern, local RoPE base, attention scale); `GGUF_UNSUPPORTED_KEYS` lists the metadata refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jpaged.device.config import ROPE_TYPES, ModelConfig, RopeScaling
from jpaged.device.params import EXPERT_LEAVES, param_shapes

# LayerParams leaf -> tensor name inside one HF layer (`model.layers.{i}.<name>.weight` / `.bias`), Llama's
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
}
_GEMMA_NORMS = {"mlp_norm": "pre_feedforward_layernorm", "post_attn_norm": "post_attention_layernorm",
                "post_mlp_norm": "post_feedforward_layernorm"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclasses.dataclass(frozen=True)
class Experts:
    """How a family declares its mixture of experts (`ModelConfig.num_experts` ...) and names its tensors.

    count         the config field holding the number of experts (`num_experts`; Mixtral `num_local_experts`)
    size          the config field holding each expert's FFN size (`moe_intermediate_size`; Mixtral and
                  OLMoE use `intermediate_size`)
    renormalize   the top-k probabilities renormalized whatever the config says (Mixtral); None: the
                  config's `norm_topk_prob`
    shared        a shared expert with a sigmoid gate (Qwen2-MoE: `shared_expert_intermediate_size`)
    block         the sparse block's module in a layer, in the one-tensor-per-expert layout
                  (`mlp`; Mixtral `block_sparse_moe`); transformers 5's fused layout is `mlp` for all
    projections   an expert's (gate, up, down) tensor names in that layout (Mixtral: w1, w3, w2)

    Tensors, per layer: the router `{block}.gate` [E, hidden]; expert e's `{block}.experts.{e}.{proj}`, or
    the fused `mlp.experts.gate_up_proj` [E, 2 * I, hidden] (gate rows, then up) and `mlp.experts.down_proj`
    [E, hidden, I]; Qwen2-MoE's `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert_gate` [1, hidden].
    """

    count: str = "num_experts"
    size: str = "moe_intermediate_size"
    renormalize: bool | None = None
    shared: bool = False
    block: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


SHARED_EXPERT_NAMES = {"shared_w_gate": "mlp.shared_expert.gate_proj", "shared_w_up": "mlp.shared_expert.up_proj",
                       "shared_w_down": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate"}
FUSED_EXPERTS = {"mlp.experts.gate_up_proj": ("experts_gate", "experts_up"), "mlp.experts.down_proj": ("experts_down",)}


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's declarations (see the module docstring).

    declarations  `ModelConfig` fields the family fixes, whatever its config says
    scale_embeddings  embeddings multiplied by sqrt(hidden_size) (Gemma)
    layer_names   LayerParams leaf -> HF tensor name, where it differs from `HF_LAYER_NAMES`
    fused         HF tensor name in a layer -> the leaves it holds, stacked along its rows, in order
    experts       its mixture of experts (`Experts`), or None: a dense family
    """

    declarations: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scale_embeddings: bool = False
    layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    experts: Experts | None = None

    def hf_layer_names(self) -> dict[str, str]:
        """Every LayerParams leaf this family stores unfused -> its HF tensor name in a layer."""
        return _unfused({**HF_LAYER_NAMES, **self.layer_names}, self.fused)


_GEMMA = dict(norm_offset=1.0, sandwich_norms=True)
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(declarations=dict(attention_bias=True)),
    "qwen3": Family(declarations=dict(qk_norm=True)),
    "phi3": Family(fused={"self_attn.qkv_proj": ("wq", "wk", "wv"), "mlp.gate_up_proj": ("w_gate", "w_up")}),
    "gemma2": Family(declarations=_GEMMA, scale_embeddings=True, layer_names=_GEMMA_NORMS),
    "gemma3_text": Family(declarations=dict(_GEMMA, qk_norm=True), scale_embeddings=True, layer_names=_GEMMA_NORMS),
    # mixtures of experts
    "qwen2_moe": Family(declarations=dict(attention_bias=True), experts=Experts(shared=True)),
    "qwen3_moe": Family(declarations=dict(qk_norm=True), experts=Experts()),
    "mixtral": Family(experts=Experts(count="num_local_experts", size="intermediate_size", renormalize=True,
                                      block="block_sparse_moe", projections=("w1", "w3", "w2"))),
    "olmoe": Family(declarations=dict(qk_norm=True, qk_norm_whole=True), experts=Experts(size="intermediate_size")),
}
# families jpaged refuses by name, with what they need that it lacks
REFUSED = {
    "gemma3": "Gemma 3 with its vision tower (vision_config), which jpaged does not run; use the text model "
              "(model_type 'gemma3_text', Gemma3ForCausalLM)",
    "deepseek_v2": "DeepSeek-V2's multi-head latent attention (MLA: kv_lora_rank), which jpaged does not run",
    "deepseek_v3": "DeepSeek-V3's multi-head latent attention (MLA: kv_lora_rank), which jpaged does not run",
    "qwen3_vl_moe": "Qwen3-VL with its vision tower (vision_config), which jpaged does not run",
}
SUPPORTED = tuple(FAMILIES)


def family(model_type: Any, where: str) -> Family:
    """The family of HF `model_type`; ValueError naming it (and `where`) when jpaged has none."""
    if model_type in REFUSED:
        raise ValueError(f"{where}: model_type {model_type!r} is {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return FAMILIES[model_type]


def _rope_parameters(hf, layer_type: str | None = None) -> dict:
    """HF's RoPE parameters (transformers >= 5: `rope_parameters`, per layer type for Gemma 3;
    older configs: `rope_theta` and `rope_scaling`)."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf, "rope_scaling", None) or {}, rope_theta=getattr(hf, "rope_theta", 10000.0))
    if params and all(isinstance(v, dict) for v in params.values()):  # one entry per layer type
        params = params.get(layer_type or "full_attention") or next(iter(params.values()))
    return dict(params)


def _rope_scaling(rope: dict, where: str) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_parameters.rope_type {rope_type!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    keys = [f.name for f in dataclasses.fields(RopeScaling) if f.name != "rope_type"]
    return RopeScaling(rope_type=rope_type, **{k: rope[k] for k in keys if rope.get(k) is not None})


def unsupported_fields(hf) -> list[str]:
    """The config fields of `hf` that jpaged does not implement, each as 'field = value (why)'."""
    found = []

    def check(field, bad, why):
        value = getattr(hf, field, None)
        if value is not None and bad(value):
            found.append(f"{field} = {value!r} ({why})")

    fam = FAMILIES.get(getattr(hf, "model_type", None))
    if fam is None or fam.experts is None:
        for field in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
            check(field, lambda v: bool(v), "a mixture of experts, in a family jpaged runs dense")
    check("kv_lora_rank", bool, "multi-head latent attention (MLA)")
    if getattr(hf, "model_type", None) == "qwen2_moe":
        check("qkv_bias", lambda v: not v, "Qwen2-MoE without its q/k/v biases")
    check("vision_config", lambda v: True, "a vision tower")
    check("mlp_bias", bool, "biases on the MLP projections")
    check("use_bidirectional_attention", bool, "bidirectional attention")
    check("partial_rotary_factor", lambda v: v != 1.0, "partial RoPE")
    rope = _rope_parameters(hf)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        found.append(f"rope_parameters.partial_rotary_factor = {rope['partial_rotary_factor']} (partial RoPE)")
    if getattr(hf, "model_type", None) not in ("qwen2", "qwen2_moe"):  # their q/k/v biases; elsewhere o has one too
        check("attention_bias", bool, "biases on the attention projections")
    return found


def model_config(hf, model_type: str, *, eos_token_ids: tuple[int, ...], where: str) -> ModelConfig:
    """The `ModelConfig` of a HF config object (`transformers.AutoConfig`) of family `model_type`.
    Raises ValueError naming the first field jpaged does not implement."""
    fam = family(model_type, where)
    bad = unsupported_fields(hf)
    if bad:
        raise ValueError(f"{where}: {bad[0]} is not supported")
    num_layers, num_heads = hf.num_hidden_layers, hf.num_attention_heads
    activation = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{where}: hidden_act {activation!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")

    sliding_window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{where}: layer_types {unknown[0]!r} is not supported (full_attention, sliding_attention)")
        windows = tuple(sliding_window if t == "sliding_attention" else None for t in layer_types)
    else:  # Mistral, Phi-3: one window for every layer, or none
        windows = (sliding_window,) * num_layers
    if any(t == "sliding_attention" for t in layer_types or ()) and not sliding_window:
        raise ValueError(f"{where}: layer_types has sliding_attention layers but sliding_window is {sliding_window!r}")
    windows = () if all(w is None for w in windows) else windows

    rope = _rope_parameters(hf)
    local_rope = _rope_parameters(hf, "sliding_attention")
    local_theta = None
    if windows and local_rope is not rope and local_rope != rope:
        if _rope_scaling(local_rope, where) is not None:
            raise ValueError(f"{where}: RoPE scaling on the sliding-window layers ({local_rope}) is not supported")
        local_theta = float(local_rope["rope_theta"])
    scaling = _rope_scaling(rope, where)
    if scaling is not None and scaling.rope_type == "dynamic" and local_theta is not None:
        raise ValueError(f"{where}: dynamic RoPE with a separate sliding-layer base is not supported")

    fields = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=hf.bos_token_id,
        eos_token_ids=eos_token_ids,
        architecture=model_type,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        layer_windows=windows,
        activation=_ACTIVATIONS[activation],
        embedding_scale=math.sqrt(hf.hidden_size) if fam.scale_embeddings else 1.0,
        query_pre_attn_scalar=getattr(hf, "query_pre_attn_scalar", None),
        attn_logit_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
    )
    fields.update(fam.declarations)
    fields.update(clip_qkv=getattr(hf, "clip_qkv", None))
    if fam.experts is not None:
        fields.update(_experts_config(hf, fam.experts, num_layers, where))
    try:
        return ModelConfig(**fields)
    except ValueError as e:  # contradicting fields (top-k above the experts, ...)
        raise ValueError(f"{where}: {e}") from e


def _experts_config(hf, experts: Experts, num_layers: int, where: str) -> dict:
    """The `ModelConfig` fields of a family's mixture of experts, as HF reads them: layer i is sparse iff it
    is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0 (Qwen2-MoE, Qwen3-MoE)."""
    num_experts = getattr(hf, experts.count, None) or 0
    top_k = getattr(hf, "num_experts_per_tok", None) or 0
    if not num_experts:
        raise ValueError(f"{where}: {experts.count} = {num_experts!r}: a {hf.model_type} model has experts")
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    renormalize = experts.renormalize
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(top_k),
                moe_intermediate_size=int(getattr(hf, experts.size)),
                norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)) if renormalize is None else renormalize,
                shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
                if experts.shared else 0,
                sparse_layers=() if all(sparse) else sparse)


def _tensor_names(config: ModelConfig, names: dict[str, str], layer: str, layer_names: Mapping[str, str],
                  fused: Mapping[str, tuple[str, ...]]) -> tuple[dict[str, str], dict[str, tuple]]:
    """(file tensor name -> intermediate key, fused tensor name -> (keys, row counts)): `names` (the
    whole-model tensors) plus each layer's, `layer` formatting a layer's tensor from `i` and `name`
    (`.weight` appended unless the name ends in `.bias`). Only the leaves this model has are named."""
    shapes = param_shapes(config).layers
    rows = {"wq": config.num_heads * config.head_dim, "wk": config.num_kv_heads * config.head_dim,
            "wv": config.num_kv_heads * config.head_dim, "w_gate": config.intermediate_size,
            "w_up": config.intermediate_size}
    names, fused_names = dict(names), {}
    for i in range(config.num_layers):
        for leaf, name in layer_names.items():
            if getattr(shapes, leaf) is not None:
                suffix = "" if name.endswith(".bias") else ".weight"
                names[layer.format(i=i, name=name) + suffix] = f"layers.{i}.{leaf}"
        for name, leaves in fused.items():
            fused_names[layer.format(i=i, name=name) + ".weight"] = (
                tuple(f"layers.{i}.{leaf}" for leaf in leaves), tuple(rows[leaf] for leaf in leaves))
    return names, fused_names


def _unfused(names: Mapping[str, str], fused: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """`names` less the leaves that `fused` tensors hold."""
    fused_leaves = {leaf for leaves in fused.values() for leaf in leaves}
    return {leaf: name for leaf, name in names.items() if leaf not in fused_leaves}


def hf_tensor_names(model_type: str, config: ModelConfig) -> tuple[dict[str, str], dict[str, tuple]]:
    """(HF tensor name -> intermediate key, HF fused tensor name -> (keys, row counts)) for a model of
    `config` (see `jpaged.weights.loader` for the intermediate keys: `embed`, `layers.{i}.{leaf}`,
    `layers.{i}.{expert leaf}.{e}` for one expert's tensor, ...). A mixture of experts' fused tensors
    (`FUSED_EXPERTS`) map to `(keys, None)`: whole stacks of experts, split by the loader."""
    fam = FAMILIES[model_type]
    names = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
    layer_names = fam.hf_layer_names()
    if fam.experts is not None:
        layer_names = {**layer_names, **SHARED_EXPERT_NAMES}
    names, fused = _tensor_names(config, names, "model.layers.{i}.{name}", layer_names, fam.fused)
    if fam.experts is not None and config.is_moe:
        ex = fam.experts
        for i in range(config.num_layers):
            layer = f"model.layers.{i}"
            for block in {ex.block, "mlp"}:  # the router keeps its name in transformers 5's fused layout
                names[f"{layer}.{block}.gate.weight"] = f"layers.{i}.router"
            for e in range(config.num_experts):
                for leaf, proj in zip(EXPERT_LEAVES, ex.projections):
                    names[f"{layer}.{ex.block}.experts.{e}.{proj}.weight"] = f"layers.{i}.{leaf}.{e}"
            for name, leaves in FUSED_EXPERTS.items():
                fused[f"{layer}.{name}"] = (tuple(f"layers.{i}.{leaf}" for leaf in leaves), None)
    return names, fused


# ---------------------------------------------------------------- GGUF: the files llama.cpp writes

# LayerParams leaf -> tensor name inside one GGUF layer (`blk.{i}.<name>`, `.weight` unless the name
# ends in `.bias`): llama.cpp's standard names (gguf-py's `MODEL_TENSOR`), the same in every family.
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
    "post_attn_norm": "post_attention_norm", "post_mlp_norm": "post_ffw_norm",
    # a mixture of experts: the router, each layer's experts as one stack [E, out, in], the shared expert
    "router": "ffn_gate_inp", "experts_gate": "ffn_gate_exps", "experts_up": "ffn_up_exps",
    "experts_down": "ffn_down_exps", "shared_w_gate": "ffn_gate_shexp", "shared_w_up": "ffn_up_shexp",
    "shared_w_down": "ffn_down_shexp", "shared_expert_gate": "ffn_gate_inp_shexp",
}


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp (`convert_hf_to_gguf.py` writing, `llama-model.cpp` reading) stores one family,
    under one GGUF `general.architecture`. Everything spelled the same way in every architecture
    (`{arch}.` shape keys, RoPE scaling keys, sliding window, soft-caps) is read once by the loader.

    model_type        the HF family (`FAMILIES` key) the file loads as
    name_hints        substring of the lower-cased `general.name` -> model_type (HF transformers' rule:
                      Mistral is written as 'llama', and only its name tells it apart)
    permute_qk        attn_q/attn_k rows (and biases) are in llama.cpp's interleaved-RoPE order
                      (`LlamaModel.permute`, the 'llama' converter only); undone on load
    norm_shift        the converter adds it to every norm weight (Gemma's (1 + w) norms: +1); subtracted
    fused             tensor name in a layer -> the leaves it holds, stacked along its rows, in order
    activation        the gated MLP's activation (no file states it)
    swa_pattern       llama.cpp's built-in period p of the sliding-window layers when the file has no
                      `attention.sliding_window_pattern` (layer i is local iff i % p < p - 1); None: the
                      window, if any, applies to every layer
    default_window    llama.cpp's sliding window when the file has no `attention.sliding_window`
    swa_rope_theta    llama.cpp's built-in RoPE base of the sliding-window layers, unless the file has
                      `rope.freq_base_swa` (Gemma 3: 10000); None: the global base
    softcaps          llama.cpp's (attention, final) logit soft-caps when the file has neither key
    query_scalar_by_hidden  None: attention scale head_dim^-1/2 unless the file has `attention.scale`.
                      Else (Gemma) llama.cpp's rule: query_pre_attn_scalar is hidden / heads for models
                      of these layer counts (the 27B), head_dim otherwise
    moe_model_type    the HF family a file of this architecture with experts (`{arch}.expert_count` > 0)
                      loads as (Mixtral is written as 'llama'); None: its experts are `model_type`'s own
    renormalize_experts  llama.cpp's built-in choice to renormalize the top-k router probabilities (its
                      `build_moe_ffn(..., norm_w)`; no converter writes HF's `norm_topk_prob`), unless the
                      file has `expert_weights_norm`
    """

    model_type: str
    name_hints: Mapping[str, str] = dataclasses.field(default_factory=dict)
    permute_qk: bool = False
    norm_shift: float = 0.0
    fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    activation: str = "silu"
    swa_pattern: int | None = None
    default_window: int | None = None
    swa_rope_theta: float | None = None
    softcaps: tuple[float | None, float | None] = (None, None)
    query_scalar_by_hidden: tuple[int, ...] | None = None
    moe_model_type: str | None = None
    renormalize_experts: bool = False

    def layer_names(self) -> dict[str, str]:
        """Every LayerParams leaf this architecture stores unfused -> its tensor name in a layer."""
        return _unfused(GGUF_LAYER_NAMES, self.fused)


_GGUF_GEMMA = dict(norm_shift=1.0, activation="gelu_tanh")
GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", name_hints={"mistral": "mistral"}, permute_qk=True, moe_model_type="mixtral",
                      renormalize_experts=True),
    "qwen2": GGUFArch("qwen2"),
    "qwen3": GGUFArch("qwen3"),
    "phi3": GGUFArch("phi3", fused={"attn_qkv": ("wq", "wk", "wv"), "ffn_up": ("w_gate", "w_up")}),
    "gemma2": GGUFArch("gemma2", **_GGUF_GEMMA, swa_pattern=2, default_window=4096, softcaps=(50.0, 30.0),
                       query_scalar_by_hidden=(46,)),
    "gemma3": GGUFArch("gemma3_text", **_GGUF_GEMMA, swa_pattern=6, swa_rope_theta=10000.0,
                       query_scalar_by_hidden=(62,)),
    # mixtures of experts (llama.cpp's qwen2moe.cpp, qwen3moe.cpp, olmoe.cpp; Mixtral is 'llama')
    "qwen2moe": GGUFArch("qwen2_moe"),
    "qwen3moe": GGUFArch("qwen3_moe", renormalize_experts=True),
    "olmoe": GGUFArch("olmoe"),
}
# `{arch}.` keys that change the forward pass in ways jpaged does not implement: refused when present
# (with a value other than the harmless one, where one is given)
GGUF_UNSUPPORTED_KEYS: dict[str, tuple[Any, str]] = {
    "attention.causal": (True, "bidirectional attention"),
    "logit_scale": (None, "scaled logits"),
    "embedding_scale": (None, "scaled embeddings"),
    "residual_scale": (None, "scaled residuals"),
    "attention.clamp_kqv": (None, "clamped q/k/v"),
    "attention.max_alibi_bias": (None, "ALiBi"),
    "rope.dimension_sections": (None, "multimodal RoPE sections"),
    "rope.scaling.yarn_log_multiplier": (None, "YaRN's log multiplier (mscale_all_dim)"),
    "rope.scaling.yarn_ext_factor": (1.0, "a YaRN extrapolation factor other than 1"),
    "rope.scaling.attn_factor": (1.0, "a RoPE attention factor"),
}
# tensors that carry RoPE frequency factors rather than weights
GGUF_ROPE_FREQS = "rope_freqs.weight"
GGUF_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def gguf_arch(arch: Any, where: str) -> GGUFArch:
    """The declarations of GGUF architecture `arch`; ValueError naming `general.architecture` when jpaged
    has none."""
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{where}: general.architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHS)}")
    return GGUF_ARCHS[arch]


def gguf_tensor_names(arch: str, config: ModelConfig) -> tuple[dict[str, str], dict[str, tuple]]:
    """(GGUF tensor name -> intermediate key, GGUF fused tensor name -> (keys, row counts)) for a model of
    `config` stored as GGUF architecture `arch` (the keys of `hf_tensor_names`)."""
    spec = GGUF_ARCHS[arch]
    names = {"token_embd.weight": "embed", "output_norm.weight": "final_norm"}
    if not config.tie_word_embeddings:
        names["output.weight"] = "lm_head"
    return _tensor_names(config, names, "blk.{i}.{name}", spec.layer_names(), spec.fused)
