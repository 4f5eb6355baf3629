"""Fused block copy (PagedAttention section 5.1): all copy-on-write copies of a step, one launch.

Copy-on-write copies whole blocks, ``src -> dst``, K and V, in every layer of the pool
``kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``. A block's K and V
are side by side (``kv_cache[layer, b]`` is ``[2, block_size, num_kv_heads, head_dim]``, K then
V, contiguous), so one copy of ``kv_cache[layer, src]`` moves both. Launching one copy per block
(and per layer) would be dominated by launch overhead; this kernel does the step's copies for
all layers in one ``pallas_call``, in place (the pool is an aliased input/output).

Kernel design (Triton-style Pallas): one program per ``(pair, layer, kv_head)`` moves a
``[2, block_size, head_dim]`` tile, the head's K and V (``num_kv_heads`` need not be a power of
two).

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


def _kernel(pairs_ref, kv_in_ref, kv_ref):
    del kv_in_ref  # aliased with kv_ref
    pair = pl.program_id(0)
    layer = pl.program_id(1)
    kv_head = pl.program_id(2)
    src = pairs_ref[pair, 0]
    dst = pairs_ref[pair, 1]
    # [2, block_size, head_dim]: this head's K and V.
    kv_ref[layer, dst, :, :, kv_head, :] = kv_ref[layer, src, :, :, kv_head, :]


def _validate(kv_cache, pairs):
    what = "copy_blocks"
    check_pool(kv_cache, None if kv_cache.ndim == 5 else 0, what=what)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype != jnp.int32:
        raise ValueError(
            f"{what}: pairs must be i32[num_pairs, 2] (src, dst); got pairs {describe(pairs)} "
            f"for kv_cache {describe(kv_cache)}"
        )
    block_size, _, head_dim = kv_cache.shape[-3:]
    if not (is_power_of_2(block_size) and is_power_of_2(head_dim)):
        raise ValueError(
            f"{what}: block_size and head_dim must be powers of two (Triton tiles); got "
            f"kv_cache {describe(kv_cache)}"
        )


@functools.partial(jax.jit, static_argnames=("interpret",))
def copy_blocks(kv_cache: jax.Array, pairs: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Copies block ``src`` to block ``dst``, K and V, all layers, for every row of ``pairs``.

    Args:
      kv_cache: the K/V pool, ``f[num_layers, num_blocks, 2, block_size, num_kv_heads,
        head_dim]`` (or one layer, ``f[num_blocks, 2, block_size, num_kv_heads, head_dim]``):
        ``kv_cache[..., b, 0, :, :, :]`` is block ``b``'s K, ``kv_cache[..., b, 1, :, :, :]`` its
        V.
      pairs: ``i32[num_pairs, 2]``, rows ``(src, dst)`` of block ids in ``[0, num_blocks)``;
        padding rows are ``(0, 0)``. Destinations distinct, and none is also a source.
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.

    Returns:
      ``kv_cache``, the updated pool (the input buffer when it is donated; this wrapper does not
      donate: call it inside a jit that donates the pool).
    """
    _validate(kv_cache, pairs)
    num_pairs = pairs.shape[0]
    if num_pairs == 0:
        return kv_cache
    single_layer = kv_cache.ndim == 5
    kv6 = kv_cache[None] if single_layer else kv_cache
    num_layers, _, _, _, num_kv_heads, _ = kv6.shape
    whole = _compat.WHOLE_ARRAY
    kv6 = pl.pallas_call(
        _kernel,
        grid=(num_pairs, num_layers, num_kv_heads),
        in_specs=[whole, whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(kv6.shape, kv6.dtype),
        input_output_aliases={1: 0},
        compiler_params=_compat.compiler_params(num_warps=2, num_stages=1),
        interpret=interpret,
        name="copy_blocks",
    )(pairs, kv6)
    return kv6[0] if single_layer else kv6


@jax.jit
def copy_blocks_reference(kv_cache: jax.Array, pairs: jax.Array) -> jax.Array:
    """Plain-``jnp`` :func:`copy_blocks`: read every source, then write every destination."""
    _validate(kv_cache, pairs)
    src, dst = pairs[:, 0], pairs[:, 1]
    if kv_cache.ndim == 5:  # one layer: blocks on axis 0
        return kv_cache.at[dst].set(kv_cache[src])
    return kv_cache.at[:, dst].set(kv_cache[:, src])
