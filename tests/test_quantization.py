"""Weight-only int8 (`quantization="int8"`, `jpaged.device.quant`): the matmul (native kernel and XLA
path) against a float64 numpy reference, a tiny Llama written as a Q8_0 GGUF by gguf-py's writer and
quantizer against HF transformers loading the same file, and the default model's greedy agreement
with float32."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jpaged.core.sampling_params import SamplingParams
from jpaged.device.attention import native
from jpaged.device.config import ModelConfig
from jpaged.device.model import compute_logits, sequence_logits
from jpaged.device.params import init_params
from jpaged.device.quant import (NATIVE_MAX_ROWS, QuantizedWeight, float_rows, dequantize, quantize, quantize_params,
                                 quantized_matmul, take_rows)
from jpaged.engine import EngineConfig
from jpaged.weights import loader
from test_families import build_family
import test_families_gguf
from test_families_gguf import write_gguf

tokenizer_fields = test_families_gguf.tokenizer_fields  # the fixture: the default model's tokenizer metadata

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _reference(x, values, scales):
    """float64: x @ (values * scales per group).T"""
    n, k = values.shape
    w = values.astype(np.float64).reshape(n, scales.shape[1], -1) * scales.astype(np.float64)[..., None]
    return x.astype(np.float64) @ w.reshape(n, k).T


@pytest.mark.parametrize("k, n, group, scale_dtype", [(64, 19, 64, np.float32), (96, 33, 32, np.float16),
                                                      (50, 7, 25, np.float32), (33, 5, 33, np.float16)])
def test_int8_matmul_matches_float64(k, n, group, scale_dtype):
    """Rows 1..9 (the native kernel where built) and more than NATIVE_MAX_ROWS (XLA), per-channel and
    grouped scales, sizes that are not multiples of the 16-lane vectors."""
    rng = np.random.default_rng(k * n)
    values = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // group)) * 0.02 + 0.001).astype(scale_dtype)
    w = QuantizedWeight(jnp.asarray(values), jnp.asarray(scales), (k, n), (0,))
    matmul = jax.jit(quantized_matmul)
    for rows in [*range(1, 10), NATIVE_MAX_ROWS + 3]:
        x = rng.standard_normal((rows, k)).astype(np.float32)
        ref = _reference(x, values, scales)
        np.testing.assert_allclose(np.asarray(matmul(x, w)), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        for variant in native.available_variants()[1:] if rows in (1, 9) else ():  # the other builds (AVX2, portable)
            call = jax.ffi.ffi_call(native.int8_matmul_target(variant), [jax.ShapeDtypeStruct((rows, n), jnp.float32)])
            np.testing.assert_allclose(np.asarray(call(x, np.int32(0), values, scales)[0]), ref, rtol=1e-5,
                                       atol=1e-5 * np.abs(ref).max(), err_msg=variant)


def test_int8_computing_in_bfloat16_rounds_the_activations():
    """int8 weights computing in bfloat16 (`quantize_params(..., dtype=bfloat16)`, the engine's under
    `dtype="bfloat16"`): every product takes `x` rounded to bfloat16. The native kernel's rows (up to
    NATIVE_MAX_ROWS) multiply it by the int8 weights exactly and match the float64 reference of the rounded
    `x`; XLA's (more rows) round the dequantized weights to bfloat16 too, within bfloat16's rounding of it.
    Either is farther from the float32 `x`'s reference than float32 sums would be."""
    rng = np.random.default_rng(11)
    n, k = 48, 96
    config = ModelConfig(vocab_size=64, hidden_size=k, intermediate_size=n, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    params = quantize_params(init_params(config, jax.random.key(11)), "int8", jnp.bfloat16)
    w = params.layers.w_up.of_layer(jnp.int32(0))  # [k, n] logically, its rows [n, k]
    assert w.dtype == jnp.bfloat16 and w.compute_dtype == "bfloat16"
    values, scales = np.asarray(w.values[0]), np.asarray(w.scales[0])
    matmul = jax.jit(quantized_matmul)
    for rows in (1, 7, NATIVE_MAX_ROWS + 3):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        rounded = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
        ref, unrounded = _reference(rounded, values, scales), _reference(x, values, scales)
        got = np.asarray(matmul(x, w))
        scale = np.abs(ref).max()
        tol = 1e-5 if rows <= NATIVE_MAX_ROWS and native.available_variants() else 2 ** -7
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol * scale)
        assert np.abs(got - unrounded).max() > 1e-4 * scale


