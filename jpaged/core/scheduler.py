"""The scheduler: FCFS, iteration-level batching, chunked prefill, preemption by recompute or swap
(no JAX).

Two policies (`SchedulerConfig.enable_chunked_prefill`):
- *Ragged* (the default, as in vLLM v1, SGLang and tpu-inference): every step is one batch under a
  token budget (`max_num_batched_tokens`). First a decode token for every live sequence of every
  running group whose prompt is in the cache, then chunks of the prompts being prefilled (running
  groups first, in arrival order, then newly admitted ones): a prompt longer than what the budget
  leaves is computed over several steps, `long_prefill_token_threshold` capping one prompt's share of
  a step. A group samples only once its whole prompt (prompt + generated tokens, after a recompute)
  is in the cache: the step that computes the last token of each of its prefilling sequences (all of
  them in one step, so that n samples and beams stay in step) samples from those rows. A long
  prompt admitted while others decode thus delays each of their tokens by one chunk, not by the
  whole prompt.
- *Prefill first* (the paper's, `enable_chunked_prefill=False`): every step is either a *prefill*
  step (newly admitted or resumed-by-recompute groups: all their uncached tokens; the first group
  of a step always admitted, whatever the budget) or a *decode* step (one token for every live
  sequence of every running group). As in vLLM v0, prefill goes first whenever a waiting group can
  be admitted and nothing is swapped out.

Blocks. A group is admitted when its whole prompt's blocks fit (less the prefix-cache hit), with
the watermark, and holds them from then on; a chunk only decides which of them the step writes.
With prefix caching a block enters the cache when the chunk that writes it is scheduled
(`allocate(num_computed=...)`, `cache_computed`): no request may map a block whose K/V is not
written, and a chunk boundary never splits the hash chain (hashes are over token ids, computed at
admission).

When the KV blocks run out during decode, the latest-arrived running group is preempted, whole:
by recompute (its blocks are freed; it goes back to the front of the waiting queue and
re-prefills prompt + generated tokens) or by swap (its blocks move to the CPU pool; it comes back
before any new admission). A group preempted while its prompt is being prefilled is always
recomputed (it has nothing worth swapping; its computed full blocks stay in the prefix cache).
Liveness: a group that cannot grow even when running alone, or that can no longer be re-admitted
or swapped in even into an empty pool, is finished with `finish_reason="length"` (keeping what it
generated) rather than waiting forever; a request too large ever to start is refused at admission
by the engine.

The scheduler owns the KV cache manager snapshot (`jpaged.core.kv_cache_manager`: replaced, never
mutated), the queues, and the lifecycle of every group it holds: status, timestamps, prefill
progress (`SequenceGroup.num_computed_tokens`), which sequences a group holds (`fork_seq`,
`set_beams`) and each sequence's `finish_reason` (`finish_seq`, `abort`, `fail`, and "length" for a
group that cannot grow alone). It hands the device side `Row`s (numpy-friendly lists) and the
`DeviceOps` a step implies.

Data parallel (a manager with `num_partitions` > 1, `jpaged.core.partitioned`): each new group is
placed on the partition (data rank) left with the most free blocks once it is allocated there (a
prefix that rank's running sequences hold is shared, not taken) and keeps it for life, preemption
included (`group.rank`); blocks are counted per partition, and a group short of blocks preempts
the latest arrival of its own partition. With one partition every rank is 0 and nothing changes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import operator
import time
from typing import NamedTuple, Optional, Sequence as Seq

from jpaged.core.kv_cache_manager import (DeviceOps, KVCacheManager, SwappingKVCacheManager, append_slots,
                                          appends_fit, cache_computed)
from jpaged.core.proposer import DraftRequest, Proposer
from jpaged.core.sequence import GroupStatus, Sequence, SequenceGroup

logger = logging.getLogger("jpaged")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """A step's budgets, the policy, how to preempt, and the fraction of the pool an admission leaves
    free while other groups run (the module docstring).

    max_num_seqs: sequences running at once. max_num_batched_tokens: tokens a step computes. Ragged
      policy: decode tokens first (they always run), then prompt chunks in what is left; the first
      prefilling group of a step makes progress even when nothing is left (at least one token, or
      its sequences' last tokens), so a step computes at most max_num_batched_tokens + max_num_seqs.
      Prefill first: the prompt tokens of a prefill step, the first group always admitted whole.
    enable_chunked_prefill: the ragged policy (True) or the paper's prefill-first one (False).
    long_prefill_token_threshold: the most tokens of one prompt a ragged step computes (0: no cap
      but the budget), so that several long prompts progress together.
    num_speculative_tokens: draft tokens a decoding sequence may verify in a step (speculative
      decoding; 0: none), as the scheduler's proposer drafts them, within the blocks left once every
      sequence has its next token's and the token budget (drafts never preempt).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    preemption_mode: str = "recompute"  # or "swap"
    watermark: float = 0.01  # fraction of blocks kept free at admission, against immediate preemption
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    num_speculative_tokens: int = 0

    def __post_init__(self):
        if not (isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1):
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', not {self.preemption_mode!r}")
        if not (type(self.max_num_seqs) is int and self.max_num_seqs >= 1):
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not (type(self.max_num_batched_tokens) is int and self.max_num_batched_tokens >= 1):
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}")
        if not (type(self.num_speculative_tokens) is int and self.num_speculative_tokens >= 0):
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {self.num_speculative_tokens!r}")
        if not (type(self.long_prefill_token_threshold) is int and self.long_prefill_token_threshold >= 0):
            raise ValueError("long_prefill_token_threshold must be an integer >= 0 (0: no cap), got "
                             f"{self.long_prefill_token_threshold!r}")


