"""The Orca baselines inside the engine: `OrcaBlockManager` (contiguous buddy reservations behind
`BlockManager`'s interface) pinned against the buddy allocator, then the real engine on the real
model: memory management must never change what is generated, only how much runs at once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jpaged import SamplingParams
from jpaged.block_manager import BlockManager, DeviceOps, OutOfBlocksError
from jpaged.reservation import OrcaBlockManager

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `bench` is a plain directory at the repository root
    sys.path.insert(0, str(ROOT))

from bench import throughput  # noqa: E402

POLICIES = ("orca_max", "orca_pow2", "orca_oracle")


def orca(policy="orca_oracle", num_blocks=33, max_model_len=256, block_size=16):
    """Blocks 1..32 form one buddy root of 32 when num_blocks is 33."""
    return OrcaBlockManager.create(policy=policy, max_model_len=max_model_len, num_blocks=num_blocks,
                                   block_size=block_size)


def free_runs(bm):
    return sorted(bm.reservations.buddy.free_runs)


# ---------------------------------------------------------------- OrcaBlockManager, pinned

def test_allocate_reserves_a_pinned_contiguous_run_and_tables_cover_tokens_so_far():
    bm0 = orca("orca_oracle")
    bm, num_cached = bm0.allocate("a", list(range(20)), max_new_tokens=30)  # 50 slots: 4 blocks
    assert num_cached == 0 and bm0.seq_ids == () and bm0.num_free_blocks == 32  # old snapshot untouched
    assert bm.block_table("a") == (1, 2) and bm.num_tokens("a") == 20  # run 1..4, tokens in 1..2
    assert bm.slot_mapping("a", 0, 3) == [16, 17, 18] and bm.slot_mapping("a", 18, 20) == [34, 35]
    assert free_runs(bm) == [(5, 4), (9, 8), (17, 16)] and bm.num_free_blocks == 28
    assert [bm.refcount(b) for b in (0, 1, 2, 4, 5)] == [0, 1, 1, 1, 0]  # reserved blocks are used
    bm, _ = bm.allocate("b", list(range(10)), max_new_tokens=20)  # oracle: 30 slots, 2 blocks
    assert bm.block_table("b") == (5,) and free_runs(bm) == [(7, 2), (9, 8), (17, 16)]
    with pytest.raises(ValueError, match="already exists"):
        bm.allocate("a", [1])
    bm.check_invariants()
    s = bm.stats()
    assert s["num_used_blocks"] == 6 and s["num_free_blocks"] == 26 and s["num_seqs"] == 2
    assert s["num_reserved_slots"] == 80 and s["num_token_slots"] == 30 and s["largest_free_run"] == 16
    assert set(BlockManager.create(33, 16).stats()) <= set(s)  # BlockManager's keys, and more


@pytest.mark.parametrize("policy, prompt, max_new, run", [
    ("orca_max", 3, 2, 16),        # the model's length, 256 slots, whatever the request
    ("orca_pow2", 20, 30, 4),      # 20 + 32 = 52 slots: 4 blocks
    ("orca_pow2", 20, 33, 8),      # 20 + 64 = 84 slots: 6 blocks -> a run of 8
    ("orca_oracle", 20, 30, 4),    # 50 slots: 4 blocks
    ("orca_oracle", 40, 60, 8),    # 100 slots: 7 blocks -> a run of 8
    ("orca_oracle", 40, None, 16),  # no output budget: up to the model's length
    ("orca_oracle", 250, 100, 16),  # capped at max_model_len: the engine stops a sequence there
    ("orca_oracle", 300, 10, 16),   # a block-rounded length past the model's: capped, no error
])
def test_reservation_size_per_policy(policy, prompt, max_new, run):
    bm = orca(policy)
    assert bm.reservation_blocks(prompt, max_new) == run
    if prompt < 256:
        bm, _ = bm.allocate("s", list(range(prompt)), max_new_tokens=max_new)
        assert bm.reservations.buddy.allocation("s")[1] == run
        bm.check_invariants()


def test_append_stays_inside_the_reservation_without_device_work():
    bm, _ = orca("orca_oracle").allocate("a", list(range(15)), max_new_tokens=3)  # 18 slots: 2 blocks
    assert bm.num_blocks_to_append(["a"]) == 0
    bm, ops = bm.append([("a", 7)])
    assert ops == DeviceOps() and bm.num_tokens("a") == 16 and bm.block_table("a") == (1,)
    bm, _ = bm.append([("a", 8)])  # crosses into the second reserved block: no allocation
    assert bm.block_table("a") == (1, 2) and bm.slot_mapping("a", 16, 17) == [32]
    assert bm.num_free_blocks == 30
    bm, _ = bm.append([("a", 9)])  # 18 tokens: the reservation is full
    # a sequence that would outgrow its reservation asks for more than the pool: the scheduler
    # then ends it with finish_reason="length"
    assert bm.num_blocks_to_append(["a"]) > bm.num_free_blocks and not bm.can_append(["a"])
    with pytest.raises(OutOfBlocksError, match="outgrow"):
        bm.append([("a", 10)])
    with pytest.raises(ValueError, match="twice"):
        bm.num_blocks_to_append(["a", "a"])
    bm.check_invariants()


def test_admission_refused_when_no_run_fits_though_enough_blocks_are_free():
    bm = orca("orca_oracle")
    for name in "abcd":  # 100 + 28 = 128 slots: 8 blocks each, filling blocks 1..32
        bm, _ = bm.allocate(name, list(range(100)), max_new_tokens=28)
    assert [bm.block_table(n)[0] for n in "abcd"] == [1, 9, 17, 25] and bm.num_free_blocks == 0
    bm = bm.free(["a", "c"])  # 16 blocks free, in two runs of 8 that are not buddies
    assert free_runs(bm) == [(1, 8), (17, 8)] and bm.num_free_blocks == 16
    assert not bm.can_allocate(200, max_new_tokens=50)  # 250 slots: 16 blocks, no run of 16
    with pytest.raises(OutOfBlocksError, match="no free run of 16"):
        bm.allocate("e", list(range(200)), max_new_tokens=50)
    paged = BlockManager.create(17, 16)  # the same 16 free blocks, paged: it fits
    assert paged.can_allocate(200, max_new_tokens=50)
    assert bm.can_allocate(100, max_new_tokens=28)  # a run of 8 does fit
    bm = bm.free(["b"])  # 1..8 and 9..16 merge
    assert free_runs(bm) == [(1, 16), (17, 8)] and bm.can_allocate(200, max_new_tokens=50)
    bm = bm.free(["d"])
    assert free_runs(bm) == [(1, 32)] and bm.seq_ids == ()
    bm.check_invariants()


def test_orca_max_holds_model_length_runs_and_ignores_the_watermark():
    bm = orca("orca_max", num_blocks=65)  # 64 blocks: four runs of 16 (256 tokens)
    for i in range(4):
        assert bm.can_allocate(5, reserve=8, max_new_tokens=5)  # the reservation covers growth
        bm, _ = bm.allocate(i, [1] * 5, max_new_tokens=5)
    assert [bm.block_table(i) for i in range(4)] == [(1,), (17,), (33,), (49,)]
    assert bm.num_free_blocks == 0 and not bm.can_allocate(1, max_new_tokens=1)
    bm = bm.free([0, 1, 2, 3])
    assert bm.num_free_blocks == 64
    bm.check_invariants()


def test_sharing_swapping_and_bad_arguments_raise_clearly():
    bm, _ = orca().allocate("a", [1, 2, 3], max_new_tokens=4)
    for call in (lambda: bm.fork("a", "b"), lambda: bm.swap_out(["a"]), lambda: bm.swap_in(["a"]),
                 lambda: bm.can_swap_out(["a"]), lambda: bm.can_swap_in(["a"])):
        with pytest.raises(NotImplementedError, match="kv_policy='paged'"):
            call()
    with pytest.raises(NotImplementedError, match="prefix caching"):
        OrcaBlockManager.create(policy="orca_max", max_model_len=64, num_blocks=9, block_size=16,
                                enable_prefix_caching=True)
    with pytest.raises(ValueError):
        OrcaBlockManager.create(policy="orca_best", max_model_len=64, num_blocks=9, block_size=16)
    with pytest.raises(KeyError):
        bm.block_table("zz")
    with pytest.raises(IndexError):
        bm.slot_mapping("a", 0, 4)
    with pytest.raises(ValueError, match="twice"):
        bm.free(["a", "a"])


# ---------------------------------------------------------------- the real engine, the real model

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "To make a cup of tea, first", "The three primary colors are",
           "Python is a programming language that", "In 1969, the first humans"]
MAX_TOKENS = [6, 24, 12, 30, 18, 40]  # prompts of 5-10 tokens: at most 50 tokens, 4 blocks


def run_engine(llm, prompts):
    """Drives `engine.step()`: (generated token ids per request, peak running requests), checking
    the block manager's invariants after every step and that every block is free at the end."""
    engine = llm.engine
    for i, (prompt, max_tokens) in enumerate(zip(prompts, MAX_TOKENS)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          ignore_eos=True))
    finished, peak = {}, 0
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        peak = max(peak, len(engine.scheduler.running))
        engine.scheduler.block_manager.check_invariants()
    stats = engine.stats()
    assert stats["num_free_blocks"] == engine.num_blocks - 1 and stats["num_seqs"] == 0, stats
    outs = [finished[str(i)].outputs[0] for i in range(len(prompts))]
    assert [len(o.token_ids) for o in outs] == MAX_TOKENS
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs], peak, stats


