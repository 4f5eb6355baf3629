"""The Orca baselines of `bench/baselines/orca.py`: `OrcaKVCacheManager` (contiguous buddy
reservations behind the `KVCacheManager` protocol) pinned against the buddy allocator, then the real
engine on the real model: memory management must never change what is generated, only how much
runs at once. Also the helpers of `bench/throughput.py`.
"""

from __future__ import annotations

import json

import pytest

from bench import throughput
from bench.baselines.orca import POLICIES, OrcaKVCacheManager, orca
from bench.clock import ShapeClock, TimedStep
from jpaged import SamplingParams
from jpaged.core.block_manager import BlockManager
from jpaged.core.kv_cache_manager import (DeviceOps, ForkingKVCacheManager, KVCacheManager, KVCacheSpec,
                                          OutOfBlocksError, SwappingKVCacheManager)


def ids(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def manager(policy="orca_oracle", num_blocks=33, max_model_len=256, block_size=16, output_lens=None):
    """Blocks 1..32 form one buddy root of 32 when num_blocks is 33."""
    return OrcaKVCacheManager.create(policy, num_blocks=num_blocks, block_size=block_size,
                                     max_model_len=max_model_len, output_lens=output_lens)


def free_runs(bm):
    return sorted(bm.reservations.buddy.free_runs)


# ---------------------------------------------------------------- OrcaKVCacheManager, pinned

def test_it_is_a_kv_cache_manager_that_neither_forks_nor_swaps():
    bm = manager()
    assert isinstance(bm, KVCacheManager)
    assert not isinstance(bm, ForkingKVCacheManager) and not isinstance(bm, SwappingKVCacheManager)
    paged = BlockManager.create(33, 16, num_cpu_blocks=4)
    assert isinstance(paged, ForkingKVCacheManager) and isinstance(paged, SwappingKVCacheManager)


def test_allocate_reserves_a_pinned_contiguous_run_and_tables_cover_tokens_so_far():
    bm0 = manager("orca_oracle", output_lens={ids(20): 30, ids(10, 100): 20})
    bm, num_cached = bm0.allocate("a", ids(20))  # 50 slots: 4 blocks
    assert num_cached == 0 and bm0.seq_ids == () and bm0.num_free_blocks == 32  # old snapshot untouched
    assert bm.block_table("a") == (1, 2) and bm.num_tokens("a") == 20  # run 1..4, tokens in 1..2
    assert bm.slot_mapping("a", 0, 3) == [16, 17, 18] and bm.slot_mapping("a", 18, 20) == [34, 35]
    assert free_runs(bm) == [(5, 4), (9, 8), (17, 16)] and bm.num_free_blocks == 28
    assert [bm.refcount(b) for b in (0, 1, 2, 4, 5)] == [0, 1, 1, 1, 0]  # reserved blocks are used
    bm, _ = bm.allocate("b", ids(10, 100))  # oracle: 30 slots, 2 blocks
    assert bm.block_table("b") == (5,) and free_runs(bm) == [(7, 2), (9, 8), (17, 16)]
    with pytest.raises(ValueError, match="already exists"):
        bm.allocate("a", [1])
    bm.check_invariants()
    s = bm.stats()
    assert s["num_used_blocks"] == 6 and s["num_free_blocks"] == 26 and s["num_seqs"] == 2
    assert s["num_reserved_slots"] == 80 and s["num_token_slots"] == 30 and s["largest_free_run"] == 16
    assert set(BlockManager.create(33, 16).stats()) <= set(s)  # BlockManager's keys, and more


@pytest.mark.parametrize("policy, prompt, output, run", [
    ("orca_max", 3, 2, 16),        # the model's length, 256 slots, whatever the request
    ("orca_pow2", 20, 30, 4),      # 20 + 32 = 52 slots: 4 blocks
    ("orca_pow2", 20, 33, 8),      # 20 + 64 = 84 slots: 6 blocks -> a run of 8
    ("orca_oracle", 20, 30, 4),    # 50 slots: 4 blocks
    ("orca_oracle", 40, 60, 8),    # 100 slots: 7 blocks -> a run of 8
    ("orca_oracle", 40, None, 16),  # the oracle knows nothing of it: up to the model's length
    ("orca_oracle", 250, 100, 16),  # capped at max_model_len: the engine stops a sequence there
    ("orca_oracle", 300, 10, 16),   # a length past the model's: capped, no error
])
def test_reservation_size_per_policy(policy, prompt, output, run):
    bm = manager(policy, output_lens={} if output is None else {ids(prompt): output})
    assert bm.reservation_blocks(ids(prompt)) == run
    if prompt < 256:
        bm, _ = bm.allocate("s", ids(prompt))
        assert bm.reservations.buddy.allocation("s")[1] == run
        bm.check_invariants()


def test_append_stays_inside_the_reservation_without_device_work():
    bm, _ = manager("orca_oracle", output_lens={ids(15): 3}).allocate("a", ids(15))  # 18 slots: 2 blocks
    assert bm.num_blocks_to_append(["a"]) == 0
    bm, ops = bm.append([("a", 7)])
    assert ops == DeviceOps() and bm.num_tokens("a") == 16 and bm.block_table("a") == (1,)
    bm, _ = bm.append([("a", 8)])  # crosses into the second reserved block: no allocation
    assert bm.block_table("a") == (1, 2) and bm.slot_mapping("a", 16, 17) == [32]
    assert bm.num_free_blocks == 30
    bm, _ = bm.append([("a", 9)])  # 18 tokens: the reservation is full
    # a sequence that would outgrow its reservation asks for more than the pool: the scheduler
    # then ends it with finish_reason="length"
    assert bm.num_blocks_to_append(["a"]) > bm.num_free_blocks
    with pytest.raises(OutOfBlocksError, match="outgrow"):
        bm.append([("a", 10)])
    with pytest.raises(ValueError, match="twice"):
        bm.num_blocks_to_append(["a", "a"])
    bm.check_invariants()


def test_admission_refused_when_no_run_fits_though_enough_blocks_are_free():
    lens = {ids(100, k): 28 for k in range(4)} | {ids(200): 50}
    bm = manager("orca_oracle", output_lens=lens)
    for k, name in enumerate("abcd"):  # 100 + 28 = 128 slots: 8 blocks each, filling blocks 1..32
        bm, _ = bm.allocate(name, ids(100, k))
    assert [bm.block_table(n)[0] for n in "abcd"] == [1, 9, 17, 25] and bm.num_free_blocks == 0
    bm = bm.free(["a", "c"])  # 16 blocks free, in two runs of 8 that are not buddies
    assert free_runs(bm) == [(1, 8), (17, 8)] and bm.num_free_blocks == 16
    assert not bm.can_allocate([ids(200)])  # 250 slots: 16 blocks, no run of 16
    with pytest.raises(OutOfBlocksError, match="no free run of 16"):
        bm.allocate("e", ids(200))
    paged = BlockManager.create(17, 16)  # the same 16 free blocks, paged: it fits
    assert paged.can_allocate([ids(200)])
    assert bm.can_allocate([ids(100)])  # a run of 8 does fit
    assert not bm.can_allocate([ids(100), ids(100, 1), ids(100, 2)])  # three runs of 8 do not
    bm = bm.free(["b"])  # 1..8 and 9..16 merge
    assert free_runs(bm) == [(1, 16), (17, 8)] and bm.can_allocate([ids(200)])
    bm = bm.free(["d"])
    assert free_runs(bm) == [(1, 32)] and bm.seq_ids == ()
    bm.check_invariants()


def test_orca_max_holds_model_length_runs_and_honours_the_reserve_asked_for():
    bm = manager("orca_max", num_blocks=65)  # 64 blocks: four runs of 16 (256 tokens)
    for i in range(4):
        assert bm.can_allocate([[1] * 5])  # the benchmarks ask for no watermark: a run covers growth
        assert not bm.can_allocate([[1] * 5], reserve=64 - 16 * i - 15)
        bm, _ = bm.allocate(i, [1] * 5)
    assert [bm.block_table(i) for i in range(4)] == [(1,), (17,), (33,), (49,)]
    assert bm.num_free_blocks == 0 and not bm.can_allocate([[1]])
    bm = bm.free([0, 1, 2, 3])
    assert bm.num_free_blocks == 64
    bm.check_invariants()


def test_prefix_caching_and_bad_arguments_are_refused_clearly():
    bm, _ = manager().allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match="no prefix caching"):
        orca("orca_max")(KVCacheSpec(num_blocks=9, block_size=16, enable_prefix_caching=True, max_model_len=64))
    with pytest.raises(ValueError):
        manager("orca_best")
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
    # Same pool, same kernels: the paged engine's runner (its KV pool and compiled step shapes) is
    # reused, so that only the KV cache manager differs and nothing compiles twice. The oracle knows
    # every request's output length; a reservation covers its growth: no watermark.
    oracle = {tuple(p): n for p, n in zip(prompts, MAX_TOKENS)}
    llm = make_llm(num_blocks=17, max_model_len=64, watermark=0.0, runner=paged_llm.engine.runner,
                   kv_cache_manager=orca(policy, oracle))
    assert isinstance(llm.engine.scheduler.block_manager, OrcaKVCacheManager)
    tokens, peak, stats = run_engine(llm, prompts)
    assert tokens == paged_tokens
    assert stats["num_preemptions"] == 0  # reservations cover all growth
    assert peak <= paged_peak
    if policy == "orca_max":  # four 64-token runs in 16 blocks; paged runs all six at first
        assert peak == 4 < paged_peak == 6


