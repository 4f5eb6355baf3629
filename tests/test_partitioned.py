"""The data-parallel host side without the model: `PartitionedBlockManager` (one block manager per
data rank, global ids) and the scheduler's placement (the most free blocks left, a held prefix
shared; kept across preemption)."""

from __future__ import annotations

import pytest

from jpaged.core.block_manager import BlockManager
from jpaged.core.kv_cache_manager import KVCacheSpec
from jpaged.core.partitioned import PartitionedBlockManager
from test_scheduler import Harness


def two_ranks(**kwargs) -> PartitionedBlockManager:
    return PartitionedBlockManager.create(2, 5, 4, **kwargs)  # ranks own global blocks 0-4 and 5-9


def test_ids_are_global_and_each_partition_has_its_own_null_block():
    bm = two_ranks()
    assert bm.num_blocks == 10 and bm.num_free_blocks == 8  # blocks 0 and 5 are the null blocks
    bm, _ = bm.allocate("a", list(range(6)), rank=0)
    bm, _ = bm.allocate("b", list(range(6)), rank=1)
    assert bm.block_table("a") == (1, 2) and bm.block_table("b") == (6, 7)
    assert bm.slot_mapping("b", 4, 6) == [7 * 4, 7 * 4 + 1]
    assert (bm.rank_of("a"), bm.rank_of("b")) == (0, 1)
    assert bm.num_free_blocks_in(0) == bm.num_free_blocks_in(1) == 2
    bm.check_invariants()


def test_fork_and_copy_on_write_stay_in_the_partition():
    bm, _ = two_ranks().allocate("a", [1, 2, 3, 4, 5, 6], rank=1)
    bm = bm.fork("a", "c")
    assert bm.rank_of("c") == 1 and bm.block_table("c") == (6, 7)
    bm, ops = bm.append([("c", 9)])
    (src, dst), = ops.copy_pairs
    assert src == 7 and 5 < dst < 10  # the copy of the shared last block is a block of rank 1
    assert bm.num_free_blocks_in(0) == 4
    bm = bm.free(["a", "c"])
    assert bm.num_free_blocks == 8 and bm.seq_ids == ()
    bm.check_invariants()


def test_a_partition_runs_out_alone():
    bm, _ = two_ranks().allocate("a", list(range(16)), rank=0)  # all 4 usable blocks of rank 0
    assert not bm.can_allocate([[1]], rank=0) and bm.can_allocate([[1]], rank=1)


def test_swap_areas_are_per_partition():
    bm, _ = two_ranks(cpu_blocks_per_partition=3).allocate("a", list(range(6)), rank=1)
    bm, ops = bm.swap_out(["a"])
    assert ops.swap_out == ((6, 3), (7, 4))  # rank 1's device blocks 6, 7 -> its CPU blocks 3, 4
    assert bm.is_swapped("a") and bm.block_table("a") == (3, 4)
    bm, ops = bm.swap_in(["a"])
    assert [c for c, _ in ops.swap_in] == [3, 4] and all(5 < d < 10 for _, d in ops.swap_in)
    bm.check_invariants()


def test_prefix_caches_are_per_partition():
    bm = two_ranks(enable_prefix_caching=True)
    bm, cached = bm.allocate("a", list(range(9)), rank=0)
    bm, hit0 = bm.allocate("b", list(range(9)), rank=0)
    bm, hit1 = bm.allocate("c", list(range(9)), rank=1)
    assert (cached, hit0, hit1) == (0, 8, 0)  # rank 1 never saw the prefix


def partitioned_harness(num_blocks_per_rank: int, mode: str = "recompute", **kwargs) -> Harness:
    harness = Harness(2, mode=mode)
    harness.scheduler.block_manager = PartitionedBlockManager.create(
        2, num_blocks_per_rank, 4, cpu_blocks_per_partition=num_blocks_per_rank if mode == "swap" else 0, **kwargs)
    return harness


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_groups_go_to_the_least_loaded_rank_and_keep_it_across_preemption(mode):
    h = partitioned_harness(6, mode)  # 5 usable blocks of 4 tokens per rank
    a = h.add("a", 8, max_tokens=12, arrival=0)
    b = h.add("b", 4, max_tokens=12, arrival=1)
    c = h.add("c", 8, max_tokens=12, arrival=2)
    h.step()
    assert (a.rank, b.rank, c.rank) == (0, 1, 1)  # b: rank 1 had more free blocks; c: 4 free there vs 3
    ranks_seen = set()
    preempted = []
    while h.scheduler.has_unfinished():
        out = h.step()
        preempted += out.preempted
        for g in (a, b, c):
            for s in g.seqs:
                if h.scheduler.block_manager.has(s.seq_id):
                    ranks_seen.add((g.request_id, h.scheduler.block_manager.rank_of(s.seq_id)))
    assert preempted and all(g.request_id == "c" for g in preempted)  # the latest arrival of the short rank
    assert ranks_seen == {("a", 0), ("b", 1), ("c", 1)}  # nobody ever moved
    assert h.scheduler.block_manager.num_free_blocks == 10