@pytest.fixture(scope="module")
def paged_run(make_llm):
    # 16 usable blocks of 16 and a 64-token model length: Orca(Max) fits four 4-block runs
    llm = make_llm(num_blocks=17, max_model_len=64)
    prompts = [llm.tokenizer(p).input_ids for p in PROMPTS]
    tokens, peak, stats = run_engine(llm, prompts)
    return llm, prompts, tokens, peak


@pytest.mark.parametrize("policy", POLICIES)
def test_orca_policies_generate_exactly_what_paged_does(make_llm, paged_run, policy):
    paged_llm, prompts, paged_tokens, paged_peak = paged_run
    llm = make_llm(num_blocks=17, max_model_len=64, kv_policy=policy)
    assert isinstance(llm.engine.scheduler.block_manager, OrcaBlockManager)
    # Same pool size, same kernels: reuse the paged engine's runner (its KV pool and compiled
    # step shapes) so that only the block manager differs, and nothing compiles twice.
    llm.engine.runner = paged_llm.engine.runner
    tokens, peak, stats = run_engine(llm, prompts)
    assert tokens == paged_tokens
    assert stats["num_preemptions"] == 0  # reservations cover all growth
    assert peak <= paged_peak
    if policy == "orca_max":  # four 64-token runs in 16 blocks; paged runs all six at first
        assert peak == 4 < paged_peak == 6


