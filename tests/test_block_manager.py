"""The paper's worked examples (Figures 6, 8, 9), swapping and prefix caching, with pinned block
ids, slots and free-list order after each operation. Property-based tests are in
test_block_manager_properties.py."""

import copy

import pytest

from jpaged.core.block_manager import BlockManager
from jpaged.core.kv_cache_manager import (NULL_BLOCK_ID, DeviceOps, KVCacheSpec, OutOfBlocksError, filled_slots,
                                          kv_utilization)

WORDS = "Four score and seven years ago our fathers brought forth mothers".split()
TOKEN = {w: i + 100 for i, w in enumerate(WORDS)}
PROMPT = [TOKEN[w] for w in "Four score and seven years ago our".split()]  # 7 tokens


def paper_pool(**kw):
    """9 blocks of 4 slots; free list [7, 1, 3, ...] so the prompt lands where Figure 6 draws it."""
    return BlockManager.create(9, 4, free_block_ids=[7, 1, 3, 2, 4, 5, 6, 8], **kw)


def test_create_reserves_null_block_and_validates():
    bm = BlockManager.create(5, 16)
    assert bm.free_block_ids == (1, 2, 3, 4) and bm.num_free_blocks == 4
    assert bm.refcount(NULL_BLOCK_ID) == 0 and NULL_BLOCK_ID not in bm.free_block_ids
    bm.check_invariants()
    with pytest.raises(ValueError, match="permutation of 1..4"):
        BlockManager.create(5, 16, free_block_ids=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="permutation"):
        BlockManager.create(5, 16, free_block_ids=[1, 2, 3])


def test_figure6_block_table_translation():
    bm0 = paper_pool()
    bm1, num_cached = bm0.allocate("A", PROMPT)
    assert num_cached == 0
    assert bm1.block_table("A") == (7, 1) and bm1.num_tokens("A") == 7
    assert bm1.refcount(7) == bm1.refcount(1) == 1
    assert bm1.free_block_ids == (3, 2, 4, 5, 6, 8)
    # logical block 0 -> physical 7 (4 filled), logical block 1 -> physical 1 (3 filled)
    assert bm1.slot_mapping("A", 0, 7) == [28, 29, 30, 31, 4, 5, 6]
    assert bm0.free_block_ids == (7, 1, 3, 2, 4, 5, 6, 8) and not bm0.has("A")  # old snapshot kept
    bm1.check_invariants()

    # decode step 1: "fathers" fills the 4th slot of block 1, no allocation
    bm2, ops = bm1.append([("A", TOKEN["fathers"])])
    assert ops == DeviceOps() and not ops
    assert bm2.block_table("A") == (7, 1) and bm2.num_tokens("A") == 8
    assert bm2.slot("A", 7) == 1 * 4 + 3 and bm2.free_block_ids == bm1.free_block_ids
    bm2.check_invariants()

    # decode step 2: "brought" needs a new block: physical block 3, 1 slot filled
    bm3, ops = bm2.append([("A", TOKEN["brought"])])
    assert ops == DeviceOps()
    assert bm3.block_table("A") == (7, 1, 3) and bm3.num_tokens("A") == 9
    assert bm3.slot("A", 8) == 12 and bm3.refcount(3) == 1
    assert bm3.free_block_ids == (2, 4, 5, 6, 8)
    bm3.check_invariants()
    with pytest.raises(IndexError, match="out of range"):
        bm3.slot("A", 9)

    bm4 = bm3.free(["A"])  # released last block first, each to the back of the free list
    assert bm4.free_block_ids == (2, 4, 5, 6, 8, 3, 1, 7) and bm4.seq_ids == ()
    assert bm4.num_free_blocks == 8
    bm4.check_invariants()


def test_figure8_parallel_sampling_copy_on_write():
    bm, _ = paper_pool().allocate("A1", PROMPT)
    bm = bm.fork("A1", "A2")
    assert bm.block_table("A2") == (7, 1) and bm.refcount(7) == bm.refcount(1) == 2
    assert bm.slot_mapping("A1", 0, 7) == bm.slot_mapping("A2", 0, 7)
    assert bm.stats()["refcount_histogram"] == {2: 2}
    assert bm.num_blocks_to_append(["A1", "A2"]) == 1  # one copy; the last writer writes in place
    assert bm.num_blocks_to_append(["A1"]) == 1
    bm.check_invariants()

    # A1 writes first: block 1 is shared -> copy-on-write into block 3
    bm, ops = bm.append([("A1", TOKEN["fathers"]), ("A2", TOKEN["mothers"])])
    assert ops == DeviceOps(copy_pairs=((1, 3),))
    assert bm.block_table("A1") == (7, 3) and bm.block_table("A2") == (7, 1)
    assert bm.refcount(7) == 2 and bm.refcount(1) == 1 and bm.refcount(3) == 1
    assert bm.slot("A1", 7) == 15 and bm.slot("A2", 7) == 7
    assert bm.free_block_ids == (2, 4, 5, 6, 8)
    bm.check_invariants()

    # next step: both last blocks are full and private: new blocks, no copies
    bm, ops = bm.append([("A1", 1), ("A2", 2)])
    assert not ops and bm.block_table("A1") == (7, 3, 2) and bm.block_table("A2") == (7, 1, 4)

    bm = bm.free(["A1"])
    assert bm.refcount(7) == 1 and bm.free_block_ids == (5, 6, 8, 2, 3)
    bm = bm.free(["A2"])
    assert bm.free_block_ids == (5, 6, 8, 2, 3, 4, 1, 7) and bm.num_free_blocks == 8
    assert bm.stats()["num_used_blocks"] == 0
    bm.check_invariants()


