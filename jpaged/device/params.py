"""Model parameters as typed pytrees (flax.struct dataclasses), never dicts.

One layout serves every family (`jpaged.device.config.ModelConfig`); the leaves a family lacks
are None (absent from the pytree). `param_shapes(config)` is the one statement of the layout.

Layout (heads are an explicit axis everywhere, so sharding over heads is a layout change):
  embed       f[vocab, hidden]
  layers      LayerParams, every leaf stacked with a leading `num_layers` axis:
    attn_norm f[L, hidden]
    wq        f[L, hidden, num_heads, head_dim]
    wk        f[L, hidden, num_kv_heads, head_dim]
    wv        f[L, hidden, num_kv_heads, head_dim]
    wo        f[L, num_heads, head_dim, hidden]
    mlp_norm  f[L, hidden]
    w_gate    f[L, hidden, intermediate]      the dense MLP (absent in a mixture of experts)
    w_up      f[L, hidden, intermediate]
    w_down    f[L, intermediate, hidden]
    bq        f[L, num_heads, head_dim]     q/k/v biases      (attention_bias: Qwen2)
    bk, bv    f[L, num_kv_heads, head_dim]
    q_norm    f[L, head_dim]                per-head q/k RMSNorm (qk_norm: Qwen3, Gemma 3)
    k_norm    f[L, head_dim]                (qk_norm_whole, OLMoE: f[L, heads, head_dim], f[L, kv_heads, head_dim])
    post_attn_norm f[L, hidden]             after attention / the MLP (sandwich_norms: Gemma 2, 3)
    post_mlp_norm  f[L, hidden]
    router    f[L, hidden, experts]         a mixture of experts (num_experts > 0: `jpaged.device.moe`)
    experts_gate f[L, experts, hidden, moe_intermediate]
    experts_up   f[L, experts, hidden, moe_intermediate]
    experts_down f[L, experts, moe_intermediate, hidden]
    shared_w_gate f[L, hidden, shared_intermediate]   the shared expert (Qwen2-MoE)
    shared_w_up   f[L, hidden, shared_intermediate]
    shared_w_down f[L, shared_intermediate, hidden]
    shared_expert_gate f[L, hidden]         its sigmoid gate: sigmoid(h . w)
  final_norm  f[hidden]
  lm_head     f[hidden, vocab], or None when the embeddings are tied (logits = h @ embed.T)

Weight-only int8 (`jpaged.device.quant.quantize_params`), or float rows on one CPU
(`jpaged.device.quant.float_row_params`): the dense leaves (embed, lm_head, wq ... w_down) may be
`QuantizedWeight`s, of the same logical shapes; a tied model's lm_head is then `embed.T`, a view of the
embedding's own arrays.

q/k projections are in HF's (rotate-half) RoPE convention: llama.cpp's interleaved permutation
is undone by the loader.

Storage on a CPU (`to_storage`): bfloat16 leaves are kept as their uint16 bit patterns (`BF16_BITS`),
as the XLA backend keeps a bfloat16 KV pool. XLA's CPU compiler has no bfloat16 dynamic-slice: it
widens the whole stacked bfloat16 array to float32 for the layer scan's slicing, in every step (a
decode step over bfloat16 layers took 7x float32's); a uint16 stack is sliced as it is, and the model
bit-casts each layer's slice back (`from_storage`). Float16 needs no such form. On a single CPU device
the engine first makes float rows of the bfloat16 and float32 dense leaves
(`jpaged.device.quant.float_row_params`: `QuantizedWeight`s of uint16 bits or float32, [out, in], no
scales) for the native few-row matmul; `to_storage` then holds the remaining bfloat16 leaves (norms,
biases) as bits.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jpaged.device.quant import QuantizedWeight, dequantize

BF16_BITS = jnp.dtype(jnp.uint16)  # a bfloat16 parameter stored as its bit patterns (`to_storage`)


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    mlp_norm: jax.Array
    w_gate: Optional[jax.Array] = None
    w_up: Optional[jax.Array] = None
    w_down: Optional[jax.Array] = None
    bq: Optional[jax.Array] = None
    bk: Optional[jax.Array] = None
    bv: Optional[jax.Array] = None
    q_norm: Optional[jax.Array] = None
    k_norm: Optional[jax.Array] = None
    post_attn_norm: Optional[jax.Array] = None
    post_mlp_norm: Optional[jax.Array] = None
    router: Optional[jax.Array] = None
    experts_gate: Optional[jax.Array] = None
    experts_up: Optional[jax.Array] = None
    experts_down: Optional[jax.Array] = None
    shared_w_gate: Optional[jax.Array] = None
    shared_w_up: Optional[jax.Array] = None
    shared_w_down: Optional[jax.Array] = None
    shared_expert_gate: Optional[jax.Array] = None


EXPERT_LEAVES = ("experts_gate", "experts_up", "experts_down")  # stacked by expert: [L, experts, ...]


@struct.dataclass
class LlamaParams:
    """The decoder's parameters (every family's: the name is the first family's)."""

    embed: jax.Array
    layers: LayerParams
    final_norm: jax.Array
    lm_head: Optional[jax.Array] = None


NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "final_norm")


def param_shapes(config) -> LlamaParams:
    """The layout above for `config`: a `LlamaParams` whose leaves are shape tuples (None where the
    family has no such leaf)."""
    c = config
    L, h, i, nh, nkv, d = c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    bias, qk, sandwich, moe = c.attention_bias, c.qk_norm, c.sandwich_norms, c.is_moe
    E, ei, si = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    shared = moe and si > 0
    layers = LayerParams(
        attn_norm=(L, h), wq=(L, h, nh, d), wk=(L, h, nkv, d), wv=(L, h, nkv, d), wo=(L, nh, d, h),
        mlp_norm=(L, h), w_gate=None if moe else (L, h, i), w_up=None if moe else (L, h, i),
        w_down=None if moe else (L, i, h),
        bq=(L, nh, d) if bias else None, bk=(L, nkv, d) if bias else None, bv=(L, nkv, d) if bias else None,
        q_norm=((L, nh, d) if c.qk_norm_whole else (L, d)) if qk else None,
        k_norm=((L, nkv, d) if c.qk_norm_whole else (L, d)) if qk else None,
        post_attn_norm=(L, h) if sandwich else None, post_mlp_norm=(L, h) if sandwich else None,
        router=(L, h, E) if moe else None, experts_gate=(L, E, h, ei) if moe else None,
        experts_up=(L, E, h, ei) if moe else None, experts_down=(L, E, ei, h) if moe else None,
        shared_w_gate=(L, h, si) if shared else None, shared_w_up=(L, h, si) if shared else None,
        shared_w_down=(L, si, h) if shared else None, shared_expert_gate=(L, h) if shared else None)
    return LlamaParams(embed=(c.vocab_size, h), layers=layers, final_norm=(h,),
                       lm_head=None if c.tie_word_embeddings else (h, c.vocab_size))


def _shape_leaves(shapes: LlamaParams):
    return jax.tree_util.tree_leaves_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))


def abstract_params(config, dtype=jnp.float32) -> LlamaParams:
    """`param_shapes` as `jax.ShapeDtypeStruct`s of `dtype` (restore targets, shape checks)."""
    return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), param_shapes(config),
                        is_leaf=lambda x: isinstance(x, tuple))


def num_params(config) -> int:
    """Parameters of a model of this configuration (the layout above)."""
    return sum(math.prod(shape) for _, shape in _shape_leaves(param_shapes(config)))


