"""Throughput and latency: PagedAttention vs the Orca baselines, in the same engine (paper, 6.2, Fig. 12).

Every system is the real `LLMEngine` on the real default model (SmolLM2-135M, float32) with the
same scheduler, kernels and KV pool; only memory management differs (the engine's
`kv_cache_manager`): paged blocks, or one contiguous buddy run per request sized by Orca(Max) /
Orca(Pow2) / Orca(Oracle) (`bench.baselines.orca`: they know each request's output length through
an oracle, and run without the scheduler's watermark). One `ModelRunner` (parameters, KV pool,
compiled step shapes) serves every run (`LLMEngine(..., runner=...)`), so a shape compiles once.
Every system schedules as the paper's vLLM did (`enable_chunked_prefill=False`: each step a prefill
of whole prompts or a decode), so that these results stay comparable with the paper's and with
those published before the ragged step became jpaged's default.

Workload: token-id prompts of exact lengths drawn from `bench/traces.py` (log-normal fits of the
paper's ShareGPT / Alpaca means), `SamplingParams(temperature=0, max_tokens=output_len,
ignore_eos=True)`: every request generates exactly its trace output length. KV budget: 12,288
token slots (768 blocks of 16, `num_blocks=769` with the null block), `max_model_len=2048`.
`--scale S` shrinks the experiment as a whole: mean lengths, `max_model_len` and the pool all
divided by S, so requests per pool and the reservation ratios stay those of the full experiment
while every step gets cheaper (the quick preset is the ShareGPT-like trace at S=8).

Clock: simulated. Each step is charged its host CPU seconds plus the median CPU seconds of its
padded model-step shape over the benchmark so far (`--clock cpu`, the default: robust to the other
processes on a shared machine; see `Bench` and `bench/clock.py`), or its wall seconds (`--clock
wall`); compilation and the engine's usage statistics are excluded (the engine's `StepRecord`s
leave them out).
Requests join when the clock passes their arrival time; when nothing is queued or running the
clock jumps to the next arrival, so an idle gap costs no real time. Offline results (whose schedule
does not depend on the clock) also give the shape-min clock (each shape charged its fastest run: a
noisy stretch of the benchmark moves the medians, far less the minima) and wall-clock figures, each
with paged's ratios; the load average at the start is recorded.

(a) Offline: all requests at t=0; output tokens/s and requests/s over the makespan.
(b) Online: Poisson arrivals at increasing rates (requests/s of the simulated clock, a geometric
grid from half of Orca(Max)'s offline request rate to 1.25x paged's, unless `--rates`); the
normalized latency (end-to-end latency / output length; mean, p50, p90) per rate, as in Fig. 12.
A system *sustains* a rate when its mean normalized latency stays within 2x its value at the
lowest rate tried; once a system fails a rate, its higher rates are not run.
KV utilization: token states held / KV slots allocated (reserved, for Orca), weighted by step
duration over the steps that hold anything; `engine_kv_utilization` is `engine.stats()`'s.

    python bench/throughput.py --quick            # 32 requests, offline only (see PRESETS for times)
    python bench/throughput.py --preset mini      # the whole protocol on the 1/8 miniature
    python bench/throughput.py                    # the whole protocol at the paper's scale
    python bench/throughput.py --traces sharegpt_like --rates-from RESULT.json
                                                  # its Poisson sweep alone, the rate grid from a saved
                                                  # offline run (RESULT: e.g. throughput_full_sharegpt_offline.json)

Results: `throughput.json` / `.png` for --quick, `throughput_<preset>.*` for the other presets.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench import traces as traces_lib  # noqa: E402
from bench.baselines.orca import POLICIES, orca  # noqa: E402
from bench.clock import ShapeClock, TimedStep  # noqa: E402

SYSTEMS = ("paged", *POLICIES)  # paged, orca_max, orca_pow2, orca_oracle
BLOCK_SIZE = 16
POOL_SLOTS = 12288
TRACE_PARAMS = dict(sharegpt_like=traces_lib.SHAREGPT, alpaca_like=traces_lib.ALPACA)
TOKEN_ID_RANGE = (1000, 40000)  # ordinary vocabulary tokens (SmolLM2's specials are < 50)

# Time on the 2-core development machines with the packed / tiled attention path: quick 2 min,
# mini 21 min (measured). full, run in parts (README): offline ShareGPT-like 43 min, offline
# Alpaca-like 17 min, the Poisson sweeps for paged and Orca(Max) at 4 rates 71 min (ShareGPT-like)
# and 24 min (Alpaca-like); a low-rate run costs more than an offline one (small batches). The whole
# preset (every system, 5 rates, both traces) is estimated at 5 hours on 2 cores: run it on a bigger
# machine, or run mini.
# Requests per trace: enough that memory binds most of a run. The longest request still sets a floor
# on the makespan (at full scale the Alpaca-like trace's 1,510-token output took most of paged's
# 1,528 decode steps); `backlogged_output_tokens_per_s` measures the phase where memory binds.
PRESETS = {
    "quick": dict(scale=8, offline={"sharegpt_like": 32}, online={}, num_rates=0),
    "mini": dict(scale=8, offline={"sharegpt_like": 128}, online={"sharegpt_like": 96}, num_rates=5),
    "full": dict(scale=1, offline={"sharegpt_like": 128, "alpaca_like": 512},
                 online={"sharegpt_like": 96, "alpaca_like": 256}, num_rates=5),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One trace ready to serve: lengths, token-id prompts, arrival times (seconds)."""

    name: str
    requests: tuple  # traces_lib.TraceRequest
    prompts: tuple  # token-id tuples of exactly prompt_len tokens
    max_model_len: int

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def with_arrivals(self, times) -> "Workload":
        return dataclasses.replace(self, requests=tuple(traces_lib.with_arrivals(list(self.requests), times)))

    def describe(self) -> dict:
        p = np.array([r.prompt_len for r in self.requests])
        o = np.array([r.output_len for r in self.requests])
        return dict(num_requests=len(p), mean_prompt=float(p.mean()), mean_output=float(o.mean()),
                    max_prompt=int(p.max()), max_output=int(o.max()), max_total=int((p + o).max()),
                    num_output_tokens=int(o.sum()), max_model_len=self.max_model_len)


