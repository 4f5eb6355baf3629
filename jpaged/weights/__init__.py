"""Weights I/O: model files in, `LoadedModel` (config, parameter pytree, tokenizer) out.

`load_model(path)` reads a GGUF file (`loader.load_gguf`, dequantized), a HF checkpoint
directory (`loader.load_hf_dir`) or a jpaged orbax checkpoint (`checkpoint.load`, written by
`checkpoint.save` / `jpaged convert`); `path=None` is the embedded default model. Builds the
parameter layout of `jpaged.device.params`; imports nothing above the device side.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax.numpy as jnp

from jpaged.device.config import ModelConfig
from jpaged.weights import checkpoint, families
from jpaged.weights.loader import LoadedModel, default_model_path, gguf_config, hf_config, load_gguf, load_hf_dir

__all__ = ["LoadedModel", "default_model_path", "load_model", "read_config"]

_EXPECTED = ("expected a .gguf file or a directory with config.json and *.safetensors (model_type one of "
             f"{', '.join(families.SUPPORTED)})")


def _kind(path: pathlib.Path) -> str:
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "hf"
    if checkpoint.is_checkpoint(path):
        return "checkpoint"
    if path.is_dir():
        _explain_hf_dir(path)
    what = "no such file or directory" if not path.exists() else "unsupported"
    raise ValueError(f"{path}: {what}; {_EXPECTED} or a jpaged checkpoint")


def _explain_hf_dir(path: pathlib.Path) -> None:
    """A directory that is half a HF checkpoint: raises ValueError saying what is missing or broken."""
    config = path / "config.json"
    broken = ""
    if config.is_file():
        try:
            json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            broken = f"{config} is not readable JSON ({' '.join(str(e).split())}): restore the model's config.json"
    others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack",
                                                                     ".gguf"))
    if config.is_file():
        found = f" (found {', '.join(others[:3])}{', ...' if len(others) > 3 else ''})" if others else ""
        gguf = [name for name in others if name.endswith(".gguf")]
        hint = (f"; for the GGUF file pass --model {path / gguf[0]}" if gguf else
                "; jpaged reads safetensors, not PyTorch .bin files" if others else "")
        raise ValueError(f"{path}: a HF model directory without its *.safetensors weights{found}: download the "
                         f"model's *.safetensors files into it{hint}" + (f"; and {broken}" if broken else ""))
    if any(path.glob("*.safetensors")):
        raise ValueError(f"{path}: *.safetensors weights without config.json: put the model's config.json beside "
                         f"them ({_EXPECTED})")


def read_config(path: str | os.PathLike | None = None) -> ModelConfig:
    """The model's configuration read from its files' metadata alone (no weights, no tokenizer:
    `eos_token_ids` may lack the chat template's end-of-turn token), in well under a second: what
    the engine sizes its KV pool with before loading anything."""
    path = default_model_path() if path is None else pathlib.Path(path)
    kind = _kind(path)
    if kind == "gguf":
        return gguf_config(path)
    return hf_config(path) if kind == "hf" else checkpoint.read_config(path)


def load_model(path: str | os.PathLike | None = None, dtype=jnp.float32) -> LoadedModel:
    """Loads a `.gguf` file, a HF checkpoint directory of a supported family (`families.SUPPORTED`;
    config.json + *.safetensors, possibly sharded), a jpaged checkpoint or, with `path=None`, the
    default model. Raises ValueError naming `path` for anything else."""
    path = default_model_path() if path is None else pathlib.Path(path)
    kind = _kind(path)
    if kind == "gguf":
        return load_gguf(path, dtype)
    return load_hf_dir(path, dtype) if kind == "hf" else checkpoint.load(path, dtype)
