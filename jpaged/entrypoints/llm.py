"""`LLM`: the offline, notebook-friendly entry point (vLLM's `LLM` names).

    from jpaged import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from jpaged.core.sampling_params import as_list
from jpaged.device import distributed
from jpaged.engine import EngineConfig, LLMEngine, RequestOutput
from jpaged.weights import LoadedModel


class LLM:
    """Loads a model (default: the embedded SmolLM2-135M-Instruct) and a paged KV cache.

    `num_blocks` counts every block of the pool, the null block included; with `num_blocks=None`
    the pool is sized from `kv_cache_memory`. Other keyword arguments are `EngineConfig` fields.

    Compilation: each new step shape compiles when first met; `llm.engine.warm_up()` compiles them
    all ahead. `LLM` leaves JAX's global configuration alone: JAX's persistent compilation cache (on
    by default in the CLI) is yours to turn on, e.g. `jpaged.entrypoints.cli.enable_compile_cache()`.
    """

    def __init__(self, model: Optional[str] = None, block_size: int = 16, num_blocks: Optional[int] = None,
                 kv_cache_memory: str | int = "1GiB", dtype: str = "float32", *,
                 loaded: Optional[LoadedModel] = None, runner=None, kv_cache_manager=None, params=None, **kwargs):
        """`loaded` reuses an already loaded model (e.g. one `load_model()` shared by several LLMs);
        `params` serves another parameter pytree of that model's layout (e.g. fine-tuned:
        `LLM(loaded=model, params=tuned)`, `model` from `load_model()`; `llm.engine.model` is the model
        as served, on a CPU with [out, in] rows in place of those arrays); `runner`, `kv_cache_manager`
        and `params` are passed to `LLMEngine`."""
        self.engine = LLMEngine(EngineConfig(model=model, block_size=block_size, num_blocks=num_blocks,
                                             kv_cache_memory=kv_cache_memory, dtype=dtype, **kwargs),
                                loaded=loaded, runner=runner, kv_cache_manager=kv_cache_manager, params=params)
        self.tokenizer = self.engine.tokenizer
        self._request_counter = itertools.count()
        self.last_run: dict = {}

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for each prompt (text, or a list of token ids). Every prompt is validated before
        any runs: a bad one raises ValueError and nothing is queued. Outputs come in input order.
        Several processes (`jpaged.device.distributed`): every process calls it; process 0's prompts and
        sampling params are run (the others' are ignored) and every process returns the outputs."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # one prompt, not a batch
        if self.engine.has_unfinished():
            raise ValueError("the engine has requests in flight that generate() did not queue (engine.add_request): "
                             "run them with engine.step() or abort them first, or use another LLM")
        # several processes (`jpaged.device.distributed`): every one runs process 0's requests
        prompts, sampling_params = distributed.broadcast((list(prompts), sampling_params))
        params = as_list(sampling_params, len(prompts))
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                _, ids = self.engine.tokenize(prompt)
                self.engine.check_request(ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = [f"{next(self._request_counter)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(request_id, prompt, p)
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Applies the chat template to one conversation (a list of {"role", "content"} dicts) or to a
        list of conversations, then generates."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.chat_prompt(conversation, add_generation_prompt) for conversation in messages]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, conversation, add_generation_prompt: bool = True) -> dict:
        """The templated conversation as a prompt (`LLMEngine.chat_prompt`)."""
        return self.engine.chat_prompt(conversation, add_generation_prompt)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True) -> str:
        return self.engine.apply_chat_template(conversation, add_generation_prompt)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        finished: dict[str, RequestOutput] = {}
        compile_before = engine.runner.compile_seconds
        start = time.perf_counter()
        with tqdm(total=len(request_ids), desc="requests", disable=not use_tqdm or len(request_ids) < 2,
                  leave=False) as bar:
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        compile_s = engine.runner.compile_seconds - compile_before
        self.last_run = {"elapsed_s": time.perf_counter() - start - compile_s, "compile_s": compile_s}
        return [finished[i] for i in request_ids]
