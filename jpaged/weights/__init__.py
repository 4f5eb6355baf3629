"""Weights I/O: model files in, `LoadedModel` (config, parameter pytree, tokenizer) out.

`load_model(path)` reads a GGUF file (`loader.load_gguf`, dequantized), a HF Llama checkpoint
directory (`loader.load_hf_dir`) or a jpaged orbax checkpoint (`checkpoint.load`, written by
`checkpoint.save` / `jpaged convert`); `path=None` is the embedded default model. Builds the
parameter layout of `jpaged.device.params`; imports nothing above the device side.
"""

from __future__ import annotations

import os
import pathlib

import jax.numpy as jnp

from jpaged.weights import checkpoint
from jpaged.weights.loader import LoadedModel, default_model_path, load_gguf, load_hf_dir

__all__ = ["LoadedModel", "default_model_path", "load_model"]

_EXPECTED = "expected a .gguf file or a directory with config.json and *.safetensors (Llama family)"


def load_model(path: str | os.PathLike | None = None, dtype=jnp.float32) -> LoadedModel:
    """Loads a `.gguf` file, a HF Llama checkpoint directory (config.json + *.safetensors,
    possibly sharded), a jpaged checkpoint or, with `path=None`, the default model. Raises
    ValueError naming `path` for anything else."""
    path = default_model_path() if path is None else pathlib.Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype)
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return load_hf_dir(path, dtype)
    if checkpoint.is_checkpoint(path):
        return checkpoint.load(path, dtype)
    what = "no such file or directory" if not path.exists() else "unsupported"
    raise ValueError(f"{path}: {what}; {_EXPECTED} or a jpaged checkpoint")