def make_workload(name: str, num: int, seed: int, scale: int) -> Workload:
    """`num` requests of trace `name` with means and `max_model_len` divided by `scale`."""
    params = dict(TRACE_PARAMS[name])
    params["mean_in"] /= scale
    params["mean_out"] /= scale
    max_model_len = traces_lib.MAX_MODEL_LEN // scale
    requests = traces_lib.lognormal_trace(num, seed, max_model_len=max_model_len, **params)
    rng = np.random.default_rng(seed + 10_000)
    prompts = tuple(tuple(int(t) for t in rng.integers(*TOKEN_ID_RANGE, r.prompt_len)) for r in requests)
    return Workload(name, tuple(requests), prompts, max_model_len)


# ---- serving one workload on one system ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Step:
    """One engine step as the benchmark saw it (times exclude compilation and engine statistics)."""

    kind: str  # "decode", "prefill" or "empty" (no model step)
    timed: TimedStep  # on the CPU shape clock: host CPU seconds, and the model step's and sampler's
    wall: float  # wall seconds of `engine.step()`
    start: float  # the clock when it began
    cost: float  # what the clock advanced by
    new_tokens: int  # tokens sampled (one per row)
    computed_tokens: int  # tokens whose K/V the step computed (a prefill's prompts), unpadded
    padded_tokens: int  # the same, padded to the step's shape bucket
    running: int  # requests running after it
    token_slots: int  # KV slots holding token states after it
    used_slots: int  # KV slots allocated (reserved) after it
    backlogged: bool  # a request was waiting after it was scheduled
    finished: tuple  # request ids that finished in it


