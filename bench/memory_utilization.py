"""KV memory utilization: paged blocks vs Orca-style contiguous reservation (paper, Figure 2).

An allocator-only simulation (no model): traces are replayed through iteration-level batching
in which one step is one forward pass and every running request produces one token per step.
A request with prompt length p and output length o holds, after the step in which it has already
generated g tokens, the KV states of p + g tokens (the prefill writes p; each decode step writes
the token fed in), so it peaks at p + o - 1 states: the last sampled token is never written.
Admission is FCFS whenever memory allows (strict: the head of the queue blocks the rest).

- paged: pool of `pool_slots / block_size` blocks, block 0 the null block; blocks are taken on
  demand when a sequence's last block is full and freed when it finishes. Out of blocks: preempt
  the latest-arrived running request by recompute (blocks released, request re-queued at the
  front; on readmission it re-prefills its p + g tokens). No admission in a step that preempted.
- orca_{max,pow2,oracle}: `bench.baselines.reservation.ReservationManager` over the same pool at block
  size 16; a request reserves its policy's slots at admission, rounded up to whole blocks and
  then to a power of two by the buddy allocator, and keeps them until it finishes.

Per step the usable pool (the null block excluded) is split into: token states; reserved (slots
a request will fill before it finishes: for paged, the empty slots of a last block that its
sequence will still fill); internal fragmentation (allocated slots it will never fill:
over-reservation past its true length, padding of its last block, buddy rounding); external
fragmentation (all free memory, when the next waiting request's run would fit in the free total
but no free run is large enough); free (including memory too small in total for the next
request). Utilization = time integral of token states / time integral of allocated memory
(token states + reserved + internal), over every step. The pool split is time-averaged over
*backlogged* steps (some arrived request is still waiting: memory is the bottleneck), which
leaves out the drain at the end of a finite trace where the pool empties whatever the allocator;
the all-steps split is in the JSON as well. Steps in which nothing runs are skipped. The paged
floor is the best any block-granular allocator can do (every running sequence owning exactly
ceil(tokens / block_size) blocks), computed from the trace alone. Arrivals: all at t=0, or a
Poisson process at `poisson_rate` (one time unit = one step; a step's cost does not depend on
its batch or prefill lengths here).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `jpaged` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench import traces as traces_lib  # noqa: E402
from bench.baselines.reservation import ReservationManager, ReservationPolicy  # noqa: E402
from jpaged.core.kv_cache_manager import blocks_for  # noqa: E402

CATEGORIES = ("token_states", "reserved", "internal", "external", "free")
INTERNAL_PARTS = ("over_reservation", "block_padding", "buddy_rounding")
RECORDED = CATEGORIES + INTERNAL_PARTS + ("num_running", "floor_padded", "backlogged")


@dataclasses.dataclass
class SimResult:
    """Per-step records (slots, `RECORDED` keys) of one system replaying one trace."""

    system: str
    block_size: int
    pool_slots: int  # usable slots: (num_blocks - 1) * block_size
    steps: dict[str, np.ndarray]
    num_preemptions: int = 0
    makespan: int = 0

    def window(self, mask: np.ndarray) -> dict:
        """Utilization and time-averaged pool split over the steps selected by `mask`."""
        s = {k: int(v[mask].sum()) for k, v in self.steps.items()}
        allocated = s["token_states"] + s["reserved"] + s["internal"]
        return dict(num_steps=int(mask.sum()),
                    utilization=s["token_states"] / allocated if allocated else None,
                    split={k: s[k] / (int(mask.sum()) * self.pool_slots) if mask.any() else None
                           for k in CATEGORIES + INTERNAL_PARTS})

    def summary(self) -> dict:
        """Headline numbers: utilization over every step; the pool split over backlogged steps
        (a request waits: memory is the bottleneck), which leaves out the drain at a trace's end."""
        steps = self.steps
        allocated = steps["token_states"] + steps["reserved"] + steps["internal"]
        every, backlogged = np.ones_like(allocated, dtype=bool), steps["backlogged"] > 0
        out = dict(system=self.system, block_size=self.block_size, pool_slots=self.pool_slots,
                   utilization=self.window(every)["utilization"],
                   utilization_mean_of_steps=float(np.mean(steps["token_states"] / allocated)),
                   split=self.window(backlogged if backlogged.any() else every)["split"],
                   split_window="backlogged" if backlogged.any() else "all",
                   backlogged=self.window(backlogged),
                   all_steps=self.window(every), backlogged_fraction=float(backlogged.mean()),
                   peak_running=int(steps["num_running"].max()),
                   mean_running=float(steps["num_running"].mean()),
                   num_steps=len(allocated), makespan=self.makespan,
                   num_preemptions=self.num_preemptions)
        if steps["floor_padded"].any():  # paged: the floor over the same steps, from the running set
            out["floor_running"] = int(steps["token_states"].sum()) / int(steps["floor_padded"].sum())
        return out


