"""The native attention backend: paged attention as a C++ kernel called through XLA's FFI, the
CPU fast path.

On the CPU the XLA path (`xla.py`) gathers every key tile into a new buffer before its small
matmuls; the native kernel (`csrc/paged_attention.cc`) reads K/V blocks in place through the block
tables, with an online softmax per chunk of up to 16 query tokens of a row, on XLA's own intra-op
threads. It serves decode and prefill (several query tokens per row, causal within the row) with
the same code. Pools of float32, float16 and bfloat16 (stored as uint16 bit patterns, as the XLA
backend stores them) are read natively and widened to float32; compute is float32. A sliding
window (a traced int32 operand, `FULL_WINDOW` when there is none) starts each row's reads at its
first token's window, so that the block table entries before it are never looked up; logit
soft-capping is a static attribute (0: none).

Builds. `pip install` compiles the kernel three times (setup.py): `avx512`, `avx2` (with FMA and
F16C) and `portable` (the compiler's baseline), each a shared library beside this module. At run
time the portable library says which of the others this CPU can run (`available_variants`), and
the best is registered with `jax.ffi.register_ffi_target` (or the best up to the one the environment's
JPAGED_NATIVE_VARIANT names). A machine without a compiler installs without them; `get_backend('auto')`
then falls back to the XLA path and logs one line saying so.

The same libraries hold the few-row weight matmuls (`csrc/int8_matmul.cc`: `int8_matmul_target` for int8
weights with scales, and `float_rows_matmul_target` for float rows: bfloat16, float16 or float32 weights
without scales; each takes up to 4 weights of the same activations in one call), which `jpaged.device.quant` calls for few-row products of
int8, bfloat16 and float32 parameters; on a CPU with AMX-BF16 the AVX-512 library runs bfloat16 products
on AMX tiles (`amx_bf16`), and on one with AVX512-BF16 alone on VDPBF16PS (`avx512_bf16`).

In the model's layers the cache write is the same native call as the attention (`native_write_and_attend`:
a plain copy of each new token's K/V into its slot, then the attention, the pool updated in place), where
XLA's two scatters and their index computations were 6 small operations a layer (the default model's
bfloat16 decode step: 636 -> 456 fusions; one row, one process alternating the two, AMD EPYC: 9.38 against
9.48 ms a step, int8 4.78 against 4.84, float32 even). `write_kv` alone and the copy-on-write copies stay
XLA's (`xla_write_kv`, `xla_copy_blocks`): scatters XLA does in place.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.machinery
import os

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.device.attention.xla import FULL_WINDOW, storage_dtype, to_pool, xla_copy_blocks, xla_write_kv

VARIANTS = ("avx512", "avx2", "portable")  # best first
VARIANT_ENV = "JPAGED_NATIVE_VARIANT"  # the best variant to use, where set (`available_variants`)
_HANDLER = "JpagedPagedAttention"
_WRITE_HANDLER = "JpagedPagedAttentionWrite"  # the cache write, then the attention
_INT8_HANDLER = "JpagedInt8Matmul"  # csrc/int8_matmul.cc
_FLOAT_ROWS_HANDLER = "JpagedFloatRowsMatmul"  # csrc/int8_matmul.cc: bfloat16, float16 or float32 rows
_TARGETS = {_HANDLER: "paged_attention", _WRITE_HANDLER: "paged_attention_write", _INT8_HANDLER: "int8_matmul",
            _FLOAT_ROWS_HANDLER: "float_rows_matmul"}


def library_path(variant: str) -> str | None:
    """Where the built library of `variant` is, or None when it was not built."""
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, f"_native_{variant}{suffix}")
        if os.path.exists(path):
            return path
    return None


@functools.cache
def _library(variant: str) -> ctypes.CDLL:
    path = library_path(variant)
    if path is None:
        raise NativeUnavailable(f"the native CPU kernels' {variant} library was not built")
    return ctypes.CDLL(path)


class NativeUnavailable(RuntimeError):
    """The native kernels cannot run here: not built (no C++ compiler at install), or not this CPU's."""


@functools.cache
def available_variants() -> tuple[str, ...]:
    """The variants built and runnable on this CPU, best first (empty when none was built); none better than
    `VARIANT_ENV` names where it is set (to run a CPU's lesser code paths, as a benchmark of an AVX2-only
    machine on an AVX-512 one does; XLA's own are capped by XLA_FLAGS=--xla_cpu_max_isa)."""
    best = os.environ.get(VARIANT_ENV) or VARIANTS[0]
    if best not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={best!r} is no native variant: set it to one of {', '.join(VARIANTS)} "
                         "(or unset it for the best this CPU runs)")
    try:
        portable = _library("portable")
    except (NativeUnavailable, OSError):
        return ()
    can_run = portable.JpagedCpuCanRun
    can_run.argtypes, can_run.restype = [ctypes.c_char_p], ctypes.c_int
    return tuple(v for v in VARIANTS[VARIANTS.index(best):] if library_path(v) is not None and can_run(v.encode()))


