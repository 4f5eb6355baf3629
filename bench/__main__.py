"""Run the benchmarks: `python -m bench [--quick] [--only NAME,...] [--out DIR]`.

--quick (4.5 minutes measured on 2 cores): the allocator simulation, offline throughput of paged
against the Orca baselines on 32 requests, jpaged against HF transformers at batch 16, the
scheduler's host overhead and the decode step's model FLOPs utilisation. The full preset runs
every benchmark at full size, vLLM's CPU build included: an estimated 5 hours on 2 cores, nearly
all of it throughput's paper-scale sweep (not run whole; its parts measured: offline ShareGPT-like
43 minutes, offline Alpaca-like 17, Poisson sweeps of two systems 71 (ShareGPT-like) and 24
(Alpaca-like); `python bench/throughput.py --preset mini` is its 21-minute miniature; vs_peers
alone took 15 minutes).
Results: bench/results/<name>.json and .png (<name>_quick.* for --quick; throughput.py names its
files by preset). `bench/gpu_kernels.py` runs on a GPU machine instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUICK = ["memory_utilization", "throughput", "vs_peers", "scheduler_overhead", "mfu", "attention_cpu"]
FULL = QUICK + ["sharing", "block_size", "preemption", "kv_dtype", "checkpoint_load", "weights_memory", "serve_load",
               "sampler", "sliding_window", "weights_dtype", "speculative", "structured_output", "latency"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(FULL)}")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else (QUICK if args.quick else FULL)
    unknown = sorted(set(names) - set(FULL))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}: choose from {FULL}")
    failed = []
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        sub_argv = (["--quick"] if args.quick else []) + (["--out", args.out] if args.out else [])
        print(f"== {name} {' '.join(sub_argv)}", flush=True)
        start = time.perf_counter()
        try:
            module.main(sub_argv)
        except Exception as e:  # one failing benchmark must not hide the others' results
            failed.append(name)
            print(f"!! {name} failed: {type(e).__name__}: {e}", flush=True)
        print(f"== {name} done in {time.perf_counter() - start:.0f}s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
