"""GPU check of the Pallas kernels: compile for real, check against references, time.

One command, sized for under 5 minutes on one H200 (Python 3.12, jax 0.11.2 with CUDA, no network):

    python bench/gpu_kernels.py --out DIR            # full sweep (batch x context x heads grid)
    python bench/gpu_kernels.py --out DIR --quick    # a handful of shapes
    python bench/gpu_kernels.py --out DIR --interpret  # tiny sweep on a CPU (smoke test)

Imports only ``pallas_kernels``, jax and numpy (plus ``jpaged.device.model`` for the tiny-Llama check,
skipped with a note when it cannot be imported). Writes ``DIR/gpu_kernels.json`` after every
measurement, so a run cut short still leaves its results.

What it does:

0. measures the device's copy bandwidth in the same run: an ``x + 1`` pass over a 1 GiB int32
   array (bytes read + written / time), timed as in 2 (medians of several runs); every attention time is reported against it, not an assumed peak;
1. compiles ``paged_attention``, ``write_kv`` and ``copy_blocks`` (``interpret=False``) and
   checks each against its ``*_reference`` on fresh random inputs, on the kernels' pool layout
   (one array, each block's K and V side by side: ``[num_blocks, 2, block_size, kv_heads,
   head_dim]``, stacked over layers for write/copy);
2. times paged attention per call on the device: ``n`` calls in one jitted executable (on
   separate copies of q, every output returned, so XLA neither merges nor drops any),
   ``(T(n) - T(1)) / (n - 1)`` with medians of the wall times: the fixed cost of a dispatch
   (host, launch, sync: tens of microseconds per jitted call, which dominated the single-call
   wall times of the first GPU run at small shapes) cancels.
   Against (a) dense attention over the same K/V stored contiguously
   (``jax.nn.dot_product_attention``, XLA, and cuDNN where it accepts the shape) and (b) JAX's
   bundled ``jax.experimental.pallas.ops.gpu.paged_attention`` (separate head-major K and V
   pages, unscaled q: q is pre-scaled for it), both fed layouts derived from the joint pool
   outside the timing, over a batch x context x heads grid (two head configs: 9 query / 3 KV
   heads of 64, the default model; 32 / 8 heads of 128); the single-call wall time is kept too
   (``wall``);
3. reports achieved K/V read bandwidth (bytes of K and V in the context / device time) and its
   fraction of the measured copy bandwidth, and judges the goals (issue 31): paged decode at
   >= 50% of the copy bandwidth at batch >= 32 and context >= 2,048 with 32/8 heads of 128;
   the default model's shape (9/3 heads of 64, bfloat16) within 1.2x of cuDNN's dense attention.

A few tiling variants (blocks_per_iter, num_splits, num_warps, num_stages) are timed on two
shapes at the end, when the time budget allows, to guide the defaults.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)  # Triton backend, bundled op

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e, the data sheet's figure (for reference only)
HEAD_CONFIGS = {"9q3kv_d64": (9, 3, 64), "32q8kv_d128": (32, 8, 128)}
SMALL_CONFIG, BIG_CONFIG = "9q3kv_d64", "32q8kv_d128"
# Goals (issue 31): the big config at >= this fraction of the copy bandwidth at batch >= 32 and
# context >= 2,048; the small config (the default model) within this ratio of cuDNN.
GOAL_FRAC_OF_COPY, GOAL_BATCH, GOAL_CONTEXT = 0.5, 32, 2048
GOAL_VS_CUDNN = 1.2
CALLS = 8  # calls per timed executable on the GPU (2 in interpret mode; see device_time)
COPY_BYTES = 1 << 30  # the copy-bandwidth array (interpret mode: 16 MiB)

# (batch, context, block_size, also_float32); most informative first, in case the budget ends:
# the first GPU run's shapes, then a batch x context grid (every row runs both head configs).
FULL_SHAPES = [
    (32, 2048, 16, True),
    (1, 4096, 16, False),
    (256, 1024, 32, False),
    (64, 2048, 16, False),
    (128, 2048, 16, False),
    (32, 8192, 16, False),
    (256, 2048, 16, False),
    (8, 2048, 16, False),
    (1, 8192, 16, False),
    (128, 8192, 16, False),
    (32, 512, 16, False),
    (8, 8192, 16, False),
    (256, 512, 16, False),
    (1, 512, 16, False),
]
QUICK_SHAPES = [(32, 2048, 16, True), (1, 4096, 16, False), (128, 4096, 16, False)]
INTERPRET_SHAPES = [(2, 40, 16, True), (3, 64, 32, False)]


# ------------------------------------------------------------------------------------------------
# bookkeeping


class Report:
    """The JSON document, rewritten (atomically) after every change."""

    def __init__(self, out_dir: Path, args):
        self.path = out_dir / "gpu_kernels.json"
        devices = jax.devices()
        self.doc = {
            "env": {
                "python": platform.python_version(),
                "jax": jax.__version__,
                "backend": jax.default_backend(),
                "devices": [f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in devices],
                "interpret": args.interpret,
                "quick": args.quick,
                "peak_bytes_per_s": PEAK_BYTES_PER_S,
            },
            "checks": [],
            "attention": [],
            "variants": [],
            "other_kernels": [],
            "copy_bandwidth": None,
            "tiny_llama": None,
            "errors": [],
            "goals": {},
            "elapsed_s": 0.0,
        }
        self.t0 = time.perf_counter()
        self.save()

    def add(self, section: str, item) -> None:
        if isinstance(self.doc[section], list):
            self.doc[section].append(item)
        else:
            self.doc[section] = item
        self.save()

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.path)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def log(*parts) -> None:
    print(*parts, flush=True)


def time_fn(fn, *args, min_runs: int, max_runs: int, max_s: float) -> dict:
    """Median wall time of ``fn(*args)`` (after a compile + warm-up call), block_until_ready."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first_s = time.perf_counter() - t
    jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < max_s):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "runs": len(times),
        "first_call_s": round(first_s, 3),
    }


