"""One decode row's float32 weight products: jpaged's native kernel under XLA against the same access
pattern in a plain C loop, on the same weights.

The default model's shapes (30 layers of q/k/v [576 -> 576, 192, 192], o [576 -> 576], gate/up
[576 -> 1536] x 2 and down [1536 -> 576], then the [576 -> 49152] head: 538 MB of float32), random
weights laid out as the engine holds them for its one-row products (`quant.float_rows` stacks on
transparent huge pages, `huge_pages.advise_huge_pages`). Two ways to multiply one row by all of them,
as a decode step's chain of dependent products (121 calls, as the model makes them: q/k/v together,
gate/up together):
  - "xla": jpaged's products (`quantized_matmuls`, the native float-rows kernel) in one jitted `lax.scan`
    over the layers, then the head: the model's layer loop without its attention and norms;
  - "loop": `bench/csrc/row_read.c`, compiled here with the system C compiler for this CPU: the kernel's
    access pattern at one row on AMD Zen 4 (a channel at a time, the next prefetched; two threads in
    guided runs) in a plain loop over the very same buffers, without XLA, the FFI or the kernel's crew.
Both read the same bytes in the same order, so the loop is what this pattern costs here, and the ratio
is what running it as jpaged runs it adds. Rounds alternate the two (which goes first alternates too);
each figure is the median of `--reps` passes. The sums are not compared (the loop's order of additions
is not the kernel's); the weights and the order of the reads are.

    python bench/one_row_read.py [--rounds 8] [--reps 7]     # one_row_read.json / .png

This is an instrument for the one-stream decode of bench/latency.py (float32 against llama.cpp's F32),
not a product path: nothing in jpaged uses the loop.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 30, 576, 1536, 49152
QKV = (576, 192, 192)  # q, k, v output channels (9 query heads, 3 KV heads of 64)


def build_loop():
    """`rr_pass` of bench/csrc/row_read.c, compiled for this CPU into a temporary folder."""
    rr_pass = common.load_c_library("row_read.c", ["-pthread"]).rr_pass
    rr_pass.restype = ctypes.c_double
    rr_pass.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 2
    return rr_pass


def weights(seed: int) -> dict:
    """The default model's weight shapes as the engine's one-row products hold them: name -> float-rows
    `QuantizedWeight` (a stack of 30 layers, or the head alone), on huge pages where Linux allows."""
    import jax.numpy as jnp

    from jpaged.device.huge_pages import advise_huge_pages
    from jpaged.device.quant import float_rows

    rng = np.random.default_rng(seed)
    shapes = dict(q=(LAYERS, HIDDEN, QKV[0]), k=(LAYERS, HIDDEN, QKV[1]), v=(LAYERS, HIDDEN, QKV[2]),
                  o=(LAYERS, QKV[0], HIDDEN), gate=(LAYERS, HIDDEN, INTERMEDIATE), up=(LAYERS, HIDDEN, INTERMEDIATE),
                  down=(LAYERS, INTERMEDIATE, HIDDEN), head=(1, HIDDEN, VOCAB))
    out = {}
    for name, shape in shapes.items():
        w = float_rows(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02), shape[1:], (0,))
        advise_huge_pages(w)
        out[name] = w
    return out


def xla_chain(ws: dict):
    """The jitted chain of jpaged's products: an argument-free callable that runs it once and waits."""
    import jax
    import jax.numpy as jnp

    from jpaged.device.quant import quantized_matmul, quantized_matmuls

    def layer(x, i):
        q, k, v = quantized_matmuls(x, [ws[n].of_layer(i) for n in ("q", "k", "v")])
        x = x + quantized_matmul(q + 1e-30 * (k[:, :1] + v[:, :1]), ws["o"].of_layer(i))
        gate, up = quantized_matmuls(x, [ws["gate"].of_layer(i), ws["up"].of_layer(i)])
        return x + 1e-3 * quantized_matmul(gate * up, ws["down"].of_layer(i)), None

    def step(x):
        x = jax.lax.scan(layer, x, jnp.arange(LAYERS, dtype=jnp.int32))[0]
        return quantized_matmul(x, ws["head"].of_layer(jnp.int32(0)))

    f = jax.jit(step)
    x = jnp.ones((1, HIDDEN), jnp.float32)
    jax.block_until_ready(f(x))
    return lambda: jax.block_until_ready(f(x))


