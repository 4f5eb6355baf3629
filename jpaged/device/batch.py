"""One step's batch as device arrays: the scheduler's rows, packed token by token, plus the
*attention plan* that tells the XLA attention path which (query tile, key tile) pairs to compute.

Packing. The new tokens of all rows are laid end to end (`token_ids i32[N]`, no per-row padding),
so a prefill of a 1,000-token and a 40-token prompt costs 1,040 token-steps of the matmuls, not
2 x 1,024. Only the total N is padded (to a shape bucket, below); padded tokens write to the null block.

Attention plan (the XLA path; the native and Pallas kernels read `block_tables` instead). Each row's
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

An engine packs with `StepShapes` instead of `pack_rows`: buckets bounded by its limits, in which
the inputs its attention backend does not read shape nothing, so that every step shape it can
meet is known ahead and compiled before serving (`LLMEngine.warm_up`).
"""

from __future__ import annotations

import dataclasses
import itertools
from operator import attrgetter
from typing import Callable, Sequence as Seq

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
    block_tables  i32[B, M]  physical block ids in logical order (padding: 0); the kernels' view
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
    `block_size`. Shapes: the buckets of the module docstring, with no limit known (an engine packs
    with its `StepShapes` instead, whose shapes are bounded by its limits and can be enumerated).
    """
    if k_tile % block_size:
        raise ValueError(f"k_tile ({k_tile}) must be a multiple of block_size ({block_size})")
    lens = [len(r.token_ids) for r in rows]
    prefill = max(lens) > 1  # decode steps are many and small: coarse buckets keep their compilations few
    tiles = _tiles(rows, q_tile, k_tile, k_tile // block_size)
    q_tiles, k_tiles, pairs = tiles
    num_rows = bucket(len(rows)) if prefill else row_bucket(len(rows))
    dims = StepDims(num_tokens=fine_bucket(sum(lens), 16) if prefill else num_rows,  # decode: N == B
                    num_rows=num_rows, width=bucket(max(len(r.block_table) for r in rows), 4),
                    num_q=bucket(len(q_tiles)) if prefill else num_rows, num_k=bucket(len(k_tiles)),
                    num_pairs=fine_bucket(len(pairs), steps=4 if prefill else 2))
    return _fill(rows, dims, q_tile=q_tile, blocks_per_tile=k_tile // block_size, tiles=tiles)


@dataclasses.dataclass(frozen=True)
class StepDims:
    """The padded sizes of one step's `ModelInputs` (steps of equal dims and kind share an executable):
    num_tokens N, num_rows B, width M (block-table columns), num_q NQ (query tiles), num_k NK (key
    tiles), num_pairs P. An input the attention backend does not read is packed at a fixed size of
    one entry (the plan: NQ = NK = P = 1; the block tables: M = 1), so it shapes nothing."""

    num_tokens: int
    num_rows: int
    width: int
    num_q: int
    num_k: int
    num_pairs: int


def _tiles(rows: Seq, q_tile: int, k_tile: int, blocks_per_tile: int) -> tuple[list, list, list]:
    """A step's query tiles (start token, count, first position), key tiles (blocks, start position)
    and pairs (query tile, key tile, context length): see the module docstring."""
    q_tiles, k_tiles, pairs = [], [], []
    start = 0
    for r in rows:
        n, first = len(r.token_ids), r.start_position
        context = first + n
        row_k = len(k_tiles)
        for t in range(-(-context // k_tile)):
            k_tiles.append((r.block_table[t * blocks_per_tile:(t + 1) * blocks_per_tile], t * k_tile))
        for t0 in range(0, n, q_tile):
            qt = len(q_tiles)
            q_tiles.append((start + t0, min(q_tile, n - t0), first + t0))
            last_position = first + min(t0 + q_tile, n) - 1
            pairs.extend((qt, row_k + t, context) for t in range(last_position // k_tile + 1))
        start += n
    return q_tiles, k_tiles, pairs


_TOKEN_IDS, _START_POSITION, _SLOTS, _BLOCK_TABLE = map(attrgetter, ("token_ids", "start_position", "slots",
                                                                   "block_table"))


class BlockTableCache:
    """The rows' block tables as int32 arrays, kept from one step to the next: a sequence's table is the
    block manager's tuple, the same object every step until a block is added to it, so each is converted
    once instead of entry by entry every step (a decode step at long contexts packs hundreds of entries a
    row). Keyed by the tuple itself (its identity, the tuple held so that the identity stays its own);
    what the last step did not pack is dropped. Tables of other types (lists: mutable) are converted
    every time. One cache per stepping thread (a runner's)."""

    def __init__(self):
        self._arrays: dict[int, tuple[tuple, np.ndarray]] = {}

    def concatenated(self, tables: Seq[Seq[int]]) -> np.ndarray:
        """Every table's entries, end to end (int32)."""
        kept, arrays = {}, []
        for table in tables:
            if type(table) is tuple:
                entry = self._arrays.get(id(table))
                if entry is None or entry[0] is not table:
                    entry = (table, np.array(table, np.int32))
                kept[id(table)] = entry
                arrays.append(entry[1])
            else:
                arrays.append(np.asarray(table, np.int32))
        self._arrays = kept
        return np.concatenate(arrays) if arrays else np.zeros(0, np.int32)


def _fill(rows: Seq, dims: StepDims, *, q_tile: int, blocks_per_tile: int, tiles=None,
          tables: bool = True, table_cache: BlockTableCache | None = None) -> ModelInputs:
    """`rows` packed into arrays of `dims` (each at least what the rows need); `tiles` (`_tiles`), or
    None for a one-entry plan that nothing reads; `tables`: False for block tables that nothing reads
    (zeros); `table_cache`: the block tables' arrays kept from the step before, if any."""
    num_tokens, num_rows, width = dims.num_tokens, dims.num_rows, dims.width
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)
    logits_index = np.zeros(num_rows, np.int32)
    context_lens = np.zeros(num_rows, np.int32)
    block_tables = np.zeros((num_rows, width), np.int32)
    # every row at once: one pass over the rows' lists each, then numpy over the packed tokens
    # (the rows' fields read by `map(attrgetter(...))`: iterated in C, no Python frame a row)
    num_real = len(rows)
    row_tokens = list(map(_TOKEN_IDS, rows))
    lens = np.fromiter(map(len, row_tokens), np.int32, num_real)
    starts = np.fromiter(map(_START_POSITION, rows), np.int32, num_real)
    ends = np.cumsum(lens, dtype=np.int32)
    total = int(ends[-1]) if num_real else 0
    token_ids[:total] = np.fromiter(itertools.chain.from_iterable(row_tokens), np.int32, total)
    slots[:total] = np.fromiter(itertools.chain.from_iterable(map(_SLOTS, rows)), np.int32, total)
    # a token's position: its row's start plus its index in the row (its packed index less the row's offset)
    positions[:total] = np.repeat(starts - (ends - lens), lens) + np.arange(total, dtype=np.int32)
    logits_index[:num_real] = ends - 1
    context_lens[:num_real] = starts + lens
    if tables:
        row_tables = list(map(_BLOCK_TABLE, rows))
        table_lens = np.fromiter(map(len, row_tables), np.int64, num_real)
        num_entries = int(table_lens.sum())
        # entry j of row i goes to flat index i * width + j: O(entries), not O(rows * width)
        first = np.cumsum(table_lens) - table_lens
        flat = np.repeat(np.arange(num_real, dtype=np.int64) * width - first, table_lens) + np.arange(num_entries)
        block_tables.reshape(-1)[flat] = (
            np.fromiter(itertools.chain.from_iterable(row_tables), np.int32, num_entries) if table_cache is None
            else table_cache.concatenated(row_tables))
    num_q, num_k, num_pairs = dims.num_q, dims.num_k, dims.num_pairs
    q_index = np.zeros((num_q, q_tile), np.int32)
    q_positions = np.full((num_q, q_tile), -1, np.int32)
    token_slot = np.zeros(num_tokens if tiles is not None else 1, np.int32)
    k_blocks = np.zeros((num_k, blocks_per_tile), np.int32)
    k_start = np.zeros(num_k, np.int32)
    pair_arr = np.zeros((num_pairs, 3), np.int32)
    pair_arr[:, 0] = num_q - 1
    if tiles is not None:
        q_tiles, k_tiles, pairs = tiles
        for i, (s, count, pos) in enumerate(q_tiles):
            q_index[i, :count] = np.arange(s, s + count)
            q_positions[i, :count] = np.arange(pos, pos + count)
            token_slot[s:s + count] = i * q_tile + np.arange(count)
        for i, (blocks, pos) in enumerate(k_tiles):
            k_blocks[i, :len(blocks)] = blocks
            k_start[i] = pos
        pair_arr[:len(pairs)] = pairs
    plan = AttentionPlan(q_index=q_index, q_positions=q_positions, k_blocks=k_blocks, k_start=k_start,
                         pair_q=pair_arr[:, 0], pair_k=pair_arr[:, 1], pair_len=pair_arr[:, 2],
                         token_slot=token_slot)
    return ModelInputs(token_ids=token_ids, positions=positions, slot_mapping=slots, logits_index=logits_index,
                       block_tables=block_tables, context_lens=context_lens, plan=plan)


