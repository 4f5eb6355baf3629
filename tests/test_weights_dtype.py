"""16-bit parameters (issue 33): `dtype="bfloat16"` / `"float16"` stores the parameters in 16 bits (on a
CPU too, bfloat16 held by the runner as its bit patterns), every matmul accumulates in float32, and
float32 is what it was."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import chat_token_ids
from jpaged import SamplingParams
from jpaged.device import quant
from jpaged.device.attention import native
from jpaged.device.model import compute_logits
from jpaged.device.params import BF16_BITS, cast_params, num_params, to_storage
from jpaged.device.quant import (AMX_MAX_ROWS, NATIVE16_MAX_ROWS, NATIVE32_MAX_ROWS, WIDEN16_MIN_ROWS, QuantizedWeight,
                                 dequantize, float_rows, quantize, quantized_matmul, take_rows)

on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU storage form of bfloat16 parameters")


def native_rows_product(variant: str, x: np.ndarray, values) -> np.ndarray:
    """The native float-rows kernel of `variant` alone: x f32[M, K] by weight rows `values` [N, K] -> f32[M, N]."""
    out = jax.ShapeDtypeStruct((x.shape[0], values.shape[-2]), jnp.float32)
    return np.asarray(jax.ffi.ffi_call(native.float_rows_matmul_target(variant), [out])(x, np.int32(0), values)[0])


NUM_TOKENS = 16


@pytest.fixture(scope="module")
def bf16_llm(make_llm):
    return make_llm(dtype="bfloat16", num_blocks=64)


def unique_bytes(*trees) -> int:
    """The bytes of the distinct buffers among the trees' arrays (views of one buffer counted once)."""
    buffers = {x.unsafe_buffer_pointer(): x.nbytes for tree in trees for x in jax.tree.leaves(tree)}
    return sum(buffers.values())


@on_cpu
def test_bfloat16_parameters_are_stored_in_16_bits_once(bf16_llm, llm, default_model):
    engine = bf16_llm.engine
    served, stored = engine.model.params, engine.runner.params  # the runner's: bit patterns of the model's
    assert engine.param_dtype == jnp.bfloat16
    assert all(x.dtype in (jnp.bfloat16, BF16_BITS) for x in jax.tree.leaves(served))
    assert all(x.dtype == BF16_BITS for x in jax.tree.leaves(stored))
    # one copy of every weight: what the runner reads is the model's own memory
    assert unique_bytes(served, stored) == 2 * num_params(engine.model.config)
    if native.available_variants():  # dense weights as [out, in] rows for the native few-row kernel
        assert isinstance(stored.layers.w_up, QuantizedWeight) and stored.layers.w_up.is_16bit
        assert stored.lm_head.values is stored.embed.values  # the tied head: a view of the embedding
    f32 = llm.engine  # float32: [out, in] rows of the same values where the native kernel is built
    assert f32.param_dtype == jnp.float32 and all(x.dtype == jnp.float32 for x in jax.tree.leaves(f32.runner.params))
    assert unique_bytes(f32.model.params, f32.runner.params) == 4 * num_params(f32.model.config)
    wq = f32.runner.params.layers.wq
    if native.available_variants():
        assert isinstance(wq, QuantizedWeight) and wq.values.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(quant.dequantize(wq)), np.asarray(default_model.params.layers.wq))
    else:
        assert wq is default_model.params.layers.wq


