"""The XLA attention backend: paged attention as plain XLA ops, the engine's CPU fast path.

`xla_attend` follows the step inputs' `AttentionPlan` (`jpaged.device.batch`): query tile x key
tile pairs, each a partial softmax over key blocks gathered from the pool, merged per query tile,
so each row's cost is its own context length. `xla_write_kv` scatters a step's new K/V into their
slots; `xla_copy_blocks` does copy-on-write copies. `gather_attend` is the plain reference (one
padded gather of every row's block table) that the tests hold `xla_attend` to.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


# XLA's CPU backend scatters into a bfloat16 array by widening all of it (measured: 179 ms to write
# 16 tokens into 30 layers of a small pool, 0.08 ms for float32 or float16), so the XLA backend keeps
# a bfloat16 pool as its uint16 bit patterns: the scatter stays in place, and a gathered tile is
# bitcast back to bfloat16 before it is widened to the compute dtype.
BF16_BITS = jnp.uint16


def storage_dtype(dtype):
    """The dtype the XLA backend stores a pool of `dtype` in."""
    return BF16_BITS if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def to_pool(x, pool):
    """New K or V in the pool's storage dtype."""
    if pool.dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(pool.dtype)


def _from_pool(tile, dtype):
    """A gathered tile in the compute dtype `dtype`."""
    if tile.dtype == BF16_BITS:
        tile = jax.lax.bitcast_convert_type(tile, jnp.bfloat16)
    return tile.astype(dtype)


def xla_write_kv(pool, layer, k, v, slot_mapping):
    """Scatters `k, v f[num_tokens, num_kv_heads, head_dim]` into slots `i32[num_tokens]` of one layer."""
    block_size = pool.shape[3]
    block_ids, offsets = slot_mapping // block_size, slot_mapping % block_size
    pool = pool.at[layer, block_ids, 0, offsets].set(to_pool(k, pool))
    return pool.at[layer, block_ids, 1, offsets].set(to_pool(v, pool))


def _tiles(pool, layer, blocks, dtype):
    """The K and V of `blocks` (any shape of block ids) in one layer, each [*blocks.shape, block_size,
    kv_heads, head_dim] in the compute dtype `dtype`."""
    return _from_pool(pool[layer, blocks, 0], dtype), _from_pool(pool[layer, blocks, 1], dtype)


def _visible(plan, key_tile, window):
    """bool[P, TQ, TK]: which keys of its key tile each query slot of a pair may see (causal, in
    context, and inside the sliding window when there is one)."""
    q_pos = plan.q_positions[plan.pair_q]  # [P, TQ]
    k_pos = plan.k_start[plan.pair_k][:, None] + jnp.arange(key_tile)  # [P, TK]
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] < plan.pair_len[:, None, None])
    if window is not None:
        visible &= k_pos[:, None, :] > q_pos[:, :, None] - window
    return visible


# the window of a layer that sees the whole context, where a window must be given (a full layer among
# windowed ones, scanned with them; the native kernel's operand): longer than any context
FULL_WINDOW = 1 << 30


