"""The Llama decoder as pure functions over `LlamaParams`, reading and writing a paged `KVCache`.

`forward(params, cache, inputs, config=, backend=) -> (cache, hidden)` runs every layer in one
`lax.scan` over the stacked layer parameters. The KV pool rides in the scan *carry* (never as
scanned inputs/outputs, which would copy the whole pool every step) and is updated in place at
the traced layer index: with the cache donated, a step writes only its new tokens' K/V.

Math follows HF transformers' `LlamaForCausalLM`: RMSNorm (computed in float32), rotate-half RoPE,
grouped-query attention, SwiGLU MLP, tied or untied LM head.

`sequence_logits(params, sequences, config=)` runs the same forward over whole token sequences
(teacher forcing, through a scratch pool of their own): a differentiable function of the
parameters, for fine-tuning them (`notebooks/finetune_then_serve.ipynb`) and for checks.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jpaged.device.attention.xla import XLABackend
from jpaged.device.batch import ModelInputs, pack_rows
from jpaged.device.config import ModelConfig
from jpaged.device.kv_cache import KVCache
from jpaged.device.params import LlamaParams

_SCRATCH_BLOCK_SIZE = 16


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta):
    """Rotate-half RoPE. x f[N, heads, D], positions i32[N]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [N, D/2]
    cos = jnp.concatenate([jnp.cos(freqs)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(freqs)] * 2, axis=-1)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


def forward(params: LlamaParams, cache: KVCache, inputs: ModelInputs, *, config: ModelConfig, backend):
    """Runs the decoder on the packed tokens of `inputs`, writing their K/V into `cache`.

    Returns (cache, hidden f[N, hidden]), one hidden state per packed token.
    """
    scale = config.head_dim ** -0.5
    x = params.embed[inputs.token_ids]

    def layer(carry, layer_inputs):
        x, pool = carry
        p, layer_id = layer_inputs
        h = rms_norm(x, p.attn_norm, config.rms_norm_eps)
        q = rope(jnp.einsum("th,hnd->tnd", h, p.wq), inputs.positions, config.rope_theta)
        k = rope(jnp.einsum("th,hnd->tnd", h, p.wk), inputs.positions, config.rope_theta)
        v = jnp.einsum("th,hnd->tnd", h, p.wv)
        pool = backend.write_kv(pool, layer_id, k, v, inputs.slot_mapping)
        attn = backend.attend(q, pool, layer_id, inputs, scale)
        x = x + jnp.einsum("tnd,ndh->th", attn, p.wo)
        h = rms_norm(x, p.mlp_norm, config.rms_norm_eps)
        gate = jnp.einsum("th,hi->ti", h, p.w_gate)
        up = jnp.einsum("th,hi->ti", h, p.w_up)
        x = x + jnp.einsum("ti,ih->th", jax.nn.silu(gate) * up, p.w_down)
        return (x, pool), None

    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, pool), _ = jax.lax.scan(layer, (x, cache.kv), (params.layers, layer_ids))
    x = rms_norm(x, params.final_norm, config.rms_norm_eps)
    return KVCache(kv=pool), x


def compute_logits(params: LlamaParams, hidden) -> jax.Array:
    """hidden f[..., hidden] -> float32 logits f[..., vocab]."""
    if params.lm_head is None:
        logits = jnp.einsum("...h,vh->...v", hidden, params.embed)
    else:
        logits = jnp.einsum("...h,hv->...v", hidden, params.lm_head)
    return logits.astype(jnp.float32)


class _Row(NamedTuple):  # the fields of `jpaged.device.batch.pack_rows`'s rows
    token_ids: Sequence[int]
    start_position: int
    slots: Sequence[int]
    block_table: Sequence[int]


def sequence_logits(params: LlamaParams, sequences: Sequence[Sequence[int]], *, config: ModelConfig,
                    backend=None) -> list[jax.Array]:
    """The logits f32[len(s), vocab] at every position of each token sequence in `sequences` (row t
    predicts token t + 1): the engine's prefill over a scratch KV pool holding these sequences alone,
    so a differentiable function of `params` (`jax.grad` of a loss built on it fine-tunes them).
    Token ids are static: each new set of lengths traces anew. `backend`: the XLA path by default."""
    bs, rows, next_block = _SCRATCH_BLOCK_SIZE, [], 1  # block 0 is the null block
    for ids in sequences:
        n = len(ids)
        if n == 0:
            raise ValueError("sequence_logits: a sequence is empty")
        table = list(range(next_block, next_block - (-n // bs)))
        next_block += len(table)
        rows.append(_Row(list(ids), 0, [table[p // bs] * bs + p % bs for p in range(n)], table))
    inputs = pack_rows(rows, block_size=bs, q_tile=64, k_tile=128)
    cache = KVCache.create(config, next_block, bs, params.embed.dtype)
    _, hidden = forward(params, cache, inputs, config=config, backend=backend or XLABackend())
    starts = [0, *itertools.accumulate(len(ids) for ids in sequences)]
    return [compute_logits(params, hidden[a:b]) for a, b in zip(starts, starts[1:])]
