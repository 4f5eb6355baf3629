"""`EngineConfig`: the engine's static settings, validated on construction (vLLM's names)."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax
import jax.numpy as jnp

from jpaged.core.proposer import NgramProposer, check_method
from jpaged.core.scheduler import SchedulerConfig
from jpaged.device.attention import BACKENDS
from jpaged.device.kv_cache import parse_memory_size
from jpaged.device.quant import check_quantization
from jpaged.device.sharding import (ShardingStrategy, data_and_expert_parallel, data_and_tensor_parallel,
                                    data_parallel, expert_parallel, make_mesh, tensor_parallel)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine settings.

    model: a .gguf file, a HF checkpoint directory of a supported family or a jpaged checkpoint (None: the
      embedded default).
    block_size: tokens per KV block (a power of two). num_blocks: the whole device pool, the null
      block included; when None it is sized from `kv_cache_memory` (bytes, or e.g. '1GiB').
    dtype: of the parameters and the KV pool; every matmul accumulates in float32 and the activations
      between them stay float32 (`jpaged.device.model`). quantization: None or 'int8' (weight-only:
      the dense weights int8 with per-output-channel scales, a Q8_0 GGUF's blocks kept as they are;
      norms, biases and the KV pool stay `dtype`, and under bfloat16 the int8 products take their
      activations rounded to bfloat16, as bfloat16 weights' do; `jpaged.device.quant`); one device only.
      attention_backend: 'auto' (Pallas on a GPU, the native
      kernel on a CPU where it was built, else XLA), 'native', 'pallas' or 'xla'; `interpret`
      runs the Pallas kernels in the interpreter.
    max_model_len: the longest sequence (prompt + output), at most the model's context.
    max_num_seqs / max_num_batched_tokens: a step's sequence and token budgets (default tokens:
      `default_batched_tokens`: max(max_model_len, 2048), or on a CPU with chunked prefill at most
      4096, as vLLM's CPU build).
    enable_chunked_prefill: one ragged step under the token budget, decode tokens first, long
      prompts in chunks (True, as in vLLM v1), or the paper's prefill-first steps (False);
      long_prefill_token_threshold caps one prompt's tokens in a step (0: none). See
      `jpaged.core.scheduler`.
    speculative_method: None, 'ngram' (prompt lookup, `jpaged.core.proposer`) or 'draft-layers'
      (self-drafting: the model's first `speculative_draft_layers` layers, default half of them, with
      its final norm and LM head, `jpaged.engine.draft`): each decoding sequence proposes up to
      `num_speculative_tokens` draft tokens a step, verified in that step with exact acceptance
      (greedy: the target's argmax tokens; sampled: the target distribution); `prompt_lookup_min` /
      `prompt_lookup_max` bound the n-gram matched. Beam-search requests draft nothing.
    preemption_mode: 'recompute' or 'swap' (into `swap_space` GiB of CPU blocks, as in vLLM).
    watermark: the fraction of the pool kept free when admitting a request while others run,
      against preempting right after admission.
    enable_prefix_caching: reuse the KV blocks of identical prompt prefixes.
    seed: draws the seeds of requests that give none.
    tensor_parallel_size: devices the model and the KV pool are split over by heads (Megatron-style,
      `jpaged.device.sharding.tensor_parallel`); 1: one device.
    data_parallel_size: devices the KV pool is split over by blocks, each running the requests placed
      on its partition (`jpaged.device.sharding.data_parallel`, `jpaged.core.partitioned`); the pool's
      blocks (num_blocks) are shared out evenly, each partition with its own null block. Both above 1:
      a 2-D mesh (`jpaged.device.sharding.data_and_tensor_parallel`).
    expert_parallel_size: a mixture of experts' experts split over this many devices (vLLM's
      `--enable-expert-parallel`), each holding whole experts: the tensor-parallel devices
      (`tensor_parallel(experts=True)`; it must then equal tensor_parallel_size), or with
      tensor_parallel_size 1 a mesh axis of its own size on which attention runs whole
      (`expert_parallel()`); combines with data_parallel_size. 1: the experts are not split (under tensor
      parallelism each expert's intermediate axis is). It must divide the model's experts (checked
      before any weight is read).
    sharding / mesh: a `ShardingStrategy` and the `jax.sharding.Mesh` it lays the arrays out on
      (both, instead of tensor_parallel_size); the mesh must have every axis the strategy's rules name.
    async_scheduling: overlap the host with the device (vLLM's name): while a decode step runs, the
      host schedules and packs the next one, whose rows take their input tokens from the running
      step's samples on the device, and reads those samples one step late (a sequence found finished
      then has its extra row dropped and its blocks freed). Outputs are the synchronous engine's;
      `step()` returns each step's outputs at the next call. A step runs ahead only from a plain
      decode step with nothing waiting, swapped, queued or to preempt; beam search, structured output,
      speculative decoding, prefix caching and data parallelism run synchronously (see
      `LLMEngine._can_run_ahead`). Device times are then not measured (runs are not waited for).
    Every field is checked on construction, before anything is loaded (the scheduler's settings
    by `jpaged.core.scheduler.SchedulerConfig`).
    """

    model: Optional[str] = None
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_cache_memory: str | int = "1GiB"
    dtype: str = "float32"
    quantization: Optional[str] = None
    attention_backend: str = "auto"
    interpret: bool = False
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    speculative_method: Optional[str] = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    speculative_draft_layers: Optional[int] = None
    preemption_mode: str = "recompute"
    swap_space: float = 0.0
    watermark: float = 0.01
    enable_prefix_caching: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    sharding: Optional[ShardingStrategy] = None
    mesh: Optional[jax.sharding.Mesh] = None
    async_scheduling: bool = False

    def __post_init__(self):
        b = self.block_size
        if not (type(b) is int and b >= 1 and b & (b - 1) == 0):
            raise ValueError(f"block_size must be a power of two (e.g. 16), got {b!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_quantization(self.quantization)
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(map(repr, BACKENDS))}, "
                             f"got {self.attention_backend!r}")
        if self.num_blocks is not None and not (type(self.num_blocks) is int and self.num_blocks >= 2):
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is the reserved null block), "
                             f"got {self.num_blocks!r}")
        _check_memory_size(self.kv_cache_memory)
        if not (isinstance(self.swap_space, (int, float)) and self.swap_space >= 0):
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")
        if self.max_model_len is not None and not (type(self.max_model_len) is int and self.max_model_len >= 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        tp, dp, ep = self.tensor_parallel_size, self.data_parallel_size, self.expert_parallel_size
        for name, size in (("tensor_parallel_size", tp), ("data_parallel_size", dp), ("expert_parallel_size", ep)):
            if not (type(size) is int and size >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
        if ep > 1 and tp > 1 and ep != tp:
            raise ValueError(f"expert_parallel_size {ep} and tensor_parallel_size {tp}: the experts split over the "
                             "tensor-parallel devices, so give the same size, or tensor_parallel_size 1 for a mesh "
                             "axis of the experts' own")
        tp = max(tp, ep)  # the devices of the mesh axis 'model'
        if self.quantization is not None and (self.sharding is not None or tp * dp > 1):
            raise ValueError(f"quantization={self.quantization!r} runs on one device: use tensor_parallel_size=1 and "
                             "data_parallel_size=1 (no sharding), or quantization=None")
        if (self.sharding is None) != (self.mesh is None):
            raise ValueError("give sharding and mesh together (a ShardingStrategy and the jax.sharding.Mesh it uses)")
        if self.sharding is not None:
            if not isinstance(self.sharding, ShardingStrategy):
                raise ValueError(f"sharding must be a jpaged.device.sharding.ShardingStrategy, "
                                 f"got {type(self.sharding).__name__}")
            if not isinstance(self.mesh, jax.sharding.Mesh):
                raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
            if tp != 1 or dp != 1:
                raise ValueError("give tensor_parallel_size / data_parallel_size / expert_parallel_size or sharding "
                                 "and mesh, not both")
            missing = [a for a in self.sharding.mesh_axes if a not in self.mesh.axis_names]
            if missing:
                raise ValueError(f"the mesh (axes {', '.join(map(repr, self.mesh.axis_names))}) lacks the axis "
                                 f"{', '.join(map(repr, missing))} that sharding strategy "
                                 f"{self.sharding.name!r} names")
        elif tp * dp > 1 and tp * dp > jax.device_count():  # (one device: JAX not started, jax.distributed may come)
            make_mesh(tp, dp)  # raises the one-line error: more devices asked for than exist
        # the scheduler's settings, checked now, before any model is loaded
        self.scheduler_config(1)
        if self.speculative_method is not None:
            check_method(self.speculative_method)
            if self.speculative_method == "ngram":
                self.ngram_proposer()
            if not (type(self.num_speculative_tokens) is int and self.num_speculative_tokens >= 1):
                raise ValueError("speculative decoding needs num_speculative_tokens >= 1 (--num-speculative-tokens "
                                 f"K), got {self.num_speculative_tokens!r}")
        elif self.num_speculative_tokens:
            raise ValueError("num_speculative_tokens needs a speculative_method (--speculative-method ngram)")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        layers = self.speculative_draft_layers
        if layers is not None and not (type(layers) is int and layers >= 1):
            raise ValueError(f"speculative_draft_layers must be an integer >= 1, got {layers!r}")

    def ngram_proposer(self) -> NgramProposer:
        return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)

    def scheduler_config(self, default_batched_tokens: int) -> SchedulerConfig:
        """The scheduler's settings (`max_num_batched_tokens` when None: `default_batched_tokens`)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, preemption_mode=self.preemption_mode, watermark=self.watermark,
            max_num_batched_tokens=(default_batched_tokens if self.max_num_batched_tokens is None
                                    else self.max_num_batched_tokens),
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            num_speculative_tokens=self.num_speculative_tokens if self.speculative_method else 0)

    def layout(self) -> tuple[Optional[ShardingStrategy], Optional[jax.sharding.Mesh]]:
        """(strategy, mesh) the runner lays the model and the pool out with, or (None, None): one device."""
        if self.sharding is not None:
            return self.sharding, self.mesh
        tp, dp, ep = self.tensor_parallel_size, self.data_parallel_size, self.expert_parallel_size
        experts = ep > 1
        if tp > 1 and dp > 1:
            return data_and_tensor_parallel(experts=experts), make_mesh(tp, dp)
        if tp > 1:
            return tensor_parallel(experts=experts), make_mesh(tp)
        if ep > 1 and dp > 1:
            return data_and_expert_parallel(), make_mesh(ep, dp)
        if ep > 1:
            return expert_parallel(), make_mesh(ep)
        if dp > 1:
            return data_parallel(), make_mesh(1, dp)
        return None, None

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]


CPU_BATCHED_TOKENS = 4096  # vLLM's default token budget on a CPU (its offline `LLM`; 2048 for its server)


def default_batched_tokens(max_model_len: int, enable_chunked_prefill: bool, *, on_cpu: bool) -> int:
    """A step's token budget when `max_num_batched_tokens` is not given: max(max_model_len, 2048), so that
    a whole prompt fits one step; on a CPU with chunked prefill (long prompts go in chunks), at most
    `CPU_BATCHED_TOKENS`, as vLLM's CPU build. On an Intel Xeon with AMX (2 cores, bfloat16, the 120
    vs_peers requests, alternating, two passes): 4096 tokens 935-971 tokens/s, 2048 891-963, 8192 817-912."""
    budget = max(max_model_len, 2048)
    return min(budget, CPU_BATCHED_TOKENS) if on_cpu and enable_chunked_prefill else budget


def _check_memory_size(size) -> None:
    """`kv_cache_memory` readable and above 0 bytes; ValueError saying what to write otherwise."""
    try:
        parse_memory_size(size)
    except ValueError:
        match = re.fullmatch(r"\s*([-+]?[0-9.e+-]*)\s*([a-zA-Z]*)\s*", str(size))
        number, unit = match.groups() if match else ("", "")
        try:
            too_small = float(number) < float("inf") and (unit == "" or parse_memory_size(f"1{unit}") > 0)
        except ValueError:
            too_small = False  # not a number, or not a unit: parse_memory_size's message says how to write it
        if too_small and not isinstance(size, bool):
            raise ValueError(f"kv_cache_memory must be at least 1 byte, got {size!r}: give a size such as '1GiB' "
                             "(--kv-cache-memory), or a pool size in blocks (num_blocks / --num-blocks)") from None
        raise
