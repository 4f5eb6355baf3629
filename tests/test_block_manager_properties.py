"""Property-based tests of the block manager: random allocate / fork / append / free / swap_out /
swap_in / abort programs, with and without prefix caching, against a model of device memory.

The model: every slot holds the K/V of one token, identified by the token prefix that produced it
(`tuple(tokens[:position + 1])`). Operations write the slots the engine would write, and the
returned DeviceOps move blocks in the model's device and CPU pools. After every operation, every
live sequence must read its own prefix at each of its slots (so copy-on-write, swap maps and
prefix-cache hits are all checked), and `check_invariants` must hold.

The sliding-window machines draw a window W: a sequence then reads only its live positions (those
after its null entries), which must hold every position the window of its last token's query
sees, and right after an append it holds at most `max_window_blocks` blocks.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jpaged.core.persistent as persistent
from jpaged.core.block_manager import BlockManager
from jpaged.core.kv_cache_manager import NULL_BLOCK_ID, OutOfBlocksError, filled_slots, kv_utilization

PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 1])  # shared prompts
tokens_st = st.lists(st.integers(0, 3), max_size=6)


class BlockManagerMachine(RuleBasedStateMachine):
    prefix_caching = False
    windowed = False

    @initialize(data=st.data(), block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(4, 24), num_cpu_blocks=st.integers(0, 12),
                shard_bits=st.sampled_from([0, 2, persistent.SHARD_BITS]))
    def setup(self, data, block_size, num_blocks, num_cpu_blocks, shard_bits):
        # small shards, so that small pools exercise the persistent tables' copy-on-write
        order = data.draw(st.permutations(range(1, num_blocks)), label="free_block_ids")
        window = data.draw(st.integers(1, 9), label="sliding_window") if self.windowed else None
        self.bm = BlockManager.create(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                                      enable_prefix_caching=self.prefix_caching, sliding_window=window,
                                      free_block_ids=order, shard_bits=shard_bits)
        self.tokens = {}  # seq id -> token ids whose K/V is in its slots
        self.groups = {}  # group id -> seq ids (a request's samples / beam candidates)
        self.device, self.cpu = {}, {}  # slot -> token prefix whose K/V it holds
        self.next_id = 0
        self.old = (self.bm, self.fingerprint(self.bm))

    # ---- model helpers ------------------------------------------------------------------------
    @staticmethod
    def fingerprint(bm):
        """Everything observable about a snapshot, to check that later operations leave it be."""
        seqs = {s: (bm.block_table(s), bm.num_tokens(s), bm.is_swapped(s)) for s in bm.seq_ids}
        return (seqs, bm.free_block_ids, bm.free_cpu_block_ids,
                [bm.refcount(b) for b in range(bm.num_blocks)],
                [bm.cpu_refcount(b) for b in range(bm.num_cpu_blocks)],
                [bm.is_cached(b) for b in range(bm.num_blocks)], bm.stats())

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def group_ids(self, swapped):
        return sorted(g for g, seqs in self.groups.items()
                      if all(self.bm.is_swapped(s) == swapped for s in seqs))

    def running(self):
        return sorted(s for s in self.tokens if not self.bm.is_swapped(s))

    def live(self, seq_id):
        """The entries of a sequence's table that name a block (after the null ones)."""
        table, num_null = self.bm.block_table(seq_id), self.bm.num_null_blocks(seq_id)
        assert table[:num_null] == (NULL_BLOCK_ID,) * num_null
        return table[num_null:]

    def write(self, seq_id, start):
        tokens = self.tokens[seq_id]
        for p, slot in enumerate(self.bm.slot_mapping(seq_id, start, len(tokens)), start):
            self.device[slot] = tuple(tokens[:p + 1])

    def move_blocks(self, pairs, src, dst):
        bs = self.bm.block_size
        for s, d in pairs:
            for o in range(bs):
                dst[d * bs + o] = src.get(s * bs + o)

    # ---- rules ---------------------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), tail=tokens_st)
    def allocate(self, data, prefix, tail):
        token_ids = prefix + tail or [0]
        seq_id = self.new_id()
        can = self.bm.can_allocate([token_ids])
        try:
            self.bm, num_cached = self.bm.allocate(seq_id, token_ids)
        except OutOfBlocksError:
            assert not can, "can_allocate said yes, allocate failed"
            return
        bs = self.bm.block_size
        assert num_cached % bs == 0 and 0 <= num_cached < len(token_ids)
        assert num_cached == 0 or self.prefix_caching
        self.tokens[seq_id] = list(token_ids)
        self.groups[seq_id] = [seq_id]
        self.write(seq_id, num_cached)  # the cached part must already hold the right K/V

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.new_id()
        self.bm = self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        next(g for g in self.groups.values() if parent in g).append(child)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def append(self, data):
        seq_ids = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, unique=True))
        new_tokens = data.draw(st.lists(st.integers(0, 3), min_size=len(seq_ids),
                                        max_size=len(seq_ids)))
        appends = list(zip(seq_ids, new_tokens))
        if not self.bm.can_append(seq_ids):  # can_append is exact
            with pytest.raises(OutOfBlocksError):
                self.bm.append(appends)
            return
        free_before = self.bm.num_free_blocks
        if data.draw(st.booleans(), label="append_slots"):
            # the batched decode append: the snapshot `append` gives (and, without a window, whose releases
            # come before a batch's allocations, appends one sequence at a time), with each sequence's new
            # slot and block table
            (bm, ops, slots, tables), (reference, reference_ops) = self.bm.append_slots(appends), self.bm.append(appends)
            assert self.fingerprint(bm) == self.fingerprint(reference) and ops == reference_ops
            assert bm.num_filled_slots == reference.num_filled_slots
            if not self.windowed:
                one_by_one, pairs = self.bm, ()
                for item in appends:
                    one_by_one, one_ops = one_by_one.append([item])
                    pairs += one_ops.copy_pairs
                assert self.fingerprint(bm) == self.fingerprint(one_by_one) and ops.copy_pairs == pairs
            n = {s: bm.num_tokens(s) for s in seq_ids}
            assert slots == [bm.slot_mapping(s, n[s] - 1, n[s])[0] for s in seq_ids]
            assert tables == [bm.block_table(s) for s in seq_ids]
            self.bm = bm
        else:
            self.bm, ops = self.bm.append(appends)
        assert free_before - self.bm.num_free_blocks <= len(seq_ids)
        if self.windowed:  # right after an append: the window's bound
            assert all(len(self.live(s)) <= self.bm.max_window_blocks for s in seq_ids)
        else:
            assert all(self.bm.num_null_blocks(s) == 0 for s in seq_ids)
        assert not ops.swap_in and not ops.swap_out
        self.move_blocks(ops.copy_pairs, self.device, self.device)
        for seq_id, token_id in appends:
            self.tokens[seq_id].append(token_id)
            self.write(seq_id, len(self.tokens[seq_id]) - 1)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def finish(self, data):  # one sample or beam candidate ends
        seq_id = data.draw(st.sampled_from(self.running()))
        self.bm = self.bm.free([seq_id])
        del self.tokens[seq_id]
        for g, seqs in list(self.groups.items()):
            if seq_id in seqs:
                seqs.remove(seq_id)
                if not seqs:
                    del self.groups[g]

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort(self, data):  # a whole request, running or swapped out
        g = data.draw(st.sampled_from(sorted(self.groups)))
        self.bm = self.bm.free(self.groups[g])
        for seq_id in self.groups.pop(g):
            del self.tokens[seq_id]

    @precondition(lambda self: self.group_ids(swapped=False))
    @rule(data=st.data())
    def swap_out(self, data):
        seqs = self.groups[data.draw(st.sampled_from(self.group_ids(swapped=False)))]
        if not self.bm.can_swap_out(seqs):
            with pytest.raises(OutOfBlocksError):
                self.bm.swap_out(seqs)
            return
        tables = {s: self.live(s) for s in seqs}
        nulls = {s: self.bm.num_null_blocks(s) for s in seqs}
        self.bm, ops = self.bm.swap_out(seqs)
        assert len(ops.swap_out) == len({b for t in tables.values() for b in t})  # moved once
        mapping = dict(ops.swap_out)
        for s in seqs:  # null entries move nothing and stay null
            assert self.bm.block_table(s) == (NULL_BLOCK_ID,) * nulls[s] + tuple(mapping[b] for b in tables[s])
        self.move_blocks(ops.swap_out, self.device, self.cpu)

    @precondition(lambda self: self.group_ids(swapped=True))
    @rule(data=st.data())
    def swap_in(self, data):
        seqs = self.groups[data.draw(st.sampled_from(self.group_ids(swapped=True)))]
        if not self.bm.can_swap_in(seqs):
            with pytest.raises(OutOfBlocksError):
                self.bm.swap_in(seqs)
            return
        nulls = {s: self.bm.num_null_blocks(s) for s in seqs}
        self.bm, ops = self.bm.swap_in(seqs)
        assert len(ops.swap_in) == len({b for s in seqs for b in self.live(s)})
        assert nulls == {s: self.bm.num_null_blocks(s) for s in seqs}
        self.move_blocks(ops.swap_in, self.cpu, self.device)

    # ---- checks after every operation ----------------------------------------------------------
    @invariant()
    def invariants_hold(self):
        self.bm.check_invariants()
        old_bm, old_fingerprint = self.old  # the snapshot before the last operation is unchanged
        assert self.fingerprint(old_bm) == old_fingerprint
        self.old = (self.bm, self.fingerprint(self.bm))
        stats = self.bm.stats()
        assert stats["num_free_blocks"] + stats["num_used_blocks"] == self.bm.num_blocks - 1

    @invariant()
    def kept_utilization_is_a_walk(self):
        """The counter the block manager keeps (`num_filled_slots`) against a walk of every block table."""
        walked = sum(filled_slots(self.bm).values())
        assert self.bm.num_filled_slots == walked
        used = self.bm.num_blocks - 1 - self.bm.num_free_blocks
        assert kv_utilization(self.bm) == (walked / (used * self.bm.block_size) if used else None)

    @invariant()
    def every_sequence_reads_its_own_prefix(self):
        bs = self.bm.block_size
        owner = {}  # device slot -> prefix, across live running sequences
        window = self.bm.sliding_window
        for seq_id, tokens in self.tokens.items():
            assert self.bm.num_tokens(seq_id) == len(tokens)
            table = self.bm.block_table(seq_id)
            memory = self.cpu if self.bm.is_swapped(seq_id) else self.device
            first_live = self.bm.num_null_blocks(seq_id) * bs
            # every position the last token's query (or a later one) reads is live
            assert first_live == 0 or window is not None and first_live <= len(tokens) - window
            for p in range(first_live, len(tokens)):
                slot = table[p // bs] * bs + p % bs
                assert memory.get(slot) == tuple(tokens[:p + 1]), f"seq {seq_id} position {p}"
                if not self.bm.is_swapped(seq_id):
                    # slots collide only where two sequences hold the same token prefix
                    assert owner.setdefault(slot, tuple(tokens[:p + 1])) == tuple(tokens[:p + 1])

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        self.bm = self.bm.free(list(self.tokens))
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks - 1
        assert self.bm.num_free_cpu_blocks == self.bm.num_cpu_blocks
        assert self.bm.stats()["num_used_blocks"] == 0 and self.bm.seq_ids == ()


class PrefixCachingMachine(BlockManagerMachine):
    prefix_caching = True


class SlidingWindowMachine(BlockManagerMachine):
    windowed = True


class SlidingWindowPrefixCachingMachine(BlockManagerMachine):
    prefix_caching = True
    windowed = True


_settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = _settings
TestBlockManagerPrefixCaching = PrefixCachingMachine.TestCase
TestBlockManagerPrefixCaching.settings = _settings
TestBlockManagerSlidingWindow = SlidingWindowMachine.TestCase
TestBlockManagerSlidingWindow.settings = _settings
TestBlockManagerSlidingWindowPrefixCaching = SlidingWindowPrefixCachingMachine.TestCase
TestBlockManagerSlidingWindowPrefixCaching.settings = _settings