def soft_cap(scores, softcap):
    """Gemma 2's attention logit soft-capping: c * tanh(s / c) (None: the scores unchanged)."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _softmax_partials(scores, visible):
    """scores f32[..., TK] masked by `visible` -> (row max, row sum, probabilities) of the tile."""
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # a slot that sees no key of this tile
    probs = jnp.exp(scores - row_max[..., None])  # masked -> exactly 0
    return row_max, jnp.sum(probs, axis=-1), probs


def _decode_partials(q, pool, layer, plan, scale, window, softcap):
    """Query tiles of one token: per pair (max, sum) f32[P, KVH, G] and unnormalised output [P, KVH, G, D]."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = pool.shape[4]
    num_pairs = plan.pair_q.shape[0]
    blocks = plan.k_blocks[plan.pair_k]  # [P, blocks per key tile]
    # [P, TK, KVH, D], in the compute dtype (a 16-bit pool under float32 compute is widened here)
    k, v = (x.reshape(num_pairs, -1, num_kv_heads, head_dim) for x in _tiles(pool, layer, blocks, q.dtype))
    q_pairs = (q[plan.q_index] * scale)[plan.pair_q].reshape(num_pairs, 1, num_kv_heads, -1, head_dim)
    scores = soft_cap(jnp.einsum("ptkgd,pskd->pkgts", q_pairs, k, preferred_element_type=jnp.float32), softcap)
    row_max, row_sum, probs = _softmax_partials(scores, _visible(plan, k.shape[1], window)[:, None, None])
    partial = jnp.einsum("pkgts,pskd->pkgtd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return row_max[..., 0], row_sum[..., 0], partial[..., 0, :]


def _prefill_partials(q, pool, layer, plan, scale, window, softcap):
    """Query tiles of TQ tokens: per pair (max, sum) f32[P, KVH, G * TQ] and output [P, KVH, G * TQ, D]
    (the G query heads that share a KV head stack with the tile's tokens into one matrix)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = pool.shape[4]
    group = num_heads // num_kv_heads
    num_q_tiles, q_tile = plan.q_index.shape
    num_pairs = plan.pair_q.shape[0]
    blocks = plan.k_blocks[plan.pair_k]
    # [P, KVH, TK, D] in the compute dtype: batch dimensions leading, as the batched matmuls want
    k, v = (x.reshape(num_pairs, -1, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
            for x in _tiles(pool, layer, blocks, q.dtype))
    q_tiles = (q[plan.q_index] * scale).reshape(num_q_tiles, q_tile, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 3, 1, 4).reshape(num_q_tiles, num_kv_heads, group * q_tile, head_dim)
    scores = soft_cap(jnp.einsum("pkmd,pksd->pkms", q_tiles[plan.pair_q], k, preferred_element_type=jnp.float32),
                      softcap)
    visible = jnp.tile(_visible(plan, k.shape[2], window), (1, group, 1))[:, None]  # [P, 1, G * TQ, TK]
    row_max, row_sum, probs = _softmax_partials(scores, visible)
    partial = jnp.einsum("pkms,pksd->pkmd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return row_max, row_sum, partial


def xla_attend(q, pool, layer, plan, scale, *, window=None, softcap=None):
    """Exact causal attention over the pairs of an `AttentionPlan` (see `jpaged.device.batch`).

    q f[N, H, D] (packed new tokens) -> f[N, H, D]. Every pair computes the partial softmax of
    one query tile over one key tile (gathered block by block from the pool); each query tile then
    merges its pairs' partials by their running maxima. Work is proportional to the pairs, i.e. to
    the tokens each row really attends to, whatever the other rows' lengths. Decode (one-token
    query tiles) and prefill lay the tiles out differently: each is the faster layout on XLA CPU.
    `window` (None or i32[], traced) and `softcap` (None or a float): see the attention seam
    (`jpaged.device.attention`).
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = pool.shape[4]
    num_q_tiles, q_tile = plan.q_index.shape
    partials = _decode_partials if q_tile == 1 else _prefill_partials
    row_max, row_sum, partial = partials(q, pool, layer, plan, scale, window, softcap)

    # merge: each query tile combines its pairs (consecutive in pair order) by their running maxima
    def per_tile(op, x):
        return op(x, plan.pair_q, num_segments=num_q_tiles, indices_are_sorted=True)

    pair_max = jnp.where(row_sum > 0, row_max, -jnp.inf)  # a pair that saw nothing weighs 0
    top = per_tile(jax.ops.segment_max, pair_max)
    weights = jnp.exp(pair_max - jnp.where(jnp.isfinite(top), top, 0.0)[plan.pair_q])
    total = per_tile(jax.ops.segment_sum, weights * row_sum)  # [NQ, KVH, G * TQ] (decode: G, TQ = 1)
    out = per_tile(jax.ops.segment_sum, weights[..., None] * partial) / jnp.where(total > 0, total, 1.0)[..., None]
    out = out.reshape(num_q_tiles, num_kv_heads, num_heads // num_kv_heads, q_tile, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(num_q_tiles * q_tile, num_heads, head_dim)[plan.token_slot].astype(q.dtype)


def gather_attend(q, pool, layer, block_tables, context_lens, positions, scale, *, window=None, softcap=None):
    """Reference: attention by gathering each row's whole block table (padded rows and tokens).

    q f[B, T, H, D]; block_tables i32[B, M]; context_lens i32[B]; positions i32[B, T] -> f[B, T, H, D].
    Query token t of row b attends to every cached position p <= positions[b, t], p < context_lens[b]
    (and p > positions[b, t] - window with a window; scores soft-capped with a softcap).
    Simple and exact, but every row pays for the widest table: tests compare `xla_attend` with it.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = pool.shape[4]
    group = num_heads // num_kv_heads
    # [B, S, KVH, D]
    k, v = (x.reshape(batch, -1, num_kv_heads, head_dim) for x in _tiles(pool, layer, block_tables, q.dtype))
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    scores = soft_cap(jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale, softcap)
    key_pos = jnp.arange(k.shape[1])
    visible = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
    if window is not None:
        visible &= key_pos[None, None, :] > positions[:, :, None] - window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0)  # rows with no visible key (padding) -> 0, not NaN
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def xla_copy_blocks(pool, pairs):
    """Copies block `pairs[i, 0]` to `pairs[i, 1]` (its K and V) in every layer. Padded pairs are (0, 0)."""
    src, dst = pairs[:, 0], pairs[:, 1]
    return pool.at[:, dst].set(pool[:, src])


@dataclasses.dataclass(frozen=True)
class XLABackend:
    name: str = "xla"

    def storage_dtype(self, dtype):
        return storage_dtype(dtype)

    def write_kv(self, pool, layer, k, v, slot_mapping):
        return xla_write_kv(pool, layer, k, v, slot_mapping)

    def attend(self, q, pool, layer, inputs, scale, *, window=None, softcap=None):
        return xla_attend(q, pool, layer, inputs.plan, scale, window=window, softcap=softcap)

    def write_and_attend(self, q, k, v, pool, layer, inputs, scale, *, window=None, softcap=None):
        pool = self.write_kv(pool, layer, k, v, inputs.slot_mapping)
        return pool, self.attend(q, pool, layer, inputs, scale, window=window, softcap=softcap)

    def copy_blocks(self, pool, pairs):
        return xla_copy_blocks(pool, pairs)