class Bench:
    """The loaded model, the one `ModelRunner` every engine shares, and the clock.

    Clock `cpu` (the default): a step costs the CPU seconds (all threads) the process spent in it
    outside the model step and sampler (scheduling, block manager, packing, detokenization), plus
    the median CPU seconds of the model step and sampler over every run of its shape in the whole
    benchmark (`bench.clock.ShapeClock`): pooling runs of a shape across systems charges systems
    that run the same shapes the same. Offline runs, whose schedule does not depend on the clock,
    are re-costed with the final medians. Clock `wall`: a step costs its measured wall duration.
    Either way compilation is excluded (the engine's step records leave it out, and a new
    executable's first run with it), and so is the engine's own statistics bookkeeping.
    """

    def __init__(self, num_blocks: int, dtype: str = "float32", clock: str = "cpu"):
        import jax.numpy as jnp

        from jpaged.weights import load_model

        if clock not in ("cpu", "wall"):
            raise ValueError(f"clock must be 'cpu' or 'wall', got {clock!r}")
        self.num_blocks, self.dtype, self.clock = num_blocks, dtype, clock
        self.pool_slots = (num_blocks - 1) * BLOCK_SIZE
        with common.Stopwatch() as sw:
            self.model = load_model(None, dtype=getattr(jnp, dtype))
        self.load_seconds = sw.seconds
        self.runner = None
        self.shapes = ShapeClock(time="cpu")

    def step_cost(self, step: Step, stat: str = "median") -> float:
        return step.wall if self.clock == "wall" else self.shapes.cost(step.timed, stat)

    def recost(self, workload: Workload, steps: list, stat: str = "median") -> dict:
        """An offline run's metrics under the final cost table (its schedule ignores the clock);
        `stat="min"` charges each shape its fastest run instead of its median (the shape-min clock)."""
        return offline_metrics(workload, steps, [self.step_cost(st, stat) for st in steps], self.pool_slots)

    def warm_up(self, max_rows: int, max_model_len: int) -> dict:
        """Compiles the decode shapes a run is likely to use (padded rows up to `max_rows`, block
        tables up to `max_model_len`, rows x table width at most 4x the pool) on rows that read and
        write only the null block. Other shapes (prefill ones are too many to enumerate) compile
        when first seen, off the clock."""
        from jpaged.core.kv_cache_manager import blocks_for
        from jpaged.core.scheduler import Row
        from jpaged.device.batch import bucket, row_bucket
        from jpaged.device.runner import SampleRow

        runner = self.runner
        compile_before, start_all = runner.compile_seconds, time.perf_counter()
        widths = [w for w in (1 << k for k in range(2, 16)) if w <= bucket(blocks_for(max_model_len, BLOCK_SIZE), 4)]
        shapes = [(num_rows, width) for num_rows in sorted({row_bucket(n) for n in range(1, max_rows + 1)})
                  for width in widths if num_rows * width <= max(4 * (self.num_blocks - 1), 64)]
        for num_rows, width in shapes:
            rows = [Row([1], width * BLOCK_SIZE - 1, [0], [0] * width)] * num_rows
            sample_rows = [SampleRow(i, 0.0, 0, 1.0, 0, 0, 0) for i in range(num_rows)]
            runner.sample(runner.execute(rows, decode=True), sample_rows, 1)
        return dict(seconds=time.perf_counter() - start_all, compile_seconds=runner.compile_seconds - compile_before,
                    shapes=len(shapes))

    def engine(self, system: str, max_model_len: int, output_lens: dict):
        """An engine for `system` on the shared runner (the first one builds it). The Orca baselines
        get the oracle `output_lens` and no watermark (`bench.baselines.orca`)."""
        from jpaged.engine import EngineConfig, LLMEngine

        config = EngineConfig(num_blocks=self.num_blocks, block_size=BLOCK_SIZE, dtype=self.dtype,
                              max_model_len=max_model_len, enable_chunked_prefill=False)  # the paper's policy
        if system == "paged":
            engine = LLMEngine(config, loaded=self.model, runner=self.runner)
        else:
            engine = LLMEngine(config, loaded=self.model, runner=self.runner, watermark=0.0,
                               kv_cache_manager=orca(system, output_lens))
        self.runner = engine.runner
        return engine

    def serve(self, system: str, workload: Workload) -> dict:
        """Runs `workload` on `system`; returns the run's metrics, with its steps under "steps_log"."""
        from jpaged.core.sampling_params import SamplingParams

        output_lens = {workload.prompts[r.request_id]: r.output_len for r in workload.requests}
        engine = self.engine(system, workload.max_model_len, output_lens)
        records = []
        engine.add_observer(records.append)
        runner = self.runner
        pending = collections.deque(sorted(workload.requests, key=lambda r: (r.arrival_time, r.request_id)))
        outputs, steps, clock = {}, [], 0.0
        compile_before = runner.compile_seconds
        wall_start = time.perf_counter()
        while pending or engine.has_unfinished():
            while pending and pending[0].arrival_time <= clock:
                r = pending.popleft()
                engine.add_request(str(r.request_id), list(workload.prompts[r.request_id]),
                                   SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True),
                                   arrival_time=r.arrival_time)
            if not engine.has_unfinished():
                clock = pending[0].arrival_time
                continue
            outs = engine.step()
            record = records[-1]
            outputs.update((o.request_id, o.outputs[0]) for o in outs if o.finished)
            kv = record.kv
            used = (kv.num_blocks - 1 - kv.num_free_blocks) * BLOCK_SIZE
            tokens = sum(kv.num_tokens(s) for s in kv.seq_ids) if used else 0
            step = Step(record.kind or "empty", self.shapes.observe(record), record.seconds, clock, 0.0,
                        record.num_sampled_tokens, record.num_computed_tokens, record.num_padded_tokens,
                        record.num_running, tokens, used, record.num_waiting > 0, record.finished)
            step = dataclasses.replace(step, cost=self.step_cost(step))
            steps.append(step)
            clock += step.cost
        by_id = {str(r.request_id): r for r in workload.requests}
        for rid, out in outputs.items():  # every request generates exactly its trace length
            assert len(out.token_ids) == by_id[rid].output_len and out.finish_reason == "length", (rid, out)
        assert len(outputs) == len(workload.requests)
        stats = engine.stats()
        decode = [st.new_tokens for st in steps if st.kind == "decode"]
        prefill = [st for st in steps if st.kind == "prefill"]
        return dict(
            **metrics(workload, steps, [st.start for st in steps], [st.cost for st in steps], self.pool_slots),
            system=system, num_requests=len(workload.requests), clock=self.clock,
            engine_kv_utilization=stats["kv_utilization"], peak_used_blocks=stats["peak_used_blocks"],
            num_preemptions=stats["num_preemptions"], num_steps=len(steps),
            mean_decode_batch=float(np.mean(decode)) if decode else None,
            prefill_tokens=sum(st.computed_tokens for st in prefill),
            prefill_padded_tokens=sum(st.padded_tokens for st in prefill),
            compile_seconds=runner.compile_seconds - compile_before,
            wall_seconds=time.perf_counter() - wall_start,
            token_ids_digest=[hash(tuple(outputs[str(i)].token_ids)) for i in range(len(workload.requests))],
            steps_log=steps)


