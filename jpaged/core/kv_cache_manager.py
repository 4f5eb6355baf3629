"""The scheduler's view of KV memory, written down: the `KVCacheManager` protocol (no JAX).

A KV cache manager (the paper's name, section 4.2) owns the mapping from sequences to physical
blocks of the device pool. It is an immutable snapshot: every operation returns a new manager
(and the `DeviceOps` the device must run), never mutating the old one, so a refused operation
leaves its input untouched and any snapshot can be kept, compared or drawn.

Every manager does allocate / append / free (`KVCacheManager`). Two capabilities are separate
protocols, checked with `isinstance` where they are needed:
- `ForkingKVCacheManager`: `fork` shares a sequence's blocks with a new one (parallel sampling,
  beam search). The engine refuses n > 1 and beam search without it.
- `SwappingKVCacheManager`: moves sequences' blocks to a CPU pool and back. The scheduler refuses
  `preemption_mode="swap"` without it.
`jpaged.core.block_manager.BlockManager` (paging, PagedAttention) implements all three. The
engine builds its manager with a factory `KVCacheSpec -> KVCacheManager` (`LLMEngine(...,
kv_cache_manager=...)`); the benchmarks' contiguous-reservation baselines are such factories.

Vocabulary: the device pool holds `num_blocks` blocks of `block_size` token slots, block 0 being
the null block that is never handed out; a sequence's block table maps its logical blocks to
physical block ids, and token `p` lives at slot `table[p // block_size] * block_size + p %
block_size`.

Sliding window (`KVCacheSpec.sliding_window`: W when every layer of the model attends only to its
W most recent positions): a manager may release a sequence's leading blocks that no future query
reads. Their table entries become null (NULL_BLOCK_ID on the device; a placeholder naming no CPU
block while swapped out), so a table keeps its length ceil(n / block_size) and every position its
logical index. A manager that does so has `num_null_blocks(seq_id)`; read it with the module's
`num_null_blocks(manager, seq_id)` (0 for managers without it).

Optional members, read through this module's functions (a manager without them still works, the
slower way): `num_filled_slots` (token slots holding K/V in the device blocks in use, kept as blocks
are taken and released: `kv_utilization` then costs O(1) a step instead of a walk of every table),
`append_slots` (a decode step's appends, returning each sequence's new slot and block table:
`append_slots`) and `max_blocks_per_append` (the most free blocks one sequence's one-token append
takes: the scheduler's shortcut `appends_fit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Optional, Protocol, runtime_checkable

SeqId = Hashable
NULL_BLOCK_ID = 0


class OutOfBlocksError(ValueError):
    """Not enough free blocks for an operation (callers check `can_*` first)."""


@dataclasses.dataclass(frozen=True)
class DeviceOps:
    """Device work implied by KV cache manager operations. Apply in this order: swap_out, swap_in,
    copy_pairs, then the step's K/V writes. That is correct as long as a step that swaps in does
    not also swap out (the scheduler never swaps in while it preempts)."""

    copy_pairs: tuple[tuple[int, int], ...] = ()  # copy-on-write: (src_block_id, dst_block_id)
    swap_out: tuple[tuple[int, int], ...] = ()  # (device_block_id, cpu_block_id)
    swap_in: tuple[tuple[int, int], ...] = ()  # (cpu_block_id, device_block_id)

    def __add__(self, other: DeviceOps) -> DeviceOps:
        return DeviceOps(self.copy_pairs + other.copy_pairs, self.swap_out + other.swap_out,
                         self.swap_in + other.swap_in)

    def __bool__(self) -> bool:
        return bool(self.copy_pairs or self.swap_out or self.swap_in)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """What the engine knows when it builds a KV cache manager: the pools' sizes in blocks (the
    device pool's `num_blocks` counts the null block), the block size, whether prefix caching is
    asked for, the longest sequence the model runs, and the sliding window W when every layer of
    the model sees only its W most recent positions (None when any layer sees the whole context)."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = False
    max_model_len: Optional[int] = None
    sliding_window: Optional[int] = None


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def slot_ids(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Device slots of positions [start, end) of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def num_null_blocks(manager: KVCacheManager, seq_id: SeqId) -> int:
    """A sequence's leading block-table entries released by a sliding window (they name no block)."""
    get = getattr(manager, "num_null_blocks", None)
    return 0 if get is None else get(seq_id)


def live_block_table(manager: KVCacheManager, seq_id: SeqId) -> list[tuple[int, int]]:
    """(logical index, block id) of the entries of a sequence's block table that name a block."""
    table = manager.block_table(seq_id)
    return list(enumerate(table))[num_null_blocks(manager, seq_id):]


def filled_slots(manager: KVCacheManager, *, swapped: bool = False) -> dict[int, int]:
    """Block id -> token slots holding K/V, for every device block (or, with `swapped`, CPU block)
    named by a sequence's block table (null entries a sliding window released name none); a block
    shared by several tables is counted once (shared blocks hold the same prefix)."""
    filled: dict[int, int] = {}
    bs = manager.block_size
    for seq_id in manager.seq_ids:
        if manager.is_swapped(seq_id) != swapped:
            continue
        n = manager.num_tokens(seq_id)
        for j, block_id in live_block_table(manager, seq_id):
            filled[block_id] = max(filled.get(block_id, 0), min(bs, n - j * bs))
    return filled


def kv_utilization(manager: KVCacheManager) -> Optional[float]:
    """Token slots holding K/V over the slots of the device blocks in use (a block shared by several
    tables counts once; a null entry is no block in use; a manager that reserves blocks ahead counts
    them as in use); None when no block is in use. Every data-parallel partition's null block is
    left out of the pool."""
    used = manager.num_blocks - getattr(manager, "num_partitions", 1) - manager.num_free_blocks
    if not used:
        return None
    filled = getattr(manager, "num_filled_slots", None)  # kept by the manager, else a walk of every table
    return (sum(filled_slots(manager).values()) if filled is None else filled) / (used * manager.block_size)


def append_slots(manager: KVCacheManager, appends: Sequence[tuple[SeqId, int]]) -> tuple[
        KVCacheManager, DeviceOps, list[int], list[tuple[int, ...]]]:
    """A decode step's appends (`manager.append(appends)`), with, for each (sequence, token) in
    order, the slot its token's K/V goes to and its block table afterwards: one call for the whole
    step where the manager has `append_slots`, else `append` and a lookup per sequence."""
    method = getattr(manager, "append_slots", None)
    if method is not None:
        return method(appends)
    manager, ops = manager.append(appends)
    slots, tables = [], []
    for seq_id, _ in appends:
        n = manager.num_tokens(seq_id)
        slots.append(manager.slot_mapping(seq_id, n - 1, n)[0])
        tables.append(manager.block_table(seq_id))
    return manager, ops, slots, tables


def appends_fit(manager: KVCacheManager, num_seqs: int, num_free: int) -> bool:
    """Whether a one-token append to each of `num_seqs` sequences surely fits in `num_free` free
    blocks, without counting per sequence: True only for a manager that bounds an append's blocks
    per sequence (`max_blocks_per_append`: paging takes a new block or a copy, never both)."""
    bound = getattr(manager, "max_blocks_per_append", None)
    return bound is not None and num_seqs * bound <= num_free


def cache_computed(manager: KVCacheManager, seq_id: SeqId, num_computed: int) -> KVCacheManager:
    """The manager once the step being scheduled writes the K/V of the first `num_computed` tokens
    of a sequence allocated with fewer computed (a prompt prefilled in chunks): a manager with a
    prefix cache may now share its full blocks among them. Managers without `cache_computed`
    share nothing of the kind: returned as they are."""
    method = getattr(manager, "cache_computed", None)
    return manager if method is None else method(seq_id, num_computed)


@runtime_checkable
class KVCacheManager(Protocol):
    """An immutable snapshot of which blocks hold which sequences' tokens (see the module docstring).

    Invariant every implementation keeps: a running sequence of n tokens has a block table whose
    first ceil(n / block_size) entries name the blocks holding its tokens, and `slot_mapping`
    addresses them; block 0 (null) is never in a table, except as the leading entries a sliding
    window released (`num_null_blocks`: those positions are never read again). `check_invariants`
    asserts the rest of an implementation's own invariants.
    """

    @property
    def num_blocks(self) -> int:
        """The device pool, null block included."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_free_blocks(self) -> int:
        """Device blocks that an allocation may take now."""

    @property
    def seq_ids(self) -> tuple:
        """Every sequence the manager holds, in no particular order."""

    def has(self, seq_id: SeqId) -> bool: ...

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        """Physical block ids in logical order (CPU block ids while swapped out), the first
        `num_null_blocks(self, seq_id)` of them null."""

    def num_tokens(self, seq_id: SeqId) -> int: ...

    def is_swapped(self, seq_id: SeqId) -> bool: ...

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Device slots of positions [start, end) of a running sequence."""

    def can_allocate(self, token_ids: Sequence[Sequence[int]], *, reserve: int = 0) -> bool:
        """Whether new sequences holding these tokens (one list per sequence) can be allocated
        with `reserve` device blocks still free after them. May be conservative, never optimistic."""

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], *,
                 num_computed: Optional[int] = None) -> tuple[KVCacheManager, int]:
        """A new running sequence holding `token_ids`: (snapshot, how many of its first tokens
        already have their K/V in the pool, e.g. from a prefix cache). `num_computed`: how many of
        its first tokens the step being scheduled writes (None: all); a manager that shares
        computed blocks between sequences (a prefix cache) shares no block past them before
        `cache_computed` (the module's function) says they are scheduled. Raises OutOfBlocksError."""

    def num_blocks_to_append(self, seq_ids: Sequence[SeqId]) -> int:
        """Free device blocks that `append` of one token to each of these sequences takes (a
        number larger than the pool when one of them can never grow)."""

    def append(self, appends: Sequence[tuple[SeqId, int]]) -> tuple[KVCacheManager, DeviceOps]:
        """One more token slot for each (running sequence, its new token id)."""

    def free(self, seq_ids: Sequence[SeqId]) -> KVCacheManager:
        """Drops sequences, running or swapped out, releasing what they alone held."""

    def forget_cached(self) -> KVCacheManager:
        """Forgets what free device blocks hold (a prefix cache): called when the device pool's
        contents were lost. Sequences still holding device blocks must have been freed first."""

    def usage(self) -> dict:
        """num_used_blocks, num_free_blocks and num_cached_blocks as `stats` counts them, cheaply (a
        server reads them every step)."""

    def stats(self) -> dict:
        """At least num_blocks, num_free_blocks, num_used_blocks, num_cached_blocks,
        num_cached_free_blocks, refcount_histogram, num_cpu_blocks, num_used_cpu_blocks, num_seqs,
        num_swapped_seqs."""

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant."""


@runtime_checkable
class ForkingKVCacheManager(KVCacheManager, Protocol):
    """A manager whose sequences can share blocks (copy-on-write on a shared block's next write)."""

    def fork(self, parent_seq_id: SeqId, child_seq_id: SeqId) -> ForkingKVCacheManager:
        """A new sequence sharing every block of the parent."""


@runtime_checkable
class SwappingKVCacheManager(KVCacheManager, Protocol):
    """A manager with a CPU block pool that running sequences can be swapped out to."""

    @property
    def num_cpu_blocks(self) -> int: ...

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool: ...

    def swap_out(self, seq_ids: Sequence[SeqId]) -> tuple[SwappingKVCacheManager, DeviceOps]:
        """Moves running sequences' blocks to the CPU pool (a block they share moves once)."""

    def can_swap_in(self, seq_ids: Sequence[SeqId]) -> bool:
        """Counts only the swapped blocks: the caller keeps room for the next append."""

    def swap_in(self, seq_ids: Sequence[SeqId]) -> tuple[SwappingKVCacheManager, DeviceOps]:
        """Moves swapped-out sequences' blocks back to the device pool."""


def check_unique(seq_ids: Sequence[SeqId]) -> None:
    """Raises ValueError when a sequence appears twice in one batched operation."""
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"a sequence appears twice in {list(seq_ids)!r}")
