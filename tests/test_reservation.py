"""Orca baselines (`bench/baselines/reservation.py`): buddy allocator, reservation policies, and the
memory-utilization simulation of `bench/memory_utilization.py`."""

import pytest
from hypothesis import given, settings, strategies as st

from bench import memory_utilization as mu
from bench import traces
from bench.baselines.reservation import (
    ORCA_MAX, ORCA_ORACLE, ORCA_POW2, BuddyAllocator, ReservationManager, next_power_of_two)


def runs(buddy):
    return sorted(buddy.free_runs)


# ---------------------------------------------------------------- buddy allocator, pinned

def test_create_splits_pool_after_null_block_into_maximal_aligned_roots():
    buddy = BuddyAllocator.create(768)
    assert runs(buddy) == [(1, 512), (513, 128), (641, 64), (705, 32), (737, 16), (753, 8),
                           (761, 4), (765, 2), (767, 1)]
    assert buddy.num_free_blocks == 767 and buddy.largest_free_run == 512
    buddy.check_invariants()


def test_allocate_splits_best_fit_and_free_merges_buddies():
    buddy = BuddyAllocator.create(17)  # blocks 1..16: one root of 16
    buddy, first = buddy.allocate("a", 3)  # rounded to 4: 16 -> 8 + 8 -> 4 + 4
    assert first == 1 and buddy.allocation("a") == (1, 4)
    assert runs(buddy) == [(5, 4), (9, 8)]
    buddy, first = buddy.allocate("b", 1)
    assert first == 5 and runs(buddy) == [(6, 1), (7, 2), (9, 8)]
    buddy, first = buddy.allocate("c", 2)  # best fit: the free pair, not a split of the 8
    assert first == 7 and runs(buddy) == [(6, 1), (9, 8)]
    buddy.check_invariants()

    buddy = buddy.free("a")  # its buddy (5..8) is partly allocated: no merge
    assert runs(buddy) == [(1, 4), (6, 1), (9, 8)]
    buddy = buddy.free("b")  # 5 + 6 merge; their buddy 7..8 is still held by c
    assert runs(buddy) == [(1, 4), (5, 2), (9, 8)]
    buddy = buddy.free("c")  # cascades up to the whole root
    assert runs(buddy) == [(1, 16)] and buddy.allocations == frozenset()
    buddy.check_invariants()


def test_runs_are_aligned_in_buddy_addresses_and_never_touch_the_null_block():
    buddy = BuddyAllocator.create(768)
    firsts = {}
    for request_id, size in enumerate([64, 1, 128, 3, 200, 16, 5, 256, 2, 7]):
        buddy, firsts[request_id] = buddy.allocate(request_id, size)
        first, n = buddy.allocation(request_id)
        assert n == next_power_of_two(size) and (first - 1) % n == 0 and first >= 1
        buddy.check_invariants()
    assert firsts[0] == 641  # best fit: the 64-block root, not a split of the 512 root
    assert 0 not in {b for _, f, n in buddy.allocations for b in range(f, f + n)}


def test_external_fragmentation_enough_free_blocks_but_no_run():
    buddy = BuddyAllocator.create(17)
    for i in range(16):
        buddy, first = buddy.allocate(i, 1)
        assert first == i + 1
    for i in range(0, 16, 2):
        buddy = buddy.free(i)
    assert buddy.num_free_blocks == 8 and buddy.largest_free_run == 1
    assert buddy.can_allocate(1) and not buddy.can_allocate(2)
    with pytest.raises(MemoryError):
        buddy.allocate("big", 2)
    buddy.check_invariants()


def test_allocate_refuses_a_second_run_for_one_request():
    buddy, _ = BuddyAllocator.create(9).allocate("a", 1)
    with pytest.raises(ValueError):
        buddy.allocate("a", 1)


