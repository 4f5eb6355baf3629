"""Model FLOPs utilisation of the decode step against this machine's float32 matmul peak.

The peak is a large `jnp.dot` (f32, 2048 x 2048 x 2048) timed in the same run, interleaved with
the decode measurements (the machine is shared: each decode figure is divided by the median of
the peak readings taken around it). Decode: the real default model's compiled decode step through
`ModelRunner` (packed rows, paged attention over a `context`-token cache per sequence, the LM head
for every row), timed compile-free, median of `repeats` steps.

The small batches show what batching buys on this machine: a decode step reads every weight
once whatever the batch (a fixed cost), and on a CPU each row adds compute that soon dominates, so
tokens/s saturates after a few dozen rows (the paper's GPU decode, bound by memory reads, keeps
gaining with the batch). That curve bounds what any memory manager can gain by fitting more
sequences in the batch (`throughput_vs_batch_1`).

Model FLOPs per decoded token: 2 x (every matmul weight, LM head included) + 4 x context x
num_heads x head_dim x num_layers (QK^T and PV). Embedding lookups, norms and softmax count zero.

    python bench/mfu.py [--quick] [--out bench/results]     # writes mfu.json and mfu.png (--quick: mfu_quick.*)

Goal (issue 5): decode at batch >= 64 reaches 40% of the f32 matmul peak.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import RESULTS_DIR, machine_info, results_stem, write_json  # noqa: E402

PEAK_N = 2048
BLOCK_SIZE = 16


def matmul_peak(repeats: int = 5, dtype: str = "float32") -> float:
    """GFLOP/s of the best of `repeats` [N, N] @ [N, N] products in `dtype` with a float32 result
    (compiled once)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (PEAK_N, PEAK_N), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * PEAK_N ** 3 / best / 1e9


def decode_flops_per_token(config, context: int) -> float:
    h, d = config.hidden_size, config.head_dim
    attn = h * config.num_heads * d * 2 + h * config.num_kv_heads * d * 2  # q, o; k, v
    mlp = 3 * h * config.intermediate_size
    weights = config.num_layers * (attn + mlp) + h * config.vocab_size  # + LM head
    return 2 * weights + 4 * context * config.num_heads * d * config.num_layers


def decode_step_seconds(loaded, backend, batch: int, context: int, repeats: int) -> float:
    """Median wall seconds of the compiled decode step for `batch` sequences of `context` tokens, with
    attention on `backend` (an `AttentionBackend`)."""
    import jax

    from jpaged.core.kv_cache_manager import blocks_for, slot_ids
    from jpaged.device.runner import ModelRunner
    from jpaged.core.scheduler import Row

    per_seq = blocks_for(context, BLOCK_SIZE)
    runner = ModelRunner(loaded.config, loaded.params, num_blocks=1 + batch * per_seq, block_size=BLOCK_SIZE,
                         backend=backend)
    rows = []
    for b in range(batch):  # each sequence decodes its token at position context - 1 of its own blocks
        table = list(range(1 + b * per_seq, 1 + (b + 1) * per_seq))
        rows.append(Row(token_ids=[100 + b], start_position=context - 1,
                        slots=slot_ids(table, context - 1, context, BLOCK_SIZE), block_table=table))
    jax.block_until_ready(runner.execute(rows, decode=True))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.execute(rows, decode=True))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def plot(rows: list, path: Path, attention: str) -> None:
    """Decode tokens/s and MFU against the batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(batches, [r["tokens_per_s"] for r in rows], "o-", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.1 * max(r["tokens_per_s"] for r in rows))
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("decode tokens/s", color="tab:blue")
    mfu = ax.twinx()
    mfu.plot(batches, [100 * r["mfu"] for r in rows], "s--", color="tab:red")
    mfu.axhline(40, color="tab:red", lw=0.8, ls=":")
    mfu.set_ylabel("% of f32 matmul peak (MFU)", color="tab:red")
    mfu.set_ylim(0, 100)
    ax.set_title(f"SmolLM2-135M decode step, context {rows[0]['context']}, f32, CPU, {attention} attention",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batches 64 and 128 only, fewer repeats")
    parser.add_argument("--context", type=int, default=128, help="tokens in each sequence's cache")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    from jpaged.device.attention import get_backend
    from jpaged.weights import load_model

    backend = get_backend("auto")  # the attention every batch runs (and the results name)
    attention = backend.name
    loaded = load_model(None)
    batches = (64, 128) if args.quick else (1, 4, 8, 16, 24, 32, 64, 128, 256)
    repeats = 3 if args.quick else 7
    flops_per_token = decode_flops_per_token(loaded.config, args.context)
    peaks, rows = [matmul_peak()], []
    for batch in batches:
        seconds = decode_step_seconds(loaded, backend, batch, args.context, repeats)
        peaks.append(matmul_peak())
        peak = float(np.median(peaks[-2:]))
        gflops = batch * flops_per_token / seconds / 1e9
        rows.append(dict(batch=batch, context=args.context, step_ms=1e3 * seconds, tokens_per_s=batch / seconds,
                         model_gflops=gflops, peak_gflops=peak, mfu=gflops / peak))
        print(f"batch {batch:4d}: decode step {1e3 * seconds:7.1f} ms, {batch / seconds:6.0f} tok/s, "
              f"{gflops:6.1f} GFLOP/s = {gflops / peak:.0%} of the f32 matmul peak ({peak:.0f} GFLOP/s)", flush=True)
    # Not this run's model (float32 parameters): what `dtype="bfloat16"` parameters use on a CPU,
    # read after the last batch. On an AMD EPYC with AVX512-BF16 XLA's CPU dot ran bf16 operands at
    # 1.7-1.9x float32 with a float32 result, and no faster than float32 with a bfloat16 one.
    bf16_peak = matmul_peak(dtype="bfloat16")
    print(f"bfloat16 x bfloat16 -> float32 matmul peak: {bf16_peak:.0f} GFLOP/s "
          f"({bf16_peak / peaks[-1]:.2f}x float32's last reading)", flush=True)
    for r in rows:
        r["throughput_vs_batch_1"] = r["tokens_per_s"] / rows[0]["tokens_per_s"] if batches[0] == 1 else None
    at_64 = [r["mfu"] for r in rows if r["batch"] >= 64]
    result = {"benchmark": "mfu", "machine": machine_info(),
              "settings": {"context": args.context, "block_size": BLOCK_SIZE, "dtype": "float32",
                           "attention_backend": attention,
                           "peak": f"jnp.dot f32 {PEAK_N}^3, best of 5, measured before and after every batch",
                           "model_flops_per_token": flops_per_token, "repeats": repeats},
              "peak_readings_gflops": peaks, "rows": rows,
              "bfloat16_peak_gflops": bf16_peak, "bfloat16_peak": "jnp.dot bf16 x bf16 -> f32, "
                                                                   f"{PEAK_N}^3, best of 5, after the last batch",
              "goal": {"mfu_at_batch_64_or_more": 0.40, "best": max(at_64), "met": max(at_64) >= 0.40}}
    stem = results_stem("mfu", args.quick)
    write_json(args.out / f"{stem}.json", result)
    plot(rows, args.out / f"{stem}.png", attention)
    return result


if __name__ == "__main__":
    main()
