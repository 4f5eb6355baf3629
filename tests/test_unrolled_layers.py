"""Decode steps of few rows on one CPU device run the layers unrolled over per-layer views of the stacked
weights (`jpaged.device.params.unstack_layers`, `ModelRunner.unrolled_max_rows`): the views share the
stack's memory, and the unrolled step computes what the layer scan computes (logits and the K/V it
writes), for float32 and 16-bit-rows weights, on a family with per-layer windows, RoPE bases, biases,
q/k norms, sandwich norms and soft-caps. Agreement with HF transformers through the engine (whose float
decode steps take this path only without the native library, or with float16 weights: float rows and
int8 weights take the scan) is tests/test_families.py's."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.core.scheduler import Row
from jpaged.device.attention import native
from jpaged.device.attention.xla import XLABackend
from jpaged.device.config import ModelConfig
from jpaged.device.params import LayerParams, init_params, to_storage, unstack_layers
from jpaged.device.quant import QuantizedWeight, float_row_params, quantize_params
from jpaged.device.runner import UNROLLED_MAX_ROWS, ModelRunner, default_unrolled_max_rows

LLAMA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=512)
# Gemma-2/3-like: every per-layer and per-family option the layer body has
GEMMA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=32, max_position_embeddings=512, architecture="gemma3_text", local_rope_theta=10000.0,
                    rope_theta=1e6, layer_windows=(8, None, 8), attention_bias=True, qk_norm=True, norm_offset=1.0,
                    sandwich_norms=True, activation="gelu_tanh", embedding_scale=8.0, query_pre_attn_scalar=24,
                    attn_logit_softcap=5.0, final_logit_softcap=3.0)
BACKENDS = ["xla"] + (["native"] if native.available_variants() else [])


def test_per_layer_views_share_the_stacks_memory():
    params = init_params(LLAMA, jax.random.key(0))
    layers = unstack_layers(params.layers)
    assert len(layers) == LLAMA.num_layers and all(isinstance(p, LayerParams) for p in layers)
    for name in ("wq", "wo", "w_down", "attn_norm"):
        stack = getattr(params.layers, name)
        for i, layer in enumerate(layers):
            view = getattr(layer, name)
            np.testing.assert_array_equal(np.asarray(view), np.asarray(stack[i]))
            assert view.unsafe_buffer_pointer() == stack.unsafe_buffer_pointer() + i * view.nbytes


def test_int8_weights_keep_the_scan_and_sharded_or_stacked_defaults():
    params = init_params(LLAMA, jax.random.key(0))
    assert default_unrolled_max_rows(params, sharded=False) == UNROLLED_MAX_ROWS
    assert default_unrolled_max_rows(params, sharded=True) == 0
    assert default_unrolled_max_rows(quantize_params(params, "int8"), sharded=False) == 0
    plain16 = to_storage(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))  # bits, as without the library
    assert default_unrolled_max_rows(plain16, sharded=False) == 0
    if native.available_variants():  # float rows, 16-bit or float32: the scan, which reads them in place
        rows16 = float_row_params(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
        assert default_unrolled_max_rows(to_storage(rows16), sharded=False) == 0
        rows32 = float_row_params(params)
        assert isinstance(rows32.layers.wq, QuantizedWeight) and rows32.layers.wq.values.dtype == jnp.float32
        assert default_unrolled_max_rows(rows32, sharded=False) == 0


def _decode_rows(n: int) -> list[Row]:
    """n rows of one token each, at different context lengths (blocks of 8 tokens: row r owns 3 blocks)."""
    rows = []
    for r in range(n):
        position = 5 + 4 * r
        table = [1 + 3 * r, 2 + 3 * r, 3 + 3 * r]
        rows.append(Row([7 + r], position, [table[position // 8] * 8 + position % 8], table))
    return rows


def _prefill_rows(n: int) -> list[Row]:
    """The context the decode rows attend to: row r's first 5 + 4r tokens."""
    rows = []
    for r in range(n):
        length, table = 5 + 4 * r, [1 + 3 * r, 2 + 3 * r, 3 + 3 * r]
        rows.append(Row([(11 * r + 3 * p) % 256 for p in range(length)], 0,
                        [table[p // 8] * 8 + p % 8 for p in range(length)], table))
    return rows


@pytest.mark.parametrize("weights", ["float32", "float32-rows", "bfloat16-rows"])
@pytest.mark.parametrize("config", [LLAMA, GEMMA], ids=["llama", "gemma"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unrolled_decode_step_computes_what_the_scan_does(config, weights, backend):
    params = init_params(config, jax.random.key(1), scale=0.15)
    if weights == "bfloat16-rows":
        params = to_storage(float_row_params(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)))
    elif weights == "float32-rows":
        params = float_row_params(params)
    results = {}
    for unrolled in (UNROLLED_MAX_ROWS, 0):
        runner = ModelRunner(config, params, num_blocks=16, block_size=8, unrolled_max_rows=unrolled,
                             backend=XLABackend() if backend == "xla" else native.NativeBackend())
        runner.execute(_prefill_rows(3), decode=False)
        logits = np.asarray(runner.execute(_decode_rows(3), decode=True))[:3]
        (decode_key,) = [key for key in runner.executables if key[0] == "decode_step"]
        results[unrolled] = logits, np.asarray(runner.cache.kv), decode_key
        if weights == "float32-rows" and native.available_variants():  # q/k/v one call, gate/up one: 4 a layer
            hlo = runner.executables[decode_key].as_text()
            calls = len(re.findall(r'custom_call_target="[^"]*float_rows_matmul', hlo))
            assert calls == 4 * (config.num_layers if unrolled else 1) + 1, (unrolled, calls)  # + the head
    (unrolled_logits, unrolled_kv, unrolled_key), (scan_logits, scan_kv, scan_key) = results.values()
    assert unrolled_key != scan_key  # the two forms are two executables (one leaf a layer against the stacks)
    np.testing.assert_allclose(unrolled_logits, scan_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(unrolled_kv, scan_kv, rtol=1e-6, atol=1e-6)
    assert np.abs(scan_logits).max() > 0.1  # not a vacuous comparison of zeros


def test_decode_steps_past_the_limit_and_prefill_take_the_stack():
    runner = ModelRunner(LLAMA, init_params(LLAMA, jax.random.key(0)), num_blocks=16, block_size=8, unrolled_max_rows=2,
                         backend=XLABackend())
    assert isinstance(runner._step_params(True, 2).layers, tuple)
    assert isinstance(runner._step_params(True, 4).layers, LayerParams)
    assert isinstance(runner._step_params(False, 1).layers, LayerParams)
    off = ModelRunner(LLAMA, init_params(LLAMA, jax.random.key(0)), num_blocks=16, block_size=8, unrolled_max_rows=0,
                      backend=XLABackend())
    assert isinstance(off._step_params(True, 1).layers, LayerParams)
    assert not any(isinstance(leaf, QuantizedWeight) for leaf in jax.tree.leaves(off.params))