class Row(NamedTuple):
    """One sequence's part of a step: compute `token_ids` at positions `start_position`.. into `slots`
    (a tuple: a decode step builds one a sequence)."""

    token_ids: Seq[int]
    start_position: int
    slots: Seq[int]
    block_table: Seq[int]


_ARRIVAL_TIME = operator.attrgetter("arrival_time")

# a `Row` without its Python-level __new__ (a decode step builds one a sequence)
_row = functools.partial(tuple.__new__, Row)


@dataclasses.dataclass
class SchedulerOutput:
    """What one step runs. `row_seqs[i]` are the sequences whose next token is drawn from row i's logits
    (several for a fresh group of n samples, which shares one prompt prefill; none for a chunk that
    ends before its prompt does). `is_decode`: every row computes one token (the decode step kind)."""

    is_decode: bool
    rows: list[Row]
    row_seqs: list[list[Sequence]]
    groups: list[SequenceGroup]
    ops: DeviceOps
    preempted: list[SequenceGroup]
    finished: list[SequenceGroup]  # groups the scheduler ended (could not grow alone)
    # speculative decoding: seq_id -> (the row of its last token, its draft tokens); draft j sits in row
    # `row + 1 + j` (a row of one token whose logits verify it; `row_seqs` empty), at the lookahead slot
    # after the sequence's tokens. A sequence's new tokens: `commit_drafts` once verified. Filled by
    # `Scheduler.propose_drafts` from `lookahead` (seq_id -> lookahead slots granted, appended already),
    # once the step's block operations are applied.
    drafts: dict = dataclasses.field(default_factory=dict)
    lookahead: dict = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.rows) if self.is_decode else sum(len(r.token_ids) for r in self.rows)


