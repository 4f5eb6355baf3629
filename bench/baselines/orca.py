"""The Orca baselines inside the real engine: contiguous reservation as a `KVCacheManager`.

`LLMEngine(..., kv_cache_manager=orca(policy, output_lens), watermark=0.0)` runs the same model,
kernels and scheduler as the paged engine; only memory management differs. Orca reserves, at
admission, one contiguous run of blocks per request (a buddy run, `bench.baselines.reservation`)
sized by its policy (PagedAttention paper, section 6.1): Orca(Max) the model's whole context,
Orca(Pow2) the prompt plus the next power of two of the true output length, Orca(Oracle) the prompt
plus the true output length. The true output lengths are what those two baselines are assumed to
know: the benchmark gives them as an oracle, `output_lens`, mapping each prompt's token ids to the
number of tokens the request will generate (its `max_tokens` when it ignores EOS).

The watermark: a reservation already covers a sequence's growth, so the scheduler's watermark (kept
free against the preemptions that growth causes under paging) has nothing to protect; the benchmarks
run the baselines with `watermark=0.0` (a watermark would cost Orca(Max) one of its six 2048-token
runs in a 768-block pool). The manager honours whatever reserve it is asked for.

Host-side only: never imports JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Callable, NamedTuple, Optional

from bench.baselines.reservation import Reservation, ReservationManager, ReservationPolicy
from jpaged.core.kv_cache_manager import DeviceOps, KVCacheSpec, OutOfBlocksError, check_unique

POLICIES = tuple(p.value for p in ReservationPolicy)  # "orca_max", "orca_pow2", "orca_oracle"


class _Held(NamedTuple):
    """One running sequence under contiguous reservation."""

    reservation: Reservation
    num_tokens: int  # tokens whose K/V slots are in use (as BlockManager's num_tokens)


@dataclasses.dataclass(frozen=True, repr=False)
class OrcaKVCacheManager:
    """Contiguous reservation as a `jpaged.core.kv_cache_manager.KVCacheManager` (it neither forks
    nor swaps: the engine refuses n > 1 and beam search with it, the scheduler swap preemption).
    An immutable snapshot; every operation returns a new one.

    A sequence is admitted with one buddy run holding its policy's reservation of its tokens plus
    the output the oracle predicts for them (none known: up to the model's length). Its block
    table is the consecutive block ids of that run covering its tokens so far, so `slot = block_id
    * block_size + offset` and the kernels are those of the paged engine. Growth never allocates:
    `append` only counts tokens, `num_blocks_to_append` is 0 inside the reservation, hence no
    preemption is ever needed.

    Semantics next to `BlockManager`:
    - `num_free_blocks`: blocks in free buddy runs. Reserved blocks, written or not, are used.
    - `refcount(b)`: 1 for every block of an allocated run (its only holder), else 0.
    - `can_allocate(token_ids, reserve=)`: whether free runs fit the reservations, leaving `reserve`
      blocks free.
    - `num_blocks_to_append`: larger than the pool when a sequence would outgrow its reservation
      (only when it runs past the oracle's length), so the scheduler ends it with "length".

    Invariants (`check_invariants`): the buddy allocator's; one allocated run per sequence and
    none without one; each sequence's tokens fit its reservation, and its reservation its run;
    block 0 (null) is never reserved.
    """

    policy: ReservationPolicy
    reservations: ReservationManager
    output_lens: Mapping[tuple, int]
    _seqs: dict  # seq_id -> _Held

    @classmethod
    def create(cls, policy: ReservationPolicy | str, *, num_blocks: int, block_size: int, max_model_len: int,
               output_lens: Optional[Mapping[tuple, int]] = None) -> OrcaKVCacheManager:
        """`output_lens`: the oracle, prompt token ids (a tuple) -> tokens the request generates."""
        policy = ReservationPolicy(policy)
        if block_size < 1 or max_model_len < 2:
            raise ValueError(f"bad block_size={block_size} or max_model_len={max_model_len}")
        manager = ReservationManager.create(num_blocks, block_size, policy, max_model_len)
        return cls(policy, manager, dict(output_lens or {}), {})

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

    def refcount(self, block_id: int) -> int:
        """1 for a block of an allocated run (reserved: its sequence's alone), else 0."""
        return int(any(first <= block_id < first + n
                       for _, first, n in self.reservations.buddy.allocations))

    def lengths(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """(prompt, output) lengths the reservation of a sequence holding `token_ids` covers: the
        oracle's output length, or everything up to `max_model_len` when it knows none; capped at
        `max_model_len` (the engine ends a sequence there, whatever its `max_tokens`)."""
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        prompt_len = min(len(token_ids), self.max_model_len - 1)
        room = self.max_model_len - prompt_len
        output_len = self.output_lens.get(tuple(token_ids))
        return prompt_len, room if output_len is None else max(1, min(output_len, room))

    def reservation_blocks(self, token_ids: Sequence[int]) -> int:
        """Blocks of the buddy run a new sequence holding `token_ids` reserves."""
        return self.reservations.num_run_blocks(*self.lengths(token_ids))

    def can_allocate(self, token_ids: Sequence[Sequence[int]], *, reserve: int = 0) -> bool:
        """Whether free buddy runs fit the new sequences' reservations with `reserve` blocks still
        free after them (exact: the allocations are tried on a copy of the buddy allocator)."""
        buddy, taken = self.reservations.buddy, 0
        for i, ids in enumerate(token_ids):
            blocks = self.reservation_blocks(ids)
            if not buddy.can_allocate(blocks):
                return False
            buddy, _ = buddy.allocate(("can_allocate", i), blocks)
            taken += blocks
        return self.num_free_blocks - taken >= reserve

    def num_blocks_to_append(self, seq_ids) -> int:
        """0 while every sequence stays inside its reservation; `num_blocks` (more than can ever be
        free) when one would outgrow it."""
        check_unique(seq_ids)
        for seq_id in seq_ids:
            held = self._held(seq_id)
            if held.num_tokens + 1 > held.reservation.num_slots:
                return self.num_blocks
        return 0

    # ---- operations ----------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *,
                 num_computed: int | None = None) -> tuple[OrcaKVCacheManager, int]:
        """Admit a sequence holding `token_ids`: reserve its run. Returns (snapshot, 0 cached tokens).
        `num_computed` changes nothing (no block is shared)."""
        if seq_id in self._seqs:
            raise ValueError(f"cannot allocate sequence {seq_id!r}: it already exists")
        n = len(token_ids)
        if not 1 <= n < self.max_model_len:
            raise ValueError(f"cannot allocate sequence {seq_id!r} of {n} tokens: 1.."
                             f"{self.max_model_len - 1} fit the model")
        try:
            manager, reservation = self.reservations.admit(seq_id, *self.lengths(token_ids))
        except MemoryError as e:
            raise OutOfBlocksError(f"cannot allocate sequence {seq_id!r} ({n} tokens, "
                                   f"{self.policy.value}): {e}") from None
        seqs = dict(self._seqs)
        seqs[seq_id] = _Held(reservation, n)
        return dataclasses.replace(self, reservations=manager, _seqs=seqs), 0

    def append(self, appends) -> tuple[OrcaKVCacheManager, DeviceOps]:
        """One more token slot for each running sequence, inside its reservation: no device work."""
        check_unique([seq_id for seq_id, _ in appends])
        seqs = dict(self._seqs)
        for seq_id, _ in appends:
            held = self._held(seq_id)
            if held.num_tokens + 1 > held.reservation.num_slots:
                raise OutOfBlocksError(f"sequence {seq_id!r} would outgrow its reservation of "
                                       f"{held.reservation.num_slots} slots")
            seqs[seq_id] = held._replace(num_tokens=held.num_tokens + 1)
        return dataclasses.replace(self, _seqs=seqs), DeviceOps()

    def free(self, seq_ids) -> OrcaKVCacheManager:
        """Release the sequences' runs (the buddy allocator merges them back)."""
        check_unique(list(seq_ids))
        manager, seqs = self.reservations, dict(self._seqs)
        for seq_id in seq_ids:
            self._held(seq_id)
            del seqs[seq_id]
            manager = manager.release(seq_id)
        return dataclasses.replace(self, reservations=manager, _seqs=seqs)

    def forget_cached(self) -> OrcaKVCacheManager:
        """Nothing is cached under contiguous reservation: the same snapshot."""
        return self

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

    def usage(self) -> dict:
        return {"num_used_blocks": self.num_blocks - 1 - self.num_free_blocks, "num_free_blocks": self.num_free_blocks,
                "num_cached_blocks": 0}

    def stats(self) -> dict:
        """`BlockManager.stats()`'s keys (nothing is cached, shared or swapped here), plus the
        reservation's own: reserved slots, slots holding tokens, the largest free run."""
        usage = self.usage()
        num_used = usage["num_used_blocks"]
        return {
            "num_blocks": self.num_blocks,
            **usage,
            "num_cached_free_blocks": 0,
            "refcount_histogram": {1: num_used} if num_used else {},
            "num_cpu_blocks": 0,
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
        return (f"OrcaKVCacheManager({self.policy.value}, block_size={self.block_size}, blocks "
                f"used/free/total={s['num_used_blocks']}/{s['num_free_blocks']}/{self.num_blocks}, "
                f"largest free run={s['largest_free_run']}, seqs={s['num_seqs']})")


def orca(policy: ReservationPolicy | str,
         output_lens: Optional[Mapping[tuple, int]] = None) -> Callable[[KVCacheSpec], OrcaKVCacheManager]:
    """A `kv_cache_manager` factory for `LLMEngine`: the Orca baseline `policy` over the engine's
    device pool, with the oracle `output_lens` (prompt token ids -> tokens generated)."""
    policy = ReservationPolicy(policy)

    def build(spec: KVCacheSpec) -> OrcaKVCacheManager:
        if spec.enable_prefix_caching:
            raise ValueError(f"{policy.value}: contiguous reservation shares no blocks, so it has no "
                             "prefix caching (use the paged engine)")
        return OrcaKVCacheManager.create(policy, num_blocks=spec.num_blocks, block_size=spec.block_size,
                                         max_model_len=spec.max_model_len, output_lens=output_lens)

    return build