@on_cpu
def test_an_engine_keeps_no_copy_of_the_weights_its_rows_came_from(default_model, llm, bf16_llm):
    """The float rows replace the arrays they were transposed from: once the caller lets go of those,
    they are freed, and the engine (whose model holds the rows) still serves the same tokens."""
    import gc
    import weakref

    from jpaged import LLM

    params = jax.tree.map(lambda x: x + 0, default_model.params)  # arrays of their own, only held here
    w_up = weakref.ref(params.layers.w_up)
    tuned = LLM(loaded=default_model, params=params, num_blocks=16)
    del params
    gc.collect()
    assert (w_up() is None) == bool(native.available_variants())  # transposed into rows, then freed
    again = LLM(loaded=tuned.engine.model, num_blocks=16)  # a served model serves again as it is
    greedy, prompt = SamplingParams(temperature=0, max_tokens=8), ["The capital of France is"]
    want = llm.generate(prompt, greedy)[0].outputs[0].token_ids  # the same values, the shared engine's
    assert tuned.generate(prompt, greedy)[0].outputs[0].token_ids == want
    assert again.generate(prompt, greedy)[0].outputs[0].token_ids == want
    # served at another width, the rows are cast as the arrays would be: the bfloat16 engine's tokens
    narrower = LLM(loaded=tuned.engine.model, num_blocks=16, dtype="bfloat16")
    stored = narrower.engine.runner.params
    assert all(x.dtype == BF16_BITS for x in jax.tree.leaves(stored))
    if native.available_variants():  # rows again, the tied head a view of the embedding's
        assert stored.lm_head.values is stored.embed.values
    assert narrower.generate(prompt, greedy)[0].outputs[0].token_ids == \
        bf16_llm.generate(prompt, greedy)[0].outputs[0].token_ids


def huge_page_bytes(ranges) -> int:
    """The bytes of 2 MiB pages (/proc/self/smaps' AnonHugePages) in the mappings that overlap any of `ranges`
    ([start, end) address pairs), each mapping counted once."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(v, 16) for v in head.split("-"))
            overlaps = any(start < high and low < end for start, end in ranges)
        elif head == "AnonHugePages:" and overlaps:
            total += int(line.split()[1]) * 1024
    return total


def huge_pages_allowed() -> bool:
    """Whether this Linux collapses pages on request: transparent huge pages not off, and MADV_COLLAPSE (6.1)."""
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not enabled.exists() or "[never]" in enabled.read_text():
        return False
    import platform
    import re
    version = re.match(r"(\d+)\.(\d+)", platform.release())
    return version is not None and (int(version[1]), int(version[2])) >= (6, 1)


@on_cpu
def test_an_engines_weights_are_on_huge_pages_where_linux_allows(bf16_llm):
    """A CPU engine's weights, read whole every decode step, are collapsed onto 2 MiB pages
    (jpaged.device.huge_pages), their values unchanged."""
    from jpaged.device.huge_pages import advise_huge_pages, huge_range

    if not huge_pages_allowed():
        pytest.skip("this Linux does not collapse pages into transparent huge pages on request")
    x = jnp.arange(3 * 2**20, dtype=jnp.float32) + 1  # 12 MiB of its own: at least 5 whole huge pages
    start, end = huge_range(x.unsafe_buffer_pointer(), x.nbytes)
    assert advise_huge_pages({"x": x}) == end - start
    assert huge_page_bytes([(start, end)]) >= end - start
    np.testing.assert_array_equal(np.asarray(x), np.arange(3 * 2**20, dtype=np.float32) + 1)
    # the engine's: nearly all of its weights' whole huge pages (written on 4 KiB pages where transparent huge
    # pages are "madvise": without the engine's advice, none of the bfloat16 weights' were, where this was written)
    ranges = {huge_range(a.unsafe_buffer_pointer(), a.nbytes) for a in jax.tree.leaves(bf16_llm.engine.model.params)}
    ranges = [r for r in ranges if r[0] < r[1]]  # a tied head's view of the embedding once
    wanted = sum(end - start for start, end in ranges)
    assert wanted > 0 and huge_page_bytes(ranges) >= 0.9 * wanted


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_accumulates_and_returns_float32(default_model, dtype, tied):
    """Each logit is 575 x 4 + 5 = 2305: exact in float32, 2304 in either 16-bit dtype (8 / 11
    significant bits), so a 16-bit accumulation or result would show. 16-bit bfloat16 heads in their
    storage form, 49152 columns: on a CPU the chunked head."""
    config = default_model.config
    head = np.full((config.hidden_size, config.vocab_size), 4.0, np.float32)
    head[0] = 5.0
    params = default_model.params.replace(lm_head=None if tied else jnp.asarray(head),
                                          embed=jnp.asarray(head.T) if tied else default_model.params.embed)
    params = to_storage(cast_params(params, dtype))
    hidden = jnp.ones((3, config.hidden_size), jnp.float32)
    logits = jax.jit(lambda p, h: compute_logits(p, h, config=config))(params, hidden)
    assert logits.dtype == jnp.float32 and logits.shape == (3, config.vocab_size)
    np.testing.assert_array_equal(np.asarray(logits), 2305.0)


def test_bfloat16_greedy_agrees_with_float32(bf16_llm, llm, alpaca_prompts):
    """The same greedy requests: first-token log-probabilities close to float32's, and the tokens mostly
    float32's (measured: `bench/weights_dtype.py`)."""
    prompts = [chat_token_ids(llm.tokenizer, p) for p in alpaca_prompts[:4]]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    want, got = (m.generate(prompts, params, use_tqdm=False) for m in (llm, bf16_llm))
    prefixes = []
    for a, b in zip(want, got):
        ref, out = a.outputs[0], b.outputs[0]
        top_ref, top = ref.logprobs[0], out.logprobs[0]
        for token in set(top_ref) & set(top):  # float32 accumulation: log-probabilities within 0.15 nats
            assert abs(top_ref[token] - top[token]) < 0.15, (token, top_ref[token], top[token])
        assert ref.token_ids[0] == out.token_ids[0]
        prefixes.append(next((i for i, (x, y) in enumerate(zip(ref.token_ids, out.token_ids)) if x != y), NUM_TOKENS))
    assert sum(p == NUM_TOKENS for p in prefixes) >= len(prompts) // 2 and np.mean(prefixes) >= NUM_TOKENS / 2, prefixes


