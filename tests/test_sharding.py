"""Tensor and data parallelism on forced CPU devices (issue 13), against one device.

The checks need several devices, and `XLA_FLAGS=--xla_force_host_platform_device_count=6` acts only
before JAX starts, while this suite runs on one: `tests/sharding_worker.py` runs them in a process
of its own (once per session, about 1.5-2 minutes on two cores) and prints what it saw as JSON; the
tests below hold it to the one-device references it ran in the same process. The mix: 9 prompts
(3 sharing a system prompt, prefix caching on), greedy, beam search (width 2), parallel sampling
(n=2, seeded), and a pool of 10 blocks, so that requests are preempted, by recompute and by swap.

Several processes (`jax.distributed`): `two_processes` starts the worker twice (`--process`), 3 forced
CPU devices each, as one engine on data parallel 2 x tensor parallel 3 over the 6 global devices
(gloo collectives, a free local port, killed past a deadline), and holds both to the one-process run
on 6 devices.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import pytest

from workers import run_workers, worker_env

WORKER = pathlib.Path(__file__).with_name("sharding_worker.py")


@pytest.fixture(scope="module")
def seen():
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=worker_env(6), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["num_devices"] == 6
    return result


@pytest.fixture(scope="module")
def two_processes():
    with socket.socket() as s:  # a free port for process 0's coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argvs = [[str(WORKER), "--process", f"127.0.0.1:{port}", "2", str(i)] for i in range(2)]
    return run_workers(argvs, worker_env(3), timeout=400)


def test_two_processes_give_one_processes_tokens(seen, two_processes):
    # the one-process reference: the same requests on the same 2 x 3 mesh of 6 devices, at PARAMS' lengths; the
    # two processes ran greedy and sampled requests to 8 tokens (a prefix of theirs), beam search as it was
    reference = seen["dp2xtp3_swap"]["tokens"]
    expected = [[t[:n] for t in r] for r, n in zip(reference, two_processes[0]["max_tokens"])]
    assert len(expected) >= 8 and [len(r) for r in expected][6:8] == [2, 2]  # with beam search and n=2
    layers, blocks, halves, block_size, _, head_dim = seen["pool_shape"]
    for i, run in enumerate(two_processes):
        assert run["process_id"] == i and run["num_devices"] == 6 and run["local_devices"] == 3
        # half the blocks, 1 KV head
        assert run["local_pool_shards"] == [[layers, blocks // 2, halves, block_size, 1, head_dim]] * 3
        assert run["tokens"] == expected, f"process {i}"
        assert run["num_preemptions"] > 0 and "read_blocks" in run["executables"], "meant to swap blocks out"
        assert run["prefix_cache_hit_rate"] > 0
        assert run["num_free_blocks"] == run["num_blocks"] - 2


def test_cli_on_two_processes_prints_on_process_0_alone(two_processes):
    first, second = (run["cli"] for run in two_processes)
    assert first["code"] == second["code"] == 0, (first["stderr"], second["stderr"])
    summary = json.loads(first["stdout"].splitlines()[-1])["summary"]
    assert summary["num_devices"] == 6 and summary["output_tokens"] == 2
    assert second["stdout"] == second["stderr"] == ""


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tensor_parallel_3_gives_one_devices_tokens(seen, mode):
    one, tp3 = seen[f"one_{mode}"], seen[f"tp3_{mode}"]
    assert one["num_devices"] == 1 and tp3["num_devices"] == 3
    assert one["num_preemptions"] > 0 and tp3["num_preemptions"] > 0, "the pool was meant to be too small"
    assert one["prefix_cache_hit_rate"] > 0
    assert len(one["tokens"]) >= 8
    assert [len(r) for r in one["tokens"]][6:8] == [2, 2]  # the beam-search and the n=2 requests
    assert tp3["tokens"] == one["tokens"]
    assert tp3["num_compilations"] == one["num_compilations"]  # the same shape buckets, nothing recompiled
    assert tp3["num_free_blocks"] == tp3["num_blocks"] - 1  # every block back at the end


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("run, devices", [("dp2", 2), ("dp2xtp3", 6)])
def test_data_parallel_2_gives_one_devices_tokens(seen, mode, run, devices):
    one, dp2 = seen[f"one_{mode}"], seen[f"{run}_{mode}"]
    assert dp2["num_devices"] == devices and seen["dp_ranks"] == 2
    assert dp2["num_preemptions"] > 0, "each partition (4 usable blocks) was meant to be too small"
    assert dp2["prefix_cache_hit_rate"] > 0
    assert dp2["tokens"] == one["tokens"]
    assert dp2["num_free_blocks"] == dp2["num_blocks"] - 2  # every block back, but each partition's null block


def test_data_parallel_devices_hold_half_the_blocks_and_attention_needs_no_collective(seen):
    layers, blocks, halves, block_size, kv_heads, head_dim = seen["pool_shape"]
    assert seen["dp_pool_shards"] == [[layers, blocks // 2, halves, block_size, kv_heads, head_dim]] * 2
    for name, c in seen["dp_collectives"].items():
        assert c["in_loop"] == {} or set(c["in_loop"].values()) == {0}, (name, c)  # nothing in the layers
        assert sum(c["counts"].values()) <= 1, (name, c)  # the logits' gather, at the end
        assert "all-to-all" not in c["counts"]


def test_2x3_devices_hold_half_the_blocks_of_one_kv_head(seen):
    layers, blocks, halves, block_size, kv_heads, head_dim = seen["pool_shape"]
    assert seen["both_pool_shards"] == [[layers, blocks // 2, halves, block_size, 1, head_dim]] * 6
    for name, c in seen["both_collectives"].items():
        assert c["in_loop"] == {"all-reduce": 2}, (name, c)  # tensor parallel's two; data parallel adds none
        assert "all-to-all" not in c["counts"] and c["counts"]["all-reduce"] <= 3, (name, c)


def test_pallas_under_shard_map_on_local_blocks_gives_the_xla_tokens(seen):
    assert seen["pallas_dp2"] == seen["xla_one"]


def test_preemption_modes_agree(seen):
    assert seen["one_recompute"]["tokens"] == seen["one_swap"]["tokens"]


def test_steps_update_each_devices_pool_shard_in_place(seen):
    assert seen["pool_copies"]
    for name, c in seen["pool_copies"].items():
        assert c["aliased"] and c["copies"] == [] and c["layer_slices"] == [], (name, c)


def test_each_device_holds_a_third_of_the_kv_heads(seen):
    layers, blocks, halves, block_size, kv_heads, head_dim = seen["pool_shape"]
    assert halves == 2 and kv_heads == 3 and seen["pool_sharding"] == "P(None, None, None, None, 'model', None)"
    assert [shape for _, shape in seen["pool_shards"]] == [[layers, blocks, 2, block_size, 1, head_dim]] * 3
    assert len({device for device, _ in seen["pool_shards"]}) == 3
    assert seen["tp3_recompute"]["kv_head_replication"] == 1


def test_fewer_kv_heads_than_devices_are_replicated_not_split(seen):
    r = seen["replication"]  # 6 query heads, 2 KV heads, tensor parallel 6
    assert r["kv_head_replication"] == 3
    assert r["shard_shapes"] == [[2, 4, 2, 16, 1, 16]] * 6  # 2 x 3 = 6 KV heads stored, one whole head a device
    assert r["max_abs_diff"] < 1e-5 * max(1.0, r["max_abs_logit"])


def test_pallas_under_shard_map_gives_the_xla_tokens(seen):
    assert seen["pallas_tp3"] == seen["xla_one"]


@pytest.mark.parametrize("run", ["native_tp3", "native_dp2"])
def test_native_kernel_under_shard_map_gives_the_xla_tokens(seen, run):
    if run not in seen:
        pytest.skip("the native CPU kernel was not built on this machine")
    assert seen[run] == seen["xla_one"]


def test_a_users_own_strategy_and_mesh(seen):
    # LLM(sharding=tensor_parallel(vocab=True), mesh=make_mesh(3)): the embedding split by vocabulary too
    assert seen["vocab_embed_shards"] == [[49152 // 3, 576]] * 3
    assert seen["vocab_tp3"] == seen["xla_one"]


def test_compiled_steps_have_two_all_reduces_per_layer(seen):
    assert seen["collectives"], "no compiled step recorded"
    assert any(name.startswith("decode_step") for name in seen["collectives"])
    for name, c in seen["collectives"].items():
        # o projection and MLP down: one all-reduce each, in the layer loop's body (run num_layers times);
        # nothing else (the pool never moves between devices, the logits are computed replicated)
        assert c["counts"] == {"all-reduce": 2}, (name, c)
        assert c["in_loop"] == {"all-reduce": 2}, (name, c)


@pytest.mark.parametrize("run, devices", [("cli_tp3", 3), ("cli_dp2", 2)])
def test_cli_runs_sharded(seen, run, devices):
    # jpaged generate hi --tensor-parallel-size 3 (--data-parallel-size 2) --json: the flag reaches the engine
    assert seen[run]["code"] == 0
    assert seen[run]["summary"]["output_tokens"] == 4 and seen[run]["summary"]["num_devices"] == devices


@pytest.mark.parametrize("case, message", [
    ("heads", "9 query heads do not divide over 2 devices"),
    ("devices", "7 devices asked for"),
    ("zero", "tensor_parallel_size must be an integer >= 1"),
    ("dp_devices", "7 devices asked for"),
    ("both", "9 query heads do not divide over 2 devices"),
])
def test_cli_bad_tensor_parallel_size_exits_2_with_one_line(seen, case, message):
    out = seen["cli"][case]
    assert out["code"] == 2
    assert out["stderr"].count("\n") == 1 and out["stderr"].startswith("error: ") and message in out["stderr"]


@pytest.mark.parametrize("case, message", [
    ("mesh_axis", "lacks the axis 'model'"),
    ("both", "not both"),
    ("split_head_dim", "never cut"),
])
def test_bad_sharding_configurations_are_refused(seen, case, message):
    assert message in seen["config"][case] and "\n" not in seen["config"][case]


# ---- in this process (one device): the rules alone -----------------------------------------------

def test_rules_give_the_megatron_partition_specs():
    from jax.sharding import PartitionSpec as P

    from jpaged.device.sharding import (PARAM_AXES, POOL_AXES, data_and_tensor_parallel, data_parallel, replicated,
                                        tensor_parallel)

    tp = tensor_parallel()
    specs = {name: tp.spec(axes) for name, axes in PARAM_AXES.items()}
    assert specs["wq"] == specs["wk"] == specs["wv"] == P(None, None, "model", None)  # by heads
    assert specs["wo"] == P(None, "model", None, None)  # by heads, on its input axis
    assert specs["w_gate"] == specs["w_up"] == P(None, None, "model")  # by columns
    assert specs["w_down"] == P(None, "model", None)  # by rows
    assert specs["attn_norm"] == specs["mlp_norm"] == P(None, None) and specs["final_norm"] == P(None)
    assert specs["embed"] == P(None, None) and tensor_parallel(vocab=True).spec(PARAM_AXES["embed"]) == P("model", None)
    assert tp.spec(POOL_AXES) == P(None, None, None, None, "model", None)  # the pool by KV heads
    assert replicated().spec(POOL_AXES) == P(None, None, None, None, None, None)
    assert data_parallel().spec(POOL_AXES) == P(None, "data", None, None, None, None)  # the pool by blocks
    both = data_and_tensor_parallel()
    assert both.spec(POOL_AXES) == P(None, "data", None, None, "model", None) and both.spec(PARAM_AXES["wq"]) == specs["wq"]


def test_engine_config_refuses_more_devices_than_exist():
    import jax

    from jpaged.engine import EngineConfig

    with pytest.raises(ValueError, match=f"{jax.device_count() + 1} devices asked for"):
        EngineConfig(tensor_parallel_size=jax.device_count() + 1)
    with pytest.raises(ValueError, match="give sharding and mesh together"):
        from jpaged.device.sharding import tensor_parallel
        EngineConfig(sharding=tensor_parallel())
