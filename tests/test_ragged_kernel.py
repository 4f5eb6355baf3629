"""The ragged paged-attention kernel (interpret mode on a CPU) against its reference in float64.

A ragged batch packs rows end to end: decode rows (one new token over cached context), prefill
chunks (many new tokens over cached context), whole prompts (every token new), padding rows (no
tokens, no context) and padding tokens after the last row. Every case is checked against
`ragged_paged_attention_reference` computed in float64 (`jax.enable_x64`), and the reference
itself against an independent numpy loop over the block tables. Pools are poisoned (NaN, or huge
values) wherever a correct kernel must not read: the null block, spare blocks, the unused slots
of each row's last block, the other layers of the stacked pool, and, under a sliding window, the
blocks wholly before a row's first query's window (whose table entries become the null block, as
the block manager leaves them); padding tokens' queries are NaN.

Tolerances (as in tests/test_kernels.py): a float32 pool agrees with the float64 truth to 1e-5;
a bfloat16 pool's result within 2 bfloat16 ulps of the truth rounded to bfloat16, plus 1e-3.

Last, an engine with the Pallas backend (interpret mode) gives the XLA backend's greedy tokens on
a prompt mix with chunked prompts, decode rows and a prefix-cache hit.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import triton_check
from pallas_kernels import _compat, ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention import tile_schedule

NUM_KV_HEADS = 2
HEAD_DIM = 32
LAYER, NUM_LAYERS = 1, 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class Case:
    """A ragged batch as numpy arrays: q f32[N, H, D] (values rounded to the test dtype), kv_cache
    f32[L, num_blocks, 2, block_size, KVH, D], cu_q_lens i32[B + 1], kv_lens i32[B], page_indices
    i32[B, M]."""

    q: np.ndarray
    kv_cache: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray

    @property
    def args(self):
        return self.q, self.kv_cache, self.cu_q_lens, self.kv_lens, self.page_indices


def make_case(rng, rows, *, block_size, q_per_kv, num_tokens=None, dtype=jnp.float32, window=None,
              poison="nan", spare_blocks=2, pad_columns=1) -> Case:
    """`rows`: (q_len, kv_len) per row; (0, 0) is a padding row. `num_tokens`: N (at least the rows'
    tokens; the rest are padding tokens, whose queries are NaN). Blocks are a random permutation
    of the pool; with `window` W, each row's blocks wholly before its first query's window (position
    kv_len - q_len - W + 1) are freed: null entries in the table, NaN in the pool."""
    real_tokens = sum(q for q, _ in rows)
    num_tokens = num_tokens or real_tokens
    blocks_per_row = [cdiv(kv, block_size) for _, kv in rows]
    num_blocks = 1 + sum(blocks_per_row) + spare_blocks
    width = max(max(blocks_per_row), 1) + pad_columns
    shape = (NUM_LAYERS, num_blocks, 2, block_size, NUM_KV_HEADS, HEAD_DIM)
    kv = rng.standard_normal(shape).astype(np.float32)
    valid = np.zeros((NUM_LAYERS, num_blocks, block_size), bool)
    order = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(rows), width), np.int32)
    used = 0
    for b, ((q_len, kv_len), n) in enumerate(zip(rows, blocks_per_row)):
        tables[b, :n] = order[used:used + n]
        used += n
        for i in range(n):
            valid[LAYER, tables[b, i], :min(block_size, kv_len - i * block_size)] = True
        if window is not None and q_len:
            freed = max(kv_len - q_len - window + 1, 0) // block_size
            valid[LAYER, tables[b, :freed]] = False
            tables[b, :freed] = 0
    kv = np.where(valid[:, :, None, :, None, None], kv, np.nan if poison == "nan" else np.float32(1e30))
    q = rng.standard_normal((num_tokens, NUM_KV_HEADS * q_per_kv, HEAD_DIM)).astype(np.float32)
    q[real_tokens:] = np.nan
    q, kv = (np.array(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, kv))
    cu_q_lens = np.concatenate([[0], np.cumsum([q_len for q_len, _ in rows])]).astype(np.int32)
    return Case(q, kv, cu_q_lens, np.asarray([kv for _, kv in rows], np.int32), tables)


def numpy_ragged_attention(case: Case, *, scale, layer=LAYER, window=None, softcap=None):
    """Independent float64 attention: for each row and new token, walk the block table."""
    q = case.q.astype(np.float64)
    pool = case.kv_cache[layer].astype(np.float64)
    block_size, num_heads = pool.shape[2], q.shape[1]
    group = num_heads // NUM_KV_HEADS
    out = np.zeros_like(q)
    for b in range(len(case.kv_lens)):
        start, end, kv_len = int(case.cu_q_lens[b]), int(case.cu_q_lens[b + 1]), int(case.kv_lens[b])
        for n in range(start, end):
            pos = kv_len - (end - n)
            lo = 0 if window is None else max(pos - window + 1, 0)
            keys = range(lo, pos + 1)
            blocks = [case.page_indices[b, k // block_size] for k in keys]
            k = np.stack([pool[blk, 0, k % block_size] for blk, k in zip(blocks, keys)])  # [keys, KVH, D]
            v = np.stack([pool[blk, 1, k % block_size] for blk, k in zip(blocks, keys)])
            for h in range(num_heads):
                s = k[:, h // group] @ q[n, h] * scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                out[n, h] = (w / w.sum()) @ v[:, h // group]
    return out


def reference64(case: Case, **opts):
    with jax.enable_x64(True):
        q, kv, *meta = case.args
        window = opts.pop("window", None)
        out = ragged_paged_attention_reference(
            jnp.asarray(q, jnp.float64), jnp.asarray(kv, jnp.float64), *map(jnp.asarray, meta),
            layer=LAYER, window=None if window is None else jnp.int32(window), **opts)
        assert out.dtype == jnp.float64
        return np.asarray(out)


def kernel(case: Case, dtype=jnp.float32, q_dtype=None, **opts):
    q, kv, *meta = case.args
    window = opts.pop("window", None)
    out = ragged_paged_attention(
        jnp.asarray(q, q_dtype or dtype), jnp.asarray(kv, dtype), *map(jnp.asarray, meta),
        layer=jnp.int32(LAYER), window=None if window is None else jnp.int32(window), interpret=True, **opts)
    assert out.shape == q.shape and out.dtype == (q_dtype or dtype)
    return np.asarray(out.astype(jnp.float32), np.float64)


def assert_matches(actual, truth, dtype, what):
    assert np.all(np.isfinite(actual)), f"{what}: non-finite output (read outside a row's keys?)"
    if dtype == jnp.float32:
        np.testing.assert_allclose(actual, truth, rtol=1e-5, atol=1e-5, err_msg=what)
    else:
        rounded = np.asarray(jnp.asarray(truth, jnp.float32).astype(dtype).astype(jnp.float32))
        np.testing.assert_allclose(actual, rounded, rtol=2**-7, atol=1e-3, err_msg=what)


def check(case: Case, dtype=jnp.float32, *, window=None, softcap=None, **tiling):
    scale = HEAD_DIM**-0.5
    truth = reference64(case, scale=scale, window=window, softcap=softcap)
    out = kernel(case, dtype, scale=scale, window=window, softcap=softcap, **tiling)
    assert_matches(out, truth, dtype, f"kernel, window {window}, softcap {softcap}, {tiling}")
    np.testing.assert_array_equal(out[case.cu_q_lens[-1]:], 0.0)  # padding tokens: zeros
    return out


# Row mixes: (q_len, kv_len) per row. A decode row is (1, n); a chunk over cached context (q, n > q);
# a whole prompt (q, q); a padding row (0, 0). Lengths straddle block edges (block sizes 4 to 16).
DECODE = [(1, 1), (1, 8), (1, 17), (1, 40)]
PROMPTS = [(5, 5), (16, 16), (33, 33)]
CHUNKS = [(7, 30), (16, 48), (1, 9), (20, 21)]
MIXED = [(1, 23), (9, 9), (12, 44), (1, 4), (0, 0), (0, 0)]  # padding rows last, as the engine packs

MIXES = {"decode": (DECODE, None), "prompts": (PROMPTS, 64), "chunks": (CHUNKS, 48), "mixed": (MIXED, 32)}


@pytest.mark.parametrize(
    "mix,block_size,q_per_kv",
    [("decode", 8, 3), ("prompts", 4, 1), ("prompts", 16, 4), ("chunks", 8, 2), ("chunks", 16, 3),
     ("mixed", 4, 8), ("mixed", 8, 3), ("mixed", 16, 1)],
)
def test_kernel_matches_reference(mix, block_size, q_per_kv):
    rows, num_tokens = MIXES[mix]
    rng = np.random.default_rng(100 * block_size + q_per_kv + len(mix))
    case = make_case(rng, rows, block_size=block_size, q_per_kv=q_per_kv, num_tokens=num_tokens,
                     poison="nan" if block_size % 8 else "huge")
    check(case)


@pytest.mark.parametrize("q_tile,blocks_per_iter", [(1, 1), (2, 4), (8, 2), (32, 1)])
def test_tiling_options(q_tile, blocks_per_iter):
    """Query tiles of one token to longer than any row, one block to several per iteration."""
    rng = np.random.default_rng(q_tile + 10 * blocks_per_iter)
    case = make_case(rng, MIXED, block_size=4, q_per_kv=3, num_tokens=40)
    check(case, q_tile=q_tile, blocks_per_iter=blocks_per_iter)


@pytest.mark.parametrize("softcap", [None, 1.5], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", [1, 3, 8, 13, 1 << 30])
def test_window_and_softcap(window, softcap):
    """Windows of one token, within a block, of exactly a block, across blocks, and the full
    window a model passes for its unwindowed layers; a tile's later queries see windows that start
    after its first iterations. Blocks wholly before each row's window are null entries (NaN)."""
    rng = np.random.default_rng(window % 97)
    case = make_case(rng, MIXED + [(3, 3)], block_size=8, q_per_kv=3, num_tokens=40,
                     window=None if window > 1000 else window)
    check(case, window=window, softcap=softcap, q_tile=8, blocks_per_iter=1)


