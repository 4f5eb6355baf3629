"""Recompute vs swap: the cost of preemption (paper, 7.3 and Figure 19).

Every run is the real `LLMEngine` on the real default model (SmolLM2-135M-Instruct, float32). For
each block size, two LLMs with the same KV budget in token slots (`num_blocks = pool_slots /
block_size + 1`) serve the same offline workload: one preempts by recompute (drop the blocks,
re-prefill prompt + generated tokens later), the other by swap (copy the blocks to the CPU block
pool, `swap_space` 1 GiB, which the engine caps at the device pool's size, and copy them back
later). The pool is small enough that both preempt (asserted: `num_preemptions > 0`). Both schedule
as the paper's vLLM did (`enable_chunked_prefill=False`, through `bench.block_size.make_llm`).

Workload: ShareGPT-like token-id prompts of exact lengths (`bench.throughput.make_workload`, the
log-normal fit of the paper's means, scaled down 8x in the quick preset and 4x in the full one),
`SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)`, all at t=0. Greedy
decoding and exact attention: the two modes must generate identical token ids (asserted).

Clock: as in `bench/block_size.py`. The four (quick) or eight (full) LLMs serve in lockstep (one
engine step of each in turn) so that contention on a shared machine hits them alike; tokens/s is
given on the shape-median clock (headline), the shape-min clock and measured wall time
(compilation excluded). Swap copies are host work in all three (they are not model steps); the
seconds of their executables are reported separately as `swap_s` (`SwapMeter`, a step observer).
On a CPU machine the "device" pool and the CPU pool are both host memory: a swap is a jitted
gather out of the JAX pool into a numpy array and a jitted scatter back, not a PCIe transfer, so
swap is cheaper here than on a GPU, relative to the model.

    python bench/preemption.py --quick   # ~2-3 min on 2 unloaded cores
    python bench/preemption.py           # full preset (~15 min on 2 unloaded cores)

Paper (OPT-13B on an A100, ShareGPT): swap is slow at small block sizes (many small PCIe
transfers), recompute is never more than 20% slower than swap, and they are close at 16-64.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.block_size import cost_run, interleave, make_llm, serve, warm_up  # noqa: E402
from bench.clock import ShapeClock  # noqa: E402
from bench.throughput import TRACE_PARAMS, make_workload  # noqa: E402

MODES = ("recompute", "swap")
PRESETS = {
    "quick": dict(block_sizes=(16, 32), pool_slots=256, trace="sharegpt_like", num_requests=16, scale=8),
    "full": dict(block_sizes=(8, 16, 32, 64), pool_slots=1024, trace="sharegpt_like", num_requests=48, scale=4),
}


class SwapMeter:
    """A step observer counting an engine's swap-outs and swap-ins (steps with any, blocks moved)
    and the seconds of their executables (the pool gathers and scatters; compilation excluded)."""

    def __init__(self):
        self.counts = collections.Counter()

    def __call__(self, record) -> None:
        for name, pairs, call in (("swap_out", record.ops.swap_out, "read_blocks"),
                                  ("swap_in", record.ops.swap_in, "write_blocks")):
            if pairs:
                self.counts[f"{name}_calls"] += 1
                self.counts[f"{name}_blocks"] += len(pairs)
                self.counts[f"{name}_s"] += sum(c.seconds for c in record.calls if c.name == call)


def run(preset: dict, seed: int, log=print) -> dict:
    from jpaged.weights import load_model

    with common.Stopwatch() as sw:
        loaded = load_model(None)
    log(f"model loaded in {sw.seconds:.1f} s")
    workload = make_workload(preset["trace"], preset["num_requests"], seed, preset["scale"])
    pool = preset["pool_slots"]
    longest = workload.describe()["max_total"]
    block_sizes = [b for b in preset["block_sizes"] if longest <= pool - b]
    configs = [(bs, mode) for bs in block_sizes for mode in MODES]
    llms, clocks, swaps, warm = {}, {}, {}, {}
    for bs, mode in configs:
        llm = make_llm(loaded, bs, pool, workload.max_model_len, preemption_mode=mode,
                       swap_space=1.0 if mode == "swap" else 0.0)
        llms[bs, mode] = llm
        clocks[bs, mode] = ShapeClock(time="wall")
        warm[bs, mode] = warm_up(llm, workload)
        swaps[bs, mode] = meter = SwapMeter()
        llm.engine.add_observer(meter)
    log("warm-up: " + ", ".join(f"bs {b} {m} {s:.0f} s" for (b, m), s in warm.items()))
    results = interleave(serve(llms[c], workload, clocks[c], tag=f"{c[0]}-{c[1]}-") for c in configs)
    rows, token_ids = {}, {}
    for c, r in zip(configs, results):
        token_ids[c] = r.pop("token_ids")
        r = {k: v for k, v in cost_run(r, clocks[c]).items() if k != "steps"}
        r.update(swaps[c].counts)
        r["cpu_blocks"] = llms[c].engine.kv_cache_spec.num_cpu_blocks
        rows[c] = r
        log(f"  bs {c[0]:3d} {c[1]:<9}: {r['output_tokens_per_s']:6.1f} tok/s "
            f"(measured {r['measured_tokens_per_s']:.1f}), "
            f"{r['num_preemptions']} preemptions, {r['num_steps']} steps, recomputed {r['recomputed_tokens']}, "
            f"swapped out {r.get('swap_out_blocks', 0)} blocks")
    summary = {}
    for bs in block_sizes:
        rec, swp = rows[bs, "recompute"], rows[bs, "swap"]
        identical = token_ids[bs, "recompute"] == token_ids[bs, "swap"]
        assert rec["num_preemptions"] > 0 and swp["num_preemptions"] > 0, f"block size {bs}: no preemption"
        assert identical, f"block size {bs}: recompute and swap generated different tokens"
        summary[bs] = dict(
            identical_outputs=identical,
            recompute_over_swap_time=swp["output_tokens_per_s"] / rec["output_tokens_per_s"],
            recompute_over_swap_time_shape_min=swp["shape_min_tokens_per_s"] / rec["shape_min_tokens_per_s"],
            recompute_over_swap_time_measured=swp["measured_tokens_per_s"] / rec["measured_tokens_per_s"],
        )
    first = token_ids[block_sizes[0], "recompute"]
    same_across = {bs: sum(a == b for a, b in zip(token_ids[bs, "recompute"], first)) / len(first)
                   for bs in block_sizes}
    return dict(trace=workload.describe(), block_sizes=block_sizes,
                results={f"{bs}/{mode}": r for (bs, mode), r in rows.items()}, summary=summary,
                outputs_identical_across_block_sizes=same_across,
                model_load_seconds=sw.seconds, warm_up_seconds={f"{b}/{m}": s for (b, m), s in warm.items()})


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bss = out["block_sizes"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    width = 0.38
    for j, (mode, color) in enumerate((("recompute", "tab:orange"), ("swap", "tab:blue"))):
        values = [out["results"][f"{bs}/{mode}"]["output_tokens_per_s"] for bs in bss]
        bars = ax.bar(np.arange(len(bss)) + (j - 0.5) * width, values, width, color=color, label=mode)
        for bar, bs in zip(bars, bss):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                    f"{out['results'][f'{bs}/{mode}']['num_preemptions']}p", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(bss)), [str(b) for b in bss])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("output tokens / s (shape-median clock)")
    ax.set_title(f"offline throughput, pool {out['settings']['pool_slots']} slots (preemptions on top)", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    for key, style, label in (("recompute_over_swap_time", "o-", "shape-median"),
                              ("recompute_over_swap_time_shape_min", "s--", "shape-min"),
                              ("recompute_over_swap_time_measured", "^:", "measured")):
        ax.plot(bss, [out["summary"][bs][key] for bs in bss], style, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.2, color="tab:red", lw=0.8, ls="--", label="paper: recompute <= 1.2x swap")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bss, [str(b) for b in bss])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("recompute time / swap time")
    ax.set_title("relative cost of recompute (same outputs)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(out: dict) -> None:
    print("tok/s: shape-median clock (min: shape-min clock; meas.: measured wall); "
          "rec/swap: recompute time / swap time")
    print(f"{'bs':>4} {'mode':<10}{'tok/s':>7}{'min':>7}{'meas.':>7}{'preempt':>8}{'steps':>6}{'batch':>6}"
          f"{'recomp':>7}{'swap out/in blk':>16}{'swap_s':>7}{'rec/swap':>9}{'min':>6}{'meas.':>6}{'same':>5}")
    for bs in out["block_sizes"]:
        s = out["summary"][bs]
        for mode in MODES:
            r = out["results"][f"{bs}/{mode}"]
            swap_s = r.get("swap_out_s", 0.0) + r.get("swap_in_s", 0.0)
            tail = (f"{s['recompute_over_swap_time']:9.3f}{s['recompute_over_swap_time_shape_min']:6.2f}"
                    f"{s['recompute_over_swap_time_measured']:6.2f}{'yes' if s['identical_outputs'] else 'NO':>5}"
                    if mode == "swap" else "")
            print(f"{bs:>4} {mode:<10}{r['output_tokens_per_s']:7.1f}{r['shape_min_tokens_per_s']:7.1f}"
                  f"{r['measured_tokens_per_s']:7.1f}{r['num_preemptions']:8d}{r['num_steps']:6d}"
                  f"{r['mean_decode_batch']:6.1f}"
                  f"{r['recomputed_tokens']:7d}{r.get('swap_out_blocks', 0):>9d}/{r.get('swap_in_blocks', 0):<6d}"
                  f"{swap_s:7.2f}{tail}")


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], "block sizes 16 and 32, 16 requests, a 256-slot pool")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    preset_name = "quick" if args.quick else "full"
    preset = PRESETS[preset_name]
    start = time.perf_counter()
    machine = common.machine_info()
    out = run(preset, args.seed, log=lambda s: print(s, flush=True))
    out = dict(benchmark="preemption", preset=preset_name, machine=machine,
               settings=dict(**preset, dtype="float32", model="SmolLM2-135M-Instruct (default)",
                             num_blocks="pool_slots / block_size + 1 (null block)",
                             swap_space_gib=1.0, cpu_pool="min(swap_space, device pool) blocks",
                             swap_s="seconds in the swap executables (gather out of / scatter into the pool)",
                             sampling="temperature=0, max_tokens=output_len, ignore_eos=True", arrivals="all at t=0",
                             trace_params=TRACE_PARAMS[preset["trace"]], compile_cache=args.compile_cache),
               seeds=dict(trace=args.seed, prompts=args.seed + 10_000),
               paper="recompute <= 1.2x swap's time; close at block sizes 16-64; swap slow at small blocks", **out)
    return common.report(out, args.out, common.results_stem("preemption", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