class _Seq:
    __slots__ = ("req", "generated", "num_blocks", "reservation", "internal_parts")

    def __init__(self, req):
        self.req, self.generated, self.num_blocks = req, 0, 0
        self.reservation = self.internal_parts = None

    @property
    def priority(self):
        return (self.req.arrival_time, self.req.request_id)


def _replay(trace, admit_and_allocate, record, finish):
    """Shared loop: arrivals, the system's admission/allocation, recording, finishing.
    `record` returns one step's values in `RECORDED` order, less the trailing `backlogged`."""
    pending = collections.deque(sorted(trace, key=lambda r: (r.arrival_time, r.request_id)))
    waiting: collections.deque[_Seq] = collections.deque()
    running: list[_Seq] = []
    rows, t = [], 0
    while pending or waiting or running:
        while pending and pending[0].arrival_time <= t:
            waiting.append(_Seq(pending.popleft()))
        if not waiting and not running:
            t = math.ceil(pending[0].arrival_time)
            continue
        admit_and_allocate(running, waiting)
        rows.append(record(running, waiting) + (int(bool(waiting)),))
        done = False
        for seq in running:
            seq.generated += 1
            if seq.generated == seq.req.output_len:
                finish(seq)
                done = True
        if done:
            running[:] = [seq for seq in running if seq.generated < seq.req.output_len]
        t += 1
    columns = np.array(rows, dtype=np.int64).reshape(-1, len(RECORDED)).T
    return dict(zip(RECORDED, columns)), t


def simulate_paged(trace, block_size: int, pool_slots: int) -> SimResult:
    num_blocks = pool_slots // block_size
    free, preemptions = num_blocks - 1, 0
    by_priority = lambda seq: seq.priority  # noqa: E731

    def admit_and_allocate(running, waiting):
        nonlocal free, preemptions
        preempted, i = False, 0
        while i < len(running):
            seq = running[i]
            need = blocks_for(seq.req.prompt_len + seq.generated, block_size) - seq.num_blocks
            victim = None
            while need > free and victim is not seq:
                victim = running.pop()  # latest arrival
                free += victim.num_blocks
                victim.num_blocks, preempted = 0, True
                preemptions += 1
                waiting.appendleft(victim)
            if victim is seq:
                break
            free -= need
            seq.num_blocks += need
            i += 1
        while not preempted and waiting:
            seq = waiting[0]
            need = blocks_for(seq.req.prompt_len + seq.generated, block_size)
            if need > free:
                break
            waiting.popleft()
            free -= need
            seq.num_blocks = need
            bisect.insort(running, seq, key=by_priority)

    def record(running, waiting):
        tokens = reserved = internal = padded = 0
        for seq in running:
            req = seq.req
            now = req.prompt_len + seq.generated
            final = req.prompt_len + req.output_len - 1
            allocated = seq.num_blocks * block_size
            tokens += now
            if allocated > final:  # slots past the sequence's last token: never filled
                reserved += final - now
                internal += allocated - final
            else:
                reserved += allocated - now
            padded += blocks_for(now, block_size) * block_size
        # token_states, reserved, internal, external, free, over_res, padding, buddy, running, floor
        return (tokens, reserved, internal, 0, free * block_size, 0, internal, 0, len(running), padded)

    def finish(seq):
        nonlocal free
        free += seq.num_blocks

    steps, makespan = _replay(trace, admit_and_allocate, record, finish)
    return SimResult(f"paged_bs{block_size}", block_size, (num_blocks - 1) * block_size,
                     steps, preemptions, makespan)


