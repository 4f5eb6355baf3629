"""Helpers shared by the benchmarks: the machine/versions record, JSON results, timing, summaries.

Every result file records `machine_info()`: versions of the libraries that shape the numbers, the
CPU, and the load average when the run started (the development machines are shared: a load
above the core count means the timings are inflated).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# JAX's persistent compilation cache, the product's: `enable_compile_cache(path)` (a rerun loads its step
# executables instead of compiling them); `jpaged generate` / `serve` use DEFAULT_COMPILE_CACHE by default
from jpaged.entrypoints.cli import default_compile_cache_dir, enable_compile_cache  # noqa: F401 (loads no JAX)

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
PACKAGES = ("jax", "jaxlib", "numpy", "transformers", "matplotlib", "gguf")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state() -> dict:
    """The commit the working tree is on and whether it has uncommitted changes (None outside git)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        return dict(commit=git("rev-parse", "HEAD") or None, dirty=bool(git("status", "--porcelain")))
    except (OSError, subprocess.SubprocessError):
        return dict(commit=None, dirty=None)


def cpu_info() -> dict:
    """The CPU as lscpu names it: model (and family: AMD's 25 with AVX-512 is Zen 4, 26 Zen 5), counts, memory,
    L3 cache, the vector ISA flags that decide the kernels and XLA's matmul paths (AVX2, AVX-512, AVX512-BF16),
    whether it has AMX, and the load average."""
    lscpu = {}
    with contextlib.suppress(Exception):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            key, _, value = line.partition(":")
            lscpu[key.strip()] = value.strip()
    flags = set(lscpu.get("Flags", "").split())
    mem_gib = None
    with contextlib.suppress(Exception):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {"model_name": lscpu.get("Model name"), "family": lscpu.get("CPU family"), "model": lscpu.get("Model"),
            "l3_cache": lscpu.get("L3 cache"), "cpus": lscpu.get("CPU(s)"),
            "cores_per_socket": lscpu.get("Core(s) per socket"), "threads_per_core": lscpu.get("Thread(s) per core"),
            "nproc": os.cpu_count(), "memory_gib": mem_gib, "hypervisor": lscpu.get("Hypervisor vendor"),
            "isa": sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "f16c")),
            "has_amx": any(f.startswith("amx") for f in flags), "kernel": platform.release(),
            "loadavg_at_start": os.getloadavg()}


def machine_info(packages=PACKAGES) -> dict:
    """Python, library versions, platform, CPU count, load average, date, git state; with JAX loaded, its
    backend and devices and the native kernels' variant (`native_info`)."""
    info = dict(python=sys.version.split()[0], platform=platform.platform(),
                machine=platform.machine(), processor=platform.processor() or None,
                cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                versions={p: _version(p) for p in packages}, git=git_state())
    with contextlib.suppress(OSError, AttributeError):
        info["load_average_at_start"] = list(os.getloadavg())
    if "jax" in sys.modules:  # only when the benchmark uses it: importing JAX costs seconds
        jax = sys.modules["jax"]
        info["jax_backend"] = jax.default_backend()
        info["jax_devices"] = [str(d) for d in jax.devices()]
        info["native"] = native_info()
    info["cpu"] = cpu_info()
    return info


def native_info() -> dict:
    """jpaged's native CPU kernels here: the libraries built and runnable on this CPU, best first
    (`variants`), the one jpaged runs by default (`variant`: the first; None: the XLA paths only), and
    whether its 16-bit weight products run on AMX tiles or on AVX512-BF16's VDPBF16PS, the most rows of
    an int8 product its calling thread runs alone, and Linux's transparent huge pages setting (the engine
    asks for them for its weights: `jpaged.device.huge_pages`; None off Linux). Imports JAX (through jpaged's
    native module)."""
    from jpaged.device.attention import native

    variants = native.available_variants()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return {"variants": list(variants), "variant": variants[0] if variants else None,
            "amx_bf16": native.amx_bf16(), "avx512_bf16": native.avx512_bf16(),
            "int8_solo_max_rows": native.int8_solo_max_rows(),
            "reads_channel_at_a_time": native.reads_channel_at_a_time(),
            "transparent_hugepage": thp.read_text().strip() if thp.exists() else None}


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):  # numpy scalars: bool_, integer, floating
        x = x.item()
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, float):
        x = float(x)
        return x if math.isfinite(x) else None  # JSON has no inf / nan
    if isinstance(x, Path):
        return str(x)
    return x


