"""`Lockstep`: one `LLMEngine` over several processes, stepped by process 0 for a request stream that
arrives while it runs (`jpaged serve`).

Every process holds the same engine over the global devices and must run the same steps on the same
requests, in the same order: each step is one set of collectives. Process 0 takes the requests; before
each step it hands that step's intake to the others over a `jpaged.device.distributed.Link`, and
every process (process 0 included) applies it the same way, then steps:

    process 0                                       every other process
    lockstep.add_request / abort (any thread)       lockstep.follow():
      -> checked at once, queued in the intake        receive a step's intake
    lockstep.step() (the stepping thread):            apply it: engine.add_request / abort, in order
      send the intake, apply it, engine.step()        engine.step()

What makes the steps the same everywhere: a step's intake is applied between steps, from the stepping
thread alone, so the engine numbers sequences alike; an added request travels as its prompt token ids
(tokenized once, on process 0), its sampling parameters with the seed drawn on process 0 when the
request gives none (from a generator seeded by the engine's `seed`, as the engine draws them: a
one-process engine with the same requests gives the same tokens), its id and its arrival time (the
scheduler orders by it); aborts travel in the order they came, after the step's additions, as
`LLMEngine` drains its own queues. An abort that comes after its request finished is dropped alike on
every process.

On process 0 a `Lockstep` stands in for the engine (`jpaged.entrypoints.server` takes it as one):
`add_request`, `abort`, `step`, `has_unfinished` and `num_waiting` are its own, every other attribute
is the engine's. Never add or abort through the engine itself: a process that schedules otherwise
than the others waits in a collective forever. `stop()` closes the link in order, which tells the
others to end (their `follow()` returns). A process that goes away is the link's to notice (`Link`'s
`on_lost`), whatever the others are doing; `step` and `follow` then raise `LinkLost`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Optional

import numpy as np

from jpaged.core.sampling_params import SamplingParams
from jpaged.device.distributed import Link, LinkLost
from jpaged.engine.llm_engine import LLMEngine
from jpaged.engine.outputs import RequestMetrics, RequestOutput

logger = logging.getLogger("jpaged")

_FAILED_STEP_WAIT_S = 1.0  # after a failed step, how long to wait for the link to say a process went away


@dataclasses.dataclass(frozen=True)
class AddRequest:
    """A request as every process adds it: tokenized, its seed drawn."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float


@dataclasses.dataclass(frozen=True)
class Abort:
    """An abort as every process applies it (dropped alike where its request has finished)."""

    request_id: str


class Lockstep:
    """Process 0's engine, stepped in lockstep with the other processes' (see the module docstring);
    on the others, `follow()` runs process 0's steps. `link` is `distributed.open_link(...)`'s."""

    def __init__(self, engine: LLMEngine, link: Link):
        self.engine, self.link = engine, link
        self._lock = threading.Lock()
        self._intake: list = []  # AddRequest | Abort, in arrival order, for the next step
        self._in_flight: set[str] = set()  # added here and not finished (as far as the last step said)
        self._rng = np.random.default_rng(engine.config.seed)  # the seeds of requests that give none

    def __getattr__(self, name):  # everything else is the engine's: tokenize, chat_prompt, add_observer, ...
        return getattr(self.engine, name)

    # ---- process 0 ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        """`LLMEngine.add_request`, for the next step of every process: checked here at once (raises
        ValueError, queuing nothing, for a bad request), tokenized, its seed drawn."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.engine.tokenize(prompt)
        self.engine.check_request(ids, params)
        request_id = str(request_id)
        with self._lock:
            if request_id in self._in_flight:
                raise ValueError(f"request_id {request_id!r} is already in use: pick a unique id")
            if params.seed is None:
                params = dataclasses.replace(params, seed=int(self._rng.integers(2**32)))
            self._in_flight.add(request_id)
            self._intake.append(AddRequest(request_id, text, tuple(ids), params,
                                           arrival_time if arrival_time is not None else time.monotonic()))

    def abort(self, request_id: str) -> None:
        """`LLMEngine.abort`, at the next step of every process. Raises ValueError for an id not in flight."""
        request_id = str(request_id)
        with self._lock:
            if request_id not in self._in_flight:
                raise ValueError(f"no request {request_id!r} in flight to abort: it finished already or was never "
                                 "added")
            self._intake.append(Abort(request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._intake) or self.engine.has_unfinished()

    def num_waiting(self) -> int:
        """Requests added but not running: in the intake, queued in the engine, or waiting for KV blocks."""
        with self._lock:
            return sum(isinstance(item, AddRequest) for item in self._intake) + self.engine.num_waiting()

    def step(self) -> list[RequestOutput]:
        """One step of every process: hands the intake to the others, applies it here, steps. Raises
        LinkLost when another process went away: before the step (nothing of the intake has run), or
        during it (its collectives failed, and it failed its requests: that is not their failure)."""
        with self._lock:
            intake, self._intake = self._intake, []
        self.link.send(intake)
        outputs = _apply(self.engine, intake) + self.engine.step()
        # a process killed mid-step breaks the step's collectives here too (gloo: "connection reset"), as
        # its link closes: what failed is the job, not these requests, and the link's message says why
        if any(out.error is not None for out in outputs) and self.link.wait_lost(_FAILED_STEP_WAIT_S):
            raise LinkLost(self.link.lost)
        with self._lock:
            self._in_flight.difference_update(out.request_id for out in outputs if out.finished)
        return outputs

    def stop(self) -> None:
        """Tells the other processes to end, closing the link in order: their `follow()` returns once it
        has run every step sent before. Call it once no step runs any more."""
        self.link.close()

    # ---- every other process -----------------------------------------------------------------

    def follow(self) -> None:
        """Runs process 0's steps, each as it comes, until process 0 stops (returns). Raises LinkLost
        when process 0 went away (between steps: within a step, only the link's `on_lost` hears of it)."""
        while True:
            intake = self.link.receive()
            if intake is None:  # process 0 stopped
                self.link.close()
                return
            _apply(self.engine, intake)
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 - as process 0's loop: the step failed alike everywhere
                logger.exception("an engine step raised")


def _apply(engine: LLMEngine, intake: list) -> list[RequestOutput]:
    """Adds and aborts a step's intake, in order. Returns a failed output for each request the engine
    refused (all processes alike; process 0 checked them, so never unless the engine's checks change)."""
    failed = []
    for item in intake:
        if isinstance(item, Abort):
            try:
                engine.abort(item.request_id)
            except ValueError:
                pass  # finished meanwhile
            continue
        try:
            prompt = {"prompt": item.prompt, "prompt_token_ids": list(item.prompt_token_ids)}
            engine.add_request(item.request_id, prompt, item.params, arrival_time=item.arrival_time)
        except ValueError as e:
            failed.append(RequestOutput(item.request_id, item.prompt, list(item.prompt_token_ids), [], True,
                                        RequestMetrics(item.arrival_time, None, None, time.monotonic()),
                                        f"ValueError: {e}"))
    return failed
