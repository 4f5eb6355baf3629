"""Block-size ablation at a fixed KV memory budget (paper, 7.2 and Figure 18b).

Every run is the real `LLMEngine` on the real default model (SmolLM2-135M-Instruct, float32), one
LLM (its own KV pool and compiled step shapes) per block size. Every block size gets the same KV
budget in token slots: `num_blocks = pool_slots / block_size + 1` (the null block on top). Every
LLM schedules as the paper's vLLM did (`enable_chunked_prefill=False`; `make_llm`, shared with
`bench/preemption.py`).

Workload: token-id prompts of exact lengths from `bench/traces.py` (the log-normal ShareGPT-like
and Alpaca-like fits of the paper's means), built by `bench.throughput.make_workload`: means and
`max_model_len` divided by a per-trace `scale` (the quick preset shrinks ShareGPT 8x, Alpaca 2x),
`SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)`, every request at t=0
(offline). The pool is small enough that memory binds: requests queue and get preempted (by
recompute, the default).

Per run: output tokens/s, engine steps, mean decode batch, preemptions, prompt tokens recomputed
after preemption, padded prefill tokens (what the step shapes computed), KV utilization (token
states / slots of allocated blocks, summed over steps) and pool occupancy (allocated slots / pool
slots, averaged over steps). The schedule of an offline run does not depend on timing, so
everything but tokens/s is deterministic.

Clock: a shared 2-core machine makes wall time noisy (block sizes run one after the other once
differed 2x with the same steps), so the block sizes serve each trace in lockstep (`interleave`:
one engine step of each in turn) and contention hits them alike, and tokens/s is given on three
clocks (`bench.clock.ShapeClock`, one per LLM, fed by the engine's step records): the headline
charges each step its measured host time plus the *median* wall time of its shape's model step
and sampler in this LLM (robust to bursts of contention, and unbiased for rare shapes such as the
re-prefills after a preemption), `shape-min` the fastest (near the uncontended cost, but with few
samples it favours frequent shapes), and `measured` is the plain wall time, compilation excluded.
Each LLM first compiles its sampler on a tiny warm-up; rounds alternate the order of block sizes;
the table gives the median over rounds and the ratio to block size 16 (the paper's default).

    python bench/block_size.py --quick   # ~3 min on 2 unloaded cores
    python bench/block_size.py           # full preset (~1 h on 2 unloaded cores)

Paper (OPT-13B on an A100): block sizes 16-128 are best on ShareGPT, 16-32 on Alpaca; smaller
blocks underuse the GPU in the attention kernel, larger ones waste memory (internal
fragmentation) and, on Alpaca's short sequences, lose the sharing and batching that memory buys.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.clock import ShapeClock  # noqa: E402
from bench.throughput import TRACE_PARAMS, Workload, make_workload  # noqa: E402

PRESETS = {
    "quick": dict(block_sizes=(4, 8, 16, 32, 64), pool_slots=256, rounds=1,
                  traces={"sharegpt_like": dict(num=16, scale=8), "alpaca_like": dict(num=16, scale=2)}),
    "full": dict(block_sizes=(4, 8, 16, 32, 64, 128), pool_slots=4096, rounds=1,
                 traces={"sharegpt_like": dict(num=64, scale=2), "alpaca_like": dict(num=128, scale=1)}),
}
PAPER_BEST = {"sharegpt_like": (16, 128), "alpaca_like": (16, 32)}


def make_llm(loaded, block_size: int, pool_slots: int, max_model_len: int, **kwargs):
    from jpaged import LLM

    if pool_slots % block_size:
        raise ValueError(f"pool_slots {pool_slots} is not a multiple of block size {block_size}")
    kwargs.setdefault("enable_chunked_prefill", False)  # the paper's policy: results comparable with it
    return LLM(loaded=loaded, block_size=block_size, num_blocks=pool_slots // block_size + 1, dtype="float32",
               max_model_len=max_model_len, **kwargs)


def warm_up(llm, workload: Workload) -> float:
    """Compiles the sampler and the first shapes on two short requests (compile time is excluded anyway)."""
    from jpaged import SamplingParams

    start = time.perf_counter()
    llm.generate([list(p[:8]) for p in workload.prompts[:2]],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start


def interleave(runs) -> list:
    """Runs generators (one engine step per `next`) round-robin until all are done; returns their
    return values in order. Configurations served in lockstep see the same contention on a shared
    machine (an offline schedule does not depend on timing, so interleaving changes no result)."""
    runs = list(runs)
    results = [None] * len(runs)
    active = list(range(len(runs)))
    while active:
        for i in list(active):
            try:
                next(runs[i])
            except StopIteration as stop:
                results[i] = stop.value
                active.remove(i)
    return results


def serve(llm, workload: Workload, clock: ShapeClock, tag: str = ""):
    """Serves `workload` offline (every request at t=0) on `llm`, yielding after every engine step (drive
    it with `interleave`); returns the run's metrics, every request's token ids ("token_ids") and its
    steps on `clock` ("steps", for `cost_run`). tokens/s here is measured; `cost_run` adds the shape
    clocks'."""
    from jpaged import SamplingParams

    engine = llm.engine
    records = []
    engine.add_observer(records.append)
    bs = engine.config.block_size
    pool_slots = (engine.num_blocks - 1) * bs
    for r in workload.requests:
        engine.add_request(f"{tag}{r.request_id}", list(workload.prompts[r.request_id]),
                           SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        yield
    engine.remove_observer(records.append)
    token_ids = []
    for r in workload.requests:
        out = outputs[f"{tag}{r.request_id}"].outputs[0]
        assert len(out.token_ids) == r.output_len and out.finish_reason == "length", (tag, r, out.finish_reason)
        token_ids.append(tuple(out.token_ids))
    out_tokens = sum(len(t) for t in token_ids)
    steps = [clock.observe(record) for record in records]
    elapsed = sum(record.seconds for record in records)
    decode = [record for record in records if record.kind == "decode"]
    prefill = [record for record in records if record.kind == "prefill"]
    used = [record.kv.num_blocks - 1 - record.kv.num_free_blocks for record in records]
    token_slots = sum(sum(kv.num_tokens(s) for s in kv.seq_ids if not kv.is_swapped(s))
                      for kv, u in zip((record.kv for record in records), used) if u)
    return dict(
        elapsed_s=elapsed, compile_s=sum(record.compile_seconds for record in records), output_tokens=out_tokens,
        measured_tokens_per_s=out_tokens / elapsed, num_steps=len(records), num_decode_steps=len(decode),
        num_prefill_steps=len(prefill), peak_running=max(record.num_running for record in records),
        mean_decode_batch=float(np.mean([record.num_rows for record in decode])),
        num_preemptions=sum(len(record.preempted) for record in records),
        prompt_tokens=sum(len(p) for p in workload.prompts),
        recomputed_tokens=sum(record.num_computed_tokens for record in prefill) - sum(len(p) for p in workload.prompts),
        padded_prefill_tokens=sum(record.num_padded_tokens for record in prefill),
        padded_decode_rows=sum(record.num_padded_tokens for record in decode),
        kv_utilization=token_slots / (sum(used) * bs) if sum(used) else None,
        pool_occupancy=sum(used) * bs / (len(records) * pool_slots),
        host_s=sum(st.host for st in steps),
        token_ids=token_ids, steps=steps,
    )


def cost_run(result: dict, clock: ShapeClock) -> dict:
    """Adds the shape clocks' elapsed times and tokens/s (call after every run, with the final table):
    `output_tokens_per_s` on the shape-median clock, `shape_min_tokens_per_s` on the shape-min clock."""
    median = sum(clock.cost(st, "median") for st in result["steps"])
    least = sum(clock.cost(st, "min") for st in result["steps"])
    return dict(result, shape_median_elapsed_s=median, output_tokens_per_s=result["output_tokens"] / median,
                shape_min_elapsed_s=least, shape_min_tokens_per_s=result["output_tokens"] / least)


def run(preset: dict, seed: int, log=print) -> dict:
    from jpaged.weights import load_model

    with common.Stopwatch() as sw:
        loaded = load_model(None)
    log(f"model loaded in {sw.seconds:.1f} s")
    workloads = {name: make_workload(name, t["num"], seed + k, t["scale"])
                 for k, (name, t) in enumerate(preset["traces"].items())}
    max_model_len = max(w.max_model_len for w in workloads.values())
    longest = max(w.describe()["max_total"] for w in workloads.values())
    pool = preset["pool_slots"]
    block_sizes = [b for b in preset["block_sizes"] if longest <= pool - b]  # a lone request must fit
    llms, clocks, warm = {}, {}, {}
    for bs in block_sizes:
        llms[bs] = make_llm(loaded, bs, pool, max_model_len)
        clocks[bs] = ShapeClock(time="wall")
        warm[bs] = warm_up(llms[bs], next(iter(workloads.values())))
    log(f"warm-up: {', '.join(f'bs {b} {s:.0f} s' for b, s in warm.items())}")
    runs = collections.defaultdict(list)  # (trace, bs) -> per-round results
    digests = {}
    for k in range(preset["rounds"]):
        order = block_sizes if k % 2 == 0 else block_sizes[::-1]
        for name, workload in workloads.items():  # every block size in lockstep, one trace at a time
            results = interleave(serve(llms[bs], workload, clocks[bs], tag=f"r{k}-{name}-") for bs in order)
            for bs, r in zip(order, results):
                ids = r.pop("token_ids")
                digests.setdefault(name, {})[bs] = [hash(t) for t in ids]
                runs[(name, bs)].append(r)
                log(f"  round {k} {name:<14} bs {bs:3d}: {r['measured_tokens_per_s']:6.1f} tok/s measured "
                    f"({r['elapsed_s']:.1f} s), "
                    f"{r['num_steps']} steps, batch {r['mean_decode_batch']:.1f}, {r['num_preemptions']} preemptions, "
                    f"util {r['kv_utilization']:.2f}")
    results = {}
    for name in workloads:
        rows = {}
        for bs in block_sizes:
            rs = [cost_run(r, clocks[bs]) for r in runs[(name, bs)]]  # with the final shape-cost table
            row = {k: v for k, v in rs[0].items() if k != "steps"}  # deterministic metrics: the same every round
            keys = ("output_tokens_per_s", "shape_min_tokens_per_s", "measured_tokens_per_s")
            for key in keys + ("elapsed_s", "shape_median_elapsed_s", "shape_min_elapsed_s"):
                row[key] = statistics.median(r[key] for r in rs)
            row["rounds"] = [{k: r[k] for k in keys} for r in rs]
            rows[bs] = row
        if 16 in rows:
            for bs, row in rows.items():
                row["throughput_vs_bs16"] = row["output_tokens_per_s"] / rows[16]["output_tokens_per_s"]
                row["shape_min_vs_bs16"] = row["shape_min_tokens_per_s"] / rows[16]["shape_min_tokens_per_s"]
                row["measured_vs_bs16"] = row["measured_tokens_per_s"] / rows[16]["measured_tokens_per_s"]
        results[name] = rows
    # greedy outputs must not depend on the block size (same model, exact attention): report, not assert
    # (float32 summation order differs with the block layout, so a near-tie may flip a token)
    same = {name: {bs: sum(a == b for a, b in zip(d[bs], d[block_sizes[0]])) / len(d[bs]) for bs in block_sizes}
            for name, d in digests.items()}
    return dict(traces={n: w.describe() for n, w in workloads.items()}, block_sizes=block_sizes,
                results=results, outputs_identical_to_smallest_block_size=same,
                model_load_seconds=sw.seconds, warm_up_seconds=warm,
                device_cost_table={bs: c.table() for bs, c in clocks.items()},
                num_compilations={bs: llm.engine.runner.num_compilations for bs, llm in llms.items()})


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["results"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = out["results"][name]
        bss = sorted(int(b) for b in rows)
        ax.plot(bss, [rows[b]["output_tokens_per_s"] for b in bss], "o-", color="tab:green", label="output tokens/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bss, [str(b) for b in bss])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("output tokens / s (offline, shape-median clock)")
        lo, hi = PAPER_BEST[name]
        ax.axvspan(lo * 0.85, hi * 1.15, color="lightgray", alpha=0.5, label=f"paper's best ({lo}-{hi})")
        ax.set_xlim(bss[0] / 1.4, bss[-1] * 1.4)
        ax2 = ax.twinx()
        ax2.plot(bss, [100 * rows[b]["kv_utilization"] for b in bss], "s--", color="tab:blue", label="KV utilization %")
        ax2.set_ylabel("KV utilization (%)")
        ax2.set_ylim(0, 105)
        for b in bss:
            ax.annotate(f"{rows[b]['num_preemptions']} preempt.\nbatch {rows[b]['mean_decode_batch']:.1f}",
                        (b, rows[b]["output_tokens_per_s"]), fontsize=6, textcoords="offset points", xytext=(0, 6),
                        ha="center")
        ax.margins(y=0.2)
        t = out["traces"][name]
        ax.set_title(f"{name}: {t['num_requests']} req, mean in/out {t['mean_prompt']:.0f}/{t['mean_output']:.0f}, "
                     f"pool {out['settings']['pool_slots']} slots", fontsize=9)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(out: dict) -> None:
    print("tok/s: shape-median clock; min: shape-min clock; meas.: measured wall (compile excluded); "
          "x16: ratio to block size 16")
    print(f"{'trace':<14}{'bs':>4}{'tok/s':>7}{'x16':>6}{'min':>7}{'x16':>6}{'meas.':>7}{'x16':>6}{'steps':>6}"
          f"{'batch':>6}{'peak':>5}{'preempt':>8}"
          f"{'recomp':>7}{'util%':>6}{'occup%':>7}{'padded prefill':>15}{'same out':>9}")
    for name, rows in out["results"].items():
        for bs, r in rows.items():
            same = out["outputs_identical_to_smallest_block_size"][name][bs]
            nan = float("nan")
            print(f"{name:<14}{bs:>4}{r['output_tokens_per_s']:7.1f}{r.get('throughput_vs_bs16', nan):6.2f}"
                  f"{r['shape_min_tokens_per_s']:7.1f}{r.get('shape_min_vs_bs16', nan):6.2f}"
                  f"{r['measured_tokens_per_s']:7.1f}{r.get('measured_vs_bs16', nan):6.2f}"
                  f"{r['num_steps']:6d}{r['mean_decode_batch']:6.1f}{r['peak_running']:5d}{r['num_preemptions']:8d}"
                  f"{r['recomputed_tokens']:7d}{100 * r['kv_utilization']:6.1f}{100 * r['pool_occupancy']:7.1f}"
                  f"{r['padded_prefill_tokens']:>9d}/{r['prompt_tokens'] + r['recomputed_tokens']:<5d}"
                  f"{100 * same:8.0f}%")


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], "5 block sizes, 2 x 16 requests, a 256-slot pool")
    parser.add_argument("--rounds", type=int, help="repeat every run this many times (median reported)")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    preset_name = "quick" if args.quick else "full"
    preset = dict(PRESETS[preset_name])
    if args.rounds:
        preset["rounds"] = args.rounds
    start = time.perf_counter()
    machine = common.machine_info()
    out = run(preset, args.seed, log=lambda s: print(s, flush=True))
    out = dict(benchmark="block_size", preset=preset_name, machine=machine,
               settings=dict(**preset, dtype="float32", model="SmolLM2-135M-Instruct (default)",
                             num_blocks="pool_slots / block_size + 1 (null block)", preemption_mode="recompute",
                             sampling="temperature=0, max_tokens=output_len, ignore_eos=True", arrivals="all at t=0",
                             trace_params={n: TRACE_PARAMS[n] for n in preset["traces"]},
                             compile_cache=args.compile_cache),
               seeds={name: args.seed + k for k, name in enumerate(preset["traces"])},
               paper=dict(best_block_sizes=PAPER_BEST), **out)
    return common.report(out, args.out, common.results_stem("block_size", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
