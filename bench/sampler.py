"""The greedy sampler on a CPU: `jpaged.device.sampler.sample` against its previous formulation.

`sample` with greedy rows over the default model's vocabulary (49,152 logits a row), with no top
tokens and with one (`num_top=1`, as a request for logprobs asks), against `previous_sample` below:
the same computation with XLA's argmax over whole rows and `lax.top_k` for the top token (the
sampler before commit 6aa7be4). XLA's CPU argmax is a variadic (value, index) reduction that does
not vectorize; `sample` takes the argmax from chunk maxima instead. Every variant runs alternating
with the others, median of `--reps` rounds of 20 calls; the two must agree (tokens, top tokens, logprobs).

    python bench/sampler.py [--quick] [--reps 7] [--out bench/results]   # sampler{,_quick}.json/.png
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import bench_parser, machine_info, report, results_stem  # noqa: E402

VOCAB = 49152
CALLS = 20


def previous_sample(logits, rows, num_top: int):
    """The greedy path of the sampler before commit 6aa7be4: (token ids, their logprobs, top ids,
    top logprobs), as `sample` returns them."""
    import jax
    import jax.numpy as jnp

    logits = logits.astype(jnp.float32)
    row_max = jnp.max(logits, axis=-1)
    log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1))
    token_ids = jnp.argmax(logits, axis=-1)[rows].astype(jnp.int32)
    chosen = (logits[rows, token_ids] - row_max[rows]) - log_norm[rows]
    if not num_top:
        return token_ids, chosen, jnp.zeros((rows.shape[0], 0), jnp.int32), jnp.zeros((rows.shape[0], 0))
    top_logits, top_ids = jax.lax.top_k(logits, num_top)
    top_logprobs = (top_logits[rows] - row_max[rows, None]) - log_norm[rows, None]
    return token_ids, chosen, top_ids[rows].astype(jnp.int32), top_logprobs


def variants(num_top: int):
    """name -> a jitted (logits, rows) -> (token ids, logprobs, top ids, top logprobs): every output a
    call returns, so that XLA computes all of it."""
    import jax
    import jax.numpy as jnp

    from jpaged.device.sampler import SamplingInputs, sample

    def current(logits, rows):
        n = rows.shape[0]
        greedy = SamplingInputs(temperature=jnp.zeros(n), top_k=jnp.zeros(n, jnp.int32), top_p=jnp.ones(n),
                                seed=jnp.zeros(n, jnp.uint32), sample_index=jnp.zeros(n, jnp.int32),
                                step=jnp.zeros(n, jnp.int32))
        out = sample(logits, rows, greedy, num_top=num_top, use_random=False)
        return out.token_ids, out.logprobs, out.top_ids, out.top_logprobs

    return {"sample": jax.jit(current), "previous": jax.jit(lambda logits, rows: previous_sample(logits, rows, num_top))}


def measure(rows: int, num_top: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    logits = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, VOCAB), np.float32) * 4)
    index = jnp.arange(rows, dtype=jnp.int32)
    fns = variants(num_top)
    outs = {name: jax.block_until_ready(f(logits, index)) for name, f in fns.items()}  # compile
    a, b = ([np.asarray(x) for x in outs[name]] for name in ("sample", "previous"))
    if not (np.array_equal(a[0], b[0]) and np.array_equal(a[2], b[2])
            and np.allclose(a[1], b[1], atol=1e-5) and np.allclose(a[3], b[3], atol=1e-5)):
        raise SystemExit(f"rows={rows} num_top={num_top}: the two samplers disagree")
    times = {name: [] for name in fns}
    for rep in range(reps):
        for name in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            for _ in range(CALLS):
                out = fns[name](logits, index)
            jax.block_until_ready(out)
            times[name].append(1e3 * (time.perf_counter() - t0) / CALLS)
    ms = {name: float(np.median(t)) for name, t in times.items()}
    return {"rows": rows, "num_top": num_top, "ms": ms, "speedup": ms["previous"] / ms["sample"],
            "ms_all": times}


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for num_top, style in ((0, "-"), (1, "--")):
        cases = [c for c in out["cases"] if c["num_top"] == num_top]
        for name, color in (("previous", "tab:gray"), ("sample", "tab:blue")):
            ax.plot([c["rows"] for c in cases], [c["ms"][name] for c in cases], "o" + style, color=color,
                    label=f"{name}, num_top={num_top}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows")
    ax.set_ylabel(f"ms per call (vocabulary {VOCAB})")
    ax.set_title("Greedy sampling on a CPU: chunked argmax against XLA's argmax", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(out: dict) -> None:
    print(f"{'rows':>5s} {'num_top':>8s} {'previous ms':>12s} {'sample ms':>10s} {'speedup':>8s}")
    for c in out["cases"]:
        print(f"{c['rows']:5d} {c['num_top']:8d} {c['ms']['previous']:12.2f} {c['ms']['sample']:10.2f} "
              f"{c['speedup']:7.1f}x")


def main(argv=None) -> dict:
    parser = bench_parser(__doc__.splitlines()[0], "rows 128 only, 3 reps")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = (128,) if args.quick else (16, 64, 128, 256)
    reps = 3 if args.quick else args.reps
    cases = [measure(n, num_top, reps) for n in rows for num_top in (0, 1)]
    out = {"benchmark": "sampler", "machine": machine_info(),
           "settings": {"vocab": VOCAB, "calls_per_rep": CALLS, "reps": reps, "sampling": "greedy"},
           "cases": cases}
    return report(out, args.out, results_stem("sampler", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
