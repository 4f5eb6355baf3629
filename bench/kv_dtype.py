"""The KV pool's dtype on a CPU: float32 against bfloat16 and float16, speed and greedy agreement.

A 16-bit `dtype` halves the KV pool's bytes; the XLA backend stores a bfloat16 pool as its uint16 bit
patterns, because XLA's CPU scatter into a bfloat16 array widens the whole array. Since issue 33 the
same `dtype` is the parameters' on a CPU too (matmuls accumulating in float32, activations float32),
so this benchmark's 16-bit runs now hold 16-bit weights as well (`bench/weights_dtype.py` measures
that, one stream included; the README's kv_dtype table predates it: 16-bit pools, float32 weights).
This benchmark runs the same greedy requests with each dtype, side by side in one process: output
tokens/s of a timed `generate` after a warm-up, and how many requests give exactly float32's tokens.

    python bench/kv_dtype.py [--quick] [--out bench/results]     # writes kv_dtype.json (--quick: kv_dtype_quick.json)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.traces import load_alpaca_prompts  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def run(num_requests: int, max_tokens: int, rounds: int, log=print) -> dict:
    from jpaged import LLM, SamplingParams
    from jpaged.weights import load_model

    loaded = load_model(None)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llms = {dtype: LLM(loaded=loaded, dtype=dtype, num_blocks=num_requests * 8 + 8) for dtype in DTYPES}
    prompts = [llms["float32"].chat_prompt([{"role": "user", "content": p}])
               for p in load_alpaca_prompts()[:num_requests]]
    tokens, speed = {}, {dtype: [] for dtype in DTYPES}
    for llm in llms.values():  # compiles every shape of the run
        llm.generate(prompts, params, use_tqdm=False)
    for k in range(rounds):  # the dtypes alternate, round after round
        for dtype in (DTYPES if k % 2 == 0 else DTYPES[::-1]):
            start = time.perf_counter()
            outs = llms[dtype].generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            speed[dtype].append(num_requests * max_tokens / seconds)
            tokens[dtype] = [o.outputs[0].token_ids for o in outs]
            log(f"  round {k} {dtype:<9} {speed[dtype][-1]:6.1f} tokens/s")
    results = {}
    for dtype in DTYPES:
        reference = tokens["float32"]
        prefix = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(t))
                  for t, r in zip(tokens[dtype], reference)]
        engine = llms[dtype].engine
        results[dtype] = dict(
            tokens_per_s=sorted(speed[dtype])[len(speed[dtype]) // 2], rounds_tokens_per_s=speed[dtype],
            speed_vs_float32=sorted(speed[dtype])[rounds // 2] / sorted(speed["float32"])[rounds // 2],
            identical_requests=sum(p == max_tokens for p in prefix), mean_matching_prefix=sum(prefix) / len(prefix),
            pool_storage=str(engine.runner.cache.kv.dtype), parameters=str(engine.model.params.embed.dtype),
            attention_backend=engine.runner.backend.name,  # what 'auto' chose
            pool_bytes=int(engine.runner.cache.kv.nbytes))
    return results


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = out["results"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    bars = ax.bar(list(results), [r["tokens_per_s"] for r in results.values()], color="tab:blue")
    for bar, r in zip(bars, results.values()):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"{r['identical_requests']}/{out['settings']['num_requests']} as f32", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s (greedy)")
    ax.set_title("dtype of the KV pool and the parameters on a CPU (float32 accumulation)", fontsize=9)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], "8 requests of 16 tokens, 1 round")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    start = time.perf_counter()
    num_requests, max_tokens, rounds = (8, 16, 1) if args.quick else (32, 64, 3)
    machine = common.machine_info()
    results = run(num_requests, max_tokens, rounds, log=lambda s: print(s, flush=True))
    out = dict(benchmark="kv_dtype", machine=machine,
               settings=dict(num_requests=num_requests, max_tokens=max_tokens, rounds=rounds, greedy=True,
                             prompts="the first Alpaca seed prompts as chats", compile_cache=args.compile_cache),
               results=results)

    def print_table(out):
        print(f"{'dtype':<10}{'tokens/s':>9}{'x f32':>7}{'same':>6}{'prefix':>8}  pool storage, parameters, attention")
        for dtype, r in out["results"].items():
            print(f"{dtype:<10}{r['tokens_per_s']:9.1f}{r['speed_vs_float32']:7.2f}{r['identical_requests']:6d}"
                  f"{r['mean_matching_prefix']:8.1f}  {r['pool_storage']}, {r['parameters']}, "
                  f"{r.get('attention_backend', '?')}")

    return common.report(out, args.out, common.results_stem("kv_dtype", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
