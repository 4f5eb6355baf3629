"""One host block manager over a pool split by blocks into data-parallel partitions (no JAX).

Under data parallelism the device pool is split by *blocks*: data rank r owns device blocks
[r * P, (r + 1) * P) of the global pool (P = `blocks_per_partition`) and runs the requests placed
on it. `PartitionedBlockManager` keeps one `BlockManager` per rank, each with its own free list,
null block (global id r * P), CPU swap area (CPU blocks [r * C, (r + 1) * C)) and prefix cache; a
sequence lives in one partition, and fork and copy-on-write stay inside it. Block tables, slots and
device operations are *global* ids here; the device side turns them into each rank's local ids
(global - r * P).

Placement is the scheduler's: `allocate(..., rank=)` puts a new sequence on a rank (chosen with
`allocation_cost`, which counts each rank's prefix cache); `rank_of` says where a sequence lives. Invariants (`check_invariants`): every partition's own, and every sequence
in exactly one partition. An immutable snapshot, like `BlockManager`.

With a sliding window every partition releases blocks that slid out of it (`BlockManager`'s module
docstring); a released entry of a running sequence's global table is its rank's null block
(global id r * P, local 0), and `num_null_blocks` says how many leading entries are released (while
swapped out they are placeholders naming no CPU block).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from jpaged.core.block_manager import BlockManager
from jpaged.core.kv_cache_manager import DeviceOps, KVCacheSpec, SeqId


@dataclasses.dataclass(frozen=True, repr=False)
class PartitionedBlockManager:
    partitions: tuple[BlockManager, ...]
    _ranks: tuple[tuple[SeqId, int], ...] = ()  # (seq_id, rank) pairs: small, rebuilt per operation

    @classmethod
    def create(cls, num_partitions: int, blocks_per_partition: int, block_size: int, *,
               cpu_blocks_per_partition: int = 0, enable_prefix_caching: bool = False,
               sliding_window: int | None = None) -> PartitionedBlockManager:
        part = BlockManager.create(blocks_per_partition, block_size, num_cpu_blocks=cpu_blocks_per_partition,
                                   enable_prefix_caching=enable_prefix_caching, sliding_window=sliding_window)
        return cls((part,) * num_partitions)

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, num_partitions: int) -> PartitionedBlockManager:
        """`spec.num_blocks` (and `num_cpu_blocks`) split evenly: each must be a multiple of `num_partitions`."""
        if spec.num_blocks % num_partitions or spec.num_cpu_blocks % num_partitions:
            raise ValueError(f"{spec.num_blocks} device / {spec.num_cpu_blocks} CPU blocks do not split into "
                             f"{num_partitions} partitions")
        return cls.create(num_partitions, spec.num_blocks // num_partitions, spec.block_size,
                          cpu_blocks_per_partition=spec.num_cpu_blocks // num_partitions,
                          enable_prefix_caching=spec.enable_prefix_caching, sliding_window=spec.sliding_window)

    # ---- geometry ----------------------------------------------------------------------------
    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    @property
    def blocks_per_partition(self) -> int:
        return self.partitions[0].num_blocks

    @property
    def num_blocks(self) -> int:
        """The whole device pool, every partition's null block included."""
        return self.blocks_per_partition * self.num_partitions

    @property
    def block_size(self) -> int:
        return self.partitions[0].block_size

    @property
    def sliding_window(self) -> int | None:
        return self.partitions[0].sliding_window

    @property
    def num_cpu_blocks(self) -> int:
        return self.partitions[0].num_cpu_blocks * self.num_partitions

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.partitions)

    def num_free_blocks_in(self, rank: int) -> int:
        return self.partitions[rank].num_free_blocks

    @property
    def num_filled_slots(self) -> int:
        """Token slots holding K/V in the device blocks in use, over every partition."""
        return sum(p.num_filled_slots for p in self.partitions)

    max_blocks_per_append = BlockManager.max_blocks_per_append  # per sequence, in its own partition

    # ---- sequences ---------------------------------------------------------------------------
    @property
    def _rank_map(self) -> dict:
        return dict(self._ranks)

    def rank_of(self, seq_id: SeqId) -> int:
        return self._rank_map[seq_id]

    @property
    def seq_ids(self) -> tuple:
        return tuple(s for s, _ in self._ranks)

    def has(self, seq_id: SeqId) -> bool:
        return seq_id in self._rank_map

    def _part(self, seq_id):
        rank = self.rank_of(seq_id)
        return rank, self.partitions[rank]

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        rank, part = self._part(seq_id)
        base = (part.num_cpu_blocks if part.is_swapped(seq_id) else part.num_blocks) * rank
        return tuple(base + b for b in part.block_table(seq_id))

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._part(seq_id)[1].num_tokens(seq_id)

    def num_null_blocks(self, seq_id: SeqId) -> int:
        """Leading block-table entries the sliding window released."""
        return self._part(seq_id)[1].num_null_blocks(seq_id)

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._part(seq_id)[1].is_swapped(seq_id)

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        rank, part = self._part(seq_id)
        base = rank * part.num_blocks * part.block_size
        return [base + s for s in part.slot_mapping(seq_id, start, end)]

    # ---- operations --------------------------------------------------------------------------
    def _with(self, updates: dict, ranks=None) -> PartitionedBlockManager:
        parts = tuple(updates.get(r, p) for r, p in enumerate(self.partitions))
        return PartitionedBlockManager(parts, self._ranks if ranks is None else tuple(ranks.items()))

    def _global(self, rank: int, ops: DeviceOps) -> DeviceOps:
        d, c = rank * self.blocks_per_partition, rank * self.partitions[0].num_cpu_blocks
        return DeviceOps(copy_pairs=tuple((a + d, b + d) for a, b in ops.copy_pairs),
                         swap_out=tuple((a + d, b + c) for a, b in ops.swap_out),
                         swap_in=tuple((a + c, b + d) for a, b in ops.swap_in))

    def _by_rank(self, seq_ids) -> dict[int, list]:
        out: dict[int, list] = {}
        ranks = self._rank_map
        for s in seq_ids:
            out.setdefault(ranks[s], []).append(s)
        return out

    def can_allocate(self, token_ids: Sequence[Sequence[int]], *, reserve: int = 0, rank: int = 0) -> bool:
        return self.partitions[rank].can_allocate(token_ids, reserve=reserve)

    def allocation_cost(self, token_ids: Sequence[int], *, rank: int = 0) -> tuple[int, int]:
        """(free blocks of `rank` that allocating these tokens there takes, tokens of its prefix in
        that rank's prefix cache): what the scheduler's placement compares across ranks."""
        return self.partitions[rank].allocation_cost(token_ids)

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], *, rank: int = 0, num_computed: int | None = None):
        part, num_cached = self.partitions[rank].allocate(seq_id, token_ids, num_computed=num_computed)
        return self._with({rank: part}, {**self._rank_map, seq_id: rank}), num_cached

    def commit_lookahead(self, seq_id: SeqId, token_ids: Sequence[int]) -> PartitionedBlockManager:
        rank, part = self._part(seq_id)
        return self._with({rank: part.commit_lookahead(seq_id, token_ids)})

    def cache_computed(self, seq_id: SeqId, num_computed: int) -> PartitionedBlockManager:
        rank, part = self._part(seq_id)
        return self._with({rank: part.cache_computed(seq_id, num_computed)})

    def num_blocks_to_append(self, seq_ids: Sequence[SeqId], *, lookahead: int = 0) -> int:
        return sum(self.partitions[r].num_blocks_to_append(ids, lookahead=lookahead)
                   for r, ids in self._by_rank(seq_ids).items())

    def append(self, appends: Sequence[tuple[SeqId, int]], *, lookahead=0):
        ranks, by_rank = self._rank_map, {}
        for seq_id, token in appends:
            by_rank.setdefault(ranks[seq_id], []).append((seq_id, token))
        updates, ops = {}, DeviceOps()
        for rank, items in sorted(by_rank.items()):
            updates[rank], part_ops = self.partitions[rank].append(items, lookahead=lookahead)
            ops += self._global(rank, part_ops)
        return self._with(updates), ops

    def fork(self, parent_seq_id: SeqId, child_seq_id: SeqId) -> PartitionedBlockManager:
        rank, part = self._part(parent_seq_id)
        return self._with({rank: part.fork(parent_seq_id, child_seq_id)}, {**self._rank_map, child_seq_id: rank})

    def free(self, seq_ids: Sequence[SeqId]) -> PartitionedBlockManager:
        updates = {r: self.partitions[r].free(ids) for r, ids in self._by_rank(seq_ids).items()}
        gone = set(seq_ids)
        return self._with(updates, {s: r for s, r in self._ranks if s not in gone})

    def forget_cached(self) -> PartitionedBlockManager:
        return self._with({r: p.forget_cached() for r, p in enumerate(self.partitions)})

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool:
        return all(self.partitions[r].can_swap_out(ids) for r, ids in self._by_rank(seq_ids).items())

    def can_swap_in(self, seq_ids: Sequence[SeqId]) -> bool:
        return all(self.partitions[r].can_swap_in(ids) for r, ids in self._by_rank(seq_ids).items())

    def _swap(self, seq_ids, out: bool):
        updates, ops = {}, DeviceOps()
        for rank, ids in sorted(self._by_rank(seq_ids).items()):
            part = self.partitions[rank]
            updates[rank], part_ops = part.swap_out(ids) if out else part.swap_in(ids)
            ops += self._global(rank, part_ops)
        return self._with(updates), ops

    def swap_out(self, seq_ids: Sequence[SeqId]):
        return self._swap(seq_ids, True)

    def swap_in(self, seq_ids: Sequence[SeqId]):
        return self._swap(seq_ids, False)

    # ---- checks and statistics -----------------------------------------------------------------
    def usage(self) -> dict:
        parts = [p.usage() for p in self.partitions]
        return {key: sum(u[key] for u in parts) for key in parts[0]}

    def stats(self) -> dict:
        parts = [p.stats() for p in self.partitions]
        out = {}
        for key, value in parts[0].items():
            if key == "refcount_histogram":
                total = Counter()
                for s in parts:
                    total.update(s[key])
                out[key] = dict(total)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = sum(s[key] for s in parts)
            else:
                out[key] = value
        out["num_partitions"] = self.num_partitions
        return out

    def check_invariants(self) -> None:
        ranks = self._rank_map
        assert len(ranks) == len(self._ranks), "a sequence is in two partitions"
        for rank, part in enumerate(self.partitions):
            part.check_invariants()
            held = {s for s, r in ranks.items() if r == rank}
            assert held == set(part.seq_ids), f"partition {rank} holds {set(part.seq_ids)}, the rank map says {held}"

    def __repr__(self) -> str:
        return f"PartitionedBlockManager({self.num_partitions} x {self.blocks_per_partition} blocks)"