def calls_in_one_executable(fn):
    """A jitted ``[fn(first, *rest) for first in firsts]``: ``len(firsts)`` calls of ``fn`` in one
    executable, on separate copies of the first operand (distinct parameters, so XLA cannot merge
    the calls) with every output returned (so it drops none); on a GPU they run back to back on
    one stream. (Chaining the calls through an optimization barrier does not work: XLA expands the
    barrier and then merges the identical calls; checked on the CPU.)"""

    @jax.jit
    def run(firsts, *rest):
        return [fn(first, *rest) for first in firsts]

    return run


def device_time(fn, *args, n: int, min_runs: int, max_runs: int, max_s: float) -> dict:
    """Per-call device time of ``fn(*args)``: ``(T(n) - T(1)) / (n - 1)``, the medians of one
    executable of ``n`` calls and of one of a single call (``calls_in_one_executable``), so the
    fixed cost of a dispatch (host, launch, sync) cancels. Also the single call's wall time
    (``wall_median_s``: dispatch included, what the first GPU run reported)."""
    first, *rest = args
    firsts = [first] + [jnp.copy(first) for _ in range(n - 1)]
    run = calls_in_one_executable(fn)
    one = time_fn(run, firsts[:1], *rest, min_runs=min_runs, max_runs=max_runs, max_s=max_s)
    many = time_fn(run, firsts, *rest, min_runs=min_runs, max_runs=max_runs, max_s=max_s)
    del firsts
    per_call = (many["median_s"] - one["median_s"]) / (n - 1)
    # A negative or tiny difference (noise) falls back to the n-call executable's mean.
    if per_call <= 0.1 * many["median_s"] / n:
        per_call = many["median_s"] / n
    return {
        "median_s": per_call,
        "calls": n,
        "calls_median_s": many["median_s"],
        "wall_median_s": one["median_s"],
        "wall_min_s": one["min_s"],
        "runs": many["runs"],
        "first_call_s": one["first_call_s"],
    }


