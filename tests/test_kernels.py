"""Tests of the Pallas kernels (interpret mode on a CPU) against their references and numpy.

Every kernel is checked three ways: kernel vs its ``jnp`` reference, kernel vs an independent
straightforward numpy computation (float64, python loops over the block table), and reference vs
that same numpy computation (so a wrong reference fails too). K/V pools are poisoned (NaN or
huge values) everywhere a correct kernel must not read: the null block, unused blocks, the
unused slots of each sequence's last block, and the other layers of a stacked pool, in both the
K and the V half of each block.

The pool is one array, ``kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads,
head_dim]`` (or one layer without the leading axis), block ``b``'s K at ``kv_cache[..., b, 0]``
and its V at ``kv_cache[..., b, 1]``; the numpy checks index it that way themselves.

Tolerances: float32 inputs agree to 1e-5 (absolute and relative). bfloat16 inputs are compared
after rounding the float64 truth to bfloat16: within 2 bfloat16 ulps (rtol 2**-7) plus 1e-3
absolute, since the kernel computes in float32 and rounds once at the end.
"""

from __future__ import annotations

import importlib

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import triton_check
from pallas_kernels import _compat
from pallas_kernels import (
    copy_blocks,
    copy_blocks_reference,
    paged_attention,
    paged_attention_reference,
    write_kv,
    write_kv_reference,
)

NUM_KV_HEADS = 2
LONG = 1003  # a context of >= 1000 tokens, not a multiple of any block size


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def poison_value(kind: str) -> float:
    return float("nan") if kind == "nan" else 1e30


def joint(k, v):
    """One pool from separate K and V pools: ``[..., num_blocks, 2, block_size, heads, dim]``."""
    return np.stack([k, v], axis=-4)


def make_attention_case(
    rng: np.random.Generator,
    *,
    block_size: int,
    q_per_kv: int,
    head_dim: int,
    context_lens: list[int],
    dtype,
    num_layers: int | None = None,
    layer: int = 0,
    poison: str = "nan",
    spare_blocks: int = 3,
    pad_columns: int = 2,
):
    """A random K/V pool, block tables (permuted, null-padded) and queries.

    Returns numpy arrays (pool as float32 values already rounded to ``dtype``); ``kv_cache`` is
    ``[num_layers, num_blocks, 2, block_size, heads, dim]`` (no leading axis when
    ``num_layers`` is None), poisoned in both halves wherever a correct kernel must not read.
    """
    num_blocks_per_seq = [cdiv(c, block_size) for c in context_lens]
    num_blocks = 1 + sum(num_blocks_per_seq) + spare_blocks
    max_blocks = max(num_blocks_per_seq) + pad_columns
    layers = 1 if num_layers is None else num_layers
    shape = (layers, num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    valid = np.zeros(shape[:3], bool)  # [layers, num_blocks, block_size]
    block_ids = rng.permutation(np.arange(1, num_blocks))
    block_tables = np.zeros((len(context_lens), max_blocks), np.int32)  # padded with null 0
    used = 0
    for b, (ctx, n) in enumerate(zip(context_lens, num_blocks_per_seq)):
        block_tables[b, :n] = block_ids[used : used + n]
        used += n
        for i in range(n):
            filled = min(block_size, ctx - i * block_size)
            valid[layer, block_tables[b, i], :filled] = True
    bad = poison_value(poison)
    k[~valid] = bad
    v[~valid] = bad
    num_heads = NUM_KV_HEADS * q_per_kv
    q = rng.standard_normal((len(context_lens), num_heads, head_dim), dtype=np.float32)
    # Round to the test dtype so numpy sees exactly the kernel's inputs.
    q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))
    kv = joint(k, v)
    if num_layers is None:
        kv = kv[0]
    return dict(
        q=q,
        kv_cache=kv,
        block_tables=block_tables,
        context_lens=np.asarray(context_lens, np.int32),
    )


def numpy_dense_attention(q, kv_cache, block_tables, context_lens, *, scale, layer=None,
                          window=None, softcap=None):
    """Independent float64 attention: walk each block table, concatenate, softmax.

    Block ``b``'s K is ``kv_cache[b, 0]`` and its V ``kv_cache[b, 1]`` (of the layer's pool).
    With ``window`` W the query (at ``ctx - 1``) sees positions ``max(ctx - W, 0) .. ctx - 1``
    only, and only their blocks are walked; ``softcap`` c maps scores ``s -> c * tanh(s / c)``.
    """
    q = np.asarray(q, np.float64)
    if layer is not None:
        kv_cache = kv_cache[layer]
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = np.zeros_like(q)
    for b in range(batch):
        ctx = int(context_lens[b])
        if ctx == 0:
            continue
        lo = 0 if window is None else max(ctx - int(window), 0)  # first visible position
        first = lo // block_size
        blocks = [block_tables[b, i] for i in range(first, cdiv(ctx, block_size))]
        span = slice(lo - first * block_size, ctx - first * block_size)
        k = np.concatenate([kv_cache[i, 0] for i in blocks])[span].astype(np.float64)
        v = np.concatenate([kv_cache[i, 1] for i in blocks])[span].astype(np.float64)
        for h in range(num_heads):
            kv = h // group
            scores = k[:, kv, :] @ q[b, h] * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            w = np.exp(scores - scores.max())
            out[b, h] = (w / w.sum()) @ v[:, kv, :]
    return out


