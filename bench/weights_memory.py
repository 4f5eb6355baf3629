"""The memory an engine's weights take: the bytes of parameters it holds and the process's resident memory.

For each weight width (float32, bfloat16, int8), a fresh process builds `LLM(dtype=..., num_blocks=16)`
on the default model (a pool of 16 blocks: the pool's memory is negligible) and reports: the model's
parameter count times the width (`weight_bytes`: what one copy takes), the distinct device buffers the
engine holds in `engine.model.params` and `engine.runner.params` (`held_bytes`: views of one buffer
counted once), and the process's memory before the engine is built (JAX initialized) and after, from
Linux's /proc/self/statm: resident (`rss_growth_bytes`) and resident less file-backed pages, the mapped
model file and libraries (`anon_growth_bytes`: what the process allocated, freed memory the allocator
keeps included), with the peak resident memory (`ru_maxrss`: loading included).
On one CPU device the engine holds its bfloat16 and float32 dense weights as [out, in] rows for the
native few-row kernel (`jpaged.device.quant.float_row_params`); `held_bytes / weight_bytes` says
whether the arrays they were transposed from are kept beside them.

    python bench/weights_memory.py [--quick] [--out bench/results]     # weights_memory.json / .png
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

WIDTHS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
          "int8": dict(dtype="float32", quantization="int8")}


def _resident() -> tuple[int, int]:
    """(resident bytes, resident bytes less the file-backed ones) of this process."""
    fields = [int(f) * os.sysconf("SC_PAGE_SIZE") for f in Path("/proc/self/statm").read_text().split()]
    return fields[1], fields[1] - fields[2]


def child(width: str) -> dict:
    """One engine of `width` in this process: its numbers (see the module docstring)."""
    import gc

    import jax
    import numpy as np

    from jpaged import LLM
    from jpaged.device.params import num_params

    jax.devices()  # the backend's own memory before the baseline
    before = _resident()
    llm = LLM(num_blocks=16, **WIDTHS[width])
    gc.collect()
    engine = llm.engine
    buffers = {x.unsafe_buffer_pointer(): x.nbytes
               for tree in (engine.model.params, engine.runner.params) for x in jax.tree.leaves(tree)}
    itemsize = 1 if width == "int8" else np.dtype(engine.param_dtype).itemsize
    return dict(weight_bytes=num_params(engine.model.config) * itemsize, held_bytes=sum(buffers.values()),
                **{name: after - was for name, after, was in zip(("rss_growth_bytes", "anon_growth_bytes"),
                                                                  _resident(), before)},
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                float_rows=getattr(engine.runner.params.layers.wq, "is_float", False))


def run(widths, log=print) -> dict:
    results = {}
    for width in widths:
        out = subprocess.run([sys.executable, __file__, "--child", width], check=True, capture_output=True,
                             text=True).stdout
        results[width] = r = json.loads(out.strip().splitlines()[-1])
        r["held_over_weights"] = r["held_bytes"] / r["weight_bytes"]
        log(f"{width:<9} weights {r['weight_bytes'] / 2**20:6.0f} MiB  held {r['held_bytes'] / 2**20:6.0f} MiB "
            f"({r['held_over_weights']:.2f}x)  allocated +{r['anon_growth_bytes'] / 2**20:6.0f} MiB, resident "
            f"+{r['rss_growth_bytes'] / 2**20:6.0f} MiB (peak {r['peak_rss_bytes'] / 2**20:.0f} MiB)")
    return results


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = out["results"]
    names = list(results)
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(5, 3))
    for offset, key, label in ((-0.27, "weight_bytes", "one copy of the weights"),
                               (0.0, "held_bytes", "held by the engine"),
                               (0.27, "anon_growth_bytes", "memory the process allocated")):
        ax.bar([i + offset for i in x], [results[n][key] / 2**20 for n in names], width=0.27, label=label)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MiB")
    ax.set_title(f"An engine's weights, the default model ({out['machine']['cpu'].get('model_name')})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(argv[1])))
        return {}
    parser = common.bench_parser(__doc__.splitlines()[0], "float32 and bfloat16 only")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    widths = ["float32", "bfloat16"] if args.quick else list(WIDTHS)
    out = dict(benchmark="weights_memory", machine=common.machine_info(), settings=dict(widths=widths, num_blocks=16),
               results=run(widths, log=lambda s: print(s, flush=True)))

    def print_table(out):
        for width, r in out["results"].items():
            print(f"{width:<9} held {r['held_over_weights']:.2f}x one copy, allocated "
                  f"+{r['anon_growth_bytes'] / 2**20:.0f} MiB for {r['weight_bytes'] / 2**20:.0f} MiB of weights")

    return common.report(out, args.out, common.results_stem("weights_memory", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
