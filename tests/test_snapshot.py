"""Paused engines (`LLMEngine.save` / `LLMEngine.restore`, `jpaged/engine/snapshot.py`).

The reference is the uninterrupted run of the same requests on the same settings: a run paused after
k steps and finished by a restored engine, in another process, must give exactly its tokens (greedy,
seeded sampling, parallel sampling, beam search, with a group swapped out to CPU blocks at the
pause) and end with every block free. Bad directories and mismatched engines are refused with a
message naming the file or the setting.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jpaged import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.device.params import cast_params
from jpaged.device.quant import IN_AXES, QuantizedWeight, float_rows
from jpaged.engine import snapshot

# a small pool and CPU swap blocks: the requests below outgrow it, so a group is swapped out mid-run
SETTINGS = dict(block_size=16, num_blocks=14, preemption_mode="swap", swap_space=0.01, watermark=0.0)


def add_requests(engine) -> None:
    story = "Write a long story about a dragon named number {} and all of its adventures, in detail."
    for i in range(3):
        engine.add_request(f"parallel-{i}", story.format(i), SamplingParams(n=2, temperature=0.8, seed=i,
                                                                             max_tokens=40))
    engine.add_request("beam", "What is the capital of France?", SamplingParams(beam_width=3, max_tokens=20))
    engine.add_request("greedy", "List the planets of the solar system.", SamplingParams(temperature=0,
                                                                                         max_tokens=40))
    engine.add_request("seeded", "Name three colours.", SamplingParams(temperature=1.0, top_p=0.9, seed=7,
                                                                      max_tokens=30))


def finish(engine, outputs=None) -> dict:
    """Steps `engine` to the end; {request id: [token ids of each completion]} of what finishes."""
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
    return outputs


@pytest.fixture(scope="module")
def reference(default_model) -> dict:
    engine = LLMEngine(loaded=default_model, **SETTINGS)
    add_requests(engine)
    outputs = finish(engine)
    assert engine.stats()["num_preemptions"] > 0  # the pool is small enough to swap
    return outputs


@pytest.fixture(scope="module")
def paused(default_model, tmp_path_factory):
    """An engine paused, at the first step after which a group is swapped out while beam search
    and parallel sampling are in flight: (its directory, what finished before the pause, the engine)."""
    engine = LLMEngine(loaded=default_model, **SETTINGS)
    add_requests(engine)
    before = {}
    while True:
        for out in engine.step():
            if out.finished:
                before[out.request_id] = [c.token_ids for c in out.outputs]
        s = engine.scheduler
        in_flight = {g.request_id for g in [*s.running, *s.swapped]}
        if s.swapped and {"beam", "parallel-0"} <= in_flight:
            break
        assert engine.has_unfinished(), "the run ended before a group was swapped out"
    path = tmp_path_factory.mktemp("paused") / "engine"
    engine.save(path)
    return path, before, engine


RESUME = """
import json, sys
from jpaged.engine import LLMEngine
engine = LLMEngine.restore(sys.argv[1])
outputs = {}
while engine.has_unfinished():
    for out in engine.step():
        if out.finished:
            outputs[out.request_id] = [c.token_ids for c in out.outputs]
