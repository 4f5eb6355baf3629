"""Memory saved by sharing KV blocks (paper, 6.3 and Figure 15) and a shared system prompt (6.4).

Every run is the real `LLMEngine` on the real default model (SmolLM2-135M-Instruct, float32),
scheduling as the paper's vLLM did (`enable_chunked_prefill=False`: results comparable with it).

(a) Parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) on Alpaca prompts
(`bench/data/alpaca_seed_prompts.jsonl`, the model's chat template; a seeded choice of prompts).
After every engine step the benchmark reads the block manager and counts, for the running
sequences, the blocks held with sharing (distinct physical blocks in their block tables: what the
pool really holds) and the blocks they would hold without sharing (the sum over sequences of
ceil(num_tokens / block_size): each sequence owning a private copy). Both come from the same run
and the same steps; saving = 1 - sum_t shared_t / sum_t unshared_t (the time integral, one engine
step a time unit), and at the step of peak unshared memory. Parallel sampling: temperature 1.0,
a fixed seed, stopping at EOS or `max_tokens`; beam search: HF semantics (length_penalty 1,
early_stopping False). No configuration preempts (asserted): the pool is large.

(b) Shared system prompt: one long system prompt (~250 tokens) + a different Alpaca instruction
per request, greedy, served offline (all requests at t=0) by three LLMs of the same pool:
  off     prefix caching off;
  cold    prefix caching on, nothing cached before the batch: the first request computes the
          system prompt, the others reuse its blocks from the same step on;
  primed  prefix caching on, the system prompt's blocks cached in advance by one untimed request
          (the paper's shared-prefix setting, 4.4: the provider stores the prefix's KV cache).
Reported: output tokens/s (compilation excluded), prompt tokens actually prefilled, the padded
prefill tokens the step shapes really computed, prefix-cache hit rate, and whether the modes
generate identical token ids (they must: asserted). Each LLM first compiles the sampler and the
decode shapes on short prompts that share nothing with the timed rounds; round k uses system-prompt
variant k (variants differ in their first sentence, so nothing cached in one round helps the next);
within a round the three LLMs serve in lockstep (one engine step of each in turn, so contention on
a shared machine hits them alike); speedups are medians of per-round ratios.

    python bench/sharing.py --quick      # ~2-3 min on 2 unloaded cores
    python bench/sharing.py              # full preset (~20-30 min)

Paper (OPT-13B, Alpaca): parallel sampling saves 6.09 / 8.53 / 9.79 %, beam search 37.56 /
53.13 / 55.16 %; a shared prefix raises throughput 1.67x (80 tokens) to 3.58x (341 tokens).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench import traces as traces_lib  # noqa: E402
from bench.block_size import interleave  # noqa: E402
from jpaged.core.kv_cache_manager import blocks_for  # noqa: E402

PAPER_ALPACA = {"parallel": {2: 6.09, 4: 8.53, 6: 9.79}, "beam": {2: 37.56, 4: 53.13, 6: 55.16}}
PAPER_SHAREGPT_RANGE = {"parallel": (16.2, 30.5), "beam": (44.3, 66.3)}

MAX_PROMPT_TOKENS = 256  # templated; leaves out 4 of the 120 seed prompts (the longest is 1,350 tokens)
PRESETS = {
    "quick": dict(num_prompts=4, max_tokens=32, widths=(2, 4, 6), prefix_requests=8, prefix_max_tokens=16,
                  rounds=1, block_size=16),
    "full": dict(num_prompts=24, max_tokens=64, widths=(2, 4, 6), prefix_requests=32, prefix_max_tokens=32,
                 rounds=3, block_size=16),
}

# ~250 tokens with the SmolLM2 tokenizer (the exact count is recorded). Variants differ in their first
# sentence, so they share no prefix block with one another.
SYSTEM_PROMPT_BODY = (
    "Your job is to help people with writing, reasoning, planning and everyday questions. Follow these rules "
    "in every answer. First, read the whole request before you reply, and answer the question that was "
    "actually asked; if a request is ambiguous, state the interpretation you chose in one short sentence. "
    "Second, be accurate: do not invent facts, names, numbers, quotations or sources, and say plainly when "
    "you are not sure. Third, be concise: prefer short paragraphs and lists, avoid filler, and do not repeat "
    "the question back. Fourth, match the requested format exactly, whether it is a haiku, a table, a list "
    "of examples, a single sentence or a piece of code. Fifth, be kind and respectful, keep a neutral tone, "
    "and never produce content that is hateful, dangerous or that reveals private information about real "
    "people. Sixth, when you write code, keep it short, runnable and commented, and mention its assumptions. "
    "Seventh, when you give advice about health, law or money, give general information only and suggest "
    "asking a qualified professional. Finally, end your answer as soon as the task is done."
)
SYSTEM_PROMPT_OPENINGS = (
    "You are a careful, friendly and knowledgeable assistant for a small company.",
    "You are a patient and helpful assistant who works for a public library service.",
    "You are a precise, polite and experienced assistant working for a community college.",
    "You are a thoughtful and reliable assistant employed by a regional newspaper office.",
    "You are a calm, clear and practical assistant serving the staff of a city hospital.",
    "You are an honest, cheerful and efficient assistant for a family-run travel agency.",
)


def system_prompt(variant: int) -> str:
    return SYSTEM_PROMPT_OPENINGS[variant % len(SYSTEM_PROMPT_OPENINGS)] + " " + SYSTEM_PROMPT_BODY


# ---- (a) parallel sampling and beam search ---------------------------------------------------------

def measure_sharing(llm, prompts: list, params, tag: str) -> dict:
    """Serves `prompts` with `params`; integrates shared vs unshared blocks over the engine's steps."""
    engine = llm.engine
    bs = engine.config.block_size
    preemptions_before = engine.scheduler.num_preemptions
    compile_before = engine.runner.compile_seconds
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    shared_t, unshared_t, tokens_t, seqs_t, prompt_only_t = [], [], [], [], []
    outputs = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        bm = engine.scheduler.block_manager
        seq_ids = bm.seq_ids
        if not seq_ids:
            continue
        shared = len({b for s in seq_ids for b in bm.block_table(s)})
        assert shared == bm.num_blocks - 1 - bm.num_free_blocks, "held blocks != used blocks"
        num_tokens = [bm.num_tokens(s) for s in seq_ids]
        shared_t.append(shared)
        unshared_t.append(sum(blocks_for(n, bs) for n in num_tokens))
        tokens_t.append(sum(num_tokens))
        seqs_t.append(len(seq_ids))
        # what sharing only the prompt's full blocks would save (parallel sampling's sharing, to first order)
        prompt_only_t.append(sum((sum(bm.has(q.seq_id) for q in g.seqs) - 1) * (len(g.prompt_token_ids) // bs)
                                 for g in engine.scheduler.running if any(bm.has(q.seq_id) for q in g.seqs)))
    wall = time.perf_counter() - start - (engine.runner.compile_seconds - compile_before)
    assert engine.scheduler.num_preemptions == preemptions_before, "a sharing run preempted: enlarge the pool"
    shared_t, unshared_t = np.array(shared_t), np.array(unshared_t)
    peak = int(np.argmax(unshared_t))
    outs = [outputs[f"{tag}-{i}"] for i in range(len(prompts))]
    out_lens = [len(c.token_ids) for o in outs for c in o.outputs]
    return dict(
        saving=1.0 - shared_t.sum() / unshared_t.sum(),
        saving_at_peak=1.0 - shared_t[peak] / unshared_t[peak],
        saving_prompt_blocks_only=float(np.sum(prompt_only_t) / unshared_t.sum()),
        shared_block_steps=int(shared_t.sum()), unshared_block_steps=int(unshared_t.sum()),
        peak_shared_blocks=int(shared_t.max()), peak_unshared_blocks=int(unshared_t.max()),
        token_slot_utilization_shared=float(np.sum(tokens_t) / (shared_t.sum() * bs)),
        num_steps=len(shared_t), mean_live_seqs=float(np.mean(seqs_t)),
        mean_prompt_tokens=float(np.mean([len(o.prompt_token_ids) for o in outs])),
        mean_output_tokens=float(np.mean(out_lens)), num_outputs=len(out_lens),
        finish_reasons={r: sum(c.finish_reason == r for o in outs for c in o.outputs) for r in ("stop", "length")},
        wall_seconds=wall,
        per_step=dict(shared=shared_t.tolist(), unshared=unshared_t.tolist()),
    )


def run_sharing(loaded, preset: dict, seed: int, prompts_text: list[str]) -> dict:
    from jpaged import LLM, SamplingParams

    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(len(prompts_text), preset["num_prompts"], replace=False).tolist())
    bs = preset["block_size"]
    prompts = [chat_prompt(loaded.tokenizer, [{"role": "user", "content": prompts_text[i]}]) for i in chosen]
    # room for every sequence to hold a private copy (the unshared case): sharing never preempts
    num_blocks = max(preset["widths"]) * sum(blocks_for(len(p["prompt_token_ids"]) + preset["max_tokens"], bs)
                                             for p in prompts) + 16
    llm = LLM(loaded=loaded, block_size=bs, num_blocks=num_blocks, dtype="float32",
              enable_chunked_prefill=False)  # the paper's policy: results comparable with it
    # warm-up: compile the sampler and the shapes of the smallest configuration (compile time is excluded anyway)
    llm.generate(prompts[:2], SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=seed), use_tqdm=False)
    results = {"parallel": {}, "beam": {}}
    for kind in ("parallel", "beam"):
        for width in preset["widths"]:
            if kind == "parallel":
                params = SamplingParams(n=width, temperature=1.0, max_tokens=preset["max_tokens"], seed=seed)
            else:
                params = SamplingParams(beam_width=width, max_tokens=preset["max_tokens"])
            r = measure_sharing(llm, prompts, params, f"{kind}{width}")
            results[kind][width] = r
            print(f"  {kind:<8} {width}: saving {100 * r['saving']:5.1f}% (at peak {100 * r['saving_at_peak']:5.1f}%), "
                  f"{r['num_steps']} steps, mean output {r['mean_output_tokens']:.1f} tokens, "
                  f"{r['wall_seconds']:.1f} s",
                  flush=True)
    return dict(prompt_ids=chosen, num_blocks=llm.engine.num_blocks, results=results)


