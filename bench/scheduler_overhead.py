"""Host time per step against device time per step, at 16, 64 and 256 running sequences.

Host time is everything a step spends outside the compiled executables: scheduling (block-manager
snapshots, queues, preemption checks), building the padded step arrays, and post-processing
(appending tokens, detokenizing, stop checks, outputs). Device time is the synchronised time
inside the compiled step and sampler. Compilation is excluded (warm-up steps first).

The scheduler alone (`scheduler_alone`): the host core without the model, 256 sequences decoding,
every scheduled sequence given a fake token, at two pool sizes (4,096 blocks of 16: 3 GiB of the
default model's float32 KV, enough that nothing is preempted; and 65,536 blocks): milliseconds per
decode step, median of 5 rounds of 200 steps. This is where the block manager's persistent tables show (bench/README.md).

    python bench/scheduler_overhead.py [--quick] [--out bench/results]

Goal (issue 3): host time under 10% of step time at 256 sequences.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import RESULTS_DIR, machine_info, results_stem, write_json  # noqa: E402

PROMPT_LEN = 32
WARMUP_STEPS = 2


def measure(loaded, num_seqs: int, decode_steps: int) -> dict:
    from jpaged import EngineConfig, LLMEngine, SamplingParams
    from jpaged.core.kv_cache_manager import blocks_for

    block_size = 16
    per_seq = blocks_for(PROMPT_LEN + WARMUP_STEPS + decode_steps + 2, block_size)
    engine = LLMEngine(EngineConfig(num_blocks=num_seqs * per_seq + 8, block_size=block_size, max_num_seqs=num_seqs,
                                    max_num_batched_tokens=max(2048, num_seqs * PROMPT_LEN)), loaded=loaded)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=WARMUP_STEPS + decode_steps + 2, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), rng.integers(100, 40000, PROMPT_LEN).tolist(), params)
    engine.step()  # admits the requests and prefills the first of them
    while engine.scheduler.waiting:  # prefill the rest
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    assert len(engine.scheduler.running) == num_seqs
    engine.timings.clear()
    t0 = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
    wall = time.perf_counter() - t0
    t = engine.timings
    return {
        "num_seqs": num_seqs, "decode_steps": decode_steps, "wall_s": wall,
        "step_ms": 1e3 * t["step_s"] / decode_steps, "host_ms": 1e3 * t["host_s"] / decode_steps,
        "schedule_ms": 1e3 * t["schedule_s"] / decode_steps, "device_ms": 1e3 * t["device_s"] / decode_steps,
        "host_fraction": t["host_s"] / t["step_s"],
        "tokens_per_s": num_seqs * decode_steps / t["step_s"],
    }


def scheduler_alone(num_seqs: int, num_blocks: int, steps: int = 200, rounds: int = 5) -> dict:
    """Milliseconds per decode step of `Scheduler.schedule()` plus a fake token per sequence."""
    import itertools
    import statistics

    from jpaged.core.block_manager import BlockManager
    from jpaged.core.sampling_params import SamplingParams
    from jpaged.core.scheduler import Scheduler, SchedulerConfig
    from jpaged.core.sequence import Sequence, SequenceGroup

    times = []
    for _ in range(rounds):
        ids = itertools.count()
        scheduler = Scheduler(BlockManager.create(num_blocks, 16),
                              SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * PROMPT_LEN))
        params = SamplingParams(max_tokens=steps + 2)
        for i in range(num_seqs):
            prompt = tuple(range(i, i + PROMPT_LEN))
            scheduler.add(SequenceGroup(str(i), None, prompt, params, 0, [Sequence(next(ids), 0, prompt)]))
        for step in range(steps + 1):
            if step == 1:
                start = time.perf_counter()
            out = scheduler.schedule()
            assert step == 0 or (out.is_decode and len(out.rows) == num_seqs)
            for seqs in out.row_seqs:
                for seq in seqs:
                    seq.append_token(7, 0.0)
        times.append((time.perf_counter() - start) / steps)
    return {"num_seqs": num_seqs, "num_blocks": num_blocks, "steps": steps,
            "schedule_ms": 1e3 * statistics.median(times), "rounds_ms": [1e3 * t for t in times]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer decode steps")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    from jpaged.weights import load_model

    loaded = load_model(None)
    steps = 4 if args.quick else 10
    rows = []
    for num_seqs in (16, 64, 256):
        row = measure(loaded, num_seqs, steps)
        rows.append(row)
        print(f"{num_seqs:4d} seqs: step {row['step_ms']:8.1f} ms = device {row['device_ms']:8.1f} + host "
              f"{row['host_ms']:6.1f} (schedule {row['schedule_ms']:5.1f}) ms; host {row['host_fraction']:.1%}; "
              f"{row['tokens_per_s']:.0f} tokens/s", flush=True)
    alone = [scheduler_alone(256, num_blocks) for num_blocks in (4096, 65536)]
    for row in alone:
        print(f"scheduler alone, {row['num_seqs']} seqs, {row['num_blocks']} blocks: {row['schedule_ms']:.2f} ms a step",
              flush=True)
    result = {"benchmark": "scheduler_overhead", "machine": machine_info(),
              "settings": {"prompt_len": PROMPT_LEN, "decode_steps": steps, "block_size": 16, "dtype": "float32",
                           "attention_backend": "auto"},
              "rows": rows, "scheduler_alone": alone,
              "goal": {"host_fraction_at_256_below": 0.10, "met": rows[-1]["host_fraction"] < 0.10}}
    write_json(args.out / f"{results_stem('scheduler_overhead', args.quick)}.json", result)
    return result


if __name__ == "__main__":
    main()
