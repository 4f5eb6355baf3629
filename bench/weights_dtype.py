"""Parameter widths on a CPU: float32, bfloat16, float16 and int8 weights (computing in float32 or bfloat16), side
by side.

`dtype="bfloat16"` / `"float16"` stores the parameters in 16 bits (on a CPU a bfloat16 leaf is held as
its uint16 bit patterns: `jpaged.device.params.to_storage`; on one CPU device its dense weights as
[out, in] rows of those bits, whose few-row products run the native kernel: `jpaged.device.quant`,
`float_row_params`), every matmul accumulates in float32 and
the activations between matmuls are float32 (`jpaged.device.model`). `int8` is `quantization="int8"`
with float32 norms and KV pool: the dense weights int8 with a float32 scale per output channel
(`jpaged.device.quant`); `int8-bf16` the same at `dtype="bfloat16"` (bfloat16 norms and KV pool, the int8
products taking their activations rounded to bfloat16). A decode step of one row reads every weight once, so 16-bit weights halve
what it reads and int8 quarters it. For each width, in one process, the widths alternating round
after round:

- one stream: ms per output token of one greedy request (its decode steps: from its first token to
  its last), the median over the round's requests;
- batched: output tokens/s of a timed `generate` of `num_requests` greedy chats at once;
- greedy agreement with float32: of the batched requests (all in one batch) and of the one-stream
  requests, how many give float32's tokens exactly, and the mean matching prefix;
- the parameters' bytes as the runner holds them, and the CPU (model name, ISA flags) of the run.

    python bench/weights_dtype.py [--quick] [--rounds N] [--out bench/results]   # writes weights_dtype.json and .png
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.peers.make_gguf import INT8_DTYPES  # noqa: E402
from bench.traces import load_alpaca_prompts  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16", "int8", "int8-bf16")  # the parameters' widths (int8: quantization="int8")
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_summary(cpu: dict) -> dict:
    """The CPU (`common.cpu_info`) in brief: its model name, cores, and each ISA flag that decides
    XLA's 16-bit matmul paths, present or not."""
    return {"model_name": cpu.get("model_name"), "nproc": cpu.get("nproc"),
            "isa": {f: f in cpu.get("isa", ()) for f in ISA_FLAGS}, "amx": bool(cpu.get("has_amx"))}


def _llm_args(width: str) -> dict:
    """The `LLM` arguments of a width: an int8 width is `quantization="int8"` at its products' dtype."""
    return dict(dtype=INT8_DTYPES[width], quantization="int8") if width in INT8_DTYPES else dict(dtype=width)


def _matching_prefix(tokens, reference) -> list[int]:
    return [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), min(len(t), len(r)))
            for t, r in zip(tokens, reference)]