@pytest.mark.parametrize("window", [None, 5])
def test_bfloat16_pool(window):
    rng = np.random.default_rng(16)
    case = make_case(rng, MIXED, block_size=8, q_per_kv=4, num_tokens=32, dtype=jnp.bfloat16,
                     poison="huge", window=window)
    check(case, jnp.bfloat16, window=window, softcap=None if window is None else 2.0)


def test_float32_queries_over_bfloat16_pool():
    rng = np.random.default_rng(17)
    case = make_case(rng, CHUNKS, block_size=8, q_per_kv=3, dtype=jnp.bfloat16)
    case.q = rng.standard_normal(case.q.shape).astype(np.float32)  # not bfloat16-representable
    truth = reference64(case, scale=0.2)
    out = kernel(case, jnp.bfloat16, q_dtype=jnp.float32, scale=0.2)
    # float32 math on bfloat16 keys and values; p @ v keeps ~16 bits of p (two bfloat16 halves)
    np.testing.assert_allclose(out, truth, rtol=1e-4, atol=1e-4)


def test_one_layer_pool_and_layer_scan():
    """A pool without the layer axis (layer=None), and the engine's pattern: `lax.scan` over the layers
    with the pool as carry and a traced layer index (and window, as a family's per-layer options)."""
    rng = np.random.default_rng(18)
    case = make_case(rng, MIXED, block_size=8, q_per_kv=2, num_tokens=32, poison="huge")
    pool = case.kv_cache.copy()
    pool[0] = np.where(np.isfinite(pool[1]), -2 * pool[1], pool[0])  # layer 0: other values, same slots
    case.kv_cache = pool
    scale = 0.3
    q, kv, *meta = map(jnp.asarray, case.args)
    one_layer = ragged_paged_attention(q, kv[LAYER], *meta, scale=scale, interpret=True)
    assert_matches(np.asarray(one_layer), reference64(case, scale=scale), jnp.float32, "layer=None")

    @jax.jit
    def all_layers(pool, windows):
        def step(pool, xs):
            layer, window = xs
            return pool, ragged_paged_attention(q, pool, *meta, scale=scale, layer=layer, window=window,
                                                interpret=True)
        return jax.lax.scan(step, pool, (jnp.arange(NUM_LAYERS, dtype=jnp.int32), windows))

    windows = jnp.asarray([4, 1 << 30], jnp.int32)
    pool_out, outs = all_layers(kv, windows)
    for layer in range(NUM_LAYERS):
        truth = numpy_ragged_attention(case, scale=scale, layer=layer, window=int(windows[layer]))
        assert_matches(np.asarray(outs[layer]), truth, jnp.float32, f"layer {layer}")
    np.testing.assert_array_equal(np.asarray(pool_out), pool)