def test_the_engine_refuses_what_a_manager_cannot_do(make_llm, paged_run):
    paged_llm, prompts, _, _ = paged_run
    llm = make_llm(num_blocks=17, max_model_len=64, runner=paged_llm.engine.runner, kv_cache_manager=orca("orca_max"))
    for params in (SamplingParams(n=2), SamplingParams(beam_width=2)):
        with pytest.raises(ValueError, match="cannot share blocks"):
            llm.engine.add_request("x", prompts[0], params)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="no CPU swap space: use preemption_mode='recompute'"):
        make_llm(num_blocks=17, max_model_len=64, runner=paged_llm.engine.runner,
                 kv_cache_manager=orca("orca_max"), preemption_mode="swap", swap_space=0.001)
    with pytest.raises(ValueError, match="its num_blocks is 17, the engine's 18"):
        make_llm(num_blocks=18, max_model_len=64, runner=paged_llm.engine.runner)


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
        "decode", TimedStep(("decode",), 0.5, 0.5), 2.0, 0.0, 1.0, 2, 0, 0, running, tokens, used, backlogged,
        finished)
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
    bench.clock, bench.pool_slots, bench.shapes = "cpu", 128, ShapeClock(time="cpu")
    shape = ("decode", (2, 4), ())
    bench.shapes.runs[shape] = [(9.0, 0.5), (9.0, 0.2), (9.0, 0.3)]  # (wall, cpu) per run
    w = throughput.make_workload("alpaca_like", 2, seed=0, scale=1)
    # host CPU 0.6 s per step (0.4 measured in the model step); the model step: median 0.3, min 0.2
    steps = [throughput.Step("decode", TimedStep(shape, 0.6, 0.4), 2.0, 0.0, 0.0, 2, 0, 0, 1, 10, 16, False,
                             finished) for finished in (("0",), ("1",))]
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
