"""Decode attention on the CPU: the native kernel against the XLA path and the memory-read bound.

One decode step's attention over the default model's 30 layers (3 KV heads x 64, 9 query heads),
on a pool laid out as jpaged's ([layers, blocks, 2 (K, V), 16, kv_heads, head_dim]) with every row's blocks
scattered at random, built as the engine builds it (zeros on transparent huge pages, then written
in place; `--small-pages` leaves it on 4 KiB pages, as XLA allocates by default), in one jitted
`lax.scan` over the layers as in the model (the pool is read in place at a traced layer index).
For each (rows, context) case and pool dtype, side by side in one run: ms per step of the native
kernel (`jpaged.device.attention.native`, the variant this CPU runs best) and of the XLA path
(`xla_attend`, gathered key tiles), and of reading what the step reads with vector loads and no
arithmetic, one thread per core (`bench/csrc/block_read.c`, compiled here with the system C compiler
for this CPU):
  - the read bound: reading as many bytes of the pool sequentially;
  - the block-read time: reading the very blocks the step reads, layer by layer, the faster of plain
    loads and loads with each next block's pages touched ahead. Scattered blocks read slower than
    one sequential stream: this is what reading them costs here before any arithmetic.
Each is the median of `--reps` runs, all of them alternating (forward, then backward), so that every
figure of a case sees the same load on this shared machine: its memory bandwidth moves from one
second to the next with its neighbours' work. The machine's read bandwidth is also measured once at
the start (the best of a multi-threaded matrix-vector product and numpy sums on one thread per core,
over a 1 GiB array); the step's bytes over it are a second bound, usually the stricter (it is the
best moment's bandwidth), reported beside the first, and the only one without a C compiler.
It also checks the two backends agree.

    python bench/attention_cpu.py [--quick] [--reps 7] [--out bench/results]   # attention_cpu{,_quick}.json/.png
    python bench/attention_cpu.py --quick --dtypes float32 --block-sizes 16,32,64   # attention_cpu_block_sizes_quick
    python bench/attention_cpu.py --small-pages     # attention_cpu_small_pages.json/.png
    python bench/attention_cpu.py --quick --variants avx512,avx2,portable   # attention_cpu_variants_quick

`--variants` also times the native kernel's other builds side by side (`native_<variant>_ms`): what
an AVX2-only or a non-x86 CPU gets from the kernel, measured on this one.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.vs_peers import machine_info as cpu_info  # noqa: E402

LAYERS, KV_HEADS, HEADS, HEAD_DIM = 30, 3, 9, 64
FULL = [(16, 480), (64, 480), (120, 128), (120, 480), (120, 1024), (120, "mixed")]
QUICK = [(16, 480), (64, 480), (120, 480)]


def seconds_on_threads(calls) -> float:
    """Wall seconds to run each of `calls` (argument-free callables) on a thread of its own, at once."""
    threads = [threading.Thread(target=call) for call in calls]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def measure_bandwidth(gib: float = 1.0, reps: int = 5) -> dict:
    """Read bandwidth (bytes/s) of this machine now: the best of a BLAS matrix-vector product (its
    own threads) and numpy sums on one thread per core, each over `gib` GiB of float32."""
    x = np.ones((int(gib * 2**30) // 4 // 1024, 1024), np.float32)
    ones = np.ones(1024, np.float32)
    gemv = []
    for _ in range(reps):
        t = time.perf_counter()
        x @ ones
        gemv.append(x.nbytes / (time.perf_counter() - t))
    parts = np.array_split(x, os.cpu_count() or 1)
    threaded = [x.nbytes / seconds_on_threads([functools.partial(np.sum, p) for p in parts]) for _ in range(reps)]
    return dict(bytes_per_s=max(max(gemv), max(threaded)), gemv=max(gemv), numpy_threads=max(threaded))


def build_block_reader():
    """`read_chunks` of bench/csrc/block_read.c, compiled for this CPU into a temporary folder, or None
    (with a line saying why) where no C compiler builds it."""
    try:
        read = common.load_c_library("block_read.c").read_chunks
    except (OSError, subprocess.SubprocessError) as error:
        print(f"block-read bound skipped: {os.environ.get('CC', 'cc')} could not build block_read.c ({error})")
        return None
    read.restype = ctypes.c_float
    read.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int]
    return read


def chunk_reader(read, k_ptr: int, v_ptr: int, offsets, sizes, prefetch: bool):
    """An argument-free callable: reads (with `read`) the chunks (offsets, sizes, in bytes) from the
    addresses `k_ptr` and `v_ptr`, K then V, the list cut into one contiguous part per core, each on
    its own thread; returns the wall seconds. `prefetch`: each next chunk's pages touched ahead (see
    block_read.c). The caller keeps the memory behind the addresses alive."""
    offsets, sizes = np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(sizes, np.int64)
    parts = [part for part in np.array_split(np.arange(len(offsets)), os.cpu_count() or 1) if len(part)]

    def run():  # holds `offsets` and `sizes` (and so the memory the pointers below point into)
        calls = [functools.partial(read, k_ptr, v_ptr, offsets[part[0]:].ctypes.data,
                                   sizes[part[0]:].ctypes.data, len(part), prefetch) for part in parts]
        return seconds_on_threads(calls)

    return run


def read_timers(read, pool, tables, lens) -> tuple[dict, int]:
    """({name: timer}, bytes) for the step's reads with no arithmetic (`chunk_reader`s):
      - "sequential": as many bytes of the pool as the step reads, from its start, in 1 MiB chunks;
      - "blocks" / "blocks, pages touched": the very blocks the step reads (the slots each row's
        context fills: of a block's K, then of its V beside it), layer by layer and row by row, with
        plain loads / with each next block's pages touched ahead."""
    num_blocks, block_size = pool.shape[1], pool.shape[3]
    token = KV_HEADS * HEAD_DIM * pool.dtype.itemsize
    block = block_size * token  # a block's K (its V follows)
    chunks = [((layer * num_blocks + b) * 2 * block, min(block_size, int(n) - block_size * j) * token)
              for layer in range(LAYERS) for n, table in zip(lens, tables) for j, b in enumerate(table)]
    offsets, sizes = (np.array(a, np.int64) for a in zip(*chunks))
    half = int(sizes.sum())  # of K, and as many of V
    base = pool.unsafe_buffer_pointer()
    starts = np.arange(0, half, 2**20, dtype=np.int64)
    timers = {"sequential": chunk_reader(read, base, base + half, starts, np.minimum(2**20, half - starts), False),
              "blocks": chunk_reader(read, base, base + block, offsets, sizes, False),
              "blocks, pages touched": chunk_reader(read, base, base + block, offsets, sizes, True)}
    return timers, 2 * half


def context_lengths(rows: int, context, rng) -> np.ndarray:
    """Each row's context: `context` tokens, random 16-1,024 ("mixed"), or a sequence of `rows` lengths."""
    if not isinstance(context, (int, str)):
        return np.asarray(context)
    if context == "mixed":
        return rng.integers(16, 1025, rows)
    return np.full(rows, context)


def make_case(rows: int, context, dtype: str, rng, block_size: int = 16, huge_pages: bool = True):
    """(pool, per-row block tables, context lengths) with every block of every row at a random place."""
    import jax
    import jax.numpy as jnp

    from jpaged.device.attention.xla import storage_dtype
    from jpaged.device.kv_cache import KVCache, back_with_huge_pages

    lens = context_lengths(rows, context, rng)
    blocks = [-(-int(n) // block_size) for n in lens]
    num_blocks = sum(blocks) + 1
    order = rng.permutation(np.arange(1, num_blocks))
    tables, start = [], 0
    for n in blocks:
        tables.append(order[start:start + n].tolist())
        start += n
    shape = (LAYERS, num_blocks, 2, block_size, KV_HEADS, HEAD_DIM)
    store = storage_dtype(dtype)
    # as the engine's runner builds its pool: zeros on huge pages (jpaged.device.kv_cache), written in place
    cache = KVCache(kv=jnp.zeros(shape, store))
    if huge_pages:
        back_with_huge_pages(cache)

    @functools.partial(jax.jit, donate_argnums=0)
    def fill(pool, values):
        values = values.astype(dtype)
        if store != values.dtype:  # bfloat16 pools are stored as their bits (see jpaged.device.attention.xla)
            values = jax.lax.bitcast_convert_type(values, store)
        return jax.lax.dynamic_update_slice(pool, values, (0,) * len(shape))

    return fill(cache.kv, rng.standard_normal(shape, np.float32)), tables, lens


def step_fn(backend, inputs):
    """A jitted decode step's attention over every layer: each layer's output is the next one's query."""
    import jax

    def step(q, pool):
        def layer(q, layer_id):
            return backend.attend(q, pool, layer_id, inputs, HEAD_DIM ** -0.5), None
        out, _ = jax.lax.scan(layer, q, np.arange(LAYERS, dtype=np.int32))
        return out

    return jax.jit(step)


def seconds_of_step(fn, q, pool) -> float:
    """Wall seconds of one call of the jitted step `fn`, to its result."""
    import jax

    t = time.perf_counter()
    jax.block_until_ready(fn(q, pool))
    return time.perf_counter() - t


def run_case(rows, context, dtype, reps, bandwidth, rng, reader=None, block_size=16, huge_pages=True,
             variants=(), log=print) -> dict:
    import jax

    from jpaged.device.attention.native import NativeBackend, available_variants
    from jpaged.device.attention.xla import XLABackend
    from jpaged.device.batch import pack_rows
    from jpaged.device.model import _Row

    pool, tables, lens = make_case(rows, context, dtype, rng, block_size, huge_pages)
    packed = [_Row([0], int(n) - 1, [0], table) for n, table in zip(lens, tables)]
    inputs = pack_rows(packed, block_size=block_size, q_tile=1, k_tile=64)  # the runner's decode tiles
    q = rng.standard_normal((len(inputs.token_ids), HEADS, HEAD_DIM), np.float32)  # padded rows: see nothing
    fns = {"native": step_fn(NativeBackend(), inputs), "xla": step_fn(XLABackend(), inputs),
           **{f"native_{v}": step_fn(NativeBackend(variant=v), inputs) for v in variants}}
    outs = {name: jax.block_until_ready(fn(q, pool)) for name, fn in fns.items()}  # compile
    timers = {name: functools.partial(seconds_of_step, fn, q, pool) for name, fn in fns.items()}
    itemsize = np.dtype(np.float32 if dtype == "float32" else np.uint16).itemsize
    read_bytes = int(lens.sum()) * LAYERS * 2 * KV_HEADS * HEAD_DIM * itemsize
    if reader is not None:
        reads, reads_bytes = read_timers(reader, pool, tables, lens)
        assert reads_bytes == read_bytes, (reads_bytes, read_bytes)
        for timer in reads.values():  # warm the page tables (the steps ran once above, compiling)
            timer()
        timers.update(reads)
    times = {name: [] for name in timers}
    for r in range(reps):  # alternating, forward then backward, so that drift in the machine's load is shared
        for name in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            times[name].append(timers[name]())
    ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    bandwidth_bound = 1e3 * read_bytes / bandwidth
    bound = ms.get("sequential", bandwidth_bound)
    blocks_modes = {mode: ms[name] for mode, name in (("plain", "blocks"), ("prefetch", "blocks, pages touched"))
                    if name in ms}
    blocks_ms = min(blocks_modes.values(), default=None)  # the faster way of reading them
    diff = float(np.abs(np.asarray(outs["native"][:rows]) - np.asarray(outs["xla"][:rows])).max())
    result = dict(rows=rows, context=context, dtype=dtype, block_size=block_size, mean_context=float(lens.mean()),
                  read_bytes=read_bytes,
                  read_bound_ms=bound, read_bound_of_bandwidth_ms=bandwidth_bound,
                  native_ms=ms["native"], xla_ms=ms["xla"],
                  native_over_bound=ms["native"] / bound, xla_over_native=ms["xla"] / ms["native"],
                  block_read_ms=blocks_ms, native_over_block_read=blocks_ms and ms["native"] / blocks_ms,
                  block_read_modes_ms=blocks_modes,
                  max_abs_difference=diff, native_variant=available_variants()[0],
                  **{f"{name}_ms": ms[name] for name in fns if name.startswith("native_")},
                  runs_ms={name: [1e3 * sec for sec in t] for name, t in times.items()})
    blocks = f"  block read {blocks_ms:7.1f}" if blocks_ms else ""
    log(f"  {rows:>4} rows x {str(context):>6} {dtype:<8} blocks of {block_size:<3} bound {bound:7.1f} ms{blocks}  "
        f"native {ms['native']:7.1f}  "
        f"xla {ms['xla']:8.1f}  " + "".join(f"{n} {ms[n]:7.1f}  " for n in fns if n.startswith("native_")) +
        f"native/bound {result['native_over_bound']:.2f}  xla/native "
        f"{result['xla_over_native']:.1f}x  |diff| {diff:.1e}")
    return result


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(out["dtypes"]), figsize=(6 * len(out["dtypes"]), 4), squeeze=False)
    for ax, dtype in zip(axes[0], out["dtypes"]):
        cases = [c for c in out["cases"] if c["dtype"] == dtype]
        labels = [f"{c['rows']}x{c['context']}" + (f"\n/{c['block_size']}" if len(out["block_sizes"]) > 1 else "")
                  for c in cases]
        x = np.arange(len(cases))
        bars = [("read_bound_ms", "read bound (reading as many bytes sequentially)"),
                ("block_read_ms", "reading the same blocks, no arithmetic"),
                ("native_ms", "native kernel"), ("xla_ms", "XLA path"),
                *((f"native_{v}_ms", f"native kernel, {v} build") for v in out.get("variants", ()))]
        bars = [(key, label) for key, label in bars if all(c.get(key) for c in cases)]
        width = 0.8 / len(bars)
        for i, (key, label) in enumerate(bars):
            ax.bar(x + (i - (len(bars) - 1) / 2) * width, [c[key] for c in cases], width, label=label)
        ax.set_xticks(x, labels)
        ax.set_yscale("log")
        ax.set_xlabel("rows x context")
        ax.set_ylabel("ms per decode step (30 layers)")
        ax.set_title(f"{dtype} pool")
        ax.legend()
    cpu = out["machine"].get("cpu", {})
    fig.suptitle(f"{cpu.get('model_name')} ({'AMX' if cpu.get('has_amx') else 'no AMX'})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(out: dict) -> None:
    print(f"\nbandwidth {out['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s; ms per decode step of {LAYERS} layers")
    print("| pool | rows | context | block size | read bound | block read | native | XLA | native / bound "
          "| native / bandwidth bound | native / block read | XLA / native |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in out["cases"]:
        blocks = ((f"{c['block_read_ms']:.0f}", f"{c['native_over_block_read']:.2f}") if c["block_read_ms"]
                  else ("-", "-"))
        print(f"| {c['dtype']} | {c['rows']} | {c['context']} | {c['block_size']} | {c['read_bound_ms']:.0f} | "
              f"{blocks[0]} | "
              f"{c['native_ms']:.0f} | {c['xla_ms']:.0f} | {c['native_over_bound']:.2f} | "
              f"{c['native_ms'] / c['read_bound_of_bandwidth_ms']:.2f} | {blocks[1]} | "
              f"{c['xla_over_native']:.1f}x |")


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], f"cases {QUICK} (default {FULL})")
    parser.add_argument("--reps", type=int, default=7, help="timed runs of each backend and read, per case")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="pool dtypes, comma-separated")
    parser.add_argument("--block-sizes", default="16", help="tokens per KV block, comma-separated (default 16; "
                        "others write attention_cpu_block_sizes*.json)")
    parser.add_argument("--small-pages", action="store_true", help="pools on 4 KiB pages, not on the huge pages the "
                        "engine asks for (writes attention_cpu_small_pages*.json)")
    parser.add_argument("--variants", default="", help="native builds to time beside the best one, comma-separated "
                        "(avx512, avx2, portable: those this CPU runs; writes attention_cpu_variants*.json)")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    start = time.perf_counter()
    import jax

    print(f"JAX {jax.__version__} on {jax.default_backend()}")
    rng = np.random.default_rng(args.seed)
    bandwidth = measure_bandwidth()
    print(f"read bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s (gemv {bandwidth['gemv'] / 1e9:.1f}, "
          f"numpy threads {bandwidth['numpy_threads'] / 1e9:.1f})")
    dtypes = args.dtypes.split(",")
    reader = build_block_reader()
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    cases = [run_case(rows, context, dtype, args.reps, bandwidth["bytes_per_s"], rng, reader, block_size,
                      not args.small_pages, variants)
             for dtype in dtypes for rows, context in (QUICK if args.quick else FULL) for block_size in block_sizes]
    machine = {**common.machine_info(), "cpu": cpu_info()}  # the CPU model, its vector ISA and whether it has AMX
    out = dict(machine=machine, bandwidth=bandwidth, dtypes=dtypes, block_sizes=block_sizes, cases=cases,
               reps=args.reps, huge_pages=not args.small_pages, variants=variants)
    name = ("attention_cpu" + ("" if block_sizes == [16] else "_block_sizes") + ("_small_pages" if args.small_pages else "")
            + ("_variants" if variants else ""))
    return common.report(out, Path(args.out), common.results_stem(name, args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