@pytest.mark.skipif(not native.available_variants(), reason="the native 16-bit kernel is not built")
@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_rows_lm_head_accumulates_in_float32(default_model, tied):
    """`test_lm_head_accumulates_and_returns_float32` on 16-bit rows (`float_row_params`): one row
    (the native kernel), a few (chunks of 4096 columns, native; with AMX one call), more than
    `native16_max_rows()` (chunks, XLA's dot; with AMX one native call) and more than `AMX_MAX_ROWS`
    (chunks, XLA's dot)."""
    config = default_model.config
    head = np.full((config.hidden_size, config.vocab_size), 4.0, np.float32)
    head[0] = 5.0
    params = default_model.params.replace(lm_head=None if tied else jnp.asarray(head),
                                          embed=jnp.asarray(head.T) if tied else default_model.params.embed)
    params = to_storage(quant.float_row_params(cast_params(params, jnp.bfloat16)))
    assert isinstance(params.lm_head, QuantizedWeight) and (params.lm_head.values is params.embed.values) == tied
    for rows in (1, 3, quant.native16_max_rows() + 2, AMX_MAX_ROWS + 1):
        hidden = jnp.ones((rows, config.hidden_size), jnp.float32)
        logits = jax.jit(lambda p, h: compute_logits(p, h, config=config))(params, hidden)
        assert logits.dtype == jnp.float32 and logits.shape == (rows, config.vocab_size)
        np.testing.assert_array_equal(np.asarray(logits), 2305.0)


