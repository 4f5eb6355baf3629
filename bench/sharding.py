"""Sharding strategies on forced CPU devices: KV capacity per device, duplication, bytes, collectives.

For each strategy and mesh (`jpaged.device.sharding`) this runs the same greedy requests on the
default model and writes: the KV-head duplication factor; each device's bytes of parameters and of
the pool (from the arrays' shards) and what `compiled.memory_analysis()` says of the decode step;
the KV blocks and tokens one device holds at a fixed per-device budget; the collectives in the
compiled decode step (and how many sit in the layer loop, run once per layer); the number of
compilations over the run; and the decode step's median time, *indicative only*: forced CPU devices
share the same cores, so splitting a step over them cannot make it faster here.

Strategies: one device; tensor parallel 3 (the pool split by KV heads: 1 of 3 per device);
tensor parallel 3 with the embedding and LM head split by vocabulary; a heads-only rule set on 9
devices (9 query heads, 3 KV heads: each KV head stored 3 times, the MLP replicated), to show the
duplication; data parallel 2 (the pool split by blocks, weights replicated); and data parallel 2 x
tensor parallel 3 on a 2-D mesh. Capacity per device counts each device's share of a block.

    python bench/sharding.py [--quick] [--out bench/results]   # writes sharding.json / .png (--quick: sharding_quick.*)

It forces 9 CPU devices itself (XLA_FLAGS, before JAX starts), so it runs as its own process and
is not part of `python -m bench`.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_DEVICES = 9
BUDGET_BYTES = 256 * 2**20  # the per-device KV budget the capacities are computed at


_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8}


def collectives(executable) -> dict:
    """Collective ops in a compiled executable's HLO (`counts`), how many of them sit in a while loop's
    body (`in_loop`: the layer scan, run once per layer), and the bytes of their results (`bytes`, each op
    counted once as written: one in a loop body runs once per iteration)."""
    text = executable.as_text()
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", text))
    counts, in_loop, nbytes, computation = Counter(), Counter(), Counter(), None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            computation = header[1]
        op = re.search(r"= (\S+|\(.*?\)) (all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)"
                       r"(?:-start)?\(", line)
        if op:
            counts[op[2]] += 1
            in_loop[op[2]] += computation in bodies
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", op[1]):
                nbytes[op[2]] += _DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
    return {"counts": dict(counts), "in_loop": dict(in_loop), "bytes": dict(nbytes)}


def strategies():
    from jpaged.device.sharding import ShardingStrategy, make_mesh, tensor_parallel

    heads_only = ShardingStrategy(name="heads_only", rules=(("heads", "model"), ("kv_heads", "model")))
    return {"one device": {},
            "tensor parallel 3": {"tensor_parallel_size": 3},
            "tensor parallel 3, vocab split": {"sharding": tensor_parallel(vocab=True), "mesh": make_mesh(3)},
            "heads only, 9 devices": {"sharding": heads_only, "mesh": make_mesh(9)},
            "data parallel 2": {"data_parallel_size": 2},
            "data parallel 2 x tensor parallel 3": {"data_parallel_size": 2, "tensor_parallel_size": 3}}


def device_bytes(tree) -> int:
    """Bytes of `tree`'s arrays on the first device that holds a shard of each."""
    import jax

    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def run(num_requests: int, max_tokens: int, num_blocks: int, log=print) -> dict:
    import numpy as np

    from bench.traces import load_alpaca_prompts
    from jpaged import LLM, SamplingParams
    from jpaged.weights import load_model

    loaded = load_model(None)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results, reference = {}, None
    for name, kwargs in strategies().items():
        llm = LLM(loaded=loaded, num_blocks=num_blocks, **kwargs)
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in load_alpaca_prompts()[:num_requests]]
        llm.generate(prompts, params, use_tqdm=False)  # compiles every shape of the run
        decode_s = []
        llm.engine.add_observer(lambda r: decode_s.extend(c.seconds for c in r.calls if c.name == "decode_step"))
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        reference = reference or tokens
        runner = llm.engine.runner
        pool_device = device_bytes(runner.cache)
        block_device = pool_device * runner.num_partitions // runner.num_blocks  # a device's share of one of its blocks
        decode = [ex for (n, _), ex in runner.executables.items() if n == "decode_step"][-1]
        memory = decode.memory_analysis()
        results[name] = dict(
            num_devices=len(runner.devices), rules=dict(runner.sharding.rules) if runner.sharding else {},
            kv_head_replication=runner.kv_head_replication, num_partitions=runner.num_partitions,
            pool_shard_shape=list(runner.cache.kv.addressable_shards[0].data.shape),
            param_bytes_per_device=device_bytes(runner.params), pool_bytes_per_device=pool_device,
            kv_block_bytes_per_device=block_device, blocks_per_device_at_budget=BUDGET_BYTES // block_device,
            tokens_per_device_at_budget=BUDGET_BYTES // block_device * runner.block_size,
            decode_memory_analysis=dict(argument_bytes=memory.argument_size_in_bytes,
                                        output_bytes=memory.output_size_in_bytes,
                                        alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes),
            decode_collectives=collectives(decode), num_compilations=runner.num_compilations,
            decode_step_median_s_indicative=float(np.median(decode_s)) if decode_s else None,
            same_tokens_as_one_device=tokens == reference)
        r = results[name]
        log(f"  {name:<32} x{r['kv_head_replication']} pool/device {r['pool_bytes_per_device'] / 2**20:6.1f} MiB, "
            f"params/device {r['param_bytes_per_device'] / 2**20:6.1f} MiB, {r['decode_collectives']['counts']}")
    return results


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = out["results"]
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    axes[0].barh(names, [r["tokens_per_device_at_budget"] for r in results.values()], color="tab:blue")
    axes[0].set_xlabel(f"KV tokens one device holds in {BUDGET_BYTES // 2**20} MiB")
    for i, r in enumerate(results.values()):
        axes[0].text(r["tokens_per_device_at_budget"], i, f" x{r['kv_head_replication']} dup.", va="center", fontsize=8)
    axes[1].barh(names, [r["param_bytes_per_device"] / 2**20 for r in results.values()], color="tab:orange")
    axes[1].set_xlabel("parameter MiB per device")
    axes[1].set_yticks([])
    fig.suptitle("sharding strategies, default model (forced CPU devices)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" in sys.modules and "xla_force_host_platform_device_count" not in flags:
        raise SystemExit("bench/sharding.py forces CPU devices before JAX starts: run it as its own process")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={NUM_DEVICES}".strip()
    from bench import common

    parser = common.bench_parser(__doc__.splitlines()[0], "4 requests of 8 tokens")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    start = time.perf_counter()
    num_requests, max_tokens, num_blocks = (4, 8, 64) if args.quick else (16, 32, 256)
    machine = common.machine_info()
    results = run(num_requests, max_tokens, num_blocks, log=lambda s: print(s, flush=True))
    out = dict(benchmark="sharding", machine=machine,
               settings=dict(num_requests=num_requests, max_tokens=max_tokens, num_blocks=num_blocks,
                             forced_cpu_devices=NUM_DEVICES, budget_bytes_per_device=BUDGET_BYTES, greedy=True,
                             prompts="the first Alpaca seed prompts as chats", compile_cache=args.compile_cache,
                             note="step times are indicative: forced CPU devices share the same cores"),
               results=results)

    def print_table(out):
        print(f"{'strategy':<32}{'dup':>4}{'pool MiB/dev':>13}{'param MiB/dev':>14}{'tokens@budget':>14}"
              f"{'compiles':>9}{'decode ms*':>11}  collectives (in layer loop)")
        for name, r in out["results"].items():
            ms = r["decode_step_median_s_indicative"]
            print(f"{name:<32}{r['kv_head_replication']:>4}{r['pool_bytes_per_device'] / 2**20:13.1f}"
                  f"{r['param_bytes_per_device'] / 2**20:14.1f}{r['tokens_per_device_at_budget']:14d}"
                  f"{r['num_compilations']:9d}{(ms or 0) * 1e3:11.1f}  {r['decode_collectives']['counts']} "
                  f"({r['decode_collectives']['in_loop']}){'' if r['same_tokens_as_one_device'] else ' TOKENS DIFFER'}")
        print("* indicative: forced CPU devices share the same cores")

    return common.report(out, args.out, common.results_stem("sharding", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