def copy_bandwidth(interpret: bool) -> dict:
    """The device's copy bandwidth: ``x + 1`` over an int32 array of ``COPY_BYTES`` (read once,
    written once), timed by ``device_time``; ``bytes_per_s`` = 2 * bytes / time per pass."""
    nbytes = (16 << 20) if interpret else COPY_BYTES
    x = jnp.zeros((nbytes // 4,), jnp.int32)
    n = 2 if interpret else 4  # 4 inputs and 4 outputs of COPY_BYTES
    t = device_time(lambda a: a + 1, x, n=n, min_runs=2 if interpret else 10,
                    max_runs=3 if interpret else 50, max_s=0.0 if interpret else 1.0)
    del x
    return {"bytes": nbytes, "moved_bytes": 2 * nbytes, **t,
            "bytes_per_s": 2 * nbytes / t["median_s"]}


def max_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b).astype(jnp.float32), np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def tolerance(dtype) -> float:
    return 1e-4 if dtype == jnp.float32 else 2e-2


# ------------------------------------------------------------------------------------------------
# inputs


def make_inputs(key, *, batch, context, block_size, num_heads, num_kv_heads, head_dim, dtype):
    """A pool holding ``batch`` sequences of ``context`` tokens in randomly permuted blocks.

    The pool is ``kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]`` (one layer;
    block ``b``'s K at ``kv_cache[b, 0]``, its V at ``kv_cache[b, 1]``).
    """
    blocks_per_seq = -(-context // block_size)
    num_blocks = 1 + batch * blocks_per_seq  # + the null block 0
    kq, kkv = jax.random.split(key)
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    kv_cache = jax.random.normal(kkv, shape, jnp.float32).astype(dtype)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), jnp.float32).astype(dtype)
    rng = np.random.default_rng(batch * 100003 + context)
    perm = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
    block_tables = jnp.asarray(perm.reshape(batch, blocks_per_seq))
    context_lens = jnp.full((batch,), context, jnp.int32)
    return q, kv_cache, block_tables, context_lens


def bundled_paged_attention_fn(interpret: bool, pages_per_seq: int):
    """JAX's bundled op (separate head-major K and V pages, unscaled q); the caller derives
    its inputs from the joint pool outside the timing."""
    from jax.experimental.pallas.ops.gpu import paged_attention as bundled

    k_splits = 1
    while k_splits * 2 <= min(16, pages_per_seq) and pages_per_seq % (k_splits * 2) == 0:
        k_splits *= 2
    per_partition = pages_per_seq // k_splits
    pages_per_compute_block = math.gcd(8, per_partition)

    @jax.jit
    def run(q_scaled, k_pages, v_pages, block_tables, lengths):
        return bundled.paged_attention(
            q_scaled, k_pages, v_pages, block_tables, lengths,
            k_splits=k_splits, pages_per_compute_block=pages_per_compute_block,
            interpret=interpret,
        )

    return run, {"k_splits": k_splits, "pages_per_compute_block": pages_per_compute_block}


def dense_fn(implementation: str | None, scale: float):
    @jax.jit
    def run(q, k, v, lengths):
        out = jax.nn.dot_product_attention(
            q[:, None], k, v, scale=scale, key_value_seq_lengths=lengths,
            implementation=implementation,
        )
        return out[:, 0]

    return run


# ------------------------------------------------------------------------------------------------
# measurements


