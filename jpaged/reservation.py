"""Orca-style contiguous KV reservation: the baselines PagedAttention is measured against.

Orca reserves, at admission, one contiguous chunk of KV memory per request, sized by a policy
(PagedAttention paper, section 6.1); chunks come from a buddy allocator. Here the chunk is a run
of consecutive blocks of the same block pool the paged engine uses, so a reserved request yields
the same block tables and slot mappings (`slot = block_id * block_size + offset`) and the engine
runs both with the same kernels and scheduler: only memory management differs.

Buddy arithmetic and the null block. Block 0 is the null block and is never allocated, so the
allocator manages blocks `[1, num_blocks)` in its own *buddy address* space,
`address = block_id - 1`, of size `num_blocks - 1`. That space is split greedily into *roots*:
maximal aligned power-of-two runs (767 blocks -> 512 + 128 + 64 + 32 + 16 + 8 + 4 + 2 + 1).
A run of 2**k blocks starts at an address aligned to 2**k; its buddy is `address ^ 2**k`; two
free buddies merge only if the merged run stays inside one root. Offsetting by one (instead of
aligning absolute block ids) keeps the largest run as large as possible (512 of 767 blocks
rather than 256).

Host-side only: never imports JAX.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Hashable
from typing import NamedTuple

from jpaged.block_manager import DeviceOps, OutOfBlocksError


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _roots(size: int) -> tuple[tuple[int, int], ...]:
    """Greedy split of buddy addresses [0, size) into maximal aligned power-of-two runs."""
    roots, address = [], 0
    while address < size:
        run = 1 << (size - address).bit_length() - 1
        while address % run:
            run //= 2
        roots.append((address, run))
        address += run
    return tuple(roots)


@dataclasses.dataclass(frozen=True)
class BuddyAllocator:
    """Immutable buddy-allocator snapshot over blocks `[1, num_blocks)`; every op returns a new one.

    `free_runs`: `(first_block_id, num_blocks)` of each free run. `allocations`:
    `(request_id, first_block_id, num_blocks)` of each allocated run. Invariants
    (`check_invariants`): every run is a power of two long, aligned in buddy addresses and inside
    one root; runs are pairwise disjoint and together cover `[1, num_blocks)` exactly; no two free
    runs are mergeable buddies (free memory is fully coalesced).
    """

    num_blocks: int
    free_runs: frozenset[tuple[int, int]]
    allocations: frozenset[tuple[Hashable, int, int]] = frozenset()

    @classmethod
    def create(cls, num_blocks: int) -> "BuddyAllocator":
        if num_blocks < 2:
            raise ValueError(f"need the null block and at least one more, got {num_blocks}")
        return cls(num_blocks, frozenset((a + 1, n) for a, n in _roots(num_blocks - 1)))

    @functools.cached_property
    def num_free_blocks(self) -> int:
        return sum(n for _, n in self.free_runs)

    @functools.cached_property
    def largest_free_run(self) -> int:
        return max((n for _, n in self.free_runs), default=0)

    def _root_size(self, block_id: int) -> int:
        address = block_id - 1
        return next(n for a, n in _roots(self.num_blocks - 1) if a <= address < a + n)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether one free run can hold `next_power_of_two(num_blocks)` blocks."""
        return self.largest_free_run >= next_power_of_two(num_blocks)

    def allocation(self, request_id: Hashable) -> tuple[int, int]:
        """`(first_block_id, num_blocks)` of `request_id`'s run; KeyError if it holds none."""
        for rid, first, n in self.allocations:
            if rid == request_id:
                return first, n
        raise KeyError(request_id)

    def allocate(self, request_id: Hashable, num_blocks: int) -> tuple["BuddyAllocator", int]:
        """Reserve a run of `next_power_of_two(num_blocks)` blocks; returns (snapshot, first id).

        Best fit: the smallest free run that is large enough, lowest block id first; it is halved
        until it has the wanted size, the upper halves going back as free runs.
        """
        size = next_power_of_two(num_blocks)
        if any(rid == request_id for rid, _, _ in self.allocations):
            raise ValueError(f"request {request_id!r} already holds a run")
        fits = [run for run in self.free_runs if run[1] >= size]
        if not fits:
            raise MemoryError(f"no free run of {size} blocks (largest {self.largest_free_run})")
        first, n = min(fits, key=lambda run: (run[1], run[0]))
        free = set(self.free_runs) - {(first, n)}
        while n > size:
            n //= 2
            free.add((first + n, n))
        allocations = self.allocations | {(request_id, first, size)}
        return dataclasses.replace(self, free_runs=frozenset(free), allocations=allocations), first

    def free(self, request_id: Hashable) -> "BuddyAllocator":
        """Release `request_id`'s run, merging it with free buddies as far as its root allows."""
        first, n = self.allocation(request_id)
        free = set(self.free_runs)
        root_size = self._root_size(first)
        while n < root_size:
            buddy = ((first - 1) ^ n) + 1
            if (buddy, n) not in free:
                break
            free.remove((buddy, n))
            first, n = min(first, buddy), 2 * n
        free.add((first, n))
        allocations = frozenset(a for a in self.allocations if a[0] != request_id)
        return dataclasses.replace(self, free_runs=frozenset(free), allocations=allocations)

    def check_invariants(self) -> None:
        """Raise AssertionError if the snapshot breaks any invariant in the class docstring."""
        runs = [(f, n, True) for f, n in self.free_runs]
        runs += [(f, n, False) for _, f, n in self.allocations]
        request_ids = [rid for rid, _, _ in self.allocations]
        assert len(set(request_ids)) == len(request_ids), "a request holds two runs"
        covered = 0
        for first, n, _ in sorted(runs):
            address = first - 1
            assert first == covered + 1, f"run at {first}: gap or overlap (covered to {covered})"
            assert n >= 1 and n & (n - 1) == 0, f"run at {first} has {n} blocks"
            assert address % n == 0, f"run at {first} of {n} blocks is misaligned"
            assert n <= self._root_size(first), f"run at {first} crosses a root"
            covered += n
        assert covered == self.num_blocks - 1, f"runs cover {covered} of {self.num_blocks - 1}"
        for first, n in self.free_runs:
            if 2 * n <= self._root_size(first):
                buddy = ((first - 1) ^ n) + 1
                assert (buddy, n) not in self.free_runs, f"free buddies {first}, {buddy} unmerged"


