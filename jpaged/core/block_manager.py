"""The paged KV block manager (PagedAttention, sections 4.2-4.5) as an immutable snapshot.

A `BlockManager` is a value: `allocate`, `append`, `fork`, `free`, `swap_out` and `swap_in` return
a new snapshot (plus the `DeviceOps` the device must run) and never mutate the old one, so a failed
operation leaves its input untouched. It implements `jpaged.core.kv_cache_manager`'s
`KVCacheManager`, `ForkingKVCacheManager` and `SwappingKVCacheManager`. Host-side only: no JAX.

Vocabulary (the paper's): the device pool holds `num_blocks` physical blocks of `block_size` token
slots; a sequence's block table maps its logical blocks to physical block ids; slot =
block_id * block_size + offset; a block's refcount is the number of block-table entries naming it.

Invariants (`check_invariants` asserts them all):
- Block 0 is the null block (padded block-table entries point at it): never allocated, freed or
  refcounted; never in a free list; in a block table only as a leading entry a sliding window
  released (below).
- Every other device block is exactly one of: used (refcount r > 0, named by exactly r entries of
  running sequences' block tables), free (refcount 0, once in the free list) or, with prefix
  caching, cached-free (refcount 0, in the prefix cache, once in the LRU evictable list). CPU blocks
  are used by swapped-out sequences' tables the same way, or free.
- A sequence of n tokens has a table of ceil(n / block_size) entries. A shared block sits at the
  same logical index, with the same number of filled slots, in every table that names it (so slots
  shared by two sequences hold the same token prefix).
- Prefix cache: block hash <-> block id is one-to-one, and only full blocks are cached.
- Lookahead slots (speculative decoding: `append(..., lookahead=k)`, `commit_lookahead`): a running
  sequence of n tokens may hold k slots past them for one step, its table then ceil((n + k) /
  block_size) entries; the blocks only they need are its own (refcount 1, never cached). Draft
  tokens are not tokens: they enter the sequence (and its hash chain) only when `commit_lookahead`
  accepts them, and it gives back the slots left over. A sequence with lookahead slots is not
  forked, swapped out or appended to before that.
- Uncomputed blocks (a prompt prefilled in chunks: `allocate(num_computed=...)`, `cache_computed`):
  a sequence's last full blocks whose K/V no step scheduled so far writes are not in the prefix
  cache yet (their hashes wait in the sequence); such a sequence is running, and is not forked,
  swapped out or appended to before they are computed.

Sliding window (`sliding_window=W`, for models whose every layer attends only to its W most recent
positions, its own included: the query at position p sees keys k with p - W < k <= p). When a
step computes query positions >= p0 of a sequence, its blocks whose last position is <= p0 - W are
dead: no query of this or any later step reads them. There are `num_dead(p0) = max(0, (p0 - W + 1)
// block_size)` of them, and the manager releases them at the two moments it knows p0:
- `allocate`: p0 = the tokens whose K/V need not be computed (the prefix-cache hit); dead cached
  blocks of the hit are not even taken. Without a hit p0 = 0: a prefill, first or recomputed after
  preemption by recompute, holds its whole context for that one step (and must fit the pool);
- `append`: p0 = the sequence's token count before the append (its new token's position). All of a
  batch's releases happen before its allocations, so a block released by one sequence may be
  taken by another in the same `append` (`num_blocks_to_append` counts it: `can_append` is exact).
A released entry becomes NULL_BLOCK_ID: tables keep their length ceil(n / block_size) and every
position its logical index (`slot_mapping` is unchanged for live positions); the first
`num_null_blocks(seq_id)` entries are null and a null entry never follows a live one. While a
sequence is swapped out those leading entries stay 0 and name no CPU block (CPU block 0 is a real
block: read them through `num_null_blocks`). Release is the usual refcount - 1 (a block a forked
sibling still reads stays until its last holder releases it), in logical order, to the back of the
free list, or, when it is cached, of the evictable list with its hash kept.
Invariants: a sequence of n tokens has num_null <= num_dead(n - 1) (nothing a pending or future
query reads is released; equality right after an `append`), so right after an append it holds at
most `max_window_blocks` = ceil((W - 1) / block_size) + 1 live blocks (<= ceil(W / block_size) + 1):
the W positions p0 - W + 1 .. p0 touch that many blocks at most. A recomputed or just-allocated
sequence holds more (its whole uncached context) until its first append.
Prefix caching with a window: a dead block is always full (the block of p0 is live), so with prefix
caching it was cached when it filled (unless an identical block was cached first), and it is never
a copy-on-write source (a shared partial block is every holder's last). A released block keeps its
K/V and its hash, so a later request with the same prefix can still map it (LRU eviction takes
released heads before tails: they were released earlier). The hash
chain is over token ids, not over blocks held, so the blocks after a released one hash the same
whether or not it is still held or cached. A request needs cached blocks only for its live
positions: `allocate` takes the largest k (k <= (len - 1) // block_size) such that blocks
num_dead(k * block_size) .. k - 1 are all cached, even where blocks before them were evicted; it
maps those blocks and leaves the dead ones null.

KV utilization: `num_filled_slots` counts the token slots holding K/V in the device blocks in use (a
block shared by several tables counted once: its holders agree on its fill; lookahead slots and
released entries hold none). Every operation keeps it as it takes and releases blocks (O(1) per
block touched), so that a per-step statistic never walks the pool (`check_invariants` compares it
with a walk).

Orders (tests pin them): allocation pops the front of the free list; a freed block goes to its
back. With prefix caching, uncached free blocks are used first, then cached-free blocks least
recently freed first (their cache entries are dropped). `free` releases each sequence's blocks
last block first (vLLM's order: a prefix's tail is evicted before its head); a sliding window's
releases in `append` go in logical order, sequence by sequence in the batch's order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from jpaged.core.kv_cache_manager import (NULL_BLOCK_ID, DeviceOps, KVCacheSpec, OutOfBlocksError, SeqId,
                                          blocks_for, check_unique, slot_ids)
from jpaged.core.persistent import SHARD_BITS, Queue, Table, TableEdit

# A full block's identity for prefix caching: (hash() of the parent block's BlockHash, or None for
# the first block; the block's token ids). Keying on the token ids themselves means only a
# collision of the 64-bit parent hash could alias two different prefixes.
BlockHash = tuple


class _Seq(NamedTuple):
    block_ids: tuple[int, ...]  # block table: device ids if running, CPU ids if swapped out
    num_tokens: int
    swapped: bool = False
    parent_hash: int | None = None  # prefix caching: hash() of the last full block's BlockHash
    partial_token_ids: tuple[int, ...] = ()  # prefix caching: the partly filled last block's tokens
    num_null: int = 0  # sliding window: leading entries released (NULL_BLOCK_ID, naming no block)
    uncomputed: tuple[BlockHash, ...] = ()  # prefix caching: hashes of the last full blocks, not yet computed
    num_lookahead: int = 0  # slots held past the tokens, for draft tokens (speculative decoding)

    @property
    def live(self) -> tuple[int, ...]:
        """The block ids the table holds (refcounted): every entry after the null ones."""
        return self.block_ids[self.num_null:]


_new_seq = functools.partial(tuple.__new__, _Seq)  # every field given, without the Python-level __new__


@dataclasses.dataclass(frozen=True, repr=False)
class BlockManager:
    """Snapshot of the device and CPU block pools and every sequence's block table; build one with
    `create`. Its tables and queues are persistent (`jpaged.core.persistent`): never mutated,
    shared between snapshots."""

    num_blocks: int  # the whole device pool, null block included
    block_size: int
    num_cpu_blocks: int
    enable_prefix_caching: bool
    _seqs: Table  # seq_id -> _Seq
    _refcounts: Table  # device block id -> refcount, for blocks in use only
    _free: Queue  # free uncached device blocks; the front is allocated next
    _evictable: Queue  # cached device blocks with refcount 0, least recently freed first
    _cached: Table  # the prefix cache: BlockHash -> device block id
    _block_hashes: Table  # its inverse: device block id -> BlockHash
    _cpu_refcounts: Table  # CPU block id -> refcount, for blocks in use only
    _free_cpu: Queue  # free CPU blocks
    sliding_window: int | None = None  # every layer's window W (module docstring), None: none
    num_filled_slots: int = 0  # token slots holding K/V in the device blocks in use (module docstring)

    # the most free device blocks an `append` of one token (no lookahead) takes per sequence: a new
    # block or a copy-on-write copy, never both (the scheduler's shortcut: `appends_fit`)
    max_blocks_per_append = 1

    @classmethod
    def create(cls, num_blocks: int, block_size: int, *, num_cpu_blocks: int = 0,
               enable_prefix_caching: bool = False, sliding_window: int | None = None,
               free_block_ids: Sequence[int] | None = None, shard_bits: int = SHARD_BITS) -> BlockManager:
        """`sliding_window`: W when every layer of the model sees only its W most recent positions
        (blocks that slide out are released, see the module docstring); None keeps every block.
        `free_block_ids`: the initial free-list order, a permutation of 1..num_blocks-1
        (default ascending). CPU blocks are 0..num_cpu_blocks-1, ascending. `shard_bits`: the
        persistent tables' shard width, 2**shard_bits consecutive keys a shard (default SHARD_BITS;
        tests lower it so small pools exercise many shards)."""
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError(f"bad pool: num_blocks={num_blocks}, block_size={block_size}, "
                             f"num_cpu_blocks={num_cpu_blocks}")
        if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
            raise ValueError(f"sliding_window must be None or an integer >= 1, got {sliding_window!r}")
        ids = list(range(1, num_blocks) if free_block_ids is None else free_block_ids)
        if sorted(ids) != list(range(1, num_blocks)):
            raise ValueError(f"free_block_ids must be a permutation of 1..{num_blocks - 1} "
                             f"(block {NULL_BLOCK_ID} is the null block)")
        empty, cpu_empty = Table.empty(num_blocks, shard_bits), Table.empty(num_cpu_blocks, shard_bits)
        return cls(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching, empty, empty,
                   Queue.of(ids, num_blocks, shard_bits), Queue.of([], num_blocks, shard_bits), empty, empty,
                   cpu_empty, Queue.of(range(num_cpu_blocks), num_cpu_blocks, shard_bits), sliding_window)

    @classmethod
    def from_spec(cls, spec: KVCacheSpec) -> BlockManager:
        """The engine's default KV cache manager factory: paging over the spec's pools."""
        return cls.create(spec.num_blocks, spec.block_size, num_cpu_blocks=spec.num_cpu_blocks,
                          enable_prefix_caching=spec.enable_prefix_caching, sliding_window=spec.sliding_window)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free device blocks, cached-free (evictable) ones included."""
        return self._free.size + self._evictable.size

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._free_cpu.size

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """Free device blocks in the order allocation takes them (O(num_blocks): for tests)."""
        return self._free.to_tuple() + self._evictable.to_tuple()

    @property
    def free_cpu_block_ids(self) -> tuple[int, ...]:
        return self._free_cpu.to_tuple()

    @property
    def seq_ids(self) -> tuple:
        """Every sequence, running or swapped out, in no particular order."""
        return tuple(self._seqs)

    def has(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def _seq(self, seq_id: SeqId, swapped: bool | None = None) -> _Seq:
        return _checked(self._seqs.get(seq_id), seq_id, swapped)

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        """Physical block ids in logical order (CPU block ids while swapped out)."""
        return self._seq(seq_id).block_ids

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_tokens

    def num_null_blocks(self, seq_id: SeqId) -> int:
        """Leading block-table entries the sliding window released (0 without a window)."""
        return self._seq(seq_id).num_null

    def num_dead_blocks(self, position: int) -> int:
        """Leading blocks no query at `position` or later reads: those whose last position is
        <= position - W (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, (position - self.sliding_window + 1) // self.block_size)

    @property
    def max_window_blocks(self) -> int | None:
        """The most live blocks a sequence holds right after an append: ceil((W - 1) / block_size)
        + 1, the blocks W consecutive positions can touch (None without a window)."""
        if self.sliding_window is None:
            return None
        return blocks_for(self.sliding_window - 1, self.block_size) + 1

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._seq(seq_id).swapped

    def slot(self, seq_id: SeqId, position: int) -> int:
        return self.slot_mapping(seq_id, position, position + 1)[0]

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Device slots of positions [start, end) of a running sequence (its lookahead slots included)."""
        seq, bs = self._seq(seq_id, swapped=False), self.block_size
        if not 0 <= start <= end <= seq.num_tokens + seq.num_lookahead:
            raise IndexError(f"positions [{start}, {end}) out of range for sequence {seq_id!r} "
                             f"of {seq.num_tokens} tokens and {seq.num_lookahead} lookahead slots")
        return slot_ids(seq.block_ids, start, end, bs)

    def refcount(self, block_id: int) -> int:
        return self._refcounts.get(block_id, 0)

    def cpu_refcount(self, cpu_block_id: int) -> int:
        return self._cpu_refcounts.get(cpu_block_id, 0)

    def is_cached(self, block_id: int) -> bool:
        """Whether a device block is in the prefix cache (used or cached-free)."""
        return block_id in self._block_hashes

    def can_allocate(self, token_ids: Sequence[Sequence[int]], *, reserve: int = 0) -> bool:
        """Whether new sequences holding these tokens (one list per sequence, sharing no block)
        fit with `reserve` blocks still free after them (the scheduler's watermark): each takes
        ceil(len / block_size) blocks. Conservative: prefix-cache hits can only lower the need."""
        bs = self.block_size
        return sum(blocks_for(len(ids), bs) for ids in token_ids) + reserve <= self.num_free_blocks

    def num_blocks_to_append(self, seq_ids: Sequence[SeqId], *, lookahead: int = 0) -> int:
        """Blocks one `append` of one token to each sequence takes (with `lookahead` slots past it
        each): a new block when the last is full, and the blocks the lookahead slots need; a copy
        when the last is shared, except for the last of its holders to write; less the blocks its
        sliding-window releases free (a block only when all its holders are among these
        sequences), never below 0."""
        check_unique(seq_ids)
        num_new, writers, releases = 0, Counter(), Counter()
        bs = self.block_size
        for seq_id in seq_ids:
            seq = self._seq(seq_id, swapped=False)
            num_new += blocks_for(seq.num_tokens + 1 + lookahead, bs) - blocks_for(seq.num_tokens, bs)
            if seq.num_tokens % bs:
                writers[seq.block_ids[-1]] += 1
            releases.update(seq.block_ids[seq.num_null:self.num_dead_blocks(seq.num_tokens)])
        num_copies = sum(min(k, self.refcount(b) - 1) for b, k in writers.items())
        num_freed = sum(1 for b, k in releases.items() if k == self.refcount(b))
        return max(0, num_new + num_copies - num_freed)

    def can_append(self, seq_ids: Sequence[SeqId]) -> bool:
        """Exact: `append` of these sequences succeeds iff this holds."""
        return self.num_blocks_to_append(seq_ids) <= self.num_free_blocks

    def _distinct_blocks(self, seq_ids: Sequence[SeqId], swapped: bool) -> int:
        return len({b for s in seq_ids for b in self._seq(s, swapped).live})

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool:
        return self._distinct_blocks(seq_ids, swapped=False) <= self.num_free_cpu_blocks

    def can_swap_in(self, seq_ids: Sequence[SeqId]) -> bool:
        """Counts only the swapped blocks; the caller reserves room for the next append."""
        return self._distinct_blocks(seq_ids, swapped=True) <= self.num_free_blocks

    def _prefix_hits(self, token_ids: Sequence[int]) -> tuple[list[BlockHash], int, list[int]]:
        """(the hashes of the full blocks of `token_ids`; k, the blocks of its prefix whose K/V is
        in the pool, at most (len - 1) // block_size; the cached block ids of blocks
        num_dead_blocks(k * block_size) .. k - 1, the ones its queries still read). Without a window
        k is the longest prefix found in the prefix cache; with one, the largest k whose live blocks
        are all cached. ([], 0, []) without prefix caching."""
        hashes, parent = [], None
        if not self.enable_prefix_caching:
            return hashes, 0, []
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            hashes.append((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            parent = hash(hashes[-1])
        found, run_start, k = [], 0, 0  # run_start: the first block of the cached run ending at j
        for j, block_hash in enumerate(hashes[:(len(token_ids) - 1) // bs]):
            found.append(block_id := self._cached.get(block_hash))
            if block_id is None:
                if self.sliding_window is None:
                    break
                run_start = j + 1
            elif run_start <= self.num_dead_blocks((j + 1) * bs):
                k = j + 1
        return hashes, k, found[self.num_dead_blocks(k * bs):k]

    def allocation_cost(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """What `allocate` of these tokens would take, without allocating: (free blocks it takes,
        tokens of its prefix found in the prefix cache). Cached blocks that running sequences hold
        are shared, not taken; dead ones (sliding window) are not held at all."""
        bs = self.block_size
        _, k, hits = self._prefix_hits(token_ids)
        taken = (blocks_for(len(token_ids), bs) - self.num_dead_blocks(k * bs)
                 - sum(1 for b in hits if self.refcount(b) > 0))
        return taken, k * bs

    # ---- operations ----------------------------------------------------------------------------
    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], *,
                 num_computed: int | None = None) -> tuple[BlockManager, int]:
        """A new running sequence holding `token_ids`. Returns (snapshot, num_cached_tokens): with
        prefix caching, its longest prefix of full blocks found in the cache, at most
        (len - 1) // block_size blocks (the last token is always computed), is mapped onto the
        cached blocks, and its other full blocks enter the cache once their K/V is being computed:
        `num_computed` says how many of its first tokens the step being scheduled writes (default:
        all of them; the engine writes a step's K/V before any attention reads it, so a block
        cached now may be shared by a row of the same step). The full blocks past it are kept
        uncomputed, and enter the cache when `cache_computed` says their step is scheduled (a
        prompt prefilled in chunks over several steps: a block must not be found by another
        request before its K/V is written). With a sliding window, the blocks of the hit that no
        query of the step reads (num_dead_blocks(num_cached_tokens)) are null entries, not taken
        (see the module docstring)."""
        if self.has(seq_id):
            raise ValueError(f"cannot allocate sequence {seq_id!r}: it already exists")
        n, bs = len(token_ids), self.block_size
        if n == 0:
            raise ValueError(f"cannot allocate sequence {seq_id!r} with no tokens")
        hashes, k, hits = self._prefix_hits(token_ids)
        parent = hash(hashes[-1]) if hashes else None
        num_null = self.num_dead_blocks(k * bs)
        num_needed = blocks_for(n, bs) - num_null - sum(1 for b in hits if self.refcount(b) > 0)
        if num_needed > self.num_free_blocks:
            raise OutOfBlocksError(f"cannot allocate sequence {seq_id!r} ({n} tokens): needs "
                                   f"{num_needed} blocks, {self.num_free_blocks} free")
        edit = _Edit(self)
        for block_id in hits:
            edit.acquire(block_id, filled=bs)  # a hit is a full block
        block_ids = [NULL_BLOCK_ID] * num_null + hits
        computed = len(hashes) if num_computed is None else max(k, min(num_computed // bs, len(hashes)))
        for i in range(k, blocks_for(n, bs)):
            block_ids.append(edit.allocate_block(filled=min(bs, n - i * bs)))
            if i < computed:
                edit.cache(hashes[i], block_ids[-1])
        partial = tuple(token_ids[len(hashes) * bs:]) if self.enable_prefix_caching else ()
        edit.seqs[seq_id] = _Seq(tuple(block_ids), n, False, parent, partial, num_null, tuple(hashes[computed:]))
        return edit.snapshot(), k * bs

    def cache_computed(self, seq_id: SeqId, num_computed: int) -> BlockManager:
        """The step being scheduled writes the K/V of the first `num_computed` tokens of a sequence
        allocated with fewer computed (`allocate(num_computed=...)`): its full blocks among them
        enter the prefix cache (unless an identical block is there already). Without prefix
        caching, or with nothing left uncomputed below `num_computed`, returns this snapshot."""
        seq = self._seq(seq_id, swapped=False)
        first = seq.num_tokens // self.block_size - len(seq.uncomputed)  # the first uncomputed block
        ready = max(0, min(num_computed // self.block_size - first, len(seq.uncomputed)))
        if not ready:
            return self
        edit = _Edit(self)
        for i, block_hash in enumerate(seq.uncomputed[:ready]):
            edit.cache(block_hash, seq.block_ids[first + i])
        edit.seqs[seq_id] = seq._replace(uncomputed=seq.uncomputed[ready:])
        return edit.snapshot()

    def append(self, appends: Sequence[tuple[SeqId, int]], *,
               lookahead: int | Mapping[SeqId, int] = 0) -> tuple[BlockManager, DeviceOps]:
        """One more token slot for each running sequence (for the token whose K/V is written
        this step), in order: a new block when the last is full; copy-on-write when the last
        block is shared (the copy goes to the sequence that appends first). With prefix caching,
        a block is cached the moment it becomes full. With a sliding window, every sequence's
        blocks that slid out of the window of its new token's query are released first (all
        sequences' releases before any allocation; the module docstring). `lookahead` (a count for
        every sequence, or per sequence id): slots held past the new token for this step's draft
        tokens, in new blocks of their own where the token's block has no room
        (`commit_lookahead` ends them)."""
        manager, ops, _, _ = self._append(appends, lookahead, rows=False)
        return manager, ops

    def append_slots(self, appends: Sequence[tuple[SeqId, int]]) -> tuple[
            BlockManager, DeviceOps, list[int], list[tuple[int, ...]]]:
        """A decode step's blocks in one call: `append(appends)` (no lookahead), plus, for each
        sequence in order, the slot its new token's K/V goes to and its block table afterwards
        (what `slot_mapping` and `block_table` would say, without a lookup per sequence)."""
        return self._append(appends, 0, rows=True)

    def _append(self, appends, lookahead, rows: bool):
        check_unique([seq_id for seq_id, _ in appends])
        edit, bs, copy_pairs = _Edit(self), self.block_size, []
        slots, tables = [], []
        if self.sliding_window is not None:
            for seq_id, _ in appends:
                seq = _checked(edit.seqs.get(seq_id), seq_id, swapped=False)
                if (num_null := self.num_dead_blocks(seq.num_tokens)) > seq.num_null:
                    for block_id in seq.block_ids[seq.num_null:num_null]:
                        edit.release(block_id, filled=bs)  # a dead block is full
                    edit.seqs[seq_id] = seq._replace(
                        block_ids=(NULL_BLOCK_ID,) * num_null + seq.block_ids[num_null:], num_null=num_null)
        seqs, refcounts, caching = edit.seqs, edit.refcounts, self.enable_prefix_caching
        per_seq = not isinstance(lookahead, int)
        for seq_id, token_id in appends:
            shard = seqs.writable_shard(seq_id)  # (read and written here: one lookup a sequence)
            seq = shard.get(seq_id)
            if seq is None or seq.swapped:
                _checked(seq, seq_id, swapped=False)
            if seq.uncomputed or seq.num_lookahead:
                raise ValueError(f"cannot append to sequence {seq_id!r}: it holds uncomputed blocks "
                                 "(cache_computed) or lookahead slots (commit_lookahead)")
            block_ids, parent, partial, n = seq.block_ids, seq.parent_hash, seq.partial_token_ids, seq.num_tokens
            offset = n % bs
            if offset == 0:
                block_ids += (edit.allocate_block(filled=1),)
            elif refcounts[last := block_ids[-1]] > 1:  # copy-on-write: the copy holds the shared slots and the new one
                block_ids = block_ids[:-1] + (edit.allocate_block(filled=offset + 1),)
                edit.release(last, filled=offset)
                copy_pairs.append((last, block_ids[-1]))
            else:
                edit.num_filled_slots += 1
            if caching:
                partial += (token_id,)
                if len(partial) == bs:
                    parent, partial = edit.cache((parent, partial), block_ids[-1]), ()
            k = lookahead.get(seq_id, 0) if per_seq else lookahead
            if k:
                for _ in range(blocks_for(n + 1 + k, bs) - len(block_ids)):
                    block_ids += (edit.allocate_block(),)  # lookahead slots hold no token yet
            shard[seq_id] = _new_seq((block_ids, n + 1, False, parent, partial, seq.num_null, (), k))
            if rows:
                slots.append(block_ids[n // bs] * bs + offset)
                tables.append(block_ids)
        return edit.snapshot(), DeviceOps(copy_pairs=tuple(copy_pairs)), slots, tables

    def commit_lookahead(self, seq_id: SeqId, token_ids: Sequence[int]) -> BlockManager:
        """Ends a sequence's lookahead slots: the first len(token_ids) of them now hold these tokens
        (draft tokens accepted: they join the sequence, and with prefix caching its hash chain, a
        block entering the cache when it becomes full), and the blocks only the others needed go
        back to the free list (rejected draft tokens leave nothing behind)."""
        seq = self._seq(seq_id, swapped=False)
        if len(token_ids) > seq.num_lookahead:
            raise ValueError(f"cannot commit {len(token_ids)} tokens to sequence {seq_id!r}: it holds "
                             f"{seq.num_lookahead} lookahead slots")
        edit, bs = _Edit(self), self.block_size
        parent, partial, n = seq.parent_hash, seq.partial_token_ids, seq.num_tokens
        for token_id in token_ids:
            n += 1
            if self.enable_prefix_caching:
                partial += (token_id,)
                if len(partial) == bs:
                    parent, partial = edit.cache((parent, partial), seq.block_ids[(n - 1) // bs]), ()
        edit.num_filled_slots += n - seq.num_tokens  # the accepted drafts' slots (lookahead blocks are the sequence's own)
        keep = blocks_for(n, bs)
        for block_id in reversed(seq.block_ids[keep:]):
            edit.release(block_id)  # past the tokens: no slot filled
        edit.seqs[seq_id] = seq._replace(block_ids=seq.block_ids[:keep], num_tokens=n, parent_hash=parent,
                                         partial_token_ids=partial, num_lookahead=0)
        return edit.snapshot()

    def fork(self, parent_seq_id: SeqId, child_seq_id: SeqId) -> BlockManager:
        """The child shares all of the parent's blocks (refcount + 1 each), in either pool, and
        its null entries."""
        if self.has(child_seq_id):
            raise ValueError(f"cannot fork {parent_seq_id!r} into {child_seq_id!r}: "
                             f"{child_seq_id!r} already exists")
        seq = self._seq(parent_seq_id)
        if seq.uncomputed or seq.num_lookahead:
            raise ValueError(f"cannot fork {parent_seq_id!r}: it holds uncomputed blocks (cache_computed) or "
                             "lookahead slots (commit_lookahead)")
        edit = _Edit(self)
        refcounts = edit.cpu_refcounts if seq.swapped else edit.refcounts
        for block_id in seq.live:
            refcounts[block_id] += 1
        edit.seqs[child_seq_id] = seq
        return edit.snapshot()

    def free(self, seq_ids: Sequence[SeqId]) -> BlockManager:
        """Drop sequences, running or swapped out: refcount - 1 per block; a block reaching 0 is
        free again (cached-free with prefix caching, if it is cached)."""
        edit = _Edit(self)
        for seq_id in seq_ids:
            seq = _checked(edit.seqs.get(seq_id), seq_id)
            del edit.seqs[seq_id]
            for j in reversed(range(seq.num_null, len(seq.block_ids))):
                edit.release(seq.block_ids[j], cpu=seq.swapped, filled=_filled(seq.num_tokens, j, self.block_size))
        return edit.snapshot()

    def forget_cached(self) -> BlockManager:
        """Every cached-free block becomes a plain free block and leaves the prefix cache (when the
        device pool's contents are lost). Raises ValueError while a running sequence holds a block."""
        if any(not self._seq(s).swapped for s in self._seqs):
            raise ValueError("forget_cached: running sequences still hold device blocks; free them first")
        edit = _Edit(self)
        while edit.evictable:
            block_id = edit.evictable.popleft()
            del edit.cached[edit.block_hashes.pop(block_id)]
            edit.free.append(block_id)
        return edit.snapshot()

    def swap_out(self, seq_ids: Sequence[SeqId]) -> tuple[BlockManager, DeviceOps]:
        """Move running sequences' blocks to the CPU pool; a block shared among them moves once.
        Null entries (sliding window) move nothing and stay null."""
        return self._swap(seq_ids, to_cpu=True)

    def swap_in(self, seq_ids: Sequence[SeqId]) -> tuple[BlockManager, DeviceOps]:
        """Move swapped-out sequences' blocks back to the device pool (as uncached blocks)."""
        return self._swap(seq_ids, to_cpu=False)

    def _swap(self, seq_ids, to_cpu: bool) -> tuple[BlockManager, DeviceOps]:
        edit, moved = _Edit(self), {}  # source block id -> destination block id
        for seq_id in seq_ids:
            seq = _checked(edit.seqs.get(seq_id), seq_id, swapped=not to_cpu)
            if seq.uncomputed or seq.num_lookahead:
                raise ValueError(f"cannot swap out sequence {seq_id!r}: it holds uncomputed blocks "
                                 "(cache_computed) or lookahead slots (commit_lookahead)")
            fills = [_filled(seq.num_tokens, j, self.block_size) for j in range(seq.num_null, len(seq.block_ids))]
            for block_id, filled in zip(seq.live, fills):
                if block_id in moved:
                    edit.acquire(moved[block_id], cpu=to_cpu)
                else:
                    moved[block_id] = edit.allocate_block(cpu=to_cpu, filled=filled)
            for block_id, filled in zip(reversed(seq.live), reversed(fills)):
                edit.release(block_id, cpu=not to_cpu, filled=filled)
            block_ids = (NULL_BLOCK_ID,) * seq.num_null + tuple(moved[b] for b in seq.live)
            edit.seqs[seq_id] = seq._replace(block_ids=block_ids, swapped=to_cpu)
        pairs = tuple(moved.items())
        return edit.snapshot(), DeviceOps(swap_out=pairs) if to_cpu else DeviceOps(swap_in=pairs)

    # ---- checks and reporting (O(pool size)) ---------------------------------------------------
    def check_invariants(self) -> None:
        """Assert every invariant of the module docstring."""
        bs, entries = self.block_size, {False: Counter(), True: Counter()}
        fill = {}  # (swapped, block id) -> (logical index, filled slots)
        for seq_id, seq in self._seqs.to_dict().items():
            held = seq.num_tokens + seq.num_lookahead
            assert seq.num_tokens >= 1 and len(seq.block_ids) == blocks_for(held, bs), (
                f"sequence {seq_id!r}: {seq.num_tokens} tokens and {seq.num_lookahead} lookahead slots in "
                f"{len(seq.block_ids)} blocks")
            assert not (seq.num_lookahead and (seq.swapped or seq.uncomputed)), (
                f"sequence {seq_id!r}: lookahead slots while swapped out or uncomputed")
            for block_id in seq.block_ids[blocks_for(seq.num_tokens, bs):]:
                assert self.refcount(block_id) == 1 and not self.is_cached(block_id), (
                    f"sequence {seq_id!r}: lookahead block {block_id} shared or cached")
            assert 0 <= seq.num_null <= self.num_dead_blocks(seq.num_tokens - 1), (
                f"sequence {seq_id!r} of {seq.num_tokens} tokens released {seq.num_null} leading "
                f"blocks, at most {self.num_dead_blocks(seq.num_tokens - 1)} are dead")
            assert seq.block_ids[:seq.num_null] == (NULL_BLOCK_ID,) * seq.num_null, (
                f"sequence {seq_id!r}: a released leading entry is not null: {seq.block_ids}")
            assert seq.swapped or NULL_BLOCK_ID not in seq.live, (
                f"sequence {seq_id!r}: a null entry follows a live one: {seq.block_ids}")
            if seq.num_null == self.num_dead_blocks(seq.num_tokens - 1) and self.sliding_window is not None:
                assert len(seq.live) <= self.max_window_blocks, (
                    f"sequence {seq_id!r} holds {len(seq.live)} blocks, more than the window's "
                    f"{self.max_window_blocks}")
            assert len(seq.uncomputed) <= seq.num_tokens // bs and not (seq.uncomputed and seq.swapped), (
                f"sequence {seq_id!r}: {len(seq.uncomputed)} uncomputed blocks of {seq.num_tokens // bs} full "
                f"ones{' (swapped out)' if seq.swapped else ''}")
            for i, block_hash in enumerate(seq.uncomputed):
                block_id = seq.block_ids[seq.num_tokens // bs - len(seq.uncomputed) + i]
                assert self._block_hashes.get(block_id) is None, (
                    f"sequence {seq_id!r}: block {block_id} is cached but not computed")
            if self.enable_prefix_caching:
                assert len(seq.partial_token_ids) == seq.num_tokens % bs, (
                    f"sequence {seq_id!r}: {len(seq.partial_token_ids)} tokens kept for hashing "
                    f"its partial block, {seq.num_tokens % bs} expected")
            for i, block_id in enumerate(seq.block_ids):
                if i < seq.num_null:
                    continue
                entries[seq.swapped][block_id] += 1
                here = (i, min(bs, seq.num_tokens - i * bs))
                seen = fill.setdefault((seq.swapped, block_id), here)
                assert seen == here, (f"block {block_id} is shared as (logical index, filled) "
                                      f"{seen} and {here} (by sequence {seq_id!r})")
        refcounts = self._refcounts.to_dict()
        _check_pool("device", range(1, self.num_blocks), refcounts, entries[False],
                    self._free.to_tuple(check=True) + self._evictable.to_tuple(check=True))
        _check_pool("CPU", range(self.num_cpu_blocks), self._cpu_refcounts.to_dict(), entries[True],
                    self._free_cpu.to_tuple(check=True))
        cached, block_hashes = self._cached.to_dict(), self._block_hashes.to_dict()
        assert self.enable_prefix_caching or not cached, "cache without prefix caching"
        assert block_hashes == {b: h for h, b in cached.items()}, (
            "prefix cache table and its inverse disagree")
        assert set(self._evictable.to_tuple()) <= set(block_hashes), "evictable block uncached"
        assert self.usage() == {"num_used_blocks": len(refcounts), "num_free_blocks": self.num_free_blocks,
                                "num_cached_blocks": len(block_hashes)}, "usage() disagrees with the tables"
        assert not set(self._free.to_tuple()) & set(block_hashes), "a free block is cached"
        for block_id in block_hashes:
            filled = fill.get((False, block_id), (None, bs))[1]
            assert filled == bs, f"block {block_id} is cached with {filled}/{bs} slots filled"
        walked = sum(max(0, f) for (swapped, _), (_, f) in fill.items() if not swapped)
        assert self.num_filled_slots == walked, (
            f"num_filled_slots is {self.num_filled_slots}, the block tables fill {walked} slots")

    def usage(self) -> dict:
        """The device blocks used, free (cached-free included) and cached, as `stats` counts them, in
        O(table shards): for every step of a server (`stats` walks every table, ~60 us a step at 2,912
        blocks, and grows with the pool)."""
        return {"num_used_blocks": len(self._refcounts), "num_free_blocks": self.num_free_blocks,
                "num_cached_blocks": len(self._block_hashes)}

    def stats(self) -> dict:
        """Counts of blocks (null entries of windowed tables are not blocks in use)."""
        refcounts = self._refcounts.to_dict().values()
        return {
            "num_blocks": self.num_blocks,
            **self.usage(),
            "num_cached_free_blocks": self._evictable.size,
            "refcount_histogram": dict(sorted(Counter(refcounts).items())),
            "num_cpu_blocks": self.num_cpu_blocks,
            "num_used_cpu_blocks": self.num_cpu_blocks - self.num_free_cpu_blocks,
            "num_seqs": len(self.seq_ids),
            "num_swapped_seqs": sum(s.swapped for s in self._seqs.to_dict().values()),
        }

    def __repr__(self) -> str:
        s = self.stats()
        return (f"BlockManager(block_size={self.block_size}, blocks used/free/total="
                f"{s['num_used_blocks']}/{s['num_free_blocks']}/{self.num_blocks}, cpu used="
                f"{s['num_used_cpu_blocks']}/{self.num_cpu_blocks}, seqs={s['num_seqs']})")


def _filled(num_tokens: int, index: int, block_size: int) -> int:
    """Token slots of logical block `index` that a sequence of `num_tokens` tokens fills (0 for a
    lookahead block past its tokens)."""
    return max(0, min(block_size, num_tokens - index * block_size))


def _checked(seq: _Seq | None, seq_id: SeqId, swapped: bool | None = None) -> _Seq:
    if seq is None:
        raise KeyError(f"unknown sequence {seq_id!r}")
    if swapped is not None and seq.swapped != swapped:
        raise ValueError(f"sequence {seq_id!r} is {'swapped out' if seq.swapped else 'running'}")
    return seq


def _check_pool(name, block_ids, refcounts, entries, free_block_ids) -> None:
    free = set(free_block_ids)
    assert len(free) == len(free_block_ids), f"{name} free list has duplicates: {free_block_ids}"
    assert all(r > 0 for r in refcounts.values()), f"{name} refcount table holds a zero"
    assert set(refcounts) | set(entries) | free <= set(block_ids), (
        f"{name} block ids outside {block_ids} (the null block?)")
    for block_id in block_ids:
        r, n = refcounts.get(block_id, 0), entries[block_id]
        assert r == n, f"{name} block {block_id}: refcount {r} but {n} block-table entries"
        assert (block_id in free) != (r > 0), (
            f"{name} block {block_id}: refcount {r}, {'' if block_id in free else 'not '}free")


class _Edit:
    """Working copy of a snapshot for one batched operation: an edit of each table and queue (each
    copies what it writes, on first write); `snapshot()` freezes them into a new BlockManager."""

    def __init__(self, base: BlockManager):
        self.base = base
        self.seqs: TableEdit = base._seqs.edit()
        self.refcounts: TableEdit = base._refcounts.edit()
        self.free = base._free.edit()
        self.evictable = base._evictable.edit()
        self.cached: TableEdit = base._cached.edit()
        self.block_hashes: TableEdit = base._block_hashes.edit()
        self.cpu_refcounts: TableEdit = base._cpu_refcounts.edit()
        self.free_cpu = base._free_cpu.edit()
        self.num_filled_slots = base.num_filled_slots

    def allocate_block(self, cpu: bool = False, filled: int = 0) -> int:
        """Takes a free block (refcount 1) whose first `filled` slots the taker fills."""
        free = self.free_cpu if cpu else self.free
        if free:
            block_id = free.popleft()
        elif not cpu and self.evictable:  # evict the least recently freed cached block
            block_id = self.evictable.popleft()
            del self.cached[self.block_hashes.pop(block_id)]
        else:
            raise OutOfBlocksError(f"no free {'CPU' if cpu else 'device'} block")
        if cpu:
            self.cpu_refcounts[block_id] = 1
        else:
            self.refcounts[block_id] = 1
            self.num_filled_slots += filled
        return block_id

    def acquire(self, block_id: int, cpu: bool = False, filled: int = 0) -> None:
        """One more reference to a used block, or to a cached-free one (a prefix-cache hit, whose
        `filled` slots then count as in use again)."""
        refcounts = self.cpu_refcounts if cpu else self.refcounts
        if (refcount := refcounts.get(block_id, 0)) == 0 and not cpu:
            self.evictable.remove(block_id)
            self.num_filled_slots += filled
        refcounts[block_id] = refcount + 1

    def release(self, block_id: int, cpu: bool = False, filled: int = 0) -> None:
        """One reference less; at 0 the block is free (its `filled` slots no longer in use)."""
        refcounts = self.cpu_refcounts if cpu else self.refcounts
        if (refcount := refcounts[block_id] - 1) > 0:
            refcounts[block_id] = refcount
            return
        del refcounts[block_id]
        if cpu:
            self.free_cpu.append(block_id)
            return
        self.num_filled_slots -= filled
        if block_id in self.block_hashes:
            self.evictable.append(block_id)
        else:
            self.free.append(block_id)

    def cache(self, block_hash: BlockHash, block_id: int) -> int:
        """Enter a block that just became full in the prefix cache, unless an identical block is
        there already; returns the hash its successor chains from."""
        if block_hash not in self.cached:
            self.cached[block_hash], self.block_hashes[block_id] = block_id, block_hash
        return hash(block_hash)

    def snapshot(self) -> BlockManager:
        """The new snapshot: the base's fields with the edited ones replaced (`dataclasses.replace`'s result,
        without its field-by-field __init__: a snapshot is made every step)."""
        snapshot = object.__new__(type(self.base))
        snapshot.__dict__.update(
            self.base.__dict__, _seqs=self.seqs.freeze(), _refcounts=self.refcounts.freeze(), _free=self.free.freeze(),
            _evictable=self.evictable.freeze(), _cached=self.cached.freeze(),
            _block_hashes=self.block_hashes.freeze(), _cpu_refcounts=self.cpu_refcounts.freeze(),
            _free_cpu=self.free_cpu.freeze(), num_filled_slots=self.num_filled_slots)
        return snapshot
