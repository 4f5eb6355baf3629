"""The native CPU attention kernel (`jpaged.device.attention.native`, C++ through XLA's FFI) against a
float64 numpy reference, in every variant this machine built and runs (AVX-512, AVX2, portable):
contexts 0, 1, 15, 16, 17 and 1003 tokens, one and several query tokens per row (causal within the
row), permuted block tables, NaN and 1e30 poison in every slot no row may read, float32, float16
and bfloat16 pools; sliding windows (1 token to longer than the context, traced) over block tables
whose entries before the window are the NaN-filled null block or not a block at all, and logit
soft-capping. Then the engine: greedy tokens equal the XLA path's; 'auto' picks the kernel;
and without a built kernel (as on a machine with no compiler) 'auto' falls back to XLA, saying so.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import LLM, SamplingParams
from jpaged.device import attention
from jpaged.device.attention import native
from jpaged.device.attention.xla import XLABackend, storage_dtype, xla_write_kv
from jpaged.device.batch import pack_rows
from jpaged.core.kv_cache_manager import slot_ids
from jpaged.core.scheduler import Row

VARIANTS = native.available_variants()
needs_native = pytest.mark.skipif(not VARIANTS, reason="the native kernels were not built on this machine")

LAYERS, BLOCK, KV_HEADS, GROUP = 2, 16, 3, 3
# (cached tokens, new tokens) per row: decode rows, prompts, prompts over cached context, an empty row
ROWS = [(0, 1), (14, 1), (15, 1), (16, 1), (1002, 1), (0, 15), (0, 17), (16, 1), (980, 23), (0, 0)]


def make_problem(head_dim, dtype, rng, rows=ROWS):
    """Pools poisoned outside the rows' slots (the null block 0: NaN throughout), rows over permuted
    blocks, queries, and the operands."""
    num_blocks = 1 + sum(-(-(c + n) // BLOCK) for c, n in rows) + 5  # + unused blocks
    shape = (LAYERS, num_blocks, BLOCK, KV_HEADS, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    readable = np.zeros((num_blocks, BLOCK), bool)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables, contexts = [], []
    for cached, new in rows:
        context = cached + new
        table = [int(free.pop()) for _ in range(-(-context // BLOCK))]
        for p in range(context):
            readable[table[p // BLOCK], p % BLOCK] = True
        tables.append(table)
        contexts.append(context)
    poison = np.where(rng.random(shape) < 0.5, np.nan, 1e30).astype(np.float32)
    poison[:, 0] = np.nan
    k = np.where(readable[None, :, :, None, None], k, poison)
    v = np.where(readable[None, :, :, None, None], v, poison)
    k, v = (jnp.asarray(x).astype(dtype) for x in (k, v))
    if storage_dtype(dtype) != k.dtype:  # bfloat16 pools are stored as their bits
        k, v = (jax.lax.bitcast_convert_type(x, storage_dtype(dtype)) for x in (k, v))
    pool = jnp.stack([k, v], axis=2)  # the engine's layout: a block's K and V side by side
    width = max(len(t) for t in tables)
    table_arr = np.zeros((len(rows), width), np.int32)
    for b, t in enumerate(tables):
        table_arr[b, :len(t)] = t
    q_len = np.array([n for _, n in rows], np.int32)
    q_start = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int32)
    num_tokens = int(q_len.sum()) + 3  # + padding tokens no row claims
    q = rng.standard_normal((num_tokens, KV_HEADS * GROUP, head_dim)).astype(np.float32)
    return q, pool, table_arr, np.array(contexts, np.int32), q_start, q_len


def reference(q, pool, layer, tables, contexts, q_start, q_len, scale, window=None, softcap=None):
    """float64 softmax attention over each row's readable keys, causal within the row, the token at
    position p seeing keys p - window < k <= p, scores soft-capped; unclaimed tokens 0."""
    k64, v64 = (np.asarray(pool_as_float(pool), np.float64)[layer, :, half] for half in (0, 1))
    out = np.zeros(q.shape)
    for b in range(len(contexts)):
        for i in range(q_len[b]):
            pos = contexts[b] - q_len[b] + i
            seen = np.arange(0 if window is None else max(0, pos - window + 1), pos + 1)
            blocks, offsets = tables[b, seen // BLOCK], seen % BLOCK
            keys, values = k64[blocks, offsets], v64[blocks, offsets]  # [keys, KV_HEADS, D]
            for head in range(q.shape[1]):
                s = keys[:, head // GROUP] @ q[q_start[b] + i, head].astype(np.float64) * scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[q_start[b] + i, head] = (p / p.sum()) @ values[:, head // GROUP]
    return out


def pool_as_float(x):
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(jnp.float32)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype,head_dim", [(jnp.float32, 64), (jnp.bfloat16, 64), (jnp.float16, 64),
                                            (jnp.float32, 128), (jnp.float32, 24), (jnp.bfloat16, 24)])
def test_kernel_matches_float64_reference(variant, dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    q, pool, tables, contexts, q_start, q_len = make_problem(head_dim, dtype, rng)
    scale = head_dim ** -0.5
    for layer in range(LAYERS):
        got = np.asarray(native.native_attend(q, pool, layer, tables, contexts, q_start, q_len, scale,
                                              variant=variant))
        want = reference(q, pool, layer, tables, contexts, q_start, q_len, scale)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@needs_native
def test_kernel_under_jit_and_scan_reads_the_traced_layer():
    """The kernel inside a jitted `lax.scan` over layers, as in the model, at the traced layer index."""
    rng = np.random.default_rng(1)
    q, pool, tables, contexts, q_start, q_len = make_problem(64, jnp.float32, rng)

    @jax.jit
    def every_layer(q, pool):
        def body(_, layer):
            return None, native.native_attend(q, pool, layer, tables, contexts, q_start, q_len, 0.125)
        return jax.lax.scan(body, None, jnp.arange(LAYERS, dtype=jnp.int32))[1]

    got = np.asarray(every_layer(q, pool))
    for layer in range(LAYERS):
        np.testing.assert_allclose(got[layer], reference(q, pool, layer, tables, contexts, q_start, q_len, 0.125),
                                   rtol=2e-5, atol=2e-5)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_write_and_attend_is_the_scatter_then_the_kernel(variant, dtype):
    """`native_write_and_attend` (the cache write and the attention as one call, the pool updated in place)
    against `xla_write_kv` then `native_attend`: the same pool bit for bit (each claimed token's K/V in its
    slot, padding tokens' in the null block, a slot outside the pool dropped, every other slot and layer
    untouched, NaN poison included) and the same output bit for bit, the new tokens' keys among those read;
    with the pool donated (in place) and not (XLA copies it first)."""
    rng = np.random.default_rng(4)
    q, pool, tables, contexts, q_start, q_len = make_problem(64, dtype, rng)
    slots = np.zeros(q.shape[0], np.int32)  # padding tokens: slot 0, the null block's
    for b, (start, n) in enumerate(zip(q_start, q_len)):
        for i in range(n):
            pos = contexts[b] - n + i
            slots[start + i] = tables[b, pos // BLOCK] * BLOCK + pos % BLOCK
    slots[-1] = pool.shape[1] * BLOCK + 5  # outside the pool
    k, v = (rng.standard_normal((q.shape[0], KV_HEADS, 64)).astype(np.float32) for _ in range(2))
    layer, scale = 1, 0.125
    want_pool = xla_write_kv(pool, layer, k, v, slots)
    want = native.native_attend(q, want_pool, layer, tables, contexts, q_start, q_len, scale, variant=variant)
    bits = lambda x: np.asarray(x).view(f"u{np.asarray(x).dtype.itemsize}")  # noqa: E731 (NaN == NaN)
    call = functools.partial(native.native_write_and_attend, scale=scale, variant=variant)
    for donate in ((), (4,)):
        got_pool, got = jax.jit(call, donate_argnums=donate)(q, k, v, slots, jnp.array(pool), layer, tables, contexts,
                                                             q_start, q_len)
        assert got_pool.dtype == pool.dtype and np.array_equal(bits(got_pool), bits(want_pool))
        assert np.array_equal(bits(got), bits(want)) and np.isfinite(np.asarray(got)).all()
    # new keys and values in another dtype than the pool's (the Python wrapper converts them: the raw call)
    other = jnp.float16 if dtype != jnp.float16 else jnp.float32
    raw = jax.ffi.ffi_call(native.target_name(variant, "JpagedPagedAttentionWrite"),
                           (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)))
    with pytest.raises(Exception, match="in the pool's dtype"):
        jax.block_until_ready(raw(q, pool, jnp.int32(layer), jnp.int32(1 << 30), tables, contexts, q_start, q_len,
                                  jnp.asarray(k, other), jnp.asarray(v, other), slots, scale=np.float32(scale),
                                  softcap=np.float32(0)))


# windowed rows: decodes at contexts 1 .. 200, prompts with and without cached context (the last:
# three query chunks of 16, 16 and 5 tokens), a padding row
WINDOW_ROWS = [(0, 1), (4, 1), (15, 1), (31, 1), (47, 1), (200, 1), (0, 20), (13, 20), (60, 37), (0, 0)]
# smaller than a block, one block, several blocks, longer than any context; one token; none
WINDOWS = (5, 16, 40, 1000, 1, None)


def forget_before_window(tables, contexts, q_len, window, null):
    """The block tables as the block manager leaves them under `window`: each row's entries wholly
    before its first new token's window replaced by `null` (0: the null block)."""
    tables = tables.copy()
    for b in range(len(contexts)):
        earliest = contexts[b] - q_len[b] - window + 1  # the first new token's first visible position
        tables[b, :max(0, earliest) // BLOCK] = null
    return tables


@needs_native
@pytest.mark.parametrize("dtype,head_dim", [(jnp.float32, 64), (jnp.bfloat16, 64), (jnp.float16, 128),
                                            (jnp.float32, 24), (jnp.float16, 24)])
def test_window_and_softcap_match_float64_reference(dtype, head_dim):
    """Every window x softcap on/off x variant; the table entries before each row's window are the
    NaN-filled null block, and then (same answer) a block id outside the pool: never looked up."""
    rng = np.random.default_rng(10 + head_dim)
    q, pool, tables, contexts, q_start, q_len = make_problem(head_dim, dtype, rng, WINDOW_ROWS)
    q *= 3  # scores up to about +-10: soft-capping at 2 changes them a lot
    scale, layer = head_dim ** -0.5, 1
    forgotten = 0
    for window in WINDOWS:
        cut = tables if window is None else forget_before_window(tables, contexts, q_len, window, 0)
        outside = tables if window is None else forget_before_window(tables, contexts, q_len, window,
                                                                     pool.shape[1] + 7)
        forgotten += int((cut != tables).sum())
        for softcap in (None, 2.0):
            want = reference(q, pool, layer, cut, contexts, q_start, q_len, scale, window, softcap)
            for variant in VARIANTS:
                for table in (cut, outside):
                    got = np.asarray(native.native_attend(q, pool, layer, table, contexts, q_start, q_len,
                                                          scale, window=window, softcap=softcap,
                                                          variant=variant))
                    assert np.isfinite(got).all(), (window, softcap, variant)
                    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5,
                                               err_msg=f"window {window} softcap {softcap} {variant}")
    assert forgotten > 20  # the null block stood in for many blocks
    # the reference itself: windows and the cap change the answer
    plain = reference(q, pool, layer, tables, contexts, q_start, q_len, scale)
    assert np.abs(reference(q, pool, layer, tables, contexts, q_start, q_len, scale, 40) - plain).max() > 0.1
    assert np.abs(reference(q, pool, layer, tables, contexts, q_start, q_len, scale, None, 2.0) - plain).max() > 0.1