@pytest.mark.parametrize("k, n", [(64, 19), (50, 7), (33, 5), (96, 200), (64, 8200)])
def test_float_rows_matmul_matches_float64(k, n):
    """The native float-rows kernel in every variant built (bfloat16 as bits and as bfloat16, float16, float32) and
    `quantized_matmul` of 16-bit rows (native for few rows, XLA's bf16 dot for more), against float64,
    at sizes that are not multiples of the vectors. bfloat16 weights take x rounded to bfloat16. Where
    the CPU has AMX-BF16 (`native.amx_bf16()`), K = 64 and 96 run on the tiles: 17 and 33
    rows leave a B tile half empty, 300 rows span two row chunks, 19, 200 and 8200 channels end in
    channels past the last whole tile, and 8200 take the wide outputs' work items."""
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((n, k)).astype(jnp.bfloat16)
    for rows in (1, 2, 5, 9, 17, 33, 300):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        xb = x.astype(jnp.bfloat16).astype(np.float64)
        for variant in native.available_variants():
            for values in (w.view(np.uint16), w, w.astype(np.float16), w.astype(np.float32)):
                ref = x.astype(np.float64) @ values.astype(np.float64).T if values.dtype in (np.float16, np.float32) \
                    else xb @ w.astype(np.float64).T
                np.testing.assert_allclose(native_rows_product(variant, x, values), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(),
                                           err_msg=f"{variant} {values.dtype} {rows} rows")
    rows16 = float_rows(jnp.asarray(w.T), (k, n), (0,))  # logical [in, out]
    assert rows16.values.dtype == jnp.uint16 and rows16.values.shape == (n, k) and rows16.dtype == jnp.bfloat16
    for rows in (1, quant.native16_max_rows() + 2, AMX_MAX_ROWS + 1):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        xb = x.astype(jnp.bfloat16).astype(np.float64)  # the activations rounded to bfloat16, as the model does
        ref = xb @ w.astype(np.float64).T
        np.testing.assert_allclose(np.asarray(jax.jit(quantized_matmul)(x, rows16)), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())
    view = rows16.T  # [out, in] logical: the rows themselves (the embedding's lookup)
    np.testing.assert_array_equal(np.asarray(take_rows(view, jnp.asarray([3, 0]))).astype(np.float32),
                                  w[[3, 0]].astype(np.float32))
    w32 = rng.standard_normal((n, k)).astype(np.float32)  # float32 rows: x as it is, native up to NATIVE32_MAX_ROWS
    rows32 = float_rows(jnp.asarray(w32.T), (k, n), (0,))
    assert rows32.values.dtype == jnp.float32 and rows32.values.shape == (n, k) and rows32.dtype == jnp.float32
    if native.available_variants():  # a head-wide float32 weight too
        assert quant.native_max_rows(rows32) == NATIVE32_MAX_ROWS
    for rows in (1, NATIVE32_MAX_ROWS, NATIVE32_MAX_ROWS + 1):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        ref = x.astype(np.float64) @ w32.astype(np.float64).T
        np.testing.assert_allclose(np.asarray(jax.jit(quantized_matmul)(x, rows32)), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(take_rows(rows32.T, jnp.asarray([3, 0]))), w32[[3, 0]])


@pytest.mark.parametrize("variants, bf16_dot, amx, rows", [
    (("avx2", "portable"), False, False, quant.AVX2_16_MAX_ROWS),
    (("avx512", "avx2", "portable"), False, False, NATIVE16_MAX_ROWS),
    (("avx512", "avx2", "portable"), True, False, quant.DOT16_MAX_ROWS),
    (("avx512", "avx2", "portable"), True, True, AMX_MAX_ROWS)])
def test_16bit_native_rows_by_the_library_and_cpu(monkeypatch, variants, bf16_dot, amx, rows):
    """The rows up to which 16-bit products take the native kernel: by the instructions it runs them on (AMX tiles,
    VDPBF16PS) and, without those, by the library (the AVX2 one beats XLA's bf16 dot to 32 rows; quant's docstring)."""
    monkeypatch.setattr(quant, "_float_rows_target", lambda: "target")
    monkeypatch.setattr(native, "available_variants", lambda: variants)
    monkeypatch.setattr(native, "avx512_bf16", lambda variant="auto": bf16_dot)
    monkeypatch.setattr(native, "amx_bf16", lambda variant="auto": amx)
    assert quant.native16_max_rows() == rows


@pytest.mark.skipif(not native.available_variants(), reason="the native library is not built")
@pytest.mark.parametrize("has_bf16_dot", [False, True])
def test_many_16bit_rows_widen_to_float32_where_the_cpu_has_no_bf16_dot(monkeypatch, has_bf16_dot):
    """XLA's products of 16-bit rows and of int8 computing in bfloat16 take float32 operands from WIDEN16_MIN_ROWS
    rows on where the CPU has no bfloat16 dot instruction (`quant.widens_16bit`), bfloat16 ones below those rows
    and where it has one; the products are the same (the bfloat16 operands widen exactly), against float64."""
    monkeypatch.setattr(native, "avx512_bf16", lambda variant="auto": has_bf16_dot)
    monkeypatch.setattr(native, "amx_bf16", lambda variant="auto": False)
    assert quant.widens_16bit() is not has_bf16_dot
    rng = np.random.default_rng(3)
    k, n = 96, 40
    w = rng.standard_normal((k, n)).astype(np.float32)  # logical [in, out]
    int8 = quantize(jnp.asarray(w), (k, n), (0,), group_size=32).replace(compute_dtype="bfloat16")
    bf16_rows = float_rows(jnp.asarray(w).astype(jnp.bfloat16), (k, n), (0,))
    for weight, w64 in ((bf16_rows, w.astype(jnp.bfloat16).astype(np.float64)),
                        (int8, np.asarray(dequantize(int8)).astype(jnp.bfloat16).astype(np.float64))):
        for rows in (WIDEN16_MIN_ROWS - 1, WIDEN16_MIN_ROWS):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            product = jax.jit(lambda x, w: quantized_matmul(x, w))  # traced anew: widens_16bit is patched
            hlo = product.lower(x, weight).as_text()
            widened = rows >= WIDEN16_MIN_ROWS and not has_bf16_dot
            dots = [line for line in hlo.splitlines() if "dot_general" in line]
            assert dots and all(("tensor<%dx%dxf32>" % (rows, k) in d) is widened
                                and ("tensor<%dx%dxbf16>" % (rows, k) in d) is not widened for d in dots), dots
            ref = x.astype(jnp.bfloat16).astype(np.float64) @ w64
            np.testing.assert_allclose(np.asarray(product(x, weight)), ref, rtol=1e-5,
                                       atol=1e-5 * np.abs(ref).max(), err_msg=f"{rows} rows")


