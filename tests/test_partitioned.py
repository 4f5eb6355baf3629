"""The data-parallel host side without the model: `PartitionedBlockManager` (one block manager per
data rank, global ids) and the scheduler's placement (the most free blocks left, a held prefix
shared; kept across preemption)."""

from __future__ import annotations

import pytest

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
