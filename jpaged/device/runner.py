"""The device side of a step: packs the scheduler's rows into shape buckets, runs the jitted
`prefill_step` / `decode_step`, samples, and applies the block operations (copy-on-write, swap).
`prefill_step` runs every step in which a row computes several tokens: whole prompts, prompt chunks
over cached context and, in a ragged step, the decode rows beside them; `decode_step` every step of
one token a row.

Step functions are pure, `step(params, kv_cache, inputs) -> (kv_cache, logits)`, jitted with the
cache donated, so a step writes only its new tokens' K/V into the pool. Every distinct padded shape
is compiled ahead of time once (`jit(...).lower(...).compile()`) and its new executable run once
untimed (every executable here is idempotent: a step rewrites the same K/V into the same slots),
so compilations are counted and their time, first run included, kept out of timings. Each timed
run is logged as a `DeviceCall` (`take_calls()`), which the engine hands to its step observers.

Sharding (`jpaged.device.sharding`): given a `ShardingStrategy` and a `Mesh`, the runner places the
parameters and the pool with the strategy's shardings, compiles every executable with them as
in/out shardings (the pool donated, its output sharding its input's), runs the attention backend
under `shard_map` on each device's heads, and returns logits replicated. It is the one owner of
the device state: the mesh, the placed parameters, the pool and the executables.

Data parallel (the pool split by blocks over `num_partitions` ranks): rank r owns global blocks
[r * P, (r + 1) * P). The host hands over rows in global ids; `make_inputs` packs each rank's rows
apart in local ids (global - r * P) and stacks them, and the whole step runs per device under
`shard_map` (its own tokens, its own blocks, replicated weights: no collective), the logits
gathered back into the rows' order at the end. Copy-on-write pairs go to their rank in local ids;
swaps address the global pool.

Several processes (`jax.distributed`, `jpaged.device.distributed`): the same code on the global
devices. Every process passes the same host values (rows, block ids, swapped blocks); inputs split
by rank are placed with `jax.device_put` (jit takes numpy inputs replicated only, there), and what
comes back to the host (sampled tokens, blocks swapped out) is replicated, so every process reads it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
import types
from typing import Callable, NamedTuple, Optional, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.device.batch import (BlockTableCache, DataParallelInputs, ModelInputs, StepShapes, bucket, bucket_values,
                                 pack_rows, row_bucket, stack_inputs)
from jpaged.device.config import ModelConfig
from jpaged.device.kv_cache import KVCache, back_with_huge_pages, pool_shape
from jpaged.device.model import compute_logits, forward
from jpaged.device.params import BF16_BITS, LlamaParams, single_cpu_device, unstack_layers
from jpaged.device.quant import IN_AXES, QuantizedWeight
from jpaged.device.sampler import SamplingInputs, packed, sample, unpacked
from jpaged.device.sharding import ShardedBackend, ShardingStrategy, replicate_kv_heads

P = jax.sharding.PartitionSpec


class SampleRow(NamedTuple):
    """One token to draw: from logits row `row`, with these settings (a tuple: a step builds one a
    sequence, and `ModelRunner.sample` reads them as columns)."""

    row: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    sample_index: int
    step: int
    draft: int = -1  # speculative decoding: the draft token this row verifies (-1: none)
    allowed: Optional[np.ndarray] = None  # structured output: the row's packed allowed-token bitmask


@dataclasses.dataclass(frozen=True)
class DeviceCall:
    """One timed run of a compiled executable.

    name: "prefill_step", "decode_step", "sample", "copy_blocks", "read_blocks", "write_blocks" or
      "feed_tokens" (async scheduling: a step's inputs fed the samples of the step before).
    shape: the shapes and dtypes of its array arguments (with its static options), which key its
      executable: calls of the same name and shape run the same executable.
    seconds / cpu_seconds: wall and process CPU time of the run, synchronised (block_until_ready).
    compile_seconds / compile_cpu_seconds: wall and process CPU time spent building its executable
      for this call, its untimed first run included (0.0 when the executable already existed).
    """

    name: str
    shape: tuple
    seconds: float
    cpu_seconds: float
    compile_seconds: float = 0.0
    compile_cpu_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What `ModelRunner.warm_up` did.

    executables: every executable the shapes need, by name ("prefill_step", "decode_step", "sample",
      "copy_blocks", "read_blocks", "write_blocks"); built: how many of them it built (the others
      existed already); cache_hits: of those, how many JAX's persistent compilation cache gave instead
      of compiling them; seconds: its wall time.
    """

    executables: dict
    built: int
    cache_hits: int
    seconds: float

    @property
    def num_executables(self) -> int:
        return sum(self.executables.values())


# the sampler's static variants (use_filter, use_random): greedy, random draws, filtered draws
_SAMPLE_MODES = ((False, False), (False, True), (True, True))


# attention backend name -> whether it reads the attention plan / the block tables, in (prefill, decode)
# steps (what a backend does not read is packed at one entry: it adds no shape). Others: everything.
_READS = {"native": ((False, False), (True, True)), "pallas": ((False, False), (True, True)),
          "xla": ((True, True), (False, False))}


# decode steps of at most this many rows run their layers unrolled over per-layer views of the weights, on
# one CPU device (`ModelRunner`'s `unrolled_max_rows`); more rows, or more devices: the layer scan
UNROLLED_MAX_ROWS = 8


def default_unrolled_max_rows(params: LlamaParams, *, sharded: bool) -> int:
    """`UNROLLED_MAX_ROWS` for plain float parameters on one CPU device; else 0 (the scan): for int8 weights,
    float rows (`QuantizedWeight`s, which the scan hands the native kernel as stacks to read in place), and
    bfloat16 weights as plain bits (without the native library: each bit-cast unrolled would be a copy of
    the weight). Why, measured on the default model's one-row decode step: a layer scan slices each layer's
    plain weights out of the stack, which XLA's CPU backend does by copying them before their products, a
    second pass over every weight; unrolled, the products read them where they lie (Intel Xeon, 2 cores:
    float32 39 -> 27 ms; AMD EPYC, 2 cores: the scan 17.0 against 15.4 ms). Weights the native kernel reads
    from the stack go the other way: int8 13.4 -> 14.5 ms unrolled (Intel Xeon), and bfloat16 rows, once
    the scan stopped copying them, ran faster in the scan (AMD EPYC with AVX512-BF16, one process
    alternating the two: one row 7.7-8.0 ms against 8.6-9.0, two rows 8.9 against 10.0, three even), and
    float32 rows ran even (one row 12.4 ms either way, the same machine).
    The price of unrolling is compile time too (a 30-layer step about 5x the scan's), hence few rows only."""
    if sharded or single_cpu_device(params.layers) is None:
        return 0
    dense = [getattr(params.layers, name) for name in IN_AXES if name not in ("embed", "lm_head")]
    if any(isinstance(w, QuantizedWeight) or w.dtype == BF16_BITS for w in dense if w is not None):
        return 0
    return UNROLLED_MAX_ROWS


# executable name -> position of the KV cache it takes donated (and returns, first if several outputs)
_DONATED = {"prefill_step": 1, "decode_step": 1, "draft_step": 1, "copy_blocks": 0, "write_blocks": 0}


def _step(params, cache, inputs, *, config, backend, experts=None):
    cache, hidden = forward(params, cache, inputs, config=config, backend=backend, experts=experts)
    return cache, compute_logits(params, hidden[inputs.logits_index], config=config)


def _draft_step(params, cache, inputs, *, config, backend, num_layers: int, experts=None):
    """Self-drafting: the first `num_layers` layers, the final norm and the LM head on decode rows
    (their K/V written for those layers alone); returns (cache, each row's argmax token i32[B])."""
    cache, hidden = forward(params, cache, inputs, config=config, backend=backend, num_layers=num_layers,
                            experts=experts)
    logits = compute_logits(params, hidden[inputs.logits_index], config=config)
    return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _data_parallel_step(params, cache, inputs, row_index, *, config, backend, mesh, pool_spec, axis, experts=None):
    """`_step` on every data rank's own rows and pool shard (`inputs`: stacked per rank); the logits of
    all ranks' rows, flattened rank-major, then picked in the step's row order (`row_index`). Only the
    data axis is manual: a tensor-parallel split on the other axis stays with the compiler (and the
    attention backend's own `shard_map` over it)."""
    def local(params, cache, inputs):
        cache, logits = _step(params, cache, jax.tree.map(lambda x: x[0], inputs), config=config, backend=backend,
                              experts=experts)
        return cache, logits[None]

    pool = KVCache(kv=pool_spec)
    params_spec = jax.tree.map(lambda _: P(), params)
    cache, logits = jax.shard_map(local, mesh=mesh, in_specs=(params_spec, pool, P(axis)), out_specs=(pool, P(axis)),
                                  axis_names={axis}, check_vma=False)(params, cache, inputs)
    return cache, logits.reshape(-1, logits.shape[-1])[row_index]


def _data_parallel_copy(cache, pairs, *, backend, mesh, pool_spec, axis):
    """Copy-on-write per data rank: `pairs` i32[ranks, P, 2] in each rank's local block ids."""
    kv = jax.shard_map(lambda kv, pairs: backend.copy_blocks(kv, pairs[0]), mesh=mesh,
                       in_specs=(pool_spec, P(axis)), out_specs=pool_spec,
                       axis_names={axis}, check_vma=False)(cache.kv, pairs)
    return KVCache(kv=kv)


class _LocalRow:
    """A row in its data rank's local block ids (the fields `pack_rows` reads)."""

    __slots__ = ("token_ids", "start_position", "slots", "block_table")

    def __init__(self, token_ids, start_position, slots, block_table):
        self.token_ids, self.start_position, self.slots, self.block_table = token_ids, start_position, slots, block_table


_IDLE_ROW = _LocalRow([0], 0, [0], [0])  # a rank with no row this step computes one token into its null block


class Sampled(NamedTuple):
    """A sampler run's output on the device: `token_ids` i32[B] (which a later step may be fed) and every
    field `packed` into one array, which the host reads (`ModelRunner.fetch_samples`)."""

    token_ids: jax.Array
    packed: jax.Array


@functools.partial(jax.jit, static_argnames=("num_top", "use_filter", "use_random"))
def _sample_packed(logits, rows, params, *, num_top: int, use_filter: bool, use_random: bool) -> Sampled:
    out = sample(logits, rows, params, num_top=num_top, use_filter=use_filter, use_random=use_random)
    return Sampled(out.token_ids, packed(out))


def _feed_tokens(token_ids, source, sampled):
    """Packed input tokens with token i replaced by `sampled[source[i]]` where source[i] >= 0."""
    return jnp.where(source >= 0, sampled[jnp.maximum(source, 0)], token_ids)


def _copy_blocks(cache, pairs, *, backend):
    return KVCache(kv=backend.copy_blocks(cache.kv, pairs))


def _read_blocks(cache, block_ids):
    return cache.kv[:, block_ids]


def _write_blocks(cache, block_ids, blocks):
    return KVCache(kv=cache.kv.at[:, block_ids].set(blocks))


class ModelRunner:
    """Holds the parameters and the KV cache on the device; packs rows into bucketed step inputs.

    Shape buckets (`jpaged.device.batch`): powers of two, with finer steps for the pairs, a
    prefill's packed tokens and a decode step's rows. Attention tiles: prefill query tiles of
    `prefill_q_tile` tokens and key tiles of about `prefill_key_tile`; decode query tiles of one
    token and key tiles of about `decode_key_tile` (key tiles are whole blocks; a row's last one is
    mostly padding, gathered all the same). The defaults were the fastest measured on the XLA CPU
    path (`bench/README.md`). `num_compilations` counts every executable built (steps, sampler,
    block ops); `num_blocks` and `num_cpu_blocks` are the sizes of the device and CPU pools.

    `sharding` and `mesh` (both or neither): lay the parameters and the pool out over the mesh's
    devices (see the module docstring). With fewer KV heads than the tensor-parallel size, each KV
    head is stored `kv_head_replication` times (in wk, wv and the pool: `pool_config`).

    `unrolled_max_rows`: decode steps of at most this many rows run the layers unrolled, over one
    `LayerParams` a layer (`jpaged.device.params.unstack_layers`: on a CPU, views sharing the stack's
    memory) instead of the layer scan; 0: never. Default: `default_unrolled_max_rows`.
    """

    def __init__(self, config: ModelConfig, params: LlamaParams, *, num_blocks: int, block_size: int,
                 dtype=jnp.float32, backend, num_cpu_blocks: int = 0,
                 prefill_q_tile: int = 64, prefill_key_tile: int = 128, decode_key_tile: int = 64,
                 sharding: ShardingStrategy | None = None, mesh: jax.sharding.Mesh | None = None,
                 unrolled_max_rows: Optional[int] = None):
        if (sharding is None) != (mesh is None):
            raise ValueError("give a ModelRunner both sharding and mesh, or neither")
        if sharding is not None:
            sharding.check(mesh, config)
        self.sharding, self.mesh = sharding, mesh
        self.num_partitions = sharding.axis_size("blocks", mesh) if sharding is not None else 1
        if num_blocks % self.num_partitions or num_blocks // self.num_partitions < 2:
            raise ValueError(f"{num_blocks} blocks do not split into {self.num_partitions} data-parallel partitions "
                             "of at least 2 blocks each (each has its null block)")
        self.kv_head_replication = sharding.kv_head_replication(mesh, config) if sharding is not None else 1
        # the pool's geometry: the model's, with each KV head stored kv_head_replication times
        self.pool_config = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * self.kv_head_replication)
        if params.lm_head is None:  # tied embeddings: keep a [hidden, vocab] copy so the LM head is a plain
            params = params.replace(lm_head=jnp.asarray(params.embed.T))  # matmul (no transpose per step)
        if sharding is not None:
            params = replicate_kv_heads(params, self.kv_head_replication)
            params = jax.device_put(params, sharding.param_shardings(mesh, params))
            if sharding.axis_size("kv_heads", mesh) > 1:  # tensor parallel: attention per device on its heads
                backend = ShardedBackend(backend, mesh, sharding)
        self.config, self._params, self.backend = config, params, backend
        if unrolled_max_rows is None:
            unrolled_max_rows = default_unrolled_max_rows(params, sharded=sharding is not None)
        self.unrolled_max_rows = unrolled_max_rows
        # the same parameters, one LayerParams a layer, for decode steps of few rows (None: never unrolled)
        self._unrolled_params = params.replace(layers=unstack_layers(params.layers)) if unrolled_max_rows else None
        # their `_arg_key`s, walked once: ~270 leaves unrolled, 0.13 ms at every step (AMD EPYC)
        self._params_keys = {id(p): _arg_key(p) for p in (self._params, self._unrolled_params) if p is not None}
        self.block_size = block_size
        self.prefill_q_tile = prefill_q_tile
        self.prefill_k_tile = block_size * max(1, prefill_key_tile // block_size)  # whole blocks
        self.decode_k_tile = block_size * max(1, decode_key_tile // block_size)
        self.kv_dtype = jnp.dtype(dtype)  # the pool's dtype (stored as `backend.storage_dtype` says)
        storage = backend.storage_dtype(dtype)
        self.cache = self._new_pool(pool_shape(self.pool_config, num_blocks, block_size), storage)
        self.cpu_kv = np.zeros(pool_shape(self.pool_config, num_cpu_blocks, block_size), np.dtype(storage))
        # how the sparse layers of a mixture of experts are split (`jpaged.device.moe`; None: not at all)
        experts = sharding.expert_sharding(mesh) if sharding is not None else None
        step = functools.partial(_step, config=config, backend=backend, experts=experts)
        draft = functools.partial(_draft_step, config=config, backend=backend, experts=experts)
        copy = functools.partial(_copy_blocks, backend=backend)
        self._moved = None  # the sharding of blocks moved by a swap (sharded runners)
        if sharding is None:
            self._jits = {
                "prefill_step": jax.jit(step, donate_argnums=(1,)),
                "decode_step": jax.jit(step, donate_argnums=(1,)),
                "draft_step": jax.jit(draft, donate_argnums=(1,), static_argnames=("num_layers",)),
                "copy_blocks": jax.jit(copy, donate_argnums=(0,)),
                "read_blocks": jax.jit(_read_blocks),
                "write_blocks": jax.jit(_write_blocks, donate_argnums=(0,)),
            }
        else:  # every argument and result placed as the strategy says; the pool's output sharding is its input's
            ps, rep = sharding.param_shardings(mesh, params), sharding.replicated(mesh)
            block = sharding.pool_sharding(mesh)
            pool = KVCache(kv=block)
            if self.num_partitions > 1:
                axis = sharding.rule_map["blocks"]
                # the manual (data) axis alone in the specs: the pool by blocks
                specs = dict(mesh=mesh, pool_spec=P(*(a if a == axis else None for a in block.spec)), axis=axis)
                step = functools.partial(_data_parallel_step, config=config, backend=backend, experts=experts, **specs)
                copy = functools.partial(_data_parallel_copy, backend=backend, **specs)
                by_rank = jax.sharding.NamedSharding(mesh, P(axis))
                step_in, copy_in = (ps, pool, by_rank, rep), (pool, by_rank)
            else:
                step_in, copy_in = (ps, pool, rep), (pool, rep)
            # blocks moved by a swap: as the pool, but any number of them (never split by blocks); over several
            # processes, whole on every device, so that each process reads them to its host (its own swap pool)
            moved = self._moved = jax.sharding.NamedSharding(mesh, P() if jax.process_count() > 1 else P(
                *(None if i == 1 else a for i, a in enumerate(block.spec))))
            if self.num_partitions == 1:  # self-drafting: not over data-parallel partitions
                self._draft_jit = jax.jit(draft, donate_argnums=(1,), static_argnames=("num_layers",),
                                          in_shardings=step_in, out_shardings=(pool, rep))
            self._jits = {
                "prefill_step": jax.jit(step, donate_argnums=(1,), in_shardings=step_in, out_shardings=(pool, rep)),
                "decode_step": jax.jit(step, donate_argnums=(1,), in_shardings=step_in, out_shardings=(pool, rep)),
                "copy_blocks": jax.jit(copy, donate_argnums=(0,), in_shardings=copy_in, out_shardings=pool),
                "read_blocks": jax.jit(_read_blocks, in_shardings=(pool, rep), out_shardings=moved),
                "write_blocks": jax.jit(_write_blocks, donate_argnums=(0,), in_shardings=(pool, rep, moved),
                                        out_shardings=pool),
            }
        if sharding is not None and self.num_partitions == 1:
            self._jits["draft_step"] = self._draft_jit
        self._jits["sample"] = _sample_packed
        if sharding is None:
            self._jits["feed_tokens"] = jax.jit(_feed_tokens)
        else:  # the sampled tokens come replicated; so do the packed inputs
            rep = sharding.replicated(mesh)
            self._jits["feed_tokens"] = jax.jit(_feed_tokens, in_shardings=(rep, rep, rep), out_shardings=rep)
        self._executables: dict = {}
        self.num_warm_up_compilations = 0  # executables `warm_up` built
        self.num_compilations_after_warm_up = 0  # executables built by runs since the last warm-up (or ever)
        self._calls: list[DeviceCall] = []
        self._table_cache = BlockTableCache()  # the block tables of the last step packed (`make_inputs`)
        self.compile_seconds = 0.0  # building executables, their untimed first runs included
        self.device_seconds = 0.0  # time inside compiled executables, synchronised (the rest of a step is host time)
        # whether `_run` waits for each run's results (and times it); False (async scheduling): a run is
        # dispatched and returns at once, its `DeviceCall.seconds` the dispatch's, and the host reads
        # results when it needs them
        self.synchronous = True

    def _new_pool(self, shape, dtype, kv=None) -> KVCache:
        """A pool of `shape` (zeros, or the host array `kv`), placed as the strategy says."""
        if kv is not None:
            if self.sharding is None:
                return KVCache(kv=jnp.asarray(kv))
            return KVCache(kv=jax.device_put(kv, self.sharding.pool_sharding(self.mesh)))
        if self.sharding is None:
            cache = KVCache(kv=jnp.zeros(shape, dtype))
        else:  # built in place, each device its own shard (never the whole pool on one device)
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.sharding.pool_sharding(self.mesh))
            cache = KVCache(kv=zeros())
        back_with_huge_pages(cache)  # on CPUs: attention reads blocks scattered over the pool
        return cache

    @property
    def params(self) -> LlamaParams:
        """The parameters as placed (read-only: the per-layer views of unrolled decode steps share their
        memory; another set of weights is another runner)."""
        return self._params

    @property
    def devices(self) -> tuple:
        """The devices the runner's state lives on."""
        return tuple(self.mesh.devices.flat) if self.mesh is not None else (self.cache.kv.devices().pop(),)

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_kv.shape[1]

    @property
    def num_compilations(self) -> int:
        """Every executable built: by `warm_up` and by runs (`num_warm_up_compilations`,
        `num_compilations_after_warm_up`, which counts those of runs since the last warm-up)."""
        return len(self._executables)

    @property
    def executables(self) -> dict:
        """Every executable built so far, by (name, static options, argument shapes): read-only."""
        return types.MappingProxyType(self._executables)

    @property
    def pool_lost(self) -> bool:
        """Whether the KV pool's buffers are gone: an executable that took them donated failed."""
        return self.cache.kv.is_deleted()

    def reset_pool(self) -> None:
        """A new, zeroed KV pool of the same shape (after `pool_lost`)."""
        self.cache = self._new_pool(self.cache.kv.shape, self.cache.kv.dtype)

    def pool_state(self) -> dict:
        """The KV pools' contents (device blocks `kv`, CPU swap blocks `cpu_kv`), each [layers, blocks, 2,
        block_size, kv_heads, head_dim] in the storage dtype: what a paused engine saves."""
        return {"kv": self.cache.kv, "cpu_kv": self.cpu_kv}

    def load_pool_state(self, state: dict) -> None:
        """Replaces the pools' contents with `pool_state()`'s arrays of the same shapes (16-bit values
        saved under another storage dtype of the same width are bit-cast, not converted)."""
        def like(array, have):
            array = np.asarray(array)
            if array.shape != have.shape:
                raise ValueError(f"a KV pool of shape {array.shape} does not fit this runner's {have.shape}")
            if array.dtype != have.dtype:
                if array.dtype.itemsize != have.dtype.itemsize:
                    raise ValueError(f"a KV pool stored as {array.dtype} does not fit this runner's {have.dtype}")
                array = array.view(have.dtype)
            return array

        self.cache = self._new_pool(self.cache.kv.shape, self.cache.kv.dtype, like(state["kv"], self.cache.kv))
        self.cpu_kv = like(state["cpu_kv"], self.cpu_kv)

    def take_calls(self) -> tuple[DeviceCall, ...]:
        """The timed executable runs since the last call, oldest first."""
        calls, self._calls = tuple(self._calls), []
        return calls

    def _run(self, name: str, *args, **static):
        """Runs executable `name` on `args`, building it first if this shape is new. A new
        executable runs once untimed before the timed run: every executable here is idempotent,
        and the cache it takes donated (`_DONATED`) is threaded from the first run to the second.
        Not `synchronous`: the run is dispatched and not waited for (its seconds are the dispatch's)."""
        shape = _shape_key(args, static, self._params_keys)
        executable = self._executables.get((name, shape))
        compile_seconds = compile_cpu_seconds = 0.0
        if executable is None:
            t0, c0 = time.perf_counter(), time.process_time()
            executable = self._jits[name].lower(*args, **static).compile()
            self._executables[(name, shape)] = executable
            self.num_compilations_after_warm_up += 1
            out = jax.block_until_ready(executable(*args))
            if name in _DONATED:  # the donated cache was consumed: the timed run takes the new one
                i = _DONATED[name]
                args = args[:i] + (out[0] if isinstance(out, tuple) else out,) + args[i + 1:]
            compile_seconds, compile_cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        out = executable(*args)
        if self.synchronous:
            out = jax.block_until_ready(out)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        self.compile_seconds += compile_seconds
        self.device_seconds += seconds
        self._calls.append(DeviceCall(name, shape, seconds, cpu_seconds, compile_seconds, compile_cpu_seconds))
        return out

    # ---- model steps -------------------------------------------------------------------------

    def make_inputs(self, rows: Seq, *, decode: bool, shapes: Optional[StepShapes] = None
                    ) -> ModelInputs | DataParallelInputs:
        """Packs `rows` (see `jpaged.device.batch.pack_rows`; the scheduler's `Row`s): decode rows are
        one token each, prefill rows any number; at the buckets of `shapes` (`step_shapes`) when given.
        Data parallel: each rank's rows apart, stacked (`shapes` is for one partition: not taken)."""
        if decode and any(len(r.token_ids) != 1 for r in rows):
            raise ValueError("a decode row computes exactly one token")
        if self.num_partitions > 1:
            if shapes is not None:
                raise ValueError("step shapes are for one data-parallel partition: pack these rows without")
            return self._data_parallel_inputs(rows, decode=decode)
        if shapes is not None:
            return shapes.pack(rows, decode=decode, table_cache=self._table_cache)
        return self._pack(rows, decode=decode)

    def step_shapes(self, *, max_num_seqs: int, max_prefill_tokens: int, max_model_len: int, max_width: int,
                    prefix_caching: bool = False) -> StepShapes:
        """The shape buckets of an engine with these limits on this runner (its tiles, and what its
        attention backend reads): see `jpaged.device.batch.StepShapes`."""
        plan, tables = _READS.get(getattr(self.backend, "name", None), ((True, True), (True, True)))
        return StepShapes(block_size=self.block_size, q_tile=self.prefill_q_tile, prefill_k_tile=self.prefill_k_tile,
                          decode_k_tile=self.decode_k_tile, max_num_seqs=max_num_seqs,
                          max_prefill_tokens=max_prefill_tokens, max_model_len=max_model_len, max_width=max_width,
                          prefix_caching=prefix_caching, reads_plan=plan, reads_tables=tables)

    def _pack(self, rows: Seq, *, decode: bool) -> ModelInputs:
        if decode:
            return pack_rows(rows, block_size=self.block_size, q_tile=1, k_tile=self.decode_k_tile)
        return pack_rows(rows, block_size=self.block_size, q_tile=self.prefill_q_tile, k_tile=self.prefill_k_tile)

    def _data_parallel_inputs(self, rows: Seq, *, decode: bool) -> DataParallelInputs:
        per, bs = self.num_blocks // self.num_partitions, self.block_size
        by_rank: list[list] = [[] for _ in range(self.num_partitions)]
        where = []
        for r in rows:
            rank = r.block_table[0] // per
            base = rank * per
            table = [b - base for b in r.block_table]
            # entries a sliding window released are the rank's null block (local 0), leading ones only
            if not all(0 <= b < per for b in table) or table[-1] == 0:
                raise ValueError(f"a row's blocks {list(r.block_table)} are not all in data-parallel partition {rank}")
            where.append((rank, len(by_rank[rank])))
            by_rank[rank].append(_LocalRow(r.token_ids, r.start_position, [s - base * bs for s in r.slots], table))
        inputs = stack_inputs([self._pack(rank_rows or [_IDLE_ROW], decode=decode) for rank_rows in by_rank])
        width = inputs.logits_index.shape[1]
        row_index = np.zeros(row_bucket(len(rows)), np.int32)
        row_index[:len(rows)] = [rank * width + j for rank, j in where]
        return DataParallelInputs(inputs=inputs, row_index=row_index)

    def _by_rank(self, tree):
        """Host arrays stacked by data rank, placed on their ranks' devices: jit takes numpy inputs
        replicated only, when the ranks' devices belong to several processes (each has the same values)."""
        return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, P(self.sharding.rule_map["blocks"])))

    def execute(self, rows: Seq, *, decode: bool) -> jax.Array:
        """Runs one step over `rows`; returns the logits f32[padded rows, vocab] (on the device)."""
        return self.run_step(self.make_inputs(rows, decode=decode), decode=decode)

    def run_step(self, inputs: ModelInputs, *, decode: bool) -> jax.Array:
        """Runs one step over packed `inputs` (`make_inputs`); returns the logits as `execute`."""
        name = "decode_step" if decode else "prefill_step"
        if isinstance(inputs, DataParallelInputs):
            placed = self._by_rank(inputs.inputs)
            self.cache, logits = self._run(name, self.params, self.cache, placed, inputs.row_index)
        else:
            params = self._step_params(decode, inputs.logits_index.shape[0])
            self.cache, logits = self._run(name, params, self.cache, inputs)
        return logits

    def _step_params(self, decode: bool, rows: int) -> LlamaParams:
        """The parameters a step of `rows` (padded) rows takes: one LayerParams a layer for a decode step
        within `unrolled_max_rows` (its layers unrolled), else the stack (the layer scan)."""
        if decode and self._unrolled_params is not None and rows <= self.unrolled_max_rows:
            return self._unrolled_params
        return self.params

    def feed_tokens(self, inputs: ModelInputs, source: np.ndarray, sampled: jax.Array) -> ModelInputs:
        """Running ahead (async scheduling): `inputs` with packed token i replaced by `sampled[source[i]]`
        where source[i] >= 0 (i32[N]; -1: keep it), so that a row's input is its sequence's sample in the
        step before, taken on the device (`sampled`: a `dispatch_sample` run's `token_ids`, of N rows).

        Where source is 0..N-1 (the rows keep their sequences' order and fill the bucket: one stream, or
        a full bucket of streams), the packed tokens are `sampled` itself, and no executable runs: on one
        device, where it is already placed as the step reads it. That run cost a decode step at one row
        about 0.3 ms of its 7-8 (bfloat16, AMD EPYC, 2 cores)."""
        n = inputs.token_ids.shape[0]
        if self.sharding is None and sampled.shape == (n,) and np.array_equal(source, np.arange(n)):
            return inputs.replace(token_ids=sampled)
        return inputs.replace(token_ids=self._run("feed_tokens", inputs.token_ids, source, sampled))

    def sample(self, logits: jax.Array, rows: Seq[SampleRow], num_top: int, *,
               shapes: Optional[StepShapes] = None) -> dict[str, np.ndarray]:
        """Draws one token per sample row. Returns numpy arrays token_ids, logprobs, top_ids, top_logprobs.

        With `shapes` (an engine's buckets), the sampler runs on as many sample rows as `logits` has rows
        (several runs when there are more samples: a prefill's groups of n samples) and computes
        `shapes.top_bucket(num_top)` top log-probabilities, so that its shapes are those `warm_up` built."""
        return self.fetch_samples(self.dispatch_sample(logits, rows, num_top, shapes=shapes))

    def dispatch_sample(self, logits: jax.Array, rows: Seq[SampleRow], num_top: int, *,
                        shapes: Optional[StepShapes] = None) -> list[tuple]:
        """`sample`'s runs, dispatched and not read: (its `Sampled` output on the device, its rows) for each
        run, for `fetch_samples`. A run's `token_ids` (i32[its padded rows]) may feed a later step."""
        if shapes is None:
            size, top = row_bucket(len(rows)), bucket(num_top) if num_top else 0
        else:
            size, top = logits.shape[0], shapes.top_bucket(num_top)
        return [self._sample(logits, rows[i:i + size], size, top) for i in range(0, max(len(rows), 1), size)]

    @staticmethod
    def fetch_samples(parts: list[tuple]) -> dict[str, np.ndarray]:
        """The samples of `dispatch_sample`'s runs, read to the host (waiting for them): as `sample`. One
        array a run (`Sampled.packed`), read by `np.asarray`: `jax.device_get` cost ~0.1 ms more a read."""
        rows = [np.asarray(out.packed)[:k] for out, k in parts]
        return unpacked(rows[0] if len(rows) == 1 else np.concatenate(rows))

    def _sample(self, logits, rows: Seq[SampleRow], size: int, num_top: int) -> tuple:
        dtypes = {"temperature": np.float32, "top_p": np.float32, "seed": np.uint32}
        padding = {"top_p": 1.0, "draft": -1}
        columns = {}
        fields = SampleRow._fields
        transposed = list(zip(*rows)) if rows else [()] * len(fields)
        for name, values in zip(fields[:-1], transposed):  # "allowed" (last) apart
            columns[name] = np.full(size, padding.get(name, 0), dtypes.get(name, np.int32))
            columns[name][:len(values)] = values
        allowed = None
        masks = [(i, mask) for i, mask in enumerate(transposed[-1]) if mask is not None]
        if masks:  # every other row allows everything
            allowed = np.full((size, masks[0][1].shape[-1]), -1, np.int32)
            for i, mask in masks:
                allowed[i] = mask
        params = SamplingInputs(temperature=columns["temperature"], top_k=columns["top_k"], top_p=columns["top_p"],
                                seed=columns["seed"], sample_index=columns["sample_index"],
                                step=columns["step"], draft=columns["draft"], allowed=allowed)
        n = len(rows)  # the settings as the rows give them (the padding draws nothing)
        random = columns["temperature"][:n] > 0
        use_random = bool(random.any())
        use_filter = use_random and bool((random & ((columns["top_k"][:n] > 0) | (columns["top_p"][:n] < 1.0))).any())
        return self._run("sample", logits, columns["row"], params, num_top=num_top, use_filter=use_filter,
                         use_random=use_random), len(rows)

    # ---- block operations --------------------------------------------------------------------

    def copy_blocks(self, pairs: Seq[tuple[int, int]]) -> None:
        """All of a step's copy-on-write copies in one call (padded with (0, 0) null copies)."""
        if not pairs:
            return
        if self.num_partitions > 1:  # each rank its own pairs, in local ids (a pair never crosses ranks)
            per = self.num_blocks // self.num_partitions
            by_rank: list[list] = [[] for _ in range(self.num_partitions)]
            for src, dst in pairs:
                by_rank[src // per].append((src % per, dst % per))
            padded = np.zeros((self.num_partitions, bucket(max(map(len, by_rank))), 2), np.int32)
            for rank, rank_pairs in enumerate(by_rank):
                padded[rank, :len(rank_pairs)] = rank_pairs or np.zeros((0, 2))
            padded = self._by_rank(padded)
        else:
            padded = np.zeros((bucket(len(pairs)), 2), np.int32)
            padded[:len(pairs)] = pairs
        self.cache = self._run("copy_blocks", self.cache, padded)

    def swap_out(self, mapping: Seq[tuple[int, int]]) -> None:
        """Copies device blocks to CPU blocks: mapping of (device_block_id, cpu_block_id)."""
        if not mapping:
            return
        n = len(mapping)
        device_ids = np.zeros(bucket(n), np.int32)  # padded with the null block: one executable per bucket
        device_ids[:n] = [d for d, _ in mapping]
        cpu_ids = np.asarray([c for _, c in mapping])
        self.cpu_kv[:, cpu_ids] = jax.device_get(self._run("read_blocks", self.cache, device_ids))[:, :n]

    def swap_in(self, mapping: Seq[tuple[int, int]]) -> None:
        """Copies CPU blocks back to device blocks: mapping of (cpu_block_id, device_block_id)."""
        if not mapping:
            return
        n = bucket(len(mapping))
        cpu_ids = np.zeros(n, np.int32)
        device_ids = np.zeros(n, np.int32)
        cpu_ids[:len(mapping)], device_ids[:len(mapping)] = zip(*mapping)
        blocks = self.cpu_kv[:, cpu_ids]
        if self._moved is not None:  # placed as the pool (jit takes numpy inputs replicated only, over processes)
            blocks = jax.device_put(blocks, self._moved)
        # padded entries write CPU block 0's content into the null block, which nothing reads unmasked
        self.cache = self._run("write_blocks", self.cache, device_ids, blocks)

    # ---- warm-up -----------------------------------------------------------------------------

    def draft(self, rows: Seq, *, num_layers: int, shapes: Optional[StepShapes] = None) -> np.ndarray:
        """Self-drafting: one decode-shaped step of the first `num_layers` layers over `rows` (one token
        each), writing those layers' K/V; returns each row's most likely next token (int32[len(rows)])."""
        if "draft_step" not in self._jits:
            raise ValueError("self-drafting does not run over data-parallel partitions: use data_parallel_size=1")
        inputs = shapes.pack(rows, decode=True) if shapes is not None else self._pack(rows, decode=True)
        self.cache, tokens = self._run("draft_step", self.params, self.cache, inputs, num_layers=num_layers)
        return np.asarray(tokens)[:len(rows)]

    def warm_up(self, shapes: StepShapes, *, progress: Optional[Callable[[int, int], None]] = None,
                workers: Optional[int] = None, draft_layers: Optional[int] = None,
                feed_tokens: bool = False) -> WarmUp:
        """Builds, before any step and without running anything, every executable that steps packed at
        `shapes` can run: the model steps of `shapes.all_dims` (prefill and decode), the sampler for every
        logits row count, top log-probability bucket and variant (greedy, random, filtered), the
        copy-on-write copies (up to one per sequence), with a CPU pool the swaps (up to its size) and, with
        `feed_tokens` (async scheduling), `feed_tokens` for every decode step's row count.
        Compiled from abstract shapes (`jit(...).lower(...).compile()`), so the pool is not touched.
        Lowering runs in this thread, compiling in `workers` threads (default: the CPU count, at most
        4); `progress(done, total)` is called after each. Executables built already are kept.
        Afterwards, `num_compilations_after_warm_up` counts what runs still build (0 within the limits)."""
        if self.num_partitions > 1:
            raise ValueError("warm_up covers one data-parallel partition: a data-parallel runner packs its "
                             "ranks' rows without step shapes")
        start = time.perf_counter()
        jobs = self._warm_up_jobs(shapes, draft_layers, feed_tokens)
        counts: dict[str, int] = {}
        todo = {}
        for name, args, static in jobs:
            counts[name] = counts.get(name, 0) + 1
            key = (name, _shape_key(args, static, self._params_keys))
            if key not in self._executables:
                todo.setdefault(key, (name, args, static))
        hits = []

        def on_event(event, **_):
            if event == "/jax/compilation_cache/cache_hits":
                hits.append(event)

        jax.monitoring.register_event_listener(on_event)
        workers = workers or min(4, os.cpu_count() or 1)
        try:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                futures = {}
                for key, (name, args, static) in todo.items():
                    futures[pool.submit(self._jits[name].lower(*args, **static).compile)] = key
                for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                    self._executables[futures[future]] = future.result()
                    self.num_warm_up_compilations += 1
                    if progress is not None:
                        progress(done, len(futures))
        finally:
            jax.monitoring.unregister_event_listener(on_event)
        self.num_compilations_after_warm_up = 0
        return WarmUp(executables=counts, built=len(todo), cache_hits=len(hits), seconds=time.perf_counter() - start)

    def _warm_up_jobs(self, shapes: StepShapes, draft_layers: Optional[int] = None,
                      feed_tokens: bool = False) -> list[tuple[str, tuple, dict]]:
        """(name, arguments, static options) of every executable `warm_up` builds (self-drafting's steps
        of `draft_layers` layers too, when given; `feed_tokens` for every decode row count, when asked); arrays the steps pass from the host are
        `jax.ShapeDtypeStruct`s of the shapes they would have."""
        def sds(shape, dtype, sharding=None):
            return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)

        jobs = []
        for decode in (False, True):
            name = "decode_step" if decode else "prefill_step"
            for dims in shapes.all_dims(decode=decode):
                inputs = shapes.abstract_inputs(dims, decode=decode)
                params = self._step_params(decode, inputs.logits_index.shape[0])
                jobs.append((name, (params, self.cache, inputs), {}))
                if decode and draft_layers:
                    jobs.append(("draft_step", (self.params, self.cache, inputs), dict(num_layers=draft_layers)))
        vocab = self.params.lm_head.shape[-1]
        logits_sharding = self.sharding.replicated(self.mesh) if self.sharding is not None else None
        for rows in bucket_values(1, shapes.max_num_seqs, row_bucket):  # every logits row count of a step
            for allowed in (None, sds([rows, -(-vocab // 32)], np.int32)):  # without and with structured output
                params = SamplingInputs(temperature=sds([rows], np.float32), top_k=sds([rows], np.int32),
                                        top_p=sds([rows], np.float32), seed=sds([rows], np.uint32),
                                        sample_index=sds([rows], np.int32), step=sds([rows], np.int32),
                                        draft=sds([rows], np.int32), allowed=allowed)
                for top in shapes.top_buckets():
                    for use_filter, use_random in _SAMPLE_MODES:
                        jobs.append(("sample", (sds([rows, vocab], np.float32, logits_sharding),
                                                sds([rows], np.int32), params),
                                     dict(num_top=top, use_filter=use_filter, use_random=use_random)))
        if feed_tokens:  # a decode step run ahead: its rows and the samples of the step before are as many
            rep = self.sharding.replicated(self.mesh) if self.sharding is not None else None
            for rows in bucket_values(1, shapes.max_num_seqs, row_bucket):
                jobs.append(("feed_tokens", tuple(sds([rows], np.int32, rep) for _ in range(3)), {}))
        for n in bucket_values(1, shapes.max_num_seqs, bucket):  # copy-on-write: one per appended sequence
            jobs.append(("copy_blocks", (self.cache, sds([n, 2], np.int32)), {}))
        if self.num_cpu_blocks:
            moved = self.cpu_kv.shape
            for n in bucket_values(1, min(self.num_cpu_blocks, self.num_blocks - 1), bucket):
                jobs.append(("read_blocks", (self.cache, sds([n], np.int32)), {}))
                jobs.append(("write_blocks", (self.cache, sds([n], np.int32),
                                              sds((moved[0], n, *moved[2:]), self.cpu_kv.dtype, self._moved)), {}))
        return jobs


def _shape_key(args, static: dict, known: Optional[dict] = None) -> tuple:
    """What keys an executable besides its name: its static options and each argument's `_arg_key`.
    `known`: the keys of long-lived arguments by `id` (the runner's parameters: `ModelRunner._params_keys`),
    which must outlive their entries (an id is unique only while its object lives)."""
    return (tuple(static.items()),
            tuple(known[id(a)] if known and id(a) in known else _arg_key(a) for a in args))


def _arg_key(arg) -> tuple:
    """The shapes and dtypes of an argument's arrays (arrays, numpy arrays and `jax.ShapeDtypeStruct`s alike:
    numpy dtype objects, hashable and equal across the three; their names would cost a Python-level `str`
    per leaf, 0.35 ms a decode step)."""
    return tuple((tuple(x.shape), x.dtype) for x in jax.tree.leaves(arg) if hasattr(x, "shape"))