@pytest.mark.parametrize("group", [32, 288])
def test_int8_rows_do_not_depend_on_the_threads_or_the_row_count(group):
    """One or two rows run on the calling thread alone (in the AVX-512 library off AMD Zen 4:
    `native.int8_solo_max_rows`), more rows split their output channels between threads (`kInt8SoloMaxRows` in
    csrc/int8_matmul.cc), more than 16 rows of grouped scales multiply weights widened once into a float32
    scratch (`WidenedTile`) where fewer widen them in registers, and the builds without AVX-512 sum each group
    unscaled (`kScalesAfterGroups`: `GroupSums`, 8, 4 or 2 groups side by side by the rows of a pass): in every
    library built here, a row's product is the same bits at every row count up to NATIVE_MAX_ROWS, and matches
    the float64 reference, over enough channels for many work items (and a last one of fewer channels), with
    Q8_0's groups of 32 (9 a channel: one more than the side-by-side groups of every pass) and per-channel
    scales."""
    if not native.available_variants():
        pytest.skip("native kernels not built here")
    rng = np.random.default_rng(3)
    n, k = 700, 288
    values = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // group)) * 0.02 + 0.001).astype(np.float16)
    x = rng.standard_normal((NATIVE_MAX_ROWS, k)).astype(np.float32)
    ref = _reference(x, values, scales)

    def product(variant, rows):
        call = jax.ffi.ffi_call(native.int8_matmul_target(variant), [jax.ShapeDtypeStruct((rows, n), jnp.float32)])
        return np.asarray(call(x[:rows], np.int32(0), values, scales)[0])

    for variant in native.available_variants():
        batched = product(variant, NATIVE_MAX_ROWS)
        np.testing.assert_allclose(batched, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=variant)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17):
            np.testing.assert_array_equal(product(variant, rows), batched[:rows], err_msg=f"{variant}, {rows} rows")
    w = QuantizedWeight(jnp.asarray(values), jnp.asarray(scales), (k, n), (0,))
    for rows in (1, 9):  # the model's products call the first library
        np.testing.assert_array_equal(np.asarray(jax.jit(quantized_matmul)(x[:rows], w)),
                                      product(native.available_variants()[0], rows))