# ---------------------------------------------------------------- bench/throughput.py helpers

def test_miniature_workload_scales_lengths_and_prompts_are_exact():
    w = throughput.make_workload("sharegpt_like", 64, seed=0, scale=8)
    assert w.max_model_len == 256
    assert [len(p) for p in w.prompts] == [r.prompt_len for r in w.requests]
    assert all(r.prompt_len + r.output_len <= 256 for r in w.requests)
    assert w == throughput.make_workload("sharegpt_like", 64, seed=0, scale=8)  # seeded


def test_metrics_and_sustained_rate_on_a_hand_made_run():
    w = throughput.make_workload("alpaca_like", 2, seed=0, scale=1)
    (a, b) = w.requests
    step = lambda finished, running, tokens, used, backlogged=False: throughput.Step(  # noqa: E731
        ("decode", 2, 4), 1.0, 2.0, 0.5, 0.0, 1.0, 2, 0, 0, running, tokens, used, backlogged, finished)
    steps = [step((), 2, 30, 64), step(("0",), 1, 20, 32, True), step(("1",), 0, 0, 0)]
    m = throughput.metrics(w, steps, [0.0, 1.0, 3.0], [1.0, 2.0, 1.0], pool_slots=128)
    assert m["makespan_s"] == 4.0 and m["requests_per_s"] == 0.5
    assert m["output_tokens_per_s"] == (a.output_len + b.output_len) / 4
    assert m["normalized_latency"]["mean"] == pytest.approx((3 / a.output_len + 4 / b.output_len) / 2)
    assert m["kv_utilization"] == pytest.approx((30 + 40) / (64 + 64))  # duration-weighted
    assert m["peak_running"] == 2 and m["backlogged_output_tokens_per_s"] == 1.0
    curve = [dict(rate=r, normalized_latency=dict(mean=v)) for r, v in ((1, 0.1), (2, 0.15), (4, 0.21), (8, 0.1))]
    assert throughput.sustained(curve) == 2  # 0.21 > 2 x 0.1 ends the curve
    assert throughput.sustained(curve[:1] + [dict(rate=3, skipped="x")]) == 1


