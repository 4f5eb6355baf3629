"""The paged KV cache: one block pool per K and V, threaded through the jitted steps as a pytree.

Layout (the Pallas kernels and the XLA path agree on it):
  k, v: dtype[num_layers, num_blocks, block_size, num_kv_heads, head_dim]

Token `position` of a sequence lives at slot `block_table[position // block_size] * block_size
+ position % block_size`. Block 0 is the null block: padded block-table entries and padded
tokens' slots point into it, so an out-of-range index can never read or clobber a live block
(JAX clips out-of-bounds indices instead of failing). Nothing may read the null block unmasked.

The pool is large. Step functions take it donated and update it in place; nothing slices a layer
out of it (a slice is a copy).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jpaged.device.config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @classmethod
    def create(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32) -> "KVCache":
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def bytes_per_block(config: ModelConfig, block_size: int, dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def num_blocks_for_memory(config: ModelConfig, block_size: int, dtype, memory_bytes: int) -> int:
    """How many blocks (the null block included) fit in `memory_bytes` of KV cache."""
    return int(memory_bytes // bytes_per_block(config, block_size, dtype))


def parse_memory_size(text: str | int | float) -> int:
    """'512MiB', '2GiB', '1.5GB', '1e9' or a number of bytes -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
             "gib": 2**30, "k": 2**10, "m": 2**20, "g": 2**30}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgib")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not value > 0:
        raise ValueError(f"cannot read memory size {text!r}: write e.g. '512MiB', '2GiB' or a number of bytes")
    return int(value * units[unit])