@pytest.mark.skipif(not native.available_variants(), reason="the native kernel is not built")
@pytest.mark.parametrize("kind", ["bfloat16", "float32", "int8"])
def test_several_weights_of_one_x_are_one_native_call(kind):
    """`quantized_matmuls` of float rows or int8 weights (q, k and v; gate and up): one native call with a
    result per weight, each equal bit for bit to that weight's own `quantized_matmul` (the same kernel, the
    same sums), for a layer of a stack too; weights the kernel does not take together go one by one; and
    the kernel refuses weights of two dtypes, more than 4 weights and a result of the wrong shape with a
    message."""
    rng = np.random.default_rng(7)
    shapes = [(96, 4, 16), (96, 2, 16), (96, 2, 16)]  # [hidden, heads, head_dim]: q, k, v of a GQA layer
    stacks = [rng.standard_normal((3, *shape)).astype(np.float32) for shape in shapes]

    def weight(a, shape, kind):
        if kind == "int8":  # k and v with Q8_0's blocks of 32 inputs, q per channel
            return quantize(a, shape, (0,), group_size=32 if shape == shapes[1] else None)
        return float_rows(jnp.asarray(a, kind), shape, (0,))

    ws = [weight(a, shape, kind) for a, shape in zip(stacks, shapes)]
    fused = jax.jit(lambda x, ws, i: quant.quantized_matmuls(x, [w.of_layer(i) for w in ws]))
    alone = jax.jit(lambda x, w, i: quantized_matmul(x, w.of_layer(i)))
    name = "int8_matmul" if kind == "int8" else "float_rows_matmul"
    limit = min(quant.native_max_rows(w) for w in ws)
    for rows in (1, limit, limit + 1):
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        for layer in (0, 2):
            got = fused(x, ws, layer)
            for g, w in zip(got, ws):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(alone(x, w, layer)), err_msg=f"{rows} rows")
        hlo = fused.lower(x, ws, 0).as_text()
        assert hlo.count(name) == (1 if rows <= limit else 0), rows
    other = {"bfloat16": "float32", "float32": "bfloat16", "int8": "bfloat16"}[kind]
    mixed = [ws[0], weight(stacks[1], shapes[1], other)]
    got = fused(x[:1], mixed, 1)  # two dtypes: one call each
    hlo = fused.lower(x[:1], mixed, 1).as_text()
    assert hlo.count("int8_matmul") + hlo.count("float_rows_matmul") == 2
    for g, w in zip(got, mixed):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(alone(x[:1], w, 1)))
    out = jax.ShapeDtypeStruct((1, 32), jnp.float32)
    if kind == "int8":
        target, operands = native.int8_matmul_target(), lambda *ws: [a for w in ws for a in (w.values, w.scales)]
        half = ws[1].replace(scales=ws[1].scales.astype(jnp.float16))
        with pytest.raises(Exception, match="share a dtype"):
            jax.ffi.ffi_call(target, [out, out])(x[:1], np.int32(0), *operands(ws[1], half))
    else:
        target, operands = native.float_rows_matmul_target(), lambda *ws: [w.values for w in ws]
        with pytest.raises(Exception, match="share a dtype"):
            jax.ffi.ffi_call(target, [out, out])(x[:1], np.int32(0), *operands(ws[1], mixed[1]))
    with pytest.raises(Exception, match="1 to 4 weights"):
        jax.ffi.ffi_call(target, [out] * 5)(x[:1], np.int32(0), *operands(*[ws[1]] * 5))
    with pytest.raises(Exception, match="each result must be"):  # k's 32 channels, a result of 33
        jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct((1, 33), jnp.float32)])(x[:1], np.int32(0), *operands(ws[1]))


