"""Observing the engine: one `StepRecord` per `LLMEngine.step()`, handed to every step observer.

    records = []
    engine.add_observer(records.append)      # any callable taking a StepRecord
    ...
    engine.remove_observer(records.append)

This is the one way to look inside a running engine without touching it: the record holds what
the step ran (its kind, rows, tokens and padded shape), every compiled executable it ran with its
time (`calls`), the block operations it applied, and the KV cache manager snapshot it left
(immutable: keep it, compare it, draw it). Benchmarks and notebooks build their clocks and
pictures from records; nothing outside the engine needs to patch it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from jpaged.core.kv_cache_manager import DeviceOps, KVCacheManager
from jpaged.device.runner import DeviceCall

# executables that compute the model step and sample from it (the rest are block copies and swaps)
MODEL_CALLS = ("prefill_step", "decode_step", "sample")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step, after it ran.

    index: this engine's step count before the step (0, 1, ...).
    kind: "decode" (every row computes one token), "prefill" (a row computes several: prompts or
      prompt chunks, with decode rows beside them in a ragged step), or None when the step ran no
      model step (nothing was runnable).
    num_rows: rows the model step computed (sequences; a fresh group of n samples prefills one).
    num_computed_tokens: tokens whose K/V the model step computed, unpadded (a decode step: its rows).
    num_padded_tokens: the same, padded to the step's shape bucket.
    num_sampled_tokens: tokens sampled (one per sequence that advanced).
    shape: the model step's input shapes (`ModelInputs.shape_key`): steps of equal shape run the
      same executable. None without a model step.
    calls: every compiled executable the step ran, in order, with its time (`DeviceCall`).
    ops: the swap and copy-on-write block operations the step applied before its model step.
    seconds / cpu_seconds: the step's wall and process CPU time, compilation (with the first run of
      a new executable) and the engine's own statistics bookkeeping excluded.
    compile_seconds: wall time spent building executables in this step.
    kv: the KV cache manager snapshot after the step.
    num_waiting / num_running / num_swapped: the scheduler's queues after the step (groups).
    preempted: request ids preempted in this step; finished: request ids that finished in it.
    """

    index: int
    kind: Optional[str]
    num_rows: int
    num_computed_tokens: int
    num_padded_tokens: int
    num_sampled_tokens: int
    shape: Optional[tuple]
    calls: tuple[DeviceCall, ...]
    ops: DeviceOps
    seconds: float
    cpu_seconds: float
    compile_seconds: float
    kv: KVCacheManager
    num_waiting: int
    num_running: int
    num_swapped: int
    preempted: tuple[str, ...]
    finished: tuple[str, ...]

    @property
    def compiled(self) -> bool:
        """Whether the step built a new executable."""
        return any(c.compile_seconds > 0 for c in self.calls)

    @property
    def device_seconds(self) -> float:
        """Wall time inside compiled executables (the rest of `seconds` is host time)."""
        return sum(c.seconds for c in self.calls)

    def model_calls(self) -> tuple[DeviceCall, ...]:
        """The model step and sampler runs (not the block copies and swaps)."""
        return tuple(c for c in self.calls if c.name in MODEL_CALLS)


StepObserver = Callable[[StepRecord], None]
