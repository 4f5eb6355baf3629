"""Small helpers shared by the kernels: shape descriptions and pool-layout checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_SHORT_DTYPE = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "float64": "f64",
    "int32": "i32",
    "int64": "i64",
    "uint32": "u32",
}


def describe(x) -> str:
    """``f32[2,16,4,64]``-style description of an array (or anything with shape and dtype)."""
    dtype = np.dtype(x.dtype).name
    return f"{_SHORT_DTYPE.get(dtype, dtype)}[{','.join(str(d) for d in x.shape)}]"


def is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check_pool(kv_cache, layer, *, what: str) -> None:
    """Checks the pool's layout against ``layer``.

    The pool is one array holding each block's K and then its V:
    ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` (with ``layer``) or
    ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (``layer=None``); axis -4 is the
    K/V axis (``0``: K, ``1``: V).
    """
    if layer is None:
        if kv_cache.ndim != 5:
            raise ValueError(
                f"{what}: with layer=None the pool must be "
                "[num_blocks, 2, block_size, num_kv_heads, head_dim]; got kv_cache "
                f"{describe(kv_cache)} (pass layer= for a stacked "
                "[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim] pool)"
            )
    else:
        if kv_cache.ndim != 6:
            raise ValueError(
                f"{what}: with layer= the pool must be stacked "
                "[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]; got kv_cache "
                f"{describe(kv_cache)}"
            )
        if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
            raise ValueError(f"{what}: layer must be an integer scalar; got {layer!r}")
    if kv_cache.shape[-4] != 2:
        raise ValueError(
            f"{what}: axis -4 of the pool is the K/V axis and must have size 2 "
            "([..., num_blocks, 2, block_size, num_kv_heads, head_dim], K then V); got kv_cache "
            f"{describe(kv_cache)}"
        )
    if not jnp.issubdtype(kv_cache.dtype, jnp.floating):
        raise ValueError(f"{what}: kv_cache {describe(kv_cache)} must be floating point")


def stacked(cache, layer):
    """The pool as ``[num_layers, ...]`` plus the layer as ``i32[1]``.

    A one-layer pool gets a unit leading axis (a reshape, which XLA treats as a bitcast: no copy).
    """
    if layer is None:
        return cache[None], jnp.zeros((1,), jnp.int32)
    return cache, jnp.asarray(layer, jnp.int32).reshape(1)
