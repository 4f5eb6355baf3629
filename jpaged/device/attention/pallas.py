"""The Pallas attention backend: the kernels of `pallas_kernels` behind the attention seam.

Decode (one query token per sequence) runs the paged-attention kernel, which reads K/V through
the block table inside the kernel; the cache write and the copy-on-write block copy run their
fused kernels. Prefill (several query tokens per sequence) keeps the XLA path (`xla_attend` over
the attention plan): the paper's kernels are decode kernels. `interpret=True` runs the kernels in
the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pallas_kernels

from jpaged.device.attention.xla import xla_attend


@dataclasses.dataclass(frozen=True)
class PallasBackend:
    interpret: bool = False
    name: str = "pallas"

    def storage_dtype(self, dtype):
        return jnp.dtype(dtype)  # the kernels read bfloat16 pools natively

    def write_kv(self, pool, layer, k, v, slot_mapping):
        return pallas_kernels.write_kv(pool, k, v, slot_mapping, layer=layer, interpret=self.interpret)

    def attend(self, q, pool, layer, inputs, scale, *, window=None, softcap=None):
        """`window`: None or a traced i32[] W (the query at p sees keys p - W < k <= p; an operand of
        the kernel, so one compilation serves every layer's W); `softcap`: None or a static float."""
        if inputs.plan.q_index.shape[1] != 1:  # query tiles of more than one token: a prefill step
            return xla_attend(q, pool, layer, inputs.plan, scale, window=window, softcap=softcap)
        # decode: packed token b is row b's one new token (N == B)
        return pallas_kernels.paged_attention(q, pool, inputs.block_tables, inputs.context_lens,
                                              scale=float(scale), layer=layer, window=window,
                                              softcap=None if softcap is None else float(softcap),
                                              interpret=self.interpret)

    def copy_blocks(self, pool, pairs):
        return pallas_kernels.copy_blocks(pool, pairs, interpret=self.interpret)
