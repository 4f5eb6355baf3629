"""The kernels' Triton IR compiles for an H200 (sm_90a) without spilling: a GPU-less check.

Needs jax >= 0.11 (the GPU machines' release) and the upstream ``triton`` package, which is not a
project dependency (``pip install triton`` in a Python 3.12 environment); skipped otherwise.
See ``bench/triton_check.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import _compat, copy_blocks, paged_attention, write_kv

pytest.importorskip("triton")
if _compat.JAX_VERSION < (0, 11):
    pytest.skip("the GPU machines run jax 0.11; its Triton IR is what matters", allow_module_level=True)

from bench import triton_check as _triton_check  # noqa: E402

spec = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_paged_attention_compiles_for_sm90_without_spills(heads, kv_heads, head_dim, dtype):
    pool = spec((30, 4096, 2, 16, kv_heads, head_dim), dtype)  # K and V side by side
    fn = functools.partial(paged_attention, scale=head_dim**-0.5)
    [module] = _triton_check.triton_modules(
        fn, spec((32, heads, head_dim), dtype), pool, spec((32, 256), jnp.int32),
        spec((32,), jnp.int32), layer=spec((), jnp.int32),
    )
    stats = _triton_check.compile_for_sm90(module)
    assert stats["mma_instructions"] > 0, stats  # the dots run on tensor cores
    assert stats.get("spill_bytes", 0) == 0, stats
    assert stats["shared_bytes"] <= 227 * 1024, stats
    # The split's block ids are read before the loop, so Triton pipelines the K/V copies: two
    # buffers each, the next tile's copy in flight while this one is computed.
    assert stats["copy_buffers"] >= 2, stats


def test_paged_attention_one_stage_does_not_overlap():
    """The check above means something: with num_stages=2 each K/V copy gets one buffer (issued
    after the previous tile's compute), what the first GPU run's kernel had."""
    pool = spec((30, 4096, 2, 16, 8, 128), jnp.bfloat16)
    fn = functools.partial(paged_attention, scale=128**-0.5, num_stages=2)
    [module] = _triton_check.triton_modules(
        fn, spec((32, 32, 128), jnp.bfloat16), pool, spec((32, 256), jnp.int32),
        spec((32,), jnp.int32), layer=spec((), jnp.int32),
    )
    stats = _triton_check.compile_for_sm90(module)
    assert stats["async_copies"] > 0 and stats["copy_buffers"] == 1, stats


def test_write_and_copy_compile_for_sm90():
    pool = spec((30, 4096, 2, 16, 3, 64), jnp.bfloat16)
    [write] = _triton_check.triton_modules(
        write_kv, pool, spec((64, 3, 64), jnp.bfloat16), spec((64, 3, 64), jnp.bfloat16),
        spec((64,), jnp.int32), layer=spec((), jnp.int32),
    )
    [copy] = _triton_check.triton_modules(copy_blocks, pool, spec((16, 2), jnp.int32))
    for module in (write, copy):
        stats = _triton_check.compile_for_sm90(module)
        assert stats.get("spill_bytes", 0) == 0, stats
