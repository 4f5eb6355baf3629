"""Every model family under tensor and data parallelism on forced CPU devices, against one device and HF.

`XLA_FLAGS=--xla_force_host_platform_device_count=4` acts only before JAX starts, while this suite runs on
one device: `tests/families_sharding_worker.py` builds each tiny random model of `tests/test_families.py`
(4 query heads, 2 KV heads) in a process of its own, runs greedy generation on one device, under tensor
parallel 2 (one KV head a device), tensor parallel 4 (each KV head stored twice, its biases and norms with
it) and data parallel 2 (the pool split by blocks), and HF's `generate` on the same prompts, and prints
what it got as JSON. Two workers run at once, on half the families each (compiling, most of their time, is
single-threaded): under a minute on two idle cores with a cold compilation cache. Not every family under every
strategy: the worker's `RUNS` says which, and why.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from workers import run_workers, worker_env

from test_families import FAMILIES

WORKER = pathlib.Path(__file__).with_name("families_sharding_worker.py")
sys.path.insert(0, str(WORKER.parent))
from families_sharding_worker import MAX_TOKENS, RUNS, halves  # noqa: E402  (the worker's flags act in its process alone)

CASES = [(name, run) for run, (_, families) in RUNS.items() if run != "one" for name in families]
DEVICES = {"tp2": 2, "tp4": 4, "dp2": 2}


@pytest.fixture(scope="module")
def seen():
    """Two workers at once, each on half the families (compiling is single-threaded), merged."""
    argvs = [[str(WORKER), "--families", ",".join(names)] for names in halves()]
    results = run_workers(argvs, worker_env(4), timeout=600)
    assert all(r["num_devices"] == 4 for r in results) and results[0]["prompt_ids"] == results[1]["prompt_ids"]
    return {"prompt_ids": results[0]["prompt_ids"], "families": {k: v for r in results for k, v in r["families"].items()}}


def test_every_family_but_two_rope_scalings_runs_sharded():
    assert {name for name, _ in CASES} == set(RUNS["one"][1]) == set(FAMILIES) - {"llama-yarn", "llama-linear"}
    assert {run for _, run in CASES} == set(DEVICES)


@pytest.mark.parametrize("name", RUNS["one"][1])
def test_one_device_gives_hf_generate_tokens(seen, name):
    family = seen["families"][name]
    assert family["one_devices"] == 1
    for prompt_ids, ours, hf in zip(seen["prompt_ids"], family["one"], family["hf"]):
        # the engine stops at the model's context (max_position_embeddings: 24 for llama-dynamic); HF runs past it
        assert len(ours) == min(MAX_TOKENS, family["max_model_len"] - len(prompt_ids)) > 0
        assert ours == hf[:len(ours)], f"{name}: prompt {prompt_ids[:4]}..."


@pytest.mark.parametrize("name, run", CASES)
def test_sharded_gives_one_devices_and_hf_tokens(seen, name, run):
    family = seen["families"][name]
    assert family[f"{run}_devices"] == DEVICES[run]
    assert family[f"{run}_kv_head_replication"] == (2 if run == "tp4" else 1)  # 2 KV heads on 4 devices
    assert family[run] == family["one"], f"{name} under {run}"
    assert all(ours == hf[:len(ours)] for ours, hf in zip(family[run], family["hf"])), f"{name} under {run}"
