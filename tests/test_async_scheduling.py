"""Async scheduling (`EngineConfig.async_scheduling`) against the synchronous engine, its reference: the
same requests (greedy and seeded sampling, n > 1, stop strings and stop tokens, EOS, max_tokens of several
lengths, requests arriving mid-run, preemption by recompute and by swap in a small pool) give the same
tokens, text and finish reasons, steps do run ahead, and every block is free at the end."""

from __future__ import annotations

import pytest

from bench.scheduler_overhead import StubRunner
from jpaged import EngineConfig, LLMEngine, SamplingParams
from jpaged.device.attention import get_backend

PROMPTS = ["The capital of France is", "List three colors:", "Once upon a time", "def add(a, b):",
           "Water boils at", "My favourite fruit is"]


def mix(tokenizer) -> list[tuple[int, str, str, SamplingParams]]:
    """(arrival step, request id, prompt, params): a step of 0 is before the first."""
    comma = tokenizer(",", add_special_tokens=False).input_ids[0]
    return [
        (0, "greedy-long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=24)),
        (0, "stop-string", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, stop=[".", "\n"])),
        (0, "stop-token", PROMPTS[2], SamplingParams(temperature=0.9, seed=3, max_tokens=20, stop_token_ids=[comma])),
        (0, "n2-seeded", PROMPTS[3], SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=7, max_tokens=13)),
        (2, "late-short", PROMPTS[4], SamplingParams(temperature=0, max_tokens=3)),
        (5, "late-seeded", PROMPTS[5], SamplingParams(temperature=1.0, seed=11, max_tokens=9, stop=[" the"])),
        (9, "late-greedy", PROMPTS[0], SamplingParams(temperature=0, max_tokens=7)),
    ]


def run(engine: LLMEngine, requests) -> dict:
    """Steps `engine` through `requests` (each added before the step it names); every finished request's
    completions as (token ids, text, finish reason)."""
    done, step = {}, 0
    while step <= max(r[0] for r in requests) or engine.has_unfinished():
        for arrival, request_id, prompt, params in requests:
            if arrival == step:
                engine.add_request(request_id, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
        step += 1
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == engine.num_blocks - 1, "blocks leaked"
    return done


def count_run_ahead(engine: LLMEngine) -> list[int]:
    """A one-element list counting the steps `engine` runs ahead of its step in flight."""
    count, can = [0], engine._can_run_ahead

    def spy(previous):
        ahead = can(previous)
        count[0] += ahead
        return ahead

    engine._can_run_ahead = spy
    return count


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_async_outputs_are_the_synchronous_ones(default_model, preemption_mode):
    """The real model (its rows' input tokens fed from the device) in a pool small enough to preempt."""
    requests = mix(default_model.tokenizer)
    config = EngineConfig(num_blocks=14, block_size=4, max_num_seqs=6, preemption_mode=preemption_mode,
                          swap_space=0.01 if preemption_mode == "swap" else 0.0)
    sync = LLMEngine(config, loaded=default_model)
    want = run(sync, requests)
    assert sync.scheduler.num_preemptions > 0, "the pool must be small enough to preempt"
    engine = LLMEngine(config, loaded=default_model, runner=sync.runner, async_scheduling=True)
    ahead = count_run_ahead(engine)
    assert run(engine, requests) == want
    assert ahead[0] >= 5
    assert {reason for completions in want.values() for _, _, reason in completions} >= {"stop", "length"}


def test_rows_that_fill_their_bucket_are_fed_the_samples_without_an_executable(default_model):
    """A step run ahead takes its rows' input tokens from the samples of the step before: the sampler's
    token ids as they are where the rows fill their bucket in order (one stream: no `feed_tokens` run),
    through `feed_tokens` where they do not (three rows in a bucket of four). Tokens as the synchronous
    engine's either way."""
    config = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4)
    sync = LLMEngine(config, loaded=default_model)
    for prompts in (PROMPTS[:1], PROMPTS[:3]):
        requests = [(0, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                    for i, prompt in enumerate(prompts)]
        want = run(sync, requests)
        engine = LLMEngine(config, loaded=default_model, runner=sync.runner, async_scheduling=True)
        ahead, records = count_run_ahead(engine), []
        engine.add_observer(records.append)
        assert run(engine, requests) == want and ahead[0] >= 8
        fed = sum(c.name == "feed_tokens" for r in records for c in r.calls)
        assert fed == (0 if len(prompts) == 1 else ahead[0])


CROWD = [(i % 7, f"r{i}", PROMPTS[i % len(PROMPTS)],
          SamplingParams(temperature=0.5, seed=i, max_tokens=5 + i % 23, n=1 + i % 3 // 2,
                         stop=["e"] if i % 5 == 0 else []))
         for i in range(60)]
# samples of one request stopping at different steps, with nothing waiting: every decode step runs ahead
SPLIT = [(0, f"s{i}", PROMPTS[i], SamplingParams(temperature=1.0, seed=i, max_tokens=40, n=3, stop=["q", "z"]))
         for i in range(3)]


@pytest.mark.parametrize("requests", [CROWD, SPLIT], ids=["crowd", "split"])
def test_async_on_a_stub_device(default_model, requests):
    """On the stub device (tokens a hash of seed, sample and step): the host's bookkeeping alone, at a
    scale the real model is too slow for here (a crowd preempting in a small pool), and samples of a
    request that stop a step before their siblings."""
    config = EngineConfig(num_blocks=40, block_size=16, max_num_seqs=48, attention_backend="xla")
    runner = StubRunner(default_model.config, default_model.params, num_blocks=40, block_size=16,
                        backend=get_backend("pallas", interpret=True))
    sync = LLMEngine(config, loaded=default_model, runner=runner)
    want = run(sync, requests)
    engine = LLMEngine(config, loaded=default_model, runner=runner, async_scheduling=True)
    ahead = count_run_ahead(engine)
    assert run(engine, requests) == want and ahead[0] >= 10
    if requests is CROWD:
        assert sync.scheduler.num_preemptions > 0
    else:  # each request's samples end at different steps
        assert all(len({len(ids) for ids, _, _ in completions}) > 1 for completions in want.values())


def test_async_scheduling_setting():
    """`--async-scheduling` sets the field (off by default), and a non-boolean is refused by name."""
    from jpaged.entrypoints.cli import build_parser, engine_config

    parser = build_parser()
    assert engine_config(parser.parse_args(["generate", "--async-scheduling", "hi"])).async_scheduling is True
    assert engine_config(parser.parse_args(["generate", "hi"])).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
