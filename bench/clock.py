"""The benchmarks' clock on a shared machine: each engine step charged its host time plus the
typical device time of its shape.

On the shared 2-core development machines the wall time of one compiled step varied 2-3x with the
other processes' load, and its CPU time by +-30%. Steps of equal shape run the same executable, so
pooling their device times and charging every step of a shape the same (the median of its runs, or
their least: the *shape-median* and *shape-min* clocks) charges two configurations that run the
same shapes the same, whatever the machine was doing at the moment each ran; a step's own host
time (scheduling, block manager, packing, detokenization) is charged as measured.

`ShapeClock` is a step observer's helper: feed it every `jpaged.StepRecord` (`observe`), then cost
steps with the final table (`cost`). Compilation never enters it: the engine's records exclude it,
and the runner runs each new executable once untimed before its first timed run, so no device time
here includes a compilation or a cold first run. `time="cpu"` measures process CPU seconds (all
threads; robust to other processes on the machine), `time="wall"` wall seconds.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from bench import common


@dataclasses.dataclass(frozen=True)
class TimedStep:
    """One step on the clock: its shape (None: no model step), its measured host time, and its
    measured device time (model step and sampler), in the clock's kind of seconds."""

    signature: Optional[tuple]
    host: float
    device: float


def signature(record) -> Optional[tuple]:
    """What a step runs on the device: its kind, the model step's input shapes and the sampler
    call's shapes and options. Steps of one signature run the same executables."""
    if record.kind is None:
        return None
    sample = tuple(c.shape for c in record.calls if c.name == "sample")
    return (record.kind, record.shape, sample)


class ShapeClock:
    """Pools device times by step signature (see the module docstring)."""

    def __init__(self, time: str = "wall"):
        if time not in ("wall", "cpu"):
            raise ValueError(f"time must be 'wall' or 'cpu', got {time!r}")
        self.time = time
        self.runs: dict = collections.defaultdict(list)  # signature -> (wall, cpu) device seconds per step

    def observe(self, record) -> TimedStep:
        """Adds a step's device time to its signature's runs; returns the step on this clock."""
        sig = signature(record)
        calls = record.model_calls()
        wall, cpu = sum(c.seconds for c in calls), sum(c.cpu_seconds for c in calls)
        if sig is not None:
            self.runs[sig].append((wall, cpu))
        total, device = (record.seconds, wall) if self.time == "wall" else (record.cpu_seconds, cpu)
        return TimedStep(sig, total - device, device)

    def device_cost(self, sig: tuple, stat: str = "median") -> float:
        """A signature's device seconds: the median of its runs (stat="median") or their least ("min")."""
        k = 0 if self.time == "wall" else 1
        return common.shape_time([run[k] for run in self.runs[sig]], stat)

    def cost(self, step: TimedStep, stat: str = "median") -> float:
        """What the step is charged: its host time plus its signature's device cost."""
        if step.signature is None:
            return step.host
        return step.host + self.device_cost(step.signature, stat)

    def table(self) -> list[dict]:
        """The device times per signature, for the results file."""
        import numpy as np

        return [dict(signature=list(sig), count=len(v), cpu_median=float(np.median([c for _, c in v])),
                     cpu_min=min(c for _, c in v), wall_median=float(np.median([w for w, _ in v])),
                     wall_min=min(w for w, _ in v))
                for sig, v in sorted(self.runs.items(), key=str)]