engine.scheduler.block_manager.check_invariants()
print(json.dumps({"outputs": outputs, "stats": engine.stats()}))
"""


def test_a_paused_engine_finishes_in_a_new_process_with_the_uninterrupted_tokens(paused, reference):
    path, before, _ = paused
    run = subprocess.run([sys.executable, "-c", RESUME, str(path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert {**before, **result["outputs"]} == reference
    assert set(result["outputs"]) >= {"beam", "parallel-0"}
    stats = result["stats"]
    assert stats["num_free_blocks"] == SETTINGS["num_blocks"] - 1 and stats["swapped"] == 0
    assert stats["num_steps"] > 0 and stats["num_preemptions"] > 0  # the statistics went on, not from zero


def test_the_paused_engine_and_a_restored_copy_both_go_on(paused, reference, default_model):
    path, before, engine = paused
    restored = LLMEngine.restore(path, loaded=default_model)
    assert restored.stats()["swapped"] == len(engine.scheduler.swapped) > 0
    assert {**before, **finish(restored)} == reference
    assert {**before, **finish(engine)} == reference  # saving changed nothing in the engine saved
    restored.add_request("after", "Hello", SamplingParams(temperature=0, max_tokens=4))  # and it takes new work
    assert len(finish(restored)["after"][0]) == 4


def test_restoring_into_another_model_or_geometry_is_refused(paused, default_model):
    path = paused[0]
    with pytest.raises(ValueError, match="only model, attention_backend, interpret may be given, not block_size"):
        LLMEngine.restore(path, loaded=default_model, block_size=32)
    other = default_model.params.replace(final_norm=default_model.params.final_norm * 1.5)
    with pytest.raises(ValueError, match="saved with another model .*give the saved model"):
        LLMEngine.restore(path, loaded=dataclasses.replace(default_model, params=other))
    # another configuration is refused before the engine is built: these weights (none) are never read
    other_config = dataclasses.replace(default_model.config, rope_theta=default_model.config.rope_theta * 2)
    with pytest.raises(ValueError, match="saved with another model .* has another configuration: give the saved"):
        LLMEngine.restore(path, loaded=dataclasses.replace(default_model, config=other_config, params=None))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float_rows_have_the_fingerprint_of_the_arrays_they_came_from(default_model, dtype, tied):
    """What an engine on one CPU device holds (its dense weights as [out, in] rows) is the same model as
    the arrays it came from: a save there restores on a device without rows, and the other way round."""
    params = cast_params(default_model.params, dtype)
    if not tied:  # a head of its own, [hidden, vocab]
        params = params.replace(lm_head=params.embed.T + 0)
    layers = params.layers.replace(**{name: float_rows(getattr(params.layers, name), getattr(params.layers, name)
                                                       .shape[1:], axes)
                                      for name, axes in IN_AXES.items() if name not in ("embed", "lm_head")})
    embed = float_rows(params.embed, params.embed.shape, IN_AXES["embed"])
    lm_head = embed.T if tied else float_rows(params.lm_head, params.lm_head.shape, IN_AXES["lm_head"])
    plain = dataclasses.replace(default_model, params=params)
    rows = dataclasses.replace(default_model, params=params.replace(layers=layers, embed=embed, lm_head=lm_head))
    assert isinstance(rows.params.layers.wo, QuantizedWeight)
    assert snapshot.model_identity(rows) == snapshot.model_identity(plain)
    # and it is a fingerprint of the values: one sampled value changed in the rows changes it
    changed = layers.wo.replace(values=layers.wo.values.at[0, 0, 0].add(1))
    other = dataclasses.replace(rows, params=rows.params.replace(layers=layers.replace(wo=changed)))
    assert snapshot.model_identity(other)["fingerprint"] != snapshot.model_identity(plain)["fingerprint"]


def test_missing_foreign_and_truncated_directories_are_named(paused, default_model, tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'nowhere'}: no such directory"):
        LLMEngine.restore(tmp_path / "nowhere")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"{foreign / snapshot.MARKER}: not a paused jpaged engine"):
        LLMEngine.restore(foreign)
    with pytest.raises(ValueError, match="holds no paused engine"):  # and saving there would clobber it
        paused[2].save(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"

    broken = tmp_path / "broken"
    shutil.copytree(paused[0], broken)
    step = max(int(p.name) for p in broken.iterdir() if p.name.isdigit())
    files = sorted((p for p in (broken / str(step) / "state").rglob("*") if p.is_file()),
                   key=lambda p: -p.stat().st_size)
    with open(files[0], "r+b") as f:  # the largest array file, cut in half
        f.truncate(files[0].stat().st_size // 2)
    with pytest.raises(ValueError, match=f"{broken / str(step) / 'state'}: cannot read the saved state"):
        LLMEngine.restore(broken, loaded=default_model)


def test_an_interrupted_save_leaves_the_previous_one_readable(paused, default_model, tmp_path, monkeypatch):
    path = tmp_path / "engine"
    shutil.copytree(paused[0], path)
    engine = paused[2]

    def broken_pools():  # an array that cannot be read: the write fails midway through the new step
        lost = jnp.zeros(5)
        lost.delete()
        return {**real(), "kv": lost}

    real = engine.runner.pool_state
    monkeypatch.setattr(engine.runner, "pool_state", broken_pools)
    with pytest.raises(RuntimeError, match="deleted"):
        engine.save(path)
    assert [p.name for p in path.iterdir() if "tmp" in p.name]  # the unfinished step was left, unpublished
    monkeypatch.undo()
    step, manifest = snapshot.read_manifest(path)
    restored = LLMEngine.restore(path, loaded=default_model)
    assert restored.num_steps == manifest["num_steps"] and restored.stats()["swapped"] > 0
    assert int(engine.save(path).name) == step + 1  # the next save goes on from the complete one


def test_an_engine_without_swap_space_and_with_prefix_caching_round_trips(default_model, tmp_path):
    system = "You are a helpful assistant who answers in one short sentence. " * 3
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def start():  # the first request fills the prefix cache; the next two hit it
        e = LLMEngine(loaded=default_model, block_size=16, num_blocks=64, enable_prefix_caching=True)
        e.add_request("q0", system + "What is 2+2?", params)
        outputs = {o.request_id: [c.token_ids for c in o.outputs] for o in e.step() + e.step() if o.finished}
        for i, question in enumerate(["What colour is the sky?", "Name a fruit."], 1):
            e.add_request(f"q{i}", system + question, params)
        return e, outputs

    engine, before = start()
    reference = finish(engine, dict(before))
    paused, before = start()
    before.update({o.request_id: [c.token_ids for c in o.outputs] for o in paused.step() if o.finished})
    assert paused.has_unfinished() and paused.runner.num_cpu_blocks == 0
    assert paused.stats()["prefix_cache_hit_rate"] > 0
    paused.save(tmp_path / "engine")
    restored = LLMEngine.restore(tmp_path / "engine", loaded=default_model)
    assert restored.stats()["prefix_cache_hit_rate"] == paused.stats()["prefix_cache_hit_rate"]
    assert {**before, **finish(restored)} == reference
