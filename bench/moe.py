"""Mixture-of-experts decode: a random MoE of a realistic shape against a dense model of the same active
parameters, and against llama.cpp's `llama-server` on the same weights.

Models (random weights, transformers' own `Qwen3MoeConfig` / `Qwen3Config` and init, std 0.02, float32,
saved with `save_pretrained` under checkpoints/bench-moe/, git-ignored; the default model's tokenizer):
  moe     Qwen3-MoE of OLMoE's expert shape scaled to two cores: hidden 1024, 16 heads of 64 (4 KV heads),
          4 layers, 64 experts of FFN 512, 8 a token; vocabulary 49152, tied. ~464M parameters, ~111M
          active a token (the 50M of the LM head among them).
  dense   the same without experts: one MLP of 8 x 512 = 4096 a layer, the same active parameters a token.
  moe-8   the MoE with 8 experts of which all 8 run: the same active parameters, an eighth of the experts'
          weights. Its decode step beside `moe`'s says whether a decode step reads only the chosen experts.

Measured, in `--rounds` alternating rounds in this one process (jpaged) and in llama-server (its own process):
decode tokens/s at 1 and 32 streams (`--prompt-tokens` token prompts, `--max-tokens` greedy tokens, EOS
ignored): output tokens / wall seconds of `LLM.generate` after a warm-up (compilation excluded), and of all
requests sent at once to llama-server's `/completion` (N slots). Bytes read per decode token at one stream:
the active weights (the bound), the whole model, and what the measured tokens/s gives at the machine's read
bandwidth.

llama.cpp: `bash bench/peers/build_llama_cpp.sh` first (the sources inside the llama-cpp-python sdist); the
MoE's F32 GGUF is written by that build's own `convert_hf_to_gguf.py`. `--no-llama-cpp` skips it.

    python bench/moe.py [--quick] [--rounds 3] [--streams 1,32] [--out bench/results/<cpu>]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, bench_parser, machine_info, report, use_compile_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_hidden_layers=4,
             max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)
MOE = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True,
           intermediate_size=4096)
MODELS = {"moe": ("qwen3_moe", MOE), "dense": ("qwen3", dict(intermediate_size=8 * 512)),
          "moe-8": ("qwen3_moe", dict(MOE, num_experts=8))}


def build(name: str, out: Path, tokenizer) -> Path:
    """The HF directory of model `name` (built once: kept under `out`)."""
    directory = out / name
    if (directory / "config.json").is_file():
        return directory
    import torch
    import transformers

    model_type, extra = MODELS[name]
    config_class, model_class = {"qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
                                 "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[model_type]
    torch.manual_seed(0)
    config = config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, initializer_range=0.02, **SHAPE, **extra)
    model = model_class(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_gguf(directory: Path, llama_cpp: Path) -> Path:
    """`directory` as an F32 GGUF, by llama.cpp's own converter (kept beside it)."""
    path = directory.with_suffix(".f32.gguf")
    if not path.is_file():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama_cpp / "src" / "gguf-py"), str(llama_cpp / "pylib")])}
        subprocess.run([sys.executable, str(llama_cpp / "src" / "convert_hf_to_gguf.py"), str(directory), "--outfile",
                        str(path), "--outtype", "f32"], env=env, check=True, capture_output=True)
    return path


def active_params(config) -> tuple[int, int]:
    """(parameters a decode token reads, all parameters) of a jpaged `ModelConfig` (embedding row and tied
    head counted once, as the head's matmul reads it)."""
    from jpaged.device.params import num_params

    c, total = config, num_params(config)
    if not c.is_moe:
        return total, total
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    return total - c.num_layers * (c.num_experts - c.num_experts_per_tok) * expert, total


def jpaged_rounds(directories: dict, prompts, max_tokens: int, streams, rounds: int, log=print) -> dict:
    """name -> streams -> [tokens/s per round]: each model's `LLM` built once, warmed up at each stream
    count, then the rounds alternating models."""
    from jpaged import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llms, out, tokens = {}, {}, {}
    for name, directory in directories.items():
        llms[name] = LLM(model=str(directory), num_blocks=max(streams) * (len(prompts[0]) + max_tokens) // 16 + 64)
        for n in streams:
            llms[name].generate(prompts[:n], greedy, use_tqdm=False)  # warm-up: compiles every bucket
        out[name] = {n: [] for n in streams}
    for r in range(rounds):
        for name, llm in llms.items():
            for n in streams:
                outs = llm.generate(prompts[:n], greedy, use_tqdm=False)
                assert llm.last_run["compile_s"] < 0.05 * llm.last_run["elapsed_s"] + 0.5, llm.last_run
                out[name][n].append(n * max_tokens / llm.last_run["elapsed_s"])
                tokens.setdefault(name, {})[n] = [list(o.outputs[0].token_ids) for o in outs]
                log(f"round {r} {name:6s} {n:3d} streams: {out[name][n][-1]:7.1f} tok/s")
    configs = {name: llm.engine.model.config for name, llm in llms.items()}
    return {"tokens_per_s": out, "tokens": tokens, "configs": configs}


def llama_cpp_rounds(gguf: Path, llama_cpp: Path, prompts, max_tokens: int, streams, rounds: int) -> dict:
    """llama-server's worker (bench/peers/llama_cpp_peer.py) on the MoE's GGUF: N slots and N requests per stream
    count N, `rounds` times."""
    runs, result = [], {}
    for n in streams:
        spec = dict(prompts=[""] * n, prompt_token_ids=prompts[:n], num_requests=[n], max_tokens=max_tokens,
                    threads=os.cpu_count(), llama_cpp_dir=str(llama_cpp), gguf=str(gguf), width="float32",
                    slot_counts=[n], repeats=rounds)
        with tempfile.TemporaryDirectory() as tmp:
            spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
            spec_path.write_text(json.dumps(spec))
            subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "llama_cpp_peer.py"), str(spec_path),
                            str(out_path)], check=True)
            result = json.loads(out_path.read_text())
        runs += result["runs"]
    return {"tokens_per_s": {n: [r["tokens_per_s"] for r in runs if r["slots"] == n] for n in streams},
            "build_info": result.get("build_info"),
            "tokens": {n: next(r.get("output_token_ids") for r in runs if r["slots"] == n) for n in streams}}


