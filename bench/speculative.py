"""Speculative decoding on a CPU: output tokens/s and time per output token with it off and on, side by side.

The default model (SmolLM2-135M-Instruct, float32), one engine per configuration, all sharing one
`ModelRunner` (its parameters, KV pool and every compiled executable of a shape they have in common):

  off                      no speculation;
  ngram K=4                prompt lookup (`jpaged.core.proposer.NgramProposer`), 4 drafts a step,
                           n-grams of 1-4 tokens;
  draft-layers L=10 / 15   self-drafting: the model's first L layers with its final norm and LM head
                           propose 3 drafts a step (a third and a half of the 30 layers); included when
                           `EngineConfig` accepts `speculative_method="draft-layers"`, skipped with a
                           printed note otherwise.

Workloads (greedy, at most `max_tokens` output tokens each, stopping at EOS as a user's request would):
  copy   "repeat / correct / rewrite formally / summarize this passage" chats whose passages are the
         longer reference answers of the Alpaca seed requests (`bench/data`), joined to 150-300
         tokens: outputs that copy their input, where prompt lookup is right often;
  chat   the Alpaca seed instructions as single-turn chats (no copying to find).

Concurrency C (1, 4 and 16): a closed loop over the engine's public API (`LLMEngine.add_request`,
`step`): C requests in flight from the start, and each one that finishes replaced by the next, until
the workload's requests are done. Output tokens/s: the output tokens over the loop's wall time; time
per output token (TPOT): each request's (last token time - first token time) / (its tokens - 1), the
median over the requests (vLLM's definition; its first token is the prefill's). A second clock
beside wall time, the shape-median clock (`bench/clock.py`): every step charged its measured host
time plus the median device time of its shape over the run.

Fairness on a shared machine: round 0 runs every configuration and cell untimed (every executable the
later rounds need is compiled there, and the runner runs each new one once untimed); then rounds 1..R
alternate the configurations' order (forwards, backwards, ...), and each configuration's figure is
the median of its rounds, with its ratio to `off` taken round by round (off ran beside it) and the
median of those given. Each configuration's greedy tokens are checked against `off`'s for every
request of every round: the fraction identical must be 1.0. Acceptance: drafts accepted over drafts
proposed, in all and at each draft position (the j-th draft counts only if the ones before it were
accepted), per workload (over the timed rounds' loops).

vLLM (CPU build, `.venv-vllm`, made by `bench/peers/setup_vllm.sh`): the same token ids, off and with
`speculative_config={"method": "ngram", ...}`, in a subprocess after jpaged's rounds (never beside
them), the same closed loop over its `LLMEngine`; a failure is recorded with its error.

    python bench/speculative.py [--quick] [--rounds N] [--methods off,ngram,draft-layers] [--[no-]vllm]
                                [--name STEM] [--out bench/results]   # writes speculative.json and .png
Presets: full: 4 / 8 / 32 requests a loop at C = 1 / 4 / 16, at most 128 output tokens, 3 timed rounds,
draft-layers at L = 10 and 15, vLLM (3 rounds); --quick (speculative_quick.*): 4 / 4 / 16 requests, 64
tokens, 2 rounds, L = 10 alone, no vLLM unless --vllm (its two engines start in 2-3 minutes). Measured
on 2 shared cores: --quick --vllm 21 minutes (load 2-4), 15 of them the draft-layers engine's, which ran
5-11x slower than off (bench/README.md); off + ngram at full size (--methods off,ngram --no-vllm) 18
minutes (load 2-5). The full preset with draft-layers at that speed: over an hour.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 4, 16)
WORKLOADS = ("copy", "chat")
NGRAM_K, DRAFT_K = 4, 3
COPY_TASKS = (
    "Repeat the following passage word for word.",
    "Correct any spelling or grammar mistakes in the following passage and write out the whole corrected passage.",
    "Rewrite the following passage in a more formal tone, keeping every sentence in the same order.",
    "Summarize the following passage.",
)


# ---------------------------------------------------------------- configurations and workloads

def configurations(num_layers: int, draft_layers=None, log=print) -> tuple[list[dict], list[dict]]:
    """(the configurations to run, the ones skipped with why): each {"name", "engine": EngineConfig fields}.
    draft-layers is one more entry, kept only when `EngineConfig` accepts it."""
    from jpaged.engine import EngineConfig

    draft_layers = draft_layers or (num_layers // 3, num_layers // 2)
    wanted = [dict(name="off", engine={}),
              dict(name=f"ngram K={NGRAM_K}", engine=dict(speculative_method="ngram", num_speculative_tokens=NGRAM_K,
                                                         prompt_lookup_min=1, prompt_lookup_max=4))]
    wanted += [dict(name=f"draft-layers L={n} K={DRAFT_K}",
                    engine=dict(speculative_method="draft-layers", num_speculative_tokens=DRAFT_K,
                                speculative_draft_layers=n)) for n in draft_layers]
    kept, skipped = [], []
    for c in wanted:
        try:
            EngineConfig(**c["engine"])
        except Exception as e:  # noqa: BLE001 - an EngineConfig without the method refuses it (TypeError/ValueError)
            why = f"{type(e).__name__}: {e}"
            log(f"note: skipping {c['name']}: EngineConfig refuses it ({why})")
            skipped.append({**c, "error": why})
        else:
            kept.append(c)
    return kept, skipped


def passages(tokenizer, count: int, lo: int = 150, hi: int = 300) -> list[str]:
    """`count` passages of lo..hi tokens: the Alpaca seed requests' reference answers of 40 tokens or more,
    in file order, joined by blank lines until a passage reaches `lo` tokens (cut at `hi`); cycled when
    the file runs out."""
    from bench.traces import read_alpaca

    answers = [r["reference_output"].strip() for r in read_alpaca()]
    answers = [a for a in answers if len(tokenizer(a).input_ids) >= 40]
    out, current, i = [], [], 0
    while len(out) < count:
        current.append(answers[i % len(answers)])
        i += 1
        ids = tokenizer("\n\n".join(current)).input_ids
        if len(ids) >= lo:
            out.append(tokenizer.decode(ids[:hi]).strip() if len(ids) > hi else "\n\n".join(current))
            current = []
    return out


def workloads(llm, count: int) -> dict:
    """Each workload's `count` chat-templated prompts, as token ids (tokenized once, outside every clock)."""
    from bench.traces import load_alpaca_prompts

    copy_msgs = [f"{COPY_TASKS[i % len(COPY_TASKS)]}\n\n{p}" for i, p in enumerate(passages(llm.tokenizer, count))]
    chat_msgs = load_alpaca_prompts()[:count]
    ids = lambda msgs: [llm.chat_prompt([{"role": "user", "content": m}])["prompt_token_ids"] for m in msgs]  # noqa: E731
    return {"copy": ids(copy_msgs), "chat": ids(chat_msgs)}


