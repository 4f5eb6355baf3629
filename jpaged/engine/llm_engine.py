"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduler step at a time.

`add_request` validates one request and rejects only that one; `step()` runs one scheduler step
(a prefill or a decode over the running batch) and returns the requests that progressed;
`abort` ends a request wherever it is. `add_request` and `abort` may be called from other threads
while one thread drives `step()`: they queue under a lock and take effect at the next step.

A step: the scheduler (`jpaged.core.scheduler`) decides what runs and updates its KV cache manager
snapshot; the runner (`jpaged.device.runner`) applies the block operations, runs the jitted model
step and samples; the engine turns samples into tokens and text, decides stops (telling the
scheduler, which finishes sequences) and applies beam-search decisions (`jpaged.core.beam_search`).
Observers (`add_observer`) get a `StepRecord` of every step.

The host loop's costs (issue 31; `bench/scheduler_overhead.py --stub-device` measures them alone): a
decode step's blocks come from one batched call (`kv_cache_manager.append_slots`), KV utilization from a
counter the block manager keeps, outputs are built when read (`RequestOutput.deferred`), and the heap
alive once the engine is built (model, libraries) is frozen out of the cyclic garbage collector
(`gc.freeze()`, as vLLM's engine core does at start-up): a full collection then walks only what was
allocated since, not the whole process, which at 256 sequences had cost more than the rest of a step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import itertools
import logging
import math
import operator
import pathlib
import threading
import time
from typing import Any, Callable, Optional, Sequence as Seq

import jax
import numpy as np

from jpaged.core import beam_search
from jpaged.core.block_manager import BlockManager
from jpaged.core.partitioned import PartitionedBlockManager
from jpaged.core.detokenizer import append_text, decoder, find_stop, stream_safe_length
from jpaged.core.kv_cache_manager import (ForkingKVCacheManager, KVCacheManager, KVCacheSpec, blocks_for,
                                          kv_utilization)
from jpaged.core.sampling_params import SamplingParams
from jpaged.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jpaged.core.structured_output import GrammarCompiler, fill_bitmask
from jpaged.core.sequence import GroupStatus, Sequence, SequenceGroup
from jpaged.device.attention import get_backend
from jpaged.device.huge_pages import advise_huge_pages
from jpaged.device.kv_cache import bytes_per_block, check_pool_fits, num_blocks_for_memory, parse_memory_size
from jpaged.device.params import LlamaParams, cast_params, check_params, num_params, to_storage
from jpaged.device.quant import float_row_params, quantize_params
from jpaged.device.runner import ModelRunner, SampleRow, WarmUp
from jpaged.engine.config import EngineConfig, default_batched_tokens
from jpaged.engine.draft import SelfDraftProposer
from jpaged.engine.observer import StepObserver, StepRecord
from jpaged.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jpaged.weights import LoadedModel, load_model, read_config
from jpaged.weights.loader import load_gguf

KVCacheManagerFactory = Callable[[KVCacheSpec], KVCacheManager]
logger = logging.getLogger("jpaged")

# async scheduling: the token a sequence holds for its sample still in flight (never read: its row's input
# comes from the device, and the sample replaces it before anything looks at the tokens)
_PLACEHOLDER = -1


@dataclasses.dataclass
class _Launched:
    """A step dispatched to the device (`LLMEngine._launch`): what applying its samples needs. `parts`:
    the sampler's runs (`ModelRunner.dispatch_sample`; None: nothing sampled); `targets`: the sequences
    sampled, in sample order; `verify`: seq_id -> draft tokens; `by_group`: request_id -> (sequence,
    index of its first sample)."""

    out: SchedulerOutput
    shape: tuple
    num_padded: int
    parts: Optional[list]
    targets: list
    verify: dict
    by_group: dict


@dataclasses.dataclass
class _InFlight:
    """A scheduled step (async scheduling: not yet applied): its scheduler output, its dispatch (None:
    nothing ran, or the dispatch failed), the groups it ended already (aborted, failed, finished by the
    scheduler) by request id, and its scheduling seconds."""

    out: SchedulerOutput
    launched: Optional[_Launched]
    progressed: dict
    schedule_s: float


class LLMEngine:
    """The engine. Build it with an `EngineConfig` (fields may also be given as keywords), and:

    loaded: an already loaded model (`jpaged.weights.load_model`) instead of `config.model`;
    runner: an existing `ModelRunner` (its parameters, KV pool and compiled executables) to reuse
      instead of allocating a new pool; it must match the model and the pool's geometry;
    kv_cache_manager: a factory `KVCacheSpec -> KVCacheManager` (default: paging,
      `BlockManager.from_spec`); the scheduler talks to what it builds through the
      `jpaged.core.kv_cache_manager` protocols;
    params: a parameter pytree (`jpaged.device.params.LlamaParams`) to serve instead of the
      model's own, e.g. fine-tuned ones, of the model's layout and shapes (checked before anything
      is loaded; cast to the engine's parameter dtype). The model's tokenizer and configuration are
      kept; give `loaded=` too so that the model's files are not read again.

    `engine.model` is the model as the engine serves it: its `params` int8 where `quantization` asks, and on
    one CPU device its bfloat16 and float32 dense weights as [out, in] rows (`QuantizedWeight`s; the only
    copy the engine keeps), which `LLMEngine(loaded=engine.model)` serves again as they are.
    """

    def __init__(self, config: EngineConfig = EngineConfig(), *, loaded: Optional[LoadedModel] = None,
                 runner: Optional[ModelRunner] = None, kv_cache_manager: Optional[KVCacheManagerFactory] = None,
                 params: Optional[LlamaParams] = None, **overrides):
        config = dataclasses.replace(config, **overrides)  # every field checked: nothing is loaded yet
        if params is not None and runner is not None:
            raise ValueError("give params or runner, not both: a runner serves the parameters it holds")
        self.config = config
        dtype = config.jnp_dtype  # the KV pool's
        # and the parameters': every matmul accumulates in float32 and the activations between them are
        # float32 (jpaged.device.model); on a CPU, the runner holds bfloat16 parameters as their bit
        # patterns (jpaged.device.params.to_storage, sharing their memory), on one CPU device its dense
        # bfloat16 and float32 weights as [out, in] rows (jpaged.device.quant.float_row_params: a transposed
        # copy, which `self.model` then holds in place of the arrays it came from)
        self.param_dtype = dtype
        backend = None if runner is not None else get_backend(config.attention_backend, interpret=config.interpret)
        # the pool is sized and checked against the memory there is before any weight is read
        model_config = loaded.config if loaded is not None else read_config(config.model)
        sharding, mesh = (None, None) if runner is not None else config.layout()
        if sharding is not None:
            sharding.check(mesh, model_config)  # heads that do not divide: said before any weight is read
        # the pool's geometry: with fewer KV heads than tensor-parallel devices each is stored several times,
        # and kv_cache_memory / swap_space (the whole pool's, over all devices) pay for every copy
        replication = sharding.kv_head_replication(mesh, model_config) if sharding is not None else 1
        # data parallel: the pool (and the swap pool) shared out evenly between the ranks' partitions
        self.num_partitions = (runner.num_partitions if runner is not None
                               else sharding.axis_size("blocks", mesh) if sharding is not None else 1)
        pool_config = dataclasses.replace(model_config, num_kv_heads=model_config.num_kv_heads * replication)
        if params is not None:
            check_params(params, model_config)
        self.max_model_len = min(config.max_model_len or model_config.max_model_len, model_config.max_model_len)
        num_blocks = config.num_blocks or num_blocks_for_memory(
            pool_config, config.block_size, dtype, parse_memory_size(config.kv_cache_memory))
        parts = self.num_partitions
        if parts > 1:
            if config.num_blocks is not None and (num_blocks % parts or num_blocks // parts < 2):
                raise ValueError(f"num_blocks={num_blocks} does not split into {parts} data-parallel partitions of "
                                 f"at least 2 blocks each (each has its null block): give a multiple of {parts}")
            if kv_cache_manager is not None:
                raise ValueError("data parallel builds its own partitioned KV cache manager: give no kv_cache_manager")
            num_blocks = num_blocks // parts * parts
        if num_blocks < 2:
            raise ValueError(f"a KV cache of {config.kv_cache_memory} holds {num_blocks} blocks of "
                             f"{config.block_size} tokens: give it more memory (kv_cache_memory) or set num_blocks")
        num_cpu_blocks = int(config.swap_space * 2**30 // bytes_per_block(pool_config, config.block_size, dtype))
        if config.preemption_mode == "swap":
            num_cpu_blocks = min(max(num_cpu_blocks, 1), num_blocks)  # never needs more than the device pool
            num_cpu_blocks = max(num_cpu_blocks, parts)
        num_cpu_blocks = num_cpu_blocks // parts * parts
        if runner is None:  # a new pool, and the parameters still to be placed (the runner's tied LM head copy too)
            itemsize = np.dtype(self.param_dtype).itemsize
            params_bytes = itemsize * ((num_params(model_config) if loaded is None else 0)
                                       + (model_config.vocab_size * model_config.hidden_size
                                          if model_config.tie_word_embeddings else 0))
            check_pool_fits(pool_config, config.block_size, dtype, num_blocks, num_cpu_blocks, params_bytes)
        if loaded is None and config.quantization is not None and str(config.model).endswith(".gguf"):
            loaded = load_gguf(pathlib.Path(config.model), self.param_dtype, config.quantization)  # Q8_0 kept int8
        if loaded is not None and loaded.params.embed.dtype != self.param_dtype:
            loaded = dataclasses.replace(loaded, params=cast_params(loaded.params, self.param_dtype))
        self.model = loaded if loaded is not None else load_model(config.model, dtype=self.param_dtype)
        if params is not None:
            self.model = dataclasses.replace(self.model, params=cast_params(params, self.param_dtype))
        if config.quantization is not None:  # weight-only int8 (leaves already int8 stay), computing in `dtype`'s
            quantized = quantize_params(self.model.params, config.quantization, self.param_dtype)  # float width
            self.model = dataclasses.replace(self.model, params=quantized)
        self.tokenizer = self.model.tokenizer
        self._decode = decoder(self.tokenizer)  # incremental detokenization's decode
        model_config = self.model.config
        self.kv_cache_spec = KVCacheSpec(num_blocks=num_blocks, block_size=config.block_size,
                                         num_cpu_blocks=num_cpu_blocks,
                                         enable_prefix_caching=config.enable_prefix_caching,
                                         max_model_len=self.max_model_len,
                                         sliding_window=model_config.kv_window)
        scheduler_config = config.scheduler_config(default_batched_tokens(self.max_model_len, config.enable_chunked_prefill,
                                                                          on_cpu=jax.default_backend() == "cpu"))
        factory = kv_cache_manager or BlockManager.from_spec
        if parts > 1:
            factory = functools.partial(PartitionedBlockManager.from_spec, num_partitions=parts)
        # the scheduler (its settings and the KV cache manager checked before the runner is built); its
        # speculative-decoding proposer is attached below, once the runner exists
        self.scheduler = Scheduler(factory(self.kv_cache_spec), scheduler_config, max_model_len=self.max_model_len)
        draft_layers = None  # self-drafting: the layers of the draft
        if config.speculative_method == "draft-layers":
            draft_layers = config.speculative_draft_layers or max(1, model_config.num_layers // 2)
            if draft_layers >= model_config.num_layers:
                raise ValueError(f"speculative_draft_layers={draft_layers}: the draft must have fewer layers than "
                                 f"the model's {model_config.num_layers}")
            if parts > 1:
                raise ValueError("self-drafting (speculative_method='draft-layers') does not run over data-parallel "
                                 "partitions: use data_parallel_size=1 or speculative_method='ngram'")
        self.draft_layers = draft_layers
        if runner is None:
            on_cpu = jax.default_backend() == "cpu"
            if on_cpu and sharding is None:
                # on one CPU device, bfloat16 and float32 dense weights as [out, in] rows for the native few-row
                # kernel (jpaged.device.quant.float_row_params; as they are without the native library). The
                # rows are the engine's one copy of those weights: the model it serves holds them, and the
                # arrays they were transposed from are freed unless the caller holds them (`loaded`, `params`)
                self.model = dataclasses.replace(self.model, params=float_row_params(self.model.params))
                advise_huge_pages(self.model.params)  # read whole every step: on 2 MiB pages where Linux allows
            runner = ModelRunner(model_config, to_storage(self.model.params) if on_cpu else self.model.params,
                                 num_blocks=num_blocks, block_size=config.block_size, dtype=dtype,
                                 num_cpu_blocks=num_cpu_blocks, backend=backend, sharding=sharding, mesh=mesh)
        else:
            _check_runner(runner, model_config, self.kv_cache_spec, dtype)
        self.runner = runner
        # the shape buckets of this engine's steps, bounded by its limits (one data-parallel partition)
        self.shapes = None if parts > 1 else runner.step_shapes(**self._step_limits(scheduler_config))
        # speculative decoding's proposer (None: off), and its counts: drafts proposed and accepted, and
        # by position (the 1st draft of a step, the 2nd, ...)
        self.proposer = (None if config.speculative_method is None else config.ngram_proposer()
                         if config.speculative_method == "ngram"
                         else SelfDraftProposer(runner, draft_layers, self.shapes))
        self.spec_counts = {"num_proposed": 0, "num_accepted": 0,
                            "accepted_by_position": [0] * config.num_speculative_tokens,
                            "proposed_by_position": [0] * config.num_speculative_tokens}
        self.scheduler.proposer = self.proposer
        # structured output: the grammar compiler (built at the first constrained request) and each
        # constrained sequence's matcher (seq_id -> llguidance.LLMatcher: generation state, the engine's)
        self._grammars: Optional[GrammarCompiler] = None
        self._matchers: dict[int, Any] = {}
        self.warm_up_summary = None  # what `warm_up` did, once called
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self._rng = np.random.default_rng(config.seed)
        self._seq_ids = itertools.count()
        self._lock = threading.Lock()
        self._new: collections.deque[SequenceGroup] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._request_ids: set[str] = set()
        self._observers: list[StepObserver] = []
        self._in_flight: Optional[_InFlight] = None  # async scheduling: the step dispatched, not yet applied
        self.peak_used_blocks = 0
        self.num_steps = 0
        # cumulative seconds: whole steps (compilation and statistics excluded), scheduling,
        # device executables, the rest
        self.timings = collections.Counter(step_s=0.0, schedule_s=0.0, device_s=0.0, host_s=0.0)
        self._utilization_sum = 0.0
        self._utilization_steps = 0
        freeze_heap()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_spec.num_blocks

    def _step_limits(self, scheduler_config: SchedulerConfig) -> dict:
        """The most a step can hold (`ModelRunner.step_shapes`). Rows: max_num_seqs. Tokens of a step of
        several tokens a row: ragged, the budget plus max_num_seqs (the first prefilling group always
        progresses), any row may start past cached tokens; prefill first, the budget, except that a
        step's first group is always admitted: a prompt (under the context) or a group re-prefilled after
        preemption by recompute (its sequences, each up to the context, within the pool's tokens).
        Block-table entries: the context's blocks, at most the pool's without a sliding window (whose
        released entries point at the null block)."""
        spec, length = self.kv_cache_spec, self.max_model_len
        pool_tokens = (spec.num_blocks // self.num_partitions - 1) * spec.block_size
        if scheduler_config.enable_chunked_prefill:
            tokens = min(scheduler_config.max_num_batched_tokens + scheduler_config.max_num_seqs, pool_tokens)
        else:
            tokens = max(scheduler_config.max_num_batched_tokens, length - 1,
                         min(scheduler_config.max_num_seqs * length, pool_tokens))
        width = blocks_for(length, spec.block_size)
        if spec.sliding_window is None:
            width = min(width, spec.num_blocks // self.num_partitions - 1)
        # speculative decoding: a decoding sequence's rows are its last token and its drafts
        rows = scheduler_config.max_num_seqs * (1 + scheduler_config.num_speculative_tokens)
        return dict(max_num_seqs=rows, max_prefill_tokens=tokens, max_model_len=length,
                    max_width=width,
                    prefix_caching=spec.enable_prefix_caching or scheduler_config.enable_chunked_prefill)

    def warm_up(self, progress: Optional[Callable[[int, int], None]] = None, *,
                workers: Optional[int] = None) -> WarmUp:
        """Compiles, before serving, every executable this engine's steps can run within its limits
        (max_num_seqs, the prefill token budget, max_model_len, the pool; see `_step_limits` and
        `jpaged.device.batch.StepShapes`), so that no step compiles afterwards: `stats()`'s
        `num_compilations_after_warm_up` stays 0. `progress(done, total)` is called after each
        executable built. Returns (and keeps as `warm_up_summary`) a `jpaged.device.runner.WarmUp`.
        With JAX's persistent compilation cache on, a second start loads them instead of compiling.
        Data parallel (several partitions) is not covered: raises ValueError."""
        if self.shapes is None:
            raise ValueError("warm_up covers engines of one data-parallel partition (data_parallel_size=1)")
        self.warm_up_summary = self.runner.warm_up(self.shapes, progress=progress, workers=workers,
                                                   draft_layers=self.draft_layers,
                                                   feed_tokens=self.config.async_scheduling)
        return self.warm_up_summary

    # ---- observers ---------------------------------------------------------------------------

    def add_observer(self, observer: StepObserver) -> None:
        """Calls `observer(record)` with a `StepRecord` after every step (in the stepping thread)."""
        self._observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        self._observers.remove(observer)

    # ---- requests ----------------------------------------------------------------------------

    def tokenize(self, prompt) -> tuple[Optional[str], list[int]]:
        """A prompt is text or a list of token ids (vLLM's forms). Raises ValueError saying what to change."""
        if isinstance(prompt, dict):  # {"prompt": text, "prompt_token_ids": ids}: ids win, text is kept
            text = prompt.get("prompt")
            if "prompt_token_ids" not in prompt:
                return self.tokenize(text)
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple, np.ndarray)):
                raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
            return text, self.tokenize(ids)[1]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty: give at least one non-blank character")
            prompt = valid_text(prompt)
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple, np.ndarray)):
            odd = next((t for t in prompt if not isinstance(t, (int, np.integer)) or isinstance(t, bool)), None)
            if odd is not None:
                raise ValueError(f"a list of token ids holds integers only, got {type(odd).__name__} {odd!r:.20}")
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("prompt is empty: give at least one token id")
            vocab = self.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            return None, ids
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True) -> str:
        """A conversation ([{"role": str, "content": str}, ...]) through the tokenizer's chat template."""
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template: send plain prompts")
        if not (isinstance(conversation, (list, tuple)) and conversation and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in conversation)):
            raise ValueError("a conversation is a non-empty list of {'role': str, 'content': str} messages")
        conversation = [{**m, "content": valid_text(m["content"])} for m in conversation]
        return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, conversation, add_generation_prompt: bool = True) -> dict:
        """The templated conversation as a prompt: its text, tokenized without adding special tokens again."""
        text = self.apply_chat_template(conversation, add_generation_prompt)
        return {"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids}

    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raises ValueError, saying what to change, for a request this engine can never serve."""
        manager = self.scheduler.block_manager
        if (params.n > 1 or params.use_beam_search) and not isinstance(manager, ForkingKVCacheManager):
            raise ValueError(f"this engine's KV cache manager ({type(manager).__name__}) cannot share "
                             "blocks between sequences: use n=1 without beam search")
        width = params.beam_width if params.use_beam_search else params.n
        if width > self.config.max_num_seqs:
            raise ValueError(f"{'beam_width' if params.use_beam_search else 'n'}={width} is more sequences than the "
                             f"engine runs at once (max_num_seqs={self.config.max_num_seqs}): lower it or raise "
                             "max_num_seqs")
        if params.structured_outputs is not None:  # compiled now (cached): a bad one is refused here
            self.grammars.grammar(params.structured_outputs)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens but the model's context is {self.max_model_len}: "
                             f"shorten it to at most {self.max_model_len - 1} tokens")
        bs = self.config.block_size
        need = blocks_for(n, bs)
        usable = self.num_blocks // self.num_partitions - 1  # a request lives in one partition
        if need > usable:
            raise ValueError(f"prompt of {n} tokens needs {need} KV blocks of {bs} tokens but the pool has "
                             f"{usable}{' per data-parallel partition' if self.num_partitions > 1 else ''}: "
                             "raise num_blocks / kv_cache_memory or shorten the prompt")

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's grammar compiler for this engine's tokenizer (built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, sorted(self.eos_token_ids))
        return self._grammars

    def add_request(self, request_id: str, prompt, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        """Queues one request; raises ValueError (and changes nothing) when it is bad."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if arrival_time is not None and not (isinstance(arrival_time, (int, float))
                                             and not isinstance(arrival_time, bool) and math.isfinite(arrival_time)):
            raise ValueError(f"arrival_time must be None or a number (time.monotonic()'s clock), got {arrival_time!r}")
        text, ids = self.tokenize(prompt)
        self.check_request(ids, params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        num_seqs = 1 if params.use_beam_search else params.n
        seqs = [Sequence(next(self._seq_ids), i, tuple(ids)) for i in range(num_seqs)]
        group = SequenceGroup(str(request_id), text, tuple(ids), params, seed, seqs,
                              arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                              beam_state=beam_search.BeamState() if params.use_beam_search else None)
        matchers = {s.seq_id: self.grammars.matcher(params.structured_outputs) for s in seqs
                    } if params.structured_outputs is not None else {}
        with self._lock:
            if group.request_id in self._request_ids:
                raise ValueError(f"request_id {request_id!r} is already in use: pick a unique id")
            self._request_ids.add(group.request_id)
            self._matchers.update(matchers)
            self._new.append(group)

    def abort(self, request_id: str) -> None:
        """Ends a request wherever it is, at the next step (its outputs then finish with "abort").
        Raises ValueError for an id that is not in flight (never added, or already finished)."""
        with self._lock:
            if str(request_id) not in self._request_ids:
                raise ValueError(f"no request {request_id!r} in flight to abort: it finished already or was never "
                                 "added")
            self._aborts.append(str(request_id))

    def num_waiting(self) -> int:
        """Requests added but not running: queued for the next step, or waiting for KV blocks."""
        with self._lock:
            return len(self._new) + len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._new) or self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step. Returns the requests that progressed (cumulative outputs). With
        `async_scheduling`, a step's outputs come at the next call (`_step_async`)."""
        self.runner.synchronous = not self.config.async_scheduling
        if self.config.async_scheduling:
            return self._step_async()
        start, cpu_start = time.perf_counter(), time.process_time()
        self.runner.take_calls()  # executables run outside a step (a user's own calls) are not this step's
        return self._complete(self._schedule_step(start), start, cpu_start)

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: completes the step in flight (reads its samples, applies them) and leaves the
        next one running. When the step in flight can be run ahead of (`_can_run_ahead`), the next step
        is scheduled and dispatched first, its sequences holding a placeholder for the token in flight
        (the block manager's view: one token further) and their rows fed that token on the device; the
        placeholders become the tokens read. Otherwise the step in flight completes first and the next is
        scheduled after it, as a synchronous engine does."""
        start, cpu_start = time.perf_counter(), time.process_time()
        previous, self._in_flight = self._in_flight, None
        if previous is None:  # executables run while nothing was in flight (a user's own calls) are no step's
            self.runner.take_calls()
        with self._lock:
            queued = bool(self._new or self._aborts)  # (what is queued later waits for the next call)
        run_ahead = previous is not None and not queued and self._can_run_ahead(previous)
        if run_ahead:
            for seq in previous.launched.targets:
                seq.output_token_ids.append(_PLACEHOLDER)
            self._in_flight = self._schedule_step(start, previous.launched)
            return self._complete(previous, start, cpu_start, placeholders=True)
        results = [] if previous is None else self._complete(previous, start, cpu_start)
        start, cpu_start = time.perf_counter(), time.process_time()
        flight = self._schedule_step(start)
        self._in_flight = flight if flight.out.rows or flight.progressed else None
        return results

    def _can_run_ahead(self, previous: "_InFlight") -> bool:
        """Whether the next step may be scheduled before `previous`'s samples are read: `previous` a plain
        decode step (one sampler run; no speculative decoding, beam search or structured output; no prefix
        caching, whose hashes need the tokens, nor data parallelism), its sequences all that runs, nothing waiting or
        swapped (nor queued: the caller checks), each sequence with room for two more tokens in the
        context, and blocks for every one's next token. The next step then decodes exactly those
        sequences, one token further, as a synchronous engine would once their tokens are known."""
        launched, scheduler = previous.launched, self.scheduler
        if (launched is None or launched.parts is None or len(launched.parts) != 1 or not previous.out.is_decode
                or self.proposer is not None or self._matchers or self.kv_cache_spec.enable_prefix_caching
                or self.num_partitions > 1 or scheduler.waiting or scheduler.swapped
                or any(g.params.use_beam_search for g in previous.out.groups)):
            return False
        running = {seq.seq_id for g in scheduler.running for seq in g.live_seqs}
        return (running == {seq.seq_id for seq in launched.targets}
                and all(seq.num_tokens + 2 <= self.max_model_len for seq in launched.targets)
                and scheduler.can_decode_all())

    def _schedule_step(self, start: float, previous: Optional["_Launched"] = None) -> "_InFlight":
        """Drains the queues (not when running ahead of `previous`: see `_step_async`), schedules a step and
        dispatches it (`_launch`); a step that fails to dispatch fails its requests."""
        aborted = self._drain_queues() if previous is None else []
        out = self.scheduler.schedule()
        flight = _InFlight(out, None, {g.request_id: g for g in aborted + out.finished}, time.perf_counter() - start)
        if out.rows:
            try:
                flight.launched = self._launch(out, previous)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                flight.progressed.update((g.request_id, g) for g in self._fail(out, e))
        return flight

    def _complete(self, flight: "_InFlight", start: float, cpu_start: float, *,
                  placeholders: bool = False) -> list[RequestOutput]:
        """Applies a dispatched step's samples (`_apply`), then its outputs, statistics and `StepRecord`."""
        out, progressed = flight.out, flight.progressed
        shape, num_padded, num_sampled = None, 0, 0
        if out.rows:
            if flight.launched is not None:
                try:
                    shape, num_padded, num_sampled = self._apply(flight.launched, placeholders=placeholders)
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                    progressed.update((g.request_id, g) for g in self._fail(out, e))
            progressed.update(zip(map(_REQUEST_ID, out.groups), out.groups))
        finished = [g for g in progressed.values() if g.status is GroupStatus.FINISHED]
        if self._matchers:
            for group in finished:
                for seq in group.seqs:
                    self._matchers.pop(seq.seq_id, None)
        results = [self._request_output(g) for g in progressed.values()]
        with self._lock:
            self._request_ids.difference_update(g.request_id for g in finished)
        calls = self.runner.take_calls()
        compile_s = sum(c.compile_seconds for c in calls)
        seconds = time.perf_counter() - start - compile_s
        cpu_seconds = time.process_time() - cpu_start - sum(c.compile_cpu_seconds for c in calls)
        self._record_usage()  # statistics: after the step's clock stopped
        record = StepRecord(
            index=self.num_steps, kind=("decode" if out.is_decode else "prefill") if out.rows else None,
            num_rows=len(out.rows), num_computed_tokens=out.num_tokens, num_padded_tokens=num_padded,
            num_sampled_tokens=num_sampled, shape=shape, calls=calls, ops=out.ops, seconds=seconds,
            cpu_seconds=cpu_seconds, compile_seconds=compile_s, kv=self.scheduler.block_manager,
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_swapped=len(self.scheduler.swapped), preempted=tuple(g.request_id for g in out.preempted),
            finished=tuple(g.request_id for g in finished))
        self.num_steps += 1
        device = record.device_seconds
        self.timings["step_s"] += seconds
        self.timings["schedule_s"] += flight.schedule_s
        self.timings["device_s"] += device
        self.timings["host_s"] += seconds - device
        for observer in list(self._observers):
            observer(record)
        return results

    def _drain_queues(self) -> list[SequenceGroup]:
        with self._lock:
            while self._new:
                self.scheduler.add(self._new.popleft())
            aborts = list(self._aborts)
            self._aborts.clear()
        return [g for g in map(self.scheduler.abort, aborts) if g is not None]

    def _launch(self, out: SchedulerOutput, previous: Optional["_Launched"] = None) -> "_Launched":
        """Dispatches the step's block operations, model step and sampler (the samples not read). Running
        ahead of `previous` (async scheduling), each row's input token is its sequence's sample there,
        taken on the device."""
        self.runner.swap_out(out.ops.swap_out)
        self.runner.swap_in(out.ops.swap_in)
        self.runner.copy_blocks(out.ops.copy_pairs)
        self.scheduler.propose_drafts(out)  # once the pool holds what the step's sequences hold
        inputs = self.runner.make_inputs(out.rows, decode=out.is_decode, shapes=self.shapes)
        if previous is not None:  # a decode step over `previous`'s sequences: row (= packed token) i is row_seqs[i]
            sample_of = {seq.seq_id: i for entries in previous.by_group.values() for seq, i in entries}
            source = np.full(inputs.token_ids.shape[0], -1, np.int32)
            source[:len(out.rows)] = [sample_of[seqs[0].seq_id] for seqs in out.row_seqs]
            (sampled, _), = previous.parts
            inputs = self.runner.feed_tokens(inputs, source, sampled.token_ids)
        logits = self.runner.run_step(inputs, decode=out.is_decode)
        group_of = {s.seq_id: g for g in out.groups for s in g.seqs}
        sample_rows, targets = [], []
        verify = {}  # speculative decoding: seq_id -> its drafts (sampled in the rows after its own)
        # request_id -> (sequence, the index of its first sample: its drafts' follow)
        by_group: dict[str, list[tuple[Sequence, int]]] = collections.defaultdict(list)
        drafts_of = out.drafts
        for row, seqs in enumerate(out.row_seqs):
            for seq in seqs:
                group = group_of[seq.seq_id]
                p = group.params
                temperature = 0.0 if p.beam_width > 1 else p.temperature  # (beam search: greedy candidates)
                step = len(seq.output_token_ids)
                by_group[group.request_id].append((seq, len(sample_rows)))
                targets.append(seq)
                if not (drafts_of and seq.seq_id in drafts_of):
                    sample_rows.append(_sample_row((row, temperature, p.top_k, p.top_p, group.seed, seq.sample_index,
                                                    step, -1, None)))
                    continue
                drafts = verify[seq.seq_id] = drafts_of[seq.seq_id][1]
                for j in range(len(drafts) + 1):  # row + j's logits verify draft j (the last: a bonus token)
                    sample_rows.append(SampleRow(row + j, temperature, p.top_k, p.top_p, group.seed,
                                                 seq.sample_index, step + j, drafts[j] if j < len(drafts) else -1))
        parts = None
        if sample_rows:  # (none: every row a chunk of a prompt that goes on in a later step)
            sample_rows = self._constrain(sample_rows, targets, verify, group_of)
            num_top = max(g.params.num_top_logprobs for g in out.groups)
            parts = self.runner.dispatch_sample(logits, sample_rows, num_top, shapes=self.shapes)
        return _Launched(out, inputs.shape_key, int(inputs.token_ids.shape[0]), parts, targets, verify, by_group)

    def _apply(self, launched: "_Launched", *, placeholders: bool = False) -> tuple[tuple, int, int]:
        """Reads a dispatched step's samples and applies them: tokens, text, stops, drafts, beams.
        `placeholders`: its sequences hold a placeholder for the token read (a step ran ahead), replaced
        now. A sequence that finished since the step was dispatched (async scheduling: a step earlier)
        drops its sample. Returns (the model step's input shapes, its padded token count, tokens sampled)."""
        if launched.parts is None:
            return launched.shape, launched.num_padded, 0
        samples = self.runner.fetch_samples(launched.parts)
        samples.update(token_ids=samples["token_ids"].tolist(), logprobs=samples["logprobs"].tolist())
        if placeholders:
            for seq in launched.targets:
                seq.output_token_ids.pop()
        now = time.monotonic()
        verify, num_sampled = launched.verify, 0  # tokens appended: one per sequence, one more per accepted draft
        by_group = launched.by_group
        for group in launched.out.groups:
            entries = by_group.get(group.request_id)
            if not entries or group.status is GroupStatus.FINISHED:
                continue  # its prompt is being prefilled, or it finished a step earlier
            if len(entries) > 1 or entries[0][0].finish_reason is not None:
                entries = [(seq, i) for seq, i in entries if seq.finish_reason is None]
                if not entries:
                    continue
            num_sampled += len(entries)
            if group.first_token_time is None:
                group.first_token_time = now
            if not (verify or group.params.beam_width > 1):  # one token a sequence (the common case)
                for seq, i in entries:
                    self._append_sample(group, seq, samples, i)
            elif group.params.use_beam_search:
                self._beam_step(group, [(seq, samples["top_ids"][i], samples["top_logprobs"][i])
                                        for seq, i in entries])
            else:
                for seq, i in entries:
                    drafts = verify.get(seq.seq_id, ())
                    for j in range(len(drafts) + 1):  # the accepted drafts, then one token drawn
                        num_sampled += j > 0
                        if not self._append_sample(group, seq, samples, i + j):
                            break  # the sequence stopped
                        if j == len(drafts) or not samples["accepted"][i + j]:
                            break
                    if drafts:  # rejected drafts' slots go back (all of them, had the sequence stopped)
                        num_accepted = sum(1 for _ in itertools.takewhile(bool, samples["accepted"][i:i + len(drafts)]))
                        self._count_drafts(len(drafts), num_accepted)
                        self.scheduler.commit_drafts(seq, num_accepted)
            if not group.live_seqs:
                self.scheduler.finish_group(group)
        return launched.shape, launched.num_padded, num_sampled

    def _constrain(self, sample_rows: list[SampleRow], targets: list[Sequence], verify: dict,
                   group_of: dict) -> list[SampleRow]:
        """Structured output: the sample rows of constrained sequences, with the tokens their matchers
        allow next (the others unchanged; with `ignore_eos`, end-of-sequence tokens only once the
        constraint allows nothing else). A constrained sequence has one sample row (it drafts nothing)."""
        if not self._matchers:
            return sample_rows
        rows, i = list(sample_rows), 0
        bitmask = None
        for seq in targets:
            matcher = self._matchers.get(seq.seq_id)
            if matcher is not None:
                if bitmask is None:
                    bitmask = self.grammars.allocate_bitmask(len(rows))
                fill_bitmask(matcher, bitmask, i)
                if group_of[seq.seq_id].params.ignore_eos:
                    words, kept = bitmask[i].view(np.uint32), bitmask[i].copy()
                    for eos in self.eos_token_ids:
                        words[eos // 32] &= ~np.uint32(1 << (eos % 32))
                    if not words.any():  # end-of-sequence was all it allowed
                        bitmask[i] = kept
                rows[i] = rows[i]._replace(allowed=bitmask[i])
            i += 1 + len(verify.get(seq.seq_id, ()))
        return rows

    def _append_sample(self, group: SequenceGroup, seq: Sequence, samples: dict, i: int) -> bool:
        """Appends sample `i` to `seq` (with its log-probabilities as asked); False when the sequence
        stopped with it (and was finished). A constrained sequence's matcher consumes the token, and
        the sequence stops ("stop") when its constraint is complete."""
        token, logprob, top = samples["token_ids"][i], samples["logprobs"][i], None
        if group.params.logprobs is not None:  # the k most likely tokens, and the one chosen
            k = group.params.logprobs
            top = dict(zip(samples["top_ids"][i][:k].tolist(), samples["top_logprobs"][i][:k].tolist()))
            top.setdefault(token, logprob)
        seq.append_token(token, logprob, top)
        reason = self._stop_reason(group, seq, token)
        matcher = self._matchers.get(seq.seq_id) if self._matchers else None
        if matcher is not None and reason is None:
            if not matcher.consume_token(token):
                logger.warning("request %s: token %d does not follow its constraint (%s): stopping it",
                               group.request_id, token, matcher.get_error())
                reason = "stop"
            elif matcher.is_stopped():
                reason = "stop"
        if reason is not None:
            self.scheduler.finish_seq(seq, reason)
            return False
        return True

    def _count_drafts(self, num_proposed: int, num_accepted: int) -> None:
        counts = self.spec_counts
        counts["num_proposed"] += num_proposed
        counts["num_accepted"] += num_accepted
        for j in range(num_proposed):
            counts["proposed_by_position"][j] += 1
            counts["accepted_by_position"][j] += j < num_accepted

    def _fail(self, out: SchedulerOutput, e: Exception) -> list[SequenceGroup]:
        """A step raised: the requests it ran fail with the error (their blocks come back); if the
        device pool was lost with it (a donated pool consumed by a failed executable), a new one is
        made and every running request fails too, its K/V having been there. Returns the groups failed
        besides the step's own."""
        error = f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]
        logger.error("a step failed, failing the %d requests it ran: %s", len(out.groups), error)
        for group in out.groups:
            if not group.is_finished:
                self.scheduler.fail(group, error)
        if not self.runner.pool_lost:
            return []
        self.runner.reset_pool()
        return self.scheduler.lose_device_blocks(f"the KV pool was lost in a failed step ({error})")

    def _beam_step(self, group: SequenceGroup, beams: list) -> None:
        """Applies one step of beam search: forks for parents chosen more than once, frees the beams
        not chosen, appends the chosen tokens."""
        p = group.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        decision = beam_search.step(group.beam_state, p, beams, stop_ids, self.max_model_len)
        continued, seqs = set(), []
        for candidate in decision.beams:  # fork before anything is appended to the parent
            parent = candidate.parent
            if parent.seq_id in continued:
                seqs.append(self.scheduler.fork_seq(parent, next(self._seq_ids)))
            else:
                continued.add(parent.seq_id)
                seqs.append(parent)
        self.scheduler.set_beams(group, seqs)
        for seq, candidate in zip(seqs, decision.beams):
            seq.append_token(candidate.token_id, candidate.logprob)
        group.beam_state = decision.state

    def _stop_reason(self, group: SequenceGroup, seq: Sequence, token: int) -> Optional[str]:
        """Detokenizes the newest token (`token`); returns why `seq` stops ("stop": EOS, a stop token
        or string, whose text is cut; "length": max_tokens or the context), or None."""
        p = group.params
        new_text = append_text(self._decode, seq)
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if p.stop:
            cut = find_stop(seq.text, p.stop, len(new_text))
            if cut is not None:
                seq.text = seq.text[:cut]
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- pausing ------------------------------------------------------------------------------

    def save(self, path) -> pathlib.Path:
        """Pauses the engine here: writes its KV pools and host state to the directory `path`
        (`jpaged.engine.snapshot`), from which `LLMEngine.restore` goes on with exactly the tokens
        this engine would give. This engine is unchanged and may go on too. Call it between steps."""
        from jpaged.engine import snapshot

        return snapshot.save(self, path)

    @classmethod
    def restore(cls, path, *, loaded: Optional[LoadedModel] = None, **overrides) -> "LLMEngine":
        """An engine saved by `save`, ready for its next step: the same model (checked; `loaded` or
        `model=` give it where it now lives) and the saved settings (`attention_backend` and
        `interpret` may change; anything that shapes the state may not)."""
        from jpaged.engine import snapshot

        return snapshot.restore(cls, path, loaded=loaded, **overrides)

    def host_state(self) -> dict:
        """What a paused engine keeps on the host, as objects to pickle together (one pickle keeps the
        sharing between queues, groups and sequences): the scheduler (KV cache manager snapshot,
        queues, groups with their sequences and beam state), requests queued or aborted since the last
        step, the seed generator, the next sequence id and the statistics. Not while a step is in
        flight (async scheduling): step until `has_unfinished()` is False first."""
        if self._in_flight is not None:
            raise ValueError("a step is in flight (async_scheduling): call save once has_unfinished() is False, "
                             "or save a synchronous engine")
        with self._lock:
            next_seq_id = next(self._seq_ids)
            self._seq_ids = itertools.count(next_seq_id)
            return {"scheduler": self.scheduler, "new": list(self._new), "aborts": list(self._aborts),
                    "request_ids": set(self._request_ids), "rng": self._rng, "next_seq_id": next_seq_id,
                    "peak_used_blocks": self.peak_used_blocks, "num_steps": self.num_steps,
                    "timings": dict(self.timings),
                    "utilization": (self._utilization_sum, self._utilization_steps), "clock": time.monotonic()}

    def load_host_state(self, state: dict) -> None:
        """Takes over `host_state()`'s objects (from an unpickled copy: they become this engine's).
        Request timestamps move by the time paused, so the pause counts in no latency."""
        shift = time.monotonic() - state["clock"]
        scheduler = state["scheduler"]
        for group in [*scheduler.waiting, *scheduler.running, *scheduler.swapped, *state["new"]]:
            for name in ("arrival_time", "first_scheduled_time", "first_token_time", "finished_time"):
                if getattr(group, name) is not None:
                    setattr(group, name, getattr(group, name) + shift)
        with self._lock:
            self.scheduler = scheduler
            self._new = collections.deque(state["new"])
            self._aborts = collections.deque(state["aborts"])
            self._request_ids = set(state["request_ids"])
            self._rng = state["rng"]
            self._seq_ids = itertools.count(state["next_seq_id"])
            self.peak_used_blocks, self.num_steps = state["peak_used_blocks"], state["num_steps"]
            self.timings = collections.Counter(state["timings"])
            self._utilization_sum, self._utilization_steps = state["utilization"]
            # structured output: each constrained sequence's matcher, its generated tokens replayed
            self._matchers = {
                seq.seq_id: self.grammars.matcher(group.params.structured_outputs, seq.output_token_ids)
                for group in [*scheduler.waiting, *scheduler.running, *scheduler.swapped, *state["new"]]
                if group.params.structured_outputs is not None for seq in group.live_seqs}

    # ---- outputs and statistics --------------------------------------------------------------

    def _completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        """A beam group's finished hypotheses (once done) or running beams, best first; otherwise
        the samples in order. Text still open to a stop string is held back (never retracted)."""
        p = group.params
        if p.use_beam_search and not group.seqs:  # (beam search returns no per-token logprobs: SamplingParams)
            return [CompletionOutput(i, self.tokenizer.decode(h.output_token_ids, skip_special_tokens=True),
                                     list(h.output_token_ids), h.cumulative_logprob, h.finish_reason, None)
                    for i, h in enumerate(group.beam_state.finished)]
        if p.use_beam_search:
            seqs = sorted(group.seqs, key=lambda s: -s.cumulative_logprob)
        else:
            seqs = group.seqs if len(group.seqs) == 1 else sorted(group.seqs, key=lambda s: s.sample_index)
        return [CompletionOutput(i, seq.text if seq.finished else seq.text[:stream_safe_length(seq.text, p.stop)],
                                 list(seq.output_token_ids), seq.cumulative_logprob, seq.finish_reason,
                                 list(seq.output_logprobs) if p.logprobs is not None else None)
                for i, seq in enumerate(seqs)]

    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        """The group's cumulative output now. Deferred (`RequestOutput.deferred`) but for beam search: a
        snapshot of each sequence (its append-only token and log-probability lists with their lengths, its
        text, numbers) and of the metrics, built into lists and objects only if read."""
        if group.params.use_beam_search:  # (beams fork and finish hypotheses: built now)
            metrics = RequestMetrics(group.arrival_time, group.first_scheduled_time, group.first_token_time,
                                     group.finished_time, group.num_preemptions, group.num_cached_tokens)
            return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids),
                                 self._completions(group), group.is_finished, metrics, group.error)
        p = group.params
        logprobs = p.logprobs is not None
        snapshot = (group.prompt_token_ids, p.stop, group.arrival_time, group.first_scheduled_time,
                    group.first_token_time, group.finished_time, group.num_preemptions, group.num_cached_tokens)
        if len(group.seqs) == 1 and not logprobs:  # (most requests)
            s = group.seqs[0]
            snapshot += ((s.output_token_ids, len(s.output_token_ids), s.text, s.cumulative_logprob, s.finish_reason,
                          None),)
        else:
            snapshot += tuple((s.output_token_ids, len(s.output_token_ids), s.text, s.cumulative_logprob,
                               s.finish_reason, (s.output_logprobs, len(s.output_logprobs)) if logprobs else None)
                              for s in sorted(group.seqs, key=lambda s: s.sample_index))
        return RequestOutput.deferred(group.request_id, group.prompt, group.status is GroupStatus.FINISHED,
                                      group.error, _built_output, snapshot)

    def _record_usage(self) -> None:
        """Peak used blocks, and KV utilization: token slots holding K/V over the slots of the device
        blocks in use (a block shared by several tables counts once; a manager that reserves blocks
        ahead counts them as in use)."""
        bm = self.scheduler.block_manager
        self.peak_used_blocks = max(self.peak_used_blocks, bm.num_blocks - self.num_partitions - bm.num_free_blocks)
        utilization = kv_utilization(bm)
        if utilization is not None:
            self._utilization_sum += utilization
            self._utilization_steps += 1

    def stats(self) -> dict:
        """Block pool and scheduler statistics (a cached block with refcount 0 counts as free)."""
        bm = self.scheduler.block_manager
        s = self.scheduler
        return {
            **bm.stats(),
            "peak_used_blocks": self.peak_used_blocks,
            "kv_utilization": self._utilization_sum / self._utilization_steps if self._utilization_steps else None,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_hit_rate": s.num_cached_prompt_tokens / s.num_prompt_tokens if s.num_prompt_tokens else 0.0,
            "num_prefilled_tokens": s.num_prompt_tokens - s.num_cached_prompt_tokens,
            "num_steps": self.num_steps,
            "num_compilations": self.runner.num_compilations,
            "num_warm_up_compilations": self.runner.num_warm_up_compilations,
            "num_compilations_after_warm_up": self.runner.num_compilations_after_warm_up,
            "num_devices": len(self.runner.devices), "kv_head_replication": self.runner.kv_head_replication,
            "compile_seconds": self.runner.compile_seconds,
            "waiting": len(s.waiting), "running": len(s.running), "swapped": len(s.swapped),
            "spec_decode": self._spec_stats(),
        }

    def _spec_stats(self) -> Optional[dict]:
        """Speculative decoding's counts: drafts proposed and accepted, the acceptance rate, and the rate at
        each draft position (the j-th draft of a step is accepted only after the ones before it); None
        when it is off."""
        if self.proposer is None:
            return None
        c = self.spec_counts
        return {"method": self.proposer.name, "num_proposed": c["num_proposed"], "num_accepted": c["num_accepted"],
                "acceptance_rate": c["num_accepted"] / c["num_proposed"] if c["num_proposed"] else None,
                "acceptance_rate_by_position": [a / p if p else None for a, p in
                                                zip(c["accepted_by_position"], c["proposed_by_position"])]}


