"""Pallas kernels for PagedAttention (Kwon et al., SOSP 2023, section 5.1), with references.

The three fused kernels of the paper and a ragged generalisation of the first, each beside a
plain-``jnp`` reference and behind a jitted wrapper that validates shapes once and takes
``interpret: bool`` (run the Pallas interpreter on a CPU instead of compiling for a GPU):

* :func:`paged_attention` (:mod:`pallas_kernels.paged_attention`): decode attention that reads
  K/V block by block through the block table inside the kernel; GQA groups share each K/V
  load; exact online softmax masked by context length; optional split-K with a
  log-sum-exp merge; optional sliding window (a traced per-layer W: the loop starts at the
  window's first block) and logit soft-capping.
* :func:`ragged_paged_attention` (:mod:`pallas_kernels.ragged_paged_attention`): causal attention
  of a ragged batch (decode rows, prefill chunks over cached context and whole prompts, packed
  end to end and described by ``cu_q_lens``, ``kv_lens`` and ``page_indices``) in one launch:
  query tiles of each row's tokens, GQA groups together, a key loop over the blocks each tile
  needs, the same window / soft-cap options as the decode kernel.
* :func:`write_kv` (:mod:`pallas_kernels.cache_write`): fused reshape-and-block-write of a
  step's new K/V into their slots, in place.
* :func:`copy_blocks` (:mod:`pallas_kernels.block_copy`): every copy-on-write block copy of a
  step, all layers, K and V, in one launch, in place.

KV pool layout (shared with the engine): one array, ``kv_cache: f[num_layers, num_blocks, 2,
block_size, num_kv_heads, head_dim]`` (or one layer, ``f[num_blocks, 2, block_size,
num_kv_heads, head_dim]``), where ``kv_cache[..., b, 0, :, :, :]`` is block ``b``'s K and
``kv_cache[..., b, 1, :, :, :]`` its V: each (layer, block) holds its K and then its V
contiguously, so a block is one run of memory (as in FlashInfer's paged layout).
``slot = block_id * block_size + offset``; block 0 is the null block that padded block-table
entries and padded tokens' slots point into. Kernels take the stacked pool and a (traced)
``layer`` index: slicing a layer out of the pool would copy it.

Backend choice: the kernels are Triton-style Pallas (``pallas_call`` with a grid, whole-pool
refs indexed dynamically through the block table inside the kernel, Triton compiler params).
Reasons: on jax 0.10.2 (Python 3.11, the CPU machines) only such kernels run in interpret mode
on a CPU - Mosaic GPU has no CPU interpreter there and its TMA copies fail under
``interpret=True`` - so this is the only backend whose kernels are tested where the project is
developed; and the same code compiles on jax 0.11.2 (Python 3.12, the GPU machines), where the
Triton lowering still works though it is deprecated (from 0.11) in favour of Mosaic GPU, its
successor. A Mosaic GPU port is the way forward once the project can test it (the decode
kernel's docstring gives the trade-off as of issue 31: the Triton pipeliner already overlaps the
paged K/V copies with the compute once block ids are read before the loop). The code uses only
APIs present in both releases; version differences are guarded in :mod:`pallas_kernels._compat`
(``pl.load``/``pl.store`` are not used: refs are indexed).

On a CPU, interpret mode is for correctness only; the engine's CPU fast path is an XLA gather
implementation of the same attention.
"""

from pallas_kernels.block_copy import copy_blocks, copy_blocks_reference
from pallas_kernels.cache_write import write_kv, write_kv_reference
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

__all__ = [
    "copy_blocks",
    "copy_blocks_reference",
    "paged_attention",
    "paged_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