# ---------------------------------------------------------------- the closed loop

class Loop:
    """Runs closed loops on one engine; `timed_steps` collects the steps' `bench.clock.TimedStep`s
    while `clock` is set."""

    def __init__(self, engine):
        self.engine, self.clock, self.steps = engine, None, []
        self._ids = 0
        engine.add_observer(self._observe)

    def _observe(self, record) -> None:
        if self.clock is not None:
            self.steps.append(self.clock.observe(record))

    def run(self, prompts: list[list[int]], params, concurrency: int) -> dict:
        """`concurrency` requests in flight from the start, each finished one replaced by the next prompt."""
        engine = self.engine
        counts_before = copy.deepcopy(engine.spec_counts)
        self.steps = []
        pending = list(enumerate(prompts))[::-1]
        outputs, ids = {}, {}

        def add():
            i, ids_ = pending.pop()
            self._ids += 1
            ids[f"r{self._ids}"] = i
            engine.add_request(f"r{self._ids}", ids_, params)

        runner = engine.runner
        compile_s, compilations = runner.compile_seconds, runner.num_compilations
        start = time.perf_counter()
        for _ in range(min(concurrency, len(prompts))):
            add()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[ids[out.request_id]] = out
                    if pending:
                        add()
        # a compilation is never timed (round 0 should have built every executable: `compilations` says)
        compile_s = runner.compile_seconds - compile_s
        wall = time.perf_counter() - start - compile_s
        outs = [outputs[i] for i in range(len(prompts))]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(t) - 1)
                for o, t in zip(outs, tokens) if len(t) > 1]
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        after = engine.spec_counts
        spec = {k: ([a - b for a, b in zip(after[k], counts_before[k])] if isinstance(after[k], list)
                    else after[k] - counts_before[k]) for k in after}
        return dict(wall_s=wall, output_tokens=sum(map(len, tokens)), tokens=tokens, tpot_s=tpot, ttft_s=ttft, spec=spec,
                    errors=[o.error for o in outs if o.error], steps=self.steps, compile_s=compile_s,
                    compilations=runner.num_compilations - compilations)