def test_check_invariants_catches_unmerged_buddies_and_overlaps():
    with pytest.raises(AssertionError):  # 1 and 2 are free buddies
        BuddyAllocator(5, frozenset({(1, 1), (2, 1), (3, 2)})).check_invariants()
    with pytest.raises(AssertionError):  # allocation overlaps a free run
        BuddyAllocator(5, frozenset({(1, 4)}), frozenset({("a", 1, 1)})).check_invariants()
    with pytest.raises(AssertionError):  # misaligned run
        BuddyAllocator(5, frozenset({(1, 1), (2, 2), (4, 1)})).check_invariants()


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 300),
       ops=st.lists(st.tuples(st.booleans(), st.integers(1, 70), st.integers(0, 10 ** 6)), max_size=60))
def test_random_allocate_free_keeps_invariants_and_ends_all_free(num_blocks, ops):
    start = BuddyAllocator.create(num_blocks)
    buddy, live, next_id = start, [], 0
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            fits = buddy.can_allocate(size)
            if fits:
                buddy, first = buddy.allocate(next_id, size)
                assert buddy.allocation(next_id) == (first, next_power_of_two(size))
                live.append(next_id)
            else:
                with pytest.raises(MemoryError):
                    buddy.allocate(next_id, size)
            next_id += 1
        else:
            buddy = buddy.free(live.pop(pick % len(live)))
        buddy.check_invariants()
        held = sum(n for _, _, n in buddy.allocations)
        assert buddy.num_free_blocks + held == num_blocks - 1
    for request_id in live:
        buddy = buddy.free(request_id)
    assert buddy == start


# ---------------------------------------------------------------- reservation policies

@pytest.mark.parametrize("policy, prompt, output, slots", [
    (ORCA_MAX, 161, 338, 2048), (ORCA_MAX, 1, 1, 2048),
    (ORCA_POW2, 161, 338, 161 + 512), (ORCA_POW2, 10, 25, 10 + 32),  # the paper's 25 -> 32
    (ORCA_POW2, 10, 32, 42), (ORCA_POW2, 1800, 200, 2048),  # 1800 + 256 capped at 2048
    (ORCA_ORACLE, 161, 338, 499), (ORCA_ORACLE, 2000, 48, 2048),
])
def test_policy_reservation_slots(policy, prompt, output, slots):
    assert policy.num_slots(prompt, output, 2048) == slots


def test_policy_rejects_requests_that_cannot_fit_the_model():
    with pytest.raises(ValueError):
        ORCA_ORACLE.num_slots(2000, 49, 2048)
    with pytest.raises(ValueError):
        ORCA_MAX.num_slots(0, 5, 2048)


@pytest.mark.parametrize("policy, blocks", [(ORCA_MAX, 128), (ORCA_POW2, 64), (ORCA_ORACLE, 32)])
def test_reservation_blocks_round_to_power_of_two(policy, blocks):
    # 2048 slots -> 128 blocks; 673 -> 43 -> 64; 499 -> 32 -> 32 (block size 16)
    assert ReservationManager.create(768, 16, policy, 2048).num_run_blocks(161, 338) == blocks


def test_reservation_slots_and_block_table_are_contiguous():
    manager = ReservationManager.create(768, 16, ORCA_POW2, 2048)
    manager, r = manager.admit("x", 161, 338)  # 673 slots: 43 blocks in a run of 64
    assert (r.first_block_id, r.num_slots, r.run_blocks) == (641, 673, 64)
    assert [r.slot(i) for i in (0, 15, 16, 672)] == [641 * 16, 641 * 16 + 15, 642 * 16, 641 * 16 + 672]
    assert r.block_table(17) == (641, 642)
    assert r.block_table() == tuple(range(641, 641 + 43))
    with pytest.raises(IndexError):
        r.slot(673)
    assert manager.reservation("x") == r
    assert manager.can_admit(161, 338)
    assert manager.release("x") == ReservationManager.create(768, 16, ORCA_POW2, 2048)


def test_manager_refuses_admission_when_no_run_fits():
    manager = ReservationManager.create(768, 16, ORCA_MAX, 2048)  # 767 blocks: 512 + 128 + ...
    for i in range(5):
        manager, _ = manager.admit(i, 10, 10)
    assert manager.buddy.num_free_blocks == 127 and not manager.can_admit(10, 10)
    with pytest.raises(MemoryError):
        manager.admit(5, 10, 10)