def measure_attention(report, args, cfg_name, shape, dtype, key) -> None:
    batch, context, block_size = shape
    num_heads, num_kv_heads, head_dim = HEAD_CONFIGS[cfg_name]
    scale = head_dim**-0.5
    interpret = args.interpret
    q, kv_cache, bt, cl = make_inputs(
        key, batch=batch, context=context, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
    )
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * itemsize
    entry = {
        "config": cfg_name, "batch": batch, "context": context, "block_size": block_size,
        "dtype": jnp.dtype(dtype).name, "kv_bytes": kv_bytes,
    }
    timing = dict(n=2 if interpret else CALLS, min_runs=2 if interpret else 10,
                  max_runs=3 if interpret else 100, max_s=0.0 if interpret else 0.25)
    copy_bw = report.doc["copy_bandwidth"]["bytes_per_s"]

    def paged(*a):
        return pk.paged_attention(*a, scale=scale, interpret=interpret)

    out = jax.jit(paged)(q, kv_cache, bt, cl)
    # Check against the reference on a few sequences (the reference gathers a contiguous copy).
    n_check = min(batch, 4)
    ref = pk.paged_attention_reference(
        q[:n_check], kv_cache, bt[:n_check], cl[:n_check], scale=scale
    )
    entry["max_abs_err_vs_reference"] = max_err(out[:n_check], ref)
    entry["check_ok"] = entry["max_abs_err_vs_reference"] <= tolerance(dtype)
    entry["paged"] = device_time(paged, q, kv_cache, bt, cl, **timing)
    entry["paged"]["bytes_per_s"] = kv_bytes / entry["paged"]["median_s"]
    entry["paged"]["frac_of_copy_bw"] = entry["paged"]["bytes_per_s"] / copy_bw
    report.save()

    # (a) dense attention over the same K/V, contiguous [batch, context, kv_heads, head_dim].
    blocks_per_seq = bt.shape[1]
    seq_kv = kv_cache[bt]  # [batch, blocks_per_seq, 2, block_size, kv_heads, head_dim]
    dense_shape = (batch, blocks_per_seq * block_size, num_kv_heads, head_dim)
    k_dense = seq_kv[:, :, 0].reshape(dense_shape)[:, :context]
    v_dense = seq_kv[:, :, 1].reshape(dense_shape)[:, :context]
    del seq_kv
    impls = ["xla"] + ([] if interpret or dtype == jnp.float32 else ["cudnn"])
    for impl in impls:
        name = f"dense_{impl}"
        try:
            fn = dense_fn(impl, scale)
            dense_out = fn(q, k_dense, v_dense, cl)
            entry[name] = device_time(fn, q, k_dense, v_dense, cl, **timing)
            entry[name]["max_abs_err_vs_paged"] = max_err(dense_out, out)
            entry[name]["bytes_per_s"] = kv_bytes / entry[name]["median_s"]
            entry[name]["frac_of_copy_bw"] = entry[name]["bytes_per_s"] / copy_bw
        except Exception as e:  # noqa: BLE001 - cuDNN rejects some shapes
            entry[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        report.save()
    del k_dense, v_dense

    # (b) JAX's bundled paged attention: pages [kv_heads, num_pages, page_size, head_dim].
    try:
        fn, params = bundled_paged_attention_fn(interpret, blocks_per_seq)
        k_pages = jnp.transpose(kv_cache[:, 0], (2, 0, 1, 3))
        v_pages = jnp.transpose(kv_cache[:, 1], (2, 0, 1, 3))
        q_scaled = (q.astype(jnp.float32) * scale).astype(dtype)
        bundled_out = fn(q_scaled, k_pages, v_pages, bt, cl)
        entry["bundled"] = device_time(fn, q_scaled, k_pages, v_pages, bt, cl, **timing)
        entry["bundled"].update(params)
        entry["bundled"]["max_abs_err_vs_paged"] = max_err(bundled_out, out)
        entry["bundled"]["bytes_per_s"] = kv_bytes / entry["bundled"]["median_s"]
        del k_pages, v_pages
    except Exception as e:  # noqa: BLE001
        entry["bundled"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    t_paged = entry["paged"]["median_s"]
    dense_times = [entry[f"dense_{i}"]["median_s"] for i in impls if "median_s" in entry[f"dense_{i}"]]
    if dense_times:
        entry["paged_over_best_dense"] = t_paged / min(dense_times)
    if "median_s" in entry.get("dense_cudnn", {}):
        entry["paged_over_cudnn"] = t_paged / entry["dense_cudnn"]["median_s"]
    if "median_s" in entry["bundled"]:
        entry["paged_over_bundled"] = t_paged / entry["bundled"]["median_s"]
    report.add("attention", entry)
    log(
        f"  {cfg_name:12s} {entry['dtype']:8s} b={batch:<4d} ctx={context:<5d} bs={block_size:<3d}"
        f" paged {t_paged * 1e6:8.1f}us (wall {entry['paged']['wall_median_s'] * 1e6:6.1f})"
        f" {entry['paged']['bytes_per_s'] / 1e9:7.1f} GB/s"
        f" {100 * entry['paged']['frac_of_copy_bw']:5.1f}% of copy"
        f" | /dense {entry.get('paged_over_best_dense', float('nan')):5.2f}"
        f" /cudnn {entry.get('paged_over_cudnn', float('nan')):5.2f}"
        f" | /bundled {entry.get('paged_over_bundled', float('nan')):5.2f}"
        f" | err {entry['max_abs_err_vs_reference']:.1e} {'ok' if entry['check_ok'] else 'FAIL'}"
    )


def check_other_kernels(report, args, cfg_name, dtype, key) -> None:
    """write_kv and copy_blocks on a stacked pool: correctness vs reference, and timing."""
    num_heads, num_kv_heads, head_dim = HEAD_CONFIGS[cfg_name]
    del num_heads
    interpret = args.interpret
    num_layers, num_blocks, block_size = (2, 12, 16) if interpret else (30, 4096, 16)
    num_tokens, num_pairs = (5, 3) if interpret else (256, 64)
    k1, k2 = jax.random.split(key)
    shape = (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim)  # K, V side by side
    kv_cache = jax.random.normal(k1, shape, jnp.float32).astype(dtype)
    new = jax.random.normal(k2, (2, num_tokens, num_kv_heads, head_dim), jnp.float32).astype(dtype)
    rng = np.random.default_rng(5)
    slots = rng.choice(np.arange(block_size, num_blocks * block_size), num_tokens - 1, replace=False)
    slots = jnp.asarray(np.concatenate([slots, [0]]).astype(np.int32))  # one padded token
    blocks = rng.permutation(np.arange(1, num_blocks))[: 2 * (num_pairs - 1)]
    pairs = np.concatenate([blocks.reshape(2, -1).T, [[0, 0]]]).astype(np.int32)
    pairs = jnp.asarray(pairs)
    layer = jnp.int32(num_layers - 1)
    timing = dict(min_runs=2 if interpret else 10, max_runs=3 if interpret else 100,
                  max_s=0.0 if interpret else 0.3)
    entry = {"config": cfg_name, "dtype": jnp.dtype(dtype).name, "pool_shape": list(shape),
             "num_tokens": num_tokens, "num_pairs": num_pairs}

    write = jax.jit(lambda kv, k, v, s, l: pk.write_kv(kv, k, v, s, layer=l, interpret=interpret))
    got = write(kv_cache, new[0], new[1], slots, layer)
    want = pk.write_kv_reference(kv_cache, new[0], new[1], slots, layer=layer)
    # (The null block 0 is skipped: the padded token writes there.)
    entry["write_kv_exact"] = bool(jnp.array_equal(got[:, 1:], want[:, 1:]))
    del got, want
    entry["write_kv"] = time_fn(write, kv_cache, new[0], new[1], slots, layer, **timing)
    report.save()

    copy = jax.jit(lambda kv, p: pk.copy_blocks(kv, p, interpret=interpret))
    got = copy(kv_cache, pairs)
    want = pk.copy_blocks_reference(kv_cache, pairs)
    entry["copy_blocks_exact"] = bool(jnp.array_equal(got, want))
    del got, want
    entry["copy_blocks"] = time_fn(copy, kv_cache, pairs, **timing)
    # (Timed without donation: each call also copies the pool, an upper bound. In the engine
    # the pool is donated and only the written rows move.)
    entry["note"] = "timed without donation: includes a copy of the whole pool per call"
    report.add("other_kernels", entry)
    log(f"  {cfg_name:12s} {entry['dtype']:8s} write_kv exact={entry['write_kv_exact']}"
        f" copy_blocks exact={entry['copy_blocks_exact']}")


def measure_variants(report, args, key) -> None:
    """A few tiling choices on two shapes, to guide the defaults (GPU only)."""
    cfg_name = "32q8kv_d128"
    num_heads, num_kv_heads, head_dim = HEAD_CONFIGS[cfg_name]
    scale = head_dim**-0.5
    variants = [
        dict(),
        dict(num_stages=2),  # one K/V buffer: no copy in flight during the dots
        dict(num_stages=4),
        dict(blocks_per_iter=2),
        dict(blocks_per_iter=8),
        dict(num_warps=8),
        dict(num_splits=1),
        dict(num_splits=8),
    ]
    copy_bw = report.doc["copy_bandwidth"]["bytes_per_s"]
    for batch, context in [(32, 4096), (1, 8192)]:
        q, kv_cache, bt, cl = make_inputs(
            key, batch=batch, context=context, block_size=16, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=jnp.bfloat16,
        )
        kv_bytes = 2 * batch * context * num_kv_heads * head_dim * 2
        for variant in variants:
            if report.elapsed() > args.budget_s:
                return
            try:
                fn = functools.partial(pk.paged_attention, scale=scale, **variant)
                t = device_time(fn, q, kv_cache, bt, cl, n=CALLS, min_runs=10, max_runs=100,
                                max_s=0.2)
                t["bytes_per_s"] = kv_bytes / t["median_s"]
                t["frac_of_copy_bw"] = t["bytes_per_s"] / copy_bw
            except Exception as e:  # noqa: BLE001
                t = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            report.add("variants", {"batch": batch, "context": context, "block_size": 16,
                                    "config": cfg_name, "dtype": "bfloat16",
                                    "variant": variant, **t})
            if "median_s" in t:
                log(f"  variant b={batch} ctx={context} {variant}: {t['median_s'] * 1e6:.1f}us"
                    f" {t['bytes_per_s'] / 1e9:.1f} GB/s {100 * t['frac_of_copy_bw']:.1f}% of copy")


# ------------------------------------------------------------------------------------------------
# tiny-Llama check: HOOK for the lead (jpaged's model through the kernels). Not implemented here.


def tiny_llama_check(report, args) -> None:
    """A tiny randomly initialised Llama decodes the same greedy tokens through the Pallas kernels
    (compiled, or interpreted with --interpret) and through the XLA path, using jpaged's runner."""
    try:
        from jpaged.device.attention.xla import XLABackend
        from jpaged.device.config import ModelConfig
        from jpaged.device.attention.pallas import PallasBackend
        from jpaged.device.params import init_params
        from jpaged.device.runner import ModelRunner
        from jpaged.core.scheduler import Row
    except Exception as e:  # noqa: BLE001
        note = f"skipped: jpaged not importable ({type(e).__name__}: {e})"
        log(f"tiny-Llama check {note}")
        report.add("tiny_llama", {"status": "skipped", "note": note})
        return
    config = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=256)
    params = init_params(config, jax.random.key(0), scale=0.2)
    block_size, num_blocks, steps = 16, 64, 12
    prompts = [[3, 17, 5, 99, 42], list(range(7, 40)), [250] * 18]
    runs = {}
    for name, backend in (("xla", XLABackend()), ("pallas", PallasBackend(interpret=args.interpret))):
        runner = ModelRunner(config, params, num_blocks=num_blocks, block_size=block_size, backend=backend)
        tables = [list(range(1 + 8 * i, 9 + 8 * i))[::-1] for i in range(len(prompts))]  # scattered, reversed
        slot = lambda t, p: t[p // block_size] * block_size + p % block_size  # noqa: E731
        seqs = [list(p) for p in prompts]
        rows = [Row(s, 0, [slot(t, p) for p in range(len(s))], t) for s, t in zip(seqs, tables)]
        logits = np.asarray(runner.execute(rows, decode=False))
        for _ in range(steps):
            for i, s in enumerate(seqs):
                s.append(int(logits[i].argmax()))
            rows = [Row([s[-1]], len(s) - 1, [slot(t, len(s) - 1)], t) for s, t in zip(seqs, tables)]
            logits = np.asarray(runner.execute(rows, decode=True))
        runs[name] = [s[len(p):] for s, p in zip(seqs, prompts)]
    same = runs["xla"] == runs["pallas"]
    log(f"tiny-Llama greedy tokens, Pallas vs XLA: {'identical' if same else 'DIFFERENT'}")
    report.add("tiny_llama", {"status": "ok" if same else "mismatch", "identical": same, "tokens": runs})


# ------------------------------------------------------------------------------------------------


def judge_goals(report) -> None:
    rows = [r for r in report.doc["attention"] if "paged" in r]
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    bw_rows = [r for r in bf16 if r["config"] == BIG_CONFIG and r["batch"] >= GOAL_BATCH
               and r["context"] >= GOAL_CONTEXT]
    cudnn_rows = [r for r in bf16 if r["config"] == SMALL_CONFIG and "paged_over_cudnn" in r]
    vs_bundled = [r for r in rows if "paged_over_bundled" in r]

    def shape(r):
        return f"b={r['batch']} ctx={r['context']} bs={r['block_size']}"

    goals = {
        "copy_bandwidth_bytes_per_s": report.doc["copy_bandwidth"]["bytes_per_s"],
        "all_checks_ok": all(r["check_ok"] for r in rows)
        and all(c.get("write_kv_exact") and c.get("copy_blocks_exact")
                for c in report.doc["other_kernels"]),
        f"ge_{int(100 * GOAL_FRAC_OF_COPY)}pct_of_copy_bw_{BIG_CONFIG}_batch_ge_{GOAL_BATCH}"
        f"_context_ge_{GOAL_CONTEXT}": {
            "ok": bool(bw_rows) and all(r["paged"]["frac_of_copy_bw"] >= GOAL_FRAC_OF_COPY
                                        for r in bw_rows),
            "worst": min((r["paged"]["frac_of_copy_bw"] for r in bw_rows), default=None),
            "best": max((r["paged"]["frac_of_copy_bw"] for r in bw_rows), default=None),
            "per_shape": {shape(r): round(r["paged"]["frac_of_copy_bw"], 3) for r in bw_rows},
        },
        f"{SMALL_CONFIG}_within_{GOAL_VS_CUDNN}x_of_cudnn": {
            "ok": bool(cudnn_rows) and all(r["paged_over_cudnn"] <= GOAL_VS_CUDNN
                                           for r in cudnn_rows),
            "worst": max((r["paged_over_cudnn"] for r in cudnn_rows), default=None),
            "per_shape": {shape(r): round(r["paged_over_cudnn"], 3) for r in cudnn_rows},
        },
        "no_slower_than_bundled (informative)": {
            "ok": bool(vs_bundled) and all(r["paged_over_bundled"] <= 1.0 for r in vs_bundled),
            "worst": max((r["paged_over_bundled"] for r in vs_bundled), default=None),
        },
    }
    report.add("goals", goals)
    log("goals:", json.dumps(goals, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the JSON")
    parser.add_argument("--quick", action="store_true", help="a handful of shapes")
    parser.add_argument("--interpret", action="store_true",
                        help="tiny sweep in the Pallas interpreter (CPU smoke test)")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="stop starting new measurements after this many seconds")
    parser.add_argument("--no-variants", action="store_true", help="skip the tiling variants")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, args)
    log(f"jax {jax.__version__} on {report.doc['env']['devices']}; writing {report.path}")
    if not args.interpret and jax.default_backend() != "gpu":
        log("no GPU: use --interpret for a CPU smoke test")
        report.add("errors", {"where": "startup", "error": "no GPU backend"})
        return 2

    shapes = INTERPRET_SHAPES if args.interpret else QUICK_SHAPES if args.quick else FULL_SHAPES
    key = jax.random.key(0)
    report.add("copy_bandwidth", copy_bandwidth(args.interpret))
    cb = report.doc["copy_bandwidth"]
    log(f"copy bandwidth: {cb['bytes_per_s'] / 1e9:.1f} GB/s (x + 1 over {cb['bytes'] >> 20} MiB,"
        f" {cb['median_s'] * 1e6:.1f} us per pass; data sheet {PEAK_BYTES_PER_S / 1e12:.1f} TB/s)")
    dtypes = [jnp.bfloat16, jnp.float32]
    log("kernel checks (write_kv, copy_blocks):")
    for cfg_name in HEAD_CONFIGS:
        for dtype in dtypes:
            key, sub = jax.random.split(key)
            try:
                check_other_kernels(report, args, cfg_name, dtype, sub)
            except Exception as e:  # noqa: BLE001
                report.add("errors", {"where": f"other_kernels {cfg_name} {dtype}",
                                      "error": traceback.format_exc(limit=3)})
                log(f"  ERROR {cfg_name} {jnp.dtype(dtype).name}: {type(e).__name__}: {e}")

    log("paged attention:")
    for batch, context, block_size, also_f32 in shapes:
        for dtype in dtypes if also_f32 else dtypes[:1]:
            for cfg_name in HEAD_CONFIGS:
                if report.elapsed() > args.budget_s:
                    log(f"  budget of {args.budget_s}s reached: skipping the rest")
                    report.add("errors", {"where": "sweep", "error": "time budget reached"})
                    break
                key, sub = jax.random.split(key)
                try:
                    measure_attention(report, args, cfg_name, (batch, context, block_size),
                                      dtype, sub)
                except Exception as e:  # noqa: BLE001
                    report.add("errors", {
                        "where": f"attention {cfg_name} {jnp.dtype(dtype).name} "
                                 f"b={batch} ctx={context} bs={block_size}",
                        "error": traceback.format_exc(limit=4),
                    })
                    log(f"  ERROR {cfg_name} b={batch} ctx={context}: {type(e).__name__}: {e}")

    if not args.interpret and not args.quick and not args.no_variants:
        log("tiling variants:")
        try:
            measure_variants(report, args, key)
        except Exception:  # noqa: BLE001
            report.add("errors", {"where": "variants", "error": traceback.format_exc(limit=4)})

    tiny_llama_check(report, args)
    judge_goals(report)
    log(f"done in {report.elapsed():.1f}s; JSON at {report.path}")
    return 0 if report.doc["goals"]["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
