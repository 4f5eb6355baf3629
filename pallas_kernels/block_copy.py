"""Fused block copy (PagedAttention section 5.1): all copy-on-write copies of a step, one launch.

Copy-on-write copies whole blocks, ``src -> dst``, in every layer's K and V pool. Launching one
copy per block (and per layer) would be dominated by launch overhead; this kernel does the
step's copies for all layers, K and V, in one ``pallas_call``, in place (the pools are aliased
inputs/outputs).

Kernel design (Triton-style Pallas): one program per ``(pair, layer, kv_head)`` moves a
``[block_size, head_dim]`` tile of K and one of V (``num_kv_heads`` need not be a power of two).

Contract: destinations are distinct and no destination is a source of the same launch (true of
copy-on-write: sources are shared blocks, destinations fresh ones), so the copies are order
independent. Padded pairs are ``(0, 0)``: the null block onto itself, a no-op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._common import check_pool, describe, is_power_of_2


def _kernel(pairs_ref, k_in_ref, v_in_ref, k_ref, v_ref):
    del k_in_ref, v_in_ref  # aliased with k_ref / v_ref
    pair = pl.program_id(0)
    layer = pl.program_id(1)
    kv_head = pl.program_id(2)
    src = pairs_ref[pair, 0]
    dst = pairs_ref[pair, 1]
    k_ref[layer, dst, :, kv_head, :] = k_ref[layer, src, :, kv_head, :]
    v_ref[layer, dst, :, kv_head, :] = v_ref[layer, src, :, kv_head, :]


def _validate(k_cache, v_cache, pairs):
    what = "copy_blocks"
    if k_cache.ndim == 4:
        check_pool(k_cache, v_cache, None, what=what)
    else:
        check_pool(k_cache, v_cache, 0, what=what)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype != jnp.int32:
        raise ValueError(
            f"{what}: pairs must be i32[num_pairs, 2] (src, dst); got pairs {describe(pairs)} "
            f"for k_cache {describe(k_cache)}"
        )
    block_size, _, head_dim = k_cache.shape[-3:]
    if not (is_power_of_2(block_size) and is_power_of_2(head_dim)):
        raise ValueError(
            f"{what}: block_size and head_dim must be powers of two (Triton tiles); got "
            f"k_cache {describe(k_cache)}"
        )


@functools.partial(jax.jit, static_argnames=("interpret",))
def copy_blocks(
    k_cache: jax.Array,
    v_cache: jax.Array,
    pairs: jax.Array,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Copies block ``src`` to block ``dst`` for every ``(src, dst)`` in ``pairs``, all layers.

    Args:
      k_cache: ``f[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (or one layer,
        ``f[num_blocks, block_size, num_kv_heads, head_dim]``).
      v_cache: same shape and dtype as ``k_cache``.
      pairs: ``i32[num_pairs, 2]``, rows ``(src, dst)`` of block ids in ``[0, num_blocks)``;
        padding rows are ``(0, 0)``. Destinations distinct, and none is also a source.
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.

    Returns:
      ``(k_cache, v_cache)``, the updated pools (the input buffers when they are donated; this
      wrapper does not donate: call it inside a jit that donates the pool).
    """
    _validate(k_cache, v_cache, pairs)
    single_layer = k_cache.ndim == 4
    k5 = k_cache[None] if single_layer else k_cache
    v5 = v_cache[None] if single_layer else v_cache
    num_pairs = pairs.shape[0]
    if num_pairs == 0:
        return k_cache, v_cache
    num_layers, _, _, num_kv_heads, _ = k5.shape
    whole = _compat.WHOLE_ARRAY
    k5, v5 = pl.pallas_call(
        _kernel,
        grid=(num_pairs, num_layers, num_kv_heads),
        in_specs=[whole, whole, whole],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k5.shape, k5.dtype), jax.ShapeDtypeStruct(v5.shape, v5.dtype)],
        input_output_aliases={1: 0, 2: 1},
        compiler_params=_compat.compiler_params(num_warps=2, num_stages=1),
        interpret=interpret,
        name="copy_blocks",
    )(pairs, k5, v5)
    if single_layer:
        return k5[0], v5[0]
    return k5, v5


@jax.jit
def copy_blocks_reference(
    k_cache: jax.Array, v_cache: jax.Array, pairs: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Plain-``jnp`` :func:`copy_blocks`: read every source, then write every destination."""
    _validate(k_cache, v_cache, pairs)
    src, dst = pairs[:, 0], pairs[:, 1]
    axis_blocks = k_cache.ndim - 4  # 0 for one layer, 1 for a stacked pool
    if axis_blocks == 0:
        return k_cache.at[dst].set(k_cache[src]), v_cache.at[dst].set(v_cache[src])
    return k_cache.at[:, dst].set(k_cache[:, src]), v_cache.at[:, dst].set(v_cache[:, src])