# ---------------------------------------------------------------- simulation

@pytest.fixture(scope="module")
def tiny_trace():
    return traces.sharegpt_like(40, seed=0, max_model_len=512)


@pytest.mark.parametrize("arrivals", ["t0", "poisson"])
def test_simulation_conserves_the_pool_and_paged_beats_every_orca(tiny_trace, arrivals):
    trace = tiny_trace if arrivals == "t0" else traces.with_arrivals(
        tiny_trace, traces.poisson_arrivals(len(tiny_trace), 0.02, seed=1))
    pool_slots, token_steps = 2048, sum(sum(range(r.prompt_len, r.prompt_len + r.output_len)) for r in trace)
    results = [mu.simulate_paged(trace, bs, pool_slots) for bs in (4, 16)]
    results += [mu.simulate_orca(trace, policy, 16, pool_slots, max_model_len=512)
                for policy in (ORCA_MAX, ORCA_POW2, ORCA_ORACLE)]
    for result in results:
        steps = result.steps
        assert result.pool_slots == pool_slots - result.block_size  # null block excluded
        total = sum(steps[k] for k in mu.CATEGORIES)
        assert (total == result.pool_slots).all(), result.system
        assert (steps["internal"] == sum(steps[k] for k in mu.INTERNAL_PARTS)).all()
        assert min(steps[k].min() for k in mu.CATEGORIES) >= 0
        # every request ran exactly once with p, p + 1, ..., p + o - 1 tokens, preempted or not
        assert steps["token_states"].sum() == token_steps, result.system
    paged16 = results[1].summary()
    assert results[0].num_preemptions + results[1].num_preemptions > 0  # the pool is contended
    assert paged16["utilization"] == pytest.approx(mu.paged_floor(trace, 16), abs=1e-12)
    assert paged16["floor_running"] == pytest.approx(paged16["utilization"], abs=1e-12)
    for orca in results[2:]:
        assert paged16["utilization"] > orca.summary()["utilization"], orca.system
    assert results[2].summary()["peak_running"] <= 2048 // 512


def test_external_fragmentation_is_reported_when_no_run_fits():
    # 16 usable blocks of 16 slots, one root. A, B, C, D take 4 blocks each (1..4, 5..8, 9..12,
    # 13..16); B and D finish after 2 steps, leaving 5..8 and 13..16 free: 8 blocks, but not
    # buddies. E needs 110 slots -> 7 -> 8 blocks: it waits on external fragmentation until A and
    # C finish after step 19.
    lens = [(40, 20), (40, 2), (40, 20), (40, 2), (100, 10)]
    trace = [traces.TraceRequest(i, 0.0, p, o) for i, (p, o) in enumerate(lens)]
    steps = mu.simulate_orca(trace, ORCA_ORACLE, 16, 17 * 16, max_model_len=512).steps
    assert (sum(steps[k] for k in mu.CATEGORIES) == 16 * 16).all()
    assert steps["external"][:2].tolist() == [0, 0]  # nothing free yet: E just waits
    assert (steps["external"][2:20] == 8 * 16).all() and (steps["free"][2:20] == 0).all()
    assert (steps["external"][20:] == 0).all() and steps["num_running"][20] == 1
    assert len(steps["free"]) == 30


def test_the_quick_preset_writes_its_own_files_and_keeps_the_full_results(tmp_path, monkeypatch):
    (tmp_path / "memory_utilization.json").write_text("{}")  # a full run's results, quoted by the README
    monkeypatch.setattr(mu, "plot", lambda out, path: path.write_bytes(b""))  # matplotlib: a bench extra
    out = mu.main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "memory_utilization.json").read_text() == "{}"
    assert {p.name for p in tmp_path.iterdir()} >= {"memory_utilization_quick.json", "memory_utilization_quick.png"}
    paged = {row["system"]: row for row in out["results"]["sharegpt_like/t0"]}["paged_bs16"]
    assert paged["utilization"] >= paged["floor"] - 0.01  # paged wastes at most its last blocks
