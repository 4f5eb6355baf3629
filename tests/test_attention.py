"""The XLA attention path (`xla_attend` over `pack_rows`' attention plan) against two references:
the padded block-table gather (`gather_attend`) and plain numpy softmax attention over each row's
logical K/V. Rows mix decode tokens, fresh prompts and prompts on top of cached context (the ragged
step's batch), with scattered blocks, at several tile sizes (a tile smaller than, equal to and larger
than a row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.device.attention.xla import gather_attend, xla_attend
from jpaged.device.batch import bucket, fine_bucket, pack_rows, row_bucket
from jpaged.core.kv_cache_manager import slot_ids
from jpaged.core.scheduler import Row

NUM_LAYERS, NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 2, 96, 2, 8, 6


def make_rows(specs, block_size, rng):
    """specs: (cached tokens, new tokens) per row -> rows over blocks drawn at random from the pool."""
    free = list(rng.permutation(np.arange(1, NUM_BLOCKS)))
    rows = []
    for start, n in specs:
        table = [int(free.pop()) for _ in range(-(-(start + n) // block_size))]
        rows.append(Row(token_ids=[1] * n, start_position=start, slots=slot_ids(table, start, start + n, block_size),
                        block_table=table))
    return rows


def numpy_attention(q, k_pool, v_pool, layer, row, scale, block_size):
    """q f[n, H, D] of one row -> f[n, H, D]: softmax over the row's keys at positions <= each query's."""
    context = row.start_position + len(row.token_ids)
    slots = [row.block_table[p // block_size] * block_size + p % block_size for p in range(context)]
    k = k_pool[layer].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
    v = v_pool[layer].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [S, H, D]
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), k) * scale
    positions = np.arange(row.start_position, context)
    scores = np.where(np.arange(context)[None, None, :] <= positions[None, :, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v)


SPECS = {
    "decode": [(0, 1), (12, 1), (40, 1), (3, 1), (77, 1)],
    "prefill": [(0, 13), (0, 1), (0, 40), (0, 5)],
    "cached_prefix": [(16, 9), (32, 1), (5, 30), (0, 7)],
    # the ragged step: decode rows first, then prompt chunks over cached context and whole prompts
    "ragged": [(12, 1), (40, 1), (3, 1), (24, 17), (0, 9), (33, 1), (47, 2)],
}


PREFILL_TILES = [(4, 8, 8), (4, 3, 12), (8, 64, 64)]  # (block_size, q_tile, k_tile)
DECODE_TILES = [(4, 1, 4), (4, 1, 12), (8, 1, 128)]  # decode steps use one-token query tiles


@pytest.mark.parametrize("kind,block_size,q_tile,k_tile",
                         [("decode", *t) for t in DECODE_TILES]
                         + [(kind, *t) for kind in ("prefill", "cached_prefix", "ragged") for t in PREFILL_TILES])
def test_tiled_attention_matches_references(kind, block_size, q_tile, k_tile):
    specs = SPECS[kind]
    rng = np.random.default_rng(block_size * 100 + q_tile)
    shape = (NUM_LAYERS, NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_pool = rng.standard_normal(shape).astype(np.float32)
    v_pool = rng.standard_normal(shape).astype(np.float32)
    pool = np.stack([k_pool, v_pool], axis=2)  # the engine's layout: [layers, blocks, 2 (K, V), ...]
    rows = make_rows(specs, block_size, rng)
    inputs = pack_rows(rows, block_size=block_size, q_tile=q_tile, k_tile=k_tile)
    q = rng.standard_normal((inputs.token_ids.shape[0], NUM_HEADS, HEAD_DIM)).astype(np.float32)
    plan = jax.tree.map(jnp.asarray, inputs.plan)
    out = np.asarray(jax.jit(xla_attend, static_argnums=(4,))(q, pool, 1, plan, 0.3))
    start = 0
    for row in rows:
        n = len(row.token_ids)
        expected = numpy_attention(q[start:start + n], k_pool, v_pool, 1, row, 0.3, block_size)
        np.testing.assert_allclose(out[start:start + n], expected, atol=2e-5, rtol=2e-5)
        gathered = gather_attend(q[None, start:start + n], pool, 1, np.asarray([row.block_table]),
                                 np.asarray([row.start_position + n]),
                                 np.arange(row.start_position, row.start_position + n)[None], 0.3)[0]
        np.testing.assert_allclose(out[start:start + n], np.asarray(gathered), atol=2e-5, rtol=2e-5)
        start += n


def test_plan_pairs_are_exactly_the_causal_work():
    """Every pair's key tile starts at or before its query tile's last position, and every key tile
    a query tile needs is paired with it: no work skipped, none beyond the causal triangle."""
    block_size, q_tile, k_tile = 4, 4, 8
    rows = make_rows([(0, 21), (9, 6), (30, 1)], block_size, np.random.default_rng(0))
    plan = pack_rows(rows, block_size=block_size, q_tile=q_tile, k_tile=k_tile).plan
    assert np.all(np.diff(plan.pair_q) >= 0)  # sorted: the merge is a sorted segment reduction
    real = plan.pair_len > 0  # padded pairs have no context: fully masked
    for t in range(plan.q_index.shape[0]):
        positions = plan.q_positions[t][plan.q_positions[t] >= 0]
        starts = sorted(int(s) for s in plan.k_start[plan.pair_k[real & (plan.pair_q == t)]])
        expected = list(range(0, int(positions.max()) // k_tile * k_tile + 1, k_tile)) if len(positions) else []
        assert starts == expected, t


def test_packing_lays_rows_end_to_end():
    rows = make_rows([(0, 5), (7, 1), (2, 3)], 4, np.random.default_rng(1))
    inputs = pack_rows(rows, block_size=4, q_tile=4, k_tile=4)
    assert inputs.token_ids.shape == (16,)  # 9 tokens -> the minimum prefill bucket
    assert list(inputs.positions[:9]) == [0, 1, 2, 3, 4, 7, 2, 3, 4]
    assert list(inputs.logits_index[:3]) == [4, 5, 8]
    assert list(inputs.context_lens[:3]) == [5, 8, 5]
    assert list(inputs.slot_mapping[9:]) == [0] * 7  # padding writes into the null block
    with pytest.raises(ValueError, match="multiple of block_size"):
        pack_rows(rows, block_size=4, q_tile=4, k_tile=6)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 2192, 4097])
def test_buckets(n):
    assert bucket(n) >= n and bucket(n) < 2 * n or n == 1
    for steps in (2, 4):
        fine = fine_bucket(n, steps=steps)
        assert n <= fine <= bucket(n) and (fine - n) * steps <= max(n, steps)
    assert n <= row_bucket(n) <= bucket(n) and (row_bucket(n) == bucket(n) if n <= 16 else row_bucket(n) < 1.5 * n)