def assert_greedy_close(want, got, nats: float) -> None:
    """Two greedy completions (with `logprobs`) of the same prompt by two implementations of the same
    arithmetic: the same tokens, their log-probabilities within `nats`, up to the first token where they
    differ; there each one's pick is in the other's top log-probabilities, and a near tie in both (each
    leads the other's pick by less than `nats`). Past it the two continue different texts."""
    for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
        top_a, top_b = want.logprobs[i], got.logprobs[i]
        if a == b:
            assert abs(top_a[a] - top_b[b]) < nats, (i, a, top_a[a], top_b[b])
            continue
        assert a in top_b and b in top_a, (i, top_a, top_b)
        assert top_a[a] - top_a[b] < nats and top_b[b] - top_b[a] < nats, (i, top_a, top_b)
        return


@on_cpu
@pytest.mark.skipif(not native.available_variants(), reason="the native kernel is not built")
def test_float32_native_rows_give_the_xla_paths_tokens(llm, make_llm, monkeypatch, alpaca_prompts):
    """float32 weights as [out, in] rows (`float_row_params`, the engine's default on one CPU: the native
    kernel up to `NATIVE32_MAX_ROWS` rows, XLA's dot of the rows past them) give the greedy tokens of XLA's
    einsums on the parameters' own layout (the engine before), one stream and 4 at once, with
    log-probabilities within 1e-3 nats (float32 products, sums in another order), up to a near tie."""
    prompts = [chat_token_ids(llm.tokenizer, p) for p in alpaca_prompts[:4]]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    monkeypatch.setattr("jpaged.engine.llm_engine.float_row_params", lambda p: p)
    xla = make_llm(dtype="float32")
    monkeypatch.undo()
    assert not isinstance(xla.engine.runner.params.layers.wq, QuantizedWeight)
    assert isinstance(llm.engine.runner.params.layers.wq, QuantizedWeight)
    for batch in ([prompts[0]], prompts):
        want, got = (m.generate(batch, params, use_tqdm=False) for m in (xla, llm))
        for a, b in zip(want, got):
            assert_greedy_close(a.outputs[0], b.outputs[0], nats=1e-3)


@pytest.mark.skipif(not native.available_variants(), reason="the native kernel is not built")
def test_float_rows_sum_a_row_alike_in_every_batch_up_to_native32_max_rows():
    """Batch invariance of float-rows products, bit for bit: a row's `quantized_matmul` by float32 rows is the
    same alone and among any rows up to `NATIVE32_MAX_ROWS` (every decode step of that many rows; XLA's dot
    sums one row alone differently from the same row among two), at the default model's widths and at K not a
    multiple of the lanes; and every native variant sums a row the same among 1 to 40 rows, for float32 and
    bfloat16 rows alike (one row takes its own loop over K, several inputs an iteration: `kOneRowSteps`)."""
    rng = np.random.default_rng(3)
    product = jax.jit(quantized_matmul)
    for k, n in ((576, 192), (1536, 64), (80, 70)):
        rows32 = float_rows(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)), (k, n), (0,))
        rows16 = float_rows(jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16), (k, n), (0,))
        x = rng.standard_normal((40, k)).astype(np.float32)
        among = np.asarray(product(x[:NATIVE32_MAX_ROWS], rows32))
        for m in (1, 2, 3, 8, 9, NATIVE32_MAX_ROWS - 1):
            np.testing.assert_array_equal(np.asarray(product(x[:m], rows32)), among[:m], err_msg=f"K {k}, {m} rows")
        for variant in native.available_variants():
            for rows in (rows32, rows16):
                many = native_rows_product(variant, x, rows.values)
                for m in (1, 2, 5, 16, 33):
                    np.testing.assert_array_equal(native_rows_product(variant, x[:m], rows.values), many[:m],
                                                  err_msg=f"{variant}, {rows.values.dtype}, K {k}, {m} rows")