def assert_close(actual, expected, dtype, what: str):
    actual = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite output (read outside the context?)"
    if dtype == jnp.float32:
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5, err_msg=what)
    else:
        expected = np.asarray(jnp.asarray(expected, jnp.float32).astype(dtype).astype(jnp.float32))
        np.testing.assert_allclose(actual, expected, rtol=2**-7, atol=1e-3, err_msg=what)


def run_attention(case, dtype, *, scale, layer=None, window=None, softcap=None, **kwargs):
    args = [jnp.asarray(case["q"], dtype), jnp.asarray(case["kv_cache"], dtype),
            jnp.asarray(case["block_tables"]), jnp.asarray(case["context_lens"])]
    opts = dict(scale=scale, layer=layer, window=window, softcap=softcap)
    out = paged_attention(*args, interpret=True, **opts, **kwargs)
    ref = paged_attention_reference(*args, **opts)
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert ref.shape == case["q"].shape and ref.dtype == dtype
    return out, ref


def check_attention(case, dtype, *, layer=None, window=None, softcap=None, **kwargs):
    scale = case["q"].shape[-1] ** -0.5
    out, ref = run_attention(case, dtype, scale=scale, layer=layer, window=window,
                             softcap=softcap, **kwargs)
    dense = numpy_dense_attention(
        case["q"], case["kv_cache"], case["block_tables"], case["context_lens"],
        scale=scale, layer=layer, window=window, softcap=softcap,
    )
    assert_close(ref, dense, dtype, "reference vs numpy dense")
    assert_close(out, dense, dtype, "kernel vs numpy dense")
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    else:  # both round float32 results to bfloat16 once: at most one ulp apart
        np.testing.assert_allclose(
            np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)),
            rtol=2**-7, atol=1e-3,
        )


def boundary_lengths(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, LONG]


# ---------------------------------------------------------------------------------------------
# paged attention


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_per_kv", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_attention_grid_float32(block_size, q_per_kv, head_dim):
    rng = np.random.default_rng(1000 * block_size + 10 * q_per_kv + head_dim)
    poison = "nan" if (block_size + q_per_kv) % 2 else "huge"
    case = make_attention_case(
        rng, block_size=block_size, q_per_kv=q_per_kv, head_dim=head_dim,
        context_lens=boundary_lengths(block_size), dtype=jnp.float32, poison=poison,
    )
    check_attention(case, jnp.float32)


@pytest.mark.parametrize(
    "block_size,q_per_kv,head_dim",
    [(8, 1, 128), (16, 3, 64), (32, 8, 128)],
)
def test_paged_attention_bfloat16(block_size, q_per_kv, head_dim):
    rng = np.random.default_rng(7 + block_size)
    case = make_attention_case(
        rng, block_size=block_size, q_per_kv=q_per_kv, head_dim=head_dim,
        context_lens=boundary_lengths(block_size), dtype=jnp.bfloat16, poison="huge",
    )
    check_attention(case, jnp.bfloat16)


def test_paged_attention_float32_queries_over_bfloat16_pool():
    rng = np.random.default_rng(8)
    case = make_attention_case(
        rng, block_size=16, q_per_kv=3, head_dim=64, context_lens=[1, 40, 300],
        dtype=jnp.bfloat16, poison="nan",
    )
    q = rng.standard_normal(case["q"].shape, dtype=np.float32)  # not bf16-representable
    scale = 0.125
    args = (jnp.asarray(case["kv_cache"], jnp.bfloat16), case["block_tables"],
            case["context_lens"])
    out = paged_attention(q, *args, scale=scale, interpret=True)
    ref = paged_attention_reference(q, *args, scale=scale)
    assert out.dtype == jnp.float32 and ref.dtype == jnp.float32
    dense = numpy_dense_attention(q, case["kv_cache"], case["block_tables"], case["context_lens"],
                                  scale=scale)
    # float32 math on bf16 values; p @ v keeps ~16 bits of p (two bf16 halves): 1e-4.
    np.testing.assert_allclose(np.asarray(out), dense, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ref), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "blocks_per_iter,num_splits", [(1, 1), (2, 1), (1, 7), (4, 64)],
    ids=["one-block-no-split", "two-blocks-no-split", "one-block-7-splits", "splits-capped"],
)
def test_paged_attention_tiling_options(blocks_per_iter, num_splits):
    rng = np.random.default_rng(3)
    case = make_attention_case(
        rng, block_size=16, q_per_kv=3, head_dim=64, context_lens=[33, 1, 200, 16],
        dtype=jnp.float32,
    )
    check_attention(case, jnp.float32, blocks_per_iter=blocks_per_iter, num_splits=num_splits)


