"""The attention seam: how the model writes new K/V into the paged pool and reads it back.

A backend is static configuration (frozen, hashable) with three operations on the stacked pool
`f[num_layers, num_blocks, block_size, num_kv_heads, head_dim]` and a traced `layer` index:

  write_kv(k_pool, v_pool, layer, k, v, slot_mapping)        -> (k_pool, v_pool)
  attend(q, k_pool, v_pool, layer, block_tables, context_lens, positions, scale) -> out
  copy_blocks(k_pool, v_pool, pairs)                          -> (k_pool, v_pool)

`XLABackend` is the CPU fast path: one gather of each sequence's blocks through its block table.
`PallasBackend` runs the kernels of `pallas_kernels` (compiled on a GPU, `interpret=True` on a
CPU for tests). Both compute exact softmax attention; only the storage layout is paged.

Query layout: `q f[batch, q_len, num_heads, head_dim]`, where query token t of sequence b sits at
absolute position `positions[b, t]` and may attend to every cached position `p <= positions[b, t]`
with `p < context_lens[b]`. This one rule covers decode (q_len 1), prefill and prefill on top of
cached context (prefix caching, recompute).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def xla_write_kv(k_pool, v_pool, layer, k, v, slot_mapping):
    """Scatters `k, v f[num_tokens, num_kv_heads, head_dim]` into slots `i32[num_tokens]` of one layer."""
    block_size = k_pool.shape[2]
    block_ids, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_pool = k_pool.at[layer, block_ids, offsets].set(k.astype(k_pool.dtype))
    v_pool = v_pool.at[layer, block_ids, offsets].set(v.astype(v_pool.dtype))
    return k_pool, v_pool


def xla_attend(q, k_pool, v_pool, layer, block_tables, context_lens, positions, scale):
    """Exact attention through block tables, by gathering each sequence's blocks.

    q f[B, T, H, D]; block_tables i32[B, M]; context_lens i32[B]; positions i32[B, T] -> f[B, T, H, D].
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[3]
    group = num_heads // num_kv_heads
    k = k_pool[layer, block_tables]  # [B, M, bs, KVH, D]
    v = v_pool[layer, block_tables]
    k = k.reshape(batch, -1, num_kv_heads, head_dim)  # [B, S, KVH, D], S = M * bs, logical order
    v = v.reshape(batch, -1, num_kv_heads, head_dim)
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(k.shape[1])
    visible = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0)  # rows with no visible key (padding) -> 0, not NaN
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def xla_copy_blocks(k_pool, v_pool, pairs):
    """Copies block `pairs[i, 0]` to `pairs[i, 1]` in every layer of K and V. Padded pairs are (0, 0)."""
    src, dst = pairs[:, 0], pairs[:, 1]
    k_pool = k_pool.at[:, dst].set(k_pool[:, src])
    v_pool = v_pool.at[:, dst].set(v_pool[:, src])
    return k_pool, v_pool


@dataclasses.dataclass(frozen=True)
class XLABackend:
    name: str = "xla"

    def write_kv(self, k_pool, v_pool, layer, k, v, slot_mapping):
        return xla_write_kv(k_pool, v_pool, layer, k, v, slot_mapping)

    def attend(self, q, k_pool, v_pool, layer, block_tables, context_lens, positions, scale):
        return xla_attend(q, k_pool, v_pool, layer, block_tables, context_lens, positions, scale)

    def copy_blocks(self, k_pool, v_pool, pairs):
        return xla_copy_blocks(k_pool, v_pool, pairs)


def get_backend(name: str = "auto", *, interpret: bool = False):
    """'auto' picks the Pallas kernels on a GPU and the XLA path elsewhere."""
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "xla"
    if name == "xla":
        return XLABackend()
    if name == "pallas":
        from jpaged.pallas_backend import PallasBackend

        return PallasBackend(interpret=interpret)
    raise ValueError(f"attention_backend must be 'auto', 'pallas' or 'xla', not {name!r}")
