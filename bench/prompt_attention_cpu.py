"""Prompt attention on the CPU: the native kernel's prefill path on the 120 vs_peers prompts.

The prompts of `vs_peers.py` (the 120 Alpaca instructions as chats, the default model's template;
10,532 tokens, 37-1,350 each), each a row prefilled whole, attend over their own blocks, scattered at
random in a pool laid out and built as jpaged's (`attention_cpu.make_case`: 30 layers of 3 KV heads x 64,
9 query heads, blocks of 16, on huge pages): layer 0's attention of one prefill step, as `native.native_attend` runs it inside the model. Every
native build this machine runs (`--variants`: AVX-512, AVX2, portable) is timed side by side, the builds
alternating run by run, median and min of `--reps`; each build's output is checked against the first's.
A chunk's scores are summed in the decode path's order (see `csrc/paged_attention.cc`), so this is
also the cost of a batch-invariant prompt path.

    python bench/prompt_attention_cpu.py [--quick] [--reps 15] [--dtypes bfloat16,float32] [--out bench/results]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.attention_cpu import HEAD_DIM, HEADS, KV_HEADS, make_case  # noqa: E402
from bench.vs_peers import load_requests  # noqa: E402


def operands(lengths: np.ndarray, dtype: str, rng):
    """q, the pool (built as `attention_cpu.make_case` builds it, as the engine does), the block tables, and
    each row's context, q_start and q_len: every row a whole prompt."""
    import jax.numpy as jnp

    pool, tables, _ = make_case(len(lengths), lengths, dtype, rng)
    table = np.zeros((len(tables), max(map(len, tables))), np.int32)
    for row, blocks in enumerate(tables):
        table[row, :len(blocks)] = blocks
    q_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(lengths.sum()), HEADS, HEAD_DIM)), jnp.float32)
    return q, pool, table, lengths, q_start, lengths


def time_variants(variants, args, reps: int) -> dict:
    """ms per call of each build, alternating (the order rotating each rep): median and min; and each
    build's largest difference from the first's output."""
    import jax
    import jax.numpy as jnp

    from jpaged.device.attention import native

    q, pool, tables, context, q_start, q_len = args
    calls = {v: jax.jit(lambda q, pool, v=v: native.native_attend(q, pool, jnp.int32(0), tables, context, q_start,
                                                                 q_len, HEAD_DIM ** -0.5, variant=v))
             for v in variants}
    outputs = {v: np.asarray(f(q, pool)) for v, f in calls.items()}  # compiles, and the check
    times = {v: [] for v in variants}
    for rep in range(reps):
        for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:
            start = time.perf_counter()
            calls[v](q, pool).block_until_ready()
            times[v].append((time.perf_counter() - start) * 1e3)
    first = outputs[variants[0]]
    return {v: {"median_ms": float(np.median(t)), "min_ms": float(np.min(t)), "runs_ms": t,
                "max_abs_diff_vs_first": float(np.abs(outputs[v] - first).max())} for v, t in times.items()}


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    dtypes = list(out["results"])
    variants = list(out["results"][dtypes[0]])
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax.bar(np.arange(len(dtypes)) + i * width, [out["results"][d][v]["median_ms"] for d in dtypes], width, label=v)
    ax.set_xticks(np.arange(len(dtypes)) + width * (len(variants) - 1) / 2, dtypes)
    ax.set_ylabel("ms, one layer (median)")
    ax.set_title(f"prompt attention, {out['prompt_tokens']} tokens in {out['num_prompts']} prompts\n"
                 f"{out['machine'].get('cpu', {}).get('model_name', '')}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(out: dict) -> None:
    for dtype, by_variant in out["results"].items():
        for v, r in by_variant.items():
            print(f"{dtype:9s} {v:9s} median {r['median_ms']:7.2f} ms  min {r['min_ms']:7.2f} ms  "
                  f"max |diff| vs {next(iter(by_variant))} {r['max_abs_diff_vs_first']:.2e}")


def main() -> None:
    parser = common.bench_parser(__doc__.split("\n")[0], "the first 32 prompts, 5 reps")
    parser.add_argument("--reps", type=int, default=15, help="timed calls of each build")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="pool dtypes, comma-separated")
    parser.add_argument("--variants", default="", help="native builds, comma-separated (default: every one built "
                        "that this CPU runs, the best first)")
    args = parser.parse_args()
    from jpaged.device.attention import native

    start = time.perf_counter()
    variants = args.variants.split(",") if args.variants else native.available_variants()
    if not variants:
        sys.exit("prompt_attention_cpu: no native build of the attention kernel (pip install -e . builds them)")
    lengths = np.array([len(ids) for ids in load_requests()[1][:32 if args.quick else 120]], np.int32)
    rng = np.random.default_rng(args.seed)
    reps = 5 if args.quick else args.reps
    out = {"benchmark": "prompt_attention_cpu", "quick": args.quick, "machine": common.machine_info(),
           "num_prompts": len(lengths), "prompt_tokens": int(lengths.sum()), "prompt_lengths": lengths,
           "shape": {"kv_heads": KV_HEADS, "query_heads": HEADS, "head_dim": HEAD_DIM, "block": 16},
           "reps": reps, "variants": variants, "results": {}}
    for name in args.dtypes.split(","):
        out["results"][name] = time_variants(variants, operands(lengths, name, rng), reps)
    common.report(out, args.out, common.results_stem("prompt_attention_cpu", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