def test_figure8_separate_steps():
    """A2 appending in a later step still writes in place: refcount 1 after A1's copy."""
    bm, _ = paper_pool().allocate("A1", PROMPT)
    bm, ops = bm.fork("A1", "A2").append([("A1", TOKEN["fathers"])])
    assert ops.copy_pairs == ((1, 3),)
    assert bm.num_blocks_to_append(["A2"]) == 0
    bm, ops = bm.append([("A2", TOKEN["mothers"])])
    assert not ops and bm.block_table("A2") == (7, 1)


def test_figure9_beam_search_tree():
    """Width 4, block size 4. The paper's block 0 (the prompt) is our null block, so it is 13."""
    prompt_block = 13
    bm = BlockManager.create(14, 4, free_block_ids=[prompt_block, *range(1, 13)])
    bm, _ = bm.allocate(0, [1, 2, 3, 4])
    bm = bm.fork(0, 3)
    for t in range(8):  # candidates 0 and 3 fill their 2nd and 3rd blocks
        bm, ops = bm.append([(0, 10 + t), (3, 20 + t)])
        assert not ops
    bm = bm.fork(0, 1).fork(0, 2)
    for t in range(4):  # all four fill a 4th block: 3, 1, 2, 0 allocate in that order
        bm, ops = bm.append([(3, 30 + t), (1, 40 + t), (2, 50 + t), (0, 60 + t)])
        assert not ops
    assert bm.block_table(0) == (13, 1, 3, 8)
    assert bm.block_table(1) == (13, 1, 3, 6)
    assert bm.block_table(2) == (13, 1, 3, 7)
    assert bm.block_table(3) == (13, 2, 4, 5)
    assert [bm.refcount(b) for b in (13, 1, 3)] == [4, 3, 3]
    assert bm.free_block_ids == (9, 10, 11, 12)
    bm.check_invariants()

    # the top 4 now descend from candidates 1 and 2: prune 0 and 3 -> blocks 2, 4, 5, 8 freed
    before = bm
    bm = bm.free([0, 3])
    assert bm.free_block_ids == (9, 10, 11, 12, 8, 5, 4, 2)
    assert [bm.refcount(b) for b in (13, 1, 3, 6, 7)] == [2, 2, 2, 1, 1]
    assert before.refcount(8) == 1 and bm.refcount(8) == 0  # the old snapshot is untouched
    bm = bm.fork(1, 4).fork(2, 5)
    assert [bm.refcount(b) for b in (13, 1, 3, 6, 7)] == [4, 4, 4, 2, 2]
    bm, ops = bm.append([(1, 70), (4, 71), (2, 72), (5, 73)])
    assert not ops  # 4th blocks are full: new blocks 9-12, no copy
    assert [bm.block_table(s)[4] for s in (1, 4, 2, 5)] == [9, 10, 11, 12]
    assert bm.block_table(4)[:4] == (13, 1, 3, 6)
    bm.check_invariants()
    bm = bm.free([1, 2, 4, 5])
    assert bm.num_free_blocks == 13 and bm.stats()["num_used_blocks"] == 0
    bm.check_invariants()


def test_swap_out_and_in_round_trip():
    bm = BlockManager.create(8, 4, num_cpu_blocks=4)
    bm, _ = bm.allocate("a", list(range(6)))  # blocks 1, 2 (2 filled)
    bm = bm.fork("a", "b")
    bm, ops = bm.append([("b", 9)])  # b copies block 2 into 3
    assert ops.copy_pairs == ((2, 3),)
    assert bm.block_table("a") == (1, 2) and bm.block_table("b") == (1, 3)
    assert bm.can_swap_out(["a", "b"]) and bm.can_swap_out(["a"])

    bm1, ops = bm.swap_out(["a", "b"])
    assert ops == DeviceOps(swap_out=((1, 0), (2, 1), (3, 2)))  # shared block 1 moved once
    assert bm1.block_table("a") == (0, 1) and bm1.block_table("b") == (0, 2)
    assert bm1.is_swapped("a") and bm1.num_tokens("b") == 7
    assert [bm1.cpu_refcount(c) for c in range(4)] == [2, 1, 1, 0]
    assert bm1.num_free_cpu_blocks == 1 and bm1.free_cpu_block_ids == (3,)
    assert bm1.free_block_ids == (4, 5, 6, 7, 2, 3, 1) and bm1.refcount(1) == 0
    bm1.check_invariants()
    with pytest.raises(ValueError, match="swapped out"):
        bm1.slot("a", 0)
    with pytest.raises(ValueError, match="swapped out"):
        bm1.append([("a", 1)])

    assert bm1.can_swap_in(["a", "b"])
    bm2, ops = bm1.swap_in(["b", "a"])
    assert ops == DeviceOps(swap_in=((0, 4), (2, 5), (1, 6)))
    assert bm2.block_table("b") == (4, 5) and bm2.block_table("a") == (4, 6)
    assert bm2.refcount(4) == 2 and bm2.num_free_cpu_blocks == 4
    assert bm2.free_cpu_block_ids == (3, 2, 1, 0)  # released last block first
    bm2.check_invariants()
    # logical content preserved: device -> CPU -> device composes to the original tables
    out, back = dict(((1, 0), (2, 1), (3, 2))), dict(ops.swap_in)
    for s in ("a", "b"):
        assert tuple(back[out[b]] for b in bm.block_table(s)) == bm2.block_table(s)

    bm3 = bm2.free(["a", "b"])
    assert bm3.num_free_blocks == 7 and bm3.num_free_cpu_blocks == 4
    bm3.check_invariants()


