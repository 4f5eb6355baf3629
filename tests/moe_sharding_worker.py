"""The mixture-of-experts families of `tests/test_moe.py` under expert, tensor and data parallelism, in a process
of its own on forced CPU devices; prints one JSON object.

`tests/test_moe_sharding.py` starts it with `XLA_FLAGS=--xla_force_host_platform_device_count=4` (set before JAX
starts). For each family it builds the tiny random HF model (`build_moe`: 4 query heads, 2 KV heads, 8 experts,
Mixtral 4), loads it once, and records the greedy tokens of `PROMPTS` (10 new tokens, EOS ignored, block size 4)
on one device and under each of `RUNS`, HF's `generate` on the same prompts, and the collectives of each run's
compiled decode step (`bench.sharding.collectives`: ops and bytes). The assertions live in the test module.

`--build DIR` saves Qwen3-MoE's tiny model in DIR and prints HF's tokens; `--process ADDRESS N I DIR` is then process
I of N under `jax.distributed`, one forced CPU device each, the experts split over the N processes' devices.
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

from bench.sharding import collectives  # noqa: E402
from families_sharding_worker import tokenizer  # noqa: E402
from jpaged import LLM, SamplingParams, weights  # noqa: E402
from test_moe import MOE_FAMILIES, PROMPTS, build_moe, hf_greedy  # noqa: E402
from workers import enable_compilation_cache  # noqa: E402

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# run name -> (LLM keyword arguments, the families it runs). ep2: the experts split over 2 devices, attention whole on
# each; tp2: heads split, each expert's intermediate axis split; tp2ep2: heads split, the experts split over the same
# devices (vLLM's --enable-expert-parallel); ep4: one expert a device for Mixtral's 4; dp2: the pool by blocks;
# dp2ep2: 4 devices, each data rank's experts split over 2.
RUNS = {
    "one": ({}, tuple(MOE_FAMILIES)),
    "ep2": ({"expert_parallel_size": 2}, tuple(MOE_FAMILIES)),
    "tp2": ({"tensor_parallel_size": 2}, ("qwen2_moe", "olmoe")),
    "tp2ep2": ({"tensor_parallel_size": 2, "expert_parallel_size": 2}, tuple(MOE_FAMILIES)),
    "ep4": ({"expert_parallel_size": 4}, ("mixtral", "qwen3_moe")),
    "dp2": ({"data_parallel_size": 2}, ("qwen3_moe", "mixtral")),
    "dp2ep2": ({"data_parallel_size": 2, "expert_parallel_size": 2}, ("qwen2_moe", "olmoe")),
}
NUM_BLOCKS = 48


def halves() -> list[list[str]]:
    return [["qwen2_moe", "mixtral"], ["qwen3_moe", "olmoe"]]


def main(names) -> None:
    enable_compilation_cache()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tok = tokenizer()
    ids = [list(tok(p).input_ids) for p in PROMPTS]
    result = {"num_devices": jax.device_count(), "prompt_ids": ids, "families": {}}
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            directory = pathlib.Path(root) / name
            hf = build_moe(name, directory, tok)
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
                decode = [e for (n, _), e in llm.engine.runner.executables.items() if n == "decode_step"]
                family[f"{run}_collectives"] = collectives(decode[-1]) if decode else None
                family["seconds"][run] = round(time.perf_counter() - r, 2)
                llm.engine.scheduler.block_manager.check_invariants()
            result["families"][name] = family
            print(f"{name}: {family['seconds']}", file=sys.stderr, flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(result))


def process_main(address: str, num_processes: int, process_id: int, directory: str) -> None:
    """Process `process_id` of `num_processes` under `jax.distributed` (one forced CPU device each): Qwen3-MoE (built
    by process 0 into `directory` beforehand, read by all) with its experts split over the processes' devices,
    process 0 alone giving the requests; prints the tokens it got and HF's."""
    from jpaged.device import distributed

    distributed.initialize(address, num_processes, process_id, initialization_timeout=120)
    enable_compilation_cache()
    torch.set_num_threads(1)
    tok = tokenizer()
    ids = [list(tok(p).input_ids) for p in PROMPTS]
    llm = LLM(model=directory, num_blocks=NUM_BLOCKS, block_size=4, expert_parallel_size=num_processes)
    outs = llm.generate(ids if process_id == 0 else [], GREEDY if process_id == 0 else None, use_tqdm=False)
    decode = [e for (n, _), e in llm.engine.runner.executables.items() if n == "decode_step"]
    print(json.dumps({"process_id": jax.process_index(), "num_devices": jax.device_count(),
                      "local_devices": jax.local_device_count(), "tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "collectives": collectives(decode[-1])}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:  # the model the processes share, and HF's tokens on PROMPTS
        tok = tokenizer()
        hf = build_moe("qwen3_moe", pathlib.Path(sys.argv[2]), tok)
        print(json.dumps({"hf": [hf_greedy(hf, list(tok(p).input_ids), MAX_TOKENS) for p in PROMPTS]}))
    elif sys.argv[1:2] == ["--process"]:
        process_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        chosen = list(MOE_FAMILIES)
        if sys.argv[1:2] == ["--families"]:
            chosen = sys.argv[2].split(",")
        main(chosen)
