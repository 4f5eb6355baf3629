"""The Pallas attention backend: the kernels of `pallas_kernels` behind the attention seam.

Decode (one query token per sequence) runs the paged-attention kernel, which reads K/V through
the block table inside the kernel; the cache write and the copy-on-write block copy run their
fused kernels. Prefill (several query tokens per sequence) keeps the XLA path: the paper's kernels
are decode kernels. `interpret=True` runs the kernels in the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import dataclasses

import pallas_kernels

from jpaged.attention import xla_attend


@dataclasses.dataclass(frozen=True)
class PallasBackend:
    interpret: bool = False
    name: str = "pallas"

    def write_kv(self, k_pool, v_pool, layer, k, v, slot_mapping):
        return pallas_kernels.write_kv(k_pool, v_pool, k, v, slot_mapping, layer=layer, interpret=self.interpret)

    def attend(self, q, k_pool, v_pool, layer, block_tables, context_lens, positions, scale):
        if q.shape[1] != 1:
            return xla_attend(q, k_pool, v_pool, layer, block_tables, context_lens, positions, scale)
        out = pallas_kernels.paged_attention(q[:, 0], k_pool, v_pool, block_tables, context_lens,
                                             scale=float(scale), layer=layer, interpret=self.interpret)
        return out[:, None]

    def copy_blocks(self, k_pool, v_pool, pairs):
        return pallas_kernels.copy_blocks(k_pool, v_pool, pairs, interpret=self.interpret)
