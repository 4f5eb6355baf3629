"""Dense weights stored as [out, in] rows: weight-only int8 (`quantization="int8"`: int8 values and float
scales; float32 compute, bfloat16 under `dtype="bfloat16"`), and float weights on one CPU (bfloat16 as their
bit patterns, or float32; no scales) for the native few-row product.

A `QuantizedWeight` replaces one parameter leaf of `jpaged.device.params` (a dense weight, layers
stacked or not). Whatever the leaf's logical layout there (`wq` is [hidden, heads, head_dim], `embed`
[vocab, hidden]), it is stored as GGUF and torch store a linear layer, one output channel per row:

  values  i8[*stack, out, in]
  scales  f32|f16[*stack, out, in // group_size]    w[o, k] = values[o, k] * scales[o, k // group_size]

`group_size == in` is one scale per output channel (symmetric: scale = max|w| / 127 over the channel),
what `quantize_params` makes from float parameters; `group_size == 32` with float16 scales is GGUF's
Q8_0, whose blocks the loader keeps as they are (no float32 pass). The embedding's output channels are
its vocabulary rows, so one set of scales serves the lookup (`take_rows`) and the tied LM head.
`logical_shape` (static: the scan over layers slices `values` and `scales`, not it) and `in_axes` (which
logical axes are contracted, a prefix or the last) say how the matmul maps back to the einsum it replaces.

16-bit rows (`float_rows`, `float_row_params`: what the engine makes of bfloat16 parameters on a
single CPU device, where the native library is built): `values` u16[*stack, out, in] holding bfloat16
bit patterns (uint16, as `jpaged.device.params.to_storage` holds bfloat16 on a CPU: the layer scan
slices them without XLA widening the stack; the model's `from_storage` may hand a slice back bit-cast
to bfloat16, which works the same) and `scales` None. Its `dtype` is bfloat16. Few rows: the native
kernel's 16-bit mode (XLA's CPU bf16 dot of one row reads 5-11 GB/s, a third of float32's); more rows:
XLA's bf16 x bf16 -> f32 dot of the bit-cast values, as for a plain bfloat16 parameter. Either way the
activations are rounded to bfloat16 first (the products are then exact in float32, and the two paths
differ only in the order of the sums). Measured (same machine, kernel alone, bf16 [576 x 1536] and
[1536 x 576], in cache): the native kernel 1.5-3x faster than XLA's bf16 dot of the [out, in] rows for
1-8 rows, slower from 16; the [49152 x 576] LM head of one row: 1.5 ms (36 GB/s; XLA's bf16 dot 35 ms,
float32's 3.7 ms); more rows go by 4096-row chunks (`jpaged.device.model._lm_head`). In the default model
(weights from memory), 8-request batched decode ran 15% faster with XLA's dot at 8 rows than with the
native kernel: hence `NATIVE16_MAX_ROWS` = 3 (a decode step's rows are padded to a power of two, so 3
requests run 4 rows, on XLA's dot). Where the kernel's bfloat16 products run on VDPBF16PS (with its longer work
items, `csrc/int8_matmul.cc`), it won up to 8 rows: the default model's decode step of 3 requests (4 rows)
12.4-13.1 -> 7.3-8.1 ms, of 8 requests 17.1-24.1 -> 9.1-11.3 (AMD EPYC with AVX512-BF16, 2 cores, one process
alternating the two). Once the kernel's passes took 4 rows by 6 channels (`kPassRows`), it won up to 32
rows there: 16 requests 17.6 -> 14.4 ms a step, 32 requests 31.2 -> 21.0 (64: 45.6 -> 42.1, noisy, not
taken): hence `DOT16_MAX_ROWS` = 32 there. CPUs without AVX512-BF16 were not measured again.
Where the CPU has no bfloat16 dot instruction at all (no AMX-BF16, no AVX512-BF16: `widens_16bit`), XLA's
bf16 x bf16 -> f32 dot widens the weights in its inner loop, and from `WIDEN16_MIN_ROWS` = 128 rows on both
operands are widened to float32 first (exact: the same products, summed by XLA's float32 dot in its own order).
Measured on an AMD EPYC Zen 4 (2 cores) on the AVX2 code paths (XLA at AVX2, YNNPACK's AVX2 kernels:
bench/avx2_only), a 30-layer chain of XLA's products, bf16 -> widened, ms (three rounds each): [1536 x 576]
at 64 rows 54-58 -> 57-64, 128 rows 148-168 -> 129-141, 512 rows 397-585 -> 241-421, 2048 rows 1010-1211 ->
679-821; [576 x 1536] 64 rows 50-57 -> 56-63, 128 rows 152-153 -> 127-134, 512 rows 265-267 -> 168-201;
a [4096 x 576] chunk of the LM head 64 rows 139 -> 146-149, 128 rows 225-238 -> 204-221. On those paths the native
kernel (the AVX2 library, its bfloat16 weights widened in registers) beat XLA's bf16 dot at every row count up to 32:
the default model's 121 products as a chain (269 MB), 4 rows 31.6 -> 21.7 ms, 8 rows 49.0 -> 28.0, 16 rows 68.0 ->
52.4, 32 rows 120.1 -> 75.9 (medians of 3): hence `AVX2_16_MAX_ROWS` = 32 in the AVX2 library.

float32 rows (`float_rows` of a float32 weight; what `float_row_params` makes of float32 parameters, as the
engine does on one CPU): `values` f32[*stack, out, in], `scales` None, `dtype` float32. Up to
`NATIVE32_MAX_ROWS` rows the native kernel reads them (no rounding: float32 products and sums); more rows,
XLA's float32 dot of the [out, in] rows (as fast as of the [in, out] weights at 256-512 rows, 0-9% slower at
64). A request's float32 tokens should not change with the batch it is decoded in (beam search and sampling
under aborts and swaps: tests/test_reliability.py checks that they do not). The native kernel sums a row's
products the same at any row count, bit for bit. XLA's dot does not (AMD EPYC, jax 0.10.2, the default
model's shapes): one row alone differs from the same row among two, and from 64 rows on ([576 x 1536]) from
the same row among 2-32; 2 to 32 rows agree. With the native kernel up to 8 rows and XLA's dot past them,
the aborts test's tokens changed; with it up to `NATIVE32_MAX_ROWS` = 32 every decode step of up to 32 rows
sums a row's products alike, and the test holds. Past 32 rows (prefill chunks, large batches) the rows go to
XLA's dot, as the [in, out] weights did. Measured on that machine (one process building both engines and
alternating their one-row `run_step`, median ms a decode step): 1 row 13.8 against 17.0 with XLA's dot of
the [in, out] weights; 2 rows 17.3 / 18.1, 8 rows 23.1 / 24.2, 16 rows 33.3 / 32.7, 32 rows 50.7 / 52.4. The
rows are a transposed copy of each layer's weights beside the parameters' own (the tied embedding is
shared). Measured earlier, with the native kernel up to 8 rows: 10% at one stream on an Intel Xeon with AMX
(bench/README.md), 5-25% on an AMD EPYC with AVX-512 (`LLM.generate`, 128 tokens, one prompt, alternating
processes: 14.8 / 18.6 / 15.7 ms a token against 19.9 / 19.7 / 18.5). Measured on the Intel Xeon (2 cores),
the default model's 30 layers of products as a chain of dependent calls (weights from memory), scratch
scripts: one row 22.0-23.8 ms with XLA's dot of the [in, out] weights, 18.0-19.6 with the native kernel on
rows (its caller spinning for its helpers, no software prefetch: `csrc/int8_matmul.cc`); 4 rows 33.5-34.6 ms
with XLA's dot, 26.2-27.0 native, 8 rows 41.7-42.7 and 28.2-29.4 (native before those two changes). The same
products read in the [in, out] layout by a native kernel (no transposed copy) ran at 15 GB/s against XLA's
19: 64-256-byte pieces of rows far apart stream worse than whole rows. The float32 LM head takes the native
kernel too, up to `NATIVE32_MAX_ROWS` rows, so its products are as batch-invariant as the layers' (the rest
of the step is XLA's: its float32 row sums of an RMS norm differ from 8 rows on). It once went to XLA's dot
at every row count (`NATIVE32_MAX_OUTPUT` = 8192 output channels: on the Intel Xeon the default model's tied
[49152 x 576] head of one row took 3.5 ms in the kernel against XLA's 3.0). Once the kernel's passes took 4
rows by 6 channels (`kPassRows`, `csrc/int8_matmul.cc`), it ran the head as fast as XLA's dot at one row and
faster at 4-32 rows (AMD EPYC, 2 cores, alone: 2.0-2.3 / 3.0-3.2 / 3.6-3.8 / 4.8-5.0 / 7.6-8.1 ms at 1 / 4 /
8 / 16 / 32 rows, XLA's 2.3 / 5.5 / 5.3 / 6.3 / 8.2), and the default model's float32 decode step (one
process alternating the two, median ms) 2 rows 15.7 against 17.4 with the head on XLA's dot, 8 rows 21.9
against 23.0, 32 rows 46.7 against 46.1.

On a CPU with AMX-BF16 (`native.amx_bf16()`), the native kernel runs bfloat16 products on AMX tiles
(bfloat16 x bfloat16 -> float32 tile products; one row too: its weights stream faster through tile
loads, a one-row decode step of the default model 16.3-16.7 -> 15.2-15.3 ms) and takes every 16-bit
product of up to `AMX_MAX_ROWS` rows (`native16_max_rows`). Measured on an Intel Xeon with AMX (2
cores, kernel alone, the default model's shapes, against XLA's bf16 dot): 3.5-4.5x as fast at 4-15 rows, 1.2-2.6x at 16-128 (the
[49152 x 576] LM head: 9-12x at 4-15 rows, 1.9x at 128), 0.6-1.2x at 256, slower beyond (XLA's dot
reaches AMX through its own library there: ~1 TFLOP/s at 1024 rows, where the kernel makes 0.6-0.8).
On a CPU with AVX512-BF16 and no AMX (AMD Zen 4 and later; `native.avx512_bf16()`), the kernel's bfloat16
products run on VDPBF16PS instead of widening each weight: a pair of bfloat16 products per float32 lane
(AMD EPYC, 2 cores, the default model's 121 one-row products as a chain of dependent calls: 7.6-7.9 ms
against 8.0-8.1).

The product (`quantized_matmul`): up to `NATIVE_MAX_ROWS` rows (decode), the native kernel
(`csrc/int8_matmul.cc`) reads each int8 weight once and widens it in registers; with more rows, or
without the native library, XLA dequantizes and runs a float32 dot. XLA's CPU backend (jax 0.10.2) fuses
the widening into the dot only for one row (a loop fusion); from two rows on it writes the whole float32
matrix first and reads it back (XNNPACK's dot), which many rows pay for once. Measured on an AMD EPYC
(2 cores, AVX-512), kernel alone, [576 x 1536] and [1536 x 576] int8 weights: the native kernel 1.5-9x
faster than XLA's path for 1-8 rows, even at 32-64 rows, 2x slower at 128; the [576 x 49152] LM head:
native 3-8x faster for 4-32 rows, even at 128 (a loaded machine: ratios, not times).

Products of one `x` by several weights (q, k and v; gate and up: `quantized_matmuls`), float rows of one dtype
or int8 ones, are one native call with a result per weight, where the kernel takes each of them: 4 calls a
layer instead of 7.
Each call ends with the calling thread waiting for its helpers' last items, and a decode step of one row
is a chain of such calls. Measured on an AMD EPYC with AVX-512 (2 cores; `LLM.generate`, 128 tokens, one
prompt, 3 alternating rounds, median ms a token): bfloat16 12.26 / 11.96 / 12.46 one call a weight,
11.78 / 12.08 / 11.42 fused; float32 rows 17.09 / 18.37 / 18.70 against 17.78 / 16.97 / 17.72. int8 (the same
machine, its one-row decode step, two alternating processes each): 6.6-7.6 and 5.7-7.4 ms one call a weight,
5.9-6.5 and 5.7-6.0 fused.

int8 weights compute in bfloat16 under `dtype="bfloat16"` (`compute_dtype`, which `quantize_params` sets from
the parameters' dtype): each product rounds `x` to bfloat16 first, as a bfloat16 parameter's einsum does. The
native kernel multiplies the rounded rows by the int8 values exactly (float32 sums, then the scales); XLA's
path, past `NATIVE_MAX_ROWS`, rounds the dequantized weights to bfloat16 too (as a GPU's weight-only kernel
dequantizes to its activations' dtype) for XLA's bf16 x bf16 -> f32 dot, which runs on VDPBF16PS where the
CPU has AVX512-BF16. Computing in float32, a step of many rows is a float32 GEMM at the FMA units' rate,
whatever the weights' width: 120 requests of 64 tokens (`bench/vs_peers.py`'s set, whose three prefill
steps of 4096 tokens were half the time) ran 247-256 tokens/s in float32 against 391-441 in bfloat16 (AMD
EPYC Zen 4, 2 cores, `LLM.generate` of the Q8_0 file, alternating processes).

int8 products of one or two rows have no helpers on AVX-512 CPUs other than AMD Zen 4: the calling thread
takes every item, which was faster there (`kInt8SoloMaxRows` in the kernel; one stream of the Q8_0 file served,
AMD EPYC, 7.6 -> 5.6-6.0 ms a token). On Zen 4 and in the builds without AVX-512 one thread's arithmetic
bounds an int8 row, and every int8 product has its helper (`native.int8_solo_max_rows`).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jpaged.device.attention import native

QUANTIZATIONS = ("int8",)
NATIVE_MAX_ROWS = 32  # rows up to which the native kernel beats XLA's dequantize-then-dot (module docstring)
NATIVE16_MAX_ROWS = 3  # rows up to which the native 16-bit kernel beats XLA's bf16 dot in a model (module docstring)
DOT16_MAX_ROWS = 32  # the same where its bfloat16 products run on VDPBF16PS (`native.avx512_bf16()`)
NATIVE32_MAX_ROWS = 32  # the same for float32 rows
AMX_MAX_ROWS = 128  # the same where the native kernel runs on AMX tiles
AVX2_16_MAX_ROWS = 32  # the same where the AVX2 library runs them (no bfloat16 dot instruction: module docstring)
WIDEN16_MIN_ROWS = 128  # rows from which XLA's 16-bit products run in float32 where `widens_16bit()`
ROW_DTYPES = (jnp.bfloat16, jnp.float32)  # the float weights `float_rows` takes
IN_AXES = {"embed": (1,), "lm_head": (0,), "wq": (0,), "wk": (0,), "wv": (0,), "wo": (0, 1), "w_gate": (0,),
           "w_up": (0,), "w_down": (0,)}  # the contracted logical axes of each dense leaf of params.py
# the same for a mixture of experts' stacked experts ([L, E, in, out]: each expert one weight of logical shape [in, out])
EXPERT_IN_AXES = {"experts_gate": (0,), "experts_up": (0,), "experts_down": (0,)}


@struct.dataclass
class QuantizedWeight:
    """A dense weight stored as [out, in] rows (see the module docstring): int8 with scales, or float rows
    without (bfloat16 bits, uint16, bit-cast bfloat16 in the model's layer scan; or float32). Invariants:
    int8 `values` have a last axis (`in`) that `scales`' last axis divides, and both the same leading axes;
    float rows have `scales` None; `in` is the product of `logical_shape` over `in_axes` and `out` of the
    other axes."""

    values: jax.Array
    scales: Optional[jax.Array]
    logical_shape: tuple = struct.field(pytree_node=False)
    in_axes: tuple = struct.field(pytree_node=False)
    layer: Optional[jax.Array] = None  # an int32 scalar: this is layer `layer` of the stack `values` (`of_layer`)
    compute_dtype: str = struct.field(pytree_node=False, default="float32")  # int8: what `x` is rounded to

    @property
    def shape(self) -> tuple:
        """The logical shape (params.py's layout), the stacked layer axis included (none for `of_layer`)."""
        return (() if self.layer is not None else tuple(self.values.shape[:-2])) + tuple(self.logical_shape)

    def of_layer(self, layer) -> "QuantizedWeight":
        """Layer `layer` (an int32 scalar, traced or not) of this stacked weight, without slicing it: the
        native kernels read the layer inside the stack (`quantized_matmul`), where a slice in a layer scan
        would be a copy of its weights on XLA's CPU backend (a 128-row bfloat16 decode step of the default
        model: 20 ms of its 100)."""
        if self.values.ndim != 3 or self.layer is not None:
            raise ValueError(f"of_layer takes a stack of layers' weights, not values of shape {self.values.shape}")
        if not (isinstance(layer, jax.Array) and layer.dtype == jnp.int32):  # an int32 array is kept: the
            layer = jnp.asarray(layer, jnp.int32)  # weights of one layer share it (`quantized_matmuls`)
        return self.replace(layer=layer)

    @property
    def is_float(self) -> bool:
        """Whether these are float rows (bfloat16 bits or float32, no scales) rather than int8 ones."""
        return self.scales is None

    @property
    def is_16bit(self) -> bool:
        """Whether these are 16-bit float rows (bfloat16 bits)."""
        return self.is_float and self.values.dtype.itemsize == 2

    @property
    def dtype(self):
        """What the weight computes in, the dtype its products round `x` to: bfloat16 for 16-bit rows,
        float32 for float32 rows, `compute_dtype` for int8 (float32, or bfloat16 under `dtype="bfloat16"`:
        `quantize_params`). Products accumulate and return float32 in every case."""
        if self.is_float:
            return jnp.dtype(jnp.bfloat16 if self.is_16bit else jnp.float32)
        return jnp.dtype(self.compute_dtype)

    @property
    def group_size(self) -> int:
        return self.values.shape[-1] // (1 if self.is_float else self.scales.shape[-1])

    @property
    def T(self) -> "QuantizedWeight":
        """The transposed logical view of a 2-D weight ([vocab, hidden] <-> [hidden, vocab]): the same
        arrays, so a tied LM head shares the embedding's memory."""
        if len(self.logical_shape) != 2:
            raise ValueError(f"only a 2-D weight has a transposed view, not one of shape {self.logical_shape}")
        return self.replace(logical_shape=self.logical_shape[::-1], in_axes=(1 - self.in_axes[0],))


def quantize(w, logical_shape: tuple, in_axes: tuple, group_size: int | None = None) -> QuantizedWeight:
    """A float weight `w` f[*stack, *logical_shape] as int8 with symmetric scales (float32), one per output
    channel (`group_size=None`) or per `group_size` input columns (it must divide them); `in_axes`: the
    contracted axes of `logical_shape`. Rounds to nearest: |w - dequantize(q)| <= scale / 2."""
    logical_shape, in_axes = tuple(logical_shape), tuple(in_axes)
    w = jnp.asarray(w, jnp.float32)
    stack = w.shape[:w.ndim - len(logical_shape)]
    if w.shape[len(stack):] != logical_shape:
        raise ValueError(f"a weight of shape {w.shape} does not end with the logical shape {logical_shape}")
    out_axes = [a for a in range(len(logical_shape)) if a not in in_axes]
    n_in = math.prod(logical_shape[a] for a in in_axes)
    group = n_in if group_size is None else group_size
    if group < 1 or n_in % group:
        raise ValueError(f"group_size {group_size} does not divide the {n_in} input columns")
    s = len(stack)
    rows = jnp.transpose(w, [*range(s), *(s + a for a in out_axes), *(s + a for a in in_axes)])
    blocks = rows.reshape(*stack, -1, n_in // group, group)
    scales = jnp.max(jnp.abs(blocks), axis=-1) / 127.0
    values = jnp.round(blocks / jnp.where(scales == 0, 1.0, scales)[..., None])
    values = jnp.clip(values, -127, 127).astype(jnp.int8).reshape(*stack, -1, n_in)
    return QuantizedWeight(values, scales, logical_shape, in_axes)


def float_rows(w, logical_shape: tuple, in_axes: tuple) -> QuantizedWeight:
    """A bfloat16 or float32 weight `w` [*stack, *logical_shape] as float rows [*stack, out, in], no scales
    (`in_axes`: the contracted axes of `logical_shape`): bfloat16 as uint16 bit patterns, float32 as it is.
    On a CPU a weight whose rows are already its layout (the embedding: [vocab, hidden]) shares its
    memory; others are transposed into a new array."""
    logical_shape, in_axes = tuple(logical_shape), tuple(in_axes)
    if w.dtype not in ROW_DTYPES:
        raise ValueError(f"float_rows takes a bfloat16 or float32 weight, not {w.dtype}")
    bits = w.dtype == jnp.bfloat16
    stack = w.shape[:w.ndim - len(logical_shape)]
    if w.shape[len(stack):] != logical_shape:
        raise ValueError(f"a weight of shape {w.shape} does not end with the logical shape {logical_shape}")
    out_axes = [a for a in range(len(logical_shape)) if a not in in_axes]
    s = len(stack)
    order = [*range(s), *(s + a for a in out_axes), *(s + a for a in in_axes)]
    n_in = math.prod(logical_shape[a] for a in in_axes)
    devices = w.devices() if isinstance(w, jax.Array) else set()
    if len(devices) == 1 and next(iter(devices)).platform == "cpu":  # numpy: a view where the layout allows
        array = np.asarray(w)
        rows = (array.view(np.uint16) if bits else array).transpose(order).reshape(*stack, -1, n_in)
        values = jax.device_put(rows, next(iter(devices)))
    else:
        rows = jnp.transpose(w, order).reshape(*stack, -1, n_in)
        values = jax.lax.bitcast_convert_type(rows, jnp.uint16) if bits else rows
    return QuantizedWeight(values, None, logical_shape, in_axes)


def float_row_params(params):
    """`params` (a `LlamaParams`) with every bfloat16 and float32 dense weight (`IN_AXES`) and expert
    (`EXPERT_IN_AXES`) as float rows (`float_rows`), for the native few-row product on one CPU (what the engine runs there). The same `params`
    where the native library is absent. Norms and biases stay as they are (`to_storage` makes bits of them),
    so do leaves of other dtypes (float16 weights stay XLA's). Tied embeddings get `lm_head = embed.T`, the
    same arrays viewed as [hidden, vocab]."""
    if _float_rows_target() is None:
        return params
    params = _map_dense(params, lambda w, shape, in_axes: float_rows(w, shape, in_axes) if w.dtype in ROW_DTYPES else w)
    return params.replace(layers=params.layers.replace(**_experts_as(params.layers, float_rows)))


def _experts_as(layers, convert) -> dict:
    """The experts' leaves of stacked `layers` converted, `convert(w, logical_shape, in_axes)` (`quantize`,
    `float_rows`), each expert one weight: rows [L, E, out, in]; absent and converted leaves left out."""
    return {name: convert(w, w.shape[2:], in_axes) for name, in_axes in EXPERT_IN_AXES.items()
            for w in (getattr(layers, name),)
            if w is not None and not isinstance(w, QuantizedWeight) and (convert is quantize or w.dtype in ROW_DTYPES)}


def _map_dense(params, convert):
    """`params` with `convert(w, logical_shape, in_axes)` in place of each dense leaf (`IN_AXES`) that is a
    plain array (absent and `QuantizedWeight` leaves stay); where the embeddings are tied and the
    embedding became a `QuantizedWeight`, `lm_head = embed.T`, a view of its arrays."""
    def one(name, w, stacked):
        if w is None or isinstance(w, QuantizedWeight):
            return w
        return convert(w, w.shape[1:] if stacked else w.shape, IN_AXES[name])

    layers = params.layers.replace(**{name: one(name, getattr(params.layers, name), True)
                                      for name in IN_AXES if name not in ("embed", "lm_head")})
    embed, lm_head = one("embed", params.embed, False), one("lm_head", params.lm_head, False)
    if lm_head is None and isinstance(embed, QuantizedWeight):
        lm_head = embed.T
    return params.replace(embed=embed, layers=layers, lm_head=lm_head)


def _out_axes(w: QuantizedWeight) -> list[int]:
    return [a for a in range(len(w.logical_shape)) if a not in w.in_axes]


def _bf16(values) -> jax.Array:
    """16-bit rows' values as bfloat16 (bit-cast from their uint16 storage form)."""
    return jax.lax.bitcast_convert_type(values, jnp.bfloat16) if values.dtype == jnp.uint16 else values


def dequantize_rows(values, scales) -> jax.Array:
    """f32[..., in]: int8 rows `values` [..., in] times their group scales `scales` [..., in // group];
    float rows (`scales` None): bf16[..., in] (the values bit-cast) or f32[..., in] (the values)."""
    if scales is None:
        return _bf16(values)
    groups = scales.shape[-1]
    blocks = values.astype(jnp.float32).reshape(*values.shape[:-1], groups, -1)
    return (blocks * scales.astype(jnp.float32)[..., None]).reshape(values.shape)


def dequantize(w: QuantizedWeight) -> jax.Array:
    """The weight f[*stack, *logical_shape] that `w` stands for (float32; 16-bit rows: bfloat16)."""
    s = w.values.ndim - 2
    out_axes = _out_axes(w)
    rows = dequantize_rows(w.values, w.scales)
    rows = rows.reshape(*rows.shape[:s], *(w.logical_shape[a] for a in out_axes),
                        *(w.logical_shape[a] for a in w.in_axes))
    order = out_axes + list(w.in_axes)  # the axes of `rows` after the stack, in logical terms
    return jnp.transpose(rows, [*range(s), *(s + order.index(a) for a in range(len(w.logical_shape)))])


def take_rows(w, ids) -> jax.Array:
    """`w[ids]` of a float weight, or the float32 rows of an int8 one whose rows are its output channels
    (the embedding: [vocab, hidden], `in_axes == (1,)`; 16-bit rows: bfloat16)."""
    if not isinstance(w, QuantizedWeight):
        return w[ids]
    if w.in_axes != (1,) or w.values.ndim != 2:
        raise ValueError(f"take_rows needs an unstacked [rows, columns] weight, not logical {w.logical_shape} "
                         f"contracted over {w.in_axes}")
    return dequantize_rows(w.values[ids], None if w.is_float else w.scales[ids])


def quantized_matmul(x, w: QuantizedWeight) -> jax.Array:
    """x f[..., *in] (the trailing axes: `w`'s contracted logical axes, in order) times an unstacked int8
    or float-rows weight -> f32[..., *out] (`w`'s other logical axes, in order): the einsum `w` replaces.
    Few rows (at most `native_max_rows(w)`) on a CPU with the native library: the native kernel; else XLA.
    A 16-bit weight takes `x` rounded to bfloat16 (as a bfloat16 parameter's einsum does). A weight of one
    layer of a stack (`of_layer`): the native kernel reads that layer in place; XLA's path slices it out."""
    if w.values.ndim != (2 if w.layer is None else 3):
        raise ValueError(f"a matmul takes one layer's weight, not a stack of shape {w.values.shape}")
    n_in = w.values.shape[-1]
    rows = x.reshape(-1, n_in).astype(w.dtype)
    sliced = lambda a: a if w.layer is None else a[w.layer]  # noqa: E731
    call = _native_call(w)
    if call is not None and rows.shape[0] <= native_max_rows(w):
        y, = call(rows, _layer(w), [w])
    else:  # XLA's dot of the weights in the compute dtype (int8: dequantized, rounded to bfloat16 where it
        # computes in bfloat16), contracting the rows' last axis; bf16 x bf16 -> f32 or f32's
        weights = (_bf16(sliced(w.values)) if w.is_float
                   else dequantize_rows(sliced(w.values), sliced(w.scales)).astype(w.dtype))
        if rows.dtype == jnp.bfloat16 and rows.shape[0] >= WIDEN16_MIN_ROWS and widens_16bit():
            rows, weights = rows.astype(jnp.float32), weights.astype(jnp.float32)  # exact: the same products
        y = jax.lax.dot_general(rows, weights, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.reshape(*_batch(x, w), *_out_shape(w))


def quantized_matmuls(x, ws) -> list:
    """`[quantized_matmul(x, w) for w in ws]`, the products of one `x` by several weights (q, k and v; gate
    and up), as one native call where the kernel takes them together (all float rows of one dtype, or all
    int8 with scales of one dtype; the same contracted axes and layer; at most `native_max_rows` rows of
    every weight; at most 4 weights): one wait for XLA's threads instead of one a weight (the calling
    thread waits for its helpers' last items at the end of each call: `csrc/work_list.h`). Otherwise one
    `quantized_matmul` each."""
    ws = list(ws)
    first = ws[0]
    fused = (1 < len(ws) <= 4 and all(isinstance(w, QuantizedWeight) for w in ws)
             and all(w.is_float == first.is_float and w.values.dtype == first.values.dtype
                     and (w.is_float or w.scales.dtype == first.scales.dtype) and w.dtype == first.dtype
                     and w.in_axes == first.in_axes
                     and w.values.shape[-1] == first.values.shape[-1] and w.values.ndim == first.values.ndim
                     and w.layer is first.layer for w in ws))
    if fused:
        rows = x.reshape(-1, first.values.shape[-1]).astype(first.dtype)
        fused = (first.values.ndim == (2 if first.layer is None else 3) and _native_call(first) is not None
                 and rows.shape[0] <= min(native_max_rows(w) for w in ws))
    if not fused:
        return [quantized_matmul(x, w) for w in ws]
    ys = _native_call(first)(rows, _layer(first), ws)
    return [y.reshape(*_batch(x, w), *_out_shape(w)) for y, w in zip(ys, ws)]


def _batch(x, w: QuantizedWeight) -> tuple:
    """The leading axes of `x` that a product by `w` keeps (those before its contracted ones)."""
    return x.shape[:x.ndim - len(w.in_axes)]


def _out_shape(w: QuantizedWeight) -> tuple:
    """The logical axes a product by `w` yields, in order."""
    return tuple(w.logical_shape[a] for a in _out_axes(w))


def _layer(w: QuantizedWeight) -> jax.Array:
    """The int32 layer the native kernels read of `w` (0 for an unstacked weight)."""
    return jnp.asarray(0 if w.layer is None else w.layer, jnp.int32)


def _native_call(w: QuantizedWeight):
    """The native kernel's call for weights like `w` (`_float_rows_call` or `_int8_call`), or None where
    it cannot run (not a CPU, not built)."""
    if w.is_float:
        return _float_rows_call if _float_rows_target() is not None else None
    return _int8_call if _native_target() is not None else None


def _float_rows_call(rows, layer, ws) -> list:
    """The native float-rows kernel on `rows` [M, in] (already in the weights' compute dtype) and the float
    rows `ws`, of layer `layer` where they are stacks: f32[M, out] for each weight."""
    call = jax.ffi.ffi_call(_float_rows_target(), _results(rows, ws))
    return call(rows.astype(jnp.float32), layer, *(w.values for w in ws))


def _int8_call(rows, layer, ws) -> list:
    """The native int8 kernel on `rows` [M, in] (already in the weights' compute dtype; the kernel takes them
    as float32, where a bfloat16 row times an int8 weight is exact) and the int8 weights `ws` (scales of one
    dtype), of layer `layer` where they are stacks: f32[M, out] for each weight."""
    call = jax.ffi.ffi_call(_native_target(), _results(rows, ws))
    return call(rows.astype(jnp.float32), layer, *(a for w in ws for a in (w.values, w.scales)))


def _results(rows, ws) -> list:
    """The native kernels' results for `rows` [M, in] by each weight of `ws`: f32[M, out]."""
    return [jax.ShapeDtypeStruct((rows.shape[0], w.values.shape[-2]), jnp.float32) for w in ws]


def native_max_rows(w: QuantizedWeight) -> int:
    """Rows up to which a product by `w` takes the native kernel here: `NATIVE_MAX_ROWS` for int8,
    `NATIVE32_MAX_ROWS` for float32 rows, `native16_max_rows()` for 16-bit rows; 0 where the native
    library cannot run."""
    if not w.is_float:
        return NATIVE_MAX_ROWS if _native_target() is not None else 0
    if w.is_16bit:
        return native16_max_rows()
    return NATIVE32_MAX_ROWS if _float_rows_target() is not None else 0


def native16_max_rows() -> int:
    """Rows up to which a 16-bit product takes the native kernel here: `AMX_MAX_ROWS` where it runs on AMX
    tiles, `DOT16_MAX_ROWS` where on VDPBF16PS, `AVX2_16_MAX_ROWS` in the AVX2 library, else (the AVX-512 one
    without AVX512-BF16) `NATIVE16_MAX_ROWS`; 0 where the native library cannot run."""
    if _float_rows_target() is None:
        return 0
    if native.amx_bf16():
        return AMX_MAX_ROWS
    if native.avx512_bf16():
        return DOT16_MAX_ROWS
    return AVX2_16_MAX_ROWS if native.available_variants()[0] == "avx2" else NATIVE16_MAX_ROWS


def widens_16bit() -> bool:
    """Whether XLA's products of 16-bit weights by at least `WIDEN16_MIN_ROWS` rows widen both operands to float32
    here (module docstring): on a CPU where the native library finds no bfloat16 dot instruction (neither AMX-BF16
    nor AVX512-BF16; its variant capped by JPAGED_NATIVE_VARIANT counts as the CPU). False where the native library
    cannot run (nothing measured there)."""
    return _float_rows_target() is not None and not native.amx_bf16() and not native.avx512_bf16()


def _native_target():
    """The native int8 kernel's FFI target name, or None where it cannot run (not a CPU, not built)."""
    return _cpu_target(native.int8_matmul_target)


def _float_rows_target():
    """The native float-rows kernel's FFI target name (16-bit or float32 rows), or None where it cannot run
    (not a CPU, not built)."""
    return _cpu_target(native.float_rows_matmul_target)


def _cpu_target(register):
    if jax.default_backend() != "cpu":
        return None
    try:
        return register()
    except native.NativeUnavailable:
        return None


def check_quantization(quantization) -> None:
    """Raises ValueError unless `quantization` is None or one of `QUANTIZATIONS`."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, "
                         f"got {quantization!r}")


def quantize_params(params, quantization: str = "int8", dtype=jnp.float32):
    """`params` (a `LlamaParams`) with every dense weight (`IN_AXES`) and every expert (`EXPERT_IN_AXES`) int8, one
    scale per output channel (the embedding: per vocabulary row); norms, biases and routers stay as they are, and so do leaves that are
    already quantized (a Q8_0 file's blocks). Tied embeddings get `lm_head = embed.T`, the same arrays
    viewed as [hidden, vocab] (what the runner makes of a float tied head by copying). `dtype`: the
    parameters' (`EngineConfig.dtype`); under bfloat16 every int8 weight, new or not, computes in bfloat16
    (`QuantizedWeight.dtype`), else in float32."""
    check_quantization(quantization)
    if quantization is None:
        return params
    compute = "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"
    params = _map_dense(params, quantize)  # and each expert, one scale per output channel of it:
    params = params.replace(layers=params.layers.replace(**_experts_as(params.layers, quantize)))
    return jax.tree.map(lambda w: w.replace(compute_dtype=compute) if isinstance(w, QuantizedWeight) and not w.is_float
                        else w, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
