"""Orca-style contiguous KV reservation: the buddy allocator and the reservation policies.

Orca reserves, at admission, one contiguous chunk of KV memory per request, sized by a policy
(PagedAttention paper, section 6.1); chunks come from a buddy allocator. Here the chunk is a run
of consecutive blocks of a block pool like the paged engine's, so a reserved request yields block
tables and slot mappings (`slot = block_id * block_size + offset`) that the engine's kernels read
unchanged. `bench/memory_utilization.py` simulates these allocators; `bench.baselines.orca` runs
them inside the real engine.

Buddy arithmetic and the null block. Block 0 is the null block and is never allocated, so the
allocator manages blocks `[1, num_blocks)` in its own *buddy address* space,
`address = block_id - 1`, of size `num_blocks - 1`. That space is split greedily into *roots*:
maximal aligned power-of-two runs (767 blocks -> 512 + 128 + 64 + 32 + 16 + 8 + 4 + 2 + 1).
A run of 2**k blocks starts at an address aligned to 2**k; its buddy is `address ^ 2**k`; two
free buddies merge only if the merged run stays inside one root. Offsetting by one (instead of
aligning absolute block ids) keeps the largest run as large as possible (512 of 767 blocks
rather than 256).

"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Hashable

from jpaged.core.kv_cache_manager import blocks_for
from jpaged.device.batch import bucket as next_power_of_two  # smallest power of two >= n


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

    The buddy run is `run_blocks` long; only the first `blocks_for(num_slots, block_size)` blocks are
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
        return tuple(range(self.first_block_id, self.first_block_id + blocks_for(num_tokens, self.block_size)))


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
        """Blocks the buddy allocator takes: `blocks_for(slots, block_size)` rounded to a power of two."""
        return next_power_of_two(blocks_for(self.num_slots(prompt_len, output_len), self.block_size))

    def can_admit(self, prompt_len: int, output_len: int) -> bool:
        return self.buddy.can_allocate(self.num_run_blocks(prompt_len, output_len))

    def admit(self, request_id: Hashable, prompt_len: int,
              output_len: int) -> tuple["ReservationManager", Reservation]:
        num_slots = self.num_slots(prompt_len, output_len)
        buddy, first = self.buddy.allocate(request_id, blocks_for(num_slots, self.block_size))
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
