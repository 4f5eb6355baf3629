"""Session-scoped fixtures shared by the test suite: each model is loaded once per session.

Data: `alpaca_prompts` are the 120 instructions of the repository's own
`bench/data/alpaca_seed_prompts.jsonl` (its source and license: `bench/data/README.md`). The
repository root is put on `sys.path`, so tests import `bench` (its baselines and helpers) too.

Engines: `make_llm(**kwargs)` builds an `LLM` on the session's default model (no reload; each LLM
allocates its own KV pool, so keep `num_blocks` small). `llm` is one shared `LLM` (block size 16,
`LLM_NUM_BLOCKS` blocks): tests that only generate should use it, so its compiled step shapes are
reused across test files.

Compilation: JAX's persistent compilation cache lives in `<repo>/.jax_cache` (git-ignored), so a
rerun loads the step executables instead of compiling them again; `JPAGED_JAX_CACHE=0` turns it
off, any other value names another directory. (`num_compilations` counts executables built per
runner either way: a cache hit still counts.)
"""

from __future__ import annotations

import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import LLM, weights
from jpaged.core.block_manager import BlockManager

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `bench` is a plain directory at the repository root
    sys.path.insert(0, str(REPO_ROOT))

from bench.traces import load_alpaca_prompts  # noqa: E402
from workers import enable_compilation_cache  # noqa: E402

LLM_NUM_BLOCKS = 256


enable_compilation_cache()


def scattered_blocks(seed: int):
    """A `kv_cache_manager` factory: paging whose free list is a random permutation of the pool, so a
    sequence's consecutive blocks are scattered (tests of the block-table indirection)."""
    def build(spec):
        order = np.random.default_rng(seed).permutation(np.arange(1, spec.num_blocks)).tolist()
        return BlockManager.create(spec.num_blocks, spec.block_size, num_cpu_blocks=spec.num_cpu_blocks,
                                   enable_prefix_caching=spec.enable_prefix_caching, free_block_ids=order,
                                   sliding_window=spec.sliding_window)
    return build


def chat_token_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of `prompt` as one user turn of the chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.fixture(scope="session")
def alpaca_prompts() -> list[str]:
    """The 120 instructions of `alpaca_seed_prompts.jsonl` (plain text, no chat template), in file order."""
    return load_alpaca_prompts()


@pytest.fixture(scope="session")
def default_model_path():
    """The default GGUF file; fails with the install command when it is missing."""
    return weights.default_model_path()


@pytest.fixture(scope="session")
def default_model(default_model_path) -> weights.LoadedModel:
    """`load_model(None)` in float32."""
    return weights.load_model(None, dtype=jnp.float32)


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """HF transformers' `LlamaForCausalLM` for the same GGUF file, float32, eval mode: the reference."""
    import torch
    import transformers

    # One thread: the 2 cores are shared, and torch's thread pool spin-waits under contention
    # (generate ran ~8x slower with 2 threads than with 1 while other processes were busy).
    torch.set_num_threads(1)
    return transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_llm(default_model):
    """`make_llm(**kwargs)` -> `LLM(loaded=default_model, num_blocks=LLM_NUM_BLOCKS, **kwargs)`."""

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_blocks", LLM_NUM_BLOCKS)
        return LLM(loaded=default_model, **kwargs)

    return make


@pytest.fixture(scope="session")
def llm(make_llm) -> LLM:
    """The shared LLM: default model, block size 16, `LLM_NUM_BLOCKS` blocks (the null block included)."""
    return make_llm(block_size=16)