def bucket_values(lo: int, hi: int, bucket_of: Callable[[int], int]) -> list[int]:
    """Every value `bucket_of` (non-decreasing, bucket_of(n) >= n) takes on lo..hi, ascending."""
    values, v = [], bucket_of(max(lo, 1))
    last = bucket_of(max(hi, lo, 1))
    while True:
        values.append(v)
        if v >= last:
            return values
        v = bucket_of(v + 1)


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """An engine's shape buckets, bounded by its limits, so that every step shape it can meet is known
    ahead (`all_dims`) and can be compiled before serving (`LLMEngine.warm_up`).

    Limits: `max_num_seqs` (rows of a step), `max_prefill_tokens` (tokens a prefill step computes),
    `max_model_len` (a row's context), `max_width` (block-table entries a row can have),
    `prefix_caching` (whether a prefill row may start past cached tokens). `reads_plan` /
    `reads_tables` (prefill, decode): whether the attention backend reads the attention plan / the
    block tables in each step kind; what it does not read is packed at one entry and shapes nothing.

    Each step kind has one dimension that carries its work, bucketed finely; the others follow from it
    and from the limits, so that the shapes stay few:
    - decode: B = row_bucket(rows) (N = NQ = B); block tables M = `max_width` whole (the kernels read a
      row's entries up to its context length only: the width costs its int32 entries and no work);
      plan (the XLA path, whose attention work is its pairs): P = fine_bucket(pairs, steps=2), NK = P.
    - prefill: N = fine_bucket(tokens, 16); without a plan, B (rows, whose logits are computed) is
      bucket(N) / 8 when the rows fit (padded logits rows then cost under ~5% of the step's FLOPs), else
      bucket(N) (every row computes a token), at most the row cap; with a plan, P = bucket(pairs), and
      B = bucket(min(N, P)) (every row has a pair), NQ and NK the least of P and their bounds.
    Samples beyond the logits rows (a fresh group of n samples draws n from one prompt row) are drawn
    in several sampler calls of the logits' row count (`ModelRunner.sample`), so that the sampler
    meets one sample count per logits row count.
    """

    block_size: int
    q_tile: int
    prefill_k_tile: int
    decode_k_tile: int
    max_num_seqs: int
    max_prefill_tokens: int
    max_model_len: int
    max_width: int
    prefix_caching: bool = False
    reads_plan: tuple[bool, bool] = (True, True)
    reads_tables: tuple[bool, bool] = (True, True)

    # ---- buckets -------------------------------------------------------------------------------

    @property
    def max_rows(self) -> int:
        """Rows of the largest step (the row cap)."""
        return row_bucket(self.max_num_seqs)

    @staticmethod
    def token_bucket(n: int) -> int:
        return fine_bucket(n, 16)

    @staticmethod
    def pair_bucket(n: int, *, decode: bool) -> int:
        return fine_bucket(n, steps=2) if decode else bucket(n)

    def prefill_row_options(self, num_tokens: int) -> list[int]:
        """The row counts B of a prefill of `num_tokens` padded tokens, without a plan (the least that fits)."""
        cap = self.max_rows
        return sorted({min(cap, max(1, bucket(num_tokens) // 8)), min(cap, bucket(num_tokens))})

    def plan_rows(self, num_tokens: int, num_pairs: int) -> int:
        """The row count B of a prefill with a plan: every row has a token and a pair."""
        return min(self.max_rows, bucket(min(num_tokens, num_pairs)))

    def _prefill_bounds(self, num_tokens: int, num_rows: int) -> tuple[int, int, int]:
        """Upper bounds of (query tiles, key tiles, pairs) of a prefill of at most `num_tokens` tokens
        in at most `num_rows` rows. A row of n tokens has m = ceil(n / q_tile) query tiles, and the
        step's extra tiles sum(m - 1) stay below tokens / q_tile; query tile j of a row that starts at
        position 0 pairs with ((j + 1) * q_tile - 1) // k_tile + 1 key tiles at most, a number that
        grows with j, so the pairs are most when the extra tiles fill whole rows of `max_model_len`.
        A row past cached tokens (prefix caching) has up to ceil(max_model_len / k_tile) pairs per tile."""
        q, k, length = self.q_tile, self.prefill_k_tile, self.max_model_len
        num_rows = min(num_rows, num_tokens)  # every row computes a token
        extra = -(-num_tokens // q) - 1
        num_q = min(num_rows + extra, num_tokens)
        per_tile = -(-length // k)
        if self.prefix_caching:
            return num_q, num_rows * per_tile, num_q * per_tile
        num_k = min(num_rows + -(-num_tokens // k) - 1, num_tokens)
        per_row = -(-length // q) - 1  # a row's extra tiles, at most
        if per_row == 0:
            return num_q, num_k, num_rows
        full, rest = divmod(extra, per_row)
        return num_q, num_k, num_rows + full * _extra_tile_pairs(per_row, q, k) + _extra_tile_pairs(rest, q, k)

    def dims(self, rows: Seq, *, decode: bool, tiles=None) -> StepDims:
        """The padded dims of a step over `rows` (`tiles`: their `_tiles`, where the plan is read)."""
        plan, tables = self.reads_plan[decode], self.reads_tables[decode]
        width = self.max_width if tables else 1
        if decode:
            num_rows = row_bucket(len(rows))
            num_pairs = self.pair_bucket(len(tiles[2]), decode=True) if plan else 1
            return StepDims(num_tokens=num_rows, num_rows=num_rows, width=width, num_q=num_rows if plan else 1,
                            num_k=num_pairs, num_pairs=num_pairs)
        num_tokens = self.token_bucket(sum(len(r.token_ids) for r in rows))
        if not plan:
            num_rows = next((b for b in self.prefill_row_options(num_tokens) if b >= len(rows)), len(rows))
            return StepDims(num_tokens, num_rows, width, 1, 1, 1)
        num_pairs = self.pair_bucket(len(tiles[2]), decode=False)
        num_rows = self.plan_rows(num_tokens, num_pairs)
        max_q, max_k, _ = self._prefill_bounds(num_tokens, num_rows)
        return StepDims(num_tokens, num_rows, width, min(num_pairs, max_q), min(num_pairs, max_k), num_pairs)

    def pack(self, rows: Seq, *, decode: bool, table_cache: BlockTableCache | None = None) -> ModelInputs:
        """Packs a step's rows (as `pack_rows` does) at this engine's buckets (`table_cache`: the stepping
        thread's `BlockTableCache`, if any)."""
        if decode and any(len(r.token_ids) != 1 for r in rows):
            raise ValueError("a decode row computes exactly one token")
        q_tile, k_tile = (1 if decode else self.q_tile), (self.decode_k_tile if decode else self.prefill_k_tile)
        tiles = _tiles(rows, q_tile, k_tile, k_tile // self.block_size) if self.reads_plan[decode] else None
        return _fill(rows, self.dims(rows, decode=decode, tiles=tiles), q_tile=q_tile,
                     blocks_per_tile=k_tile // self.block_size, tiles=tiles, tables=self.reads_tables[decode],
                     table_cache=table_cache)

    # ---- every shape -------------------------------------------------------------------------------

    def all_dims(self, *, decode: bool) -> list[StepDims]:
        """Every `StepDims` a step of this kind can take within the limits (the bounds are upper
        bounds: a few of them may never occur)."""
        plan, tables = self.reads_plan[decode], self.reads_tables[decode]
        width = self.max_width if tables else 1
        out = []
        previous = 0
        if decode:
            per_row = -(-self.max_model_len // self.decode_k_tile)  # a row's key tiles, at most
            for b in bucket_values(1, self.max_num_seqs, row_bucket):
                if not plan:
                    out.append(StepDims(b, b, width, 1, 1, 1))
                else:  # pairs: at least one per row (more rows than the bucket below), at most per_row
                    out += [StepDims(b, b, width, b, p, p)
                            for p in bucket_values(previous + 1, b * per_row, self.pair_bucket_of(True))]
                previous = b
            return out
        for n in bucket_values(1, self.max_prefill_tokens, self.token_bucket):
            if not plan:
                out += [StepDims(n, b, width, 1, 1, 1) for b in self.prefill_row_options(n)]
            else:  # pairs: at least one per query tile (more tokens than the bucket below)
                _, _, max_pairs = self._prefill_bounds(n, min(n, self.max_num_seqs))
                for p in bucket_values(-(-(previous + 1) // self.q_tile), max_pairs, self.pair_bucket_of(False)):
                    b = self.plan_rows(n, p)
                    max_q, max_k, _ = self._prefill_bounds(n, b)
                    out.append(StepDims(n, b, width, min(p, max_q), min(p, max_k), p))
            previous = n
        return out

    def pair_bucket_of(self, decode: bool) -> Callable[[int], int]:
        return lambda n: self.pair_bucket(n, decode=decode)

    def abstract_inputs(self, dims: StepDims, *, decode: bool) -> ModelInputs:
        """`ModelInputs` of `jax.ShapeDtypeStruct`s of `dims`: what compiling a step needs."""
        q_tile, k_tile = (1 if decode else self.q_tile), (self.decode_k_tile if decode else self.prefill_k_tile)

        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, np.int32)

        n, b = dims.num_tokens, dims.num_rows
        return ModelInputs(
            token_ids=i32(n), positions=i32(n), slot_mapping=i32(n), logits_index=i32(b),
            block_tables=i32(b, dims.width), context_lens=i32(b),
            plan=AttentionPlan(q_index=i32(dims.num_q, q_tile), q_positions=i32(dims.num_q, q_tile),
                               k_blocks=i32(dims.num_k, k_tile // self.block_size), k_start=i32(dims.num_k),
                               pair_q=i32(dims.num_pairs), pair_k=i32(dims.num_pairs),
                               pair_len=i32(dims.num_pairs),
                               token_slot=i32(n if self.reads_plan[decode] else 1)))

    def top_bucket(self, num_top: int) -> int:
        """The top log-probabilities the sampler computes when `num_top` are asked for: 0 or 1 as asked
        (1: the argmax, free), 32 (`logprobs` up to 20, beam search up to 16 beams), else `max_top`."""
        return num_top if num_top <= 1 else 32 if num_top <= 32 else self.max_top

    @property
    def max_top(self) -> int:
        """Top log-probabilities a request can ask for: 20, or two per beam of the widest beam search."""
        return max(32, bucket(max(20, 2 * self.max_num_seqs)))

    def top_buckets(self) -> list[int]:
        return sorted({1, 32, self.max_top})


def _extra_tile_pairs(extra: int, q_tile: int, k_tile: int) -> int:
    """Pairs of query tiles 1..extra of a row that starts at position 0, at most."""
    return sum(((j + 1) * q_tile - 1) // k_tile + 1 for j in range(1, extra + 1))


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
