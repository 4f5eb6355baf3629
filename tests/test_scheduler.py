"""The scheduler alone under the paper's prefill-first policy, without the model: a fake step stands in for the engine (every scheduled
sequence gets token 7; a sequence stops at its max_tokens), and the KV cache manager's invariants
are checked after every step. Pinned: preemption order (the latest arrival first, whole groups),
the watermark, swapped groups resuming before new admissions, the token and sequence budgets, and
a group that cannot grow even alone finishing with "length"; in both preemption modes."""

from __future__ import annotations

import itertools

import pytest

from jpaged.core.block_manager import BlockManager
from jpaged.core.sampling_params import SamplingParams
from jpaged.core.scheduler import Scheduler, SchedulerConfig
from jpaged.core.sequence import GroupStatus, Sequence, SequenceGroup

MODES = ("recompute", "swap")
TOKEN = 7


class Harness:
    """A scheduler over a small paged pool, fed groups, stepped by `step()` as the engine would."""

    def __init__(self, num_blocks: int, block_size: int = 4, mode: str = "recompute", prefix_caching: bool = False,
                 **config):
        config.setdefault("watermark", 0.0)
        config.setdefault("enable_chunked_prefill", False)  # these pins are the paper's policy's (ragged: test_chunked_prefill.py)
        bm = BlockManager.create(num_blocks, block_size, num_cpu_blocks=num_blocks if mode == "swap" else 0,
                                 enable_prefix_caching=prefix_caching)
        self.scheduler = Scheduler(bm, SchedulerConfig(preemption_mode=mode, **config))
        self.seq_ids = itertools.count()

    def add(self, name: str, prompt_len, max_tokens: int = 100, n: int = 1, arrival: float = 0.0,
            first_token: int = 1):
        """`prompt_len`: a length (the prompt first_token, first_token + 1, ...) or the prompt's token ids."""
        prompt = (tuple(range(first_token, first_token + prompt_len)) if isinstance(prompt_len, int)
                  else tuple(prompt_len))
        seqs = [Sequence(next(self.seq_ids), i, prompt) for i in range(n)]
        group = SequenceGroup(name, None, prompt, SamplingParams(n=n, max_tokens=max_tokens), 0, seqs,
                              arrival_time=arrival)
        self.scheduler.add(group)
        return group

    def step(self):
        out = self.scheduler.schedule()
        for seqs in out.row_seqs:
            for seq in seqs:
                seq.append_token(TOKEN, 0.0)
                if len(seq.output_token_ids) >= seq_group(out, seq).params.max_tokens:
                    self.scheduler.finish_seq(seq, "length")
        for group in out.groups:
            if not group.live_seqs:
                self.scheduler.finish_group(group)
        self.scheduler.block_manager.check_invariants()
        return out

    def holds(self, group) -> bool:
        return any(self.scheduler.block_manager.has(s.seq_id) for s in group.seqs)


def seq_group(out, seq):
    return next(g for g in out.groups if any(s is seq for s in g.seqs))


def names(groups) -> list[str]:
    return [g.request_id for g in groups]


@pytest.mark.parametrize("mode", MODES)
def test_the_latest_arrival_is_preempted_first_as_a_whole_group(mode):
    h = Harness(num_blocks=7, mode=mode)  # 6 usable blocks of 4 slots
    a, b, c = h.add("a", 4, arrival=0.0), h.add("b", 4, arrival=1.0), h.add("c", 4, n=2, arrival=2.0)
    out = h.step()  # one prefill: a, b and c's shared prompt block (c's two samples fork it)
    assert not out.is_decode and names(out.groups) == ["a", "b", "c"] and len(out.rows) == 3
    assert h.scheduler.block_manager.num_free_blocks == 3
    # every sequence now needs a new block for its 5th token: a 1, b 1, c 2 (its two samples) > 3 free
    out = h.step()
    assert out.is_decode and names(out.groups) == ["a", "b"] and names(out.preempted) == ["c"]
    assert all(len(s.output_token_ids) == 1 for s in c.seqs)  # neither of c's samples advanced
    if mode == "swap":
        assert c.status is GroupStatus.SWAPPED and names(h.scheduler.swapped) == ["c"]
        assert all(h.scheduler.block_manager.is_swapped(s.seq_id) for s in c.seqs)
        assert len(out.ops.swap_out) == 1  # the one block both samples share moves once
    else:
        assert c.status is GroupStatus.WAITING and names(h.scheduler.waiting) == ["c"] and not h.holds(c)
    assert c.num_preemptions == 1 and h.scheduler.num_preemptions == 1
    assert a.status is b.status is GroupStatus.RUNNING


