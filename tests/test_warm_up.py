"""No compilation while serving: `LLMEngine.warm_up` builds every executable the engine's limits allow
(`jpaged.device.batch.StepShapes`), so that a workload of mixed prompt lengths, batch sizes and
sampling settings, with preemption, compiles nothing more: neither by the runner's count nor by
JAX's own lowering events. Without compiling anything, random steps within the limits are checked to
pack only at shapes the warm-up enumerates (for each attention backend's inputs), and at exactly the
shapes it compiles. /metrics reports the warm-up and the compilations after it. The `jpaged serve`
flags are tested in tests/test_cli.py.

The warmed engine is small (2 sequences, a 32-token context, a 4-block pool): 34 executables."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from jpaged import SamplingParams
from jpaged.device import runner
from jpaged.device.batch import StepShapes, _tiles, bucket_values, row_bucket
from jpaged.entrypoints.server import ServerConfig

LIMITS = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=32, num_blocks=4)
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # every new executable is lowered first


class Lowerings:
    """JAX's lowering events while open: any executable built in this process (by the runner or not)."""

    def __enter__(self):
        self.events = []
        self._listener = lambda event, duration, **kw: self.events.append(event) if event == LOWERING else None
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


@pytest.fixture(scope="module")
def warmed(make_llm):
    llm = make_llm(**LIMITS)
    progress = []
    summary = llm.engine.warm_up(lambda done, total: progress.append((done, total)))
    return llm, summary, progress