# ---------------------------------------------------------------- jpaged

def run_jpaged(configs: list[dict], num_requests: dict, max_tokens: int, rounds: int, num_blocks: int,
               log=print) -> dict:
    import numpy as np

    from bench.clock import ShapeClock
    from jpaged import LLM, SamplingParams
    from jpaged.weights import load_model

    loaded = load_model(None)
    llms, runner = {}, None
    for c in configs:  # one runner for all: a shape compiles once, whichever engine meets it first
        kwargs = dict(loaded=loaded, num_blocks=num_blocks, max_num_seqs=max(CONCURRENCY), **c["engine"])
        try:
            llms[c["name"]] = LLM(runner=runner, **kwargs)
        except ValueError as e:  # a configuration whose runner cannot be shared gets its own
            log(f"note: {c['name']} cannot share the runner ({e}); it gets its own")
            llms[c["name"]] = LLM(**kwargs)
        runner = runner or llms[c["name"]].engine.runner
    names = list(llms)
    prompts = workloads(llms["off"], max(num_requests.values()))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    loops = {n: Loop(llms[n].engine) for n in names}
    clock = ShapeClock("wall")
    cells = [(w, c) for w in WORKLOADS for c in CONCURRENCY]
    runs = {n: {cell: [] for cell in cells} for n in names}  # timed rounds
    reference, identical = {}, {n: [0, 0] for n in names}  # off's tokens per cell; [identical, compared]
    for k in range(rounds + 1):  # round 0: untimed, compiles every executable the timed rounds run
        order = names if k % 2 == 1 or k == 0 else names[::-1]
        for name in order:
            loop = loops[name]
            loop.clock = clock if k > 0 else None
            for w, conc in cells:
                r = loop.run(prompts[w][:num_requests[conc]], params, conc)
                if r["errors"]:
                    raise RuntimeError(f"{name} {w} C={conc}: {r['errors'][0]}")
                if name == "off" and (w, conc) not in reference:
                    reference[(w, conc)] = r["tokens"]
                if (w, conc) in reference:  # off ran first in round 0 (and every later round compares to it)
                    same = sum(a == b for a, b in zip(r["tokens"], reference[(w, conc)]))
                    identical[name][0] += same
                    identical[name][1] += len(r["tokens"])
                if k > 0:
                    runs[name][(w, conc)].append(r)
                log(f"  round {k}{'' if k else ' (untimed)'} {name:<22} {w:<4} C={conc:<3} "
                    f"{r['output_tokens'] / r['wall_s']:7.1f} tokens/s, TPOT {1e3 * np.median(r['tpot_s']):6.1f} ms"
                    + (f", accepted {r['spec']['num_accepted']}/{r['spec']['num_proposed']}"
                       if r["spec"]["num_proposed"] else ""))
            loop.clock = None
    median = lambda xs: float(np.median(xs))  # noqa: E731
    results = {}
    for name in names:
        res = dict(engine=next(c["engine"] for c in configs if c["name"] == name),
                   attention_backend=llms[name].engine.runner.backend.name,
                   greedy_identical_to_off=identical[name][0] / identical[name][1],
                   greedy_requests_compared=identical[name][1], cells={}, acceptance={})
        for w in WORKLOADS:
            total = None
            for conc in CONCURRENCY:
                rs, offs = runs[name][(w, conc)], runs["off"][(w, conc)]
                speed = [r["output_tokens"] / r["wall_s"] for r in rs]
                tpot = [median(r["tpot_s"]) for r in rs]
                shape = [r["output_tokens"] / sum(clock.cost(s) for s in r["steps"]) for r in rs]
                off_speed = [r["output_tokens"] / r["wall_s"] for r in offs]
                off_tpot = [median(r["tpot_s"]) for r in offs]
                off_shape = [r["output_tokens"] / sum(clock.cost(s) for s in r["steps"]) for r in offs]
                spec = _sum_spec([r["spec"] for r in rs])
                total = spec if total is None else _sum_spec([total, spec])
                res["cells"][f"{w}/C={conc}"] = dict(
                    workload=w, concurrency=conc, num_requests=len(rs[0]["tokens"]),
                    output_tokens=rs[0]["output_tokens"],
                    mean_output_tokens=rs[0]["output_tokens"] / len(rs[0]["tokens"]),
                    tokens_per_s=median(speed), rounds_tokens_per_s=speed,
                    tpot_ms=1e3 * median(tpot), rounds_tpot_ms=[1e3 * t for t in tpot],
                    tpot_mean_ms=1e3 * median([np.mean(r["tpot_s"]) for r in rs]),
                    ttft_ms=1e3 * median([median(r["ttft_s"]) for r in rs]),
                    shape_clock_tokens_per_s=median(shape), rounds_shape_clock_tokens_per_s=shape,
                    speedup=median([a / b for a, b in zip(speed, off_speed)]),
                    rounds_speedup=[a / b for a, b in zip(speed, off_speed)],
                    tpot_speedup=median([b / a for a, b in zip(tpot, off_tpot)]),
                    shape_clock_speedup=median([a / b for a, b in zip(shape, off_shape)]),
                    acceptance=_acceptance(spec), wall_s=[r["wall_s"] for r in rs],
                    compilations_in_timed_rounds=sum(r["compilations"] for r in rs))
            res["acceptance"][w] = _acceptance(total)
        results[name] = res
    extra = dict(attention_backend=runner.backend.name, num_compilations=runner.num_compilations,
                 compile_seconds=runner.compile_seconds,
                 prompt_tokens={w: dict(mean=float(np.mean([len(p) for p in prompts[w][:max(num_requests.values())]])),
                                        max=max(len(p) for p in prompts[w]))
                                for w in WORKLOADS},
                 shared_runner=all(llm.engine.runner is runner for llm in llms.values()))
    reference = {f"{w}/C={c}": tokens for (w, c), tokens in reference.items()}
    return dict(results=results, jpaged=extra, prompts=prompts, reference=reference)