class ReservationPolicy(enum.Enum):
    """How many token slots a request reserves at admission (paper, section 6.1)."""

    ORCA_MAX = "orca_max"        # the model's maximum sequence length, prompt included
    ORCA_POW2 = "orca_pow2"      # prompt + next power of two >= true output length (<= 2x over)
    ORCA_ORACLE = "orca_oracle"  # prompt + true output length exactly

    def num_slots(self, prompt_len: int, output_len: int, max_model_len: int) -> int:
        """Token slots reserved for a request; all policies are capped at `max_model_len`.

        ORCA_MAX reserves `max_model_len` (2048 for the paper's OPT models: "reserves the space
        up to the maximum sequence length"), whatever the prompt. ORCA_POW2 would exceed
        `max_model_len` only for slots that no sequence can ever use, so it is capped there.
        """
        if prompt_len < 1 or output_len < 1 or prompt_len + output_len > max_model_len:
            raise ValueError(f"prompt {prompt_len} + output {output_len} must fit in 1.."
                             f"{max_model_len} tokens")
        if self is ReservationPolicy.ORCA_MAX:
            return max_model_len
        if self is ReservationPolicy.ORCA_POW2:
            return min(prompt_len + next_power_of_two(output_len), max_model_len)
        return prompt_len + output_len


ORCA_MAX = ReservationPolicy.ORCA_MAX
ORCA_POW2 = ReservationPolicy.ORCA_POW2
ORCA_ORACLE = ReservationPolicy.ORCA_ORACLE