def loop_chain(ws: dict, rr_pass):
    """The same calls over the same buffers in `rr_pass`: an argument-free callable returning its seconds."""
    calls = [("q", "k", "v"), ("o",), ("gate", "up"), ("down",)]
    pointers, n, k, first = [], [], [], [0]
    for layer in range(LAYERS):
        for call in calls:
            for name in call:
                values = ws[name].values  # [L, N, K] float32
                _, rows, cols = values.shape
                pointers.append(values.unsafe_buffer_pointer() + layer * rows * cols * 4)
                n.append(rows)
                k.append(cols)
            first.append(len(pointers))
    head = ws["head"].values
    pointers.append(head.unsafe_buffer_pointer())
    n.append(head.shape[1])
    k.append(head.shape[2])
    first.append(len(pointers))
    pointers = np.array(pointers, np.uint64)
    n, k, first = np.array(n, np.int64), np.array(k, np.int64), np.array(first, np.int32)
    x, y = np.ones(INTERMEDIATE, np.float32), np.zeros(VOCAB, np.float32)
    nbytes = int((n * k).sum()) * 4
    arrays = (pointers, n, k, first, x, y)  # kept alive by `run`, which passes their addresses

    def run():
        return rr_pass(*(a.ctypes.data for a in arrays[:4]), len(first) - 1, x.ctypes.data, y.ctypes.data)

    return run, nbytes


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7, help="passes a figure is the median of")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rr_pass = build_loop()  # before JAX: a machine without a compiler stops here
    ws = weights(args.seed)
    runners = {"xla": xla_chain(ws)}
    loop, nbytes = loop_chain(ws, rr_pass)
    runners["loop"] = loop
    loop()

    def seconds(name):
        if name == "loop":
            return runners["loop"]()
        t = time.perf_counter()
        runners["xla"]()
        return time.perf_counter() - t

    rounds = []
    for r in range(args.rounds):
        order = ("xla", "loop") if r % 2 == 0 else ("loop", "xla")
        ms = {name: 1e3 * statistics.median(seconds(name) for _ in range(args.reps)) for name in order}
        rounds.append(dict(ms, xla_over_loop=ms["xla"] / ms["loop"]))
        print(f"round {r + 1}: xla {ms['xla']:.2f} ms ({nbytes / ms['xla'] / 1e6:.1f} GB/s), loop {ms['loop']:.2f} ms "
              f"({nbytes / ms['loop'] / 1e6:.1f} GB/s), xla / loop {ms['xla'] / ms['loop']:.3f}", flush=True)
    summary = {key: statistics.median(r[key] for r in rounds) for key in ("xla", "loop", "xla_over_loop")}
    out = dict(benchmark="one_row_read", machine=common.machine_info(),
               config=dict(rounds=args.rounds, reps=args.reps, seed=args.seed, bytes=nbytes, calls=LAYERS * 4 + 1),
               rounds=rounds, median=summary)
    return common.report(out, args.out, "one_row_read", start, plot, print_table)


def print_table(out: dict) -> None:
    m = out["median"]
    nbytes = out["config"]["bytes"]
    print(f"{out['machine']['cpu'].get('model_name')}: {nbytes / 1e6:.0f} MB of float32 weights, one row, "
          f"median of {out['config']['rounds']} rounds")
    print(f"  jpaged under XLA {m['xla']:.2f} ms ({nbytes / m['xla'] / 1e6:.1f} GB/s), plain loop {m['loop']:.2f} ms "
          f"({nbytes / m['loop'] / 1e6:.1f} GB/s), xla / loop {m['xla_over_loop']:.3f} (rounds "
          f"{', '.join(format(r['xla_over_loop'], '.2f') for r in out['rounds'])})")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rounds = np.arange(1, len(out["rounds"]) + 1)
    for key, label in (("xla", "jpaged's kernel under XLA"), ("loop", "the same pattern, plain C loop")):
        ax.plot(rounds, [r[key] for r in out["rounds"]], "o-", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("ms per pass (121 one-row products, 538 MB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"one row, float32 weights ({out['machine']['cpu'].get('model_name')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
