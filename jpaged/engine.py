"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduler step at a time.

`add_request` validates one request and rejects only that one; `step()` runs one scheduler step
(a prefill or a decode over the running batch) and returns the requests that progressed;
`abort` ends a request wherever it is. `add_request` and `abort` may be called from other threads
while one thread drives `step()`: they queue under a lock and take effect at the next step.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Optional, Sequence as Seq

import jax.numpy as jnp
import numpy as np

from jpaged import beam_search
from jpaged.attention import get_backend
from jpaged.block_manager import BlockManager
from jpaged.detokenizer import append_text, find_stop, stream_safe_length
from jpaged.kv_cache import bytes_per_block, num_blocks_for_memory, parse_memory_size
from jpaged.loader import LoadedModel, load_model
from jpaged.params import cast_params
from jpaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jpaged.runner import ModelRunner, SampleRow
from jpaged.sampling_params import SamplingParams
from jpaged.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jpaged.sequence import Sequence, SequenceGroup

logger = logging.getLogger("jpaged")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine settings. `num_blocks` counts the whole pool, the null block included;
    when None it is sized from `kv_cache_memory` (bytes or e.g. '1GiB')."""

    model: Optional[str] = None
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_cache_memory: str | int = "1GiB"
    dtype: str = "float32"
    attention_backend: str = "auto"
    interpret: bool = False
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    preemption_mode: str = "recompute"
    swap_space: float = 0.0  # GiB of CPU block pool, as in vLLM
    enable_prefix_caching: bool = False
    seed: int = 0
    free_block_ids: Optional[tuple[int, ...]] = None  # initial free-list order (tests scatter blocks)
    kv_policy: str = "paged"  # or the contiguous-reservation baselines "orca_max" / "orca_pow2" / "orca_oracle"

    def __post_init__(self):
        b = self.block_size
        if not (isinstance(b, int) and b >= 1 and b & (b - 1) == 0):
            raise ValueError(f"block_size must be a power of two (e.g. 16), got {b!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), got {self.num_blocks}")
        if self.kv_policy not in ("paged", "orca_max", "orca_pow2", "orca_oracle"):
            raise ValueError(f"kv_policy must be 'paged', 'orca_max', 'orca_pow2' or 'orca_oracle', got {self.kv_policy!r}")
        if self.kv_policy != "paged" and (self.preemption_mode == "swap" or self.enable_prefix_caching):
            raise ValueError(f"kv_policy={self.kv_policy!r} reserves contiguous runs: it supports neither swap "
                             "nor prefix caching (use kv_policy='paged')")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), *, loaded: Optional[LoadedModel] = None, **overrides):
        config = dataclasses.replace(config, **overrides)
        self.config = config
        dtype = DTYPES[config.dtype]
        if loaded is not None and loaded.params.embed.dtype != dtype:
            loaded = dataclasses.replace(loaded, params=cast_params(loaded.params, dtype))
        self.model = loaded if loaded is not None else load_model(config.model, dtype=dtype)
        self.tokenizer = self.model.tokenizer
        model_config = self.model.config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        num_blocks = config.num_blocks or num_blocks_for_memory(
            model_config, config.block_size, dtype, parse_memory_size(config.kv_cache_memory))
        if num_blocks < 2:
            raise ValueError(f"a KV cache of {config.kv_cache_memory} holds {num_blocks} blocks of "
                             f"{config.block_size} tokens: give it more memory (kv_cache_memory) or set num_blocks")
        num_cpu_blocks = int(config.swap_space * 2**30 // bytes_per_block(model_config, config.block_size, dtype))
        if config.preemption_mode == "swap":
            num_cpu_blocks = min(max(num_cpu_blocks, 1), num_blocks)  # never needs more than the device pool
        self.block_manager_args = dict(num_blocks=num_blocks, block_size=config.block_size,
                                       num_cpu_blocks=num_cpu_blocks,
                                       enable_prefix_caching=config.enable_prefix_caching,
                                       free_block_ids=config.free_block_ids)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens or max(self.max_model_len, 2048),
            preemption_mode=config.preemption_mode)
        self.scheduler = Scheduler(self._create_block_manager(), scheduler_config)
        params = self.model.params
        self.runner = ModelRunner(model_config, params, num_blocks=num_blocks, block_size=config.block_size,
                                  dtype=dtype, backend=get_backend(config.attention_backend, interpret=config.interpret),
                                  num_cpu_blocks=num_cpu_blocks)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self._rng = np.random.default_rng(config.seed)
        self._seq_ids = itertools.count()
        self._lock = threading.Lock()
        self._new: collections.deque[SequenceGroup] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._request_ids: set[str] = set()
        self.peak_used_blocks = 0
        self.num_steps = 0
        # cumulative seconds: whole steps (compilation excluded), scheduling, device executables, the rest
        self.timings = collections.Counter(step_s=0.0, schedule_s=0.0, device_s=0.0, host_s=0.0)
        self._utilization_sum = 0.0
        self._utilization_steps = 0

    def _create_block_manager(self):
        if self.config.kv_policy == "paged":
            return BlockManager.create(**self.block_manager_args)
        from jpaged.reservation import OrcaBlockManager

        return OrcaBlockManager.create(policy=self.config.kv_policy, max_model_len=self.max_model_len,
                                       **self.block_manager_args)

    @property
    def num_blocks(self) -> int:
        return self.block_manager_args["num_blocks"]

    # ---- requests ----------------------------------------------------------------------------

    def tokenize(self, prompt) -> tuple[Optional[str], list[int]]:
        """A prompt is text or a list of token ids (vLLM's forms). Raises ValueError saying what to change."""
        if isinstance(prompt, dict):  # {"prompt": text, "prompt_token_ids": ids}: ids win, text is kept
            text = prompt.get("prompt")
            if "prompt_token_ids" not in prompt:
                return self.tokenize(text)
            return text, self.tokenize(list(prompt["prompt_token_ids"]))[1]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty: give at least one non-blank character")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple, np.ndarray)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("prompt is empty: give at least one token id")
            vocab = self.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            return None, ids
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        if self.config.kv_policy != "paged" and (params.n > 1 or params.use_beam_search):
            raise ValueError(f"kv_policy={self.config.kv_policy!r} reserves one contiguous run per sequence and "
                             "cannot share blocks: use n=1 without beam search, or kv_policy='paged'")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens but the model's context is {self.max_model_len}: "
                             f"shorten it to at most {self.max_model_len - 1} tokens")
        bs = self.config.block_size
        need = -(-n // bs)
        if need > self.num_blocks - 1:
            raise ValueError(f"prompt of {n} tokens needs {need} KV blocks of {bs} tokens but the pool has "
                             f"{self.num_blocks - 1}: raise num_blocks / kv_cache_memory or shorten the prompt")

    def add_request(self, request_id: str, prompt, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        """Queues one request; raises ValueError (and changes nothing) when it is bad."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        self.check_request(ids, params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        width = params.beam_width if params.use_beam_search else params.n
        num_seqs = 1 if params.use_beam_search else width
        seqs = [Sequence(next(self._seq_ids), i, tuple(ids)) for i in range(num_seqs)]
        group = SequenceGroup(str(request_id), text, tuple(ids), params, seed, seqs,
                              arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        with self._lock:
            if group.request_id in self._request_ids:
                raise ValueError(f"request_id {request_id!r} is already in use: pick a unique id")
            self._request_ids.add(group.request_id)
            self._new.append(group)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(str(request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._new) or self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step. Returns the requests that progressed (cumulative outputs)."""
        start = time.perf_counter()
        device_before, compile_before = self.runner.device_seconds, self.runner.compile_seconds
        aborted = self._drain_queues()
        out = self.scheduler.schedule()
        self.timings["schedule_s"] += time.perf_counter() - start
        progressed = {g.request_id: g for g in aborted + out.finished}
        if out.rows:
            self._execute(out)
            progressed.update((g.request_id, g) for g in out.groups)
        self.num_steps += 1
        self._record_usage()
        results = [self._request_output(g) for g in progressed.values()]
        for group in progressed.values():
            if group.is_finished:
                self._request_ids.discard(group.request_id)
        total = time.perf_counter() - start - (self.runner.compile_seconds - compile_before)
        device = self.runner.device_seconds - device_before
        self.timings["step_s"] += total
        self.timings["device_s"] += device
        self.timings["host_s"] += total - device
        return results

    def _drain_queues(self) -> list[SequenceGroup]:
        with self._lock:
            while self._new:
                self.scheduler.add(self._new.popleft())
            aborts = list(self._aborts)
            self._aborts.clear()
        aborted = []
        for request_id in aborts:
            group = self.scheduler.abort(request_id)
            if group is not None:
                group.finished_time = time.monotonic()
                aborted.append(group)
        return aborted

    def _execute(self, out: SchedulerOutput) -> None:
        self.runner.swap_out(out.ops.swap_out)
        self.runner.swap_in(out.ops.swap_in)
        self.runner.copy_blocks(out.ops.copy_pairs)
        logits = self.runner.execute(out.rows, decode=out.is_decode)
        group_of = {s.seq_id: g for g in out.groups for s in g.seqs}
        sample_rows, targets = [], []
        for row, seqs in enumerate(out.row_seqs):
            for seq in seqs:
                group = group_of[seq.seq_id]
                p = group.params
                temperature = 0.0 if p.use_beam_search else p.temperature
                sample_rows.append(SampleRow(row, temperature, p.top_k, p.top_p, group.seed, seq.sample_index,
                                             len(seq.output_token_ids)))
                targets.append(seq)
        num_top = max(g.params.num_top_logprobs for g in out.groups)
        samples = self.runner.sample(logits, sample_rows, num_top)
        now = time.monotonic()
        by_group: dict[str, list[tuple[Sequence, int]]] = collections.defaultdict(list)
        for i, seq in enumerate(targets):
            by_group[group_of[seq.seq_id].request_id].append((seq, i))
        for group in out.groups:
            if group.first_token_time is None:
                group.first_token_time = now
            entries = by_group[group.request_id]
            if group.params.use_beam_search:
                beam_search.step(self, group, [(seq, samples["top_ids"][i], samples["top_logprobs"][i])
                                               for seq, i in entries])
            else:
                for seq, i in entries:
                    top = None
                    if group.params.logprobs is not None:
                        k = group.params.logprobs
                        top = dict(zip(samples["top_ids"][i][:k].tolist(), samples["top_logprobs"][i][:k].tolist()))
                    seq.append_token(int(samples["token_ids"][i]), float(samples["logprobs"][i]), top)
                    self._check_stop(group, seq)
            if not group.live_seqs:
                self.scheduler.finish_group(group)

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        """Sets `seq.finish_reason` when it hit EOS, a stop token or string, max_tokens or the context."""
        p = group.params
        token = seq.last_token_id
        new_text = append_text(self.tokenizer, seq)
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            seq.finish_reason = "stop"
        else:
            cut = find_stop(seq.text, p.stop, len(new_text))
            if cut is not None:
                seq.text = seq.text[:cut]
                seq.finish_reason = "stop"
            elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finished:
            self.scheduler.free_seq(seq)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    # ---- outputs and statistics --------------------------------------------------------------

    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        if group.params.use_beam_search:
            seqs = beam_search.ranked(group)
        else:
            seqs = sorted(group.seqs, key=lambda s: s.sample_index)
        outputs = []
        for index, seq in enumerate(seqs):
            text = seq.text if seq.finished else seq.text[:stream_safe_length(seq.text, group.params.stop)]
            outputs.append(CompletionOutput(index, text, list(seq.output_token_ids), seq.cumulative_logprob,
                                            seq.finish_reason,
                                            list(seq.output_logprobs) if group.params.logprobs is not None else None))
        metrics = RequestMetrics(group.arrival_time, group.first_scheduled_time, group.first_token_time,
                                 group.finished_time, group.num_preemptions, group.num_cached_tokens)
        return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids), outputs,
                             group.is_finished, metrics)

    def _record_usage(self) -> None:
        """Peak used blocks, and KV utilization: token slots holding K/V over the slots of the device
        blocks in use (a block shared by several tables counts once; reserved-but-empty blocks of the
        Orca baselines count as in use)."""
        bm = self.scheduler.block_manager
        used = bm.num_blocks - 1 - bm.num_free_blocks
        self.peak_used_blocks = max(self.peak_used_blocks, used)
        if used:
            filled = {}
            for seq_id in bm.seq_ids:
                if bm.is_swapped(seq_id):  # its table holds CPU block ids
                    continue
                table, n = bm.block_table(seq_id), bm.num_tokens(seq_id)
                for j, block_id in enumerate(table):
                    filled[block_id] = max(filled.get(block_id, 0), min(bm.block_size, n - j * bm.block_size))
            self._utilization_sum += sum(filled.values()) / (used * bm.block_size)
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
            "compile_seconds": self.runner.compile_seconds,
            "waiting": len(s.waiting), "running": len(s.running), "swapped": len(s.swapped),
        }