def test_a_group_goes_where_running_sequences_hold_its_prefix():
    h = partitioned_harness(8, enable_prefix_caching=True)  # 7 usable blocks of 4 tokens per rank
    a = h.add("a", 9, max_tokens=20)                  # 3 blocks on rank 0 (the tie goes to the lower rank)
    x = h.add("x", 8, max_tokens=20, first_token=50)  # another prompt: 2 blocks on rank 1, the least loaded
    b = h.add("b", 9, max_tokens=20)                  # a's prompt: 2 of its 3 blocks are a's, shared on rank 0
    h.step()
    # least loaded would put b on rank 1 (5 free against 4); on rank 0 it takes 1 block and leaves 3,
    # on rank 1 it would take 3 and leave 2
    assert (a.rank, x.rank, b.rank) == (0, 1, 0)
    assert b.num_cached_tokens == 8
    bm = h.scheduler.block_manager
    assert bm.block_table(b.seqs[0].seq_id)[:2] == bm.block_table(a.seqs[0].seq_id)[:2]
    assert (bm.num_free_blocks_in(0), bm.num_free_blocks_in(1)) == (3, 5)


def test_allocation_cost_counts_shared_and_cached_free_prefix_blocks():
    bm = two_ranks(enable_prefix_caching=True)
    bm, _ = bm.allocate("a", list(range(9)), rank=1)
    assert bm.allocation_cost(list(range(9)), rank=1) == (1, 8)  # 2 blocks shared with running a
    assert bm.allocation_cost(list(range(9)), rank=0) == (3, 0)
    bm = bm.free(["a"])
    assert bm.allocation_cost(list(range(9)), rank=1) == (3, 8)  # cached but free: taken, not computed


def test_a_sliding_window_releases_blocks_in_each_partition_with_its_null_block():
    bm = PartitionedBlockManager.create(2, 6, 4, cpu_blocks_per_partition=3, sliding_window=6)
    assert bm.sliding_window == 6 and all(p.sliding_window == 6 for p in bm.partitions)
    bm, _ = bm.allocate("a", list(range(9)), rank=1)  # global blocks 7, 8, 9
    bm, _ = bm.append([("a", 9)])  # the query at 9 reads 4..9: the first block is dead
    assert bm.block_table("a") == (6, 8, 9) and bm.num_null_blocks("a") == 1  # 6: rank 1's null block
    assert bm.num_free_blocks_in(1) == 3 and bm.slot_mapping("a", 4, 5) == [8 * 4]
    bm, ops = bm.swap_out(["a"])
    assert ops.swap_out == ((8, 3), (9, 4))  # only the live blocks move, to rank 1's CPU blocks
    assert bm.num_null_blocks("a") == 1 and bm.block_table("a")[1:] == (3, 4)
    bm, ops = bm.swap_in(["a"])
    assert bm.block_table("a")[0] == 6 and bm.num_null_blocks("a") == 1
    bm.check_invariants()
    spec_bm = PartitionedBlockManager.from_spec(KVCacheSpec(num_blocks=12, block_size=4, sliding_window=5), 2)
    assert spec_bm.sliding_window == 5


@pytest.mark.parametrize("num_partitions", [1, 2])
def test_the_scheduler_runs_past_the_pool_with_a_sliding_window(num_partitions):
    """W = 8, blocks of 4: a sequence holds at most 3 blocks after an append (its 8-token prompt: 2
    until then), so two requests of 68 tokens each run in 6 usable blocks per partition without a
    preemption; decode rows carry block tables of full length whose leading entries are null."""
    h = Harness(2)
    if num_partitions == 1:
        h.scheduler.block_manager = BlockManager.create(7, 4, sliding_window=8)
    else:
        h.scheduler.block_manager = PartitionedBlockManager.create(2, 7, 4, sliding_window=8)
    a = h.add("a", 8, max_tokens=60, arrival=0)
    b = h.add("b", 8, max_tokens=60, arrival=1, first_token=50)
    most_live = 0
    while h.scheduler.has_unfinished():
        out = h.step()
        assert not out.preempted and not out.finished
        for row in out.rows:
            end = row.start_position + len(row.token_ids)
            assert len(row.block_table) == -(-end // 4)
            null_ids = {0, 7} if num_partitions == 2 else {0}
            dead = max(0, (row.start_position - 8 + 1) // 4) if out.is_decode else 0
            assert set(row.block_table[:dead]) <= null_ids and not set(row.block_table[dead:]) & null_ids
            most_live = max(most_live, len(row.block_table) - dead)
    assert most_live == 3
    assert [len(g.seqs[0].output_token_ids) for g in (a, b)] == [60, 60]
    assert h.scheduler.block_manager.num_free_blocks == 6 * num_partitions
