"""Loading the default model: its GGUF file against a jpaged checkpoint of it, side by side.

`load_model` on the GGUF (Q4_1, parsed and dequantized to float32) and on the orbax checkpoint
`jpaged convert` writes (float32 parameters, the tokenizer beside them), alternating, `--repeats`
times each, in one process (the first of each is reported apart: it pays imports and cold files).
Also: the conversion's own time and the checkpoint's size on disk.

    python bench/checkpoint_load.py [--quick] [--out bench/results]     # checkpoint_load.json / .png
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402


def run(repeats: int, log=print) -> dict:
    import jax

    from jpaged.weights import checkpoint, default_model_path, load_model

    def timed_load(path) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(load_model(path).params)
        return time.perf_counter() - t0

    gguf = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        converted = checkpoint.save(load_model(gguf), Path(tmp) / "smol")
        convert_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in converted.rglob("*") if f.is_file())
        times = {"gguf": [], "checkpoint": []}
        for k in range(repeats + 1):  # alternating; round 0 is the cold one
            for name, path in (("gguf", gguf), ("checkpoint", converted)):
                times[name].append(timed_load(path))
                log(f"round {k}: {name} {times[name][-1]:.2f} s")
    result = {name: {"first_s": t[0], "median_s": float(sorted(t[1:])[len(t[1:]) // 2]), "runs_s": t[1:]}
              for name, t in times.items()}
    return {"loads": result, "gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size, "checkpoint_bytes": size,
            "convert_s": convert_s,
            "checkpoint_speedup": result["gguf"]["median_s"] / result["checkpoint"]["median_s"]}


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = out["results"]["loads"]
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.bar(["GGUF (Q4_1)", "jpaged checkpoint"], [loads["gguf"]["median_s"], loads["checkpoint"]["median_s"]],
           color=["tab:gray", "tab:blue"])
    ax.set_ylabel("load_model, seconds (median)")
    ax.set_title(f"Loading the default model: checkpoint {out['results']['checkpoint_speedup']:.1f}x faster",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], "2 loads of each instead of 5")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    machine = common.machine_info()
    results = run(2 if args.quick else 5, log=lambda s: print(s, flush=True))
    out = dict(benchmark="checkpoint_load", machine=machine, settings=dict(repeats=2 if args.quick else 5),
               results=results)

    def print_table(out):
        r = out["results"]
        for name, t in r["loads"].items():
            print(f"{name:<11} median {t['median_s']:.2f} s  (first {t['first_s']:.2f} s)")
        print(f"checkpoint: {r['checkpoint_speedup']:.1f}x faster to load, {r['checkpoint_bytes'] / 2**20:.0f} MiB "
              f"against the GGUF's {r['gguf_bytes'] / 2**20:.0f} MiB; converting took {r['convert_s']:.1f} s")

    return common.report(out, args.out, common.results_stem("checkpoint_load", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
