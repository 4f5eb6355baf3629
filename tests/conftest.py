"""Session-scoped fixtures shared by the test suite: each model is loaded once per session."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jpaged import loader


@pytest.fixture(scope="session")
def default_model_path():
    """The default GGUF file; fails with the install command when it is missing."""
    return loader.default_model_path()


@pytest.fixture(scope="session")
def default_model(default_model_path) -> loader.LoadedModel:
    """`load_model(None)` in float32."""
    return loader.load_model(None, dtype=jnp.float32)


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """HF transformers' `LlamaForCausalLM` for the same GGUF file, float32, eval mode: the reference."""
    import torch
    import transformers

    torch.set_num_threads(2)  # the machine has 2 cores
    return transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32).eval()