@dataclasses.dataclass(frozen=True)
class Reservation:
    """One request's contiguous reservation: `num_slots` token slots from block `first_block_id`.

    The buddy run is `run_blocks` long; only the first `cdiv(num_slots, block_size)` blocks are
    ever written. Token `i` of the sequence lives at slot `first_block_id * block_size + i`.
    """

    request_id: Hashable
    first_block_id: int
    num_slots: int
    run_blocks: int
    block_size: int

    def slot(self, position: int) -> int:
        if not 0 <= position < self.num_slots:
            raise IndexError(f"position {position} outside the reservation of {self.num_slots}")
        return self.first_block_id * self.block_size + position

    def block_table(self, num_tokens: int | None = None) -> tuple[int, ...]:
        """Block ids holding the first `num_tokens` tokens (default: the whole reservation)."""
        num_tokens = self.num_slots if num_tokens is None else num_tokens
        if not 0 <= num_tokens <= self.num_slots:
            raise IndexError(f"{num_tokens} tokens outside the reservation of {self.num_slots}")
        return tuple(range(self.first_block_id, self.first_block_id + cdiv(num_tokens, self.block_size)))


@dataclasses.dataclass(frozen=True)
class ReservationManager:
    """Immutable snapshot the scheduler uses for Orca baselines: admit / release / look up.

    Verbs mirror the paged block manager: `can_admit` then `admit` at admission (all memory the
    request will ever use, reserved up front), `release` when it finishes or is preempted.
    """

    buddy: BuddyAllocator
    block_size: int
    policy: ReservationPolicy
    max_model_len: int
    reservations: frozenset[Reservation] = frozenset()

    @classmethod
    def create(cls, num_blocks: int, block_size: int, policy: ReservationPolicy,
               max_model_len: int) -> "ReservationManager":
        return cls(BuddyAllocator.create(num_blocks), block_size, policy, max_model_len)

    def num_slots(self, prompt_len: int, output_len: int) -> int:
        return self.policy.num_slots(prompt_len, output_len, self.max_model_len)

    def num_run_blocks(self, prompt_len: int, output_len: int) -> int:
        """Blocks the buddy allocator takes: `cdiv(slots, block_size)` rounded to a power of two."""
        return next_power_of_two(cdiv(self.num_slots(prompt_len, output_len), self.block_size))

    def can_admit(self, prompt_len: int, output_len: int) -> bool:
        return self.buddy.can_allocate(self.num_run_blocks(prompt_len, output_len))

    def admit(self, request_id: Hashable, prompt_len: int,
              output_len: int) -> tuple["ReservationManager", Reservation]:
        num_slots = self.num_slots(prompt_len, output_len)
        buddy, first = self.buddy.allocate(request_id, cdiv(num_slots, self.block_size))
        _, run_blocks = buddy.allocation(request_id)
        reservation = Reservation(request_id, first, num_slots, run_blocks, self.block_size)
        return dataclasses.replace(self, buddy=buddy,
                                   reservations=self.reservations | {reservation}), reservation

    def release(self, request_id: Hashable) -> "ReservationManager":
        reservation = self.reservation(request_id)
        return dataclasses.replace(self, buddy=self.buddy.free(request_id),
                                   reservations=self.reservations - {reservation})

    def reservation(self, request_id: Hashable) -> Reservation:
        for reservation in self.reservations:
            if reservation.request_id == request_id:
                return reservation
        raise KeyError(request_id)


# ---- the Orca baselines inside the engine ---------------------------------------------------------

class _Held(NamedTuple):
    """One running sequence under contiguous reservation."""

    reservation: Reservation
    num_tokens: int  # tokens whose K/V slots are in use (as BlockManager's num_tokens)


