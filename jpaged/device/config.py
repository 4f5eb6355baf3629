"""Static configuration: frozen, hashable dataclasses (safe to close over in `jax.jit`).

`ModelConfig` describes one decoder-only transformer, and every family jpaged runs (Llama, Qwen,
Mistral, Gemma, Phi-3) is a set of values of its fields, not a forward pass of its own: the shapes,
then the family's *declarations* (how a layer normalizes, its biases and q/k norms, its RoPE, its
activation, its attention options, its per-layer sliding windows). `jpaged.weights.families`
reads HF configs into it; `jpaged.device.model.forward` is the one decoder that honours it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling rule, as HF transformers' `rope_parameters` spell it (`rope_type` and its keys).

    linear:  positions divided by `factor` (inverse frequencies / factor).
    llama3:  Llama 3.1's per-frequency rule (`low_freq_factor`, `high_freq_factor`,
             `original_max_position_embeddings`).
    yarn:    YaRN (`beta_fast`, `beta_slow`, `original_max_position_embeddings`, `attention_factor`
             or the `mscale` pair, `truncate`): blended frequencies, cos/sin scaled by the attention factor.
    dynamic: dynamic NTK: the base grows with the sequence once it passes `max_position_embeddings`
             (HF's rule, computed per row from the row's length this step).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"RoPE scaling type {self.rope_type!r} is not supported (supported: "
                             f"{', '.join(ROPE_TYPES[1:])})")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. Every field is static under `jit`; the defaults are Llama's.

    Shapes: `num_heads % num_kv_heads == 0` (grouped-query attention: query head h reads KV head
    `h // (num_heads // num_kv_heads)`); `head_dim` may differ from `hidden_size / num_heads`.

    Family declarations:
      architecture          the HF `model_type` the model came from (names it in messages)
      rope_theta, rope_scaling   RoPE's base and scaling rule (`RopeScaling`, None: plain RoPE)
      local_rope_theta      the base of the sliding-window layers where it differs (Gemma 3); they
                            are never scaled
      layer_windows         per layer, its sliding window W (the query at position p sees the keys at
                            p - W < k <= p, HF's mask) or None (full attention); () = all full
      attention_bias        biases on q, k and v (Qwen2)
      qk_norm               RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
      norm_offset           RMSNorm scales by (norm_offset + w) (Gemma: 1.0), in float32
      sandwich_norms        norms after attention and after the MLP too, before each residual add
                            (Gemma 2 and 3: their weights are `post_attn_norm`, `post_mlp_norm`)
      activation            the gated MLP's activation: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU)
      embedding_scale       embeddings are multiplied by it (Gemma: sqrt(hidden_size))
      query_pre_attn_scalar attention scores are scaled by its -1/2 power (default: head_dim's)
      attn_logit_softcap    scores become c * tanh(s / c) before the mask and softmax (Gemma 2)
      final_logit_softcap   the same on the output logits (Gemma 2)
      qk_norm_whole         the q/k RMSNorm runs over the whole projection (all heads at once), not
                            per head (OLMoE); its weights are then [heads, head_dim] / [kv_heads, head_dim]
      clip_qkv              q, k and v are clamped to [-clip_qkv, clip_qkv] after their projection
                            (and norm) (OLMoE)

    Mixture of experts (`num_experts > 0`; the sparse MLP is `jpaged.device.moe`):
      num_experts           experts per sparse layer
      num_experts_per_tok   experts each token is routed to (top-k of the router's softmax)
      moe_intermediate_size each expert's FFN size (a gated MLP, the model's activation)
      norm_topk_prob        the top-k probabilities are renormalized to sum to 1 (Mixtral: always)
      shared_expert_intermediate_size  a shared expert every token runs, gated by sigmoid(h . w)
                            (Qwen2-MoE); 0: none
      sparse_layers         per layer, whether its MLP is sparse; () = every layer (with experts).
                            Every layer must be of one kind (see `__post_init__`)
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    rope_scaling: Optional[RopeScaling] = None
    local_rope_theta: Optional[float] = None
    layer_windows: tuple[Optional[int], ...] = ()
    attention_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    activation: str = "silu"
    embedding_scale: float = 1.0
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    qk_norm_whole: bool = False
    clip_qkv: Optional[float] = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE rotates pairs)")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"sliding windows must be >= 1 (got {self.layer_windows})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                                 f"num_experts ({self.num_experts})")
            if self.moe_intermediate_size < 1:
                raise ValueError(f"moe_intermediate_size ({self.moe_intermediate_size}) must be >= 1 with experts")
        if self.sparse_layers and len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"sparse_layers has {len(self.sparse_layers)} entries for {self.num_layers} layers")
        if self.sparse_layers and not self.num_experts and any(self.sparse_layers):
            raise ValueError("sparse_layers names sparse layers, but num_experts is 0")
        if len(set(self.sparse_layers)) > 1:
            # one parameter layout for every layer keeps the layer scan (and the stacks it slices)
            dense = [i for i, s in enumerate(self.sparse_layers) if not s]
            raise ValueError(f"dense MLP layers {dense} among sparse ones are not supported (every layer of a "
                             "mixture of experts must be sparse: mlp_only_layers = [], decoder_sparse_step = 1)")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model runs: `max_position_embeddings`, times the factor of a
        dynamic NTK RoPE (which stretches the positions it was trained on, as vLLM counts it)."""
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "dynamic":
            return int(self.max_position_embeddings * self.rope_scaling.factor)
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def windows(self) -> tuple[Optional[int], ...]:
        """Each layer's sliding window (None: full attention)."""
        return self.layer_windows or (None,) * self.num_layers

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def kv_window(self) -> Optional[int]:
        """The window beyond which no layer looks back, when every layer is windowed (Mistral): blocks
        wholly before a sequence's last `kv_window` positions are dead for every layer and may go
        back to the pool. None when a layer attends to the whole context (then every block is live)."""
        windows = self.windows
        return None if any(w is None for w in windows) else max(windows)

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are sparse (a mixture of experts: every layer, see `sparse_layers`)."""
        return self.num_experts > 0 and all(self.sparse_layers or (True,))

    def layer_rope(self, layer: int) -> tuple[float, Optional[RopeScaling]]:
        """(base, scaling) of layer `layer`'s RoPE."""
        if self.local_rope_theta is not None and self.windows[layer] is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (what checkpoints and snapshots record)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
        """The inverse of `to_dict` (lists back to tuples, the scaling rule back to a `RopeScaling`).
        Raises TypeError / ValueError on unknown or malformed fields."""
        fields = dict(fields)
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        fields["layer_windows"] = tuple(fields.get("layer_windows", ()))
        fields["sparse_layers"] = tuple(fields.get("sparse_layers", ()))
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return cls(**fields)


# ---------------------------------------------------------------- RoPE frequencies (host side, numpy)

def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling], *,
                  max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies f32[head_dim / 2], attention factor) of one layer's RoPE, as HF's
    `ROPE_INIT_FUNCTIONS` compute them. For 'dynamic' these are the frequencies at or below
    `max_position_embeddings` tokens; `dynamic_base` gives the grown base past it."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    s = scaling
    if s.rope_type == "linear":
        return (inv_freq / np.float32(s.factor)).astype(np.float32), 1.0
    if s.rope_type == "llama3":
        original = s.original_max_position_embeddings or max_position_embeddings
        low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    # yarn
    original = s.original_max_position_embeddings or max_position_embeddings
    factor = s.factor

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations):
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32), float(attention_factor)
