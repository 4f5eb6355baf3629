"""Host time per step against device time per step, at 16, 64 and 256 running sequences.

Host time is everything a step spends outside the compiled executables: scheduling (block-manager
snapshots, queues, preemption checks), building the padded step arrays, and post-processing
(appending tokens, detokenizing, stop checks, outputs). Device time is the synchronised time
inside the compiled step and sampler. Compilation is excluded (warm-up steps first).

The scheduler alone (`scheduler_alone`): the host core without the model, 256 sequences decoding,
every scheduled sequence given a fake token, at two pool sizes (4,096 blocks of 16: 3 GiB of the
default model's float32 KV, enough that nothing is preempted; and 65,536 blocks): milliseconds per
decode step, median of 5 rounds of 200 steps. This is where the block manager's persistent tables show (bench/README.md).

The host alone (`--stub-device`, issue 31): the real engine (scheduler, block manager, packing at the
engine's buckets, sampling inputs, post-processing, detokenizer) on a `StubRunner`, whose model step and
sampler return at once, so that a step is host time: milliseconds per decode step at 16, 64 and 256
sequences (wall, and the stepping thread's CPU time, the steadier on a shared machine; the garbage
collector's share), split into parts by clocking them; then, on a simulated device that takes `DEVICE_MS` a step, synchronous against
`async_scheduling=True` steps, and the share of the host's time the overlap hides.

    python bench/scheduler_overhead.py [--quick] [--stub-device] [--out bench/results]

Goals: host time under 10% of step time at 256 sequences (issue 3); on the stub device, at most 3 ms of
host time per decode step at 256 sequences (issue 31).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jpaged.device.attention import get_backend  # noqa: E402
from jpaged.device.kv_cache import KVCache  # noqa: E402
from jpaged.device.runner import DeviceCall, ModelRunner, Sampled  # noqa: E402
from jpaged.device.sampler import SamplerOutput, packed  # noqa: E402

from bench.common import RESULTS_DIR, machine_info, results_stem, write_json  # noqa: E402

PROMPT_LEN = 32
WARMUP_STEPS = 2
DEVICE_MS = 5.0  # the simulated device's decode step: a 135M model at 256 rows on a GPU takes a few ms


class StubRunner(ModelRunner):
    """The real runner's host side (packing at the engine's buckets, sampling inputs, block-operation
    arguments, reading results back) with every executable replaced by a numpy stand-in that returns at
    once, so that a step's time is its host time. No KV pool is allocated (its shape only). The model
    step returns [rows, 1] logits; the sampler's token for (seed, sample_index, step) is a hash of them
    in [256, 33024), deterministic and in the tokenizer's text range, as a seeded sampler's is.

    `device_step_s` > 0 simulates a device: each model step occupies it that long, from its dispatch or
    the end of the work queued before it, and reading a step's samples (`fetch_samples`) sleeps until
    the step is done, leaving the CPU to the host, as a GPU does."""

    device_step_s = 0.0

    def _new_pool(self, shape, dtype, kv=None) -> KVCache:
        self._busy_until, self._ready_at = 0.0, {}
        return KVCache(kv=jax.ShapeDtypeStruct(shape, dtype))

    def _run(self, name: str, *args, **static):
        self._calls.append(DeviceCall(name, (), 0.0, 0.0))
        if name in ("prefill_step", "decode_step"):
            self._busy_until = max(time.perf_counter(), self._busy_until) + self.device_step_s
            return self.cache, np.zeros((args[2].logits_index.shape[0], 1), np.float32)
        if name == "sample":
            params, k = args[2], static["num_top"]
            mixed = (params.seed.astype(np.uint64) * 40503 + params.sample_index.astype(np.uint64) * 977
                     + params.step.astype(np.uint64) * 2654435761)
            tokens = (mixed % 32768 + 256).astype(np.int32)
            self._ready_at[id(tokens)] = self._busy_until
            return Sampled(tokens, packed(SamplerOutput(tokens, np.zeros(len(tokens), np.float32),
                                                        np.repeat(tokens[:, None], k, 1),
                                                        np.zeros((len(tokens), k), np.float32), np.zeros(len(tokens), bool))))
        if name == "feed_tokens":  # running ahead (async scheduling): the rows' inputs from the samples before
            token_ids, source, sampled = args
            return np.where(source >= 0, np.asarray(sampled)[np.maximum(source, 0)], token_ids)
        if name == "read_blocks":
            return np.zeros((self.cpu_kv.shape[0], len(args[1]), *self.cpu_kv.shape[2:]), self.cpu_kv.dtype)
        return self.cache  # copy_blocks, write_blocks

    def fetch_samples(self, parts: list[tuple]) -> dict[str, np.ndarray]:
        wait = max(self._ready_at.pop(id(out.token_ids), 0.0) for out, _ in parts) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return super().fetch_samples(parts)


def decoding_engine(loaded, num_seqs: int, decode_steps: int, *, stub: bool = False, async_scheduling: bool = False):
    """An engine with `num_seqs` requests of PROMPT_LEN random tokens, all prefilled and decoding (after
    WARMUP_STEPS decode steps), each with room for `decode_steps` more. `stub`: on a `StubRunner` whose
    attention backend is the GPU's (Pallas: block tables read, no attention plan)."""
    from jpaged import EngineConfig, LLMEngine, SamplingParams
    from jpaged.core.kv_cache_manager import blocks_for

    block_size = 16
    per_seq = blocks_for(PROMPT_LEN + WARMUP_STEPS + decode_steps + 2, block_size)
    config = EngineConfig(num_blocks=num_seqs * per_seq + 8, block_size=block_size, max_num_seqs=num_seqs,
                          max_num_batched_tokens=max(2048, num_seqs * PROMPT_LEN), async_scheduling=async_scheduling)
    runner = None
    if stub:
        runner = StubRunner(loaded.config, loaded.params, num_blocks=config.num_blocks, block_size=block_size,
                            backend=get_backend("pallas", interpret=True))
    engine = LLMEngine(config, loaded=loaded, runner=runner)
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
    return engine