@pytest.mark.parametrize("mode", MODES)
def test_preemption_takes_the_latest_arrivals_while_the_earliest_grow(mode):
    h = Harness(num_blocks=5, mode=mode)  # 4 usable blocks
    w, x, y, z = (h.add(name, 4, arrival=t) for t, name in enumerate("wxyz"))
    h.step()  # all four prompts: one block each, none free
    out = h.step()  # each needs one more block: w grows into z's, x into y's
    assert names(out.groups) == ["w", "x"] and names(out.preempted) == ["z", "y"]
    # recompute: the preempted go back to the front of the waiting queue, earliest first
    queue = h.scheduler.swapped if mode == "swap" else h.scheduler.waiting
    assert names(queue) == (["z", "y"] if mode == "swap" else ["y", "z"])
    assert w.status is x.status is GroupStatus.RUNNING


def test_recompute_prefills_prompt_and_generated_tokens_again():
    h = Harness(num_blocks=7, mode="recompute")
    h.add("a", 4, arrival=0.0), h.add("b", 4, arrival=1.0)
    c = h.add("c", 4, n=2, arrival=2.0)
    h.step(), h.step()  # c preempted after its first token
    assert names(h.scheduler.waiting) == ["c"]
    h.scheduler.finish_group(h.scheduler.running[0])  # a leaves: room for c again
    out = h.step()
    assert not out.is_decode and names(out.groups) == ["c"]
    # not fresh any more: each sample is its own row of prompt + its generated token, no sharing
    assert [len(r.token_ids) for r in out.rows] == [5, 5] and [len(s) for s in out.row_seqs] == [1, 1]
    assert out.rows[0].start_position == 0 and c.status is GroupStatus.RUNNING


def test_swapped_groups_resume_before_any_new_admission():
    h = Harness(num_blocks=7, mode="swap")
    a, b = h.add("a", 4, max_tokens=3, arrival=0.0), h.add("b", 4, arrival=1.0)
    c = h.add("c", 4, n=2, arrival=2.0)
    h.step(), h.step()
    assert names(h.scheduler.swapped) == ["c"]
    d = h.add("d", 1, arrival=3.0)  # fits at once, but c waits on the CPU
    out = h.step()  # a finishes (3 tokens) and frees 2 blocks; no prefill while a group is swapped out
    assert out.is_decode and d.status is GroupStatus.WAITING and a.status is GroupStatus.FINISHED
    while h.scheduler.swapped:
        out = h.step()
        assert out.is_decode and d.status is GroupStatus.WAITING
    assert c.status is GroupStatus.RUNNING and len(out.ops.swap_in) == 1 and names(out.groups) == ["b", "c"]
    h.scheduler.finish_group(b)
    out = h.step()  # nothing swapped: d is admitted
    assert not out.is_decode and names(out.groups) == ["d"]


@pytest.mark.parametrize("mode", MODES)
def test_the_watermark_holds_blocks_back_unless_nothing_runs(mode):
    h = Harness(num_blocks=11, mode=mode, watermark=0.2)  # 10 usable blocks: keep 2 free when others run
    a = h.add("a", 4 * 10)  # all 10 blocks: admitted, since nothing else runs
    out = h.step()
    assert names(out.groups) == ["a"] and h.scheduler.block_manager.num_free_blocks == 0
    h.scheduler.finish_group(a)
    h.add("b", 4 * 7), h.add("c", 4 * 2), h.add("d", 4 * 1)
    out = h.step()  # b takes 7 (nothing ran before it); c would leave 1 < 2 free; d is behind c (FCFS)
    assert names(out.groups) == ["b"] and names(h.scheduler.waiting) == ["c", "d"]


@pytest.mark.parametrize("mode", MODES)
def test_the_token_and_sequence_budgets_of_a_prefill_step(mode):
    h = Harness(num_blocks=65, mode=mode, max_num_batched_tokens=12, max_num_seqs=4)
    h.add("a", 8), h.add("b", 8), h.add("c", 3), h.add("d", 3, n=2), h.add("e", 2)
    out = h.step()  # a: 8 tokens; b would make 16 > 12
    assert names(out.groups) == ["a"] and out.num_tokens == 8
    out = h.step()  # prefill first while groups wait: b 8 + c 3 = 11; d's 3 more would make 14
    assert names(out.groups) == ["b", "c"] and out.num_tokens == 11
    out = h.step()  # d's 2 samples would make 5 running sequences > 4
    assert out.is_decode and names(out.groups) == ["a", "b", "c"] and names(h.scheduler.waiting) == ["d", "e"]
    lone = Harness(num_blocks=65, mode=mode, max_num_batched_tokens=12)
    lone.add("big", 30)
    assert names(lone.step().groups) == ["big"]  # the first group of a step always fits the budget


