"""The device side of a step: packs the scheduler's rows into shape buckets, runs the jitted
`prefill_step` / `decode_step`, samples, and applies the block operations (copy-on-write, swap).

Step functions are pure, `step(params, kv_cache, inputs) -> (kv_cache, logits)`, jitted with the
cache donated, so a step writes only its new tokens' K/V into the pool. Every distinct padded shape
is compiled ahead of time once (`jit(...).lower(...).compile()`), so compilations are counted and
their time kept out of throughput figures.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.batch import ModelInputs, bucket, pack_rows, row_bucket
from jpaged.config import ModelConfig
from jpaged.kv_cache import KVCache
from jpaged.model import compute_logits, forward
from jpaged.params import LlamaParams
from jpaged.sampler import SamplingInputs, sample
from jpaged.scheduler import Row


@dataclasses.dataclass(frozen=True)
class SampleRow:
    """One token to draw: from logits row `row`, with these settings."""

    row: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    sample_index: int
    step: int


def _step(params, cache, inputs, *, config, backend):
    cache, hidden = forward(params, cache, inputs, config=config, backend=backend)
    return cache, compute_logits(params, hidden[inputs.logits_index])


def _copy_blocks(cache, pairs, *, backend):
    k, v = backend.copy_blocks(cache.k, cache.v, pairs)
    return KVCache(k=k, v=v)


def _read_blocks(cache, block_ids):
    return cache.k[:, block_ids], cache.v[:, block_ids]


def _write_blocks(cache, block_ids, k_blocks, v_blocks):
    return KVCache(k=cache.k.at[:, block_ids].set(k_blocks), v=cache.v.at[:, block_ids].set(v_blocks))


class ModelRunner:
    """Holds the parameters and the KV cache on the device; packs rows into bucketed step inputs.

    Shape buckets (`jpaged.batch`): powers of two, with finer steps for the pairs, a prefill's
    packed tokens and a decode step's rows. Attention tiles: prefill query tiles of `prefill_q_tile`
    tokens and key tiles of about `prefill_key_tile`; decode query tiles of one token and key tiles
    of about `decode_key_tile` (key tiles are whole blocks). The defaults were the fastest measured
    on a 2-core XLA CPU. Decode: a row's last key tile is mostly padding that is gathered all the
    same (gathers write their output, and writes are this CPU's scarce bandwidth), so on the mixed
    contexts of the 120 vs_peers requests tiles of 64 beat 128 by 13% end to end (32: 12%, 16: 2%).
    `num_compilations` counts every executable built (steps, sampler, block ops).
    """

    def __init__(self, config: ModelConfig, params: LlamaParams, *, num_blocks: int, block_size: int,
                 dtype=jnp.float32, backend, num_cpu_blocks: int = 0, cache_sharding=None,
                 prefill_q_tile: int = 64, prefill_key_tile: int = 128, decode_key_tile: int = 64):
        if params.lm_head is None:  # tied embeddings: keep a [hidden, vocab] copy so the LM head is a plain
            params = params.replace(lm_head=jnp.asarray(params.embed.T))  # matmul (no transpose per step)
        self.config, self.params, self.backend = config, params, backend
        self.block_size = block_size
        self.prefill_q_tile = prefill_q_tile
        self.prefill_k_tile = block_size * max(1, prefill_key_tile // block_size)  # whole blocks
        self.decode_k_tile = block_size * max(1, decode_key_tile // block_size)
        self.cache = KVCache.create(config, num_blocks, block_size, dtype, sharding=cache_sharding)
        cpu_shape = (config.num_layers, num_cpu_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.cpu_k = np.zeros(cpu_shape, np.dtype(dtype))
        self.cpu_v = np.zeros(cpu_shape, np.dtype(dtype))
        step = functools.partial(_step, config=config, backend=backend)
        self._jits = {
            "prefill_step": jax.jit(step, donate_argnums=(1,)),
            "decode_step": jax.jit(step, donate_argnums=(1,)),
            "copy_blocks": jax.jit(functools.partial(_copy_blocks, backend=backend), donate_argnums=(0,)),
            "read_blocks": jax.jit(_read_blocks),
            "write_blocks": jax.jit(_write_blocks, donate_argnums=(0,)),
            "sample": sample,
        }
        self._executables: dict = {}
        self.compile_seconds = 0.0
        self.device_seconds = 0.0  # time inside compiled executables, synchronised (the rest of a step is host time)

    @property
    def num_compilations(self) -> int:
        return len(self._executables)

    def _run(self, name: str, *args, **static):
        key = (name, tuple(static.items()),
               tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args) if hasattr(x, "shape")))
        executable = self._executables.get(key)
        if executable is None:
            t0 = time.perf_counter()
            executable = self._jits[name].lower(*args, **static).compile()
            self.compile_seconds += time.perf_counter() - t0
            self._executables[key] = executable
        t0 = time.perf_counter()
        out = jax.block_until_ready(executable(*args))
        self.device_seconds += time.perf_counter() - t0
        return out

    # ---- model steps -------------------------------------------------------------------------

    def make_inputs(self, rows: Seq[Row], *, decode: bool) -> ModelInputs:
        """Packs `rows` (see `jpaged.batch`): decode rows are one token each, prefill rows any number."""
        if decode and any(len(r.token_ids) != 1 for r in rows):
            raise ValueError("a decode row computes exactly one token")
        if decode:
            return pack_rows(rows, block_size=self.block_size, q_tile=1, k_tile=self.decode_k_tile)
        return pack_rows(rows, block_size=self.block_size, q_tile=self.prefill_q_tile, k_tile=self.prefill_k_tile)

    def execute(self, rows: Seq[Row], *, decode: bool) -> jax.Array:
        """Runs one step over `rows`; returns the logits f32[padded rows, vocab] (on the device)."""
        inputs = self.make_inputs(rows, decode=decode)
        name = "decode_step" if decode else "prefill_step"
        self.cache, logits = self._run(name, self.params, self.cache, inputs)
        return logits

    def sample(self, logits: jax.Array, rows: Seq[SampleRow], num_top: int) -> dict[str, np.ndarray]:
        """Draws one token per sample row. Returns numpy arrays token_ids, logprobs, top_ids, top_logprobs."""
        n = row_bucket(len(rows))
        dtypes = {"temperature": np.float32, "top_p": np.float32, "seed": np.uint32}
        columns = {f.name: np.zeros(n, dtypes.get(f.name, np.int32)) for f in dataclasses.fields(SampleRow)}
        columns["top_p"][:] = 1.0
        for i, r in enumerate(rows):
            for name in columns:
                columns[name][i] = getattr(r, name)
        params = SamplingInputs(temperature=columns["temperature"], top_k=columns["top_k"], top_p=columns["top_p"],
                                seed=columns["seed"], sample_index=columns["sample_index"],
                                step=columns["step"])
        use_filter = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0) for r in rows)
        use_random = any(r.temperature > 0 for r in rows)
        out = self._run("sample", logits, columns["row"], params, num_top=bucket(num_top) if num_top else 0,
                        use_filter=use_filter, use_random=use_random)
        out = jax.device_get(out)
        k = len(rows)
        return {"token_ids": out.token_ids[:k], "logprobs": out.logprobs[:k],
                "top_ids": out.top_ids[:k], "top_logprobs": out.top_logprobs[:k]}

    # ---- block operations --------------------------------------------------------------------

    def copy_blocks(self, pairs: Seq[tuple[int, int]]) -> None:
        """All of a step's copy-on-write copies in one call (padded with (0, 0) null copies)."""
        if not pairs:
            return
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
        k, v = jax.device_get(self._run("read_blocks", self.cache, device_ids))
        self.cpu_k[:, cpu_ids] = k[:, :n]
        self.cpu_v[:, cpu_ids] = v[:, :n]

    def swap_in(self, mapping: Seq[tuple[int, int]]) -> None:
        """Copies CPU blocks back to device blocks: mapping of (cpu_block_id, device_block_id)."""
        if not mapping:
            return
        n = bucket(len(mapping))
        cpu_ids = np.zeros(n, np.int32)
        device_ids = np.zeros(n, np.int32)
        cpu_ids[:len(mapping)], device_ids[:len(mapping)] = zip(*mapping)
        k = self.cpu_k[:, cpu_ids]
        v = self.cpu_v[:, cpu_ids]
        # padded entries write CPU block 0's content into the null block, which nothing reads unmasked
        self.cache = self._run("write_blocks", self.cache, device_ids, k, v)
