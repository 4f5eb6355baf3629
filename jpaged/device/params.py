"""Model parameters as typed pytrees (flax.struct dataclasses), never dicts.

Layout (heads are an explicit axis everywhere, so sharding over heads is a layout change):
  embed       f[vocab, hidden]
  layers      LayerParams, every leaf stacked with a leading `num_layers` axis:
    attn_norm f[L, hidden]
    wq        f[L, hidden, num_heads, head_dim]
    wk        f[L, hidden, num_kv_heads, head_dim]
    wv        f[L, hidden, num_kv_heads, head_dim]
    wo        f[L, num_heads, head_dim, hidden]
    mlp_norm  f[L, hidden]
    w_gate    f[L, hidden, intermediate]
    w_up      f[L, hidden, intermediate]
    w_down    f[L, intermediate, hidden]
  final_norm  f[hidden]
  lm_head     f[hidden, vocab], or None when the embeddings are tied (logits = h @ embed.T)

q/k projections are in HF's (rotate-half) RoPE convention: llama.cpp's interleaved permutation
is undone by the loader.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    mlp_norm: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


@struct.dataclass
class LlamaParams:
    embed: jax.Array
    layers: LayerParams
    final_norm: jax.Array
    lm_head: Optional[jax.Array] = None


def num_params(config) -> int:
    """Parameters of a model of this configuration (the layout above)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    per_layer = 2 * h + 2 * h * config.num_heads * d + 2 * h * config.num_kv_heads * d + 3 * h * i
    lm_head = 0 if config.tie_word_embeddings else h * config.vocab_size
    return config.vocab_size * h + config.num_layers * per_layer + h + lm_head


def check_params(params, config) -> None:
    """Raises ValueError, naming the first leaf that differs, unless `params` is a `LlamaParams` with
    the layout and shapes of a model of this configuration (floating-point leaves; an untied
    `lm_head` exactly when the model has one). Reads no data: what `init_params` would build is
    compared by shape alone."""
    if not isinstance(params, LlamaParams):
        raise ValueError(f"params must be a LlamaParams (jpaged.device.params), got {type(params).__name__}")
    expected = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    if (params.lm_head is None) != (expected.lm_head is None):
        raise ValueError(f"params {'lack' if params.lm_head is None else 'have'} an lm_head, but this model's "
                         f"embeddings are {'untied' if params.lm_head is None else 'tied'}")
    for (path, leaf), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path).lstrip(".")
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape != want.shape:
            raise ValueError(f"params.{name} has shape {shape}, this model's is {want.shape}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"params.{name} has dtype {dtype}: parameters are floating-point")


def cast_params(params: LlamaParams, dtype) -> LlamaParams:
    """Returns `params` with every floating leaf cast to `dtype`."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def init_params(config, key, dtype=jnp.float32, scale: float = 0.05) -> LlamaParams:
    """Random parameters of the right shapes (tests, GPU checks without a checkpoint)."""
    L, h, i = config.num_layers, config.hidden_size, config.intermediate_size
    nh, nkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    shapes = dict(wq=(L, h, nh, d), wk=(L, h, nkv, d), wv=(L, h, nkv, d), wo=(L, nh, d, h),
                  w_gate=(L, h, i), w_up=(L, h, i), w_down=(L, i, h))
    keys = iter(jax.random.split(key, len(shapes) + 2))
    normal = lambda shape: (scale * jax.random.normal(next(keys), shape)).astype(dtype)  # noqa: E731
    layers = LayerParams(attn_norm=jnp.ones((L, h), dtype), mlp_norm=jnp.ones((L, h), dtype),
                         **{name: normal(shape) for name, shape in shapes.items()})
    lm_head = None if config.tie_word_embeddings else normal((h, config.vocab_size))
    return LlamaParams(embed=normal((config.vocab_size, h)), layers=layers, final_norm=jnp.ones((h,), dtype),
                       lm_head=lm_head)
