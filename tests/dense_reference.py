"""A dense, cacheless Llama forward pass: the reference the paged engine is checked against.

Written from HF transformers' `LlamaForCausalLM` (not from `jpaged.device.model`): plain `jnp`, a Python
loop over the layers, causal softmax attention over the whole token sequence, no KV cache, no
block tables, no padding masks beyond causality. Grouped-query attention repeats each KV head
for its query heads (HF's `repeat_kv`) instead of grouping the queries.

Only the `LlamaParams` leaves are shared with the engine (their layout is pinned against HF's
weights by `tests/test_loader.py`). Each layer is one small jitted function, reused for every
layer; sequences are padded on the right to a multiple of `PAD_TO` tokens so that a growing
sequence compiles only a few times (causal attention: padding after the last real token cannot
change the logits of any real position).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

PAD_TO = 64


def _rms_norm(x, weight, eps):
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return weight * (x * jax.lax.rsqrt(variance + eps))


def _rope_tables(num_tokens: int, head_dim: int, theta: float):
    """HF's default RoPE: float32 inverse frequencies, cos/sin of shape [T, head_dim]."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    angles = np.arange(num_tokens, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    emb = np.concatenate([angles, angles], axis=-1)
    return jnp.asarray(np.cos(emb), jnp.float32), jnp.asarray(np.sin(emb), jnp.float32)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


@functools.partial(jax.jit, static_argnames=("num_kv_heads", "eps"))
def _layer(x, cos, sin, attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down, *, num_kv_heads, eps):
    """One decoder layer over a whole sequence. x f32[T, hidden] -> f32[T, hidden]."""
    num_tokens, hidden = x.shape
    _, num_heads, head_dim = wq.shape
    h = _rms_norm(x, attn_norm, eps)
    q = (h @ wq.reshape(hidden, -1)).reshape(num_tokens, num_heads, head_dim)
    k = (h @ wk.reshape(hidden, -1)).reshape(num_tokens, num_kv_heads, head_dim)
    v = (h @ wv.reshape(hidden, -1)).reshape(num_tokens, num_kv_heads, head_dim)
    q = q * cos[:, None, :] + _rotate_half(q) * sin[:, None, :]
    k = k * cos[:, None, :] + _rotate_half(k) * sin[:, None, :]
    repeat = num_heads // num_kv_heads
    k = jnp.repeat(k, repeat, axis=1)  # [T, heads, D]: query head h reads KV head h // repeat
    v = jnp.repeat(v, repeat, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(head_dim).astype(np.float32)
    causal = np.tril(np.ones((num_tokens, num_tokens), dtype=bool))
    scores = jnp.where(causal[None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("hqk,khd->qhd", probs, v).reshape(num_tokens, num_heads * head_dim)
    x = x + attn @ wo.reshape(num_heads * head_dim, hidden)
    h = _rms_norm(x, mlp_norm, eps)
    return x + (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


@jax.jit
def _head(x, final_norm, embed, lm_head, eps):
    x = _rms_norm(x, final_norm, eps)
    return x @ (embed.T if lm_head is None else lm_head)


def dense_logits(params, config, token_ids) -> np.ndarray:
    """Logits f32[len(token_ids), vocab] of every position of one sequence, computed from scratch."""
    ids = np.asarray(token_ids, np.int32)
    num_tokens = len(ids)
    padded = -(-num_tokens // PAD_TO) * PAD_TO
    ids = np.concatenate([ids, np.zeros(padded - num_tokens, np.int32)])
    cos, sin = _rope_tables(padded, config.head_dim, config.rope_theta)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    x = f32(params.embed)[ids]
    layers = params.layers
    for i in range(config.num_layers):
        x = _layer(x, cos, sin, *(f32(getattr(layers, name)[i]) for name in (
            "attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")),
            num_kv_heads=config.num_kv_heads, eps=config.rms_norm_eps)
    lm_head = None if params.lm_head is None else f32(params.lm_head)
    logits = _head(x, f32(params.final_norm), f32(params.embed), lm_head, config.rms_norm_eps)
    return np.asarray(logits[:num_tokens], np.float32)