def measure(loaded, num_seqs: int, decode_steps: int) -> dict:
    engine = decoding_engine(loaded, num_seqs, decode_steps)
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


# the host's parts of a decode step: (part, the function whose frames are its time: `Class.method`)
PARTS = (("schedule", "Scheduler.schedule"), ("pack", "ModelRunner.make_inputs"),
         ("sample_inputs", "ModelRunner.dispatch_sample"), ("post_process", "LLMEngine._apply"),
         ("outputs", "LLMEngine._request_output"), ("statistics", "LLMEngine._record_usage"))
SAMPLE_INTERVAL_S = 0.0005


def sampled_parts(engine, steps: int) -> dict:
    """One round of `steps` steps while another thread samples the stepping thread's Python stack every
    `SAMPLE_INTERVAL_S` (as py-spy does, nothing of the engine wrapped or replaced): part -> the share of
    the samples inside its function (`PARTS`; a frame's `co_qualname`), and "samples". A profiler's cost
    per call would inflate the parts made of many small calls; a sample costs the same wherever it lands."""
    names = {qualname: part for part, qualname in PARTS}
    counts = dict.fromkeys([part for part, _ in PARTS], 0)
    total, done = 0, threading.Event()
    target = threading.get_ident()

    def sample():
        nonlocal total
        while not done.wait(SAMPLE_INTERVAL_S):
            frame = sys._current_frames().get(target)
            total += 1
            while frame is not None:
                part = names.get(frame.f_code.co_qualname)
                if part is not None:
                    counts[part] += 1
                    break
                frame = frame.f_back

    # the sampler waits for the GIL: hand it over at least every interval (else it lands where the stepping
    # thread releases it, in numpy's calls, every 5 ms by default)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(SAMPLE_INTERVAL_S / 5)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for _ in range(steps):
            engine.step()
    finally:
        done.set()
        sampler.join()
        sys.setswitchinterval(switch_interval)
    return {"samples": total, **{part: n / max(total, 1) for part, n in counts.items()}}