def metrics(workload: Workload, steps: list, starts: list, costs: list, pool_slots: int) -> dict:
    """Throughput, normalized latency, concurrency and KV utilization of one run, given each
    step's start time and cost."""
    finish = {rid: start + cost for st, start, cost in zip(steps, starts, costs) for rid in st.finished}
    by_id = {str(r.request_id): r for r in workload.requests}
    first_arrival = min(r.arrival_time for r in workload.requests)
    end = max(finish.values())
    makespan = end - first_arrival
    normalized = [(finish[rid] - r.arrival_time) / r.output_len for rid, r in by_id.items()]
    costs = np.asarray(costs)
    held = np.array([st.used_slots > 0 for st in steps])
    tokens = np.array([st.token_slots for st in steps], dtype=float)
    used = np.array([st.used_slots for st in steps], dtype=float)
    backlogged = np.array([st.backlogged for st in steps])
    new_tokens = np.array([st.new_tokens for st in steps])
    kinds = collections.Counter(st.kind for st in steps)
    return dict(
        makespan_s=makespan, output_tokens_per_s=workload.num_output_tokens / makespan,
        requests_per_s=len(by_id) / makespan,
        backlogged_output_tokens_per_s=(float(new_tokens[backlogged].sum() / costs[backlogged].sum())
                                        if backlogged.any() else None),
        backlogged_fraction=float(costs[backlogged].sum() / costs.sum()),
        normalized_latency=common.summarize(normalized),
        latency_s=common.summarize(finish[rid] - r.arrival_time for rid, r in by_id.items()),
        peak_running=max(st.running for st in steps),
        mean_running=float(sum(st.running * c for st, c in zip(steps, costs)) / (end - min(starts))),
        kv_utilization=float((tokens * costs).sum() / (used * costs).sum()) if held.any() else None,
        kv_token_fraction_of_pool=(float((tokens * costs).sum() / (costs[held].sum() * pool_slots))
                                   if held.any() else None),
        steps=dict(kinds), step_seconds={k: float(sum(c for st, c in zip(steps, costs) if st.kind == k))
                                         for k in kinds},
        cpu_seconds=float(sum(st.timed.host + st.timed.device for st in steps)),
        wall_seconds_in_steps=float(sum(st.wall for st in steps)),
        device_cpu_seconds=float(sum(st.timed.device for st in steps)),
    )


def offline_metrics(workload: Workload, steps: list, costs: list, pool_slots: int) -> dict:
    """`metrics` of an offline run (every request at t=0) whose steps ran back to back at `costs`."""
    assert all(r.arrival_time == 0 for r in workload.requests)
    return metrics(workload, steps, list(np.cumsum([0.0] + costs[:-1])), costs, pool_slots)


# ---- the experiment ----------------------------------------------------------------------------