@needs_native
@pytest.mark.parametrize("dtype,head_dim", [(jnp.float32, 64), (jnp.bfloat16, 64), (jnp.float16, 128),
                                            (jnp.float32, 24)])
def test_a_tokens_output_does_not_depend_on_how_its_prompt_was_chunked(dtype, head_dim):
    """Batch invariance, bit for bit: a prompt's token attends to the same keys whether it is decoded
    alone (a chunk of one), or sits anywhere in a prefill chunk of any length (the kernel's query
    chunks of 16 and its groups of tokens split differently); the engine's outputs then do not
    depend on the step's budget, on preemption by recompute, or on the other requests in the step."""
    rng = np.random.default_rng(20 + head_dim)
    prompt = 45
    q, pool, tables, _, _, _ = make_problem(head_dim, dtype, rng, [(0, prompt)])
    q *= 3
    scale = head_dim ** -0.5
    for softcap in (None, 2.0):
        outputs = []
        for pieces in ([1] * prompt, [prompt], [3, 17, 1, 24], [16, 16, 13], [2, 5, 7, 31], [44, 1]):
            ends = np.cumsum(pieces).astype(np.int32)
            q_len = np.array(pieces, np.int32)
            rows = np.repeat(tables, len(pieces), axis=0)
            for variant in VARIANTS:
                got = np.asarray(native.native_attend(q, pool, 1, rows, ends, ends - q_len, q_len, scale,
                                                      softcap=softcap, variant=variant))[:prompt]
                outputs.append((pieces, variant, got))
        for variant in VARIANTS:
            alone = next(got for pieces, v, got in outputs if v == variant)
            for pieces, v, got in outputs:
                if v == variant:
                    np.testing.assert_array_equal(got, alone, err_msg=f"{variant} chunks {pieces} softcap {softcap}")
        want = reference(q, pool, 1, tables, np.array([prompt], np.int32), np.array([0], np.int32),
                         np.array([prompt], np.int32), scale, None, softcap)[:prompt]
        np.testing.assert_allclose(alone, want, rtol=2e-5, atol=2e-5)


