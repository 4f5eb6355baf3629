"""Several processes, one engine: JAX's own distributed runtime (`jax.distributed`).

Every process runs the same program on its local devices; together they see one global set of
devices (`jax.devices()`), over which the sharded engine (`jpaged.device.sharding`) lays out the
model and the KV pool exactly as on one process. Each process runs the same deterministic
scheduler on the same request stream: process 0 receives the requests and `broadcast` hands them
to the others, and the sampled tokens come back replicated, so every process takes the same
decisions, step after step.

    from jpaged.device import distributed
    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # first, before any JAX work
    llm = LLM(data_parallel_size=2, tensor_parallel_size=3)                   # on 2 x 3 global devices
    outs = llm.generate(prompts, params)   # process 0's prompts and params, run (and returned) everywhere

On CPUs the collectives go through gloo; each process's CPU devices are forced as usual
(`XLA_FLAGS=--xla_force_host_platform_device_count=N` before JAX starts).

What holds across processes: `LLM.generate` / `chat` broadcast process 0's requests and return the
outputs on every process; the CLI (`jpaged generate --coordinator-address HOST:PORT --num-processes N
--process-id I`) prints on process 0 alone. Preemption by swap works: swapped blocks come back
replicated, and every process keeps the same CPU swap pool. With `LLMEngine` directly, add the same
requests in the same order on every process (`broadcast` them from process 0) and abort none from
another thread: a process that schedules otherwise than the others waits in a collective forever.
Pausing an engine (`LLMEngine.save` / `restore`) is refused. Each process checks the pool against its
own memory (the whole pool's bytes: conservative). `broadcast` unpickles what process 0 sent: the
processes of one job trust one another.
"""

from __future__ import annotations

import pickle
import re

import jax
import numpy as np


def check_address(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Raises ValueError (one line) unless these name a coordinator HOST:PORT, a number of processes
    >= 1 and this process's id among them. Touches nothing: call it before anything loads."""
    if not (isinstance(num_processes, int) and not isinstance(num_processes, bool) and num_processes >= 1):
        raise ValueError(f"the number of processes (--num-processes) must be an integer >= 1, got {num_processes!r}")
    if not (isinstance(process_id, int) and not isinstance(process_id, bool) and 0 <= process_id < num_processes):
        raise ValueError(f"the process id (--process-id) must be in 0..{num_processes - 1} for {num_processes} "
                         f"process{'es' if num_processes > 1 else ''}, got {process_id!r}")
    match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):([0-9]{1,5})", str(coordinator_address))
    if coordinator_address is None or not match or not 0 < int(match[2]) < 65536:
        raise ValueError("the coordinator address (--coordinator-address) must be HOST:PORT, process 0's "
                         f"(e.g. 10.0.0.1:1234), got {coordinator_address!r}")


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               initialization_timeout: int = 300) -> None:
    """Joins this process to the others through `jax.distributed.initialize`, with CPU collectives
    through gloo. Call it in every process, before anything else uses JAX; `coordinator_address` is
    process 0's HOST:PORT (process 0 listens there). Waits up to `initialization_timeout` seconds
    for every process to join. Already joined (here or by `jax.distributed.initialize`) as this
    process among as many: does nothing."""
    check_address(coordinator_address, num_processes, process_id)
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
            raise ValueError(f"this process already runs as process {jax.process_index()} of {jax.process_count()}, "
                             f"not {process_id} of {num_processes}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=initialization_timeout)


def broadcast(value):
    """`value` as process 0 has it, on every process (any picklable object; with one process, `value`
    itself). Every process must call it at the same point of the program: it is a collective."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(value), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size)))
    padded = np.zeros(size, np.uint8)
    padded[:payload.size] = payload
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(padded)).tobytes())