def test_tiles_are_independent_of_their_order(monkeypatch):
    """The interpreter runs the grid in order; a GPU runs its programs at once. Query tiles of
    neighbouring rows overlap in the packed token range, so a program that stored past its own
    tokens would be overwritten in order and race on a GPU: run the tiles in reverse order."""
    # the module (the package's attribute of that name is the function)
    module = importlib.import_module("pallas_kernels.ragged_paged_attention")

    def reversed_schedule(*args):
        return tuple(x[::-1] for x in tile_schedule(*args))

    rng = np.random.default_rng(21)
    case = make_case(rng, MIXED, block_size=8, q_per_kv=3, num_tokens=40)
    monkeypatch.setattr(module, "tile_schedule", reversed_schedule)
    q, kv, *meta = map(jnp.asarray, case.args)
    out = ragged_paged_attention.__wrapped__(q, kv, *meta, scale=0.3, layer=LAYER, q_tile=8, interpret=True)
    assert_matches(np.asarray(out), reference64(case, scale=0.3), jnp.float32, "tiles in reverse order")


@pytest.mark.parametrize("window", [None, 13])
def test_block_table_read_in_the_loop(monkeypatch, window):
    """Tables wider than _MAX_PRELOADED_IDS are read in the key loop, not before it: the same
    results (the cap at 0 forces that path on a small table)."""
    module = importlib.import_module("pallas_kernels.ragged_paged_attention")
    monkeypatch.setattr(module, "_MAX_PRELOADED_IDS", 0)
    rng = np.random.default_rng(5)
    case = make_case(rng, MIXED + [(3, 3)], block_size=8, q_per_kv=3, num_tokens=40, window=window)
    q, kv, *meta = map(jnp.asarray, case.args)
    out = ragged_paged_attention.__wrapped__(q, kv, *meta, scale=0.3, layer=LAYER, window=window,
                                             q_tile=8, blocks_per_iter=2, interpret=True)
    truth = reference64(case, scale=0.3, window=window)
    assert_matches(np.asarray(out), truth, jnp.float32, f"table read in the loop, window {window}")