@functools.cache
def target_name(variant: str = "auto", handler: str = _HANDLER) -> str:
    """Registers `variant`'s `handler` with XLA (once) and returns its FFI target name.
    'auto': the best of `available_variants()`."""
    variants = available_variants()
    if not variants:
        raise NativeUnavailable(
            "the native CPU attention kernels were not built (no C++ compiler when jpaged was installed?): "
            "install g++ and reinstall jpaged, or use attention_backend='xla'")
    if variant == "auto":
        variant = variants[0]
    if variant not in variants:
        raise NativeUnavailable(f"native variant {variant!r} is not available on this machine (built and "
                                f"runnable here: {', '.join(variants)})")
    name = f"jpaged_{_TARGETS[handler]}_{variant}"
    try:
        function = getattr(_library(variant), handler)
    except AttributeError:  # a library built before this handler existed
        raise NativeUnavailable(f"the native {variant} library has no {handler}: rebuild it "
                                "(python setup.py build_ext --inplace)") from None
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(function), platform="cpu")
    return name


def int8_matmul_target(variant: str = "auto") -> str:
    """The FFI target of the int8 weight matmul (operands x, layer, then 1 to 4 weights as values and scales,
    one result each; `csrc/int8_matmul.cc`, in the same libraries; used by `jpaged.device.quant`),
    registered once."""
    return target_name(variant, _INT8_HANDLER)


def float_rows_matmul_target(variant: str = "auto") -> str:
    """The FFI target of the float-rows weight matmul (bfloat16 bits, float16 or float32 values, no scales;
    operands x, layer, then 1 to 4 weights, one result each; `csrc/int8_matmul.cc`, used by
    `jpaged.device.quant`), registered once."""
    return target_name(variant, _FLOAT_ROWS_HANDLER)


@functools.cache
def amx_bf16(variant: str = "auto") -> bool:
    """Whether `variant`'s 16-bit weight matmul runs bfloat16 weights on AMX tiles: the
    AVX-512 library, on a CPU with AMX-BF16 whose OS grants this process the tile state. False where
    the native kernels cannot run."""
    return _library_says(variant, "JpagedAmxBf16")


@functools.cache
def avx512_bf16(variant: str = "auto") -> bool:
    """Whether `variant`'s 16-bit weight matmul runs bfloat16 weights on AVX512-BF16's VDPBF16PS (pairs of
    bfloat16 products summed in float32, the weights never widened): the AVX-512 library, on a CPU with
    AVX512-BF16 where the AMX tiles do not take them. False where the native kernels cannot run."""
    return _library_says(variant, "JpagedAvx512Bf16")


@functools.cache
def int8_solo_max_rows(variant: str = "auto") -> int:
    """The most rows of an int8 product that `variant`'s library runs on the calling thread alone, without
    its helper threads (`Crew`, `csrc/work_list.h`), on this CPU: 2, or 0 where one thread's arithmetic
    cannot keep up with the memory (AMD Zen 4, which splits each 512-bit operation in two, and every build
    without AVX-512, whose registers widen half as many weights: `csrc/int8_matmul.cc`). 0 where the native
    kernels cannot run."""
    return _library_says(variant, "JpagedInt8SoloMaxRows", int)


@functools.cache
def reads_channel_at_a_time(variant: str = "auto") -> bool:
    """Whether `variant`'s library reads the float32 and bfloat16 weights of a one-row product (and the float32
    weights of a product of up to 8 rows, in one pass) one output channel at a time, each channel's weights one
    sequential stream, rather than 4 to 8 channels side by side: the AVX-512 and AVX2 libraries on AMD family 19h
    (Zen 4, where that reads at the memory's rate; Zen 3), `csrc/int8_matmul.cc`. The sums are the same either
    way. False where the native kernels cannot run."""
    return _library_says(variant, "JpagedReadsChannelAtATime")


def _library_says(variant: str, function: str, kind=bool):
    """The answer of `variant`'s library function `function` (no arguments) as `kind`: `kind()` (False, 0)
    where it is missing."""
    variants = available_variants()
    if variant == "auto":
        variant = variants[0] if variants else None
    if variant not in variants:
        return kind()
    check = getattr(_library(variant), function, None)
    return kind() if check is None else kind(check())