class Scheduler:
    """See the module docstring. Speculative decoding (`num_speculative_tokens` > 0): `proposer`
    (`jpaged.core.proposer`; given here or set later, before the first step) drafts for the sequences
    granted lookahead slots, none past `max_model_len` (the context) or past what its request may still
    generate; the engine asks for the drafts (`propose_drafts`) once the step's block operations are
    applied."""

    def __init__(self, block_manager: KVCacheManager, config: SchedulerConfig, *,
                 proposer: Optional[Proposer] = None, max_model_len: Optional[int] = None):
        if config.preemption_mode == "swap" and not isinstance(block_manager, SwappingKVCacheManager):
            raise ValueError(f"{type(block_manager).__name__} has no CPU swap space: use "
                             "preemption_mode='recompute'")
        self.block_manager = block_manager
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    # ---- queues ------------------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str) -> Optional[SequenceGroup]:
        """Removes the request from whichever queue holds it, returns all its blocks and finishes
        its live sequences with "abort"."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in list(queue):
                if group.request_id == request_id:
                    queue.remove(group)
                    self._release(group)
                    for seq in group.live_seqs:
                        seq.finish_reason = "abort"
                    self._finished(group)
                    return group
        return None

    def fail(self, group: SequenceGroup, error: str) -> None:
        """Ends a group a failed step touched: its blocks come back, its live sequences finish with
        "error", and `group.error` says why."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        self._release(group)
        for seq in group.live_seqs:
            seq.finish_reason = "error"
        group.error = error
        self._finished(group)

    def lose_device_blocks(self, error: str) -> list[SequenceGroup]:
        """The device pool's contents are gone: every running group fails (its K/V was there) and the
        KV cache manager forgets what its free blocks held. Waiting groups hold no block; swapped ones
        hold CPU blocks, which are intact. Returns the failed groups."""
        failed = list(self.running)
        for group in failed:
            self.fail(group, error)
        self.block_manager = self.block_manager.forget_cached()
        return failed

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        """Ends one sequence of a running group ("stop" or "length") and frees its blocks."""
        seq.finish_reason = reason
        self._free_seq(seq)

    def fork_seq(self, parent: Sequence, child_seq_id: int) -> Sequence:
        """A new sequence sharing the parent's history and blocks (not yet a member of a group:
        see `set_beams`)."""
        child = parent.fork(child_seq_id)
        self.block_manager = self.block_manager.fork(parent.seq_id, child.seq_id)
        return child

    def set_beams(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        """A beam group's running sequences become `seqs` (forked children included, best first);
        the sequences that leave it are freed."""
        kept = {seq.seq_id for seq in seqs}
        for seq in group.seqs:
            if seq.seq_id not in kept:
                self._free_seq(seq)
        group.seqs = list(seqs)

    def finish_group(self, group: SequenceGroup) -> None:
        """Called by the engine when a running group has no live sequence left."""
        self._release(group)
        self.running.remove(group)
        self._finished(group)

    def _finished(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.FINISHED
        group.finished_time = time.monotonic()

    def _free_seq(self, seq: Sequence) -> None:
        if self.block_manager.has(seq.seq_id):
            self.block_manager = self.block_manager.free([seq.seq_id])

    def _release(self, group: SequenceGroup) -> None:
        held = [s.seq_id for s in group.seqs if self.block_manager.has(s.seq_id)]
        if held:
            self.block_manager = self.block_manager.free(held)

    # ---- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.config.enable_chunked_prefill:
            output = self._schedule_ragged()
        else:
            output = self._schedule_prefill() if not self.swapped else None
            if output is None or not output.rows:
                output = self._schedule_decode()
        if not (output.rows or output.finished or self.running) and (self.waiting or self.swapped):
            # nothing runs and the pool is as free as it gets: the group at the head can never run again
            # (a recomputed group of n samples re-prefills them unshared; a swapped one may need one more
            # block than the pool has). Ending it keeps the engine live; it keeps what it generated.
            group = min(self.swapped, key=lambda g: g.arrival_time) if self.swapped else self.waiting[0]
            logger.warning("request %s can no longer fit in the KV pool (%d blocks): finishing it with "
                           "finish_reason='length'", group.request_id, self.block_manager.num_blocks)
            (self.swapped if group in self.swapped else self.waiting).remove(group)
            self._release(group)
            for seq in group.live_seqs:
                seq.finish_reason = "length"
            self._finished(group)
            output.finished.append(group)
        return output

    def can_decode_all(self) -> bool:
        """Whether the next decode step grows every running group by one token per live sequence with
        no preemption (one partition; a group whose prompt is being prefilled counts as not)."""
        if self.num_partitions != 1 or any(g.num_computed_tokens for g in self.running):
            return False
        return self._appends_fit([self._free_in(0)]) or self._demand(self.running) <= self._free_in(0)

    def _appends_fit(self, free: list[int]) -> bool:
        """A decode step's shortcut, without a block count per group: one partition whose KV cache
        manager bounds an append's blocks per sequence (`kv_cache_manager.appends_fit`), with `free`
        blocks for an append to every live running sequence, nothing swapped and no drafts (the readers
        of what is left free afterwards)."""
        return (self.num_partitions == 1 and not self.swapped
                and not (self.config.num_speculative_tokens and self.proposer)
                and appends_fit(self.block_manager, self._num_live_running(), free[0]))

    def _num_live_running(self) -> int:
        return sum(len(g.live_seqs) for g in self.running)

    # ---- data-parallel partitions (one partition: rank 0, the whole pool) ----------------------

    @property
    def num_partitions(self) -> int:
        return getattr(self.block_manager, "num_partitions", 1)

    def _rank(self, group: SequenceGroup) -> int:
        return group.rank or 0

    def _free_in(self, rank: int, bm: Optional[KVCacheManager] = None) -> int:
        bm = bm or self.block_manager
        return bm.num_free_blocks_in(rank) if self.num_partitions > 1 else bm.num_free_blocks

    def _on_rank(self, rank: int) -> dict:
        """The keyword that puts an allocation on a partition (none with one partition)."""
        return {"rank": rank} if self.num_partitions > 1 else {}

    def _place(self, group: SequenceGroup) -> int:
        """A group's partition: the one it was placed on, else the one left with the most free
        blocks once its prompt is allocated there, where blocks of its prefix that running
        sequences of that rank hold are shared, not taken (prefix caching); ties go to the rank
        caching the longer prefix, then to the lower rank. Without prefix caching: the least loaded."""
        if group.rank is None and self.num_partitions > 1:
            prompt = group.live_seqs[0].token_ids

            def after(rank):
                taken, cached_tokens = self.block_manager.allocation_cost(prompt, rank=rank)
                return self._free_in(rank) - taken, cached_tokens, -rank

            group.rank = max(range(self.num_partitions), key=after)
        return self._rank(group)

    def _schedule_prefill(self) -> SchedulerOutput:
        rows, row_seqs, groups = [], [], []
        num_tokens, num_seqs = 0, self._num_live_running()
        while self.waiting:
            group = self.waiting[0]
            seqs, to_prefill = group.live_seqs, self._to_prefill(group)
            fresh = len(to_prefill) < len(seqs)
            if num_seqs + len(seqs) > self.config.max_num_seqs:
                break
            # prefill rows are packed (no per-row padding): the budget counts the tokens computed
            if groups and num_tokens + sum(s.num_tokens for s in to_prefill) > self.config.max_num_batched_tokens:
                break
            rank = self._fitting_rank(group, to_prefill)
            if rank is None:
                break
            self.waiting.popleft()
            cached = self._admit(group, to_prefill, rank)
            if fresh:
                self._fork_samples(group)
            for seq, num_cached in zip(to_prefill, cached):
                rows.append((seq, num_cached))
                row_seqs.append(seqs if fresh else [seq])
            groups.append(group)
            num_tokens += sum(s.num_tokens - c for s, c in zip(to_prefill, cached))
            num_seqs += len(seqs)
        built = [self._row(seq, start, seq.num_tokens) for seq, start in rows]
        return SchedulerOutput(False, built, row_seqs, groups, DeviceOps(), [], [])

    @staticmethod
    def _to_prefill(group: SequenceGroup) -> list[Sequence]:
        """The sequences whose tokens admitting a waiting group computes: a fresh group of n samples
        shares one prompt prefill (its first sequence's), a recomputed group re-prefills every live one."""
        seqs = group.live_seqs
        return seqs[:1] if all(not s.output_token_ids for s in seqs) else seqs

    def _fitting_rank(self, group: SequenceGroup, to_prefill: list[Sequence]) -> Optional[int]:
        """The partition a waiting group is placed on, if the blocks of `to_prefill` fit there now with
        the watermark kept free (unless nothing else runs on it); else None."""
        rank = self._place(group)
        idle = not any(self._rank(g) == rank for g in self.running)
        partition_blocks = self.block_manager.num_blocks // self.num_partitions
        watermark = 0 if idle else math.ceil(self.config.watermark * (partition_blocks - 1))
        fits = self.block_manager.can_allocate([s.token_ids for s in to_prefill], reserve=watermark,
                                               **self._on_rank(rank))
        return rank if fits else None

    def _admit(self, group: SequenceGroup, to_prefill: list[Sequence], rank: int, *,
               chunked: bool = False) -> list[int]:
        """Pops nothing: allocates the blocks of `to_prefill` (the group's sequences whose tokens are
        computed) on `rank`, counts the prompt tokens and the prefix-cache hits, and starts the group.
        `chunked`: the prompts are prefilled in chunks (none of their blocks past the hit enters the
        prefix cache before its chunk is scheduled; progress in `group.num_computed_tokens`). Returns
        each sequence's tokens found in the prefix cache."""
        cached = []
        for seq in to_prefill:
            self.block_manager, num_cached = self.block_manager.allocate(
                seq.seq_id, seq.token_ids, **self._on_rank(rank), **({"num_computed": 0} if chunked else {}))
            cached.append(num_cached)
        group.num_cached_tokens = cached[0]
        if chunked:
            group.num_computed_tokens = {seq.seq_id: c for seq, c in zip(to_prefill, cached)}
        self.num_prompt_tokens += sum(s.num_tokens for s in to_prefill)
        self.num_cached_prompt_tokens += sum(cached)
        self._start(group)
        return cached

    def _fork_samples(self, group: SequenceGroup) -> None:
        """A fresh group of n samples, its prompt computed (or being so this step) by its first
        sequence: the others share its blocks from now on."""
        seqs = group.live_seqs
        for seq in seqs[1:]:
            self.block_manager = self.block_manager.fork(seqs[0].seq_id, seq.seq_id)

    # ---- the ragged step ----------------------------------------------------------------------

    def _schedule_ragged(self) -> SchedulerOutput:
        """One batch under the token budget: decode rows, then chunks of running prompts, then
        newly admitted groups' chunks (the module docstring)."""
        out = self._schedule_decode()
        budget = self.config.max_num_batched_tokens - len(out.rows) - sum(out.lookahead.values())  # drafts' rows
        head = True  # the step's first prefilling group always progresses
        for group in [g for g in out.groups if g.num_computed_tokens]:  # in arrival order
            budget -= self._schedule_chunk(group, budget, head, out)
            head = False
        if out.preempted or self.swapped:
            return out  # swapped groups come back before any admission; no admission right after preempting
        num_seqs = self._num_live_running() if self.waiting else 0
        while self.waiting and (budget > 0 or head):
            group = self.waiting[0]
            seqs, to_prefill = group.live_seqs, self._to_prefill(group)
            if num_seqs + len(seqs) > self.config.max_num_seqs:
                break
            rank = self._fitting_rank(group, to_prefill)
            if rank is None:
                break
            self.waiting.popleft()
            self._admit(group, to_prefill, rank, chunked=True)
            out.groups.append(group)
            budget -= self._schedule_chunk(group, budget, head, out)
            head = False
            num_seqs += len(seqs)
        return out

    def _schedule_chunk(self, group: SequenceGroup, budget: int, head: bool, out: SchedulerOutput) -> int:
        """Adds to `out` the rows of a prefilling group's next chunk within `budget` tokens (and the
        per-prompt cap) and returns the tokens they compute. When every prefilling sequence's rest
        fits, all of them finish in this step and their rows sample; otherwise each computes at most
        all its tokens but its last. `head`: the step's first prefilling group, which progresses even
        on an empty budget (one token, or its sequences' last tokens)."""
        progress = group.num_computed_tokens
        seqs = [s for s in group.live_seqs if s.seq_id in progress]
        fresh = len(seqs) < len(group.live_seqs)  # n samples of one prompt: the others fork at its end
        limit = min(budget, self.config.long_prefill_token_threshold or budget)
        limit = max(limit, 1) if head else limit
        rest = sum(s.num_tokens - progress[s.seq_id] for s in seqs)
        if rest > limit:
            chunks = []
            for seq in seqs:
                chunks.append(max(0, min(seq.num_tokens - 1 - progress[seq.seq_id], limit - sum(chunks))))
            if any(chunks) or not head:
                for seq, take in zip(seqs, chunks):
                    if take:
                        start = progress[seq.seq_id]
                        out.rows.append(self._row(seq, start, start + take))
                        out.row_seqs.append([])
                        progress[seq.seq_id] = start + take
                        self.block_manager = cache_computed(self.block_manager, seq.seq_id, start + take)
                        out.is_decode = out.is_decode and take == 1
                return sum(chunks)
        # the group's last chunk (or a head group's sequences' last tokens): its rows sample
        for seq in seqs:
            out.rows.append(self._row(seq, progress[seq.seq_id], seq.num_tokens))
            out.row_seqs.append(group.live_seqs if fresh else [seq])
            self.block_manager = cache_computed(self.block_manager, seq.seq_id, seq.num_tokens)
        group.num_computed_tokens = {}
        if fresh:
            self._fork_samples(group)
        out.is_decode = out.is_decode and rest == len(seqs)
        return rest

    # ---- decode ------------------------------------------------------------------------------

    def _schedule_decode(self) -> SchedulerOutput:
        """Every running group grows by one token per live sequence (preempting the latest arrivals
        when blocks run short), swapped groups come back if none was preempted; the rows are the
        decoding groups' (a group whose prompt is being prefilled is scheduled, with no row: the
        ragged step adds its chunk)."""
        ops, preempted, finished = DeviceOps(), [], []
        running = sorted(self.running, key=_ARRIVAL_TIME)
        scheduled: list[SequenceGroup] = []
        free = [self._free_in(r) for r in range(self.num_partitions)]
        if self._appends_fit(free):  # no group is preempted: the loop below would schedule them all, in order
            scheduled, running = running, []
        while running:
            group = running.pop(0)
            rank = self._rank(group)
            need = self._append_demand(group)
            while need > free[rank] and any(self._rank(g) == rank for g in running):
                victim = next(g for g in reversed(running) if self._rank(g) == rank)  # the latest arrival
                running.remove(victim)
                ops += self._preempt(victim)
                preempted.append(victim)
                free[rank] = self._free_in(rank) - self._demand([g for g in scheduled if self._rank(g) == rank])
            if need > free[rank]:
                if any(self._rank(g) == rank for g in scheduled):
                    ops += self._preempt(group)
                    preempted.append(group)
                else:
                    logger.warning("request %s cannot grow even when running alone (KV pool of %d blocks): "
                                   "finishing it with finish_reason='length'", group.request_id,
                                   self.block_manager.num_blocks)
                    for seq in group.live_seqs:
                        self.finish_seq(seq, "length")
                    self.finish_group(group)
                    finished.append(group)
                continue
            scheduled.append(group)
            free[rank] -= need
        if not preempted:
            resumed, swap_ops = self._swap_in(free)
            scheduled += resumed
            ops += swap_ops
        decoding = [g for g in scheduled if not g.num_computed_tokens]
        lookahead = self._grant_lookahead(decoding, free)
        if not lookahead:  # every row one token: the block manager's batched append gives their slots and tables
            seqs = [s for g in decoding for s in g.live_seqs]
            rows = []
            if seqs:
                appends = [(seq.seq_id, seq.last_token_id) for seq in seqs]  # its last token, at its last position
                positions = [seq.num_tokens - 1 for seq in seqs]
                self.block_manager, append_ops, slots, tables = append_slots(self.block_manager, appends)
                ops += append_ops
                rows = [_row(([token], position, [slot], table))
                        for (_, token), position, slot, table in zip(appends, positions, slots, tables)]
            return SchedulerOutput(True, rows, [[s] for s in seqs], scheduled, ops, preempted, finished, {})
        appends = [(s.seq_id, s.last_token_id) for g in decoding for s in g.live_seqs]
        if appends:
            self.block_manager, append_ops = self.block_manager.append(appends, lookahead=lookahead)
            ops += append_ops
        seqs = [s for g in decoding for s in g.live_seqs]
        rows = [self._row(seq, seq.num_tokens - 1, seq.num_tokens) for seq in seqs]
        return SchedulerOutput(True, rows, [[s] for s in seqs], scheduled, ops, preempted, finished,
                               lookahead=lookahead)

    def propose_drafts(self, out: SchedulerOutput) -> None:
        """Speculative decoding's second half, called once the step's block operations (`out.ops`) are
        applied on the device (a proposer that runs the model reads and writes the pool, which must then
        hold what the step's sequences hold: a block swapped out this step may already be another's
        lookahead block, and a sequence swapped in reads its blocks). Asks the proposer for the drafts of
        the sequences granted lookahead slots (`out.lookahead`) and puts each sequence's draft rows right
        after its own row (`out.drafts`); a sequence given no drafts gives its slots back at once. The
        other rows (a ragged step's chunks) stay as they are; the token budget held the granted slots."""
        if not out.lookahead:
            return
        seqs = [r[0] for r in out.row_seqs if len(r) == 1 and r[0].seq_id in out.lookahead]  # one row each
        drafts = self._propose(seqs, out.lookahead)
        rows, row_seqs, spec = [], [], {}
        for row, targets in zip(out.rows, out.row_seqs):
            seq = targets[0] if len(targets) == 1 and targets[0].seq_id in out.lookahead else None
            if seq is None:
                rows.append(row)
                row_seqs.append(targets)
                continue
            if seq.seq_id in drafts:
                spec[seq.seq_id] = (len(rows), drafts[seq.seq_id])
            rows.append(self._row(seq, seq.num_tokens - 1, seq.num_tokens))  # its table after `_propose`
            row_seqs.append(targets)
            for j, token in enumerate(drafts.get(seq.seq_id, ())):  # at the lookahead slots
                position = seq.num_tokens + j
                rows.append(Row(token_ids=[token], start_position=position,
                                slots=self.block_manager.slot_mapping(seq.seq_id, position, position + 1),
                                block_table=self.block_manager.block_table(seq.seq_id)))
                row_seqs.append([])
        out.rows, out.row_seqs, out.drafts = rows, row_seqs, spec

    def _grant_lookahead(self, decoding: list[SequenceGroup], free: list[int]) -> dict[int, int]:
        """Lookahead slots for the decoding sequences' drafts (speculative decoding), in arrival order,
        while the blocks left in their partition (`free`, after every sequence's next token) and the
        token budget (after every decode token) hold them: seq_id -> slots. None past the context, past
        what the request may still generate (the token drawn after the drafts is one), or for a
        beam-search or structured-output group."""
        k = self.config.num_speculative_tokens
        if not (k and self.proposer):
            return {}
        budget = self.config.max_num_batched_tokens - sum(len(g.live_seqs) for g in decoding)
        length = self.max_model_len or float("inf")
        granted = {}
        for group in decoding:
            if group.params.use_beam_search or group.params.structured_outputs is not None:
                continue  # beams and constrained sequences draft nothing
            rank = self._rank(group)
            for seq in group.live_seqs:
                n = int(min(k, budget, group.params.max_tokens - len(seq.output_token_ids) - 1,
                            length - seq.num_tokens))
                if n <= 0:
                    continue
                ids = [seq.seq_id]
                extra = (self.block_manager.num_blocks_to_append(ids, lookahead=n)
                         - self.block_manager.num_blocks_to_append(ids))
                if extra > free[rank]:
                    continue
                free[rank] -= extra
                budget -= n
                granted[seq.seq_id] = n
        return granted

    def _propose(self, seqs: list[Sequence], lookahead: dict[int, int]) -> dict[int, list[int]]:
        """The proposer's drafts for `seqs`, granted lookahead slots (`lookahead`, appended already):
        seq_id -> drafts, at most its slots, none empty (a sequence given none gives its slots back;
        the others' unused slots go back with `commit_drafts`)."""
        requests = []
        for seq in seqs:
            start = seq.num_tokens - 1  # the draft inputs: the last token, then the drafts but the last
            requests.append(DraftRequest(seq, lookahead[seq.seq_id],
                                         tuple(self.block_manager.slot_mapping(
                                             seq.seq_id, start, start + lookahead[seq.seq_id])),
                                         tuple(self.block_manager.block_table(seq.seq_id))))
        drafts = {}
        for seq, tokens in zip(seqs, self.proposer.propose(requests)):
            if tokens:
                drafts[seq.seq_id] = list(tokens)[:lookahead[seq.seq_id]]
            else:  # nothing proposed: its slots go back at once
                self.block_manager = self.block_manager.commit_lookahead(seq.seq_id, [])
        return drafts

    def commit_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After a step that verified `seq`'s drafts: its first `num_accepted` drafts are its tokens
        now (the engine appended them, and the token sampled after them), the rest of its lookahead
        slots go back. A sequence that finished in the step has given back everything already."""
        if self.block_manager.has(seq.seq_id):
            start = seq.num_tokens - 1 - num_accepted
            self.block_manager = self.block_manager.commit_lookahead(
                seq.seq_id, seq.token_slice(start, start + num_accepted))

    def _swap_in(self, free: list[int]) -> tuple[list[SequenceGroup], DeviceOps]:
        """Brings swapped groups back (FCFS) while their blocks plus one more token each fit in their
        partition's `free[rank]`."""
        resumed, ops = [], DeviceOps()
        if not self.swapped:
            return resumed, ops
        num_seqs = self._num_live_running()
        for group in sorted(self.swapped, key=lambda g: g.arrival_time):
            ids = [s.seq_id for s in group.live_seqs]
            if num_seqs + len(ids) > self.config.max_num_seqs or not self.block_manager.can_swap_in(ids):
                break
            rank = self._rank(group)
            before = self._free_in(rank)
            candidate, swap_ops = self.block_manager.swap_in(ids)
            need = self._append_demand(group, candidate)
            after = self._free_in(rank, candidate)
            if after - need < 0 or before - after + need > free[rank]:
                break
            self.block_manager = candidate
            free[rank] -= before - after + need
            ops += swap_ops
            self.swapped.remove(group)
            self.running.append(group)
            group.status = GroupStatus.RUNNING
            resumed.append(group)
            num_seqs += len(ids)
        return resumed, ops

    def _preempt(self, group: SequenceGroup) -> DeviceOps:
        self.running.remove(group)
        group.num_preemptions += 1
        self.num_preemptions += 1
        ids = [s.seq_id for s in group.live_seqs if self.block_manager.has(s.seq_id)]
        prefilling, group.num_computed_tokens = bool(group.num_computed_tokens), {}
        if self.config.preemption_mode == "swap" and not prefilling and self.block_manager.can_swap_out(ids):
            self.block_manager, ops = self.block_manager.swap_out(ids)
            group.status = GroupStatus.SWAPPED
            self.swapped.append(group)
            return ops
        self._release(group)
        group.status = GroupStatus.WAITING
        self.waiting.appendleft(group)
        return DeviceOps()

    def _start(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.RUNNING
        if group.first_scheduled_time is None:
            group.first_scheduled_time = time.monotonic()
        self.running.append(group)

    # ---- block accounting --------------------------------------------------------------------

    def _append_demand(self, group: SequenceGroup, bm: Optional[KVCacheManager] = None) -> int:
        """Blocks one more token for every live sequence takes (new blocks and copy-on-writes); none
        while the group's prompt is being prefilled (its blocks were taken at admission)."""
        if group.num_computed_tokens:
            return 0
        return (bm or self.block_manager).num_blocks_to_append([s.seq_id for s in group.live_seqs])

    def _demand(self, groups: Seq[SequenceGroup]) -> int:
        return sum(self._append_demand(g) for g in groups)

    def _row(self, seq: Sequence, start: int, end: int) -> Row:
        return Row(token_ids=seq.token_slice(start, end), start_position=start,
                   slots=self.block_manager.slot_mapping(seq.seq_id, start, end),
                   block_table=self.block_manager.block_table(seq.seq_id))