def load_c_library(name: str, flags=()):
    """bench/csrc/`name`, compiled for this CPU (the system C compiler, `$CC` or cc: -O2 -march=native -shared
    -fPIC, then `flags`) into a temporary folder and loaded with ctypes (loaded, the library needs no file).
    Raises OSError or subprocess.SubprocessError where no compiler builds it. The benchmarks' instruments only:
    nothing in jpaged is built this way."""
    import ctypes
    import tempfile

    source = Path(__file__).resolve().parent / "csrc" / name
    with tempfile.TemporaryDirectory(prefix="jpaged-bench-") as folder:
        library = Path(folder) / (source.stem + ".so")
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-march=native", "-shared", "-fPIC", *flags, str(source),
                        "-o", str(library)], check=True, capture_output=True, timeout=120)
        return ctypes.CDLL(str(library))


def write_json(path: Path, obj) -> Path:
    """Writes `obj` as indented JSON (numpy scalars/arrays converted, inf/nan as null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(obj), indent=1) + "\n")
    return path


def results_stem(name: str, quick: bool) -> str:
    """A benchmark's results file stem: `<name>_quick` for its --quick preset, so that `python -m
    bench --quick` never overwrites the full results the README quotes; `<name>` otherwise."""
    return f"{name}_quick" if quick else name


def report(out: dict, out_dir: Path, name: str, start: float, plot, print_table) -> dict:
    """A benchmark's ending: its wall time (since `start`, `time.perf_counter`) into `out`, then
    `<out_dir>/<name>.json`, `plot(out, <out_dir>/<name>.png)`, `print_table(out)` and one summary line
    (`name`: see `results_stem`)."""
    out["wall_seconds"] = time.perf_counter() - start
    write_json(Path(out_dir) / f"{name}.json", out)
    plot(out, Path(out_dir) / f"{name}.png")
    print_table(out)
    print(f"wall {out['wall_seconds']:.1f} s -> {out_dir}/{name}.{{json,png}}")
    return out


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds` (wall clock, `time.perf_counter`)."""

    def __enter__(self):
        self.start = time.perf_counter()
        self.seconds = None
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        return False


def summarize(values) -> dict:
    """mean, p50, p90, max and count of a sample (None for an empty one)."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return dict(mean=None, p50=None, p90=None, max=None, count=0)
    return dict(mean=float(v.mean()), p50=float(np.percentile(v, 50)),
                p90=float(np.percentile(v, 90)), max=float(v.max()), count=int(v.size))


def shape_time(times, stat: str = "median") -> float:
    """What a step shape is charged from its timed runs: their median (the shape-median clock) or
    their least (the shape-min clock, which a noisy stretch of a benchmark moves far less)."""
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    return float(min(times) if stat == "min" else np.median(times))


DEFAULT_COMPILE_CACHE = default_compile_cache_dir()


def add_compile_cache_argument(parser) -> None:
    parser.add_argument("--compile-cache", default=DEFAULT_COMPILE_CACHE,
                        help="JAX persistent compilation cache directory ('none': off)")


def use_compile_cache(args) -> None:
    """Turns on the cache named by `--compile-cache` unless it is 'none'."""
    if args.compile_cache != "none":
        enable_compile_cache(args.compile_cache)


ISAS = ("native", "avx2")


def add_isa_argument(parser) -> None:
    parser.add_argument("--isa", default="native", choices=ISAS,
                        help="native: each engine's best code for this CPU; avx2: jpaged and llama.cpp on their AVX2 "
                             "code paths, as on a CPU without AVX-512 (isa_env; llama.cpp built for AVX2 alone)")


def isa_env(isa: str) -> dict:
    """The environment that puts jpaged's processes on `isa`'s code paths: nothing for native; for avx2, as on
    a CPU without AVX-512: jpaged's AVX2 native library (JPAGED_NATIVE_VARIANT), XLA's own code at AVX2
    (XLA_FLAGS, replacing any set), YNNPACK's AVX2 kernels for XLA's large dots (bench/avx2_only's startup hook,
    on PYTHONPATH: XLA_FLAGS does not cap the libraries XLA calls), and glibc's (glibc_env)."""
    if isa == "native":
        return {}
    from jpaged.device.attention.native import VARIANT_ENV

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    hook = str(Path(__file__).resolve().parent / "avx2_only")
    return {VARIANT_ENV: "avx2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",
            "PYTHONPATH": os.pathsep.join([hook] + [p for p in paths if p != hook]), **glibc_env(isa)}


def glibc_env(isa: str) -> dict:
    """The environment that keeps glibc's string functions (memcpy, memset, ...) of any process on `isa`'s code
    paths: for avx2, its AVX-512 variants masked (GLIBC_TUNABLES); for llama.cpp's server as for jpaged."""
    if isa == "native":
        return {}
    return {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD"}


@contextlib.contextmanager
def environ(env: dict):
    """os.environ with `env` set inside the block, as it was after it."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def bench_parser(description: str, quick_help: str):
    """The arguments every engine benchmark shares: --quick, --out, --seed, --compile-cache."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--seed", type=int, default=0)
    add_compile_cache_argument(parser)
    return parser
