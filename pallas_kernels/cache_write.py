"""Fused reshape-and-block-write (PagedAttention section 5.1): new K/V into their pool slots.

The step's new keys and values, ``[num_tokens, num_kv_heads, head_dim]``, go into the pool
``kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` (each block's K at
index 0 of the K/V axis, its V at index 1) at ``slot = block_id * block_size + offset``: K to
``kv_cache[layer, block_id, 0, offset]``, V to ``kv_cache[layer, block_id, 1, offset]``. One
launch writes K and V of every token; the pool is an aliased input/output
(``input_output_aliases``), so inside a jit whose pool argument is donated nothing is copied:
only the written slots change.

Kernel design (Triton-style Pallas): one program per ``(token, kv_head)`` moves one
``[head_dim]`` row of K and one of V (``num_kv_heads`` need not be a power of two: the row is
the tile). Padded tokens carry slots in the null block 0 (the engine never reads it as data);
a negative slot is not a padding marker and must not be passed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._common import check_pool, describe, is_power_of_2, stacked


def _kernel(
    layer_ref,  # i32[1]
    slot_mapping_ref,  # i32[num_tokens]
    k_ref,  # [head_dim] (this token and KV head)
    v_ref,  # [head_dim]
    kv_cache_in_ref,  # aliased with kv_cache_ref; unused
    kv_cache_ref,  # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim] (whole pool)
):
    del kv_cache_in_ref
    token = pl.program_id(0)
    kv_head = pl.program_id(1)
    block_size = kv_cache_ref.shape[3]
    layer = layer_ref[0]
    slot = slot_mapping_ref[token]
    block_id = slot // block_size
    offset = slot % block_size
    kv_cache_ref[layer, block_id, 0, offset, kv_head, :] = k_ref[...].astype(kv_cache_ref.dtype)
    kv_cache_ref[layer, block_id, 1, offset, kv_head, :] = v_ref[...].astype(kv_cache_ref.dtype)


def _validate(kv_cache, k, v, slot_mapping, layer):
    what = "write_kv"
    check_pool(kv_cache, layer, what=what)
    kv_shape = kv_cache.shape[-2:]
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"{what}: k {describe(k)} and v {describe(v)} must match")
    if k.ndim != 3 or k.shape[1:] != kv_shape:
        raise ValueError(
            f"{what}: k must be [num_tokens, num_kv_heads, head_dim] matching the pool; got k "
            f"{describe(k)} and kv_cache {describe(kv_cache)}"
        )
    if not jnp.issubdtype(k.dtype, jnp.floating):
        raise ValueError(f"{what}: k {describe(k)} must be floating point")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(
            f"{what}: slot_mapping must be i32[num_tokens]; got slot_mapping "
            f"{describe(slot_mapping)} and k {describe(k)}"
        )
    if not is_power_of_2(k.shape[-1]):
        raise ValueError(f"{what}: head_dim must be a power of two (Triton tiles); got k {describe(k)}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Writes ``k[t]`` and ``v[t]`` into slot ``slot_mapping[t]`` of the pool, in place.

    Args:
      kv_cache: the K/V pool, ``f[num_layers, num_blocks, 2, block_size, num_kv_heads,
        head_dim]`` with ``layer``, or ``f[num_blocks, 2, block_size, num_kv_heads, head_dim]``
        without: ``kv_cache[..., b, 0, :, :, :]`` is block ``b``'s K, ``kv_cache[..., b, 1, :, :,
        :]`` its V.
      k: ``f[num_tokens, num_kv_heads, head_dim]``; cast to the pool's dtype when written.
      v: same shape and dtype as ``k``.
      slot_mapping: ``i32[num_tokens]``, ``block_id * block_size + offset`` in
        ``[0, num_blocks * block_size)``. Padded tokens use slots of the null block 0. Two real
        tokens must not share a slot (which one wins is unspecified).
      layer: ``i32[]`` (may be traced): the layer of a stacked pool. Not bounds-checked.
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.

    Returns:
      ``kv_cache``, the updated pool (the input buffer when it is donated). This wrapper does
      not donate; call it inside a jit that donates the pool (or
      ``jax.jit(write_kv, donate_argnums=0)``) to write in place.
    """
    _validate(kv_cache, k, v, slot_mapping, layer)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return kv_cache
    kv6, layer_arr = stacked(kv_cache, layer)
    whole = _compat.WHOLE_ARRAY
    row = pl.BlockSpec((None, None, head_dim), lambda t, h: (t, h, 0))
    kv6 = pl.pallas_call(
        _kernel,
        grid=(num_tokens, num_kv_heads),
        in_specs=[whole, whole, row, row, whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(kv6.shape, kv6.dtype),
        input_output_aliases={4: 0},
        compiler_params=_compat.compiler_params(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(layer_arr, slot_mapping, k, v, kv6)
    return kv6[0] if layer is None else kv6


@jax.jit
def write_kv_reference(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Plain-``jnp`` :func:`write_kv`: a scatter to ``[(layer,) block, 0 or 1, offset]``."""
    _validate(kv_cache, k, v, slot_mapping, layer)
    block_size = kv_cache.shape[-3]
    block_id, offset = slot_mapping // block_size, slot_mapping % block_size
    lead = () if layer is None else (layer,)
    k_at = (*lead, block_id, 0, offset)  # each -> [num_tokens, num_kv_heads, head_dim]
    v_at = (*lead, block_id, 1, offset)
    kv_cache = kv_cache.at[k_at].set(k.astype(kv_cache.dtype))
    return kv_cache.at[v_at].set(v.astype(kv_cache.dtype))