def chat_prompt(tokenizer, conversation) -> dict:
    """As `LLM.chat_prompt`: the templated text and its token ids (no special tokens added again)."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}


# ---- (b) shared system prompt with and without prefix caching ------------------------------------------

PREFIX_MODES = ("off", "cold", "primed")


def serve_prefix(llm, prompts: list, params, tag: str):
    """Serves `prompts` offline, yielding after every engine step (drive it with `interleave`); counts
    the prefill tokens computed and the padded prefill tokens the step shapes ran (from the engine's
    step records)."""
    engine = llm.engine
    records = []
    engine.add_observer(records.append)
    before = engine.stats()
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        yield
    engine.remove_observer(records.append)
    outs = [finished[i] for i in ids]
    after = engine.stats()
    elapsed = sum(r.seconds for r in records)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    prefilled = after["num_prefilled_tokens"] - before["num_prefilled_tokens"]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(elapsed_s=elapsed, compile_s=sum(r.compile_seconds for r in records), output_tokens=out_tokens,
                output_tokens_per_s=out_tokens / elapsed, requests_per_s=len(outs) / elapsed,
                prompt_tokens=prompt_tokens, prefilled_tokens=prefilled,
                padded_prefill_tokens=sum(r.num_padded_tokens for r in records if r.kind == "prefill"),
                hit_rate=1.0 - prefilled / prompt_tokens,
                num_steps=after["num_steps"] - before["num_steps"],
                num_preemptions=after["num_preemptions"] - before["num_preemptions"],
                token_ids=[tuple(o.outputs[0].token_ids) for o in outs])


def common_prefix(seqs) -> list[int]:
    first = list(seqs[0])
    n = len(first)
    for s in seqs[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], s)) if a != b), min(n, len(s)))
    return first[:n]


def run_prefix(loaded, preset: dict, seed: int, prompts_text: list[str]) -> dict:
    """off: no prefix caching. cold: prefix caching, nothing cached before the batch (the first request
    computes the system prompt, the others reuse it from the same step on). primed: the system prompt's
    blocks were cached in advance, as the paper's service provider does (4.4), by one untimed request."""
    from jpaged import LLM, SamplingParams

    rng = np.random.default_rng(seed + 1)
    n = preset["prefix_requests"]
    chosen = rng.choice(len(prompts_text), n, replace=n > len(prompts_text)).tolist()
    bs = preset["block_size"]
    params = SamplingParams(temperature=0, max_tokens=preset["prefix_max_tokens"])
    tokenizer = loaded.tokenizer

    def requests(variant: int) -> list:
        return [chat_prompt(tokenizer, [{"role": "system", "content": system_prompt(variant)},
                                        {"role": "user", "content": prompts_text[i]}]) for i in chosen]

    pool = dict(num_blocks=16 + max(  # every request holding a private copy: never preempts
        sum(blocks_for(len(p["prompt_token_ids"]) + preset["prefix_max_tokens"], bs) for p in requests(v))
        for v in range(len(SYSTEM_PROMPT_OPENINGS))))
    llms = {mode: LLM(loaded=loaded, block_size=bs, dtype="float32", enable_prefix_caching=(mode != "off"),
                      enable_chunked_prefill=False, **pool)  # the paper's policy
            for mode in PREFIX_MODES}
    # compile the sampler and decode shapes on short prompts that share no block with the timed rounds
    warm = [chat_prompt(tokenizer, [{"role": "user", "content": prompts_text[i]}]) for i in chosen[:2]]
    for mode, llm in llms.items():
        r, = interleave([serve_prefix(llm, warm, SamplingParams(temperature=0, max_tokens=4), "warm-")])
        print(f"  warm-up {mode}: {r['elapsed_s']:.1f} s + {r['compile_s']:.1f} s compile", flush=True)
    rounds = []
    for k in range(preset["rounds"]):
        batch = requests(k)
        prefix = common_prefix([p["prompt_token_ids"] for p in batch])
        order = PREFIX_MODES if k % 2 == 0 else PREFIX_MODES[::-1]
        llms["primed"].generate([prefix], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        # the three modes in lockstep (one engine step of each in turn): they see the same contention
        row = dict(zip(order, interleave(serve_prefix(llms[m], batch, params, f"r{k}-") for m in order)))
        identical = all(row[m]["token_ids"] == row["off"]["token_ids"] for m in PREFIX_MODES)
        assert identical, f"round {k}: prefix caching changed the greedy outputs"
        for mode in order:
            row[mode]["token_ids_digest"] = [hash(t) for t in row[mode].pop("token_ids")]
        row = dict(variant=k, shared_prefix_tokens=len(prefix), identical_outputs=identical,
                   speedup={m: row[m]["output_tokens_per_s"] / row["off"]["output_tokens_per_s"]
                            for m in PREFIX_MODES[1:]}, **row)
        rounds.append(row)
        print(f"  round {k}: " + ", ".join(
            f"{m} {row[m]['output_tokens_per_s']:.2f} tok/s ({row[m]['elapsed_s']:.1f} s, prefilled "
            f"{row[m]['prefilled_tokens']}, padded {row[m]['padded_prefill_tokens']})" for m in PREFIX_MODES),
              flush=True)
    summary = dict(
        speedup_median={m: statistics.median(r["speedup"][m] for r in rounds) for m in PREFIX_MODES[1:]},
        **{key: {m: statistics.median(r[m][key] for r in rounds) for m in PREFIX_MODES}
           for key in ("output_tokens_per_s", "elapsed_s")},
        **{key: {m: rounds[0][m][key] for m in PREFIX_MODES}
           for key in ("prefilled_tokens", "padded_prefill_tokens", "hit_rate", "num_steps")},
        prompt_tokens=rounds[0]["off"]["prompt_tokens"],
        identical_outputs=all(r["identical_outputs"] for r in rounds),
        mean_prompt_tokens=rounds[0]["off"]["prompt_tokens"] / n,
        shared_prefix_tokens=rounds[0]["shared_prefix_tokens"],
    )
    return dict(prompt_ids=chosen, num_blocks=pool["num_blocks"], rounds=rounds, summary=summary,
                modes=dict(off="prefix caching off", cold="prefix caching on, nothing cached before the batch",
                           primed="prefix caching on, the shared prefix cached in advance by an untimed request"),
                sampling="temperature=0, max_tokens=%d, stop at EOS" % preset["prefix_max_tokens"])


# ---- reporting ---------------------------------------------------------------------------------------

def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, kind, title in ((axes[0], "parallel", "parallel sampling (n)"), (axes[1], "beam", "beam search (width)")):
        res = out["sharing"]["results"][kind]
        widths = sorted(int(w) for w in res)
        ax.bar(np.arange(len(widths)) - 0.2, [100 * res[w]["saving"] for w in widths], 0.4,
               label="jpaged, time average", color="tab:green")
        ax.bar(np.arange(len(widths)) + 0.2, [PAPER_ALPACA[kind].get(w, np.nan) for w in widths], 0.4,
               label="paper (OPT-13B, Alpaca)", color="lightgray")
        for j, w in enumerate(widths):
            ax.text(j - 0.2, 100 * res[w]["saving"] + 0.5, f"{100 * res[w]['saving']:.1f}", ha="center", fontsize=8)
        ax.set_xticks(range(len(widths)), [str(w) for w in widths])
        ax.set_xlabel(title)
        ax.set_ylabel("memory saving (%)")
        ax.set_title(f"KV blocks saved by sharing: {title}", fontsize=10)
        ax.legend(fontsize=7)
    ax = axes[2]
    s = out["prefix"]["summary"]
    ax.bar(range(len(PREFIX_MODES)), [s["output_tokens_per_s"][m] for m in PREFIX_MODES],
           color=["tab:gray", "tab:olive", "tab:green"])
    for j, m in enumerate(PREFIX_MODES):
        ax.text(j, s["output_tokens_per_s"][m], f"prefilled {s['prefilled_tokens'][m]}\n"
                f"padded {s['padded_prefill_tokens'][m]}\nhit {100 * s['hit_rate'][m]:.0f}%",
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(PREFIX_MODES)), ["caching off", "on, cold", "on, primed"])
    ax.set_ylabel("output tokens / s (offline)")
    speed = ", ".join(f"{m} x{v:.2f}" for m, v in s["speedup_median"].items())
    ax.set_title(f"shared prefix of {s['shared_prefix_tokens']} tokens: {speed}", fontsize=9)
    ax.margins(y=0.35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(out: dict) -> None:
    print(f"{'mode':<10}{'width':>6}{'saving%':>9}{'peak%':>7}{'prompt-only%':>13}{'paper%':>8}{'prompt':>8}"
          f"{'output':>8}{'steps':>7}")
    for kind in ("parallel", "beam"):
        for w, r in out["sharing"]["results"][kind].items():
            print(f"{kind:<10}{w:>6}{100 * r['saving']:9.2f}{100 * r['saving_at_peak']:7.1f}"
                  f"{100 * r['saving_prompt_blocks_only']:13.1f}"
                  f"{PAPER_ALPACA[kind].get(int(w), float('nan')):8.2f}{r['mean_prompt_tokens']:8.1f}"
                  f"{r['mean_output_tokens']:8.1f}{r['num_steps']:7d}")
    s = out["prefix"]["summary"]
    print(f"shared system prompt: common prefix {s['shared_prefix_tokens']} tokens, mean prompt "
          f"{s['mean_prompt_tokens']:.0f}, {s['prompt_tokens']} prompt tokens in all")
    print(f"{'prefix cache':<14}{'tok/s':>8}{'x off':>7}{'prefilled':>10}{'padded':>8}{'hit%':>7}{'steps':>6}")
    for m in PREFIX_MODES:
        print(f"{m:<14}{s['output_tokens_per_s'][m]:8.2f}{s['speedup_median'].get(m, 1.0):7.2f}"
              f"{s['prefilled_tokens'][m]:10d}{s['padded_prefill_tokens'][m]:8d}{100 * s['hit_rate'][m]:7.1f}"
              f"{s['num_steps'][m]:6d}")
    print(f"identical greedy outputs: {s['identical_outputs']}")


def main(argv=None) -> dict:
    parser = common.bench_parser(__doc__.splitlines()[0], "4 prompts, max 32 tokens; 8 shared-prefix requests")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    preset_name = "quick" if args.quick else "full"
    preset = PRESETS[preset_name]
    start = time.perf_counter()
    machine = common.machine_info()
    from jpaged.weights import load_model

    with common.Stopwatch() as sw:
        loaded = load_model(None)
    all_prompts = traces_lib.load_alpaca_prompts()
    prompts_text = [p for p in all_prompts if len(chat_prompt(loaded.tokenizer, [{"role": "user", "content": p}])
                                                  ["prompt_token_ids"]) <= MAX_PROMPT_TOKENS]
    print(f"model loaded in {sw.seconds:.1f} s; (a) sharing", flush=True)
    sharing = run_sharing(loaded, preset, args.seed, prompts_text)
    print("(b) shared system prompt", flush=True)
    prefix = run_prefix(loaded, preset, args.seed, prompts_text)
    out = dict(benchmark="sharing", preset=preset_name, settings=dict(
        **preset, dtype="float32", model="SmolLM2-135M-Instruct (default)", compile_cache=args.compile_cache,
        parallel_sampling="temperature=1.0, top_p=1, top_k=0, stop at EOS or max_tokens",
        beam_search="length_penalty=1.0, early_stopping=False",
        saving="1 - sum_t shared_t / sum_t unshared_t over engine steps; shared = distinct blocks held, "
               "unshared = sum over sequences of ceil(num_tokens / block_size)"),
        num_alpaca_prompts=dict(total=len(all_prompts), used=len(prompts_text), max_prompt_tokens=MAX_PROMPT_TOKENS),
        seeds=dict(seed=args.seed, prompt_choice=args.seed, prefix_prompt_choice=args.seed + 1,
                   sampling=args.seed),
        machine=machine, model_load_seconds=sw.seconds, sharing=sharing, prefix=prefix,
        paper=dict(alpaca=PAPER_ALPACA, sharegpt_range=PAPER_SHAREGPT_RANGE,
                   shared_prefix="1.67x (1-shot, 80 tokens) .. 3.58x (5-shot, 341 tokens), LLaMA-13B"))
    return common.report(out, args.out, common.results_stem("sharing", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