def check_params(params, config) -> None:
    """Raises ValueError, naming the first leaf that differs, unless `params` is a `LlamaParams` with
    the layout and shapes of a model of this configuration (floating-point leaves; each optional leaf
    present exactly when the family has it). Reads no data."""
    if not isinstance(params, LlamaParams):
        raise ValueError(f"params must be a LlamaParams (jpaged.device.params), got {type(params).__name__}")
    expected = param_shapes(config)
    if expected.lm_head is None and tied_head_view(params):  # a tied int8 / float-rows head: the embedding itself
        params = params.replace(lm_head=None)
    if (params.lm_head is None) != (expected.lm_head is None):
        raise ValueError(f"params {'lack' if params.lm_head is None else 'have'} an lm_head, but this model's "
                         f"embeddings are {'untied' if params.lm_head is None else 'tied'}")
    for name in LayerParams.__dataclass_fields__:
        have, want = getattr(params.layers, name), getattr(expected.layers, name)
        if (have is None) != (want is None):
            raise ValueError(f"params.layers.{name} is {'missing' if have is None else 'present'}, but this "
                             f"model ({config.architecture}) {'has' if have is None else 'has no'} such leaf")
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    for (path, leaf), (_, want) in zip(leaves, _shape_leaves(expected)):
        name = jax.tree_util.keystr(path).lstrip(".")
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape != want:
            raise ValueError(f"params.{name} has shape {shape}, this model's is {want}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"params.{name} has dtype {dtype}: parameters are floating-point (or QuantizedWeight)")


def cast_params(params: LlamaParams, dtype) -> LlamaParams:
    """Returns `params` with every floating leaf cast to `dtype`. int8 weights (`QuantizedWeight`) stay as
    they are, and so do float rows (a CPU engine's form of its weights, `quant.float_row_params`) already of
    `dtype`; float rows of another dtype become arrays of this module's layout again, cast (a tied head, a
    view of the embedding's rows, None again)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        if isinstance(x, QuantizedWeight):
            return dequantize(x).astype(dtype) if x.is_float and x.dtype != dtype else x
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    cast_tree = jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    tied = tied_head_view(params) and not isinstance(cast_tree.embed, QuantizedWeight)
    return cast_tree.replace(lm_head=None) if tied else cast_tree


def tied_head_view(params: LlamaParams) -> bool:
    """Whether `params.lm_head` is the tied embedding's own arrays viewed as the head (`QuantizedWeight.T`, what
    int8 and float-row weights hold where params.py's layout has lm_head None)."""
    return isinstance(params.embed, QuantizedWeight) and isinstance(params.lm_head, QuantizedWeight) \
        and params.lm_head.values is params.embed.values


def single_cpu_device(tree):
    """The device every array of `tree` lives on, when that is one CPU device (where a numpy view of an
    array is its memory); else None (several devices, an accelerator, or no placed array)."""
    devices = {d for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array) for d in leaf.devices()}
    device = next(iter(devices)) if len(devices) == 1 else None
    return device if device is not None and device.platform == "cpu" else None


def to_storage(params: LlamaParams) -> LlamaParams:
    """`params` as a CPU runner keeps them: every bfloat16 leaf as its uint16 bit patterns (see the
    module docstring), the others as they are. On a CPU a single-device leaf is reinterpreted in
    place (the result shares its memory, so the parameters are not held twice); others are copied."""
    def bits(x):
        if x.dtype != jnp.bfloat16:
            return x
        device = single_cpu_device(x)
        if device is not None:
            return jax.device_put(np.asarray(x).view(np.uint16), device)  # zero-copy on a CPU
        return jax.lax.bitcast_convert_type(x, BF16_BITS)
    return jax.tree.map(bits, params)


def unstack_layers(layers: LayerParams) -> tuple[LayerParams, ...]:
    """The stacked layer parameters as one `LayerParams` a layer (each leaf without its layer axis): what
    `jpaged.device.model.forward` runs unrolled, one layer after the other, reading each weight where it
    lies. (A layer scan slices the stack: XLA's CPU backend copies each layer's weights out of it before
    their products, a second pass over every weight in a decode step.) On a single CPU device every leaf
    is a view of its stack (a numpy view placed without a copy where aligned, as every real model's
    weights are), so the two forms share their memory; elsewhere each is a slice (a copy)."""
    device = single_cpu_device(layers)
    num_layers = jax.tree.leaves(layers)[0].shape[0]

    def layer(i):
        if device is not None:
            return jax.tree.map(lambda x: jax.device_put(np.asarray(x)[i], device, may_alias=True), layers)
        return jax.tree.map(lambda x: x[i], layers)

    return tuple(layer(i) for i in range(num_layers))


def from_storage(x: jax.Array) -> jax.Array:
    """A parameter as the model computes with it: bfloat16 bit patterns (`to_storage`) bit-cast back
    to bfloat16; any other dtype as it is."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BF16_BITS else x


def init_params(config, key, dtype=jnp.float32, scale: float = 0.05) -> LlamaParams:
    """Random parameters of the right shapes (tests, GPU checks without a checkpoint): norm weights
    at their identity (1, or 0 where the family's norm adds an offset), the rest normal * `scale`."""
    leaves = _shape_leaves(param_shapes(config))
    keys = iter(jax.random.split(key, len(leaves)))

    def init(path, shape):
        name = getattr(path[-1], "name", None)
        if name in NORMS:
            return jnp.full(shape, 1.0 - config.norm_offset, dtype)
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    return jax.tree_util.tree_map_with_path(init, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