def test_offline_recost_charges_each_shape_its_median_or_its_fastest_run():
    bench = object.__new__(throughput.Bench)  # the cost table alone: no model
    bench.clock, bench.pool_slots = "cpu", 128
    shape = ("decode", 2, 4)
    bench.device_times = {shape: [(9.0, 0.5), (9.0, 0.2), (9.0, 0.3)]}  # (wall, cpu) per run
    w = throughput.make_workload("alpaca_like", 2, seed=0, scale=1)
    # host CPU 0.6 s per step (cpu 1.0 minus 0.4 in the model step); the model step: median 0.3, min 0.2
    steps = [throughput.Step(shape, 1.0, 2.0, 0.4, 0.0, 0.0, 2, 0, 0, 1, 10, 16, False, finished)
             for finished in (("0",), ("1",))]
    assert bench.step_cost(steps[0]) == pytest.approx(0.9)
    assert bench.step_cost(steps[0], "min") == pytest.approx(0.8)
    assert bench.recost(w, steps)["makespan_s"] == pytest.approx(1.8)
    assert bench.recost(w, steps, "min")["makespan_s"] == pytest.approx(1.6)
    bench.clock = "wall"
    assert bench.step_cost(steps[0], "min") == 2.0


def test_a_saved_offline_run_gives_the_rate_grid_only_for_the_same_experiment(tmp_path):
    offline = {s: dict(requests_per_s=rps, num_requests=4) for s, rps in (("paged", 0.2), ("orca_max", 0.1))}
    saved = dict(settings=dict(scale=8, pool_slots=throughput.POOL_SLOTS // 8), offline={"sharegpt_like": offline})
    path = tmp_path / "offline.json"
    path.write_text(json.dumps(saved))
    found = throughput.saved_offline(path, 8, {"sharegpt_like": 96})
    assert found["sharegpt_like"]["paged"] == dict(offline["paged"], source=str(path))
    grid = throughput.rate_grid(found["sharegpt_like"], 3)
    assert grid == pytest.approx([0.05, 0.05 * 5 ** 0.5, 0.25])  # half Orca(Max)'s rate to 1.25x paged's
    with pytest.raises(ValueError, match="--scale 8"):
        throughput.saved_offline(path, 1, {"sharegpt_like": 96})
    with pytest.raises(ValueError, match="--traces"):
        throughput.saved_offline(path, 8, {"alpaca_like": 256})
    del saved["offline"]["sharegpt_like"]["orca_max"]
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="orca_max"):
        throughput.saved_offline(path, 8, {"sharegpt_like": 96})