@on_cpu
@pytest.mark.skipif(not native.available_variants(), reason="the native 16-bit kernel is not built")
def test_bfloat16_native_rows_give_the_xla_paths_tokens(bf16_llm, make_llm, monkeypatch, alpaca_prompts):
    """One stream (one row: the native kernel) gives the greedy tokens of the pre-change bfloat16 engine
    (XLA's bf16 einsums on the parameters' own layout), prompt by prompt, up to a near tie (as vLLM's
    `check_logprobs_close`: the two sum the same bfloat16 products in different orders, and the chosen
    tokens' log-probabilities differ by up to 0.04 nats, measured over 8 prompts, so a lead of 0.006
    nats can flip); and the self-draft path (`forward(num_layers=)`) runs on the rows."""
    prompts = [chat_token_ids(bf16_llm.tokenizer, p) for p in alpaca_prompts[:3]]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    monkeypatch.setattr("jpaged.engine.llm_engine.float_row_params", lambda p: p)
    xla = make_llm(dtype="bfloat16", num_blocks=64)
    monkeypatch.undo()
    assert not isinstance(xla.engine.runner.params.layers.wq, QuantizedWeight)
    assert isinstance(bf16_llm.engine.runner.params.layers.wq, QuantizedWeight)
    for prompt in prompts:
        want, got = (m.generate([prompt], params, use_tqdm=False)[0].outputs[0] for m in (xla, bf16_llm))
        assert_greedy_close(want, got, nats=0.1)
    draft = make_llm(dtype="bfloat16", num_blocks=64, speculative_method="draft-layers", num_speculative_tokens=2)
    assert isinstance(draft.engine.runner.params.layers.wq, QuantizedWeight)
    got = draft.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == NUM_TOKENS
    assert quant.NATIVE16_MAX_ROWS >= 1


@pytest.mark.skipif("avx512" not in native.available_variants(), reason="the AVX-512 native library is not built here")
def test_amx_tiles_are_used_where_the_cpu_has_them():
    """The AVX-512 library runs bfloat16 products on AMX tiles exactly where the CPU lists AMX-BF16 (and
    Linux, which lists it, grants the tile state); there 16-bit products of up to `AMX_MAX_ROWS` rows
    take the native kernel, on VDPBF16PS up to `DOT16_MAX_ROWS`, elsewhere up to `NATIVE16_MAX_ROWS`. The other
    builds never use the tiles."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    assert native.amx_bf16() == ({"amx_bf16", "amx_tile"} <= flags)
    assert quant.native16_max_rows() == (AMX_MAX_ROWS if native.amx_bf16() else quant.DOT16_MAX_ROWS
                                         if native.avx512_bf16() else NATIVE16_MAX_ROWS)
    assert not any(native.amx_bf16(v) for v in native.available_variants() if v != "avx512")


@pytest.mark.skipif("avx512" not in native.available_variants(), reason="the AVX-512 native library is not built here")
def test_avx512_bf16_is_used_where_the_cpu_has_it_and_no_amx():
    """The AVX-512 library runs bfloat16 products on VDPBF16PS exactly where the CPU lists AVX512-BF16 and the
    AMX tiles do not take them; the other builds never do. On any path a row's products are the same bit for
    bit whatever rows share its call (1 to 3 rows alone, and inside 8 and 19), at K a multiple of 32 and not."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    assert native.avx512_bf16() == ("avx512_bf16" in flags and not native.amx_bf16())
    assert not any(native.avx512_bf16(v) for v in native.available_variants() if v != "avx512")
    rng = np.random.default_rng(7)
    for k, n in ((576, 200), (80, 70)):
        w = rng.standard_normal((n, k)).astype(jnp.bfloat16).view(np.uint16)
        x = rng.standard_normal((19, k)).astype(np.float32)
        for variant in native.available_variants():
            many = {m: native_rows_product(variant, x[:m], w) for m in (8, 19)}
            for m in (1, 2, 3):
                alone = native_rows_product(variant, x[:m], w)
                for rows in many.values():
                    np.testing.assert_array_equal(alone, rows[:m], err_msg=f"{variant}, K {k}, {m} rows")
