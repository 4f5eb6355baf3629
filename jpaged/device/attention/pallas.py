"""The Pallas attention backend: the kernels of `pallas_kernels` behind the attention seam.

Attention reads K/V through the block tables inside the kernels, in both step kinds (it never
reads the XLA path's attention plan):
- a decode step (one query token per row, N == B) runs the decode kernel
  (`pallas_kernels.paged_attention`, split-K over long contexts);
- every other step, a ragged batch of decode rows, prefill chunks over cached context and whole
  prompts packed end to end, runs the ragged kernel (`pallas_kernels.ragged_paged_attention`):
  the rows' offsets `cu_q_lens` come from `ModelInputs.logits_index` (row b's new tokens end at
  logits_index[b]; a real row has context_lens > 0), the rows' context lengths and block tables
  are `context_lens` and `block_tables`.
The cache write and the copy-on-write block copy run their fused kernels. `interpret=True` runs
the kernels in the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pallas_kernels


def cu_q_lens(inputs) -> jax.Array:
    """i32[B + 1]: row b's new tokens are the packed tokens cu_q_lens[b] .. cu_q_lens[b + 1] - 1.
    Rows are packed end to end, real rows first, and each ends at its `logits_index`; padding rows
    (context_lens 0) have none."""
    q_end = jnp.where(inputs.context_lens > 0, inputs.logits_index + 1, 0)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jax.lax.cummax(q_end.astype(jnp.int32))])


def is_decode_step(q, inputs) -> bool:
    """Whether a step is decode-only (static): one token per row (N == B) and packed as a decode
    step (query tiles of one token; the plan is packed at one entry but keeps its tile width)."""
    return q.shape[0] == inputs.block_tables.shape[0] and inputs.plan.q_index.shape[1] == 1


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
        the kernels, so one compilation serves every layer's W); `softcap`: None or a static float."""
        softcap = None if softcap is None else float(softcap)
        if is_decode_step(q, inputs):  # packed token b is row b's one new token
            return pallas_kernels.paged_attention(q, pool, inputs.block_tables, inputs.context_lens,
                                                  scale=float(scale), layer=layer, window=window,
                                                  softcap=softcap, interpret=self.interpret)
        return pallas_kernels.ragged_paged_attention(q, pool, cu_q_lens(inputs), inputs.context_lens,
                                                     inputs.block_tables, scale=float(scale), layer=layer,
                                                     window=window, softcap=softcap, interpret=self.interpret)

    def write_and_attend(self, q, k, v, pool, layer, inputs, scale, *, window=None, softcap=None):
        pool = self.write_kv(pool, layer, k, v, inputs.slot_mapping)
        return pool, self.attend(q, pool, layer, inputs, scale, window=window, softcap=softcap)

    def copy_blocks(self, pool, pairs):
        return pallas_kernels.copy_blocks(pool, pairs, interpret=self.interpret)
