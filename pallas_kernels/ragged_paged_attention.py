"""Ragged paged attention: one kernel for a packed batch of rows, each with any number of new tokens.

A step is a *ragged batch* (the batch description of tpu-inference's ragged paged attention):
row ``b``'s new tokens are the packed queries ``q[cu_q_lens[b]:cu_q_lens[b + 1]]``, and after this
step it holds ``kv_lens[b]`` tokens in the paged K/V pool (its new ones included, their K/V
already written), in the blocks ``page_indices[b, :]`` (its block table). A decode row has one
new token, a prefill chunk many over cached context, a whole prompt all of its tokens over none.
The new tokens are the row's last ones: the query at packed index ``n`` of row ``b`` sits at
absolute position ``p = kv_lens[b] - (cu_q_lens[b + 1] - n)`` and attends to the row's keys at
positions ``k <= p`` (causal), and ``k > p - W`` with a sliding window ``W``.

Invariants of the operands (checked where static, assumed where traced):

* ``cu_q_lens i32[B + 1]``: ``cu_q_lens[0] == 0``, non-decreasing, ``cu_q_lens[B] <= N``. Padding
  rows have no tokens (``q_len == 0``) and may sit anywhere, usually at the end; packed tokens from
  ``cu_q_lens[B]`` on are padding.
* ``kv_lens i32[B]``: ``q_len[b] <= kv_lens[b] <= page_indices.shape[1] * block_size``; padding
  rows 0.
* ``page_indices i32[B, M]``: physical block ids in ``[0, num_blocks)``. Entries past a row's last
  block and entries wholly before its first query's window are never read (both may be the
  null block 0).

Output: ``f[N, num_heads, head_dim]``; padding tokens get zeros, and no value of a block the
kernel must not see (NaN in the null block, say) reaches a real token.

Kernel design (Triton-style Pallas; ``pl.pallas_call`` with a grid, whole-array refs indexed
through the block table inside the kernel, no scalar prefetch):

* **Query tiles.** Each row's tokens are cut into query tiles of ``q_tile`` consecutive tokens
  (a row's last tile may be partial, and a tile never spans two rows). The grid is ``(query
  tile, kv head)``: the tiles of all rows are numbered end to end by a small schedule the wrapper
  computes with ``jnp`` from ``cu_q_lens`` (``tile_rows``, ``tile_starts``: each tile's row and
  first packed token). The grid has ``min(N, cdiv(N, q_tile) + B)`` tiles, a static bound on
  ``sum_b cdiv(q_len[b], q_tile)``; the tiles past the real ones are empty (no tokens: the loop
  below runs zero times and nothing is stored). So a step of 250 decode rows and one 2,000-token
  chunk launches ~250 + 2000 / q_tile programs per kv head, not rows x longest row.
* **GQA.** A program computes the ``q_per_kv`` query heads that share its kv head for all the
  tile's tokens at once: one ``[q_tile * group, head_dim]`` tile (``group`` = ``q_per_kv``
  padded to a power of two, Triton's tensor sizes), so each K/V block is loaded once per kv head
  and query tile.
* **Key loop.** A ``lax.fori_loop`` over the blocks the tile needs, from the block holding its
  first query's window start (0 without a window) to the block holding its last query: causal
  attention reads no block past the tile's last position, and a window reads none before its
  first query's window. ``blocks_per_iter`` blocks per iteration form one ``[blocks_per_iter *
  block_size, head_dim]`` key tile, fetched through the block table as a gather on the pool ref.
* **Online softmax** in float32 (running max ``m``, denominator ``l``, unnormalised ``acc``), with
  a mask per (query, key): ``key <= query`` (and ``key > query - W``), and keys outside the
  tile's span ``[first query's window start, last query]`` masked for every query with their V
  rows zeroed, so that whatever unused slots and the null block hold (even NaN) is never
  multiplied in. A query that has seen no key yet (a window that starts past an iteration) keeps
  ``m = -inf``; the exponentials use a finite stand-in for it, so no ``-inf - -inf`` NaN arises.
* **Stores.** Tiles of neighbouring rows overlap in the packed token range (a row's partial last
  tile runs into the next row's tokens), so each program stores only its own tokens, by a masked
  store (``jax.experimental.pallas.triton.store``). ``q`` (and the kernel's output) is padded by
  ``q_tile`` tokens so that every tile's load is in bounds (an empty tile starts at
  ``cu_q_lens[B]``, up to ``N``); padding tokens, which no tile covers, are zeroed by the wrapper.

Choices (defaults; ``q_tile``, ``blocks_per_iter``, ``num_warps`` and ``num_stages`` can be given):

* Query rows per program (``q_tile * group``) and keys per iteration: 64 and 64 with 4 warps,
  the tile of FlashAttention-2's Triton kernels, for a "dot width" (``head_dim``, doubled when the
  dots are float32: 3xTF32 holds each operand as two halves) up to 128: bfloat16 at head_dim 64
  and 128, float32 at 64. Wider: 32 rows and 16 keys up to width 256, else 16 and 16 with 8 warps.
  A block larger than those keys (one block is the least a key tile holds) shrinks the query rows
  in proportion, to 16 at least. Measured for sm_90a with ptxas (``bench/triton_check.py``, jax
  0.11.2): these compile without spilling, where 32 rows x 64 keys spilled at width 256 (float32,
  head_dim 128), 32 x 32 did at bfloat16 head_dim 256, and 16 x 16 with 4 warps at width 512
  (bfloat16 head_dim 256 over blocks of 8 still spills 12 bytes). So ``q_tile`` is 16 tokens for a
  group of 3 or 4 (SmolLM2, Llama 3) and 64 without GQA.
* Block ids before the loop (as in the decode kernel): a table of up to 256 columns (4,096 tokens
  in blocks of 16) is read whole, once per program, and each iteration picks its ids out of
  registers, so no global load in the loop feeds a K/V address and Triton's pipeliner gives the
  K/V copies two or more shared-memory buffers (the next tile in flight during this one's dots;
  with the ids read in the loop it gave one buffer at any ``num_stages``). Wider tables are read
  in the loop. Software pipelining: 3 stages with the ids preloaded (2 without: a third buys
  nothing there), fewer where the stages' K and V tiles would take over 128 KiB of shared memory
  (float32, head_dim 256, blocks of 64). Checked for sm_90a (``bench/triton_check.py``): no
  spills at 9/3 heads of 64 and 32/8 of 128, bfloat16 and float32 (255 registers at bfloat16
  head_dim 128, at the limit).
* A decode row fills one token of its tile (``group`` of its 64 rows): such tiles are memory
  bound, and a decode-only step keeps its own split-K kernel (:mod:`pallas_kernels.paged_attention`).
  A prompt of ``n`` tokens gives ``cdiv(n, q_tile)`` programs per kv head, the later ones with more
  keys to read (causal); no split-K here.
* ``blocks_per_iter``: the keys per iteration above in whole blocks, at least 16 keys (``tl.dot``)
  and at most the table's width (rounded up to a power of two).
* Precision follows the decode kernel: float32 dots are 3xTF32 on the GPU (exact float32 in the
  interpreter); a 16-bit pool gives 16-bit dots with float32 accumulation, ``p @ v`` as two dots
  over ``p``'s high and low 16-bit halves.

Options (also as in the decode kernel): ``window`` is an ``i32[1]`` operand (one compilation
serves every layer's W), ``softcap`` a static float applied to the scaled scores before the mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import _compat
from pallas_kernels._common import check_pool, describe, is_power_of_2, next_power_of_2, stacked
from pallas_kernels.paged_attention import (
    _MIN_DOT_DIM,
    _check_window_softcap,
    _f32_dot_precision,
)

# (query rows, keys per iteration, warps) by "dot width", up to the width given (see "Choices" above).
_TILES_BY_WIDTH = ((128, (64, 64, 4)), (256, (32, 16, 4)), (None, (16, 16, 8)))
# Shared memory the pipelined K/V tiles may take (two stages of float32 [64, 256] K and V tiles
# took 296 KiB in all, past the 227 KiB of an H200; one stage: 168 KiB).
_MAX_STAGED_BYTES = 128 * 1024
# Widest block table (columns, rounded up to a power of two) whose ids a program reads before its
# key loop (a [width] i32 register vector, picked from per iteration); wider tables are read in it.
_MAX_PRELOADED_IDS = 256


def _kernel(*refs, windowed: bool, **kwargs):
    """Unpacks the operands: the window operand (``i32[1]``) exists only when ``windowed``."""
    if windowed:
        layer_ref, window_ref, *rest = refs
    else:
        (layer_ref, *rest), window_ref = refs, None
    _ragged_attention_kernel(layer_ref, window_ref, *rest, **kwargs)


def _ragged_attention_kernel(
    # inputs
    layer_ref,  # i32[1]
    window_ref,  # i32[1] (the window W) or None (no window)
    tile_rows_ref,  # i32[num_tiles]: the row of each query tile
    tile_starts_ref,  # i32[num_tiles]: the packed index of each tile's first token
    cu_q_lens_ref,  # i32[B + 1]
    kv_lens_ref,  # i32[B]
    page_indices_ref,  # i32[B, padded columns]
    q_ref,  # [N + q_tile, num_kv_heads, group, head_dim] (whole)
    kv_ref,  # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim] (whole pool)
    # outputs
    o_ref,  # [N + q_tile, num_kv_heads, group, head_dim] (whole; only real tokens are stored)
    *,
    scale: float,
    softcap: float | None,
    q_tile: int,
    blocks_per_iter: int,
    f32_dot,
    preload_ids: bool,
):
    tile_id = pl.program_id(0)
    kv_head = pl.program_id(1)
    block_size = kv_ref.shape[3]
    group, head_dim = q_ref.shape[2], q_ref.shape[3]
    rows = q_tile * group
    k_tile = blocks_per_iter * block_size
    kv_dtype = kv_ref.dtype
    exact_f32 = kv_dtype == jnp.float32

    layer = layer_ref[0]
    row = tile_rows_ref[tile_id]
    q_first = tile_starts_ref[tile_id]
    q_end = cu_q_lens_ref[row + 1]
    kv_len = kv_lens_ref[row]
    num_q = jnp.clip(q_end - q_first, 0, q_tile)  # this tile's tokens; 0: an empty tile
    first_pos = kv_len - (q_end - q_first)  # position of the tile's first query
    last_pos = first_pos + num_q - 1

    # The keys some query of the tile sees: [k_lo, last_pos].
    k_lo = 0 if window_ref is None else jnp.maximum(first_pos - window_ref[0] + 1, 0)
    lo_block = k_lo // block_size
    end_block = last_pos // block_size + 1
    num_iters = jnp.where(num_q > 0, (end_block - lo_block + blocks_per_iter - 1) // blocks_per_iter, 0)

    # Query row r is token r // group of the tile, head r % group of the kv head's group.
    token = lax.broadcasted_iota(jnp.int32, (rows,), 0) // group
    q_pos = first_pos + token
    row_valid = token < num_q
    q = q_ref[pl.ds(q_first, q_tile), kv_head, :, :].reshape(rows, head_dim)

    if preload_ids:
        # The row's whole block table, read once before the loop (a [table_width] vector); each
        # iteration picks its ids out of registers, so no global load sits between one
        # iteration's K/V copy and the next and Triton's pipeliner can issue copies ahead. An
        # iteration running past the row's last block picks id 0 there (the null block: masked).
        table_width = page_indices_ref.shape[1]
        row_ids = page_indices_ref[row, :]  # [table_width]
        column = lax.broadcasted_iota(jnp.int32, (blocks_per_iter, table_width), 1)
        slot_in_iter = lax.broadcasted_iota(jnp.int32, (blocks_per_iter, table_width), 0)

    def body(i, carry):
        acc, m, l = carry
        start = lo_block + i * blocks_per_iter
        if preload_ids:
            picked = column == start + slot_in_iter
            block_ids = jnp.sum(jnp.where(picked, row_ids[None, :], 0), axis=1)
            k = kv_ref[layer, block_ids, 0, :, kv_head, :].reshape(k_tile, head_dim)
            v = kv_ref[layer, block_ids, 1, :, kv_head, :].reshape(k_tile, head_dim)
        elif blocks_per_iter == 1:
            block_id = page_indices_ref[row, start]
            k = kv_ref[layer, block_id, 0, :, kv_head, :]  # [block_size, head_dim]
            v = kv_ref[layer, block_id, 1, :, kv_head, :]
        else:
            block_ids = page_indices_ref[row, pl.ds(start, blocks_per_iter)]
            k = kv_ref[layer, block_ids, 0, :, kv_head, :].reshape(k_tile, head_dim)
            v = kv_ref[layer, block_ids, 1, :, kv_head, :].reshape(k_tile, head_dim)
        k_pos = start * block_size + lax.broadcasted_iota(jnp.int32, (k_tile,), 0)
        key_valid = (k_pos >= k_lo) & (k_pos <= last_pos)  # [k_tile]: seen by some query
        mask = key_valid[None, :] & row_valid[:, None] & (k_pos[None, :] <= q_pos[:, None])
        if window_ref is not None:
            mask = mask & (k_pos[None, :] > q_pos[:, None] - window_ref[0])

        if q.dtype == kv_dtype:  # exact products, float32 accumulation
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=f32_dot if exact_f32 else None,
                preferred_element_type=jnp.float32,
            )  # [rows, k_tile]
        else:  # e.g. float32 queries over a bfloat16 pool
            s = lax.dot_general(
                q.astype(jnp.float32), k.astype(jnp.float32), (((1,), (1,)), ((), ())),
                precision=f32_dot, preferred_element_type=jnp.float32,
            )
        if softcap is None:
            s = s * scale
        else:  # c * tanh(scale * s / c)
            s = softcap * jnp.tanh(s * (scale / softcap))
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a query that has seen no key yet
        alpha = jnp.exp(m - m_safe)  # 0 while m = -inf
        p = jnp.exp(s - m_safe[:, None])  # masked: exp(-inf) = 0
        l_new = alpha * l + jnp.sum(p, axis=1)
        v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))  # no NaN/inf from unused slots
        if exact_f32:
            pv = jnp.dot(
                p, v.astype(jnp.float32), precision=f32_dot, preferred_element_type=jnp.float32
            )
        else:
            p_hi = p.astype(kv_dtype)
            p_lo = (p - p_hi.astype(jnp.float32)).astype(kv_dtype)
            pv = jnp.dot(p_hi, v, preferred_element_type=jnp.float32) + jnp.dot(
                p_lo, v, preferred_element_type=jnp.float32
            )
        acc_new = alpha[:, None] * acc + pv
        return acc_new, m_new, l_new

    acc0 = jnp.zeros((rows, head_dim), jnp.float32)
    m0 = jnp.full((rows,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((rows,), jnp.float32)
    acc, _, l = lax.fori_loop(0, num_iters, body, (acc0, m0, l0))
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # a query with no key (padding): zeros
    out = out.reshape(q_tile, group, head_dim).astype(o_ref.dtype)
    mine = lax.broadcasted_iota(jnp.int32, (q_tile, group, head_dim), 0) < num_q
    # (explicit i32 slices: the interpreter's implicit full slices are i64 under jax_enable_x64)
    zero = jnp.int32(0)
    tokens = o_ref.at[pl.ds(q_first, q_tile), kv_head, pl.ds(zero, group), pl.ds(zero, head_dim)]
    pl_triton.store(tokens, out, mask=mine)


def _default_tiles(head_dim: int, f32_dots: bool) -> tuple[int, int, int]:
    """(query rows, keys per iteration, num_warps) a program aims at (see ``_TILES_BY_WIDTH``)."""
    width = head_dim * (2 if f32_dots else 1)
    return next(tiles for most, tiles in _TILES_BY_WIDTH if most is None or width <= most)


def tile_schedule(cu_q_lens: jax.Array, num_tokens: int, q_tile: int) -> tuple[jax.Array, jax.Array]:
    """The query tiles of a ragged batch, numbered end to end: ``(tile_rows, tile_starts)``, each
    ``i32[num_tiles]`` with ``num_tiles = min(N, cdiv(N, q_tile) + B)`` (a static bound on the
    tiles ``sum_b cdiv(q_len[b], q_tile)`` of any batch of ``N`` tokens in ``B`` rows).

    Tile ``t`` holds the packed tokens ``[tile_starts[t], min(tile_starts[t] + q_tile,
    cu_q_lens[tile_rows[t] + 1]))`` of row ``tile_rows[t]``. The tiles past the real ones are
    empty: row ``B - 1`` from ``cu_q_lens[B]``, which is that row's end.
    """
    num_rows = cu_q_lens.shape[0] - 1
    num_tiles = min(num_tokens, -(-num_tokens // q_tile) + num_rows)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    cu_tiles = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum((q_lens + q_tile - 1) // q_tile, dtype=jnp.int32)]
    )
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    # the row b with cu_tiles[b] <= t < cu_tiles[b + 1] (rows without tiles are skipped)
    rows = jnp.minimum(jnp.searchsorted(cu_tiles[1:], t, side="right"), num_rows - 1).astype(jnp.int32)
    starts = cu_q_lens[rows] + (t - cu_tiles[rows]) * q_tile
    real = t < cu_tiles[num_rows]
    return jnp.where(real, rows, num_rows - 1), jnp.where(real, starts, cu_q_lens[num_rows])


def _validate(q, kv_cache, cu_q_lens, kv_lens, page_indices, layer, window, softcap, q_tile,
              blocks_per_iter, interpret):
    what = "ragged_paged_attention"
    check_pool(kv_cache, layer, what=what)
    _check_window_softcap(window, softcap, what=what)
    block_size, num_kv_heads, head_dim = kv_cache.shape[-3:]
    if q.ndim != 3 or q.shape[0] < 1:
        raise ValueError(f"{what}: q must be [num_tokens >= 1, num_heads, head_dim]; got q {describe(q)}")
    num_tokens, num_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"{what}: head_dim of q {describe(q)} and kv_cache {describe(kv_cache)} differ")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"{what}: q {describe(q)} must be floating point")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{what}: num_heads of q {describe(q)} must be a multiple of num_kv_heads of "
            f"kv_cache {describe(kv_cache)}"
        )
    if page_indices.ndim != 2 or page_indices.dtype != jnp.int32 or min(page_indices.shape) < 1:
        raise ValueError(
            f"{what}: page_indices must be i32[num_rows, pages_per_row] (both >= 1); got "
            f"page_indices {describe(page_indices)}"
        )
    num_rows = page_indices.shape[0]
    if cu_q_lens.shape != (num_rows + 1,) or cu_q_lens.dtype != jnp.int32:
        raise ValueError(
            f"{what}: cu_q_lens must be i32[num_rows + 1] with the rows of page_indices; got "
            f"cu_q_lens {describe(cu_q_lens)} and page_indices {describe(page_indices)}"
        )
    if kv_lens.shape != (num_rows,) or kv_lens.dtype != jnp.int32:
        raise ValueError(
            f"{what}: kv_lens must be i32[num_rows] with the rows of page_indices; got kv_lens "
            f"{describe(kv_lens)} and page_indices {describe(page_indices)}"
        )
    # Triton tensors have power-of-two sizes.
    if not is_power_of_2(head_dim) or not is_power_of_2(block_size):
        raise ValueError(
            f"{what}: head_dim and block_size must be powers of two (Triton tiles); got "
            f"kv_cache {describe(kv_cache)}"
        )
    group = next_power_of_2(num_heads // num_kv_heads)
    for name, value in (("q_tile", q_tile), ("blocks_per_iter", blocks_per_iter)):
        if value is not None and not (isinstance(value, int) and is_power_of_2(value)):
            raise ValueError(f"{what}: {name}={value!r} must be a power of two")
    if not interpret:  # tl.dot needs every dimension >= 16
        if q_tile is not None and q_tile * group < _MIN_DOT_DIM:
            raise ValueError(
                f"{what}: q_tile * (q_per_kv padded to a power of two) = {q_tile * group} must be "
                f">= {_MIN_DOT_DIM} on the GPU (tl.dot); q {describe(q)}, kv_cache {describe(kv_cache)}"
            )
        if blocks_per_iter is not None and blocks_per_iter * block_size < _MIN_DOT_DIM:
            raise ValueError(
                f"{what}: blocks_per_iter * block_size = {blocks_per_iter * block_size} must be "
                f">= {_MIN_DOT_DIM} on the GPU (tl.dot); kv_cache {describe(kv_cache)}"
            )


@functools.partial(
    jax.jit,
    static_argnames=("scale", "softcap", "interpret", "q_tile", "blocks_per_iter", "num_warps", "num_stages"),
)
def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    scale: float,
    layer: jax.Array | int | None = None,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    interpret: bool = False,
    q_tile: int | None = None,
    blocks_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """Causal attention of a ragged batch's new tokens over their rows' paged K/V (module docstring).

    Args:
      q: ``f[N, num_heads, head_dim]`` (f32, bf16 or f16), the new tokens of all rows packed end
        to end (row ``b``'s are ``q[cu_q_lens[b]:cu_q_lens[b + 1]]``), NOT pre-scaled; padding
        tokens after ``cu_q_lens[B]``. Query head ``i`` uses KV head ``i // (num_heads //
        num_kv_heads)``. Best in the pool's dtype (16-bit dots); another dtype makes ``q @ k.T`` a
        float32 dot.
      kv_cache: the K/V pool, ``f[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``
        with ``layer``, or ``f[num_blocks, 2, block_size, num_kv_heads, head_dim]`` without (f32,
        bf16 or f16): ``kv_cache[..., b, 0]`` is block ``b``'s K, ``kv_cache[..., b, 1]`` its V,
        every new token's K/V already written. ``head_dim`` and ``block_size`` are powers of two.
      cu_q_lens: ``i32[B + 1]``, row offsets into the packed tokens: 0, then non-decreasing, at
        most ``N`` (a padding row has no tokens).
      kv_lens: ``i32[B]``, tokens of each row in the pool after this step (new ones included),
        ``q_len <= kv_len <= M * block_size``; padding rows 0.
      page_indices: ``i32[B, M]``, each row's block table (physical ids in ``[0, num_blocks)``);
        entries past a row's context or wholly before its first query's window are never read.
      scale: softmax scale (a Python float), usually ``head_dim ** -0.5``.
      layer: ``i32[]`` (may be traced), the layer of a stacked pool. Not bounds-checked.
      window: ``None`` or ``i32[]`` W >= 1 (may be traced: one compiled kernel serves every W): the
        query at position ``p`` sees the keys at ``p - W < k <= p``.
      softcap: ``None`` or a Python float c > 0: scaled scores ``s`` become ``c * tanh(s / c)``
        before masking and softmax.
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.
      q_tile: tokens per query tile (power of two); default: 64 query rows (tokens x the GQA
        group padded to a power of two) per program, fewer for wide heads (``_TILES_BY_WIDTH``).
      blocks_per_iter: blocks per key-loop iteration (power of two); default: 64 keys, fewer for
        wide heads, at least 16 (``tl.dot``) and one block.
      num_warps, num_stages: Triton compiler parameters (default warps: by head width; stages: 2,
        or 1 where two stages of K/V tiles would pass 128 KiB of shared memory).

    Returns:
      ``f[N, num_heads, head_dim]`` in the dtype of ``q``; padding tokens are zeros.
    """
    _validate(q, kv_cache, cu_q_lens, kv_lens, page_indices, layer, window, softcap, q_tile,
              blocks_per_iter, interpret)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[-3], kv_cache.shape[-2]
    q_per_kv = num_heads // num_kv_heads
    group = next_power_of_2(q_per_kv)
    max_blocks = page_indices.shape[1]

    f32_dots = kv_cache.dtype == jnp.float32 or q.dtype != kv_cache.dtype
    rows, keys, warps = _default_tiles(head_dim, f32_dots)
    # blocks per iteration: `keys` tokens, at least 16 (tl.dot), at most the table's width
    per_iter = blocks_per_iter or max(
        min(max(1, keys // block_size), next_power_of_2(max_blocks)),
        next_power_of_2(-(-_MIN_DOT_DIM // block_size)),
    )
    # a key tile larger than `keys` (large blocks) takes its registers from the query rows
    rows = max(_MIN_DOT_DIM, rows * keys // max(keys, per_iter * block_size))
    tq = q_tile or max(1, rows // group)
    # pipelining stages: each holds a K and a V tile in shared memory (227 KiB on an H100/H200)
    stage_bytes = 2 * per_iter * block_size * head_dim * kv_cache.dtype.itemsize
    # Tables up to _MAX_PRELOADED_IDS columns are read whole before the key loop (see the kernel).
    preload_ids = next_power_of_2(max_blocks) <= _MAX_PRELOADED_IDS
    most_stages = 3 if preload_ids else 2  # without preloading, a third stage buys nothing
    stages = num_stages or next(
        (n for n in range(most_stages, 1, -1) if n * stage_bytes <= _MAX_STAGED_BYTES), 1
    )
    if preload_ids:  # a power-of-two width (a Triton tensor); ids past the table read as 0
        page_indices = jnp.pad(page_indices, ((0, 0), (0, next_power_of_2(max_blocks) - max_blocks)))
    elif per_iter > 1:
        # A key loop starts at any block (a window's first) and its last iteration may run
        # per_iter - 1 entries past the row's last block: pad the table (a small copy).
        page_indices = jnp.pad(page_indices, ((0, 0), (0, per_iter - 1)))
    tile_rows, tile_starts = tile_schedule(cu_q_lens, num_tokens, tq)

    # [N + tq, num_kv_heads, group, head_dim]: every tile's load [start, start + tq) is in bounds
    # (start <= cu_q_lens[B] <= N; an empty tile's start is cu_q_lens[B])
    q4 = q.reshape(num_tokens, num_kv_heads, q_per_kv, head_dim)
    q4 = jnp.pad(q4, ((0, tq), (0, 0), (0, group - q_per_kv), (0, 0)))

    kv6, layer_arr = stacked(kv_cache, layer)
    scalars = [layer_arr]  # i32[1] operands: the layer, then the window (if any)
    if window is not None:
        scalars.append(jnp.asarray(window, jnp.int32).reshape(1))

    kernel = functools.partial(
        _kernel,
        windowed=window is not None,
        scale=float(scale),
        softcap=None if softcap is None else float(softcap),
        q_tile=tq,
        blocks_per_iter=per_iter,
        f32_dot=_f32_dot_precision(interpret),
        preload_ids=preload_ids,
    )
    whole = _compat.WHOLE_ARRAY
    out = pl.pallas_call(
        kernel,
        grid=(tile_rows.shape[0], num_kv_heads),
        in_specs=[whole] * (len(scalars) + 7),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        compiler_params=_compat.compiler_params(num_warps=num_warps or warps, num_stages=stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*scalars, tile_rows, tile_starts, cu_q_lens, kv_lens, page_indices, q4, kv6)

    out = out[:num_tokens, :, :q_per_kv].reshape(num_tokens, num_heads, head_dim)
    real = jnp.arange(num_tokens) < cu_q_lens[-1]  # no tile stores the padding tokens
    return jnp.where(real[:, None, None], out, jnp.zeros_like(out))


@functools.partial(jax.jit, static_argnames=("scale", "softcap"))
def ragged_paged_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    scale: float,
    layer: jax.Array | int | None = None,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Plain-``jnp`` ragged paged attention: each token's row context gathered dense, masked, softmax.

    Same arguments and result as :func:`ragged_paged_attention`. Computes in the wider of float32
    and the inputs' dtypes (float64 inputs under ``jax_enable_x64``: float64). Gathers, for every
    packed token, a contiguous copy of its row's whole block table (``[N, M * block_size]`` keys:
    any block id there must be in range), so it is for testing, not for serving.
    """
    what = "ragged_paged_attention_reference"
    check_pool(kv_cache, layer, what=what)
    _check_window_softcap(window, softcap, what=what)
    dtype = jnp.promote_types(jnp.promote_types(q.dtype, kv_cache.dtype), jnp.float32)
    num_tokens, num_heads, head_dim = q.shape
    if layer is not None:
        kv_cache = kv_cache[layer]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_rows, max_blocks = page_indices.shape
    q_per_kv = num_heads // num_kv_heads
    context = max_blocks * block_size

    # Each packed token's row, and its position: the row's new tokens are its last ones.
    n = jnp.arange(num_tokens)
    row = jnp.clip(jnp.searchsorted(cu_q_lens, n, side="right") - 1, 0, num_rows - 1)
    real = n < cu_q_lens[num_rows]
    position = kv_lens[row] - (cu_q_lens[row + 1] - n)  # [N]

    kv = kv_cache[page_indices[row]]  # [N, M, 2, block_size, num_kv_heads, head_dim]
    k = kv[:, :, 0].reshape(num_tokens, context, num_kv_heads, head_dim)
    v = kv[:, :, 1].reshape(num_tokens, context, num_kv_heads, head_dim)
    key_position = jnp.arange(context)[None, :]
    visible = real[:, None] & (key_position <= position[:, None])  # [N, context]
    if window is not None:
        visible = visible & (key_position > position[:, None] - window)
    k = jnp.where(visible[:, :, None, None], k, 0).astype(dtype)
    v = jnp.where(visible[:, :, None, None], v, 0).astype(dtype)
    qg = q.astype(dtype).reshape(num_tokens, num_kv_heads, q_per_kv, head_dim)
    s = jnp.einsum("nhgd,nshd->nhgs", qg, k, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)
    p = jnp.exp(s - s_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("nhgs,nshd->nhgd", p, v, precision=lax.Precision.HIGHEST)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