def rate_grid(offline: dict, num_rates: int) -> list[float]:
    """Geometric grid from half Orca(Max)'s offline request rate to 1.25x paged's (requests/s)."""
    lo = 0.5 * offline["orca_max"]["requests_per_s"]
    hi = 1.25 * offline["paged"]["requests_per_s"]
    if num_rates == 1:
        return [lo]
    return [float(lo * (hi / lo) ** (k / (num_rates - 1))) for k in range(num_rates)]


def sustained(points: list[dict]) -> float | None:
    """Highest rate whose mean normalized latency, and every lower rate's, is within 2x the lowest's."""
    if not points:
        return None
    base, best = points[0]["normalized_latency"]["mean"], None
    for p in points:
        if p.get("skipped") or p["normalized_latency"]["mean"] > 2 * base:
            break
        best = p["rate"]
    return best


def ratios(by_system: dict, key) -> dict:
    """paged's value over each other system's (empty without paged)."""
    if "paged" not in by_system:
        return {}
    paged = key(by_system["paged"])
    return {s: (paged / key(r) if paged is not None and key(r) else None)
            for s, r in by_system.items() if s != "paged"}


def saved_offline(path: Path, scale: int, online: dict) -> dict:
    """The offline results, per trace, of an earlier run saved at `path`, for the traces of `online`
    it covers: the Poisson sweep takes its rate grid from them instead of running them again.
    The earlier run must be at the same scale, with the same KV pool."""
    saved = json.loads(Path(path).read_text())
    settings = saved["settings"]
    if settings["scale"] != scale or settings["pool_slots"] != POOL_SLOTS // scale:
        raise ValueError(f"{path} was run at scale 1/{settings['scale']} with {settings['pool_slots']} KV slots, "
                         f"this run is at scale 1/{scale}: give --scale {settings['scale']} or another file")
    found = {name: {system: dict(r, source=str(path)) for system, r in results.items()}
             for name, results in saved["offline"].items() if name in online}
    if not found:
        raise ValueError(f"{path} has offline results for {sorted(saved['offline'])}, none of this run's "
                         f"Poisson traces {sorted(online)}: choose them with --traces")
    for name, results in found.items():
        missing = {"paged", "orca_max"} - set(results)
        if missing:
            raise ValueError(f"{path} lacks the offline {name} run of {sorted(missing)}, which the rate grid needs")
    return found