def test_zen_4_has_its_own_few_row_choices():
    """On AMD family 25 (Zen 4, which runs each 512-bit operation as two 256-bit halves) the AVX-512 library
    gives even one-row int8 products a helper thread, and reads the float32 and bfloat16 weights of one row a
    channel at a time; on other CPUs the AVX-512 library runs int8 products of up to 2 rows on the calling
    thread alone; the builds without AVX-512 give every int8 product its helper on every CPU; and one row
    reads several channels side by side everywhere but in the AVX-512 and AVX2 libraries on AMD family 25
    (the AVX2 library on Zen 3 too). Read against /proc/cpuinfo's vendor and family. (Either way a row's sums
    are the same bits: test_weights_dtype.py's batch-invariance tests, and
    test_int8_rows_do_not_depend_on_the_threads_or_the_row_count.)"""
    if not native.available_variants():
        pytest.skip("native kernels not built here")
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    vendor, family = re.search(r"vendor_id\s*:\s*(\S+)", text), re.search(r"cpu family\s*:\s*(\d+)", text)
    zen4 = bool(vendor and family and vendor[1] == "AuthenticAMD" and int(family[1]) == 25)
    for variant in native.available_variants():
        on_zen4 = zen4 and variant == "avx512"
        assert native.int8_solo_max_rows(variant) == (2 if variant == "avx512" and not on_zen4 else 0), variant
        assert native.reads_channel_at_a_time(variant) == (zen4 and variant in ("avx512", "avx2")), variant


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_a_layer_of_a_stack_is_read_in_place(kind):
    """A layer of a stacked weight (`of_layer`: what the layer scan hands the native kernels, which read
    it inside the stack) gives that layer's product, at native and XLA row counts; a layer out of the
    stack's range fails the call instead of reading past it."""
    rng = np.random.default_rng(1)
    stack = rng.standard_normal((3, 96, 40)).astype(np.float32)  # [L, in, out]
    if kind == "int8":
        w = quantize(stack, (96, 40), (0,))
    else:
        w = float_rows(jnp.asarray(stack, jnp.bfloat16), (96, 40), (0,))
    matmul = jax.jit(lambda x, w, i: quantized_matmul(x, w.of_layer(i)))
    for rows in (1, 5, 40, 300):
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        for i in (0, 2):
            one = QuantizedWeight(w.values[i], None if w.scales is None else w.scales[i], w.logical_shape, w.in_axes)
            want = np.asarray(quantized_matmul(x, one))
            np.testing.assert_allclose(np.asarray(matmul(x, w, i)), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    if native.available_variants():
        result = [jax.ShapeDtypeStruct((1, 40), jnp.float32)]
        if kind == "int8":  # x, layer, then the weights (int8: values and scales)
            call = jax.ffi.ffi_call(native.int8_matmul_target(), result)
            operands = (x[:1], np.int32(3), w.values, w.scales)
        else:
            call = jax.ffi.ffi_call(native.float_rows_matmul_target(), result)
            operands = (x[:1], np.int32(3), w.values)
        with pytest.raises(Exception, match="layer out of range"):
            call(*operands)


@pytest.mark.parametrize("tied, compute", [(False, "float32"), (True, "float32"), (True, "bfloat16")])
def test_int8_lm_head_matches_float64(default_model, tied, compute):
    """An int8 LM head (Q8_0 groups) of the default model's shape, tied (the embedding's rows) or not,
    computing in float32 or bfloat16: the logits of the rows the native kernel takes (one call) and of more
    (chunks of 4096 vocabulary columns, XLA's dequantize-then-dot in each, in the head's compute dtype)
    against the float64 reference of the hidden states as the head's dtype rounds them."""
    config = default_model.config
    rng = np.random.default_rng(5)
    head = rng.standard_normal((config.hidden_size, config.vocab_size)).astype(np.float32) * 0.05
    w = quantize(head, head.shape, (0,), group_size=32).replace(compute_dtype=compute)
    params = (default_model.params.replace(embed=w.T, lm_head=w) if tied
              else default_model.params.replace(lm_head=w))
    logits = jax.jit(lambda p, h: compute_logits(p, h, config=config))
    for rows in (1, NATIVE_MAX_ROWS + 5):
        hidden = rng.standard_normal((rows, config.hidden_size)).astype(np.float32)
        rounded = np.asarray(jnp.asarray(hidden).astype(compute).astype(jnp.float32))
        ref = _reference(rounded, np.asarray(w.values), np.asarray(w.scales))
        got = logits(params, hidden)
        assert got.dtype == jnp.float32 and got.shape == (rows, config.vocab_size)
        tol = 1e-5 if compute == "float32" or (rows <= NATIVE_MAX_ROWS and native.available_variants()) else 2 ** -7
        np.testing.assert_allclose(np.asarray(got), ref, rtol=tol, atol=tol * np.abs(ref).max())
        if compute == "bfloat16":  # the head rounded the hidden states, in one call and in chunks alike
            unrounded = _reference(hidden, np.asarray(w.values), np.asarray(w.scales))
            assert np.abs(np.asarray(got) - unrounded).max() > 1e-4 * np.abs(ref).max()


def test_native_kernel_is_the_few_row_path():
    """Where the native libraries are built, a few-row product is one FFI call (not XLA's dot)."""
    if not native.available_variants():
        pytest.skip("native kernels not built here")
    w = quantize(np.ones((64, 8), np.float32), (64, 8), (0,))
    hlo = jax.jit(quantized_matmul).lower(jnp.ones((2, 64)), w).as_text()
    assert "int8_matmul" in hlo and "dot_general" not in hlo


def test_quantize_layouts_round_trip():
    """Per-channel scales bound the error by half a step; the logical layouts (wo's two contracted
    axes, the embedding's last) give the einsums they replace; the embedding lookup is its rows."""
    rng = np.random.default_rng(0)
    wo = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)  # [L, heads, head_dim, hidden]
    q = quantize(wo, (3, 4, 8), (0, 1))
    assert q.shape == wo.shape and q.values.shape == (2, 8, 12) and q.scales.shape == (2, 8, 1)
    step = np.abs(wo).max(axis=(1, 2), keepdims=True) / 127
    assert np.all(np.abs(np.asarray(dequantize(q)) - wo) <= step / 2 + 1e-7)
    layer = jax.tree.map(lambda a: a[1], q)  # what the scan over layers hands the model
    attn = rng.standard_normal((5, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(quantized_matmul(attn, layer)),
                               np.einsum("tnd,ndh->th", attn, np.asarray(dequantize(q))[1]), rtol=1e-5, atol=1e-5)
    embed = quantize(rng.standard_normal((10, 8)).astype(np.float32), (10, 8), (1,), group_size=4)
    h = rng.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(quantized_matmul(h, embed)), h @ np.asarray(dequantize(embed)).T,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(quantized_matmul(h, embed.T)), h @ np.asarray(dequantize(embed)).T,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(take_rows(embed, jnp.asarray([3, 0]))),
                                  np.asarray(dequantize(embed))[[3, 0]])