def test_padding_only_batch_gives_zeros():
    """No real row at all (every row padding, every token padding, NaN queries): zeros, not NaN."""
    rng = np.random.default_rng(19)
    case = make_case(rng, [(1, 5), (0, 0)], block_size=4, q_per_kv=2, num_tokens=16)
    case.cu_q_lens[:] = 0
    case.kv_lens[:] = 0
    case.q[:] = np.nan
    out = kernel(case, scale=1.0)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(reference64(case, scale=1.0), 0.0)


@pytest.mark.parametrize("q_tile", [1, 4, 16])
def test_tile_schedule_covers_every_token_once(q_tile):
    q_lens = [1, 0, 9, 4, 0, 17, 1, 0]
    num_tokens = sum(q_lens) + 3
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows, starts = map(np.asarray, tile_schedule(jnp.asarray(cu), num_tokens, q_tile))
    assert len(rows) == min(num_tokens, cdiv(num_tokens, q_tile) + len(q_lens))
    covered = []
    for row, start in zip(rows, starts):
        end = min(start + q_tile, cu[row + 1])
        assert cu[row] <= start <= cu[row + 1]
        covered += range(start, end)
    assert sorted(covered) == list(range(cu[-1]))
    assert sum(start < cu[row + 1] for row, start in zip(rows, starts)) == sum(cdiv(n, q_tile) for n in q_lens)


def test_reference_against_numpy():
    rng = np.random.default_rng(20)
    case = make_case(rng, MIXED, block_size=4, q_per_kv=3, num_tokens=32, window=6)
    for window, softcap in [(None, None), (6, None), (6, 0.8)]:
        truth = numpy_ragged_attention(case, scale=0.4, window=window, softcap=softcap)
        np.testing.assert_allclose(reference64(case, scale=0.4, window=window, softcap=softcap), truth,
                                   rtol=1e-12, atol=1e-12)