def run(preset: str = "quick", scale: int | None = None, systems=SYSTEMS, seed: int = 0,
        rates: list[float] | None = None, num_rates: int | None = None, requests: int | None = None,
        clock: str = "cpu", traces: tuple | None = None, rates_from: Path | None = None, log=print) -> dict:
    """Runs the preset (offline, then the Poisson sweep) and returns the results. `rates_from`: a
    saved result whose offline runs give the rate grid of the traces it covers (`saved_offline`);
    those offline runs are not repeated and are copied, marked with their `source`, into the result."""
    cfg = dict(PRESETS[preset])
    scale = scale or cfg["scale"]
    num_rates = cfg["num_rates"] if num_rates is None else num_rates
    offline_sizes, online_sizes = dict(cfg["offline"]), dict(cfg["online"])
    if traces is not None:  # a subset of the preset's traces
        offline_sizes = {k: v for k, v in offline_sizes.items() if k in traces}
        online_sizes = {k: v for k, v in online_sizes.items() if k in traces}
    if requests:
        offline_sizes = {k: requests for k in offline_sizes}
        online_sizes = {k: requests for k in online_sizes}
    if rates is not None and not online_sizes:
        online_sizes = dict(offline_sizes)
    if num_rates == 0 and rates is None:
        online_sizes = {}
    reused = saved_offline(rates_from, scale, online_sizes) if rates_from is not None else {}
    offline_sizes = {k: v for k, v in offline_sizes.items() if k not in reused}
    if online_sizes and rates is None and not {"paged", "orca_max"} <= set(systems):
        raise ValueError("the default rate grid comes from paged's and orca_max's offline runs: "
                         "run both, or give --rates")
    pool_slots = POOL_SLOTS // scale
    num_blocks = pool_slots // BLOCK_SIZE + 1
    seeds = dict(trace={n: seed + k for k, n in enumerate(TRACE_PARAMS)},
                 prompt_token_ids="trace seed + 10000", poisson="seed + 100 + 10 * trace index + rate index")
    out = dict(preset=preset, settings=dict(
        scale=scale, pool_slots=pool_slots, num_blocks=num_blocks, block_size=BLOCK_SIZE,
        max_model_len=traces_lib.MAX_MODEL_LEN // scale, systems=list(systems), dtype="float32",
        model="SmolLM2-135M-Instruct (default)", offline_requests=offline_sizes,
        online_requests=online_sizes, num_rates=num_rates, rates=rates,
        offline_reused_from=str(rates_from) if reused else None,
        sampling="temperature=0, max_tokens=output_len, ignore_eos=True",
        trace_params={n: {**p, "mean_in": p["mean_in"] / scale, "mean_out": p["mean_out"] / scale}
                      for n, p in TRACE_PARAMS.items()},
        clock=clock, clock_doc=Bench.__doc__.split("\n\n")[1].replace("\n    ", " ").strip(),
        sustained="mean normalized latency <= 2x its value at the lowest rate"), seeds=seeds,
        machine=common.machine_info(), traces={}, offline={}, online={}, summary={})
    bench = Bench(num_blocks, clock=clock)
    out["model_load_seconds"] = bench.load_seconds
    log(f"model loaded in {bench.load_seconds:.0f} s; pool {num_blocks} blocks of {BLOCK_SIZE}, "
        f"max_model_len {traces_lib.MAX_MODEL_LEN // scale}, clock {clock}")
    bench.engine("paged", traces_lib.MAX_MODEL_LEN // scale, {})  # creates the shared runner
    most = max([*offline_sizes.values(), *online_sizes.values()])
    out["warm_up"] = bench.warm_up(min(most, 256), traces_lib.MAX_MODEL_LEN // scale)
    log(f"warm-up: {out['warm_up']['shapes']} decode shapes compiled in {out['warm_up']['seconds']:.0f} s")

    offline_steps = {}  # (trace, system) -> (workload, steps)

    def recost_offline():  # with the cost table as it stands; the shape-min and wall-clock figures beside
        keys = ("makespan_s", "output_tokens_per_s", "requests_per_s", "normalized_latency")
        for (name, system), (workload, steps) in offline_steps.items():
            r = out["offline"][name][system]
            r.update(bench.recost(workload, steps))
            least = bench.recost(workload, steps, "min")
            r["shape_min_clock"] = {k: least[k] for k in keys}
            m = offline_metrics(workload, steps, [st.wall for st in steps], bench.pool_slots)
            r["wall_clock"] = {k: m[k] for k in keys}

    for name, num in offline_sizes.items():
        workload = make_workload(name, num, seeds["trace"][name], scale)
        out["traces"][name] = workload.describe()
        results = {}
        for system in systems:
            results[system] = r = bench.serve(system, workload)
            offline_steps[(name, system)] = (workload, r.pop("steps_log"))
            log(f"  offline {name:<14}{system:<12}{r['output_tokens_per_s']:8.1f} tok/s "
                f"{r['requests_per_s']:6.3f} req/s  peak {r['peak_running']:3d}  util "
                f"{r['kv_utilization']:.3f}  ({r['wall_seconds']:.0f} s wall, {r['compile_seconds']:.0f} s compile)")
        paged_digest = results.get("paged", {}).get("token_ids_digest")
        for r in results.values():
            digest = r.pop("token_ids_digest")
            if paged_digest is not None:
                r["same_tokens_as_paged"] = float(np.mean([a == b for a, b in zip(digest, paged_digest)]))
        out["offline"][name] = results
    recost_offline()  # the rate grid comes from these
    out["offline"].update(reused)
    for t, (name, num) in enumerate(online_sizes.items()):
        base = make_workload(name, num, seeds["trace"][name], scale)
        out["traces"].setdefault(name, base.describe())
        if rates is None and name not in out["offline"]:
            raise ValueError(f"the rate grid of {name} comes from its offline run: give it offline requests")
        grid = rates if rates is not None else rate_grid(out["offline"][name], num_rates)
        curves = {s: [] for s in systems}
        for k, rate in enumerate(grid):
            arrivals = traces_lib.poisson_arrivals(num, rate, seed + 100 + 10 * t + k)
            workload = base.with_arrivals(arrivals)
            for system in systems:
                points = curves[system]
                if points and (points[-1].get("skipped") or points[-1]["normalized_latency"]["mean"]
                               > 2 * points[0]["normalized_latency"]["mean"]):
                    points.append(dict(rate=rate, skipped="unsustained at a lower rate"))
                    continue
                r = bench.serve(system, workload)
                del r["token_ids_digest"], r["steps_log"]
                points.append(dict(rate=rate, **r))
                log(f"  {name:<14}rate {rate:7.3f}/s {system:<12} norm. latency "
                    f"{r['normalized_latency']['mean']:8.4f} s/token  peak {r['peak_running']:3d} "
                    f"({r['wall_seconds']:.0f} s wall)")
        out["online"][name] = dict(rates=grid, curves=curves,
                                   sustained_rate={s: sustained(p) for s, p in curves.items()})
    recost_offline()  # final: every shape timed as often as it will be
    out["device_cost_table"] = bench.shapes.table()  # model step + sampler per step signature
    out["compile_seconds"] = bench.runner.compile_seconds  # excluded from every clock
    for name, results in out["offline"].items():
        s = out["summary"].setdefault(name, {})
        s["throughput_ratio"] = ratios(results, lambda r: r["output_tokens_per_s"])
        s["throughput_ratio_shape_min_clock"] = ratios(results, lambda r: r["shape_min_clock"]["output_tokens_per_s"])
        s["throughput_ratio_wall_clock"] = ratios(results, lambda r: r["wall_clock"]["output_tokens_per_s"])
        s["peak_running"] = {k: r["peak_running"] for k, r in results.items()}
        if name in reused:
            s["offline_reused_from"] = str(rates_from)
    for name, online in out["online"].items():
        sustained_rate = online["sustained_rate"]
        s = out["summary"].setdefault(name, {})
        s["sustained_rate"] = sustained_rate
        s["sustained_rate_ratio"] = {k: (sustained_rate["paged"] / v if v and sustained_rate["paged"] else None)
                                     for k, v in sustained_rate.items() if k != "paged"}
    for name, s in out["summary"].items():
        goals = {}
        tr = s.get("throughput_ratio", {})
        if "orca_max" in tr:
            goals["offline_throughput_vs_orca_max>=2"] = tr["orca_max"] is not None and tr["orca_max"] >= 2
        if "orca_oracle" in tr:
            goals["offline_throughput_vs_orca_oracle>=1.3"] = (tr["orca_oracle"] is not None
                                                                and tr["orca_oracle"] >= 1.3)
        sr = s.get("sustained_rate_ratio", {})
        if "orca_max" in sr:
            goals["sustained_rate_vs_orca_max>=2"] = sr["orca_max"] is not None and sr["orca_max"] >= 2
        s["goals"] = goals
    return out


# ---- reporting ---------------------------------------------------------------------------------

COLORS = dict(paged="tab:green", orca_max="tab:red", orca_pow2="tab:orange", orca_oracle="tab:blue")
LABELS = dict(paged="paged (jpaged)", orca_max="Orca (Max)", orca_pow2="Orca (Pow2)",
              orca_oracle="Orca (Oracle)")


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    online = list(out["online"])
    fig, axes = plt.subplots(1, 1 + len(online), figsize=(5.5 * (1 + len(online)), 4.3), squeeze=False)
    ax = axes[0, 0]
    names = list(out["offline"])
    systems = out["settings"]["systems"]
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        values = [out["offline"][n][system]["output_tokens_per_s"] for n in names]
        bars = ax.bar(np.arange(len(names)) + (j - (len(systems) - 1) / 2) * width, values, width,
                      color=COLORS[system], label=LABELS[system])
        for bar, n in zip(bars, names):
            r = out["offline"][n][system]
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                    f"{r['peak_running']}\n{r['kv_utilization']:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), [f"{n}\n({out['offline'][n][systems[0]]['num_requests']} req"
                                      f"{', reused' if 'source' in out['offline'][n][systems[0]] else ''})"
                                      for n in names])
    ax.set_ylabel("output tokens / s (offline, all at t=0)")
    ax.set_ylim(0, 1.3 * max(out["offline"][n][s]["output_tokens_per_s"] for n in names for s in systems))
    ax.set_title(f"offline throughput (on top: peak running, KV utilization); scale 1/{out['settings']['scale']}",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    for k, name in enumerate(online):
        ax = axes[0, 1 + k]
        for system, points in out["online"][name]["curves"].items():
            run_points = [p for p in points if not p.get("skipped")]
            ax.plot([p["rate"] for p in run_points], [p["normalized_latency"]["mean"] for p in run_points],
                    "o-", color=COLORS[system], label=LABELS[system])
            rate = out["online"][name]["sustained_rate"][system]
            if rate is not None:
                ax.axvline(rate, color=COLORS[system], lw=0.7, ls=":")
        ax.set_xlabel("request rate (req/s, simulated clock)")
        ax.set_ylabel("mean normalized latency (s/token)")
        ax.set_yscale("log")
        ax.set_title(f"{name}: normalized latency vs rate (dotted: highest sustained)", fontsize=9)
        ax.legend(fontsize=7)
    if not online:
        axes[0, 0].text(0.5, -0.25, "no Poisson sweep in this preset", transform=axes[0, 0].transAxes,
                        ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(out: dict) -> None:
    """Offline: throughput over the makespan and while a request waits (backlogged), normalized
    latency (s/token), peak and mean running requests, KV utilization (bench's, engine's), and the
    throughput on the shape-min clock and on the wall clock."""
    print(f"{'trace':<14}{'system':<12}{'tok/s':>7}{'backlog':>8}{'req/s':>7}{'nlat':>8}{'p50':>7}{'p90':>7}"
          f"{'peak':>5}{'mean':>6}{'util':>6}{'eng':>6}{'preempt':>8}{'paged/x':>8}{'min tok/s':>10}{'paged/x':>8}"
          f"{'wall tok/s':>11}")
    for name, results in out["offline"].items():
        paged = results.get("paged")
        for system, r in results.items():
            nl, eng, back = r["normalized_latency"], r["engine_kv_utilization"], r["backlogged_output_tokens_per_s"]
            ratio = paged["output_tokens_per_s"] / r["output_tokens_per_s"] if paged else math.nan
            least, other = r["shape_min_clock"], r["wall_clock"]
            least_ratio = (paged["shape_min_clock"]["output_tokens_per_s"] / least["output_tokens_per_s"]
                           if paged else math.nan)
            print(f"{name:<14}{system:<12}{r['output_tokens_per_s']:7.1f}{back if back else math.nan:8.1f}"
                  f"{r['requests_per_s']:7.3f}{nl['mean']:8.3f}{nl['p50']:7.3f}{nl['p90']:7.3f}{r['peak_running']:5d}"
                  f"{r['mean_running']:6.1f}{r['kv_utilization']:6.3f}{eng if eng is not None else math.nan:6.3f}"
                  f"{r['num_preemptions']:8d}{ratio:8.2f}{least['output_tokens_per_s']:10.1f}{least_ratio:8.2f}"
                  f"{other['output_tokens_per_s']:11.1f}")
    for name, online in out["online"].items():
        print(f"{name}: mean normalized latency (s/token) at rates {', '.join(f'{r:.3f}' for r in online['rates'])} req/s")
        for system, points in online["curves"].items():
            cells = ["   --  " if p.get("skipped") else f"{p['normalized_latency']['mean']:7.3f}" for p in points]
            print(f"  {system:<13}{' '.join(cells)}  sustained {online['sustained_rate'][system]}")
    for name, s in out["summary"].items():
        print(f"{name}: {common.jsonable(s)}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="--preset quick: 32 ShareGPT-like requests at "
                        "scale 1/8, offline only")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="full")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--scale", type=int, help="divide lengths, max_model_len and the pool by this")
    parser.add_argument("--requests", type=int, help="requests per trace (overrides the preset)")
    parser.add_argument("--rates", type=float, nargs="+", help="Poisson rates, requests/s (default: a grid)")
    parser.add_argument("--num-rates", type=int, help="size of the default rate grid (0: offline only)")
    parser.add_argument("--rates-from", type=Path, help="a saved result (JSON) whose offline runs give the "
                        "rate grid: those offline runs are not repeated")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--traces", nargs="+", choices=tuple(TRACE_PARAMS), help="only these of the preset's traces")
    parser.add_argument("--name", help="results file stem (default: throughput for --quick, "
                        "throughput_<preset> otherwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="what a step costs: the process's CPU seconds in it (default), or wall seconds")
    common.add_compile_cache_argument(parser)
    args = parser.parse_args(argv)
    common.use_compile_cache(args)
    start = time.perf_counter()
    preset = "quick" if args.quick else args.preset
    out = run(preset, scale=args.scale, systems=tuple(args.systems), seed=args.seed,
              rates=args.rates, num_rates=args.num_rates, requests=args.requests, clock=args.clock,
              traces=tuple(args.traces) if args.traces else None, rates_from=args.rates_from)
    out["settings"]["compile_cache"] = args.compile_cache
    # presets never overwrite each other; --name keeps a partial run from overwriting its preset's
    name = args.name or ("throughput" if preset == "quick" else f"throughput_{preset}")
    return common.report(out, args.out, name, start, plot, print_table)


if __name__ == "__main__":
    main()