def test_warm_up_builds_every_shape_and_serving_compiles_nothing(warmed):
    llm, summary, progress = warmed
    engine = llm.engine
    # 6 token buckets (16..40: the ragged step's 32-token budget and up to 2 decode rows), 2 decode row counts,
    # the sampler for 1 or 2 logits rows, 1 or 32 top log-probabilities, 3 variants, without and with a
    # structured-output mask, 1 or 2 copies
    assert summary.executables == {"prefill_step": 6, "decode_step": 2, "sample": 24, "copy_blocks": 2}
    assert summary.built == 34 and progress[-1] == (34, 34) and len(progress) == 34
    assert engine.stats()["num_warm_up_compilations"] == 34 and engine.stats()["num_compilations_after_warm_up"] == 0
    ids = [[1], [9, 8, 7], list(range(100, 109)), list(range(200, 217)), list(range(300, 325))]
    mixed = [SamplingParams(max_tokens=30, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
             SamplingParams(max_tokens=12, n=2, temperature=1.0, top_k=5, seed=2, ignore_eos=True),
             SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True),
             SamplingParams(max_tokens=6, beam_width=2)]
    records = []
    engine.add_observer(records.append)
    try:
        with Lowerings() as lowerings:
            outputs = llm.generate(ids, mixed, use_tqdm=False)  # batches of 1 and 2, preempted and re-prefilled
            for prompt in ids[:2]:  # alone: batches of one
                llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        engine.remove_observer(records.append)
    assert all(o.finished and o.error is None for o in outputs)
    kinds = {(r.kind, r.num_rows) for r in records}
    assert {("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)} <= kinds, kinds
    assert engine.stats()["num_preemptions"] > 0, "meant to preempt and re-prefill"
    assert any(c.name == "copy_blocks" for r in records for c in r.calls), "meant to copy on write"
    assert not any(r.compiled for r in records)
    assert lowerings.events == [] and engine.stats()["num_compilations_after_warm_up"] == 0
    # a shape outside the engine's buckets (packed without them) is counted: the check above can fail
    row = type("Row", (), dict(token_ids=[0], start_position=0, slots=[0], block_table=[0]))()
    with Lowerings() as lowerings:
        engine.runner.execute([row] * 3, decode=True)
    assert engine.runner.num_compilations_after_warm_up == 1 and lowerings.events


def test_async_warm_up_builds_feed_tokens(warmed, default_model):
    """With async scheduling a decode step run ahead takes its input tokens from the samples of the step
    before, on the device (`ModelRunner.feed_tokens`): the warm-up builds it too, for each decode row count
    (here the only executables missing from the runner the synchronous engine warmed), so that an async run
    compiles nothing after it either."""
    import dataclasses

    from jpaged import LLMEngine

    llm, _, _ = warmed
    engine = LLMEngine(dataclasses.replace(llm.engine.config, async_scheduling=True), loaded=default_model,
                       runner=llm.engine.runner)
    summary = engine.warm_up()
    assert summary.executables["feed_tokens"] == 2 and summary.built == 2 and summary.num_executables == 36
    from test_async_scheduling import count_run_ahead

    records, ahead = [], count_run_ahead(engine)
    engine.add_observer(records.append)
    with Lowerings() as lowerings:
        for i, (prompt, max_tokens) in enumerate([([5, 6, 7], 8), ([8, 9], 12)]):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    assert ahead[0] >= 5, "meant to run steps ahead"
    assert not any(r.compiled for r in records) and lowerings.events == []
    assert engine.stats()["num_compilations_after_warm_up"] == 0


def test_metrics_count_compilations_after_the_warm_up(warmed):
    from test_server import Running

    llm, summary, _ = warmed
    running = Running(llm.engine, ServerConfig(model_name="smol"))
    try:
        r = running.client().completions.create(model="smol", prompt="Hi", max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason == "length"
        assert running.metric("jpaged_warm_up_executables") == summary.num_executables == 34
        assert running.metric("jpaged_warm_up_seconds") == pytest.approx(summary.seconds)
        assert running.metric("jpaged_compiles_total") == 0
    finally:
        running.stop()


# ---------------------------------------------------------------- every packed step is a warmed shape

class Row:
    def __init__(self, start: int, n: int, block_size: int):
        context = start + n
        self.token_ids, self.start_position = [1] * n, start
        self.block_table = list(range(1, -(-context // block_size) + 1))
        self.slots = [self.block_table[p // block_size] * block_size + p % block_size for p in range(start, context)]


READS = runner._READS  # attention backend -> whether it reads the plan / the block tables (prefill, decode)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("backend", list(READS))
def test_random_steps_pack_at_enumerated_shapes(backend, prefix_caching):
    """Steps of random rows within the limits (prefill: fresh prompts, cached prefixes, sequences re-prefilled
    whole; decode: any contexts) pack at dims `all_dims` lists, as arrays of exactly `abstract_inputs`' shapes,
    with logits rows the sampler is warmed for."""
    plan, tables = READS[backend]
    length, block_size = 300, 8
    shapes = StepShapes(block_size=block_size, q_tile=16, prefill_k_tile=32, decode_k_tile=16, max_num_seqs=6,
                        max_prefill_tokens=700, max_model_len=length, max_width=-(-length // block_size),
                        prefix_caching=prefix_caching, reads_plan=plan, reads_tables=tables)
    known = {decode: set(shapes.all_dims(decode=decode)) for decode in (False, True)}
    logits_rows = set(bucket_values(1, shapes.max_num_seqs, row_bucket))
    rng = random.Random(f"{backend}{prefix_caching}")
    for _ in range(400):
        decode = rng.random() < 0.4
        rows, budget = [], shapes.max_prefill_tokens
        for _ in range(rng.randint(1, shapes.max_num_seqs)):
            n = 1 if decode else rng.choice([rng.randint(1, 4), rng.randint(1, length - 1)])
            start = rng.randint(0, length - n) if decode or prefix_caching else 0
            if n > budget and rows:
                break
            rows.append(Row(start, min(n, budget), block_size))
            budget -= len(rows[-1].token_ids)
            if budget <= 0:
                break
        q_tile, k_tile = (1, shapes.decode_k_tile) if decode else (shapes.q_tile, shapes.prefill_k_tile)
        dims = shapes.dims(rows, decode=decode, tiles=_tiles(rows, q_tile, k_tile, k_tile // block_size))
        assert dims in known[decode], (decode, [(r.start_position, len(r.token_ids)) for r in rows], dims)
        assert dims.num_rows in logits_rows
        packed = jax.tree.map(np.shape, shapes.pack(rows, decode=decode))
        assert packed == jax.tree.map(lambda x: x.shape, shapes.abstract_inputs(dims, decode=decode))