def test_q8_0_gguf_matches_hf(tmp_path, monkeypatch, default_model, tokenizer_fields):
    """A tiny Qwen2 (a Llama with q/k/v biases and tied embeddings) written as llama.cpp's converter
    writes `--outtype q8_0` (every 2-D tensor Q8_0 by gguf-py's quantizer, 1-D ones float32) loads with
    its Q8_0 blocks as they are, and gives the logits and greedy tokens of HF transformers loading the
    same file."""
    torch.set_num_threads(1)
    model = build_family("qwen2", tmp_path / "hf", default_model.tokenizer)
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_q8_0(self, name, tensor, *args, **kwargs):
        if tensor.ndim == 2:
            return add_tensor(self, name, gguf.quants.quantize(tensor, Q8_0), raw_dtype=Q8_0)
        return add_tensor(self, name, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_q8_0)
    path = write_gguf(tmp_path / "tiny.q8_0.gguf", tmp_path / "hf", model.config, tokenizer_fields)
    monkeypatch.undo()
    loaded = loader.load_gguf(path, jnp.float32, quantization="int8")
    wq = loaded.params.layers.wq
    assert isinstance(wq, QuantizedWeight) and wq.scales.dtype == jnp.float16 and wq.group_size == 32
    assert isinstance(loaded.params.embed, QuantizedWeight) and loaded.params.embed.group_size == 32

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    tokens = [1, 450, 4996, 17354, 1701, 432, 432, 9, 28]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].numpy()
    (logits,) = sequence_logits(loaded.params, [tokens], config=loaded.config)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(np.asarray(logits), ref, rtol=0, atol=1e-4)  # float32 compute on the same weights

    from jpaged.entrypoints.llm import LLM
    llm = LLM(loaded=loaded, quantization="int8", num_blocks=16)
    ours = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                       ignore_eos=True))
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([tokens]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert list(ours[0].outputs[0].token_ids) == theirs[0, len(tokens):].tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_int8_agrees_with_float32(default_model, make_llm, llm, dtype):
    """The default model quantized per output channel, computing in float32 or (`dtype="bfloat16"`)
    bfloat16: greedy agreement with float32 (a floor, not exactness: int8 rounding moves close logits)."""
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,", "def add(a, b):"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    int8 = make_llm(quantization="int8", dtype=dtype)
    w_down = int8.engine.model.params.layers.w_down
    assert isinstance(w_down, QuantizedWeight) and w_down.dtype == jnp.dtype(dtype)
    ours = [r.outputs[0].token_ids for r in int8.generate(prompts, params)]
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, reference)]
    assert np.mean(prefixes) >= 6, prefixes


def test_bad_quantization_refused_before_loading():
    with pytest.raises(ValueError, match="quantization must be None or one of 'int8'"):
        EngineConfig(model="/nonexistent.gguf", quantization="int4")
    with pytest.raises(ValueError, match="one device"):
        EngineConfig(quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be"):
        quantize_params(None, "fp8")