def test_paged_attention_stacked_pool_traced_layer():
    rng = np.random.default_rng(4)
    case = make_attention_case(
        rng, block_size=16, q_per_kv=3, head_dim=64, context_lens=[17, 5, 64],
        dtype=jnp.float32, num_layers=3, layer=1, poison="nan",
    )
    # Other layers are entirely poisoned: reading the wrong layer gives NaN.
    check_attention(case, jnp.float32, layer=jnp.int32(1))


def test_paged_attention_in_layer_scan():
    """The engine's pattern: lax.scan over layers, pool as carry, layer index traced."""
    rng = np.random.default_rng(5)
    num_layers, block_size = 2, 8
    case = make_attention_case(
        rng, block_size=block_size, q_per_kv=2, head_dim=64, context_lens=[9, 3],
        dtype=jnp.float32, num_layers=num_layers, layer=0,
    )
    pool = case["kv_cache"].copy()
    # layer 1: different K and V, same valid slots
    pool[1, :, 0], pool[1, :, 1] = 2 * pool[0, :, 0], -pool[0, :, 1]
    bt, cl, q = (jnp.asarray(case[n]) for n in ("block_tables", "context_lens", "q"))
    scale = 64**-0.5

    @jax.jit
    def all_layers(pool):
        def step(pool, layer):
            out = paged_attention(q, pool, bt, cl, scale=scale, layer=layer, interpret=True)
            return pool, out

        return jax.lax.scan(step, pool, jnp.arange(num_layers, dtype=jnp.int32))

    pool_out, outs = all_layers(jnp.asarray(pool))
    for layer in range(num_layers):
        dense = numpy_dense_attention(
            case["q"], pool, case["block_tables"], case["context_lens"], scale=scale, layer=layer,
        )
        assert_close(outs[layer], dense, jnp.float32, f"layer {layer}")
    np.testing.assert_array_equal(np.asarray(pool_out), pool)


def test_paged_attention_zero_context_gives_zeros():
    rng = np.random.default_rng(6)
    case = make_attention_case(
        rng, block_size=8, q_per_kv=1, head_dim=64, context_lens=[5, 1], dtype=jnp.float32,
    )
    case["context_lens"] = np.array([5, 0], np.int32)
    out, ref = run_attention(case, jnp.float32, scale=0.125)
    np.testing.assert_array_equal(np.asarray(out)[1], 0.0)
    np.testing.assert_array_equal(np.asarray(ref)[1], 0.0)
    np.testing.assert_allclose(np.asarray(out)[0], np.asarray(ref)[0], rtol=1e-5, atol=1e-5)


def test_paged_attention_rejects_bad_shapes():
    q = jnp.zeros((2, 6, 64), jnp.float32)
    pool = jnp.zeros((10, 2, 16, 2, 64), jnp.float32)
    bt = jnp.zeros((2, 4), jnp.int32)
    cl = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"q f32\[2,6,32\].*kv_cache f32\[10,2,16,2,64\]"):
        paged_attention(jnp.zeros((2, 6, 32)), pool, bt, cl, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match=r"block_tables i32\[3,4\] and q f32\[2,6,64\]"):
        paged_attention(q, pool, jnp.zeros((3, 4), jnp.int32), cl, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match=r"num_heads of q f32\[2,5,64\].*kv_cache f32\[10,2,16,2,"):
        paged_attention(jnp.zeros((2, 5, 64)), pool, bt, cl, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match=r"stacked \[num_layers, num_blocks, 2, block_size"):
        paged_attention(q, pool, bt, cl, scale=1.0, layer=0, interpret=True)
    with pytest.raises(ValueError, match=r"got kv_cache f32\[3,10,2,16,2,64\] \(pass layer="):
        paged_attention(q, pool[None].repeat(3, 0), bt, cl, scale=1.0, interpret=True)
    # The old layout (separate K and V pools, no K/V axis) is refused, naming the new one.
    with pytest.raises(ValueError, match=r"\[num_blocks, 2, block_size, num_kv_heads, head_dim\]; "
                       r"got kv_cache f32\[10,16,2,64\]"):
        paged_attention(q, jnp.zeros((10, 16, 2, 64)), bt, cl, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match=r"K/V axis and must have size 2.*f32\[10,3,16,2,64\]"):
        paged_attention(q, jnp.zeros((10, 3, 16, 2, 64)), bt, cl, scale=1.0, interpret=True)