def test_swap_capacity_and_abort_while_swapped():
    bm = BlockManager.create(8, 2, num_cpu_blocks=2)
    bm, _ = bm.allocate("a", [1, 2, 3])  # 2 blocks
    bm, _ = bm.allocate("b", [4])
    assert bm.can_swap_out(["a"]) and not bm.can_swap_out(["a", "b"])
    with pytest.raises(OutOfBlocksError, match="no free CPU block"):
        bm.swap_out(["a", "b"])
    bm, ops = bm.swap_out(["a"])
    assert bm.num_free_cpu_blocks == 0 and len(ops.swap_out) == 2
    bm = bm.fork("a", "a2")  # forking while swapped shares the CPU blocks
    assert bm.cpu_refcount(0) == 2
    bm = bm.free(["a", "a2"])  # abort the swapped group
    assert bm.num_free_cpu_blocks == 2 and bm.free_cpu_block_ids == (1, 0)
    bm.check_invariants()

    bm, _ = bm.allocate("c", list(range(9)))  # 5 blocks: 1 left free
    assert bm.num_free_blocks == 1 and not bm.can_allocate([[1, 2, 3]])
    with pytest.raises(OutOfBlocksError, match="needs 2 blocks, 1 free"):
        bm.allocate("d", [1, 2, 3])


def test_can_swap_in_counts_device_blocks():
    bm = BlockManager.create(4, 2, num_cpu_blocks=4)
    bm, _ = bm.allocate("a", [1, 2, 3])  # blocks 1, 2
    bm, _ = bm.swap_out(["a"])
    bm, _ = bm.allocate("b", [1, 2, 3])  # 2 of 3 device blocks
    assert not bm.can_swap_in(["a"])
    with pytest.raises(OutOfBlocksError):
        bm.swap_in(["a"])
    bm = bm.free(["b"])
    assert bm.can_swap_in(["a"])


def test_prefix_caching_shares_full_blocks():
    bm = BlockManager.create(10, 4, enable_prefix_caching=True)
    prefix = list(range(1, 9))  # two full blocks
    bm, num_cached = bm.allocate("a", prefix + [9])
    assert num_cached == 0 and bm.block_table("a") == (1, 2, 3)
    assert bm.is_cached(1) and bm.is_cached(2) and not bm.is_cached(3)  # partial: not cached

    bm, num_cached = bm.allocate("b", prefix + [10, 11])
    assert num_cached == 8 and bm.block_table("b") == (1, 2, 4)
    assert bm.refcount(1) == bm.refcount(2) == 2
    bm, num_cached = bm.allocate("c", prefix + [9])  # same partial block as a: never shared
    assert num_cached == 8 and bm.block_table("c") == (1, 2, 5)
    bm, num_cached = bm.allocate("d", prefix)  # the last token is always computed
    assert num_cached == 4 and bm.block_table("d") == (1, 6)
    assert not bm.is_cached(6)  # an identical block is cached already (2)
    bm, num_cached = bm.allocate("e", [0] + prefix)
    assert num_cached == 0 and bm.block_table("e") == (7, 8, 9)  # hashes chain from block 0
    bm.check_invariants()
    assert bm.stats()["num_cached_blocks"] == 4  # 1, 2, 7, 8

    bm = bm.free(["a", "b", "c", "d", "e"])
    # cached blocks are cached-free (LRU, after the uncached free ones), in release order
    assert bm.num_free_blocks == 9 and bm.stats()["num_cached_free_blocks"] == 4
    assert bm.free_block_ids == (3, 4, 5, 6, 9, 2, 1, 8, 7)
    bm.check_invariants()

    # a cache hit takes cached-free blocks back out of the evictable list
    bm, num_cached = bm.allocate("f", prefix + [12])
    assert num_cached == 8 and bm.block_table("f") == (1, 2, 3)
    assert bm.free_block_ids == (4, 5, 6, 9, 8, 7)
    # an unrelated sequence takes uncached free blocks first, then evicts LRU (8, then 7)
    bm, num_cached = bm.allocate("g", list(range(50, 69)))  # 5 blocks, the last partial
    assert num_cached == 0 and bm.block_table("g") == (4, 5, 6, 9, 8)
    assert not bm.is_cached(8) and bm.is_cached(7)  # e's tail block 8 went first
    bm = bm.free(["g"])
    bm, num_cached = bm.allocate("h", [0] + prefix)  # e's head block 7 is still cached
    assert num_cached == 4 and bm.block_table("h")[0] == 7
    bm.check_invariants()


