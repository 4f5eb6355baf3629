"""Every model family of `tests/test_families.py` under tensor and data parallelism, in a process of
its own on forced CPU devices; prints one JSON object.

`tests/test_families_sharding.py` starts it (`python tests/families_sharding_worker.py`) with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`, which must be set before JAX starts, while the rest of
the suite runs on one device. For each family it builds the tiny random HF model (`build_family`: 4 query
heads, 2 KV heads, sliding windows of 8 where the family has them), loads it once, and records the greedy
tokens of `PROMPTS` (12 new tokens, EOS ignored, block size 4: contexts of several windows and blocks) on
one device, under tensor parallel 2 (the KV heads split, one a device), tensor parallel 4 (each KV head
stored twice, its biases with it), data parallel 2 (the pool split by blocks), and HF's `generate` on the same
prompts; not every family under every strategy (`RUNS` says which, and why). The assertions live in the test
module.

`--families a,b` runs only those: the test starts two workers at once on halves of the families (`halves`),
as compiling is single-threaded and CI has two cores.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))

import jax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jpaged import LLM, SamplingParams, weights  # noqa: E402
from test_families import FAMILIES, PROMPTS, build_family, hf_greedy  # noqa: E402
from workers import enable_compilation_cache  # noqa: E402

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# run name -> (LLM keyword arguments, the families it runs): a cut to keep the worker near a minute on 2 cores (each
# run compiles its own prefill and decode steps, ~2 s). What the sharding rules touch runs under tensor parallel 2
# and data parallel 2: the plain leaves (llama3), q/k/v biases (qwen2), q/k norms with head_dim 32 (qwen3), fused
# projections split at load (phi3), a sliding window on every layer (mistral: the block manager releases the blocks
# that slid out, left in the table as the rank's null block under dp2), local/global layers with soft-caps and
# sandwich norms (gemma2, gemma3); KV heads replicated under tensor parallel 4 with their biases (qwen2), beside
# q/k norms (qwen3), with soft-caps and windows (gemma2). The RoPE scalings differ from llama3 in replicated tables alone: dynamic NTK runs
# under dp2 (its rows' lengths come from each rank's own packing); yarn and linear run in `test_families.py` alone.
RUNS = {
    "tp2": ({"tensor_parallel_size": 2}, ("llama3", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3")),
    "tp4": ({"tensor_parallel_size": 4}, ("qwen2", "qwen3", "gemma2")),
    "dp2": ({"data_parallel_size": 2}, ("llama3", "llama-dynamic", "qwen2", "qwen3", "mistral", "phi3", "gemma2",
                                        "gemma3")),
}
RUNS = {"one": ({}, tuple(f for f in FAMILIES if any(f in families for _, families in RUNS.values()))), **RUNS}
NUM_BLOCKS = 48  # block size 4: the 3 prompts (20, 14, 1 tokens) + 12 need 19 blocks at most, so no rank is short


def halves() -> list[list[str]]:
    """The families of `RUNS` in two groups of about as many runs each."""
    cost = {name: sum(name in families for _, families in RUNS.values()) for name in RUNS["one"][1]}
    groups: list[list[str]] = [[], []]
    for name in sorted(cost, key=cost.get, reverse=True):
        min(groups, key=lambda g: sum(map(cost.get, g))).append(name)
    return groups


def tokenizer():
    """The default model's tokenizer alone (its GGUF file's), without loading its weights."""
    path = weights.default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def main(names) -> None:
    enable_compilation_cache()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tok = tokenizer()
    ids = [list(tok(p).input_ids) for p in PROMPTS]
    result = {"num_devices": jax.device_count(), "prompt_ids": ids, "families": {}}
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            t = time.perf_counter()
            directory = pathlib.Path(root) / name
            hf = build_family(name, directory, tok)
            loaded = weights.load_model(directory)
            family = {"hf": [hf_greedy(hf, p, MAX_TOKENS) for p in ids], "seconds": {}}
            for run, (kwargs, families) in RUNS.items():
                if name not in families:
                    continue
                r = time.perf_counter()
                llm = LLM(loaded=loaded, num_blocks=NUM_BLOCKS, block_size=4, **kwargs)
                outs = llm.generate(ids, GREEDY, use_tqdm=False)
                family[run] = [list(o.outputs[0].token_ids) for o in outs]
                family[f"{run}_devices"] = llm.engine.stats()["num_devices"]
                family[f"{run}_kv_head_replication"] = llm.engine.runner.kv_head_replication
                family["max_model_len"] = llm.engine.max_model_len
                family["seconds"][run] = round(time.perf_counter() - r, 2)
                family["seconds"][run + "_compile"] = round(llm.engine.runner.compile_seconds, 2)
                family[f"{run}_compilations"] = llm.engine.stats()["num_compilations"]
                llm.engine.scheduler.block_manager.check_invariants()
            family["seconds"]["total"] = round(time.perf_counter() - t, 2)
            result["families"][name] = family
            print(f"{name}: {family['seconds']}", file=sys.stderr, flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    chosen = list(RUNS["one"][1])
    if sys.argv[1:2] == ["--families"]:
        chosen = sys.argv[2].split(",")
    main(chosen)