# ---------------------------------------------------------------------------------------------
# paged attention: sliding window and logit soft-capping

WINDOW_CONTEXTS = [1, 7, 8, 9, 20, 37, 64]  # block size 8: within, at and across block edges
HUGE_WINDOW = 1 << 30  # what a model passes for its unwindowed layers


def make_window_case(rng, *, window: int, block_size: int = 8, context_lens=WINDOW_CONTEXTS,
                     **kwargs):
    """A one-layer case as the block manager leaves it under a sliding window: every block
    wholly before a sequence's window is freed (its table entries become the null block 0,
    which holds NaN) and reused (NaN too). The first visible block keeps its stale keys before
    the window (real values): only the mask hides them."""
    case = make_attention_case(rng, block_size=block_size, context_lens=context_lens,
                               poison="nan", **kwargs)
    kv, tables = case["kv_cache"], case["block_tables"]
    kv[0] = np.nan
    for b, ctx in enumerate(context_lens):
        first = max(ctx - window, 0) // block_size
        kv[tables[b, :first]] = np.nan
        tables[b, :first] = 0
    return case


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", [1, 5, 8, 20, 37, 1000])
def test_paged_attention_window_float32(window, softcap):
    """Windows of one token, within a block, of exactly a block, spanning several blocks, equal
    to a context, past every context; GQA groups of 3 (padded to 16 rows)."""
    rng = np.random.default_rng(window)
    case = make_window_case(rng, window=window, q_per_kv=3, head_dim=32, dtype=jnp.float32)
    check_attention(case, jnp.float32, window=jnp.int32(window), softcap=softcap)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window,q_per_kv", [(5, 1), (20, 4), (1000, 2)])
def test_paged_attention_window_bfloat16(window, q_per_kv, softcap):
    rng = np.random.default_rng(100 + window)
    case = make_window_case(rng, window=window, q_per_kv=q_per_kv, head_dim=32,
                            dtype=jnp.bfloat16)
    check_attention(case, jnp.bfloat16, window=jnp.int32(window), softcap=softcap)


@pytest.mark.parametrize(
    "blocks_per_iter,num_splits", [(2, 1), (4, 3), (1, 7), (2, 64)],
    ids=["two-blocks-no-split", "four-blocks-3-splits", "one-block-7-splits", "splits-capped"],
)
@pytest.mark.parametrize("window", [5, 20, 90])
def test_paged_attention_window_tiling(window, blocks_per_iter, num_splits):
    """Iterations of several blocks start at the window's first block, wherever it falls, and
    the longest sequence fills its table (no padding columns): the last iteration runs past
    the table's end (the kernel pads the table) and past the context (masked)."""
    rng = np.random.default_rng(7 * window + num_splits)
    case = make_window_case(rng, window=window, context_lens=[3, 30, 41, 120, 128], q_per_kv=2,
                            head_dim=32, dtype=jnp.float32, pad_columns=0, block_size=8)
    check_attention(case, jnp.float32, window=jnp.int32(window), softcap=3.0,
                    blocks_per_iter=blocks_per_iter, num_splits=num_splits)


@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_blocks_per_split_capped(monkeypatch, window):
    """A split reads its block ids before its loop, at most _MAX_BLOCKS_PER_SPLIT of them: with
    the cap at 2 blocks, one split asked for becomes many (and splits past the context, whose
    ids are never used, read an in-bounds slice of the table)."""
    module = importlib.import_module("pallas_kernels.paged_attention")
    monkeypatch.setattr(module, "_MAX_BLOCKS_PER_SPLIT", 2)
    # the un-jitted wrapper: a jit cache entry traced with the real cap must not be reused
    monkeypatch.setitem(globals(), "paged_attention", paged_attention.__wrapped__)
    rng = np.random.default_rng(17)
    case = make_window_case(rng, window=window or 1 << 20, context_lens=[3, 30, 41, 120, 128],
                            q_per_kv=2, head_dim=32, dtype=jnp.float32, pad_columns=1,
                            block_size=8)
    check_attention(case, jnp.float32, window=None if window is None else jnp.int32(window),
                    blocks_per_iter=1, num_splits=1)


def test_paged_attention_window_is_traced_not_static():
    """One compiled kernel serves every window (it comes from a per-layer array)."""
    rng = np.random.default_rng(51)
    case = make_window_case(rng, window=1000, context_lens=[9, 30], q_per_kv=1, head_dim=16,
                            dtype=jnp.float32)
    args = [jnp.asarray(case[n]) for n in ("q", "kv_cache", "block_tables", "context_lens")]
    paged_attention(*args, scale=0.25, window=jnp.int32(3), interpret=True)
    compiled = paged_attention._cache_size()
    for w in (4, 17, 1000):
        out = paged_attention(*args, scale=0.25, window=jnp.int32(w), interpret=True)
        dense = numpy_dense_attention(*(case[n] for n in ("q", "kv_cache", "block_tables",
                                                          "context_lens")), scale=0.25, window=w)
        assert_close(out, dense, jnp.float32, f"window {w}")
    assert paged_attention._cache_size() == compiled