def _sum_spec(specs: list[dict]) -> dict:
    out = copy.deepcopy(specs[0])
    for s in specs[1:]:
        for k, v in s.items():
            out[k] = [a + b for a, b in zip(out[k], v)] if isinstance(v, list) else out[k] + v
    return out


def _acceptance(spec: dict) -> dict | None:
    if not spec.get("num_proposed"):
        return None
    proposed, accepted = spec.get("proposed_by_position", []), spec.get("accepted_by_position", [])
    return dict(num_proposed=spec["num_proposed"], num_accepted=spec["num_accepted"],
                acceptance_rate=spec["num_accepted"] / spec["num_proposed"],
                by_position=[a / p if p else None for a, p in zip(accepted, proposed)],
                proposed_by_position=proposed,
                # drafts accepted per step that drafted anything (a step that drafts proposes position 1)
                mean_accepted_per_drafting_step=spec["num_accepted"] / proposed[0] if proposed and proposed[0] else None)


# ---------------------------------------------------------------- vLLM (its own venv and process)

def _vllm_worker(spec_path: str, out_path: str) -> None:
    """In .venv-vllm: the off and ngram engines, both held at once, the same closed loops as jpaged's after a
    short untimed warm-up, their order alternating round by round; writes what it got (and any error) to
    out_path as it goes. Acceptance: vLLM's own spec_decode counters over the timed rounds."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec.get("kv_cache_space_gib", 1))
    for key, value in spec.get("env", {}).items():
        os.environ[key] = str(value)
    result = {"configs": {}, "env": {k: os.environ.get(k) for k in (
        "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")}}
    save = lambda: Path(out_path).write_text(json.dumps(result))  # noqa: E731
    import traceback
    try:
        import vllm
        from vllm import LLM, SamplingParams
        result["versions"] = {"vllm": vllm.__version__}
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
        return save()

    def spec_metrics(llm) -> dict:
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):  # summed over the engines' label sets (off drafts nothing)
                value = list(m.values) if hasattr(m, "values") else m.value
                prev = out.get(m.name)
                out[m.name] = value if prev is None else (
                    [a + b for a, b in zip(prev, value)] if isinstance(value, list) else prev + value)
        return out

    counter = [0]

    def loop(engine, prompts, conc, params):
        pending, outputs, ids = list(enumerate(prompts))[::-1], {}, {}

        def add():
            i, toks = pending.pop()
            counter[0] += 1
            ids[f"r{counter[0]}"] = i
            engine.add_request(f"r{counter[0]}", {"prompt_token_ids": toks}, params)

        start = time.perf_counter()
        for _ in range(min(conc, len(prompts))):
            add()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[ids[out.request_id]] = out
                    if pending:
                        add()
        return time.perf_counter() - start, [list(outputs[i].outputs[0].token_ids) for i in range(len(prompts))]

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"])
    warm = SamplingParams(temperature=0, max_tokens=8)
    llms = {}
    for cfg in spec["configs"]:
        entry = result["configs"][cfg["name"]] = {"engine_args": cfg["engine_args"], "cells": {}}
        try:
            t0 = time.perf_counter()
            llms[cfg["name"]] = LLM(model=spec["hf_dir"], dtype="float32", seed=0, max_model_len=spec["max_model_len"],
                                    enable_prefix_caching=False, max_num_seqs=max(spec["concurrency"]),
                                    disable_log_stats=False, **cfg["engine_args"])
            entry["load_s"] = time.perf_counter() - t0
            for w, prompts in spec["prompts"].items():  # untimed: vLLM's first steps of a batch size are slower
                for conc in spec["concurrency"]:
                    loop(llms[cfg["name"]].llm_engine, prompts[:spec["num_requests"][str(conc)]], conc, warm)
            entry["metrics_after_warm_up"] = spec_metrics(llms[cfg["name"]])
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            llms.pop(cfg["name"], None)
        save()
    names = list(llms)
    for k in range(1, spec["rounds"] + 1):
        for name in (names if k % 2 else names[::-1]):
            entry = result["configs"][name]
            try:
                for w, prompts in spec["prompts"].items():
                    for conc in spec["concurrency"]:
                        m0 = spec_metrics(llms[name])
                        wall, tokens = loop(llms[name].llm_engine, prompts[:spec["num_requests"][str(conc)]], conc,
                                            params)
                        m1 = spec_metrics(llms[name])
                        cell = entry["cells"].setdefault(f"{w}/C={conc}", {"rounds_wall_s": [], "spec_metrics": []})
                        cell["spec_metrics"].append([m0, m1])
                        cell["rounds_wall_s"].append(wall)
                        cell["output_tokens"], cell["tokens"] = sum(map(len, tokens)), tokens
                        print(f"[vllm] round {k} {name} {w} C={conc}: {cell['output_tokens'] / wall:.1f} tokens/s",
                              flush=True)
                        save()
                entry["metrics_end"] = spec_metrics(llms[name])
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"
                entry["traceback"] = traceback.format_exc()[-4000:]
            save()
    result["complete"] = True
    save()


def run_vllm(prompts: dict, num_requests: dict, max_tokens: int, rounds: int, max_model_len: int,
             timeout_s: float, log=print) -> dict:
    """vLLM's CPU build off and with its ngram speculation, in .venv-vllm; {"error": ...} when it cannot run."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    hf_dir = ROOT / "checkpoints" / "smollm2-hf"
    if not python.exists() or not (hf_dir / "model.safetensors").exists():
        return {"error": f"not set up ({python} or {hf_dir} missing): run bash bench/peers/setup_vllm.sh"}
    configs = [{"name": "off", "engine_args": {}},
               {"name": f"ngram K={NGRAM_K}", "engine_args": {"speculative_config": {
                   "method": "ngram", "num_speculative_tokens": NGRAM_K, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 4}}}]
    spec = dict(prompts=prompts, num_requests={str(k): v for k, v in num_requests.items()}, max_tokens=max_tokens,
                rounds=rounds, max_model_len=max_model_len, hf_dir=str(hf_dir), concurrency=list(CONCURRENCY),
                kv_cache_space_gib=1, configs=configs, env={"VLLM_LOGGING_LEVEL": "WARNING"})
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [str(python), str(Path(__file__).resolve()), "--vllm-worker", str(spec_path), str(out_path)]
        log(f"--- vLLM: {' '.join(cmd[:2])} (timeout {timeout_s:.0f} s)")
        tail = []
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}, start_new_session=True)
        deadline, timed_out = time.perf_counter() + timeout_s, False
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-80:]
            if line.startswith("[vllm]"):
                log("   " + line.rstrip())
            if time.perf_counter() > deadline:
                timed_out = True
                break
        if proc.poll() is None:
            try:
                proc.wait(timeout=max(deadline - time.perf_counter(), 1))
            except subprocess.TimeoutExpired:
                timed_out = True
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the worker's own session: it and vLLM's engine-core children
                proc.wait()
        result = json.loads(out_path.read_text()) if out_path.exists() else {}
    if timed_out:
        result["error"] = f"timed out after {timeout_s:.0f} s"
    if proc.returncode and "error" not in result and not result.get("complete"):
        result["error"] = f"exit status {proc.returncode}: " + " | ".join(
            t for t in tail[-12:] if t.strip())[-2000:]
    result["returncode"] = proc.returncode
    return result


