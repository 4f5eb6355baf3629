"""Sliding-window attention on the paged cache: the KV blocks it holds and the decode speed it gets.

Three random models of one shape (6 layers, hidden 256, 8 query / 2 KV heads of 32, the default
model's vocabulary) differ in their attention alone:
  full     every layer sees the whole context (Llama);
  window   every layer sees its last W positions (Mistral): the block manager gives the blocks that
           slid out of the window back to the pool while the sequence runs;
  mixed    five windowed layers to one full one (Gemma 3's pattern): the full layers read the whole
           context, so every block stays allocated; the windowed layers read only their window's
           blocks (the native kernel and the Pallas kernel skip the rest).
The same greedy requests (random prompts, contexts several windows long) run on each, side by side
in one process, in alternating rounds: output tokens/s of a timed `generate`, the most blocks the
pool held at once and the most one sequence held (from the engine's step records).

    python bench/sliding_window.py [--quick] [--out bench/results]   # writes sliding_window.json and .png
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

KINDS = ("full", "window", "mixed")


def _config(kind: str, window: int, vocab_size: int):
    from jpaged.device.config import ModelConfig

    layers = 6
    windows = {"full": (), "window": (window,) * layers,
               "mixed": tuple(None if (i + 1) % 6 == 0 else window for i in range(layers))}[kind]
    return ModelConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_layers=layers,
                       num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=8192,
                       architecture={"full": "llama", "window": "mistral", "mixed": "gemma3_text"}[kind],
                       layer_windows=windows)


def run(num_requests: int, prompt_len: int, max_tokens: int, window: int, rounds: int, seed: int, log=print) -> dict:
    import jax
    import numpy as np

    from jpaged import LLM, SamplingParams
    from jpaged.core.kv_cache_manager import live_block_table
    from jpaged.device.params import init_params
    from jpaged.weights import LoadedModel, load_model

    tokenizer = load_model(None).tokenizer
    block_size = 16
    blocks_per_seq = -(-(prompt_len + max_tokens) // block_size)
    llms, records = {}, {}
    for kind in KINDS:
        config = _config(kind, window, len(tokenizer))
        params = init_params(config, jax.random.key(seed), scale=0.1)
        loaded = LoadedModel(config, params, tokenizer, Path(f"random-{kind}"))
        llms[kind] = LLM(loaded=loaded, block_size=block_size, num_blocks=num_requests * blocks_per_seq + 8)
        records[kind] = []
        llms[kind].engine.add_observer(records[kind].append)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, len(tokenizer) - 100, prompt_len).tolist() for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for kind in KINDS:  # compiles every shape of the run
        llms[kind].generate(prompts, params, use_tqdm=False)
    speed = {kind: [] for kind in KINDS}
    for k in range(rounds):
        for kind in (KINDS if k % 2 == 0 else KINDS[::-1]):
            records[kind].clear()
            start = time.perf_counter()
            llms[kind].generate(prompts, params, use_tqdm=False)
            speed[kind].append(num_requests * max_tokens / (time.perf_counter() - start))
            log(f"  round {k} {kind:<7} {speed[kind][-1]:7.1f} tokens/s")
    results = {}
    for kind in KINDS:
        kv = [r.kv for r in records[kind]]
        pool = max(m.num_blocks - 1 - m.num_free_blocks for m in kv)
        per_seq = max((len(live_block_table(m, s)) for m in kv for s in m.seq_ids if not m.is_swapped(s)), default=0)
        median = sorted(speed[kind])[len(speed[kind]) // 2]
        results[kind] = dict(tokens_per_s=median, rounds_tokens_per_s=speed[kind],
                             peak_pool_blocks=pool, peak_blocks_per_sequence=per_seq,
                             windows=list(_config(kind, window, len(tokenizer)).windows),
                             attention_backend=llms[kind].engine.runner.backend.name)
    for kind in KINDS:
        results[kind]["speed_vs_full"] = results[kind]["tokens_per_s"] / results["full"]["tokens_per_s"]
        results[kind]["pool_blocks_vs_full"] = results[kind]["peak_pool_blocks"] / results["full"]["peak_pool_blocks"]
    return results


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, s = out["results"], out["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    kinds = list(results)
    axes[0].bar(kinds, [r["peak_pool_blocks"] for r in results.values()], color="tab:blue")
    axes[0].set_ylabel("most KV blocks held at once")
    axes[1].bar(kinds, [r["tokens_per_s"] for r in results.values()], color="tab:green")
    axes[1].set_ylabel("output tokens / s (greedy)")
    fig.suptitle(f"{s['num_requests']} requests, contexts {s['prompt_len']} + {s['max_tokens']} tokens, "
                 f"window {s['window']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], "4 requests, 32 + 256 tokens, window 64, 1 round")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    start = time.perf_counter()
    num_requests, prompt_len, max_tokens, window, rounds = (4, 32, 256, 64, 1) if args.quick else (8, 64, 1024, 128, 3)
    machine = common.machine_info()
    results = run(num_requests, prompt_len, max_tokens, window, rounds, args.seed, log=lambda s: print(s, flush=True))
    out = dict(benchmark="sliding_window", machine=machine,
               settings=dict(num_requests=num_requests, prompt_len=prompt_len, max_tokens=max_tokens, window=window,
                             rounds=rounds, block_size=16, greedy=True, compile_cache=args.compile_cache),
               results=results)

    def print_table(out):
        print(f"{'model':<8}{'tokens/s':>9}{'x full':>8}{'pool blocks':>12}{'x full':>8}{'per seq':>8}")
        for kind, r in out["results"].items():
            print(f"{kind:<8}{r['tokens_per_s']:9.1f}{r['speed_vs_full']:8.2f}{r['peak_pool_blocks']:12d}"
                  f"{r['pool_blocks_vs_full']:8.2f}{r['peak_blocks_per_sequence']:8d}")

    return common.report(out, args.out, common.results_stem("sliding_window", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