def row_queries(inputs):
    """(q_start, q_len) i32[B] of a step's rows: row b's new tokens are the packed tokens
    q_start[b] .. q_start[b] + q_len[b] - 1 (padding rows: q_len 0). Rows are packed end to end,
    real rows first, and each ends at its `logits_index`."""
    real = inputs.context_lens > 0
    q_end = jnp.where(real, inputs.logits_index + 1, 0)
    q_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jax.lax.cummax(q_end)[:-1]])
    return q_start, jnp.where(real, q_end - q_start, 0)


def native_attend(q, pool, layer, block_tables, context_lens, q_start, q_len, scale, *,
                  window=None, softcap=None, variant: str = "auto"):
    """Paged attention by the native kernel (see `csrc/paged_attention.cc` for the operands):
    q f[N, H, D] -> f[N, H, D], computed in float32.

    `window`: None (every cached key in context) or an int32 scalar W >= 1, traced or not: the token at
    position p sees the keys at p - W < k <= p, and the kernel reads no block wholly before its row's
    first token's window (those table entries may be the null block). `softcap`: None or a static
    float c > 0: each scaled score s becomes c * tanh(s / c) before the mask and the softmax."""
    operands, attributes = _attention_operands(q, pool, layer, block_tables, context_lens, q_start, q_len, scale,
                                               window, softcap)
    call = jax.ffi.ffi_call(target_name(variant), jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(*operands, **attributes).astype(q.dtype)


def native_write_and_attend(q, k, v, slot_mapping, pool, layer, block_tables, context_lens, q_start, q_len, scale, *,
                            window=None, softcap=None, variant: str = "auto"):
    """`xla_write_kv(pool, layer, k, v, slot_mapping)` then `native_attend(q, pool, ...)` as one native call
    (`csrc/paged_attention.cc`'s JpagedPagedAttentionWrite): k, v f[N, KVH, D] are converted to the pool's
    storage dtype as `xla_write_kv` converts them, then copied into their slots in place (the pool operand is
    aliased to the result; a slot outside the pool is skipped, as the scatter drops it). -> (pool, out)."""
    operands, attributes = _attention_operands(q, pool, layer, block_tables, context_lens, q_start, q_len, scale,
                                               window, softcap)
    call = jax.ffi.ffi_call(target_name(variant, _WRITE_HANDLER),
                            (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
                            input_output_aliases={1: 1})
    out, pool = call(*operands, to_pool(k, pool), to_pool(v, pool), jnp.asarray(slot_mapping, jnp.int32),
                     **attributes)
    return pool, out.astype(q.dtype)


def _attention_operands(q, pool, layer, block_tables, context_lens, q_start, q_len, scale, window, softcap):
    """The operands and attributes the attention handlers share (`native_attend`)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a float > 0 or None, not {softcap!r}")
    window = jnp.asarray(FULL_WINDOW if window is None else window, jnp.int32)
    operands = (q.astype(jnp.float32), pool, jnp.asarray(layer, jnp.int32), window, block_tables, context_lens,
                q_start, q_len)
    return operands, dict(scale=np.float32(scale), softcap=np.float32(0.0 if softcap is None else softcap))


@dataclasses.dataclass(frozen=True)
class NativeBackend:
    """`variant`: 'auto' (the best this CPU runs) or one of `VARIANTS`."""

    variant: str = "auto"
    name: str = "native"

    def __post_init__(self):
        for handler in (_HANDLER, _WRITE_HANDLER):  # fails here, before any tracing, when the kernels cannot run
            target_name(self.variant, handler)

    def storage_dtype(self, dtype):
        return storage_dtype(dtype)

    def write_kv(self, pool, layer, k, v, slot_mapping):
        return xla_write_kv(pool, layer, k, v, slot_mapping)

    def attend(self, q, pool, layer, inputs, scale, *, window=None, softcap=None):
        q_start, q_len = row_queries(inputs)
        return native_attend(q, pool, layer, inputs.block_tables, inputs.context_lens, q_start, q_len, scale,
                             window=window, softcap=softcap, variant=self.variant)

    def write_and_attend(self, q, k, v, pool, layer, inputs, scale, *, window=None, softcap=None):
        q_start, q_len = row_queries(inputs)
        return native_write_and_attend(q, k, v, inputs.slot_mapping, pool, layer, inputs.block_tables,
                                       inputs.context_lens, q_start, q_len, scale, window=window, softcap=softcap,
                                       variant=self.variant)

    def copy_blocks(self, pool, pairs):
        return xla_copy_blocks(pool, pairs)