def measure_stub(loaded, num_seqs: int, steps: int, rounds: int = 5) -> dict:
    """Host time per decode step on a `StubRunner`, where a step is host time alone: wall and CPU time
    of the stepping thread (the CPU time is the steadier on a loaded machine), medians of `rounds`
    rounds of `steps` steps, with the garbage collector's share of it (its collections, timed through
    `gc.callbacks`: the engine freezes the heap alive when it is built, `LLMEngine`'s docstring).
    Then one round with the stepping thread's stack sampled (`sampled_parts`) for the parts' shares
    (`PARTS`; "other": the rest), scaled to the median CPU time."""
    import gc
    import statistics

    engine = decoding_engine(loaded, num_seqs, steps * (rounds + 1), stub=True)
    times: dict[str, list[float]] = {"wall": [], "cpu": [], "gc": []}
    collections = {"start": 0.0, "seconds": 0.0, "by_generation": [0, 0, 0]}

    def on_gc(phase, info):
        if phase == "start":
            collections["start"] = time.perf_counter()
        else:
            collections["seconds"] += time.perf_counter() - collections["start"]
            collections["by_generation"][info["generation"]] += 1

    gc.callbacks.append(on_gc)
    try:
        for _ in range(rounds):
            gc_before = collections["seconds"]
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                engine.step()
            times["wall"].append((time.perf_counter() - t0) / steps)
            times["cpu"].append((time.thread_time() - c0) / steps)
            times["gc"].append((collections["seconds"] - gc_before) / steps)
    finally:
        gc.callbacks.remove(on_gc)
    shares = sampled_parts(engine, steps)
    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    parts = {part: ms["cpu"] * shares[part] for part, _ in PARTS}
    parts["other"] = ms["cpu"] - sum(parts.values())
    return {"num_seqs": num_seqs, "steps": steps, "rounds": rounds, "host_ms": ms["wall"], "host_cpu_ms": ms["cpu"],
            "gc_ms": ms["gc"], "gc_collections_per_step": [n / (rounds * steps) for n in collections["by_generation"]],
            "parts_ms": parts,
            "rounds_ms": {name: [1e3 * t for t in values] for name, values in times.items()}}


def measure_overlap(loaded, num_seqs: int, steps: int, device_ms: float, rounds: int = 5) -> dict:
    """Wall milliseconds per decode step on a `StubRunner` simulating `device_ms` of device time a step,
    synchronous and with async scheduling (rounds alternating, medians), and the share of the host's time
    a step no longer adds: (synchronous - async) / (synchronous - device), 1.0 when all of it is hidden
    (the step then takes max(host, device))."""
    import statistics

    engines = {mode: decoding_engine(loaded, num_seqs, steps * (rounds + 1), stub=True, async_scheduling=mode)
               for mode in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for engine in engines.values():
        engine.runner.device_step_s = device_ms / 1e3
    for _ in range(rounds):
        for mode, engine in engines.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[mode].append((time.perf_counter() - t0) / steps)
    sync_ms, async_ms = (1e3 * statistics.median(times[mode]) for mode in (False, True))
    return {"num_seqs": num_seqs, "device_ms": device_ms, "sync_step_ms": sync_ms, "async_step_ms": async_ms,
            "host_hidden_fraction": (sync_ms - async_ms) / (sync_ms - device_ms),
            "rounds_ms": {"sync": [1e3 * t for t in times[False]], "async": [1e3 * t for t in times[True]]}}


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
    parser.add_argument("--stub-device", action="store_true",
                        help="the host alone: a runner whose model step and sampler return at once (StubRunner)")
    args = parser.parse_args(argv)
    from jpaged.weights import load_model

    loaded = load_model(None)
    if args.stub_device:
        return main_stub(loaded, args)
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



def main_stub(loaded, args) -> dict:
    steps = 10 if args.quick else 40
    rows = []
    for num_seqs in (16, 64, 256):
        row = measure_stub(loaded, num_seqs, steps)
        rows.append(row)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["parts_ms"].items())
        print(f"{num_seqs:4d} seqs, stub device: host {row['host_ms']:6.2f} ms a decode step, CPU {row['host_cpu_ms']:6.2f} "
              f"({parts}); garbage collector {row['gc_ms']:.2f} ms a step", flush=True)
    overlap = measure_overlap(loaded, 256, steps, DEVICE_MS)
    print(f" 256 seqs, simulated device of {DEVICE_MS} ms a step: synchronous {overlap['sync_step_ms']:.2f} ms a step, "
          f"async scheduling {overlap['async_step_ms']:.2f}; host time hidden {overlap['host_hidden_fraction']:.0%}",
          flush=True)
    result = {"benchmark": "scheduler_overhead_stub", "machine": machine_info(),
              "settings": {"prompt_len": PROMPT_LEN, "decode_steps": steps, "block_size": 16,
                           "attention_backend": "pallas (stub: block tables packed, no attention plan)"},
              "rows": rows, "overlap": overlap, "goal": {"host_cpu_ms_at_256_at_most": 3.0, "met": rows[-1]["host_cpu_ms"] <= 3.0}}
    write_json(args.out / f"{results_stem('scheduler_overhead_stub', args.quick)}.json", result)
    return result


if __name__ == "__main__":
    main()