@dataclasses.dataclass(frozen=True, repr=False)
class OrcaBlockManager:
    """Contiguous reservation behind `BlockManager`'s interface (the subset the scheduler and the
    engine call), so the same engine runs the Orca baselines: `EngineConfig(kv_policy="orca_max" |
    "orca_pow2" | "orca_oracle")`. An immutable snapshot; every operation returns a new one.

    A sequence is admitted with one buddy run holding its policy's reservation of prompt +
    `max_new_tokens` (the request's output budget: its true output length when `max_tokens` is
    it, which is what the paper's Orca(Oracle) assumes). Its block table is the consecutive block
    ids of that run covering its tokens so far, so `slot = block_id * block_size + offset` and the
    kernels are those of the paged engine. Growth never allocates: `append` only counts tokens,
    `num_blocks_to_append` is 0 inside the reservation, hence no preemption is ever needed.

    Semantics next to `BlockManager`:
    - `num_free_blocks`: blocks in free buddy runs. Reserved blocks, written or not, are used.
    - `refcount(b)`: 1 for every block of an allocated run (its only holder), else 0.
    - `can_allocate(num_tokens, reserve=, max_new_tokens=)`: whether a free run fits the
      reservation. `reserve` (the scheduler's watermark, kept free against the preemptions that
      growth causes under paging) is ignored: a reservation already covers its growth, and the
      watermark would cost Orca(Max) one of its six 2048-token runs in a 768-block pool.
    - `num_blocks_to_append`: larger than the pool when a sequence would outgrow its reservation
      (only possible when `max_tokens` is below the true output length), so the scheduler ends it
      with `finish_reason="length"`.
    - No sharing: `fork`, swapping and prefix caching raise `NotImplementedError`.

    Invariants (`check_invariants`): the buddy allocator's; one allocated run per sequence and
    none without one; each sequence's tokens fit its reservation, and its reservation its run;
    block 0 (null) is never reserved.
    """

    policy: ReservationPolicy
    reservations: ReservationManager
    num_cpu_blocks: int
    _seqs: dict  # seq_id -> _Held

    @classmethod
    def create(cls, *, policy: ReservationPolicy | str, max_model_len: int, num_blocks: int,
               block_size: int, num_cpu_blocks: int = 0, enable_prefix_caching: bool = False,
               free_block_ids=None) -> "OrcaBlockManager":
        """Same arguments as `BlockManager.create`, plus the policy and the model's maximum length.
        `free_block_ids` (a paged free-list order) has no meaning here and must be None."""
        policy = ReservationPolicy(policy)
        if enable_prefix_caching:
            raise NotImplementedError(f"{policy.value}: contiguous reservation shares no blocks, "
                                      f"so it has no prefix caching (use kv_policy='paged')")
        if free_block_ids is not None:
            raise ValueError(f"{policy.value}: free_block_ids sets a paged free-list order; the "
                             f"buddy allocator chooses the runs of contiguous reservations")
        if block_size < 1 or max_model_len < 2:
            raise ValueError(f"bad block_size={block_size} or max_model_len={max_model_len}")
        manager = ReservationManager.create(num_blocks, block_size, policy, max_model_len)
        return cls(policy, manager, num_cpu_blocks, {})

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.reservations.buddy.num_blocks

    @property
    def block_size(self) -> int:
        return self.reservations.block_size

    @property
    def max_model_len(self) -> int:
        return self.reservations.max_model_len

    @property
    def num_free_blocks(self) -> int:
        return self.reservations.buddy.num_free_blocks

    @property
    def largest_free_run(self) -> int:
        return self.reservations.buddy.largest_free_run

    @property
    def seq_ids(self) -> tuple:
        return tuple(self._seqs)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def _held(self, seq_id: Hashable) -> _Held:
        if (held := self._seqs.get(seq_id)) is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return held

    def reservation(self, seq_id: Hashable) -> Reservation:
        return self._held(seq_id).reservation

    def block_table(self, seq_id: Hashable) -> tuple[int, ...]:
        """The consecutive block ids of its run that hold its tokens so far."""
        held = self._held(seq_id)
        return held.reservation.block_table(held.num_tokens)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._held(seq_id).num_tokens

    def is_swapped(self, seq_id: Hashable) -> bool:
        self._held(seq_id)
        return False

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Device slots of positions [start, end) of a sequence: consecutive in its run."""
        held = self._held(seq_id)
        if not 0 <= start <= end <= held.num_tokens:
            raise IndexError(f"positions [{start}, {end}) out of range for sequence {seq_id!r} "
                             f"of {held.num_tokens} tokens")
        base = held.reservation.first_block_id * self.block_size
        return list(range(base + start, base + end))

    def slot(self, seq_id: Hashable, position: int) -> int:
        return self.slot_mapping(seq_id, position, position + 1)[0]

    def refcount(self, block_id: int) -> int:
        """1 for a block of an allocated run (reserved: its sequence's alone), else 0."""
        return int(any(first <= block_id < first + n
                       for _, first, n in self.reservations.buddy.allocations))

    def reservation_blocks(self, num_tokens: int, max_new_tokens: int | None) -> int:
        """Blocks of the buddy run a sequence of `num_tokens` tokens with `max_new_tokens` more to
        generate reserves (None: as many as the model allows). Lengths are capped at
        `max_model_len`: the engine ends a sequence there, whatever its `max_tokens`."""
        prompt_len, output_len = self._lengths(num_tokens, max_new_tokens)
        return self.reservations.num_run_blocks(prompt_len, output_len)

    def _lengths(self, num_tokens: int, max_new_tokens: int | None) -> tuple[int, int]:
        if num_tokens < 1:
            raise ValueError(f"a sequence needs at least one token, got {num_tokens}")
        prompt_len = min(num_tokens, self.max_model_len - 1)
        room = self.max_model_len - prompt_len
        return prompt_len, room if max_new_tokens is None else max(1, min(max_new_tokens, room))

    def can_allocate(self, num_tokens: int, *, reserve: int = 0,
                     max_new_tokens: int | None = None) -> bool:
        """Whether one free buddy run fits the reservation (`reserve` is ignored: see the class
        docstring). `num_tokens` may be rounded up to whole blocks by the caller; the answer is
        then at worst conservative."""
        del reserve
        return self.largest_free_run >= self.reservation_blocks(num_tokens, max_new_tokens)

    def num_blocks_to_append(self, seq_ids) -> int:
        """0 while every sequence stays inside its reservation; `num_blocks` (more than can ever be
        free) when one would outgrow it."""
        _check_unique(seq_ids)
        for seq_id in seq_ids:
            held = self._held(seq_id)
            if held.num_tokens + 1 > held.reservation.num_slots:
                return self.num_blocks
        return 0

    def can_append(self, seq_ids) -> bool:
        return self.num_blocks_to_append(seq_ids) <= self.num_free_blocks

    # ---- operations ----------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids, *,
                 max_new_tokens: int | None = None) -> tuple["OrcaBlockManager", int]:
        """Admit a sequence holding `token_ids`: reserve its run. Returns (snapshot, 0 cached tokens)."""
        if seq_id in self._seqs:
            raise ValueError(f"cannot allocate sequence {seq_id!r}: it already exists")
        n = len(token_ids)
        if not 1 <= n < self.max_model_len:
            raise ValueError(f"cannot allocate sequence {seq_id!r} of {n} tokens: 1.."
                             f"{self.max_model_len - 1} fit the model")
        prompt_len, output_len = self._lengths(n, max_new_tokens)
        try:
            manager, reservation = self.reservations.admit(seq_id, prompt_len, output_len)
        except MemoryError as e:
            raise OutOfBlocksError(f"cannot allocate sequence {seq_id!r} ({n} tokens, "
                                   f"{self.policy.value}): {e}") from None
        seqs = dict(self._seqs)
        seqs[seq_id] = _Held(reservation, n)
        return dataclasses.replace(self, reservations=manager, _seqs=seqs), 0

    def append(self, appends) -> tuple["OrcaBlockManager", DeviceOps]:
        """One more token slot for each running sequence, inside its reservation: no device work."""
        _check_unique([seq_id for seq_id, _ in appends])
        seqs = dict(self._seqs)
        for seq_id, _ in appends:
            held = self._held(seq_id)
            if held.num_tokens + 1 > held.reservation.num_slots:
                raise OutOfBlocksError(f"sequence {seq_id!r} would outgrow its reservation of "
                                       f"{held.reservation.num_slots} slots")
            seqs[seq_id] = held._replace(num_tokens=held.num_tokens + 1)
        return dataclasses.replace(self, _seqs=seqs), DeviceOps()

    def free(self, seq_ids) -> "OrcaBlockManager":
        """Release the sequences' runs (the buddy allocator merges them back)."""
        manager, seqs = self.reservations, dict(self._seqs)
        for seq_id in seq_ids:
            self._held(seq_id)
            if seq_id not in seqs:
                raise ValueError(f"sequence {seq_id!r} freed twice")
            del seqs[seq_id]
            manager = manager.release(seq_id)
        return dataclasses.replace(self, reservations=manager, _seqs=seqs)

    def _no_sharing(self, verb: str):
        raise NotImplementedError(
            f"{verb} is not supported under contiguous reservation ({self.policy.value}): the Orca "
            f"baselines share no blocks and never preempt (use kv_policy='paged' for n > 1, beam "
            f"search, or swap preemption)")

    def fork(self, parent_seq_id, child_seq_id):
        self._no_sharing("fork")

    def swap_out(self, seq_ids):
        self._no_sharing("swap_out")

    def swap_in(self, seq_ids):
        self._no_sharing("swap_in")

    def can_swap_out(self, seq_ids):
        self._no_sharing("can_swap_out")

    def can_swap_in(self, seq_ids):
        self._no_sharing("can_swap_in")

    # ---- checks and reporting ------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert every invariant of the class docstring."""
        buddy = self.reservations.buddy
        buddy.check_invariants()
        held_ids = {rid for rid, _, _ in buddy.allocations}
        assert held_ids == set(self._seqs), (
            f"runs held by {sorted(map(repr, held_ids))}, sequences {sorted(map(repr, self._seqs))}")
        assert {r.request_id for r in self.reservations.reservations} == held_ids, (
            "reservations and buddy runs disagree")
        for seq_id, held in self._seqs.items():
            r = held.reservation
            assert self.reservations.reservation(seq_id) == r, f"sequence {seq_id!r}: stale reservation"
            assert buddy.allocation(seq_id) == (r.first_block_id, r.run_blocks), (
                f"sequence {seq_id!r}: reservation {r} is not its run {buddy.allocation(seq_id)}")
            assert 1 <= held.num_tokens <= r.num_slots <= r.run_blocks * self.block_size, (
                f"sequence {seq_id!r}: {held.num_tokens} tokens, {r.num_slots} slots, "
                f"{r.run_blocks} blocks")
            assert r.first_block_id >= 1, f"sequence {seq_id!r} holds the null block"

    def stats(self) -> dict:
        """`BlockManager.stats()`'s keys (nothing is cached, shared or swapped here), plus the
        reservation's own: reserved slots, slots holding tokens, the largest free run."""
        num_used = self.num_blocks - 1 - self.num_free_blocks
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": num_used,
            "num_cached_blocks": 0,
            "num_cached_free_blocks": 0,
            "refcount_histogram": {1: num_used} if num_used else {},
            "num_cpu_blocks": self.num_cpu_blocks,
            "num_used_cpu_blocks": 0,
            "num_seqs": len(self._seqs),
            "num_swapped_seqs": 0,
            "policy": self.policy.value,
            "num_reserved_slots": sum(h.reservation.num_slots for h in self._seqs.values()),
            "num_token_slots": sum(h.num_tokens for h in self._seqs.values()),
            "largest_free_run": self.largest_free_run,
        }

    def __repr__(self) -> str:
        s = self.stats()
        return (f"OrcaBlockManager({self.policy.value}, block_size={self.block_size}, blocks "
                f"used/free/total={s['num_used_blocks']}/{s['num_free_blocks']}/{self.num_blocks}, "
                f"largest free run={s['largest_free_run']}, seqs={s['num_seqs']})")


def _check_unique(seq_ids) -> None:
    seq_ids = list(seq_ids)
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"a sequence appears twice in {seq_ids!r}")
