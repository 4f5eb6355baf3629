"""The engine on a GPU: the Pallas backend against the XLA backend, end to end.

    python bench/gpu_engine.py --tokenizer DIR --out DIR              # on a GPU machine
    python bench/gpu_engine.py --tokenizer DIR --out DIR --smoke      # a tiny model on a CPU (interpret)

SmolLM2-135M-Instruct's shapes (30 layers, 9 query / 3 KV heads of 64, vocabulary 49152) with
random weights: the GGUF file (98 MB) cannot travel to the GPU machines, its tokenizer can (`--tokenizer`,
a directory written by `tokenizer.save_pretrained`). Random weights of scale 0.05 give logits with a
spread of about 1, so greedy choices are not near ties. float32 throughout.

1. Agreement: the same requests through `LLMEngine` with `attention_backend="pallas"` (the Pallas
   decode kernel, cache write and copy-on-write kernels, compiled) and `"xla"`: greedy requests,
   parallel sampling (n=3, seeded, top-k 8: copy-on-write block copies; without top-k, random
   weights give a near-flat distribution over 49,152 tokens whose draws a 1e-6 change of the logits
   can move, which the first GPU run saw), beam search (width 3) and a pool
   small enough to preempt by swapping. Token ids must be identical. Run with XLA's float32
   matmuls at full precision (`jax.default_matmul_precision("highest")`; on a GPU the default is
   TF32), as the Pallas kernel's float32 dots are (3xTF32).
2. Throughput: 64 greedy requests of 128 prompt + 128 output tokens, offline, per backend: output
   tokens per second of the timed run (compilation excluded: a warm-up run compiles the shapes), at
   JAX's default matmul precision.

Writes `DIR/gpu_engine.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root


def model(tokenizer_dir: str, smoke: bool):
    import jax
    import transformers

    from jpaged.device.config import ModelConfig
    from jpaged.device.params import init_params
    from jpaged.weights import LoadedModel

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    if smoke:
        config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                             tie_word_embeddings=True, eos_token_ids=(2,))
    else:  # SmolLM2-135M-Instruct
        config = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                             num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                             max_position_embeddings=2048, tie_word_embeddings=True, eos_token_ids=(2,))
    params = init_params(config, jax.random.key(0), scale=0.05)
    return LoadedModel(config, params, tokenizer, Path(tokenizer_dir))


def agreement(loaded, smoke: bool, log) -> dict:
    from jpaged import LLM, SamplingParams

    prompts = ["The capital of France is", "Once upon a time, in a small village,", "To make a cup of tea, first",
               "The three primary colors are"]
    cases = {
        "greedy": dict(params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        "parallel_n3_seeded": dict(params=SamplingParams(n=3, temperature=0.8, top_k=8, seed=7, max_tokens=24,
                                                         ignore_eos=True)),
        "beam_width3": dict(params=SamplingParams(beam_width=3, max_tokens=16, ignore_eos=True)),
        "swap_preemption": dict(params=SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                                engine=dict(num_blocks=14, preemption_mode="swap", swap_space=0.01)),
    }
    out, runners = {}, {}  # one runner (pool, executables) per backend and pool geometry
    for name, case in cases.items():
        tokens, stats = {}, {}
        for backend in ("xla", "pallas"):
            kw = dict(num_blocks=256, block_size=16) | case.get("engine", {})
            key = (backend, kw["num_blocks"])
            llm = LLM(loaded=loaded, attention_backend=backend, interpret=smoke, runner=runners.get(key), **kw)
            runners[key] = llm.engine.runner
            outs = llm.generate(prompts, case["params"], use_tqdm=False)
            tokens[backend] = [[o.token_ids for o in r.outputs] for r in outs]
            s = llm.engine.stats()
            stats[backend] = dict(num_preemptions=s["num_preemptions"], num_free_blocks=s["num_free_blocks"],
                                  num_blocks=s["num_blocks"])
            assert s["num_free_blocks"] == s["num_blocks"] - 1, f"{name}/{backend}: blocks leaked"
        same = tokens["xla"] == tokens["pallas"]
        out[name] = dict(identical=same, stats=stats, pallas_tokens=tokens["pallas"])
        if not same:
            out[name]["xla_tokens"] = tokens["xla"]
        log(f"  {name:<20} pallas == xla: {same}  {stats['pallas']}")
    return out


def throughput(loaded, smoke: bool, log) -> dict:
    import numpy as np

    from jpaged import LLM, SamplingParams

    num, prompt_len, output_len = (8, 32, 16) if smoke else (64, 128, 128)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1000, 40000 if not smoke else len(loaded.tokenizer) - 1, prompt_len).tolist()
               for _ in range(num)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    out = {}
    for backend in ("xla", "pallas"):
        llm = LLM(loaded=loaded, attention_backend=backend, interpret=smoke, num_blocks=num * 17 + 8, block_size=16)
        llm.generate(prompts, params, use_tqdm=False)  # compiles every shape of the run
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[backend] = dict(output_tokens=tokens, seconds=seconds, output_tokens_per_s=tokens / seconds,
                            compile_seconds_in_timed_run=llm.last_run["compile_s"])
        log(f"  {backend:<7} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s")
    out["pallas_over_xla"] = out["pallas"]["output_tokens_per_s"] / out["xla"]["output_tokens_per_s"]
    out["workload"] = dict(requests=num, prompt_tokens=prompt_len, output_tokens=output_len, greedy=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a directory written by tokenizer.save_pretrained")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, Pallas in interpret mode (CPU)")
    parser.add_argument("--no-throughput", action="store_true", help="the agreement checks only")
    args = parser.parse_args(argv)
    import jax

    def log(*parts):
        print(*parts, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    import tempfile

    from bench.common import enable_compile_cache

    enable_compile_cache(str(Path(tempfile.gettempdir()) / "jpaged_gpu_jax_cache"))  # equal shapes compile once
    doc = dict(jax=jax.__version__, backend=jax.default_backend(),
               devices=[f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices()], smoke=args.smoke)
    log(f"jax {doc['jax']} on {doc['devices']}")
    if jax.default_backend() != "gpu" and not args.smoke:
        log("no GPU: use --smoke for a CPU check")
        return 2
    loaded = model(args.tokenizer, args.smoke)
    log("agreement, Pallas vs XLA:")
    with jax.default_matmul_precision("highest"):
        doc["agreement"] = agreement(loaded, args.smoke, log)
    if not args.no_throughput:
        log("throughput:")
        doc["throughput"] = throughput(loaded, args.smoke, log)
    doc["all_identical"] = all(case["identical"] for case in doc["agreement"].values())
    (args.out / "gpu_engine.json").write_text(json.dumps(doc, indent=1))
    log(f"all identical: {doc['all_identical']}; wrote {args.out / 'gpu_engine.json'}")
    return 0 if doc["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
