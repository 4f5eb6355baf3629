"""The cost of structured output: output tokens/s of a batch with and without constraints, side by side.

One engine (the default model, float32, `LLM` defaults), warmed up (`LLMEngine.warm_up`: the
sampler's masked variants included), then in each round, in alternating order:

- `free`: `num_requests` greedy chats, `max_tokens` tokens each (`ignore_eos`), no constraint;
- `masked`: the same requests, each constrained by a regex that every output of `max_tokens` tokens
  satisfies and that never completes (`[^\\x00]*`, any text): the whole cost of the mask (llguidance
  filling each sequence's bitmask row on the host every step, the jitted sampler unpacking it and
  masking the row's logits) and nothing else changes, every request still runs `max_tokens` tokens;
- `json`: the same prompts asking for a person as JSON, constrained by a JSON schema (nested object,
  array of enums, bounded integer, patterned strings), greedy, up to 160 tokens (room for a whole
  object): what an application pays, its outputs validated with `jsonschema` (the number valid is
  reported; tokens/s counts the tokens it generated).

Per configuration: output tokens/s (output tokens over the timed `generate`'s wall time), the median
over rounds, and the ratio to `free` in each round; host milliseconds per step filling bitmasks are
measured apart (llguidance's `fill_next_token_bitmask` for `num_requests` matchers, timed alone).

    python bench/structured_output.py [--quick] [--rounds N] [--out bench/results]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.traces import load_alpaca_prompts  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
ANY_TEXT = r"[^\x00]*"
JSON_MAX_TOKENS = 160  # room for a whole object of the schema
CONFIGS = ("free", "masked", "json")


def run(num_requests: int, max_tokens: int, rounds: int, log) -> dict:
    import jsonschema

    from jpaged import LLM, SamplingParams

    llm = LLM(max_num_seqs=num_requests, max_num_batched_tokens=4096)  # a warm-up of this batch's shapes
    log(f"warm-up: {llm.engine.warm_up().num_executables} executables")
    chat = lambda text: llm.chat_prompt([{"role": "user", "content": text}])  # noqa: E731
    prompts = [chat(p) for p in load_alpaca_prompts()[:num_requests]]
    people = [chat(f"Describe a person who would enjoy this as JSON: {p}")
              for p in load_alpaca_prompts()[:num_requests]]
    batches = {
        "free": (prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)),
        "masked": (prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                           structured_outputs={"regex": ANY_TEXT})),
        "json": (people, SamplingParams(temperature=0, max_tokens=JSON_MAX_TOKENS, structured_outputs={"json": PERSON})),
    }
    llm.generate(*batches["json"], use_tqdm=False)  # untimed: the first constrained requests build llguidance's tokenizer
    runs = {c: [] for c in CONFIGS}
    texts = {}
    for r in range(rounds):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        for config in order:
            t0 = time.perf_counter()
            outs = llm.generate(*batches[config], use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            runs[config].append(dict(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds))
            texts[config] = [o.outputs[0].text for o in outs]
            log(f"round {r}: {config:<7} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    valid = 0
    for text in texts["json"]:
        try:
            jsonschema.validate(json.loads(text), PERSON)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    # the host's share: llguidance filling num_requests bitmask rows, timed alone
    grammars = llm.engine.grammars
    matchers = [grammars.matcher(batches["json"][1].structured_outputs) for _ in range(num_requests)]
    bitmask = grammars.allocate_bitmask(num_requests)
    from jpaged.core.structured_output import fill_bitmask

    t0 = time.perf_counter()
    for _ in range(20):
        for i, m in enumerate(matchers):
            fill_bitmask(m, bitmask, i)
    fill_ms = (time.perf_counter() - t0) / 20 * 1000
    results = {}
    for config in CONFIGS:
        speeds = [x["tokens_per_s"] for x in runs[config]]
        ratios = [x["tokens_per_s"] / f["tokens_per_s"] for x, f in zip(runs[config], runs["free"])]
        results[config] = dict(tokens_per_s=float(np.median(speeds)), speed_vs_free=float(np.median(ratios)),
                               rounds=runs[config], rounds_speed_vs_free=ratios)
    results["json"]["valid_outputs"] = valid
    results["json"]["sample_output"] = texts["json"][0]
    return dict(results=results, fill_bitmask_ms_per_step=fill_ms)


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, n = out["results"], out["settings"]["num_requests"]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    bars = ax.bar(list(results), [r["tokens_per_s"] for r in results.values()], color="tab:blue")
    for bar, r in zip(bars, results.values()):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['speed_vs_free']:.2f}x",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"output tokens / s, {n} requests")
    ax.margins(y=0.15)
    cpu = out["machine"].get("cpu") or {}
    fig.suptitle(f"structured output's cost ({cpu.get('model_name')}, {cpu.get('nproc')} cores)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], "8 requests of 32 tokens, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the alternation (default: 4; --quick 2)")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    start = time.perf_counter()
    num_requests, max_tokens, rounds = (8, 32, 2) if args.quick else (32, 96, 4)
    rounds = args.rounds or rounds
    import os

    load_start = os.getloadavg()
    measured = run(num_requests, max_tokens, rounds, log=lambda s: print(s, flush=True))
    out = dict(benchmark="structured_output", machine=common.machine_info(),
               settings=dict(num_requests=num_requests, max_tokens=max_tokens, rounds=rounds, greedy=True,
                             any_text_regex=ANY_TEXT, schema=PERSON, compile_cache=args.compile_cache),
               load_average=dict(start=load_start, end=os.getloadavg()), **measured)

    def print_table(out):
        cpu = out["machine"].get("cpu") or {}
        print(f"{cpu.get('model_name')}, {cpu.get('nproc')} cores; load {out['load_average']}")
        for config, r in out["results"].items():
            extra = f"  valid {r['valid_outputs']}/{out['settings']['num_requests']}" if config == "json" else ""
            print(f"{config:<8}{r['tokens_per_s']:8.1f} tok/s  x free {r['speed_vs_free']:.2f} "
                  f"(rounds {' '.join(f'{x:.2f}' for x in r['rounds_speed_vs_free'])}){extra}")
        print(f"llguidance filling {out['settings']['num_requests']} bitmask rows: "
              f"{out['fill_bitmask_ms_per_step']:.2f} ms per step")

    return common.report(out, args.out, common.results_stem("structured_output", args.quick), start, plot,
                         print_table)


if __name__ == "__main__":
    main()
