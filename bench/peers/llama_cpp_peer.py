"""llama.cpp worker for bench/vs_peers.py: `llama-server` (bench/peers/build_llama_cpp.sh) with N
slots, the requests sent all at once over HTTP (stdlib only; runs in any venv).

Spec keys beyond bench/peers/common.py's: `llama_cpp_dir` (the build folder), `gguf` (the weights:
the default model as F32 / BF16 / Q8_0, bench/peers/make_gguf.py), `width` (a label), `slot_counts`
(one server per count, started, measured, stopped in turn), `omp_wait_policy` (default
common.LLAMA_OMP_WAIT_POLICY). Per slot count N: the server starts with N slots of max(prompt) +
max_tokens tokens each, `threads` threads, prompt caching off; a warm-up of
the first N prompts (untimed); then per run size n, all n requests are POSTed at once to the native
`/completion` endpoint (the prompt as token ids, greedy, `n_predict` = max_tokens, `ignore_eos`,
`return_tokens`), from n client threads; the server runs N at a time and queues the rest (its
continuous batching). The figure: output tokens / wall seconds from the first send to the last
answer. Excluded: server start (model load), the warm-up.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def complete(base: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy completion of exactly `max_tokens` tokens; its token ids."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True, "stream": False}
    request = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        tokens = json.loads(response.read())["tokens"]
    if len(tokens) != max_tokens:
        raise RuntimeError(f"llama-server returned {len(tokens)} tokens, asked for {max_tokens}")
    return tokens


def run_all(base: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Sends every prompt at once; (token ids in prompt order, wall seconds)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        t0 = time.perf_counter()
        ids = list(pool.map(lambda p: complete(base, p, max_tokens), prompts))
        return ids, time.perf_counter() - t0


def main(argv=None) -> None:
    spec, out_path = common.load_spec(argv)
    prompts, max_tokens = spec["prompt_token_ids"], spec["max_tokens"]
    ctx_per_slot = max(map(len, prompts[:max(spec["num_requests"])])) + max_tokens
    runs = []
    result = {"engine": "llama.cpp", "runs": runs, "versions": common.versions(),
              "build_info": common.llama_build_info(spec["llama_cpp_dir"]),
              "settings": {"gguf": spec["gguf"], "width": spec["width"], "slot_counts": spec["slot_counts"],
                           "ctx_per_slot": ctx_per_slot, "threads": spec["threads"],
                           "omp_wait_policy": spec.get("omp_wait_policy", common.LLAMA_OMP_WAIT_POLICY),
                           "sampling": f"/completion temperature 0, n_predict {max_tokens}, ignore_eos, cache_prompt "
                                       "false", "commands": {}},
              "excluded": "server start (model load); a warm-up of the first N prompts per slot count N"}
    with tempfile.TemporaryDirectory(prefix="llama_cpp_peer_") as tmp:
        for slots in spec["slot_counts"]:
            port = common.free_port()
            cmd = common.llama_server_command(spec["llama_cpp_dir"], spec["gguf"], port, slots, ctx_per_slot,
                                              spec["threads"])
            result["settings"]["commands"][str(slots)] = cmd
            env = {"OMP_WAIT_POLICY": spec.get("omp_wait_policy", common.LLAMA_OMP_WAIT_POLICY)}
            with common.serving(cmd, port, os.path.join(tmp, f"server-{slots}.log"), env) as (base, startup_s, _):
                t0 = time.perf_counter()
                run_all(base, prompts[:slots], max_tokens)
                warmup_s = time.perf_counter() - t0
                common.log(f"{slots} slots: up in {startup_s:.1f}s, warm-up {warmup_s:.1f}s")
                for n in spec["num_requests"]:
                    for repeat in range(spec.get("repeats", 1)):
                        with common.Window() as w:
                            ids, elapsed = run_all(base, prompts[:n], max_tokens)
                        rec = common.run_record(n, ids, elapsed, w, slots=slots, width=spec["width"], repeat=repeat,
                                                startup_s=startup_s, warmup_wall_s=warmup_s)
                        common.log(f"{slots} slots, n={n}: {rec['output_tokens']} tokens in {elapsed:.2f}s = "
                                   f"{rec['tokens_per_s']:.1f} tok/s (machine busy "
                                   f"{rec['machine_cpu_busy_fraction']:.2f})")
                        runs.append(rec)
                        common.write_result(out_path, result)
    result["complete"] = True
    common.write_result(out_path, result)


if __name__ == "__main__":
    main()