_REQUEST_ID = operator.attrgetter("request_id")

# a `SampleRow` without its Python-level __new__ (every field given: a step builds one a sequence)
_sample_row = functools.partial(tuple.__new__, SampleRow)


def freeze_heap() -> None:
    """Collects garbage, then moves every object alive into the garbage collector's permanent generation
    (`gc.freeze()`), out of every later collection's walk; vLLM's engine core does the same once started.
    Objects frozen are still freed when their reference count drops (an engine is: it holds no reference
    cycle), only a cycle among them is never collected. After the first call a collection walks only what
    was allocated since, so the next engine built pays little for it."""
    gc.collect()
    gc.freeze()


def _built_output(prompt_token_ids: tuple, stop: tuple, *snapshot) -> tuple:
    """A deferred `RequestOutput`'s (prompt_token_ids, outputs, metrics) from `_request_output`'s snapshot
    (the 6 metrics, then each sequence's state), as `_completions` builds them: text still open to a stop
    string is held back (never retracted)."""
    outputs = [CompletionOutput(i, text if reason is not None else text[:stream_safe_length(text, stop)],
                                token_ids[:n], cumulative_logprob, reason,
                                None if logprobs is None else logprobs[0][:logprobs[1]])
               for i, (token_ids, n, text, cumulative_logprob, reason, logprobs) in enumerate(snapshot[6:])]
    return list(prompt_token_ids), outputs, RequestMetrics(*snapshot[:6])


def valid_text(text: str) -> str:
    """`text` with every code point that UTF-8 cannot encode (a lone surrogate, as `json` or a
    broken decoder can leave) replaced by U+FFFD; a surrogate pair becomes its character. Control
    characters stay: they are text too."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _check_runner(runner: ModelRunner, model_config, spec: KVCacheSpec, dtype) -> None:
    """A runner given to an engine must be for its model and hold pools of its geometry."""
    have = (runner.config, runner.num_blocks, runner.block_size, runner.num_cpu_blocks, runner.kv_dtype)
    want = (model_config, spec.num_blocks, spec.block_size, spec.num_cpu_blocks, np.dtype(dtype))
    names = ("model config", "num_blocks", "block_size", "num_cpu_blocks", "dtype")
    for name, a, b in zip(names, have, want):
        if a != b:
            raise ValueError(f"the runner given does not fit this engine: its {name} is {a}, the engine's {b}")
