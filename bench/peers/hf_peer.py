"""HF transformers worker for bench/vs_peers.py (runs in the jpaged venv: torch CPU + transformers).

Static batching as a plain `generate` user does it: the n requests in input order, cut into
batches of `batch_size`, each left-padded to its longest prompt and run to completion before the
next starts. Greedy, float32, `torch.set_num_threads(threads)`. Exactly `max_tokens` tokens per
request: the model's `generation_config.eos_token_id` is cleared (and `eos_token_id=None` passed),
so EOS can still be *chosen* and generation simply goes on, as with vLLM's/jpaged's `ignore_eos`
(`min_new_tokens` would instead mask EOS and change the greedy tokens).
Timed: every `generate` call of the run, back to back (tensor building and padding included),
each batch timed on its own; `prefix_sizes` smaller than the run are reported from its leading
whole batches (`derived_from_run_of`).
Excluded: model load (GGUF dequantization) and one warm-up `generate` of one full batch
(`batch_size` prompts, 8 new tokens) before the first timed run.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None) -> None:
    spec, out_path = common.load_spec(argv)
    import torch
    import transformers

    torch.set_num_threads(spec.get("threads", 2))
    model_path = spec["gguf_path"]
    directory, name = os.path.dirname(model_path), os.path.basename(model_path)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    model.generation_config.eos_token_id = None
    pad_id = spec["pad_token_id"]
    max_tokens = spec["max_tokens"]
    prompt_ids = spec["prompt_token_ids"]

    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                               pad_token_id=pad_id, use_cache=True)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        return out[:, width:].tolist()

    runs = []
    result = {
        "engine": "hf", "load_s": load_s, "runs": runs,
        "versions": {**common.versions("transformers", "torch", "tokenizers", "gguf", "accelerate", "numpy"),
                     "torch_parallel_info": torch.__config__.parallel_info().splitlines()[:6]},
        "settings": {"dtype": "float32", "threads": torch.get_num_threads(), "padding": "left",
                     "attn_implementation": model.config._attn_implementation,
                     "batching": "static: input order, batches of batch_size, each run to completion",
                     "stop": "eos_token_id cleared: exactly max_new_tokens, EOS may be generated",
                     "max_requests_by_batch": spec.get("max_requests_by_batch", {}),
                     "model": model_path},
        "excluded": "model load (GGUF dequantization); one warm-up generate() of batch_size prompts x 8 tokens "
                    "per batch size",
    }
    for batch_size in spec["batch_sizes"]:
        t0 = time.perf_counter()
        generate(prompt_ids[:batch_size], 8)
        warmup_s = time.perf_counter() - t0
        limit = spec.get("max_requests_by_batch", {}).get(str(batch_size))
        sizes = sorted({min(n, limit) if limit else n for n in spec["num_requests"]})
        for n in sizes:
            ids, batch_s, batch_cpu_s = [], [], []
            with common.Window() as w:
                for start in range(0, n, batch_size):
                    t0, c0 = time.perf_counter(), time.process_time()
                    ids += generate(prompt_ids[start:min(start + batch_size, n)], max_tokens)
                    batch_s.append(time.perf_counter() - t0)
                    batch_cpu_s.append(time.process_time() - c0)
            assert all(len(t) == max_tokens for t in ids), "a request produced fewer tokens than asked"
            rec = common.run_record(n, ids, w.wall_s, w, batch_size=batch_size, warmup_wall_s=warmup_s,
                                    batch_s=batch_s)
            common.log(f"batch {batch_size} n={n}: {rec['output_tokens']} tokens in {rec['elapsed_s']:.1f}s = "
                       f"{rec['tokens_per_s']:.1f} tok/s (machine busy {rec['machine_cpu_busy_fraction']:.2f})")
            runs.append(rec)
            common.write_result(out_path, result)
            # smaller run sizes: the leading whole batches of this run (a static batch does not depend on later ones)
            for m in spec.get("prefix_sizes", []):
                if m >= n or m % batch_size:
                    continue
                elapsed = sum(batch_s[:m // batch_size])
                prefix = common.run_record(m, ids[:m], elapsed, w, batch_size=batch_size, warmup_wall_s=warmup_s,
                                           batch_s=batch_s[:m // batch_size], derived_from_run_of=n)
                cpu = sum(batch_cpu_s[:m // batch_size])  # this process only (HF computes in-process)
                prefix.update(wall_s=elapsed, process_cpu_s=cpu, tokens_per_cpu_s=prefix["output_tokens"] / cpu,
                              cpu_share=round(cpu / (elapsed * (os.cpu_count() or 1)), 3))
                common.log(f"batch {batch_size} n={m} (first batches of the n={n} run): "
                           f"{prefix['tokens_per_s']:.1f} tok/s")
                runs.append(prefix)
                common.write_result(out_path, result)
    result["complete"] = True
    common.write_result(out_path, result)


if __name__ == "__main__":
    main()