@pytest.mark.parametrize("mode", MODES)
def test_a_group_that_cannot_grow_even_alone_finishes_with_length(mode):
    h = Harness(num_blocks=3, mode=mode)  # 2 usable blocks of 4: 8 tokens at most
    g = h.add("g", 8)
    h.step()  # the prompt fills both blocks; the 9th token needs a third
    out = h.step()
    assert names(out.finished) == ["g"] and not out.rows and not out.preempted
    assert g.status is GroupStatus.FINISHED and [s.finish_reason for s in g.seqs] == ["length"]
    assert h.scheduler.block_manager.num_free_blocks == 2 and not h.scheduler.has_unfinished()


def test_swap_needs_a_manager_that_swaps():
    class NoSwap:  # a KV cache manager without the swapping capability
        num_blocks, block_size = 9, 4

    with pytest.raises(ValueError, match="no CPU swap space: use preemption_mode='recompute'"):
        Scheduler(NoSwap(), SchedulerConfig(preemption_mode="swap"))
    for bad in (dict(watermark=1.0), dict(max_num_seqs=0), dict(preemption_mode="drop")):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


def test_a_recomputed_group_that_can_never_come_back_ends_with_length():
    h = Harness(num_blocks=9, mode="recompute")  # 8 usable blocks of 4
    a = h.add("a", 6, arrival=0.0)  # 2 blocks
    g = h.add("g", 7, n=4, max_tokens=20, arrival=1.0)  # one shared 2-block prompt, four samples
    h.step()
    for _ in range(2):  # each sample writes its own copy of the last block, a grows: g is preempted
        out = h.step()
    assert names(out.preempted) == ["g"] and names(h.scheduler.waiting) == ["g"]
    h.scheduler.finish_group(a)  # the pool is empty; g's four samples re-prefill unshared: 4 x 3 > 8 blocks
    out = h.step()
    assert names(out.finished) == ["g"] and not out.rows
    assert g.status is GroupStatus.FINISHED and {s.finish_reason for s in g.seqs} == {"length"}
    assert all(len(s.output_token_ids) == 2 for s in g.seqs)  # what it generated is kept
    assert not h.scheduler.has_unfinished() and h.scheduler.block_manager.num_free_blocks == 8



class _WithoutShortcuts:
    """A KV cache manager (a `BlockManager` inside) without the optional members the decode step's fast
    path reads (`append_slots`, `max_blocks_per_append`, `num_filled_slots`): every operation's result is
    wrapped again, so the scheduler takes the slow way at every step."""

    HIDDEN = ("append_slots", "max_blocks_per_append", "num_filled_slots")

    def __init__(self, bm):
        self.bm = bm

    def __getattr__(self, name):
        if name in self.HIDDEN:
            raise AttributeError(name)
        value = getattr(self.bm, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            out = value(*args, **kwargs)
            if isinstance(out, BlockManager):
                return _WithoutShortcuts(out)
            if isinstance(out, tuple) and out and isinstance(out[0], BlockManager):
                return (_WithoutShortcuts(out[0]),) + out[1:]
            return out
        return call


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunked", [False, True])
def test_the_batched_decode_path_schedules_as_the_per_sequence_one(mode, chunked):
    """The decode step's batched appends (`kv_cache_manager.append_slots`, and the `appends_fit` shortcut)
    give the rows, block operations and preemptions that the per-sequence way gives (`append`, then a slot
    and table lookup per sequence, and a block count per group), step by step through admissions,
    copy-on-write of n samples, preemption and finishing, in a pool too small for everything."""
    def run(wrap):
        h = Harness(14, mode=mode, enable_chunked_prefill=chunked, max_num_batched_tokens=16)
        if wrap:
            h.scheduler.block_manager = _WithoutShortcuts(h.scheduler.block_manager)
        for i, (length, max_tokens, n) in enumerate([(5, 9, 1), (3, 12, 2), (7, 6, 1), (2, 14, 1), (6, 8, 2)]):
            h.add(f"g{i}", length, max_tokens=max_tokens, n=n, arrival=float(i), first_token=10 * i + 1)
        trace = []
        while h.scheduler.has_unfinished():
            out = h.step()
            trace.append((out.is_decode, [tuple(r) for r in out.rows], [[s.seq_id for s in seqs] for seqs in out.row_seqs],
                          out.ops, names(out.preempted), names(out.finished)))
            assert len(trace) < 500
        return trace

    fast, slow = run(False), run(True)
    assert fast == slow
    assert any(ops.copy_pairs for _, _, _, ops, _, _ in fast), "meant to copy on write"
    assert any(preempted for *_, preempted, _ in fast), "meant to preempt"
    assert sum(is_decode for is_decode, *_ in fast) > 10