def _vllm_acceptance(pairs: list) -> dict | None:
    """Acceptance from vLLM's spec_decode counters, summed over (before, after) snapshots of timed loops."""
    import numpy as np

    def total(key):
        return sum((np.asarray(b.get(key, 0), float) - np.asarray(a.get(key, 0), float) for a, b in pairs),
                   np.zeros(()))

    drafts, proposed = float(total("vllm:spec_decode_num_drafts")), float(total("vllm:spec_decode_num_draft_tokens"))
    if not proposed:
        return None
    accepted = float(total("vllm:spec_decode_num_accepted_tokens"))
    per_pos = np.atleast_1d(total("vllm:spec_decode_num_accepted_tokens_per_pos"))
    return dict(num_drafts=drafts, num_proposed=proposed, num_accepted=accepted, acceptance_rate=accepted / proposed,
                by_position=(per_pos / drafts).tolist() if drafts else None,
                by_position_definition="vLLM's: tokens accepted at position j over drafts (steps that drafted)")


def vllm_summary(raw: dict, jpaged_off: dict) -> dict:
    """vLLM's tokens/s per cell (median round), its ngram speedup round by round, its acceptance over the timed
    rounds (its counters: accepted / draft tokens; by position: accepted at j / drafts), and whether its greedy
    tokens equal its own off run's and jpaged's off run's."""
    import numpy as np

    out = {k: raw[k] for k in ("error", "versions", "returncode", "env") if k in raw}
    configs = raw.get("configs", {})
    for name, entry in configs.items():
        summary = {k: entry[k] for k in ("engine_args", "load_s", "error", "traceback") if k in entry}
        summary["acceptance"] = {}
        for w in WORKLOADS:  # vLLM's counters read before and after each timed loop
            pairs = [pair for key, cell in entry.get("cells", {}).items() if key.startswith(f"{w}/")
                     for pair in cell.get("spec_metrics", [])]
            acc = _vllm_acceptance(pairs)
            if acc:
                summary["acceptance"][w] = acc
        cells = {}
        for key, cell in entry.get("cells", {}).items():
            speed = [cell["output_tokens"] / w for w in cell["rounds_wall_s"]]
            c = dict(tokens_per_s=float(np.median(speed)), rounds_tokens_per_s=speed, output_tokens=cell["output_tokens"])
            off = configs.get("off", {}).get("cells", {}).get(key)
            if off and name != "off":
                off_speed = [off["output_tokens"] / w for w in off["rounds_wall_s"]]
                ratios = [a / b for a, b in zip(speed, off_speed)]
                c.update(speedup=float(np.median(ratios)), rounds_speedup=ratios,
                         greedy_identical_to_vllm_off=float(np.mean([a == b for a, b in zip(cell["tokens"], off["tokens"])])))
            if jpaged_off.get(key) is not None:
                c["greedy_identical_to_jpaged_off"] = float(np.mean([a == b for a, b in zip(cell["tokens"], jpaged_off[key])]))
            cells[key] = c
        summary["cells"] = cells
        out[name] = summary
    return out