def test_paged_attention_window_in_layer_scan():
    """The engine's pattern for a model mixing windowed and global layers: the windows are a
    per-layer array scanned with the layer index; the huge window is the global layer."""
    rng = np.random.default_rng(52)
    num_layers, block_size = 2, 8
    case = make_attention_case(
        rng, block_size=block_size, q_per_kv=2, head_dim=32, context_lens=[9, 3, 30],
        dtype=jnp.float32, num_layers=num_layers, layer=0,
    )
    pool = case["kv_cache"].copy()
    pool[1, :, 0], pool[1, :, 1] = 2 * pool[0, :, 0], -pool[0, :, 1]
    bt, cl, q = (jnp.asarray(case[n]) for n in ("block_tables", "context_lens", "q"))
    windows = np.array([6, HUGE_WINDOW], np.int32)

    @jax.jit
    def all_layers(pool):
        def step(pool, xs):
            layer, window = xs
            out = paged_attention(q, pool, bt, cl, scale=0.25, layer=layer, window=window,
                                  softcap=2.5, interpret=True)
            return pool, out

        return jax.lax.scan(step, pool, (jnp.arange(num_layers, dtype=jnp.int32), windows))

    _, outs = all_layers(jnp.asarray(pool))
    for layer in range(num_layers):
        dense = numpy_dense_attention(
            case["q"], pool, case["block_tables"], case["context_lens"], scale=0.25,
            layer=layer, window=int(windows[layer]), softcap=2.5,
        )
        assert_close(outs[layer], dense, jnp.float32, f"layer {layer}")
    # the huge window is no window at all
    unwindowed = numpy_dense_attention(case["q"], pool, case["block_tables"],
                                       case["context_lens"], scale=0.25, layer=1, softcap=2.5)
    assert_close(outs[1], unwindowed, jnp.float32, "huge window")


def test_paged_attention_window_and_softcap_change_the_result():
    """Guards the tests above against a no-op: the window and the cap each change the output."""
    rng = np.random.default_rng(53)
    case = make_attention_case(rng, block_size=8, q_per_kv=1, head_dim=16, context_lens=[30],
                               dtype=jnp.float32)
    base, _ = run_attention(case, jnp.float32, scale=1.0)
    windowed, _ = run_attention(case, jnp.float32, scale=1.0, window=jnp.int32(29))
    capped, _ = run_attention(case, jnp.float32, scale=1.0, softcap=1.0)
    assert np.abs(np.asarray(base) - np.asarray(windowed)).max() > 1e-3
    assert np.abs(np.asarray(base) - np.asarray(capped)).max() > 1e-3


def test_paged_attention_rejects_bad_window_and_softcap():
    q = jnp.zeros((2, 4, 16), jnp.float32)
    pool = jnp.zeros((10, 2, 8, 2, 16), jnp.float32)
    bt = jnp.zeros((2, 4), jnp.int32)
    cl = jnp.ones((2,), jnp.int32)
    for fn in (functools.partial(paged_attention, interpret=True), paged_attention_reference):
        with pytest.raises(ValueError, match="window must be None or an integer scalar"):
            fn(q, pool, bt, cl, scale=1.0, window=jnp.ones((2,), jnp.int32))
        with pytest.raises(ValueError, match="window must be None or an integer scalar"):
            fn(q, pool, bt, cl, scale=1.0, window=jnp.float32(4.0))
        with pytest.raises(ValueError, match="softcap must be None or a positive"):
            fn(q, pool, bt, cl, scale=1.0, softcap=0.0)


# ---------------------------------------------------------------------------------------------
# cache writer


def numpy_write_kv(kv_cache, k, v, slot_mapping, layer=None):
    """K of token t to ``[(layer,) block, 0, offset]``, its V to ``[(layer,) block, 1, offset]``."""
    kv_cache = kv_cache.copy()
    block_size = kv_cache.shape[-3]
    lead = () if layer is None else (layer,)
    for t, slot in enumerate(slot_mapping):
        block, offset = slot // block_size, slot % block_size
        kv_cache[(*lead, block, 0, offset)] = k[t]
        kv_cache[(*lead, block, 1, offset)] = v[t]
    return kv_cache


def random_array(rng, shape, dtype):
    """A writable numpy array of standard-normal values rounded to ``dtype``."""
    return np.array(jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype))


