"""Runs the sharding checks in a process of its own, on forced CPU devices, and prints one JSON object.

`tests/test_sharding.py` starts it (`python tests/sharding_worker.py`) with
`XLA_FLAGS=--xla_force_host_platform_device_count=6`, which must be set before JAX starts, while the rest of the
suite runs on one device. It records what the tests compare (tokens of every request on one device
and under tensor parallelism, each device's pool shard, collectives in the compiled steps, errors);
the assertions live in the test module.

`python tests/sharding_worker.py --process ADDRESS N I` is instead process I of N of one engine under
`jax.distributed` (`jpaged.device.distributed`; the test starts 2 with 3 forced CPU devices each): it
runs `SHORT` on data parallel 2 x tensor parallel 3 over the 6 global devices, process 0 alone giving
the requests, and prints what it got.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib
import re
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.sharding import collectives  # noqa: E402
from jpaged import LLM, SamplingParams, weights  # noqa: E402
from jpaged.device import distributed  # noqa: E402
from jpaged.device.config import ModelConfig  # noqa: E402
from jpaged.device.params import init_params  # noqa: E402
from jpaged.device.runner import ModelRunner  # noqa: E402
from jpaged.device.sharding import ShardingStrategy, make_mesh, tensor_parallel  # noqa: E402
from jpaged.device.attention import get_backend, native  # noqa: E402
from jpaged.engine import EngineConfig, llm_engine  # noqa: E402
from jpaged.entrypoints import cli  # noqa: E402
from workers import enable_compilation_cache  # noqa: E402

SYSTEM = ("You are a careful assistant. Answer in one short sentence, with no preamble, and never repeat "
          "the question. ")
PROMPTS = [SYSTEM + p for p in ("Name a colour.", "Name a fruit.", "Name a planet.")] + [
    "The capital of France is", "Write a haiku about autumn rain:", "1, 2, 3, 4,",
    "def fibonacci(n):", "The three primary colours are", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PARAMS = [GREEDY] * 6 + [SamplingParams(beam_width=2, temperature=0, max_tokens=6),
                         SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True), GREEDY]

# the two-process run: the same requests, greedy and sampled ones cut to 8 tokens (a prefix of PARAMS' tokens:
# each token depends on the tokens before it alone), beam search as in PARAMS (its result depends on max_tokens)
SHORT = [p if p.beam_width > 1 else dataclasses.replace(p, max_tokens=min(p.max_tokens, 8)) for p in PARAMS]
SWAP = {"num_blocks": 10, "preemption_mode": "swap", "swap_space": 0.05}  # prefix caching on, as every engine_run


def tokens(outs):
    return [[list(o.token_ids) for o in r.outputs] for r in outs]


def pool_copies(executable, shard_shape) -> dict:
    """Whether a compiled step aliases the donated pool to its output, and its lines that copy a
    device's pool shard or materialise one layer of it (tests/test_no_pool_copy.py, per device)."""
    text = executable.as_text()
    pool = "f32[" + ",".join(map(str, shard_shape)) + "]"
    layer = "f32[" + ",".join(map(str, shard_shape[1:])) + "]"
    return {"aliased": "input_output_alias" in text,
            "copies": [line for line in text.splitlines() if re.search(rf"= {re.escape(pool)}\S* copy\(", line)],
            "layer_slices": [line for line in text.splitlines() if re.search(rf"= {re.escape(layer)}", line)]}


def engine_run(model, prompts=PROMPTS, params=PARAMS, **kwargs):
    llm = LLM(loaded=model, num_blocks=kwargs.pop("num_blocks", 10), enable_prefix_caching=True, **kwargs)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    llm.engine.scheduler.block_manager.check_invariants()
    return llm, {"tokens": tokens(outs), "num_preemptions": stats["num_preemptions"],
                 "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"], "seconds": time.perf_counter() - t0,
                 "num_free_blocks": stats["num_free_blocks"], "num_compilations": stats["num_compilations"], "num_blocks": llm.engine.num_blocks,
                 "num_devices": stats["num_devices"], "kv_head_replication": stats["kv_head_replication"]}