def test_prefix_caching_caches_block_filled_by_append():
    bm = BlockManager.create(8, 4, enable_prefix_caching=True)
    bm, _ = bm.allocate("a", [1, 2, 3, 4, 5, 6, 7])
    assert not bm.is_cached(2)
    bm, _ = bm.append([("a", 8)])
    assert bm.is_cached(2)
    bm, num_cached = bm.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert num_cached == 8 and bm.block_table("b")[:2] == (1, 2)
    bm, num_cached = bm.allocate("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert num_cached == 4 and bm.block_table("c")[:1] == (1,)
    bm.check_invariants()


def test_prefix_caching_hashes_chain_through_parents():
    """A block's hash covers its whole prefix: equal tokens at another position never hit."""
    bm = BlockManager.create(10, 4, enable_prefix_caching=True)
    bm, _ = bm.allocate("a", [1, 2, 3, 4, 5, 5, 5, 5, 6, 6, 6, 6, 0])
    bm, num_cached = bm.allocate("b", [1, 2, 3, 4, 6, 6, 6, 6, 0])
    assert num_cached == 4 and bm.block_table("b") == (1, 5, 6)
    bm.check_invariants()


def test_prefix_caching_allocate_counts_cached_free_hits_as_taken():
    bm = BlockManager.create(6, 2, enable_prefix_caching=True)
    bm, _ = bm.allocate("a", [1, 2, 3, 4, 5])  # blocks 1, 2 cached, 3 partial
    bm, _ = bm.allocate("x", [9, 9, 9])  # blocks 4, 5: all used
    bm = bm.free(["a"])  # 3 free, 2 and 1 cached-free
    assert bm.free_block_ids == (3, 2, 1)
    bm, _ = bm.allocate("y", [7])  # takes 3: only cached-free blocks remain
    before = bm
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks, 2 free"):
        bm.allocate("b", [1, 2, 3, 4, 5, 6])  # 2 hits (cached-free) + 1 new block
    bm, num_cached = bm.free(["y"]).allocate("b", [1, 2, 3, 4, 5, 6])
    assert num_cached == 4 and bm.block_table("b") == (1, 2, 3) and bm.num_free_blocks == 0
    assert before.free_block_ids == (2, 1)
    bm.check_invariants()


def test_prefix_caching_off_never_caches():
    bm = BlockManager.create(8, 4)
    bm, _ = bm.allocate("a", list(range(9)))
    bm, num_cached = bm.allocate("b", list(range(9)))
    assert num_cached == 0 and set(bm.block_table("a")).isdisjoint(bm.block_table("b"))
    assert bm.stats()["num_cached_blocks"] == 0


def test_errors_leave_snapshot_unchanged():
    bm, _ = BlockManager.create(4, 2).allocate("a", [1, 2, 3])  # blocks 1, 2; 1 free
    before = copy.deepcopy(bm)
    assert not bm.can_allocate([[1, 2, 3]]) and bm.can_allocate([[1, 2]])
    with pytest.raises(OutOfBlocksError, match="cannot allocate sequence 'b' .3 tokens.: needs 2"):
        bm.allocate("b", [1, 2, 3])
    with pytest.raises(ValueError, match="sequence 'a': it already exists"):
        bm.allocate("a", [1])
    with pytest.raises(ValueError, match="no tokens"):
        bm.allocate("c", [])
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        bm.append([("zz", 1)])
    with pytest.raises(ValueError, match="appears twice"):
        bm.append([("a", 1), ("a", 2)])
    with pytest.raises(ValueError, match="cannot fork 'a' into 'a'"):
        bm.fork("a", "a")
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        bm.fork("zz", "y")
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        bm.free(["a", "zz"])  # fails after 'a' was released in the working copy
    with pytest.raises(KeyError, match="unknown sequence"):
        bm.block_table("zz")
    bm2, _ = bm.append([("a", 4)])  # block 2 full
    bm2 = bm2.fork("a", "b").fork("a", "c")
    assert not bm2.can_append(["a", "b"])
    with pytest.raises(OutOfBlocksError, match="no free device block"):
        bm2.append([("a", 5), ("b", 6)])  # a takes the last block, b finds none
    assert bm == before and bm.free_block_ids == (3,) and bm.refcount(2) == 1
    bm.check_invariants()


def test_can_allocate_with_watermark_reserve():
    bm = BlockManager.create(8, 4)  # 7 free
    assert bm.can_allocate([[0] * 20]) and not bm.can_allocate([[0] * 29])
    assert bm.can_allocate([[0] * 20], reserve=2) and not bm.can_allocate([[0] * 20], reserve=3)
    # several new sequences share no block: each takes its own ceil(len / block_size)
    assert bm.can_allocate([[0] * 5, [0] * 5, [0] * 9]) and not bm.can_allocate([[0] * 5] * 4)
    bm, _ = bm.allocate("a", [1])  # paged: nothing reserved ahead
    assert bm.num_free_blocks == 6


def test_large_pool_branching_snapshots_stay_independent():
    """Many shards (default shard size, 1000 blocks): two futures of one snapshot share its
    tables without seeing each other's writes."""
    bm = BlockManager.create(1000, 4, num_cpu_blocks=200, enable_prefix_caching=True)
    for s in range(40):
        bm, _ = bm.allocate(s, [s % 5] * 8 + list(range(s % 7 + 1)))
    bm = bm.fork(0, 100)
    base = (bm.free_block_ids, [bm.block_table(s) for s in range(40)],
            [bm.refcount(i) for i in range(1000)], bm.stats())
    a = bm
    for t in range(9):
        a, _ = a.append([(s, t) for s in range(0, 40, 2)] + [(100, t)])
    a, _ = a.swap_out([1, 3, 5])
    b = bm.free(list(range(1, 40, 2))).fork(2, 101)
    b, _ = b.append([(101, 7), (2, 7)])
    for snapshot in (bm, a, b):
        snapshot.check_invariants()
    assert base == (bm.free_block_ids, [bm.block_table(s) for s in range(40)],
                    [bm.refcount(i) for i in range(1000)], bm.stats())
    assert a.has(1) and a.is_swapped(1) and not b.has(1) and b.has(101) and not a.has(101)
    assert a.num_tokens(0) == bm.num_tokens(0) + 9 and b.num_tokens(0) == bm.num_tokens(0)
    assert a.free([s for s in a.seq_ids]).num_free_blocks == 999


def test_can_append_counts_new_blocks_and_copies():
    bm, _ = BlockManager.create(6, 2).allocate("a", [1])
    bm = bm.fork("a", "b").fork("a", "c")  # block 1 (1 filled) shared 3 ways
    assert bm.num_blocks_to_append(["a", "b", "c"]) == 2
    assert bm.num_blocks_to_append(["a", "b"]) == 2
    bm2, ops = bm.append([("a", 1), ("b", 2), ("c", 3)])
    assert ops.copy_pairs == ((1, 2), (1, 3)) and bm2.block_table("c") == (1,)
    assert bm2.num_free_blocks == bm.num_free_blocks - 2
    bm3, _ = bm2.allocate("d", [1, 2])  # 4 used, 1 free
    assert bm3.num_blocks_to_append(["a", "b", "c", "d"]) == 4 and bm3.num_free_blocks == 1
    assert bm3.can_append(["a"]) and not bm3.can_append(["a", "b"])


def test_device_ops_add_and_stats():
    a = DeviceOps(copy_pairs=((1, 2),), swap_out=((3, 0),))
    b = DeviceOps(copy_pairs=((4, 5),), swap_in=((1, 6),))
    assert a + b == DeviceOps(((1, 2), (4, 5)), ((3, 0),), ((1, 6),))
    assert not DeviceOps() and a
    bm, _ = BlockManager.create(6, 2, num_cpu_blocks=3).allocate("a", [1, 2, 3])
    bm = bm.fork("a", "b")
    assert bm.stats() == {
        "num_blocks": 6, "num_free_blocks": 3, "num_used_blocks": 2, "num_cached_blocks": 0,
        "num_cached_free_blocks": 0, "refcount_histogram": {2: 2}, "num_cpu_blocks": 3,
        "num_used_cpu_blocks": 0, "num_seqs": 2, "num_swapped_seqs": 0}
    assert "blocks used/free/total=2/3/6" in repr(bm)


def test_snapshots_with_different_shard_widths_coexist():
    """Shard layout travels with each snapshot: no module-level setting can make one unreadable."""
    wide = BlockManager.create(64, 4)
    wide, _ = wide.allocate("a", list(range(30)))
    narrow = BlockManager.create(64, 4, shard_bits=0)
    narrow, _ = narrow.allocate("a", list(range(30)))
    for bm in (wide, narrow):
        bm, _ = bm.append([("a", 1)])
        bm = bm.fork("a", "b")
        bm = bm.free(["a", "b"])
        bm.check_invariants()
        assert bm.num_free_blocks == 63


def test_filled_slots_and_kv_utilization_count_a_shared_block_once():
    from jpaged.core.kv_cache_manager import filled_slots, kv_utilization

    bm = paper_pool(num_cpu_blocks=4)
    assert filled_slots(bm) == {} and kv_utilization(bm) is None
    bm, _ = bm.allocate("A", PROMPT)  # blocks 7 (4 filled), 1 (3 filled)
    bm = bm.fork("A", "B")  # shares both
    assert filled_slots(bm) == {7: 4, 1: 3} and kv_utilization(bm) == 7 / 8
    bm, _ = bm.allocate("C", PROMPT[:1])  # block 3, 1 filled
    assert kv_utilization(bm) == 8 / 12
    bm, _ = bm.swap_out(["C"])
    assert filled_slots(bm, swapped=True) == {0: 1} and kv_utilization(bm) == 7 / 8


# ---- sliding window: blocks that slid out of every layer's window go back to the pool ---------------

def test_sliding_window_releases_blocks_that_slid_out():
    """W = 6, blocks of 4: the query at position p reads p - 5 .. p, so appending at p releases the
    blocks whose last position is <= p - 6. Released entries become null; tables keep their length."""
    bm = BlockManager.create(10, 4, sliding_window=6)
    assert bm.max_window_blocks == 3 and [bm.num_dead_blocks(p) for p in (0, 8, 9, 12, 13)] == [0, 0, 1, 1, 2]
    bm, num_cached = bm.allocate("a", list(range(7)))
    assert num_cached == 0 and bm.block_table("a") == (1, 2) and bm.num_null_blocks("a") == 0
    bm, _ = bm.append([("a", 7)])
    bm, _ = bm.append([("a", 8)])  # the query at 8 reads 3..8: block 1 (0..3) still live
    assert bm.block_table("a") == (1, 2, 3) and bm.free_block_ids == (4, 5, 6, 7, 8, 9)
    bm.check_invariants()
    bm, ops = bm.append([("a", 9)])  # reads 4..9: block 1 is dead, back to the end of the free list
    assert not ops and bm.block_table("a") == (NULL_BLOCK_ID, 2, 3) and bm.num_null_blocks("a") == 1
    assert bm.free_block_ids == (4, 5, 6, 7, 8, 9, 1) and bm.refcount(1) == 0
    assert bm.slot_mapping("a", 4, 10) == [8, 9, 10, 11, 12, 13]  # live positions keep their slots
    bm.check_invariants()
    for t in (10, 11, 12, 13):
        bm, ops = bm.append([("a", t)])
        assert not ops
    assert bm.block_table("a") == (0, 0, 3, 4) and bm.free_block_ids == (5, 6, 7, 8, 9, 1, 2)
    assert bm.stats()["num_used_blocks"] == 2 and bm.num_free_blocks == 7
    bm.check_invariants()
    bm = bm.free(["a"])  # null entries are skipped
    assert bm.free_block_ids == (5, 6, 7, 8, 9, 1, 2, 4, 3) and bm.num_free_blocks == 9
    bm.check_invariants()


def test_sliding_window_fork_shares_null_entries_and_a_block_stays_until_its_last_holder():
    bm = BlockManager.create(10, 4, sliding_window=6)
    bm, _ = bm.allocate("a", list(range(9)))  # blocks 1, 2, 3 (1 filled)
    bm, _ = bm.append([("a", 9)])
    assert bm.block_table("a") == (0, 2, 3)
    bm = bm.fork("a", "b")  # the null entry is copied, not refcounted
    assert bm.block_table("b") == (0, 2, 3) and bm.num_null_blocks("b") == 1
    assert [bm.refcount(b) for b in range(4)] == [0, 0, 2, 2]
    bm, ops = bm.append([("a", 10), ("b", 11)])  # copy-on-write of the shared last block, as ever
    assert ops.copy_pairs == ((3, 4),) and bm.block_table("a") == (0, 2, 4) and bm.block_table("b") == (0, 2, 3)
    for t in range(3):
        bm, _ = bm.append([("a", t)])
    assert bm.num_tokens("a") == 14 and bm.block_table("a") == (0, 0, 4, 5)
    assert bm.refcount(2) == 1 and 2 not in bm.free_block_ids  # b (11 tokens) still reads block 2
    bm.check_invariants()
    bm, _ = bm.append([("b", 11)])
    assert bm.num_blocks_to_append(["b"]) == 1  # position 12: a new block; the query reads 7..12
    bm, _ = bm.append([("b", 12)])
    assert bm.block_table("b") == (0, 2, 3, 6) and bm.free_block_ids == (7, 8, 9, 1)
    assert bm.num_blocks_to_append(["b"]) == 0
    bm, _ = bm.append([("b", 13)])  # the query at 13 reads 8..13: b, the last holder, frees block 2
    assert bm.block_table("b") == (0, 0, 3, 6) and bm.free_block_ids == (7, 8, 9, 1, 2)
    bm.check_invariants()


def test_sliding_window_swap_moves_only_live_blocks():
    bm = BlockManager.create(10, 4, num_cpu_blocks=6, sliding_window=6)
    bm, _ = bm.allocate("a", list(range(13)))  # blocks 1, 2, 3, 4 (1 filled): a prefill holds everything
    assert bm.block_table("a") == (1, 2, 3, 4) and bm.num_null_blocks("a") == 0
    bm, _ = bm.append([("a", 13)])  # the query at 13 reads 8..13: blocks 1 and 2 are dead
    assert bm.block_table("a") == (0, 0, 3, 4) and bm.free_block_ids == (5, 6, 7, 8, 9, 1, 2)
    assert bm.can_swap_out(["a"])
    out, ops = bm.swap_out(["a"])
    assert ops.swap_out == ((3, 0), (4, 1))
    # null entries stay 0 while swapped out: placeholders, not CPU block 0 (num_null_blocks says so)
    assert out.block_table("a") == (0, 0, 0, 1) and out.num_null_blocks("a") == 2
    assert out.free_cpu_block_ids == (2, 3, 4, 5) and out.cpu_refcount(0) == 1
    assert filled_slots(out, swapped=True) == {0: 4, 1: 2}
    out.check_invariants()
    back, ops = out.swap_in(["a"])
    assert ops.swap_in == ((0, 5), (1, 6)) and back.block_table("a") == (0, 0, 5, 6)
    assert back.slot_mapping("a", 12, 14) == [24, 25]
    back.check_invariants()
    assert back.free(["a"]).num_free_blocks == 9


def test_sliding_window_bound_holds_at_8x_the_window():
    """A sequence appended to 8 windows holds at most ceil((W - 1) / block_size) + 1 blocks after
    every append: a pool of exactly that many usable blocks never runs out, and the bound is met."""
    for block_size, window in [(1, 1), (1, 3), (2, 3), (4, 4), (4, 5), (4, 6), (16, 64), (16, 65)]:
        bound = -(-(window - 1) // block_size) + 1
        assert bound <= -(-window // block_size) + 1
        bm = BlockManager.create(bound + 1, block_size, sliding_window=window)
        assert bm.max_window_blocks == bound
        bm, _ = bm.allocate("a", [0])
        most = 1
        for t in range(8 * window):
            assert bm.can_append(["a"]), (block_size, window, t)
            bm, _ = bm.append([("a", t)])
            live = len(bm.block_table("a")) - bm.num_null_blocks("a")
            assert live <= bound and bm.num_free_blocks == bound - live
            # everything the query at the last position reads is live
            assert bm.num_null_blocks("a") * block_size <= max(0, bm.num_tokens("a") - window)
            most = max(most, live)
        assert most == bound and bm.num_tokens("a") == 8 * window + 1
        assert len(bm.block_table("a")) == -(-(8 * window + 1) // block_size)
        bm.check_invariants()
        # without the window the same pool runs out within the first window
        plain, _ = BlockManager.create(bound + 1, block_size).allocate("a", [0])
        with pytest.raises(OutOfBlocksError):
            for t in range(8 * window):
                plain, _ = plain.append([("a", t)])


def test_sliding_window_can_append_counts_blocks_the_append_releases():
    """W = 3, blocks of 2: appending at position 4 releases block 1 (positions 0-1) and needs a new
    block; with no free block it still fits (releases come before allocations), and can_append says so."""
    bm = BlockManager.create(3, 2, sliding_window=3)
    bm, _ = bm.allocate("a", [1, 2, 3])
    bm, _ = bm.append([("a", 4)])
    assert bm.block_table("a") == (1, 2) and bm.num_free_blocks == 0
    assert bm.num_blocks_to_append(["a"]) == 0 and bm.can_append(["a"])
    bm, ops = bm.append([("a", 5)])
    assert not ops and bm.block_table("a") == (0, 2, 1) and bm.num_free_blocks == 0
    bm.check_invariants()
    # a block two sequences hold is freed only when both release it in the same append
    bm = BlockManager.create(6, 2, sliding_window=3)
    bm, _ = bm.allocate("a", [1, 2, 3, 4])
    bm = bm.fork("a", "b")  # share blocks 1, 2 (both full); position 4 makes block 1 dead for each
    bm, _ = bm.allocate("x", [9, 9, 9])  # takes 3, 4: block 5 is free
    assert bm.num_blocks_to_append(["a"]) == 1 and bm.num_blocks_to_append(["a", "b"]) == 1  # 2 new, 1 freed
    assert bm.can_append(["a", "b"])
    bm, ops = bm.append([("a", 5), ("b", 6)])  # a takes 5, b the block 1 that both released
    assert not ops and bm.block_table("a") == (0, 2, 5) and bm.block_table("b") == (0, 2, 1)
    assert bm.num_free_blocks == 0 and bm.refcount(2) == 2
    bm.check_invariants()


def test_sliding_window_prefix_caching_reuses_the_live_part_of_a_cached_prefix():
    """A released block keeps its K/V and hash (cached-free), so a request with the same prompt maps
    the cached blocks its queries read and leaves the dead ones null; hashes chain over token ids,
    so blocks after an evicted one still hit."""
    tokens = list(range(100, 120))
    bm = BlockManager.create(10, 4, enable_prefix_caching=True, sliding_window=6)
    bm, _ = bm.allocate("a", tokens[:8])
    for t in tokens[8:]:
        bm, _ = bm.append([("a", t)])
    # blocks 1, 2, 3 slid out, each released to the evictable list (logical order) with its hash
    assert bm.block_table("a") == (0, 0, 0, 4, 5) and bm.free_block_ids == (6, 7, 8, 9, 1, 2, 3)
    assert all(bm.is_cached(b) for b in (1, 2, 3, 4, 5)) and bm.stats()["num_cached_free_blocks"] == 3
    bm.check_invariants()
    prompt = tokens + [1, 2]  # a continues a's conversation: 5 full blocks could hit, the last token is computed
    # computing positions 20.. reads 15..: blocks 3 and 4 (a's 4, 5) are shared, 0-2 need nothing
    assert bm.allocation_cost(prompt) == (1, 20)
    running, num_cached = bm.allocate("b", prompt)
    assert num_cached == 20 and running.block_table("b") == (0, 0, 0, 4, 5, 6)
    assert running.refcount(4) == running.refcount(5) == 2 and running.free_block_ids == (7, 8, 9, 1, 2, 3)
    running.check_invariants()

    bm = bm.free(["a"])
    assert bm.free_block_ids == (6, 7, 8, 9, 1, 2, 3, 5, 4)
    bm, _ = bm.allocate("x", list(range(8)))  # 6, 7
    bm, _ = bm.allocate("y", list(range(50, 61)))  # 8, 9 and evicts 1 (least recently freed)
    assert bm.block_table("y") == (8, 9, 1) and not bm.is_cached(1) and bm.is_cached(2)
    bm, num_cached = bm.allocate("b", prompt)  # block 0's hash is gone; the live blocks still hit
    assert num_cached == 20 and bm.block_table("b") == (0, 0, 0, 4, 5, 2)
    assert bm.refcount(4) == bm.refcount(5) == 1 and bm.num_free_blocks == 1 and bm.is_cached(3)
    bm.check_invariants()
    for t in (3, 4):  # b's blocks filled by appends keep chaining from the token hashes
        bm, _ = bm.append([("b", t)])
    bm = bm.free(["b", "x", "y"])
    bm, num_cached = bm.allocate("c", prompt + [3, 4, 5])
    assert num_cached == 24 and bm.block_table("c")[:6] == (0, 0, 0, 0, 5, 2)

    # without a window the same evictions leave no usable prefix: block 0 must hit first
    plain = BlockManager.create(10, 4, enable_prefix_caching=True)
    plain, _ = plain.allocate("a", tokens)
    plain = plain.free(["a"])
    plain, _ = plain.allocate("y", list(range(50, 50 + 4 * 9)))  # every block: all cached ones evicted
    plain = plain.free(["y"])
    assert plain.allocate("b", prompt)[1] == 0


def test_sliding_window_spec_validation_stats_and_utilization():
    spec = KVCacheSpec(num_blocks=9, block_size=4, sliding_window=6)
    bm = BlockManager.from_spec(spec)
    assert bm.sliding_window == 6 and BlockManager.from_spec(KVCacheSpec(9, 4)).sliding_window is None
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="sliding_window"):
            BlockManager.create(9, 4, sliding_window=bad)
    bm, _ = bm.allocate("a", list(range(13)))
    bm, _ = bm.append([("a", 13)])  # (0, 0, 3, 4): 4 + 2 slots filled in 2 blocks
    assert filled_slots(bm) == {3: 4, 4: 2} and kv_utilization(bm) == 6 / 8
    stats = bm.stats()
    assert stats["num_used_blocks"] == 2 and stats["num_free_blocks"] == 6
    assert stats["refcount_histogram"] == {1: 2}


def test_sliding_window_recompute_reallocates_the_whole_context():
    """After preemption by recompute the whole sequence is prefilled again: it holds every block for
    that step (nothing is cached), then its first append releases what slid out."""
    bm = BlockManager.create(10, 4, sliding_window=6)
    bm, _ = bm.allocate("a", list(range(21)))
    assert bm.block_table("a") == (1, 2, 3, 4, 5, 6) and bm.num_null_blocks("a") == 0
    bm.check_invariants()
    bm, _ = bm.append([("a", 21)])  # reads 16..21: blocks 1-4 are dead
    assert bm.block_table("a") == (0, 0, 0, 0, 5, 6) and bm.free_block_ids == (7, 8, 9, 1, 2, 3, 4)
    bm.check_invariants()


# ---------------------------------------------------------------- the host loop's per-step helpers

class _Plain:
    """A KV cache manager without the optional members (`append_slots`, `num_filled_slots`,
    `max_blocks_per_append`): the module's functions must take the slow way with it."""

    def __init__(self, bm):
        self.bm = bm

    def __getattr__(self, name):
        if name in ("append_slots", "num_filled_slots", "max_blocks_per_append"):
            raise AttributeError(name)
        return getattr(self.bm, name)

    def append(self, appends):
        bm, ops = self.bm.append(appends)
        return _Plain(bm), ops


def test_kept_utilization_follows_lookahead_fork_swap_and_free():
    """`num_filled_slots` counts token slots only: lookahead slots fill none until `commit_lookahead`
    accepts drafts; a forked (shared) block counts once, its copy-on-write copy apart; swapped-out
    sequences' blocks are not on the device. At each step it equals a walk of the tables (and
    `kv_utilization` a manager's without the counter)."""
    def walked(bm):
        assert bm.num_filled_slots == sum(filled_slots(bm).values())
        assert kv_utilization(bm) == kv_utilization(_Plain(bm))
        return bm.num_filled_slots

    bm = BlockManager.create(16, 4, num_cpu_blocks=8)
    bm, _ = bm.allocate("a", [1, 2, 3, 4, 5])  # blocks of 4 + 1 tokens
    assert walked(bm) == 5 and kv_utilization(bm) == 5 / 8
    bm, _ = bm.append([("a", 6)], lookahead=5)  # 6 tokens and 5 lookahead slots: 3 blocks, the 3rd all lookahead
    assert len(bm.block_table("a")) == 3 and walked(bm) == 6 and kv_utilization(bm) == 6 / 12
    bm = bm.commit_lookahead("a", [7, 8, 9])  # 3 drafts accepted: 9 tokens, the lookahead-only block kept
    assert walked(bm) == 9 and len(bm.block_table("a")) == 3
    bm = bm.fork("a", "b")  # shared: counted once
    assert walked(bm) == 9
    bm, ops = bm.append([("b", 10)])  # copy-on-write of the shared last block (1 token) into b's own
    assert ops.copy_pairs and walked(bm) == 9 + 2
    bm, _ = bm.swap_out(["b"])
    assert walked(bm) == 9
    bm, _ = bm.swap_in(["b"])  # back in blocks of its own: what it shared with a is no longer shared
    assert walked(bm) == 9 + 10
    bm = bm.free(["a", "b"])
    assert walked(bm) == 0 and kv_utilization(bm) is None


def test_kept_utilization_with_prefix_hits_and_a_window():
    """A prefix-cache hit on a cached-free block counts its slots again; blocks a sliding window
    releases stop counting."""
    bm = BlockManager.create(12, 4, enable_prefix_caching=True)
    bm, _ = bm.allocate("a", list(range(9)))
    bm = bm.free(["a"])  # its two full blocks stay cached (free)
    assert bm.num_filled_slots == 0
    bm, cached = bm.allocate("b", list(range(9)) + [50])
    assert cached == 8 and bm.num_filled_slots == 10 == sum(filled_slots(bm).values())
    windowed = BlockManager.create(12, 4, sliding_window=4)
    windowed, _ = windowed.allocate("w", list(range(10)))
    for t in range(6):
        windowed, _ = windowed.append([("w", t)])
        assert windowed.num_filled_slots == sum(filled_slots(windowed).values())
    assert windowed.num_null_blocks("w") > 0 and windowed.num_filled_slots < windowed.num_tokens("w")


def test_append_slots_helper_and_appends_fit():
    """`kv_cache_manager.append_slots` gives the same snapshot, slots and tables through a manager's own
    `append_slots` or, without one, `append` and a lookup per sequence; `appends_fit` holds only where a
    manager bounds an append's blocks per sequence."""
    from jpaged.core.kv_cache_manager import append_slots, appends_fit

    bm = BlockManager.create(10, 4)
    for s, n in (("a", 4), ("b", 6), ("c", 1)):
        bm, _ = bm.allocate(s, list(range(n)))
    bm = bm.fork("b", "d")  # d's append copies b's shared last block
    appends = [("a", 9), ("b", 9), ("d", 9), ("c", 9)]
    fast, fast_ops, slots, tables = append_slots(bm, appends)
    slow, slow_ops, slow_slots, slow_tables = append_slots(_Plain(bm), appends)
    assert fast_ops == slow_ops and fast_ops.copy_pairs and slots == slow_slots and tables == slow_tables
    assert [fast.block_table(s) for s, _ in appends] == [slow.bm.block_table(s) for s, _ in appends] == tables
    assert slots == [fast.slot(s, fast.num_tokens(s) - 1) for s, _ in appends]
    assert appends_fit(bm, 4, 4) and not appends_fit(bm, 5, 4)
    assert not appends_fit(_Plain(bm), 1, 100)
