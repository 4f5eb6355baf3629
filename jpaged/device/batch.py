"""One step's batch as device arrays: the scheduler's rows, packed token by token, plus the
*attention plan* that tells the XLA attention path which (query tile, key tile) pairs to compute.

Packing. The new tokens of all rows are laid end to end (`token_ids i32[N]`, no per-row padding),
so a prefill of a 1,000-token and a 40-token prompt costs 1,040 token-steps of the matmuls, not
2 x 1,024. Only the total N is padded (to a shape bucket, below); padded tokens write to the null block.

Attention plan (the XLA path; the Pallas decode kernel reads `block_tables` instead). Each row's
new tokens are cut into *query tiles* of `q_tile` tokens and its context (cached + new tokens)
into *key tiles* of `k_tile` tokens (whole blocks). A *pair* is a query tile and a key tile of the
same row whose first key position is <= the tile's last query position: every pair is work that
causal attention needs, and no other work is done. Each pair yields a partial softmax (running
max, sum, weighted values); each query tile merges its pairs' partials (flash-decoding style), so
a long sequence no longer widens every other row's attention to its length.

Shapes are bucketed (one compiled step per bucket combination): powers of two, and for the pairs,
a prefill's packed tokens and a decode step's rows, which carry the work, finer steps
(`fine_bucket`: four shapes per power of two for prefill, two for the many small decode steps,
whose compilations must stay few; `row_bucket`). Padding: query-tile slots past a row's tokens
have position -1 (they see nothing and are never read back), padded pairs join the last query
tile with key tile 0 and context length 0 (fully masked: they weigh nothing, and `pair_q` stays
sorted), and padded key tiles read the null block.
"""

from __future__ import annotations

from typing import Sequence as Seq