def replication_check() -> dict:
    """A small random model with fewer KV heads (2) than devices (6): each KV head stored 3 times; the
    logits of a prefill and a decode step against the unsharded runner's."""
    config = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                         num_kv_heads=2, head_dim=16)
    params = init_params(config, jax.random.key(1))
    backend = get_backend("xla")

    class Row:
        def __init__(self, ids, start, table):
            self.token_ids, self.start_position, self.block_table = ids, start, table
            self.slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(ids))]

    prefill = [Row([5, 9, 11, 3, 7], 0, [1]), Row([2, 4, 6], 0, [2])]
    decode = [Row([13], 5, [1]), Row([17], 3, [2])]
    logits = {}
    for name, kwargs in (("one", {}), ("tp6", {"sharding": tensor_parallel(), "mesh": make_mesh(6)})):
        runner = ModelRunner(config, params, num_blocks=4, block_size=16, backend=backend, **kwargs)
        first = np.asarray(runner.execute(prefill, decode=False))[:2]
        second = np.asarray(runner.execute(decode, decode=True))[:2]
        logits[name] = (first, second, runner)
    runner = logits["tp6"][2]
    return {"kv_head_replication": runner.kv_head_replication,
            "shard_shapes": [list(s.data.shape) for s in runner.cache.kv.addressable_shards],
            "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(logits["one"][:2], logits["tp6"][:2])),
            "max_abs_logit": float(np.abs(logits["one"][0]).max())}


def cli_error(*argv) -> dict:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli.main(["generate", "hi", *argv])
        except SystemExit as e:  # argparse refused the arguments
            code = e.code
    return {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()}


def config_error(**kwargs) -> str:
    try:
        EngineConfig(**kwargs)
    except ValueError as e:
        return str(e)
    return ""


