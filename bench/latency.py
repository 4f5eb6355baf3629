"""Latency per output token: `jpaged serve` against llama.cpp's `llama-server` on the same weights, at
1, 2, 4 and 8 concurrent requests, weight width by weight width.

Widths (jpaged / llama.cpp): float32 / F32, bfloat16 / BF16, int8 (`--quantization int8` on the
Q8_0 file) / Q8_0, int8-bf16 (the same with `--dtype bfloat16`: the int8 products compute in bfloat16, the
KV pool is bfloat16) / Q8_0. Every GGUF holds the default model's weights as jpaged runs them (the shipped
Q4_1 file, dequantized; bench/peers/make_gguf.py writes and checks them with llama.cpp's converter
and llama-quantize); jpaged float32 and bfloat16 load the shipped file itself. The int8 column is
skipped, with a note in the JSON, while `jpaged serve` has no `--quantization` flag.

Per width, both servers are started once (jpaged: `--dtype`, `--max-num-seqs` the largest
concurrency, a 1 GiB KV pool, its warm-up compiling every step shape into the persistent
compilation cache; llama-server: bench/peers/common.py's `llama_server_command`, as many slots as
the largest concurrency, prompt caching off like jpaged's, the same `--threads` as the cores XLA
uses, OMP_WAIT_POLICY as llama.cpp ships it (active): see bench/peers/common.py) and primed with one untimed level;
while one server is measured the other is stopped (SIGSTOP: an idle llama-server's OpenMP threads spin). Then `--rounds` rounds: in each, every concurrency C in
turn, jpaged and llama.cpp one after the other (which goes first alternates from level to level and
round to round), C clients each sending one request at once (bench/serve_load.py's closed loop and
streamed request: POST /v1/completions, the prompt as token ids, greedy, `ignore_eos`, exactly
`--max-tokens` tokens). The prompts: the first C chat-templated Alpaca seed prompts of at most 512
tokens, the same every round and for both servers.

Figures per request: ms per output token = (time of the last streamed token - time of the first) /
(tokens - 1); time to first token (TTFT). Per level: their medians over the C requests. Per width
and C: each engine's median over rounds, and llama.cpp / jpaged ms per token per round and their
median (above 1: jpaged is faster). The JSON names the CPU and its ISA flags and llama.cpp's build
(its `--version` and CPU feature lines).

    python bench/latency.py --quick     # 64 tokens, 1 round (4 min on 2 busy cores, warm compile cache)
    python bench/latency.py             # 128 tokens, 3 rounds (11 min)
    python bench/latency.py --widths float32 --concurrency 1,8 --rounds 5

`--isa avx2` runs both on a CPU's AVX2 code paths, as on a CPU without AVX-512: jpaged with
JPAGED_NATIVE_VARIANT=avx2 (its AVX2 library) and XLA_FLAGS=--xla_cpu_max_isa=AVX2, against llama.cpp built
for AVX2 alone (`LLAMA_CPP_ISA=avx2 bash bench/peers/build_llama_cpp.sh`, built when missing):

    python bench/latency.py --isa avx2 --concurrency 1 --async-scheduling --rounds 8

Writes `<out>/latency.json` and `.png` (`latency_quick.*` for --quick; `latency_async*` with
`--async-scheduling`, jpaged serve's host overlapped with its device; `latency_omp_passive*` with
`--llama-omp-wait-policy passive`, llama-server's threads sleeping at barriers: for a loaded machine;
`*_avx2` with `--isa avx2`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from bench.peers import common as peer_common  # noqa: E402
from bench.peers import make_gguf  # noqa: E402
from bench.serve_load import MODEL, SHORT_MAX_TOKENS, closed_loop, compact, jpaged_metrics, warm_up_line  # noqa: E402

ROOT = common.REPO_ROOT
WIDTHS = make_gguf.JPAGED_WIDTHS
ENGINES = ("jpaged", "llama.cpp")
COLORS = {"jpaged": "tab:blue", "llama.cpp": "tab:orange"}


def jpaged_serve_flags() -> str:
    return subprocess.run([sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True).stdout


def jpaged_command(width: str, port: int, ggufs: dict[str, Path], args) -> list[str]:
    """`jpaged serve` at `width`: the shipped model at --dtype float32 / bfloat16, or the Q8_0 file with
    `--quantization int8` (and `--dtype bfloat16` for int8-bf16)."""
    model = (["--dtype", width] if width not in make_gguf.INT8_DTYPES else
             ["--model", str(ggufs["Q8_0"]), "--quantization", "int8", "--dtype", make_gguf.INT8_DTYPES[width]])
    return [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL, *model, "--max-num-seqs", str(max(args.concurrency)),
            "--max-num-batched-tokens", "2048", "--kv-cache-memory", "1GiB", "--compile-cache", args.compile_cache,
            "--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]


def measure(base: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """One level: len(prompts) clients, one request each, all at once; per-request and median figures."""
    requests = [{"kind": "short", "prompt": p} for p in prompts]
    results, wall = asyncio.run(closed_loop(base, requests, len(prompts), max_tokens))
    ok = [r for r in results if "error" not in r and r["tokens"] > 1]
    for r in ok:
        r["ms_per_token"] = 1e3 * sum(r["gaps"]) / (r["tokens"] - 1)
    median = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
    return {"concurrency": len(prompts), "errors": len(results) - len(ok),
            "ms_per_token": median([r["ms_per_token"] for r in ok]),
            "ttft_ms": median([1e3 * r["ttft"] for r in ok]),
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "chunks_per_token": sum(r["chunks"] for r in ok) / max(sum(r["tokens"] for r in ok), 1),
            "requests": compact(results)}


def run_width(width: str, prompts: list[list[int]], primer: list[list[int]], ggufs, lcpp: Path, args,
              log_dir: Path) -> dict:
    """Both servers at `width`, started once; every round's levels, alternating; see the module docstring."""
    out = {"gguf": str(ggufs[WIDTHS[width]]), "servers": {}, "levels": []}
    ctx_per_slot = max(map(len, prompts + primer)) + args.max_tokens
    with contextlib.ExitStack() as stack:
        bases, groups = {}, {}
        for engine in ENGINES:
            port = peer_common.free_port()
            cmd = (jpaged_command(width, port, ggufs, args) if engine == "jpaged" else
                   peer_common.llama_server_command(str(lcpp), str(ggufs[WIDTHS[width]]), port, max(args.concurrency),
                                                    ctx_per_slot, args.threads))
            log_path = log_dir / f"{engine}-{width}.log"
            print(f"--- {engine} {width}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            env = ({"OMP_WAIT_POLICY": args.llama_omp_wait_policy, **common.glibc_env(args.isa)}
                   if engine == "llama.cpp" else common.isa_env(args.isa))
            bases[engine], startup_s, groups[engine] = stack.enter_context(
                peer_common.serving(cmd, port, str(log_path), env, cwd=str(ROOT)))
            server = {"command": cmd, "startup_s": startup_s}
            if engine == "jpaged":
                server["warm_up"] = warm_up_line(log_path)
            with contextlib.ExitStack() as others:  # the servers started before it stopped
                for other in groups.keys() - {engine}:
                    others.enter_context(peer_common.paused(groups[other]))
                primed = measure(bases[engine], primer, args.max_tokens)
            server["primer_errors"] = primed["errors"]
            out["servers"][engine] = server
            print(f"    {engine} {width} up in {startup_s:.1f} s, primed", file=sys.stderr, flush=True)
        compiles = jpaged_metrics(bases["jpaged"])["jpaged_compiles_total"]
        step = 0
        for round_ in range(args.rounds):
            for c in args.concurrency:
                order = ENGINES if step % 2 == 0 else ENGINES[::-1]
                step += 1
                for engine in order:
                    other = next(e for e in ENGINES if e != engine)
                    with peer_common.paused(groups[other]):  # the other server takes no CPU meanwhile
                        level = {"round": round_, "engine": engine, "load_average_before": os.getloadavg()[0],
                                 **measure(bases[engine], prompts[:c], args.max_tokens)}
                    out["levels"].append(level)
                    print(f"    round {round_ + 1} {width} C={c} {engine}: {level['ms_per_token']:.1f} ms/token, "
                          f"TTFT {level['ttft_ms']:.0f} ms" + (f", {level['errors']} errors" if level["errors"] else ""),
                          file=sys.stderr, flush=True)
        out["jpaged_compiles_in_levels"] = jpaged_metrics(bases["jpaged"])["jpaged_compiles_total"] - compiles
    return out