def assert_pools_equal(actual, expected, *, skip_null_block: bool, stacked: bool):
    actual, expected = np.asarray(actual), np.asarray(expected)
    if skip_null_block:  # padded tokens race to the null block: its content is unspecified
        actual = actual[:, 1:] if stacked else actual[1:]
        expected = expected[:, 1:] if stacked else expected[1:]
    # Bit-identical, NaN payloads included.
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stacked"])
def test_write_kv(stacked, dtype):
    rng = np.random.default_rng(11)
    num_layers, num_blocks, block_size, heads, head_dim = 3, 9, 8, 3, 64
    shape = (num_blocks, 2, block_size, heads, head_dim)
    if stacked:
        shape = (num_layers, *shape)
    kv_cache = random_array(rng, shape, dtype)
    num_real = 13
    slots = rng.choice(np.arange(block_size, num_blocks * block_size), num_real, replace=False)
    padded = rng.integers(0, block_size, 3)  # padded tokens: slots in the null block 0
    slot_mapping = np.concatenate([slots, padded]).astype(np.int32)
    k = random_array(rng, (len(slot_mapping), heads, head_dim), dtype)
    v = random_array(rng, (len(slot_mapping), heads, head_dim), dtype)
    layer = 2 if stacked else None

    out = write_kv(kv_cache, k, v, slot_mapping, layer=layer, interpret=True)
    ref = write_kv_reference(kv_cache, k, v, slot_mapping, layer=layer)
    expected = numpy_write_kv(kv_cache, k, v, slot_mapping, layer)
    for got in (out, ref):
        assert got.shape == shape and got.dtype == dtype
        assert_pools_equal(got, expected, skip_null_block=True, stacked=stacked)
    if stacked:  # other layers untouched, null block included
        assert_pools_equal(np.asarray(out)[:2], kv_cache[:2], skip_null_block=False, stacked=True)


def test_write_kv_casts_to_pool_dtype():
    rng = np.random.default_rng(13)
    kv_cache = random_array(rng, (5, 2, 8, 2, 64), jnp.bfloat16)
    k = rng.standard_normal((3, 2, 64), dtype=np.float32)
    v = rng.standard_normal((3, 2, 64), dtype=np.float32)
    slots = np.array([8, 33, 1], np.int32)
    out = write_kv(kv_cache, k, v, slots, interpret=True)
    expected = numpy_write_kv(kv_cache, np.asarray(jnp.asarray(k, jnp.bfloat16)),
                              np.asarray(jnp.asarray(v, jnp.bfloat16)), slots)
    assert out.dtype == jnp.bfloat16
    assert_pools_equal(out, expected, skip_null_block=True, stacked=False)


def test_write_kv_donated_in_place():
    """Under donation the pool buffer is reused for the output (no copy of the pool)."""
    rng = np.random.default_rng(12)
    kv_cache = jnp.asarray(random_array(rng, (2, 6, 2, 8, 2, 64), jnp.float32))
    k, v = (jnp.asarray(random_array(rng, (4, 2, 64), jnp.float32)) for _ in range(2))
    slots = jnp.asarray([8, 9, 47, 0], jnp.int32)
    expected = numpy_write_kv(np.asarray(kv_cache), np.asarray(k), np.asarray(v),
                              np.asarray(slots), 1)
    step = jax.jit(functools.partial(write_kv, interpret=True), donate_argnums=(0,))
    kv_out = step(kv_cache, k, v, slots, layer=jnp.int32(1))
    assert kv_cache.is_deleted()
    assert_pools_equal(kv_out, expected, skip_null_block=True, stacked=True)