def main() -> None:
    enable_compilation_cache()
    result = {"num_devices": jax.device_count()}
    model = weights.load_model(None, dtype=jnp.float32)
    for mode in ("recompute", "swap"):
        extra = {"preemption_mode": mode, "swap_space": 0.05} if mode == "swap" else {}
        _, result[f"one_{mode}"] = engine_run(model, **extra)
        dp, result[f"dp2_{mode}"] = engine_run(model, data_parallel_size=2, **extra)
        both, result[f"dp2xtp3_{mode}"] = engine_run(model, data_parallel_size=2, tensor_parallel_size=3, **extra)
        llm, result[f"tp3_{mode}"] = engine_run(model, tensor_parallel_size=3, **extra)
    result["dp_pool_shards"] = [list(s.data.shape) for s in dp.engine.runner.cache.kv.addressable_shards]
    result["dp_collectives"] = {f"{name}:{i}": collectives(ex) for i, ((name, _), ex)
                                in enumerate(dp.engine.runner.executables.items()) if name.endswith("_step")}
    result["dp_ranks"] = dp.engine.scheduler.block_manager.num_partitions
    result["both_pool_shards"] = [list(s.data.shape) for s in both.engine.runner.cache.kv.addressable_shards]
    result["both_collectives"] = {f"{name}:{i}": collectives(ex) for i, ((name, _), ex)
                                  in enumerate(both.engine.runner.executables.items()) if name.endswith("_step")}
    runner = llm.engine.runner
    result["pool_sharding"] = str(runner.cache.kv.sharding.spec)
    result["pool_shards"] = [[str(s.device), list(s.data.shape)] for s in runner.cache.kv.addressable_shards]
    result["pool_shape"] = list(runner.cache.kv.shape)
    result["collectives"] = {f"{name}:{i}": collectives(ex) for i, ((name, _), ex)
                             in enumerate(runner.executables.items()) if name.endswith("_step")}
    result["num_layers"] = model.config.num_layers
    result["pool_copies"] = {f"{name}:{i}": pool_copies(ex, runner.cache.kv.addressable_shards[0].data.shape)
                             for i, ((name, _), ex) in enumerate(runner.executables.items()) if name.endswith("_step")}
    # the Pallas kernels (interpret mode) under shard_map against the XLA path on one device
    few, params = PROMPTS[3:6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # and a user's own strategy and mesh: tensor parallel with the embedding and LM head split by vocabulary too
    runs = (("xla_one", {"attention_backend": "xla"}),
            ("pallas_tp3", {"tensor_parallel_size": 3, "attention_backend": "pallas", "interpret": True}),
            ("vocab_tp3", {"sharding": tensor_parallel(vocab=True), "mesh": make_mesh(3)}),
            ("pallas_dp2", {"data_parallel_size": 2, "attention_backend": "pallas", "interpret": True}))
    if native.available_variants():  # the native CPU kernel under shard_map, on local heads and on local blocks
        runs += (("native_tp3", {"tensor_parallel_size": 3, "attention_backend": "native"}),
                 ("native_dp2", {"data_parallel_size": 2, "attention_backend": "native"}))
    for name, kwargs in runs:
        llm = LLM(loaded=model, num_blocks=16, **kwargs)
        result[name] = tokens(llm.generate(few, params, use_tqdm=False))
        if name == "vocab_tp3":
            result["vocab_embed_shards"] = [list(s.data.shape) for s in llm.engine.runner.params.embed.addressable_shards]
    result["replication"] = replication_check()
    llm_engine.load_model = lambda path, dtype=None: model  # the CLI's run below reuses the loaded model
    ok = cli_error("--tensor-parallel-size", "3", "--max-tokens", "4", "--num-blocks", "16", "--json")
    result["cli_tp3"] = {"code": ok["code"], "summary": json.loads(ok["stdout"].splitlines()[-1])["summary"]}
    result["cli"] = {"heads": cli_error("--tensor-parallel-size", "2"), "devices": cli_error("--tensor-parallel-size", "7"),
                     "zero": cli_error("--tensor-parallel-size", "0"),
                     "dp_devices": cli_error("--data-parallel-size", "7"),
                     "both": cli_error("--data-parallel-size", "2", "--tensor-parallel-size", "2")}
    ok = cli_error("--data-parallel-size", "2", "--max-tokens", "4", "--num-blocks", "16", "--json")
    result["cli_dp2"] = {"code": ok["code"], "summary": json.loads(ok["stdout"].splitlines()[-1])["summary"]}
    result["config"] = {
        "mesh_axis": config_error(sharding=tensor_parallel(), mesh=jax.sharding.Mesh(np.asarray(jax.devices()[:3]), ("x",))),
        "both": config_error(sharding=tensor_parallel(), mesh=make_mesh(3), tensor_parallel_size=3),
        "split_head_dim": _error(lambda: ShardingStrategy(rules=(("head_dim", "model"),))),
    }
    print(json.dumps(result))


def process_main(address: str, num_processes: int, process_id: int) -> None:
    """One process of `num_processes` running one engine over all their devices (see the module docstring)."""
    distributed.initialize(address, num_processes, process_id, initialization_timeout=120)
    enable_compilation_cache()
    model = weights.load_model(None, dtype=jnp.float32)
    first = process_id == 0  # process 0 gives the requests; the others' are ignored (broadcast from process 0)
    llm, result = engine_run(model, PROMPTS if first else [], SHORT if first else None, data_parallel_size=2,
                             tensor_parallel_size=3, **SWAP)
    runner = llm.engine.runner
    result.update(process_id=jax.process_index(), local_devices=jax.local_device_count(),
                  max_tokens=[p.max_tokens for p in SHORT], executables=sorted({name for name, _ in runner.executables}),
                  local_pool_shards=[list(s.data.shape) for s in runner.cache.kv.addressable_shards])
    # the CLI's flags for the runtime (already joined): process 0 prints, the others take its prompt and print nothing
    llm_engine.load_model = lambda path, dtype=None: model
    result["cli"] = cli_error("--coordinator-address", address, "--num-processes", str(num_processes), "--process-id",
                              str(process_id), "--data-parallel-size", "2", "--tensor-parallel-size", "3",
                              "--max-tokens", "2", "--num-blocks", "10", "--json")
    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()


def _error(f) -> str:
    try:
        f()
    except ValueError as e:
        return str(e)
    return ""


if __name__ == "__main__":
    if sys.argv[1:2] == ["--process"]:
        process_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