@needs_native
def test_traced_per_layer_window_under_jit_and_scan():
    """As in a model with windowed and global layers: the window scanned over layers with the layer
    index (1 << 30 for the global one), traced, under jit; the block tables keep every block."""
    rng = np.random.default_rng(11)
    q, pool, tables, contexts, q_start, q_len = make_problem(64, jnp.bfloat16, rng, WINDOW_ROWS)
    windows = jnp.array([24, 1 << 30], jnp.int32)

    @jax.jit
    def every_layer(q, pool, windows):
        def body(_, xs):
            layer, window = xs
            return None, native.native_attend(q, pool, layer, tables, contexts, q_start, q_len, 0.125,
                                              window=window, softcap=30.0)
        return jax.lax.scan(body, None, (jnp.arange(LAYERS, dtype=jnp.int32), windows))[1]

    got = np.asarray(every_layer(q, pool, windows))
    for layer, window in enumerate((24, None)):
        want = reference(q, pool, layer, tables, contexts, q_start, q_len, 0.125, window, 30.0)
        np.testing.assert_allclose(got[layer], want, rtol=2e-5, atol=2e-5)
    with pytest.raises(Exception, match="window must be"):
        jax.block_until_ready(every_layer(q, pool, jnp.array([0, 5], jnp.int32)))