def test_rejects_bad_inputs():
    q = jnp.zeros((8, 6, 32), jnp.float32)
    pool = jnp.zeros((2, 10, 2, 8, 2, 32), jnp.float32)
    cu, kv_lens, tables = jnp.zeros(4, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros((3, 4), jnp.int32)
    call = functools.partial(ragged_paged_attention, scale=1.0, layer=0, interpret=True)
    with pytest.raises(ValueError, match=r"cu_q_lens must be i32\[num_rows \+ 1\].*i32\[3\].*i32\[3,4\]"):
        call(q, pool, jnp.zeros(3, jnp.int32), kv_lens, tables)
    with pytest.raises(ValueError, match=r"kv_lens must be i32\[num_rows\].*i32\[4\]"):
        call(q, pool, cu, jnp.zeros(4, jnp.int32), tables)
    with pytest.raises(ValueError, match=r"page_indices must be i32\[num_rows, pages_per_row\]"):
        call(q, pool, cu, kv_lens, jnp.zeros((3, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"head_dim of q f32\[8,6,16\] and kv_cache"):
        call(jnp.zeros((8, 6, 16)), pool, cu, kv_lens, tables)
    with pytest.raises(ValueError, match=r"num_heads of q f32\[8,5,32\] must be a multiple"):
        call(jnp.zeros((8, 5, 32)), pool, cu, kv_lens, tables)
    with pytest.raises(ValueError, match=r"with layer= the pool must be stacked"):
        call(q, pool[0], cu, kv_lens, tables)
    with pytest.raises(ValueError, match=r"q_tile=3 must be a power of two"):
        call(q, pool, cu, kv_lens, tables, q_tile=3)
    with pytest.raises(ValueError, match=r"window must be None or an integer scalar"):
        call(q, pool, cu, kv_lens, tables, window=jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match=r"softcap must be None or a positive"):
        call(q, pool, cu, kv_lens, tables, softcap=-1.0)
    with pytest.raises(ValueError, match=r"q_tile \* \(q_per_kv padded.*= 4 must be >= 16 on the GPU"):
        ragged_paged_attention(q, pool, cu, kv_lens, tables, scale=1.0, layer=0, q_tile=1)


# ---------------------------------------------------------------------------------------------
# Triton lowering (as on a GPU machine, no GPU needed) and sm_90a compilation (jax >= 0.11 + triton)

spec = jax.ShapeDtypeStruct


def _ragged_args(dtype, heads, kv_heads, head_dim, block_size=16):
    return (spec((256, heads, head_dim), dtype), spec((4, 512, 2, block_size, kv_heads, head_dim), dtype),
            spec((33,), jnp.int32), spec((32,), jnp.int32), spec((32, 64), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton(dtype):
    if triton_check.abstract_gpu() is None:
        pytest.skip("this JAX has no abstract GPU device to lower for")
    fn = functools.partial(ragged_paged_attention, scale=0.125, softcap=30.0)
    text = triton_check.lower_for_cuda(fn, *_ragged_args(dtype, 9, 3, 64), layer=spec((), jnp.int32),
                                       window=spec((), jnp.int32))
    assert "xla.gpu.triton" in text and "ragged_paged_attention" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_compiles_for_sm90_without_spills(heads, kv_heads, head_dim, dtype):
    """Like tests/test_kernels_triton.py: needs jax >= 0.11 and the `triton` package, else skipped."""
    pytest.importorskip("triton")
    if _compat.JAX_VERSION < (0, 11):
        pytest.skip("the GPU machines run jax 0.11; its Triton IR is what matters")
    fn = functools.partial(ragged_paged_attention, scale=head_dim**-0.5)
    [module] = triton_check.triton_modules(fn, *_ragged_args(dtype, heads, kv_heads, head_dim),
                                           layer=spec((), jnp.int32), window=spec((), jnp.int32))
    stats = triton_check.compile_for_sm90(module)
    assert stats["mma_instructions"] > 0, stats  # the dots run on tensor cores
    assert stats.get("spill_bytes", 0) == 0, stats
    assert stats["shared_bytes"] <= 227 * 1024, stats
    # the block table (256 columns) is read before the key loop, so the K/V copies are
    # pipelined: a copy in flight while the previous tile is computed
    assert stats["copy_buffers"] >= 2, stats


# ---------------------------------------------------------------------------------------------
# the engine: Pallas (interpret) against XLA, greedy tokens


def test_engine_pallas_matches_xla_with_chunks_decodes_and_a_prefix_hit(default_model, alpaca_prompts,
                                                                         monkeypatch):
    """A small token budget makes steps ragged (decode rows beside prompt chunks over their cached
    tokens); the second batch repeats the first prompt with more text after it (a prefix-cache hit:
    a row that starts past cached blocks) beside fresh prompts."""
    import pallas_kernels
    from jpaged import LLM, SamplingParams

    traced = []  # the ragged kernel's step shapes (the backend calls it through the package)

    def spy(q, *args, **kwargs):
        traced.append(q.shape)
        return ragged_paged_attention(q, *args, **kwargs)

    monkeypatch.setattr(pallas_kernels, "ragged_paged_attention", spy)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = alpaca_prompts[0]
    batches = [[first], [first + " Answer in one sentence.", alpaca_prompts[1], alpaca_prompts[2][:40]]]
    tokens = {}
    for backend in ("xla", "pallas"):
        llm = LLM(loaded=default_model, num_blocks=96, block_size=8, attention_backend=backend, interpret=True,
                  enable_prefix_caching=True, max_num_batched_tokens=24, max_num_seqs=4)
        assert llm.engine.runner.backend.name == backend
        tokens[backend] = [[o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
                           for batch in batches]
        assert llm.engine.stats()["prefix_cache_hit_rate"] > 0
    assert traced  # the Pallas engine's prefill steps ran the ragged kernel
    assert tokens["pallas"] == tokens["xla"]
    assert all(len(t) == 3 for batch in tokens["xla"] for t in batch)