# ---------------------------------------------------------------- report

def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = out["results"]
    vllm = {k: v for k, v in out.get("vllm", {}).items() if isinstance(v, dict) and v.get("cells")}
    bars = [(n, r) for n, r in results.items()] + [(f"vLLM {n}", v) for n, v in vllm.items()]
    colors = {label: f"C{j}" for j, (label, _) in enumerate(bars)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(bars)
    x = np.arange(len(CONCURRENCY))
    for ax, w in zip(axes, WORKLOADS):
        for j, (label, r) in enumerate(bars):
            cells = [r["cells"].get(f"{w}/C={c}") for c in CONCURRENCY]
            acc = r.get("acceptance", {}).get(w)
            tag = f" (accepted {acc['acceptance_rate']:.2f})" if acc else ""
            rects = ax.bar(x + (j - (len(bars) - 1) / 2) * width, [c["tokens_per_s"] if c else 0 for c in cells], width,
                           label=label + tag, color=colors[label], hatch="//" if label.startswith("vLLM") else None)
            for rect, c in zip(rects, cells):
                if c and "speedup" in c and not label.endswith("off"):
                    ax.text(rect.get_x() + rect.get_width() / 2, rect.get_height(), f"{c['speedup']:.2f}x",
                            ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(x, [f"C={c}" for c in CONCURRENCY])
        ax.set_ylabel("output tokens / s (greedy)")
        ax.set_title(f"{w}: {'repeat / correct / rewrite / summarize a passage' if w == 'copy' else 'Alpaca chats'}"
                     " (x: against off, same engine)", fontsize=9)
        ax.margins(y=0.2)
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[2]
    for label, r in bars:
        for w, style in zip(WORKLOADS, ("-o", "--s")):
            acc = r.get("acceptance", {}).get(w)
            if acc and acc.get("by_position"):
                ax.plot(range(1, len(acc["by_position"]) + 1), acc["by_position"], style, color=colors[label],
                        label=f"{label}, {w}")
    ax.set_xlabel("draft position")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("accepted at the position / drafted there")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    cpu = out["machine"].get("cpu", {})
    fig.suptitle(f"speculative decoding, SmolLM2-135M f32, closed loops of C requests; {cpu.get('model_name')}, "
                 f"{cpu.get('nproc')} cores; median of {out['settings']['rounds']} alternating rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(out: dict) -> None:
    cpu = out["machine"].get("cpu", {})
    print(f"{cpu.get('model_name')}, {cpu.get('nproc')} cores; load average {out['loadavg_start']} -> "
          f"{out['loadavg_end']}")
    print(f"{'config':<24}{'workload':<9}{'C':>3}{'tok/s':>8}{'x off':>7}{'TPOT ms':>9}{'x off':>7}{'TTFT ms':>9}"
          f"{'shape x':>8}{'accept':>8}  by position; x off round by round")
    for name, r in out["results"].items():
        for key, c in r["cells"].items():
            acc = c["acceptance"]
            print(f"{name:<24}{c['workload']:<9}{c['concurrency']:>3}{c['tokens_per_s']:8.1f}{c['speedup']:7.2f}"
                  f"{c['tpot_ms']:9.1f}{c['tpot_speedup']:7.2f}{c['ttft_ms']:9.0f}{c['shape_clock_speedup']:8.2f}"
                  f"{acc['acceptance_rate'] if acc else float('nan'):8.2f}  "
                  f"{' '.join(f'{p:.2f}' for p in acc['by_position']) if acc else '-'}; "
                  f"{' '.join(f'{s:.2f}' for s in c['rounds_speedup'])}")
        print(f"{'':<24}greedy identical to off: {r['greedy_identical_to_off']:.3f} "
              f"({r['greedy_requests_compared']} requests)")
    for name in out.get("skipped", []):
        print(f"skipped: {name['name']}: {name['error']}")
    v = out.get("vllm", {})
    if v.get("error"):
        print(f"vLLM: {v['error']}")
    for name, entry in v.items():
        if isinstance(entry, dict) and "cells" in entry:
            if entry.get("error"):
                print(f"vLLM {name}: {entry['error']}")
            for key, c in entry["cells"].items():
                w = key.split("/")[0]
                acc = entry.get("acceptance", {}).get(w)
                print(f"vLLM {name:<19}{key:<14}{c['tokens_per_s']:8.1f}"
                      + (f"{c['speedup']:7.2f}" if "speedup" in c else "")
                      + (f"  accept {acc['acceptance_rate']:.2f} by position "
                         f"{' '.join(f'{p:.2f}' for p in acc['by_position'] or [])}" if acc else "")
                      + "".join(f"  identical to {k[len('greedy_identical_to_'):]} {v:.2f}" for k, v in c.items()
                                if k.startswith("greedy_identical")))


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--vllm-worker"]:
        return _vllm_worker(*argv[1:3])
    from bench import common

    parser = common.bench_parser(__doc__.splitlines()[0],
                                 "requests per loop 4 / 4 / 16 at C = 1 / 4 / 16, 64 tokens, 2 rounds, one draft-layers L "
                                 "(a third of the layers), no vLLM")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; --quick 2)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens at most (default 128; --quick 64)")
    parser.add_argument("--draft-layers", type=int, nargs="*", default=None,
                        help="draft-layers L values (default: a third and a half of the layers; --quick: a third)")
    parser.add_argument("--methods", default="off,ngram,draft-layers",
                        help="comma-separated subset of off,ngram,draft-layers (off is always run: the reference)")
    parser.add_argument("--name", default=None, help="results file stem (default speculative, --quick speculative_quick)")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                        help="run vLLM's CPU build off and with ngram in .venv-vllm (default: on; --quick: off, as its "
                             "two engines take 3-5 minutes more)")
    parser.add_argument("--vllm-rounds", type=int, default=None, help="vLLM's timed rounds (default: --rounds; --quick 1)")
    parser.add_argument("--vllm-timeout", type=float, default=900, help="seconds for the whole vLLM subprocess")
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    start = time.perf_counter()
    loadavg_start = list(os.getloadavg())
    quick = args.quick
    # every loop's requests are the workload's first N, and N >= 4 gives each of the four copy tasks at least once
    num_requests = {1: 4, 4: 4, 16: 16} if quick else {1: 4, 4: 8, 16: 32}
    rounds = args.rounds or (2 if quick else 3)
    max_tokens = args.max_tokens or (64 if quick else 128)
    machine = common.machine_info()
    log = lambda s: print(s, flush=True)  # noqa: E731
    from jpaged.weights import read_config

    num_layers = read_config(None).num_layers
    draft_layers = args.draft_layers or ([num_layers // 3] if quick else None)
    configs, skipped = configurations(num_layers, draft_layers, log=log)
    methods = set(args.methods.split(",")) | {"off"}
    configs = [c for c in configs if c["engine"].get("speculative_method", "off") in methods]
    max_prompt = 360  # a passage of at most 300 tokens, its task and the chat template's system prompt
    max_model_len = 2048
    blocks_per_seq = -(-(max_prompt + max_tokens + max(NGRAM_K, DRAFT_K) + 1) // 16) + 1
    num_blocks = max(CONCURRENCY) * blocks_per_seq + 16
    jp = run_jpaged(configs, num_requests, max_tokens, rounds, num_blocks, log=log)
    prompts, reference = jp.pop("prompts"), jp.pop("reference")
    too_long = max(len(p) for w in WORKLOADS for p in prompts[w]) > max_prompt
    if too_long:
        log(f"note: a prompt is longer than {max_prompt} tokens (the pool was sized for that)")
    out = dict(benchmark="speculative", machine=machine, loadavg_start=loadavg_start,
               settings=dict(num_requests_per_loop={str(k): v for k, v in num_requests.items()},
                             concurrency=list(CONCURRENCY), rounds=rounds, max_tokens=max_tokens, greedy=True,
                             ignore_eos=False, num_blocks=num_blocks, block_size=16, dtype="float32",
                             model="SmolLM2-135M-Instruct (the embedded default)", num_layers=num_layers,
                             loop="closed: C requests in flight, each finished one replaced by the next",
                             copy_tasks=list(COPY_TASKS), methods=sorted(methods), compile_cache=args.compile_cache,
                             clocks="wall (compilation subtracted; none expected after round 0) and the shape-median "
                                    "clock (bench/clock.py)"),
               configs=configs, skipped=skipped, **jp)
    if not (args.vllm if args.vllm is not None else not quick):
        out["vllm"] = {"error": "not run (--no-vllm, or --quick without --vllm)"}
    else:
        vllm_rounds = args.vllm_rounds or (1 if quick else rounds)
        raw = run_vllm(prompts, num_requests, max_tokens, vllm_rounds, max_model_len, args.vllm_timeout, log=log)
        out["vllm"] = vllm_summary(raw, reference)
    out["loadavg_end"] = list(os.getloadavg())
    return common.report(out, args.out, args.name or common.results_stem("speculative", quick), start, plot, print_table)


if __name__ == "__main__":
    main()