@needs_native
def test_bad_operands_fail_the_call_instead_of_reading_out_of_bounds():
    rng = np.random.default_rng(2)
    q, pool, tables, contexts, q_start, q_len = make_problem(64, jnp.float32, rng)
    bad_tables = tables.copy()
    bad_tables[4, 3] = pool.shape[1] + 7
    with pytest.raises(Exception, match="block outside the pool"):
        jax.block_until_ready(native.native_attend(q, pool, 0, bad_tables, contexts, q_start, q_len, 0.125))
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(native.native_attend(q, pool, LAYERS, tables, contexts, q_start, q_len, 0.125))
    too_long = contexts.copy()
    too_long[0] = tables.shape[1] * BLOCK + 1
    with pytest.raises(Exception, match="longer than its block table"):
        jax.block_until_ready(native.native_attend(q, pool, 0, tables, too_long, q_start, q_len, 0.125))


def test_row_queries_recovers_each_rows_tokens_from_the_packed_batch():
    rng = np.random.default_rng(3)
    specs = [(0, 5), (16, 1), (40, 9), (3, 1)]
    free = list(rng.permutation(np.arange(1, 64)))
    rows = []
    for start, n in specs:
        table = [int(free.pop()) for _ in range(-(-(start + n) // BLOCK))]
        rows.append(Row([1] * n, start, slot_ids(table, start, start + n, BLOCK), table))
    for q_tile in (64, 1):
        batch = rows if q_tile == 64 else [r for r in rows if len(r.token_ids) == 1]
        inputs = pack_rows(batch, block_size=BLOCK, q_tile=q_tile, k_tile=64)
        q_start, q_len = (np.asarray(x) for x in native.row_queries(inputs))
        lens = [len(r.token_ids) for r in batch]
        assert q_len.tolist() == lens + [0] * (len(q_len) - len(batch))
        assert q_start[:len(batch)].tolist() == np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()


@needs_native
def test_engine_greedy_tokens_equal_the_xla_path(default_model, alpaca_prompts):
    """Eight chats sharing a system prompt (prefix caching: prefill over cached blocks), 24 greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    system = {"role": "system", "content": "You are a careful assistant. Answer in one short paragraph."}
    tokens = {}
    for backend in ("xla", "native"):
        llm = LLM(loaded=default_model, num_blocks=160, attention_backend=backend, enable_prefix_caching=True)
        assert llm.engine.runner.backend.name == backend
        prompts = [llm.chat_prompt([system, {"role": "user", "content": p}]) for p in alpaca_prompts[40:48]]
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the shared prefix's blocks
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["native"] == tokens["xla"]


@needs_native
def test_auto_picks_the_native_kernel_on_a_cpu():
    backend = attention.get_backend("auto")
    assert backend.name == "native" and backend.variant == "auto"


@pytest.fixture
def kernels_not_built(monkeypatch):
    """As on a machine where pip had no C++ compiler: no variant's library exists."""
    monkeypatch.setattr(native, "library_path", lambda variant: None)
    for cached in (native.available_variants, native.target_name, native._library):
        cached.cache_clear()
    yield
    monkeypatch.undo()
    for cached in (native.available_variants, native.target_name, native._library):
        cached.cache_clear()


@needs_native
def test_the_environment_can_name_a_lesser_variant(monkeypatch):
    """JPAGED_NATIVE_VARIANT caps the variants used (the AVX2 code paths benchmarked on an AVX-512 CPU); a name
    that is no variant is an error that says what to set."""
    built = native.available_variants()
    try:
        for best in native.VARIANTS:
            monkeypatch.setenv(native.VARIANT_ENV, best)
            native.available_variants.cache_clear()
            assert native.available_variants() == tuple(v for v in built if native.VARIANTS.index(v) >=
                                                         native.VARIANTS.index(best))
        monkeypatch.setenv(native.VARIANT_ENV, "avx3")
        native.available_variants.cache_clear()
        with pytest.raises(ValueError, match="JPAGED_NATIVE_VARIANT='avx3' is no native variant: set it to one of "
                                             "avx512, avx2, portable"):
            native.available_variants()
    finally:
        monkeypatch.undo()
        native.available_variants.cache_clear()
    assert native.available_variants() == built


def test_without_the_kernels_auto_falls_back_to_xla_in_one_line(kernels_not_built, caplog):
    with caplog.at_level(logging.WARNING, logger="jpaged"):
        backend = attention.get_backend("auto")
    assert isinstance(backend, XLABackend)
    [record] = [r for r in caplog.records if "native" in r.getMessage()]
    assert "XLA path" in record.getMessage() and "\n" not in record.getMessage()
    with pytest.raises(ValueError, match="were not built .*attention_backend='xla'"):
        attention.get_backend("native")