def summarize(width_out: dict, concurrency: list[int]) -> dict:
    """{C: each engine's median over rounds of ms/token and TTFT; llama.cpp / jpaged ms per token per
    round and their median (lower middle)}."""
    by = {(lv["round"], lv["engine"], lv["concurrency"]): lv for lv in width_out["levels"]}
    rounds = sorted({lv["round"] for lv in width_out["levels"]})
    out = {}
    for c in concurrency:
        entry = {}
        for engine in ENGINES:
            levels = [by[r, engine, c] for r in rounds if by[r, engine, c]["ms_per_token"] is not None]
            entry[engine] = {"ms_per_token": float(np.median([lv["ms_per_token"] for lv in levels])) if levels else None,
                             "ttft_ms": float(np.median([lv["ttft_ms"] for lv in levels])) if levels else None}
        ratios = [by[r, "llama.cpp", c]["ms_per_token"] / by[r, "jpaged", c]["ms_per_token"] for r in rounds
                  if by[r, "llama.cpp", c]["ms_per_token"] and by[r, "jpaged", c]["ms_per_token"]]
        entry["llama_over_jpaged_ms_per_token"] = sorted(ratios)[(len(ratios) - 1) // 2] if ratios else None
        entry["ratio_rounds"] = ratios
        out[str(c)] = entry
    return out


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(out: dict) -> None:
    cpu = out["machine"]["cpu"]
    print(f"{cpu['model_name']}, {cpu['nproc']} cores ({', '.join(cpu['isa'])}); median of {out['config']['rounds']} "
          f"round(s), {out['config']['max_tokens']} tokens")
    print(f"{'jpaged / llama.cpp':22} {'C':>2} {'jpaged ms/tok':>13} {'llama ms/tok':>12} {'llama/jpaged':>12} "
          f"{'TTFT jpaged':>11} {'TTFT llama':>10}")
    for width, w in out["widths"].items():
        label = f"{width} / {WIDTHS[width]}"
        if "skipped" in w or "error" in w:
            print(f"{label:22} {w.get('skipped') or w['error']}")
            continue
        for c, e in w["summary"].items():
            print(f"{label:22} {c:>2} {_f(e['jpaged']['ms_per_token'], '13.1f')} "
                  f"{_f(e['llama.cpp']['ms_per_token'], '12.1f')} {_f(e['llama_over_jpaged_ms_per_token'], '12.2f')} "
                  f"{_f(e['jpaged']['ttft_ms'], '11.0f')} {_f(e['llama.cpp']['ttft_ms'], '10.0f')}")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = {k: w for k, w in out["widths"].items() if "summary" in w}
    fig, axes = plt.subplots(2, max(len(widths), 1), figsize=(4.5 * max(len(widths), 1), 7), squeeze=False)
    for j, (width, w) in enumerate(widths.items()):
        cs = [int(c) for c in w["summary"]]
        for engine in ENGINES:
            for i, key in enumerate(("ms_per_token", "ttft_ms")):
                axes[i, j].plot(cs, [w["summary"][str(c)][engine][key] or np.nan for c in cs], "o-",
                                color=COLORS[engine], label=engine)
        for c in cs:
            ratio = w["summary"][str(c)]["llama_over_jpaged_ms_per_token"]
            if ratio is not None:
                axes[0, j].annotate(f"{ratio:.2f}x", (c, w["summary"][str(c)]["jpaged"]["ms_per_token"]),
                                    textcoords="offset points", xytext=(0, -12), ha="center", fontsize=7)
        axes[0, j].set_title(f"{width} / {WIDTHS[width]}")
        for i, ylabel in enumerate(("ms per output token (median)", "time to first token, ms (median)")):
            axes[i, j].set_xscale("log", base=2)
            axes[i, j].set_xticks(cs, [str(c) for c in cs])
            axes[i, j].set_xlabel("concurrent requests")
            axes[i, j].set_ylabel(ylabel)
            axes[i, j].set_ylim(bottom=0)
            axes[i, j].grid(alpha=0.3)
            axes[i, j].legend(fontsize=7)
    cpu = out["machine"]["cpu"]
    fig.suptitle(f"jpaged serve vs llama-server, same weights; {out['config']['max_tokens']} greedy tokens, median of "
                 f"{out['config']['rounds']} round(s) (annotation: llama.cpp / jpaged ms per token); "
                 f"{cpu['model_name']}, {cpu['nproc']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 tokens, 1 round (default rounds)")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (--quick 1)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens a request (default 128; --quick 64)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma list of concurrent requests")
    ap.add_argument("--widths", default=",".join(WIDTHS), help=f"comma list from {','.join(WIDTHS)}")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="llama-server's threads (default: every core, as XLA uses for jpaged)")
    ap.add_argument("--llama-omp-wait-policy", default=peer_common.LLAMA_OMP_WAIT_POLICY, choices=("active", "passive"),
                    help="llama-server's OMP_WAIT_POLICY (see bench/peers/common.py)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="jpaged serve --async-scheduling (its default): the host overlapped with the device "
                    "(`latency_async*`); without it, jpaged serve --no-async-scheduling")
    common.add_isa_argument(ap)
    ap.add_argument("--llama-cpp-dir", default=None,
                    help="llama.cpp build folder (default: build_llama_cpp.sh's for --isa)")
    ap.add_argument("--gguf-dir", type=Path, default=make_gguf.DEFAULT_OUT)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    common.add_compile_cache_argument(ap)
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.max_tokens = args.max_tokens or (64 if args.quick else 128)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.widths = args.widths.split(",")
    unknown = set(args.widths) - set(WIDTHS)
    if unknown:
        ap.error(f"unknown width(s) {sorted(unknown)}: choose from {','.join(WIDTHS)}")
    if args.rounds < 1 or args.max_tokens < 2 or min(args.concurrency) < 1:
        ap.error("--rounds and --concurrency must be >= 1 and --max-tokens >= 2")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    from bench.vs_peers import load_requests

    _, ids, _ = load_requests()
    short = [p for p in ids if len(p) <= SHORT_MAX_TOKENS]
    prompts, primer = short[:max(args.concurrency)], short[-max(args.concurrency):]
    lcpp = make_gguf.llama_cpp_dir(args.llama_cpp_dir, args.isa)
    ggufs = make_gguf.ensure(args.gguf_dir, str(lcpp), verify=False)
    has_quantization = "--quantization" in jpaged_serve_flags()
    with common.environ(common.isa_env(args.isa)):  # the record's `native` entry is then jpaged serve's
        machine = common.machine_info(common.PACKAGES + ("openai",))
    out = {"benchmark": "latency", "machine": machine,
           "llama_cpp": {"dir": str(lcpp), "build_info": peer_common.llama_build_info(str(lcpp))},
           "config": {"quick": args.quick, "rounds": args.rounds, "max_tokens": args.max_tokens,
                      "concurrency": args.concurrency, "threads": args.threads, "widths": args.widths,
                      "llama_omp_wait_policy": args.llama_omp_wait_policy, "async_scheduling": args.async_scheduling,
                      "isa": args.isa, "jpaged_env": common.isa_env(args.isa),
                      "llama_cpp_env": common.glibc_env(args.isa),
                      "prompt_tokens": [len(p) for p in prompts],
                      "workload": "C clients, one streamed /v1/completions request each, all at once; prompt token "
                                  "ids, greedy, ignore_eos; ms/token = (last token - first token) / (tokens - 1)"},
           "widths": {}}
    with tempfile.TemporaryDirectory(prefix="latency_") as tmp:
        for width in args.widths:
            if width in make_gguf.INT8_DTYPES and not has_quantization:
                out["widths"][width] = {"skipped": "jpaged serve has no --quantization flag yet (int8 weights)"}
                continue
            try:
                out["widths"][width] = run_width(width, prompts, primer, ggufs, lcpp, args, Path(tmp))
                out["widths"][width]["summary"] = summarize(out["widths"][width], args.concurrency)
            except Exception as e:  # one width failing keeps the others' figures
                logs = {p.name: p.read_text(errors="replace").splitlines()[-20:] for p in Path(tmp).glob(f"*-{width}.log")}
                out["widths"][width] = {"error": f"{type(e).__name__}: {e}", "log_tails": logs}
                print(f"!! {width} failed: {e}", file=sys.stderr, flush=True)
    out["machine"]["load_average_at_end"] = list(os.getloadavg())
    name = "latency" if args.llama_omp_wait_policy == peer_common.LLAMA_OMP_WAIT_POLICY else "latency_omp_passive"
    name = name.replace("latency", "latency_async") if args.async_scheduling else name
    name = f"{name}_avx2" if args.isa == "avx2" else name
    return common.report(out, args.out, common.results_stem(name, args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
