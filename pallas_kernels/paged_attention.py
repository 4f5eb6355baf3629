"""Paged attention for decode (PagedAttention, section 4.1 / 5.1): one query token per sequence.

Each sequence's K/V live in fixed-size blocks of a shared pool,
``kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``, where
``kv_cache[layer, b, 0]`` is block ``b``'s K and ``kv_cache[layer, b, 1]`` its V (each block's
K and V side by side in memory); its block table maps logical block ``i`` (tokens
``i*block_size ..``) to a physical block id. The kernel walks the block table itself and loads
each block's K and V straight from the pool: nothing is gathered into a contiguous copy first.

Kernel design (Triton-style Pallas; one program per ``(sequence, kv_head, context split)``):

* The GQA group: the ``q_per_kv`` query heads that share a KV head are one ``[rows, head_dim]``
  tile (``rows`` = ``q_per_kv`` padded to a power of two >= 16, what Triton's ``tl.dot`` needs),
  so each K/V block is loaded once per KV head, not once per query head.
* A ``lax.fori_loop`` over the sequence's blocks, bounded by its context length (never by
  ``max_blocks_per_seq``), ``blocks_per_iter`` blocks per iteration (a ``[blocks_per_iter *
  block_size, head_dim]`` tile, fetched through the block table as a gather on the pool ref).
  Default: ~32 KiB of K and V per iteration (64 tokens of bf16 at head_dim 128, 128 at 64).
* Block ids before the loop, so the K/V loads pipeline (the change for Hopper, issue 31): a
  program reads its split's ``blocks_per_split`` ids (a power of two, at most 256) as one
  vector before the loop and each iteration picks its ``blocks_per_iter`` ids out of registers
  (a masked sum). The loop then holds no global load that a K/V address depends on, and
  Triton's software pipeliner gives each K and V copy ``num_stages - 1`` shared-memory buffers
  (``cp.async``): with the default ``num_stages=3``, the next tile is in flight while this one
  is computed. Reading the ids inside the loop (the kernel of the first GPU run) left one
  buffer at any ``num_stages``: the copy of iteration ``i + 1`` was issued after iteration
  ``i``'s dots and waited for at the top of ``i + 1`` (``cp.async.wait_group 0``), with a
  dependent table load in front of it: two DRAM round trips per iteration, nothing in flight
  during the compute (TTGIR/SASS for sm_90a via ``bench/triton_check.py``: ``copy_buffers``).
* Scores by a matmul, then an online (streaming) softmax in float32: running max ``m``, running
  denominator ``l``, unnormalised accumulator ``acc``. Tokens at or past the context length are
  masked: their scores become ``-inf`` and their V rows are zeroed, so whatever the unused slots
  and the null block hold (even NaN) cannot leak into the result.
* Split-K: the block range is cut into ``num_splits`` static slices of ``blocks_per_split``
  blocks, one program each; the wrapper merges the partial ``(acc, m, l)`` by log-sum-exp.
  Splits that start past a sequence's context do no work. Default: enough splits for ~512
  programs (2 waves of 2 programs per SM on an H200's 132 SMs, the shared memory of two
  pipelined K/V buffers allowing 2), each split at least 2 iterations long: at batch 1 x 4,096
  tokens with 8 KV heads of 128, 32 splits of 2 iterations (256 programs; before: 16 splits of
  4); at batch 32 x 2,048, 2 splits of 16 iterations (512 programs; before: 256 programs of 32).
* Precision: float32 dots are 3xTF32 on the GPU (float32-level accuracy on tensor cores;
  Triton's default for float32 would be plain TF32) and exact float32 in the interpreter. For
  16-bit caches, ``q @ k.T`` is a 16-bit dot with float32 accumulation (exact products); the
  probabilities ``p`` (float32) are split into ``hi + lo`` 16-bit halves and ``p @ v`` is two
  16-bit dots with float32 accumulation, keeping ~16 bits of ``p`` (float32-level accuracy)
  on tensor cores.

Sliding window and soft-capping (optional, e.g. Mistral / Gemma 2):

* ``window`` (a traced ``i32[]`` W >= 1, e.g. scanned over layers, so one compiled kernel
  serves every layer): the query at position ``p = context_len - 1`` sees only the keys at
  ``p - W < k <= p``, the W most recent positions (HF transformers' ``kv_idx > q_idx -
  sliding_window``). It enters the kernel as an ``i32[1]`` operand beside the layer index. The
  windowed kernel splits only the visible block range ``[(context_len - W) // block_size,
  cdiv(context_len, block_size))``, evenly over the ``num_splits`` programs, so it never reads
  block-table entries before the window (the block manager may have freed those blocks and
  nulled their entries) and no split does work outside it; keys of the first visible block
  that are before the window are masked like tokens past the context. ``window=None`` compiles
  none of this: the kernel above, unchanged.
* ``softcap`` (a static float c > 0): each scaled score ``s`` becomes ``c * tanh(s / c)``
  before masking and softmax (Gemma 2's ``attn_logit_softcapping``).

A context length of 0 yields zeros (handy for padded batch rows); valid contexts are >= 1.

Backend: Triton-style Pallas, not Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``), although
the Triton lowering is deprecated from JAX 0.11. Reasons: (1) the kernel's core is a
data-dependent gather (block ids read in the kernel index the pool); the Triton lowering turns a
plain ref index into pipelined ``cp.async`` copies, and that is checked here without a GPU down
to the SASS (``bench/triton_check.py``). In Mosaic GPU the same walk means a TMA copy per block
(``copy_gmem_to_smem`` at a block id first brought into registers) with hand-managed barriers
and buffer rotation: the pipelining the Triton compiler does would be written by hand, and
its speed could not be checked without a GPU. (2) The project's tests run on jax 0.10.2
(Python 3.11, CPU machines), where only Triton-style kernels run in ``interpret=True`` (Mosaic
GPU's TMA copies fail there, :mod:`pallas_kernels`); jax 0.11.2 ships a Mosaic GPU interpret
mode (``InterpretGPUParams``), so a port could be tested on 3.12 only. A Mosaic GPU port (TMA +
wgmma, a warp-specialised producer) is the way past what cp.async pipelining reaches, once a GPU
run shows this kernel short of the goals.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._common import check_pool, describe, is_power_of_2, next_power_of_2, stacked

# Triton's tl.dot needs every dimension >= 16.
_MIN_DOT_DIM = 16
# Programs to aim for when choosing the number of context splits: an H200 has 132 SMs and
# holds 2 programs per SM at the default tiles (shared memory: 2 buffers of K and V each), so
# ~2 waves.
_TARGET_PROGRAMS = 512
# A split gets at least this many loop iterations' worth of blocks (2: the pipeline overlaps one
# tile's copy with the other's dots; small batches want many short splits to fill the SMs).
_MIN_ITERS_PER_SPLIT = 2
# Bytes of K and V per loop iteration the default blocks_per_iter aims for, and its bounds.
_TILE_BYTES = 32 * 1024
_MIN_TOKENS_PER_ITER = 32
_MAX_TOKENS_PER_ITER = 128
# Most block ids a split reads before its loop (a [blocks_per_split] i32 register vector).
_MAX_BLOCKS_PER_SPLIT = 256


def _f32_dot_precision(interpret: bool):
    """Precision of float32 dots. The Triton lowering maps DEFAULT to TF32 (10-bit mantissa);
    HIGHEST lowers to an IEEE dot on CUDA cores, which spills at head_dim 128. On the GPU: 3xTF32
    (tensor cores, float32-level accuracy, no spills in ptxas for sm_90a). The CPU interpreter
    has no TF32: HIGHEST, exact float32."""
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _kernel(*refs, windowed: bool, **kwargs):
    """Unpacks the operands: the window operand (``i32[1]``) exists only when ``windowed``."""
    if windowed:
        layer_ref, window_ref, *rest = refs
    else:
        (layer_ref, *rest), window_ref = refs, None
    _attention_kernel(layer_ref, window_ref, *rest, **kwargs)


def _attention_kernel(
    # inputs
    layer_ref,  # i32[1]
    window_ref,  # i32[1] (the window W) or None (no window)
    block_tables_ref,  # i32[batch, padded columns] (see paged_attention)
    context_lens_ref,  # i32[batch]
    q_ref,  # [rows, head_dim] (this sequence and KV head)
    kv_ref,  # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim] (whole pool)
    # outputs
    acc_ref,  # f32[rows, head_dim]
    m_ref,  # f32[rows]
    l_ref,  # f32[rows]
    *,
    scale: float,
    softcap: float | None,
    blocks_per_iter: int,
    blocks_per_split: int,
    num_splits: int,
    f32_dot,
):
    seq = pl.program_id(0)
    kv_head = pl.program_id(1)
    split = pl.program_id(2)
    block_size = kv_ref.shape[3]
    rows, head_dim = q_ref.shape
    tile = blocks_per_iter * block_size
    kv_dtype = kv_ref.dtype
    exact_f32 = kv_dtype == jnp.float32

    layer = layer_ref[0]
    context_len = context_lens_ref[seq]
    q = q_ref[...]  # [rows, head_dim]

    num_ctx_blocks = (context_len + block_size - 1) // block_size
    if window_ref is None:
        # Static splits of the block table; splits past the context do no work.
        first_block = split * blocks_per_split
        end_block = jnp.minimum(first_block + blocks_per_split, num_ctx_blocks)
        window_start = None
    else:
        # The visible positions are [window_start, context_len): the query (at context_len - 1)
        # and the W - 1 before it. Only the blocks holding them are split (evenly, in whole
        # iterations, from the first visible block), so no split reads the table before the
        # window, and splits past the visible range do no work. An iteration may run past the
        # visible range only at its end (past the context: masked, and the table is padded).
        window_start = jnp.maximum(context_len - window_ref[0], 0)
        lo_block = window_start // block_size
        visible_blocks = jnp.maximum(num_ctx_blocks - lo_block, 0)
        split_iters = (visible_blocks + num_splits * blocks_per_iter - 1) // (
            num_splits * blocks_per_iter
        )
        first_block = lo_block + split * split_iters * blocks_per_iter
        end_block = jnp.minimum(first_block + split_iters * blocks_per_iter, num_ctx_blocks)
    num_iters = jnp.maximum(end_block - first_block + blocks_per_iter - 1, 0) // blocks_per_iter
    # A split that does work starts before the table's last column; one that does none (its
    # ids are never used) reads from the last in-bounds start instead.
    table_start = jnp.minimum(first_block, block_tables_ref.shape[1] - blocks_per_split)

    # The split's block ids, read once before the loop (a [blocks_per_split] vector; the table
    # is padded so that this read is in bounds). The loop picks each iteration's ids out of
    # registers, so the K/V addresses of later iterations need no global load and Triton's
    # pipeliner can issue their copies num_stages - 1 iterations ahead (with a table read in
    # the loop, the copy of iteration i + 1 waits for that read, after iteration i's dots).
    split_ids = block_tables_ref[seq, pl.ds(table_start, blocks_per_split)].reshape(
        blocks_per_split // blocks_per_iter, blocks_per_iter
    )
    iter_of_id = lax.broadcasted_iota(jnp.int32, split_ids.shape, 0)

    def body(i, carry):
        acc, m, l = carry
        start = first_block + i * blocks_per_iter
        block_ids = jnp.sum(jnp.where(iter_of_id == i, split_ids, 0), axis=0)  # [blocks_per_iter]
        k = kv_ref[layer, block_ids, 0, :, kv_head, :].reshape(tile, head_dim)
        v = kv_ref[layer, block_ids, 1, :, kv_head, :].reshape(tile, head_dim)
        positions = start * block_size + lax.broadcasted_iota(jnp.int32, (tile,), 0)
        valid = positions < context_len  # [tile]
        if window_start is not None:
            valid = valid & (positions >= window_start)

        if q.dtype == kv_dtype:  # exact products, float32 accumulation
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=f32_dot if exact_f32 else None,
                preferred_element_type=jnp.float32,
            )  # [rows, tile]
        else:  # e.g. float32 queries over a bfloat16 pool
            s = lax.dot_general(
                q.astype(jnp.float32), k.astype(jnp.float32), (((1,), (1,)), ((), ())),
                precision=f32_dot, preferred_element_type=jnp.float32,
            )
        if softcap is None:
            s = s * scale
        else:  # c * tanh(scale * s / c)
            s = softcap * jnp.tanh(s * (scale / softcap))
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)  # 0 on the first iteration (m = -inf, m_new finite)
        p = jnp.exp(s - m_new[:, None])  # masked tokens: exp(-inf) = 0
        l_new = alpha * l + jnp.sum(p, axis=1)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # no NaN/inf from unused slots
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
    acc, m, l = lax.fori_loop(0, num_iters, body, (acc0, m0, l0))
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _default_blocks_per_iter(block_size: int, max_blocks: int, head_dim: int, itemsize: int) -> int:
    """Blocks per iteration: ~``_TILE_BYTES`` of K and V (64 tokens of bf16 at head_dim 128, 128
    at 64), between 32 and 128 tokens and at least 16 (``tl.dot``)."""
    tokens = _TILE_BYTES // (2 * head_dim * itemsize)
    tokens = min(_MAX_TOKENS_PER_ITER, max(_MIN_TOKENS_PER_ITER, next_power_of_2(tokens)))
    per_iter = max(1, tokens // block_size)
    per_iter = min(per_iter, next_power_of_2(max_blocks))
    # The K tile must be >= 16 tokens for tl.dot.
    return max(per_iter, next_power_of_2(-(-_MIN_DOT_DIM // block_size)))


def _default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, per_iter: int) -> int:
    """Enough programs for ``_TARGET_PROGRAMS``, each with ``_MIN_ITERS_PER_SPLIT`` iterations."""
    wanted = -(-_TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    most = max(1, max_blocks // (_MIN_ITERS_PER_SPLIT * per_iter))
    return max(1, min(wanted, most))


def _blocks_per_split(max_blocks: int, splits: int, per_iter: int) -> int:
    """Blocks per split: a power of two (the kernel reads a split's ids as one Triton tensor), a
    multiple of ``per_iter``, at most ``_MAX_BLOCKS_PER_SPLIT`` (the ids stay a few registers)."""
    wanted = next_power_of_2(-(-max_blocks // max(1, splits)))
    return max(per_iter, min(wanted, _MAX_BLOCKS_PER_SPLIT))


def _check_window_softcap(window, softcap, *, what: str) -> None:
    if window is not None and (
        jnp.shape(window) != () or not jnp.issubdtype(jnp.result_type(window), jnp.integer)
    ):
        raise ValueError(f"{what}: window must be None or an integer scalar; got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"{what}: softcap must be None or a positive Python float; got {softcap!r}")


def _validate(
    q, kv_cache, block_tables, context_lens, layer, window, softcap, blocks_per_iter, interpret
):
    what = "paged_attention"
    check_pool(kv_cache, layer, what=what)
    _check_window_softcap(window, softcap, what=what)
    block_size, num_kv_heads, head_dim = kv_cache.shape[-3:]
    if q.ndim != 3:
        raise ValueError(f"{what}: q must be [batch, num_heads, head_dim]; got q {describe(q)}")
    batch, num_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(
            f"{what}: head_dim of q {describe(q)} and kv_cache {describe(kv_cache)} differ"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"{what}: q {describe(q)} must be floating point")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{what}: num_heads of q {describe(q)} must be a multiple of num_kv_heads of "
            f"kv_cache {describe(kv_cache)}"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"{what}: block_tables must be i32[batch, max_blocks_per_seq] with the batch of q; "
            f"got block_tables {describe(block_tables)} and q {describe(q)}"
        )
    if block_tables.shape[1] < 1:
        raise ValueError(f"{what}: block_tables {describe(block_tables)} has no columns")
    if context_lens.shape != (batch,) or context_lens.dtype != jnp.int32:
        raise ValueError(
            f"{what}: context_lens must be i32[batch] with the batch of q; got context_lens "
            f"{describe(context_lens)} and q {describe(q)}"
        )
    # Triton tensors have power-of-two sizes.
    if not is_power_of_2(head_dim) or not is_power_of_2(block_size):
        raise ValueError(
            f"{what}: head_dim and block_size must be powers of two (Triton tiles); got "
            f"kv_cache {describe(kv_cache)}"
        )
    if blocks_per_iter is not None:
        if not is_power_of_2(blocks_per_iter):
            raise ValueError(f"{what}: blocks_per_iter={blocks_per_iter} must be a power of two")
        if not interpret and blocks_per_iter * block_size < _MIN_DOT_DIM:
            raise ValueError(
                f"{what}: blocks_per_iter * block_size = {blocks_per_iter * block_size} must be "
                f">= {_MIN_DOT_DIM} on the GPU (tl.dot); kv_cache {describe(kv_cache)}"
            )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "softcap",
        "interpret",
        "blocks_per_iter",
        "num_splits",
        "num_warps",
        "num_stages",
    ),
)
def paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    scale: float,
    layer: jax.Array | int | None = None,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    interpret: bool = False,
    blocks_per_iter: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:
    """Decode attention of one new query token per sequence over its paged K/V context.

    Args:
      q: ``f[batch, num_heads, head_dim]`` (f32, bf16 or f16), the new tokens' queries, NOT
        pre-scaled. Query head ``i`` uses KV head ``i // (num_heads // num_kv_heads)``. Best in
        the pool's dtype (a 16-bit dot); another dtype makes ``q @ k.T`` a float32 dot.
      kv_cache: the K/V pool, ``f[num_layers, num_blocks, 2, block_size, num_kv_heads,
        head_dim]`` with ``layer``, or ``f[num_blocks, 2, block_size, num_kv_heads, head_dim]``
        without (f32, bf16 or f16): ``kv_cache[..., b, 0, :, :, :]`` is block ``b``'s K,
        ``kv_cache[..., b, 1, :, :, :]`` its V. ``head_dim`` and ``block_size`` are powers of
        two.
      block_tables: ``i32[batch, max_blocks_per_seq]``, physical block ids in
        ``[0, num_blocks)``; entries past a sequence's last block are never read (pad with the
        null block 0).
      context_lens: ``i32[batch]``, tokens of context per sequence (including the new token,
        whose K/V must already be written); ``0 <= context_len <= max_blocks_per_seq *
        block_size``. A length of 0 gives zeros.
      scale: softmax scale (a Python float), usually ``head_dim ** -0.5``.
      layer: ``i32[]`` (may be traced), the layer of a stacked pool. Not bounds-checked.
      window: ``None`` (every position in context is visible) or ``i32[]`` W >= 1 (may be
        traced: one compiled kernel serves every W): the sliding window, the query (at
        ``context_len - 1``) sees only the last W positions of its context. Block-table
        entries before the window's first block are never read (they may be the null block).
      softcap: ``None`` or a Python float c > 0: scaled scores ``s`` become
        ``c * tanh(s / c)`` before masking and softmax (logit soft-capping).
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.
      blocks_per_iter: blocks per loop iteration (power of two); default: ~32 KiB of K and V.
      num_splits: context splits (split-K); default: enough programs to fill the GPU. Rounded so
        that each split is a power of two of blocks (at most 256): the splits used may be fewer,
        or more where a split would exceed 256 blocks.
      num_warps, num_stages: Triton compiler parameters (``num_stages - 1`` K/V buffers per
        program; 2 gives one buffer, no copy in flight during the compute).

    Returns:
      ``f[batch, num_heads, head_dim]`` in the dtype of ``q``.
    """
    _validate(
        q, kv_cache, block_tables, context_lens, layer, window, softcap, blocks_per_iter, interpret
    )
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[-3], kv_cache.shape[-2]
    q_per_kv = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]

    per_iter = blocks_per_iter or _default_blocks_per_iter(
        block_size, max_blocks, head_dim, jnp.dtype(kv_cache.dtype).itemsize
    )
    splits = num_splits or _default_num_splits(batch, num_kv_heads, max_blocks, per_iter)
    blocks_per_split = _blocks_per_split(max_blocks, splits, per_iter)
    splits = -(-max_blocks // blocks_per_split)
    if window is None:  # static splits: each reads an aligned, whole slice of the table
        padded_blocks = splits * blocks_per_split
    else:  # splits start anywhere before the context's last block
        padded_blocks = max_blocks - 1 + blocks_per_split
    if padded_blocks > max_blocks:  # a small copy of the table, never of the pool
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))

    rows = max(_MIN_DOT_DIM, next_power_of_2(q_per_kv))
    q4 = q.reshape(batch, num_kv_heads, q_per_kv, head_dim)
    if rows != q_per_kv:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - q_per_kv), (0, 0)))

    kv6, layer_arr = stacked(kv_cache, layer)

    scalars = [layer_arr]  # i32[1] operands: the layer, then the window (if any)
    if window is not None:
        scalars.append(jnp.asarray(window, jnp.int32).reshape(1))

    kernel = functools.partial(
        _kernel,
        windowed=window is not None,
        scale=float(scale),
        softcap=None if softcap is None else float(softcap),
        blocks_per_iter=per_iter,
        blocks_per_split=blocks_per_split,
        num_splits=splits,
        f32_dot=_f32_dot_precision(interpret),
    )
    whole = _compat.WHOLE_ARRAY
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, splits),
        in_specs=[
            *[whole] * len(scalars),  # layer (and window)
            whole,  # block_tables
            whole,  # context_lens
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            whole,  # K/V pool
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, batch, num_kv_heads, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, num_kv_heads, rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, num_kv_heads, rows), jnp.float32),
        ],
        compiler_params=_compat.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention",
    )(*scalars, block_tables, context_lens, q4, kv6)

    acc = acc[:, :, :, :q_per_kv]
    m = m[:, :, :, :q_per_kv]
    l = l[:, :, :, :q_per_kv]
    out = _merge_splits(acc, m, l)
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)


def _merge_splits(acc, m, l):
    """Log-sum-exp merge of per-split ``(acc f32[S,...,D], m f32[S,...], l f32[S,...])``."""
    m_max = jnp.max(m, axis=0)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)  # all splits empty: context_len == 0
    weight = jnp.exp(m - m_max[None])  # empty splits: exp(-inf) = 0
    denom = jnp.sum(weight * l, axis=0)
    numer = jnp.sum(weight[..., None] * acc, axis=0)
    return numer / jnp.where(denom > 0, denom, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "softcap"))
def paged_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    scale: float,
    layer: jax.Array | int | None = None,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Plain-``jnp`` paged attention: gather each sequence's blocks, mask, softmax (float32).

    Same arguments and result as :func:`paged_attention`. Gathers a contiguous copy of every
    sequence's context (the whole block table, before the window too: any block id there must
    be in range), so it is for testing, not for serving.
    """
    what = "paged_attention_reference"
    check_pool(kv_cache, layer, what=what)
    _check_window_softcap(window, softcap, what=what)
    batch, num_heads, head_dim = q.shape
    if layer is not None:
        kv_cache = kv_cache[layer]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    max_blocks = block_tables.shape[1]
    q_per_kv = num_heads // num_kv_heads
    seq_len = max_blocks * block_size

    kv = kv_cache[block_tables]  # [batch, max_blocks, 2, block_size, num_kv_heads, head_dim]
    k = kv[:, :, 0].reshape(batch, seq_len, num_kv_heads, head_dim)
    v = kv[:, :, 1].reshape(batch, seq_len, num_kv_heads, head_dim)
    positions = jnp.arange(seq_len)[None, :]
    valid = positions < context_lens[:, None]  # [batch, seq_len]
    if window is not None:  # the query is at context_len - 1: keys k > context_len - 1 - W
        valid = valid & (positions > context_lens[:, None] - 1 - window)
    k = jnp.where(valid[:, :, None, None], k, 0).astype(jnp.float32)
    v = jnp.where(valid[:, :, None, None], v, 0).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, q_per_kv, head_dim)
    s = jnp.einsum("bhgd,bshd->bhgs", qg, k, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)
    p = jnp.exp(s - s_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgs,bshd->bhgd", p, v, precision=lax.Precision.HIGHEST)
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)