def simulate_orca(trace, policy: ReservationPolicy, block_size: int, pool_slots: int,
                  max_model_len: int = traces_lib.MAX_MODEL_LEN) -> SimResult:
    num_blocks = pool_slots // block_size
    manager = ReservationManager.create(num_blocks, block_size, policy, max_model_len)

    def admit_and_allocate(running, waiting):
        nonlocal manager
        while waiting and manager.can_admit(waiting[0].req.prompt_len, waiting[0].req.output_len):
            seq = waiting.popleft()
            req = seq.req
            manager, r = manager.admit(req.request_id, req.prompt_len, req.output_len)
            final, blocks = req.prompt_len + req.output_len - 1, blocks_for(r.num_slots, block_size)
            seq.reservation = r
            seq.internal_parts = (r.num_slots - final, blocks * block_size - r.num_slots,
                                  (r.run_blocks - blocks) * block_size)
            running.append(seq)

    def record(running, waiting):
        tokens = reserved = over = padding = rounding = 0
        for seq in running:
            req = seq.req
            now = req.prompt_len + seq.generated
            tokens += now
            reserved += req.prompt_len + req.output_len - 1 - now  # reservation >= final
            over += seq.internal_parts[0]
            padding += seq.internal_parts[1]
            rounding += seq.internal_parts[2]
        free, external = manager.buddy.num_free_blocks, 0
        if waiting:
            need = manager.num_run_blocks(waiting[0].req.prompt_len, waiting[0].req.output_len)
            if manager.buddy.largest_free_run < need <= free:  # fits in total, in no run
                free, external = 0, free
        return (tokens, reserved, over + padding + rounding, external * block_size,
                free * block_size, over, padding, rounding, len(running), 0)

    def finish(seq):
        nonlocal manager
        manager = manager.release(seq.req.request_id)

    steps, makespan = _replay(trace, admit_and_allocate, record, finish)
    return SimResult(policy.value, block_size, (num_blocks - 1) * block_size, steps, 0, makespan)


