"""The attention seam: how the model writes new K/V into the paged pool and reads it back.

A backend (`AttentionBackend`) is static configuration (frozen, hashable) with three operations on
the stacked pool `kv f[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]` (a block's K
at index 0 of axis 2, its V at 1: `jpaged.device.kv_cache`) and a traced `layer` index (a layer is
never sliced out of the pool: a slice is a copy):

  write_kv(pool, layer, k, v, slot_mapping)                         -> pool
  attend(q, pool, layer, inputs, scale, *, window=None, softcap=None) -> out
  write_and_attend(q, k, v, pool, layer, inputs, scale, *, window=None, softcap=None) -> (pool, out)
  copy_blocks(pool, pairs)                                           -> pool

`write_and_attend` is what a model layer calls: `write_kv` of the step's new tokens (their slots are
`inputs.slot_mapping`), then `attend` over the pool that holds them; a backend may do both in one
operation (the native one does: one call instead of XLA's scatters and the attention).

A backend also says how it stores a pool of a given dtype (`storage_dtype`). The pool's dtype
may be narrower than the compute dtype (`q`'s): a 16-bit pool under float32 compute on a CPU.

Query layout: `q f[N, num_heads, head_dim]`, the packed new tokens of a
`jpaged.device.batch.ModelInputs`; the token at absolute position p of a row may attend to every
cached position <= p of that row. This one rule covers decode (one token per row), prefill and
prefill on top of cached context (prefix caching, recompute). Every backend computes exact softmax
attention; only the storage layout is paged.

Attention options (every backend honours both; with None, no code for them is compiled):
  window   None, or a traced i32[] W >= 1 (it rides in the layer scan: Gemma's layers differ):
           the query at position p sees only the keys at p - W < k <= p (HF's sliding window:
           W keys, its own included). A full layer of a model whose other layers are windowed
           passes `xla.FULL_WINDOW`. Block-table entries wholly before a row's
           window may be the null block (the block manager frees them): never read them.
  softcap  None, or a static float c: scores s (already scaled) become c * tanh(s / c) before the
           mask and the softmax (Gemma 2).

Backends: `native` (`NativeBackend`: a C++ kernel through XLA's FFI that reads blocks in place, the
CPU fast path where it was built), `xla` (`XLABackend`: plain XLA ops, on any device) and `pallas`
(`PallasBackend`: the kernels of `pallas_kernels`, compiled on a GPU, `interpret=True` on a CPU for
tests).
"""

from __future__ import annotations

import logging
from typing import Protocol

import jax

from jpaged.device.attention import native
from jpaged.device.attention.xla import XLABackend

BACKENDS = ("auto", "native", "pallas", "xla")
logger = logging.getLogger("jpaged")


class AttentionBackend(Protocol):
    """See the module docstring. `name` is the backend's name in `BACKENDS`."""

    name: str

    def storage_dtype(self, dtype):
        """The dtype a KV pool of `dtype` is stored in (the same, or a backend's own encoding of it)."""

    def write_kv(self, pool, layer, k, v, slot_mapping): ...

    def attend(self, q, pool, layer, inputs, scale, *, window=None, softcap=None): ...

    def write_and_attend(self, q, k, v, pool, layer, inputs, scale, *, window=None, softcap=None): ...

    def copy_blocks(self, pool, pairs): ...


def get_backend(name: str = "auto", *, interpret: bool = False) -> AttentionBackend:
    """'auto' picks the Pallas kernels on a GPU, the native kernel on a CPU where it was built, and the
    XLA path elsewhere (saying so in one logged line on a CPU without the native kernel)."""
    if name == "auto":
        if jax.default_backend() == "gpu":
            name = "pallas"
        elif jax.default_backend() == "cpu" and native.available_variants():
            name = "native"
        else:
            if jax.default_backend() == "cpu":
                logger.warning("the native CPU attention kernels were not built (no C++ compiler when jpaged was "
                               "installed?): attention runs on the slower XLA path")
            name = "xla"
    if name == "xla":
        return XLABackend()
    if name == "native":
        if jax.default_backend() != "cpu":
            raise ValueError(f"the native attention kernels run on a CPU, and this machine runs JAX on "
                             f"{jax.default_backend()!r}: use attention_backend='auto', 'pallas' or 'xla' here")
        try:
            return native.NativeBackend()
        except native.NativeUnavailable as error:
            raise ValueError(str(error)) from None
    if name == "pallas":
        if not interpret and jax.default_backend() != "gpu":
            raise ValueError(f"the Pallas kernels compile for a GPU only, and this machine runs JAX on "
                             f"{jax.default_backend()!r}: use attention_backend='auto' or 'xla' here (the CLI's "
                             "--attention-backend), or interpret=True (--interpret), which runs the kernels in the "
                             "slow Pallas interpreter, for tests")
        from jpaged.device.attention.pallas import PallasBackend

        return PallasBackend(interpret=interpret)
    raise ValueError(f"attention_backend must be one of {', '.join(map(repr, BACKENDS))}, not {name!r}")
