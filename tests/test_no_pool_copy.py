"""The KV pool is never copied by a step: the compiled decode and prefill steps alias the donated
pool to their output and contain no copy of it (a slice of a layer out of the stacked pool, or
the pool threaded through the layer scan as scanned input/output, would show up here)."""

from __future__ import annotations

import re

import jax
import pytest

from jpaged.device.attention import native
from jpaged.device.attention.xla import XLABackend
from jpaged.device.config import ModelConfig
from jpaged.device.params import init_params
from jpaged.device.runner import ModelRunner
from jpaged.core.scheduler import Row

CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=512)
NUM_BLOCKS, BLOCK_SIZE = 97, 8  # an odd count so the pool's shape is unmistakable in the HLO


BACKENDS = ["xla"] + (["native"] if native.available_variants() else [])  # the native kernel reads it in place too


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decode", [True, False])
def test_compiled_step_updates_the_pool_in_place(decode, backend):
    runner = ModelRunner(CONFIG, init_params(CONFIG, jax.random.key(0)), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         backend=XLABackend() if backend == "xla" else native.NativeBackend())
    rows = [Row([5] if decode else [5, 6, 7], 3 if decode else 0, [16 + 3] if decode else [16, 17, 18], [2, 9])]
    before = runner.cache.k
    runner.execute(rows, decode=decode)
    assert before.is_deleted()  # the donated buffer was consumed, not kept alongside a copy
    (executable,) = runner.executables.values()
    hlo = executable.as_text()
    pool = f"f32[{CONFIG.num_layers},{NUM_BLOCKS},{BLOCK_SIZE},{CONFIG.num_kv_heads},{CONFIG.head_dim}]"
    assert "input_output_alias" in hlo
    copies = [line for line in hlo.splitlines() if re.search(rf"= {re.escape(pool)}\S* copy\(", line)]
    assert copies == [], copies
    layer_slices = [line for line in hlo.splitlines()
                    if re.search(rf"= f32\[{NUM_BLOCKS},{BLOCK_SIZE},{CONFIG.num_kv_heads},{CONFIG.head_dim}\]", line)]
    assert layer_slices == [], layer_slices  # no whole layer of the pool is ever materialised