def main(argv=None) -> dict:
    parser = bench_parser(__doc__.splitlines()[0], "2 streams counts of few tokens, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--checkpoints", type=Path, default=ROOT / "checkpoints" / "bench-moe")
    parser.add_argument("--llama-cpp-dir", type=Path, default=Path.home() / ".cache/jpaged/llama.cpp-0.3.36")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens, args.streams = 1, 16, "1,8"
    use_compile_cache(args)
    start = time.perf_counter()
    streams = [int(s) for s in args.streams.split(",")]

    from jpaged import weights

    tokenizer = weights.load_model(None).tokenizer
    directories = {name: build(name, args.checkpoints, tokenizer) for name in MODELS}
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(100, len(tokenizer) - 100, args.prompt_tokens).tolist() for _ in range(max(streams))]
    ours = jpaged_rounds(directories, prompts, args.max_tokens, streams, args.rounds)
    out = {"machine": machine_info(), "config": vars(args) | {"checkpoints": str(args.checkpoints),
                                                               "llama_cpp_dir": str(args.llama_cpp_dir),
                                                               "out": str(args.out)},
           "models": {}, "jpaged": ours["tokens_per_s"]}
    for name, config in ours["configs"].items():
        active, total = active_params(config)
        out["models"][name] = {"active_params": active, "total_params": total, "config": config.to_dict()}
    if not args.no_llama_cpp:
        gguf = write_gguf(directories["moe"], args.llama_cpp_dir)
        peer = llama_cpp_rounds(gguf, args.llama_cpp_dir, prompts, args.max_tokens, streams, args.rounds)
        out["llama_cpp"] = peer["tokens_per_s"]
        out["llama_cpp_build"] = peer["build_info"]
        out["llama_cpp_same_tokens"] = {n: peer["tokens"][n] == ours["tokens"]["moe"][n][:len(peer["tokens"][n])]
                                        if peer["tokens"][n] else None for n in streams}
    median = {k: {name: {n: float(np.median(v)) for n, v in runs.items()} for name, runs in out[k].items()}
              if k == "jpaged" else {n: float(np.median(v)) for n, v in out[k].items()}
              for k in ("jpaged", "llama_cpp") if k in out}
    out["median_tokens_per_s"] = median
    one = streams[0]
    moe_ms = 1000 / median["jpaged"]["moe"][one]
    out["one_stream"] = {
        "moe_over_dense_step_time": median["jpaged"]["dense"][one] / median["jpaged"]["moe"][one],
        "moe64_over_moe8_step_time": median["jpaged"]["moe-8"][one] / median["jpaged"]["moe"][one],
        "bytes_per_token_active_bound": 4 * out["models"]["moe"]["active_params"],
        "bytes_per_token_all_weights": 4 * out["models"]["moe"]["total_params"],
        "moe_ms_per_token": moe_ms,
        "read_gb_per_s_if_active_only": 4 * out["models"]["moe"]["active_params"] / moe_ms / 1e6,
    }
    if "llama_cpp" in median:
        out["moe_over_llama_cpp"] = {n: median["jpaged"]["moe"][n] / median["llama_cpp"][n] for n in streams}
    return report(out, args.out, "moe_quick" if args.quick else "moe", start, plot, print_table)


def print_table(out: dict) -> None:
    m = out["median_tokens_per_s"]
    streams = list(m["jpaged"]["moe"])
    print(f"{'tokens/s (median)':24s}" + "".join(f"{n:>10} streams" for n in streams))
    for name in m["jpaged"]:
        print(f"{'jpaged ' + name:24s}" + "".join(f"{m['jpaged'][name][n]:18.1f}" for n in streams))
    if "llama_cpp" in m:
        print(f"{'llama.cpp moe (F32)':24s}" + "".join(f"{m['llama_cpp'][n]:18.1f}" for n in streams))
    print(json.dumps(out["one_stream"], indent=1))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = out["median_tokens_per_s"]
    streams = list(m["jpaged"]["moe"])
    bars = {f"jpaged {k}": m["jpaged"][k] for k in m["jpaged"]}
    if "llama_cpp" in m:
        bars["llama.cpp moe"] = m["llama_cpp"]
    fig, axes = plt.subplots(1, len(streams), figsize=(4.5 * len(streams), 3.6))
    for ax, n in zip(np.atleast_1d(axes), streams):
        ax.bar(list(bars), [bars[b][n] for b in bars], color=["C0", "C1", "C2", "C3"][:len(bars)])
        ax.set_title(f"{n} stream{'s' if str(n) != '1' else ''}")
        ax.set_ylabel("decode tokens/s")
        ax.tick_params(axis="x", rotation=30)
    cpu = out["machine"]["cpu"]
    fig.suptitle(f"MoE (64 experts, 8 active) vs dense of the same active size; {cpu['model_name']} "
                 f"family {cpu['family']} model {cpu['model']}, {cpu['nproc']} cores, float32", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