def run(num_requests: int, max_tokens: int, num_single: int, rounds: int, log=print) -> dict:
    import jax

    from jpaged import LLM, SamplingParams
    from jpaged.weights import load_model

    loaded = load_model(None)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llms = {dtype: LLM(loaded=loaded, num_blocks=num_requests * 8 + 8, **_llm_args(dtype))
            for dtype in DTYPES}
    prompts = [llms["float32"].chat_prompt([{"role": "user", "content": p}])
               for p in load_alpaca_prompts()[:num_requests]]
    singles = prompts[:num_single]
    batched_tokens, single_tokens = {}, {d: [] for d in DTYPES}
    speed, ms_per_token = {d: [] for d in DTYPES}, {d: [] for d in DTYPES}
    for llm in llms.values():  # compiles every shape of the run (the batched and the one-row buckets)
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(singles[:1], params, use_tqdm=False)
    for k in range(rounds):  # the dtypes alternate, round after round
        for dtype in (DTYPES if k % 2 == 0 else DTYPES[::-1]):
            llm = llms[dtype]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            speed[dtype].append(num_requests * max_tokens / seconds)
            batched_tokens[dtype] = [o.outputs[0].token_ids for o in outs]
            per_token, single_tokens[dtype] = [], []
            for prompt in singles:  # one stream: one request at a time
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                m = out.metrics
                per_token.append(1e3 * (m.finished_time - m.first_token_time) / (max_tokens - 1))
                single_tokens[dtype].append(out.outputs[0].token_ids)
            ms_per_token[dtype].append(float(np.median(per_token)))
            log(f"  round {k} {dtype:<9} {speed[dtype][-1]:6.1f} tokens/s at {num_requests} requests, "
                f"{ms_per_token[dtype][-1]:6.1f} ms per token at one stream")
    results = {}
    for dtype in DTYPES:
        llm = llms[dtype]
        prefix = _matching_prefix(batched_tokens[dtype], batched_tokens["float32"])
        single_prefix = _matching_prefix(single_tokens[dtype], single_tokens["float32"])
        runner_params = llm.engine.runner.params
        stored = {id(x): x for x in jax.tree.leaves(runner_params)}  # a tied int8 head shares the embedding's
        wq, runner_wq = llm.engine.model.params.layers.wq, runner_params.layers.wq
        median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        results[dtype] = dict(
            one_stream_ms_per_token=median(ms_per_token[dtype]), rounds_one_stream_ms_per_token=ms_per_token[dtype],
            tokens_per_s=median(speed[dtype]), rounds_tokens_per_s=speed[dtype],
            speed_vs_float32=median(speed[dtype]) / median(speed["float32"]),
            one_stream_speed_vs_float32=median(ms_per_token["float32"]) / median(ms_per_token[dtype]),
            # the same ratios round by round (float32 ran beside it in each round: steadier on a busy machine)
            rounds_speed_vs_float32=[a / b for a, b in zip(speed[dtype], speed["float32"])],
            rounds_one_stream_speed_vs_float32=[b / a for a, b in zip(ms_per_token[dtype], ms_per_token["float32"])],
            identical_requests=sum(p == max_tokens for p in prefix), mean_matching_prefix=sum(prefix) / len(prefix),
            one_stream_identical_requests=sum(p == max_tokens for p in single_prefix),
            one_stream_mean_matching_prefix=sum(single_prefix) / len(single_prefix),
            parameters=str(wq.dtype if getattr(wq, "is_float", False) else getattr(wq, "values", wq).dtype),
            parameters_stored_as=str(getattr(runner_wq, "values", runner_wq).dtype),
            parameter_bytes=int(sum(x.nbytes for x in stored.values())),
            pool_storage=str(llm.engine.runner.cache.kv.dtype), attention_backend=llm.engine.runner.backend.name)
    return results


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, n = out["results"], out["settings"]["num_requests"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    bars = a.bar(list(results), [r["tokens_per_s"] for r in results.values()], color="tab:blue")
    for bar, r in zip(bars, results.values()):
        a.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['identical_requests']}/{n} as f32",
               ha="center", va="bottom", fontsize=8)
    a.set_ylabel(f"output tokens / s, {n} requests")
    a.margins(y=0.15)
    b.bar(list(results), [r["one_stream_ms_per_token"] for r in results.values()], color="tab:orange")
    b.set_ylabel("ms per output token, one stream")
    cpu = out["cpu"]
    isa = ",".join(f for f, on in cpu["isa"].items() if on)
    fig.suptitle(f"parameter width on a CPU ({cpu['model_name']}, {cpu['nproc']} cores; {isa})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], "8 requests of 16 tokens, 2 one-stream requests, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the alternation (default: 5; --quick 1)")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    start = time.perf_counter()
    num_requests, max_tokens, num_single, rounds = (8, 16, 2, 1) if args.quick else (32, 64, 4, 5)
    rounds = args.rounds or rounds
    machine = common.machine_info()
    cpu = cpu_summary(machine.get("cpu") or common.cpu_info())
    results = run(num_requests, max_tokens, num_single, rounds, log=lambda s: print(s, flush=True))
    out = dict(benchmark="weights_dtype", machine=machine, cpu=cpu,
               settings=dict(num_requests=num_requests, max_tokens=max_tokens, one_stream_requests=num_single,
                             rounds=rounds, greedy=True, prompts="the first Alpaca seed prompts as chats",
                             compile_cache=args.compile_cache),
               results=results)

    def print_table(out):
        isa = " ".join(f for f, on in out["cpu"]["isa"].items() if on)
        print(f"{out['cpu']['model_name']}, {out['cpu']['nproc']} cores; ISA: {isa}")
        print(f"{'dtype':<10}{'tok/s':>8}{'x f32':>7}{'ms/tok@1':>10}{'x f32':>7}{'same':>6}{'prefix':>8}"
              f"{'same@1':>8}  parameters (stored), MB; x f32 round by round: batched | one stream")
        for dtype, r in out["results"].items():
            print(f"{dtype:<10}{r['tokens_per_s']:8.1f}{r['speed_vs_float32']:7.2f}{r['one_stream_ms_per_token']:10.1f}"
                  f"{r['one_stream_speed_vs_float32']:7.2f}{r['identical_requests']:6d}{r['mean_matching_prefix']:8.1f}"
                  f"{r['one_stream_identical_requests']:8d}  {r['parameters']} ({r['parameters_stored_as']}), "
                  f"{r['parameter_bytes'] / 1e6:.0f}; {' '.join(f'{x:.2f}' for x in r['rounds_speed_vs_float32'])} | "
                  f"{' '.join(f'{x:.2f}' for x in r['rounds_one_stream_speed_vs_float32'])}")

    return common.report(out, args.out, common.results_stem("weights_dtype", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