import jax
import numpy as np
from flax import struct


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def fine_bucket(n: int, minimum: int = 1, *, steps: int = 4) -> int:
    """Smallest multiple of bucket(n) / (2 * steps) that is >= max(n, minimum): `steps` shapes between
    two powers of two (padding under 1/steps of n). For the dimensions that carry the work."""
    n = max(n, minimum)
    step = max(bucket(n) // (2 * steps), 1)
    return -(-n // step) * step


def row_bucket(n: int) -> int:
    """Padded row count of a decode step (where N == B) and of a sampler call: powers of two up to
    16, then two shapes per power of two (24, 32, 48, 64, 96, ...). Decode steps are the many
    steps, and their matmuls cost in proportion to the padded rows: 17 rows pay for 24, not 32."""
    return bucket(n) if n <= 16 else fine_bucket(n, steps=2)


@struct.dataclass
class AttentionPlan:
    """Which query tiles attend to which key tiles (see the module docstring).

    q_index     i32[NQ, TQ]  packed token index of each query-tile slot (padding: 0)
    q_positions i32[NQ, TQ]  absolute position of each slot (padding: -1, sees no key)
    k_blocks    i32[NK, TK // block_size]  physical blocks of each key tile, in logical order
    k_start     i32[NK]      absolute position of each key tile's first token
    pair_q      i32[P]       query tile of each pair, non-decreasing (a tile's pairs are consecutive)
    pair_k      i32[P]       key tile of each pair
    pair_len    i32[P]       context length of the pair's row (keys at positions >= it are masked)
    token_slot  i32[N]       where each packed token sits in the flattened [NQ * TQ] query tiles
    """

    q_index: jax.Array
    q_positions: jax.Array
    k_blocks: jax.Array
    k_start: jax.Array
    pair_q: jax.Array
    pair_k: jax.Array
    pair_len: jax.Array
    token_slot: jax.Array


@struct.dataclass
class ModelInputs:
    """One step's packed batch: row b's new tokens are consecutive and end at `logits_index[b]`.

    token_ids     i32[N]     new tokens of all rows, end to end (padding: 0)
    positions     i32[N]     their absolute positions in their sequence
    slot_mapping  i32[N]     where each new token's K/V is written (padding: a slot of the null block)
    logits_index  i32[B]     the packed index of each row's last new token (padding rows: 0)
    block_tables  i32[B, M]  physical block ids in logical order (padding: 0); the Pallas kernel's view
    context_lens  i32[B]     tokens of each row in the cache after this step (padding rows: 0)
    plan          the XLA path's attention plan
    """

    token_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    logits_index: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    plan: AttentionPlan

    @property
    def shape_key(self) -> tuple:
        """Every array's shape: one compiled step per distinct key."""
        return tuple(x.shape for x in jax.tree.leaves(self))


def pack_rows(rows: Seq, *, block_size: int, q_tile: int, k_tile: int) -> ModelInputs:
    """Packs scheduler rows (`token_ids`, `start_position`, `slots`, `block_table`) into `ModelInputs`.

    A row computes its tokens at positions start_position.. and then holds start_position +
    len(token_ids) tokens; `block_table` covers all of them. `k_tile` must be a multiple of
    `block_size`.
    """
    if k_tile % block_size:
        raise ValueError(f"k_tile ({k_tile}) must be a multiple of block_size ({block_size})")
    blocks_per_tile = k_tile // block_size
    lens = [len(r.token_ids) for r in rows]
    total = sum(lens)
    prefill = max(lens) > 1  # decode steps are many and small: coarse buckets keep their compilations few
    num_rows = bucket(len(rows)) if prefill else row_bucket(len(rows))
    num_tokens = fine_bucket(total, 16) if prefill else num_rows  # decode: N == B
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)
    logits_index = np.zeros(num_rows, np.int32)
    context_lens = np.zeros(num_rows, np.int32)
    width = bucket(max(len(r.block_table) for r in rows), 4)
    block_tables = np.zeros((num_rows, width), np.int32)

    q_tiles, k_tiles, pairs = [], [], []  # (start token, count, first pos) / (blocks, start pos) / (qt, kt, len)
    start = 0
    for b, r in enumerate(rows):
        n, first = lens[b], r.start_position
        context = first + n
        token_ids[start:start + n] = r.token_ids
        positions[start:start + n] = np.arange(first, context)
        slots[start:start + n] = r.slots
        logits_index[b] = start + n - 1
        context_lens[b] = context
        block_tables[b, :len(r.block_table)] = r.block_table
        row_k = len(k_tiles)
        for t in range(-(-context // k_tile)):
            k_tiles.append((r.block_table[t * blocks_per_tile:(t + 1) * blocks_per_tile], t * k_tile))
        for t0 in range(0, n, q_tile):
            qt = len(q_tiles)
            q_tiles.append((start + t0, min(q_tile, n - t0), first + t0))
            last_position = first + min(t0 + q_tile, n) - 1
            pairs.extend((qt, row_k + t, context) for t in range(last_position // k_tile + 1))
        start += n

    num_q, num_k = (bucket(len(q_tiles)) if prefill else num_rows), bucket(len(k_tiles))
    num_pairs = fine_bucket(len(pairs), steps=4 if prefill else 2)
    q_index = np.zeros((num_q, q_tile), np.int32)
    q_positions = np.full((num_q, q_tile), -1, np.int32)
    token_slot = np.zeros(num_tokens, np.int32)
    for i, (s, count, pos) in enumerate(q_tiles):
        q_index[i, :count] = np.arange(s, s + count)
        q_positions[i, :count] = np.arange(pos, pos + count)
        token_slot[s:s + count] = i * q_tile + np.arange(count)
    k_blocks = np.zeros((num_k, blocks_per_tile), np.int32)
    k_start = np.zeros(num_k, np.int32)
    for i, (blocks, pos) in enumerate(k_tiles):
        k_blocks[i, :len(blocks)] = blocks
        k_start[i] = pos
    pair_arr = np.zeros((num_pairs, 3), np.int32)
    pair_arr[:, 0] = num_q - 1
    pair_arr[:len(pairs)] = pairs
    plan = AttentionPlan(q_index=q_index, q_positions=q_positions, k_blocks=k_blocks, k_start=k_start,
                         pair_q=pair_arr[:, 0], pair_k=pair_arr[:, 1], pair_len=pair_arr[:, 2],
                         token_slot=token_slot)
    return ModelInputs(token_ids=token_ids, positions=positions, slot_mapping=slots, logits_index=logits_index,
                       block_tables=block_tables, context_lens=context_lens, plan=plan)


def stack_inputs(packed: Seq[ModelInputs]) -> ModelInputs:
    """Several `ModelInputs` (one per data-parallel rank) as one whose every leaf has a leading
    [len(packed)] axis: each padded at its end to the largest shape, as `pack_rows` pads (0; query
    positions -1, which see nothing; pairs joining the last query tile, with context length 0, so
    `pair_q` stays sorted and they weigh nothing). A decode step's N == B holds after padding."""
    num_q = max(p.plan.q_index.shape[0] for p in packed)

    def stack(path, *leaves):
        name = getattr(path[-1], "name", None)
        shape = tuple(max(dims) for dims in zip(*(np.shape(x) for x in leaves)))
        fill = -1 if name == "q_positions" else num_q - 1 if name == "pair_q" else 0
        out = np.full((len(leaves),) + shape, fill, np.int32)
        for i, x in enumerate(leaves):
            out[(i,) + tuple(slice(0, d) for d in np.shape(x))] = x
        return out

    return jax.tree_util.tree_map_with_path(stack, packed[0], *packed[1:])


@struct.dataclass
class DataParallelInputs:
    """A data-parallel step's inputs: each rank's rows packed apart, in the rank's local block ids,
    and stacked (`stack_inputs`: every leaf of `inputs` has a leading [num_ranks] axis).

    row_index i32[R]  where row i of the step (in the scheduler's order) finds its logits among the
                      ranks' rows flattened, rank-major (padding: 0)
    """

    inputs: ModelInputs
    row_index: jax.Array

    @property
    def shape_key(self) -> tuple:
        return tuple(x.shape for x in jax.tree.leaves(self))

    @property
    def token_ids(self):
        """Every rank's packed tokens, end to end (their count is what the step computed, padding included)."""
        return np.asarray(self.inputs.token_ids).reshape(-1)