def paged_floor(trace, block_size: int) -> float:
    """Best block-granular utilization, from the trace alone: over every (request, step) the
    request runs, sum(tokens) / sum(ceil(tokens / block_size) * block_size). Independent of the
    schedule: a request runs with p, p + 1, ..., p + o - 1 tokens whatever preempts it."""
    tokens = np.concatenate([np.arange(r.prompt_len, r.prompt_len + r.output_len) for r in trace])
    return float(tokens.sum() / (-(-tokens // block_size) * block_size).sum())


def poisson_rate(trace, pool_slots: int, load: float = 1.0) -> float:
    """Requests per step at which a waste-free KV cache of `pool_slots` is `load` full on average
    (Little's law: rate * mean over requests of the KV-slot-steps it occupies = load * pool)."""
    slot_steps = np.mean([r.output_len * (r.prompt_len + (r.output_len - 1) / 2) for r in trace])
    return load * pool_slots / float(slot_steps)


def run(quick: bool = False, pool_slots: int = 12288, block_sizes=(8, 16, 32, 64, 128, 256),
        orca_block_size: int = 16, load: float = 1.0, seed: int = 0) -> dict:
    # Long enough that Poisson arrivals span several times the longest request's lifetime.
    sizes = dict(sharegpt_like=300, alpaca_like=1500, alpaca_real=600) if quick else \
        dict(sharegpt_like=2000, alpaca_like=10000, alpaca_real=4000)
    seeds = dict(sharegpt_like=seed, alpaca_like=seed + 1, alpaca_real_resample=seed + 2,
                 poisson=seed + 3)
    base = dict(sharegpt_like=traces_lib.sharegpt_like(sizes["sharegpt_like"], seeds["sharegpt_like"]),
                alpaca_like=traces_lib.alpaca_like(sizes["alpaca_like"], seeds["alpaca_like"]))
    notes = []
    try:
        real = traces_lib.alpaca_real(traces_lib.default_tokenizer())
        notes.append(f"alpaca_real: {len(real)} seed requests, {traces_lib.DEFAULT_GGUF} tokenizer, "
                     f"ChatML template; resampled with replacement")
        base["alpaca_real"] = traces_lib.resample(real, sizes["alpaca_real"], seeds["alpaca_real_resample"])
    except (OSError, ImportError, ValueError) as e:  # no GGUF / tokenizer: skip the real trace
        notes.append(f"alpaca_real skipped: {e!r}")
    out = dict(traces={}, results={}, notes=notes, seeds=seeds, sizes=sizes)
    for k, (name, trace) in enumerate(base.items()):
        rate = poisson_rate(trace, pool_slots, load)
        arrivals = traces_lib.poisson_arrivals(len(trace), rate, seeds["poisson"] + k)
        p = np.array([r.prompt_len for r in trace]); o = np.array([r.output_len for r in trace])
        out["traces"][name] = dict(num_requests=len(trace), mean_prompt=float(p.mean()),
                                   mean_output=float(o.mean()), max_total=int((p + o).max()),
                                   poisson_rate_per_step=rate, poisson_seed=seeds["poisson"] + k,
                                   paged_floor={bs: paged_floor(trace, bs) for bs in block_sizes})
        for mode, replay in (("t0", trace), ("poisson", traces_lib.with_arrivals(trace, arrivals))):
            rows = [simulate_paged(replay, bs, pool_slots).summary() for bs in block_sizes]
            rows += [simulate_orca(replay, policy, orca_block_size, pool_slots).summary()
                     for policy in ReservationPolicy]
            for row in rows:
                if row["system"].startswith("paged"):
                    row["floor"] = out["traces"][name]["paged_floor"][row["block_size"]]
            out["results"][f"{name}/{mode}"] = rows
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["traces"])
    colors = dict(token_states="tab:green", reserved="tab:orange", internal="tab:red",
                  external="tab:purple", free="lightgray")
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 8.5), squeeze=False)
    for j, name in enumerate(names):
        ax, labels, x = axes[0, j], [], 0
        for mode in ("t0", "poisson"):
            for row in out["results"][f"{name}/{mode}"]:
                if row["system"].startswith("paged") and row["block_size"] != 16:
                    continue
                bottom = 0.0
                for cat in CATEGORIES:
                    value = 100 * row["split"][cat]
                    ax.bar(x, value, bottom=bottom, color=colors[cat],
                           label=cat.replace("_", " ") if x == 0 and j == 0 else None)
                    bottom += value
                ax.text(x, 101, f"{100 * row['utilization']:.1f}", ha="center", fontsize=7)
                labels.append(f"{row['system'].replace('orca_', 'orca(').replace('paged_bs16', 'paged16')}"
                              f"{')' if row['system'].startswith('orca') else ''}\n{mode}")
                x += 1
        ax.set_xticks(range(x), labels, fontsize=7, rotation=45)
        ax.set_ylim(0, 108)
        ax.set_ylabel("% of KV pool, time average over backlogged steps")
        ax.set_title(f"{name}: pool split (utilization on top)", fontsize=10)
        ax = axes[1, j]
        for mode, style, color in (("t0", "o-", "tab:blue"), ("poisson", "s--", "tab:green")):
            paged = [r for r in out["results"][f"{name}/{mode}"] if r["system"].startswith("paged")]
            ax.plot([r["block_size"] for r in paged], [100 * r["utilization"] for r in paged], style,
                    color=color, label=f"paged utilization ({mode})")
            ax.plot([r["block_size"] for r in paged], [100 * r["split"]["token_states"] for r in paged],
                    style, color=color, alpha=0.4, label=f"token states, % of pool when backlogged ({mode})")
        floor = out["traces"][name]["paged_floor"]
        ax.plot(list(floor), [100 * v for v in floor.values()], "k:", label="floor (from the trace)")
        for row in out["results"][f"{name}/t0"]:
            if row["system"].startswith("orca"):
                ax.axhline(100 * row["utilization"], lw=0.8, color="gray")
                ax.text(8, 100 * row["utilization"] + 1, row["system"] + " (t0)", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("utilization (%)")
        ax.set_ylim(0, 101)
        ax.legend(fontsize=6, loc="lower right")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="upper center", ncol=len(CATEGORIES),
               fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(out: dict) -> None:
    """util/floor: all steps; token..free: % of the pool over backlogged steps; backlog: % of steps."""
    print(f"{'trace/arrivals':<22}{'system':<12}{'util%':>6}{'floor%':>7} |{'tok%':>6}{'resv%':>6}"
          f"{'int%':>6}{'ext%':>6}{'free%':>6} |{'backlog%':>9}{'peak':>5}{'mean':>7}{'preempt':>8}")
    for key, rows in out["results"].items():
        for row in rows:
            s = row["split"]
            floor = f"{100 * row['floor']:7.1f}" if "floor" in row else f"{'':>7}"
            print(f"{key:<22}{row['system']:<12}{100 * row['utilization']:6.1f}{floor} |"
                  + "".join(f"{100 * s[k]:6.1f}" for k in CATEGORIES)
                  + f" |{100 * row['backlogged_fraction']:9.1f}{row['peak_running']:5d}"
                  f"{row['mean_running']:7.1f}{row['num_preemptions']:8d}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller traces (a few seconds)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--pool-slots", type=int, default=12288)
    parser.add_argument("--load", type=float, default=1.0, help="Poisson load (see poisson_rate)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = run(quick=args.quick, pool_slots=args.pool_slots, load=args.load, seed=args.seed)
    out["settings"] = dict(quick=args.quick, pool_slots=args.pool_slots, load=args.load,
                           block_sizes=[8, 16, 32, 64, 128, 256], orca_block_size=16,
                           max_model_len=traces_lib.MAX_MODEL_LEN, null_block="excluded from the pool",
                           trace_params=dict(sharegpt_like=traces_lib.SHAREGPT, alpaca_like=traces_lib.ALPACA))
    out["machine"] = common.machine_info()
    return common.report(out, args.out, common.results_stem("memory_utilization", args.quick), start, plot, print_table)


if __name__ == "__main__":
    main()