def test_write_kv_rejects_bad_shapes():
    pool = jnp.zeros((4, 2, 8, 2, 64), jnp.float32)
    k = jnp.zeros((3, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"k f32\[3,2,32\].*kv_cache f32\[4,2,8,2,64\]"):
        write_kv(pool, jnp.zeros((3, 2, 32)), jnp.zeros((3, 2, 32)),
                 jnp.zeros((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"slot_mapping i32\[4\] and k f32\[3,2,64\]"):
        write_kv(pool, k, k, jnp.zeros((4,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"k f32\[3,2,64\] and v bf16\[3,2,64\]"):
        write_kv(pool, k, k.astype(jnp.bfloat16), jnp.zeros((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"stacked \[num_layers, num_blocks, 2,.*f32\[4,2,8,2,64\]"):
        write_kv(pool, k, k, jnp.zeros((3,), jnp.int32), layer=0, interpret=True)
    with pytest.raises(ValueError, match=r"K/V axis and must have size 2.*f32\[4,8,2,2,64\]"):
        write_kv(jnp.zeros((4, 8, 2, 2, 64)), k, k, jnp.zeros((3,), jnp.int32), interpret=True)


# ---------------------------------------------------------------------------------------------
# block copier


def numpy_copy_blocks(kv_cache, pairs):
    """Block ``src`` (axis -5: K and V, every layer) onto block ``dst``."""
    out = kv_cache.copy()
    for src, dst in pairs:
        out[..., dst, :, :, :, :] = kv_cache[..., src, :, :, :, :]
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stacked"])
def test_copy_blocks(stacked, dtype):
    rng = np.random.default_rng(21)
    shape = (3, 12, 2, 16, 3, 64) if stacked else (12, 2, 16, 3, 64)
    kv_cache = random_array(rng, shape, dtype)
    # NaN payloads are copied bit for bit, in the K and the V half.
    kv_cache[..., 5, 0, 3, 1, 7] = np.nan
    kv_cache[..., 2, 1, 15, 2, 63] = np.nan
    pairs = np.array([[5, 9], [2, 10], [7, 3], [0, 0], [0, 0]], np.int32)
    out = copy_blocks(kv_cache, pairs, interpret=True)
    ref = copy_blocks_reference(kv_cache, pairs)
    expected = numpy_copy_blocks(kv_cache, pairs)
    for got in (out, ref):
        assert got.shape == shape and got.dtype == dtype
        assert_pools_equal(got, expected, skip_null_block=False, stacked=stacked)


def test_copy_blocks_rejects_bad_shapes():
    pool = jnp.zeros((2, 4, 2, 8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"pairs i32\[3\] for kv_cache f32\[2,4,2,8,2,64\]"):
        copy_blocks(pool, jnp.zeros((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"K/V axis and must have size 2.*f32\[2,4,8,2,64\]"):
        copy_blocks(jnp.zeros((2, 4, 8, 2, 64)), jnp.zeros((1, 2), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"stacked \[num_layers, .*kv_cache f32\[4,8,2,64\]"):
        copy_blocks(jnp.zeros((4, 8, 2, 64)), jnp.zeros((1, 2), jnp.int32), interpret=True)


# ---------------------------------------------------------------------------------------------
# the three together: write, copy-on-write, read


def test_copy_on_write_then_attention():
    """Two sequences share a prefix block; a CoW copy gives the second its own block, the new
    tokens are written with write_kv, and attention reads both through their block tables."""
    rng = np.random.default_rng(31)
    num_layers, num_blocks, block_size, heads, head_dim, q_per_kv = 2, 8, 8, 2, 64, 3
    shape = (num_layers, num_blocks, 2, block_size, heads, head_dim)
    pool = np.full(shape, np.nan, np.float32)
    # Shared block 3 holds 6 tokens of the common prefix (both layers, K and V).
    pool[:, 3, :, :6] = rng.standard_normal((num_layers, 2, 6, heads, head_dim))
    pairs = np.array([[3, 5], [0, 0]], np.int32)  # CoW: sequence 1 gets block 5
    pool = copy_blocks(pool, pairs, interpret=True)
    np.testing.assert_array_equal(np.asarray(pool)[:, 5], np.asarray(pool)[:, 3])

    # Each sequence appends one token at offset 6 of its own block (layer 1), plus a padded token.
    new_k = rng.standard_normal((3, heads, head_dim)).astype(np.float32)
    new_v = rng.standard_normal((3, heads, head_dim)).astype(np.float32)
    slots = np.array([3 * block_size + 6, 5 * block_size + 6, 0], np.int32)
    pool = write_kv(pool, new_k, new_v, slots, layer=jnp.int32(1), interpret=True)
    block_tables = np.array([[3, 0], [5, 0]], np.int32)
    context_lens = np.array([7, 7], np.int32)
    q = rng.standard_normal((2, heads * q_per_kv, head_dim)).astype(np.float32)
    out = paged_attention(q, pool, block_tables, context_lens, scale=0.125,
                          layer=jnp.int32(1), interpret=True)
    dense = numpy_dense_attention(q, np.asarray(pool), block_tables, context_lens, scale=0.125,
                                  layer=1)
    assert_close(out, dense, jnp.float32, "attention after CoW + write")
    # The sequences differ only in their new token.
    assert not np.allclose(np.asarray(out)[0], np.asarray(out)[1])


# ---------------------------------------------------------------------------------------------
# Triton lowering (jaxpr -> Triton IR, as on a GPU machine; no GPU needed to lower)


def _lower_or_skip(fn, *args, **kwargs):
    if triton_check.abstract_gpu() is None:
        pytest.skip("this JAX has no abstract GPU device to lower for")
    text = triton_check.lower_for_cuda(fn, *args, **kwargs)
    assert "xla.gpu.triton" in text
    return text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (32, 8, 128, 32), (8, 8, 64, 8)]
)
def test_kernels_lower_to_triton(num_heads, num_kv_heads, head_dim, block_size, dtype):
    spec = jax.ShapeDtypeStruct
    pool = spec((4, 64, 2, block_size, num_kv_heads, head_dim), dtype)
    attention = functools.partial(paged_attention, scale=head_dim**-0.5)
    _lower_or_skip(attention, spec((8, num_heads, head_dim), dtype), pool,
                   spec((8, 16), jnp.int32), spec((8,), jnp.int32), layer=spec((), jnp.int32))
    text = _lower_or_skip(write_kv, pool, spec((5, num_kv_heads, head_dim), dtype),
                          spec((5, num_kv_heads, head_dim), dtype), spec((5,), jnp.int32),
                          layer=spec((), jnp.int32))
    assert "output_operand_aliases" in text
    text = _lower_or_skip(copy_blocks, pool, spec((4, 2), jnp.int32))
    assert "output_operand_aliases" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_windowed_softcapped_attention_lowers_to_triton(dtype):
    spec = jax.ShapeDtypeStruct
    pool = spec((4, 64, 2, 16, 3, 64), dtype)
    attention = functools.partial(paged_attention, scale=0.125, softcap=50.0)
    _lower_or_skip(attention, spec((8, 9, 64), dtype), pool, spec((8, 16), jnp.int32),
                   spec((8,), jnp.int32), layer=spec((), jnp.int32), window=spec((), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_windowed_softcapped_attention_compiles_for_sm90_without_spills(dtype):
    """Like tests/test_kernels_triton.py (jax >= 0.11 and the `triton` package, else skipped),
    for the windowed, soft-capped kernel at the bench's larger head configuration."""
    pytest.importorskip("triton")
    if _compat.JAX_VERSION < (0, 11):
        pytest.skip("the GPU machines run jax 0.11; its Triton IR is what matters")
    spec = jax.ShapeDtypeStruct
    attention = functools.partial(paged_attention, scale=128**-0.5, softcap=50.0)
    [module] = triton_check.triton_modules(
        attention, spec((32, 32, 128), dtype), spec((30, 4096, 2, 16, 8, 128), dtype),
        spec((32, 256), jnp.int32), spec((32,), jnp.int32), layer=spec((), jnp.int32),
        window=spec((), jnp.int32),
    )
    stats = triton_check.compile_for_sm90(module)
    assert stats["mma_instructions"] > 0, stats
    assert stats.get("spill_bytes", 0) == 0, stats
    assert stats["copy_buffers"] >= 2, stats  # K/V copies in flight during the dots


# ---------------------------------------------------------------------------------------------
# the references themselves, on their own (so they can fail independently of the kernels)


def test_references_against_numpy():
    rng = np.random.default_rng(41)
    case = make_attention_case(
        rng, block_size=4, q_per_kv=2, head_dim=8, context_lens=[1, 4, 9, 13],
        dtype=jnp.float32, num_layers=2, layer=1,
    )
    ref = paged_attention_reference(
        case["q"], case["kv_cache"], case["block_tables"], case["context_lens"],
        scale=0.3, layer=1,
    )
    dense = numpy_dense_attention(
        case["q"], case["kv_cache"], case["block_tables"], case["context_lens"],
        scale=0.3, layer=1,
    )
    assert_close(ref, dense, jnp.float32, "paged_attention_reference")

    kv_cache = random_array(rng, (2, 5, 2, 4, 2, 8), jnp.float32)
    k, v = (random_array(rng, (3, 2, 8), jnp.float32) for _ in range(2))
    slots = np.array([4, 19, 7], np.int32)
    assert_pools_equal(write_kv_reference(kv_cache, k, v, slots, layer=0),
                       numpy_write_kv(kv_cache, k, v, slots, 0),
                       skip_null_block=False, stacked=True)
    pairs = np.array([[1, 4], [2, 3]], np.int32)
    assert_pools_equal(copy_blocks_reference(kv_cache, pairs), numpy_copy_blocks(kv_cache, pairs),
                       skip_null_block=False, stacked=True)


@pytest.mark.parametrize("window", [1, 3, 4, 6, 100])
def test_windowed_reference_against_numpy(window):
    rng = np.random.default_rng(60 + window)
    case = make_window_case(rng, window=window, block_size=4, context_lens=[1, 4, 9, 13],
                            q_per_kv=2, head_dim=8, dtype=jnp.float32)
    args = [case[n] for n in ("q", "kv_cache", "block_tables", "context_lens")]
    for softcap in (None, 0.7):
        ref = paged_attention_reference(*args, scale=0.6, window=window, softcap=softcap)
        dense = numpy_dense_attention(*args, scale=0.6, window=window, softcap=softcap)
        assert_close(ref, dense, jnp.float32, f"reference, window {window}, softcap {softcap}")
