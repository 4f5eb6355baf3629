"""Converted checkpoints: a `LoadedModel` saved with orbax, so later loads skip GGUF parsing
and dequantization.

Directory layout (the directory is created by `save` and must not exist yet; it is written under a
temporary name beside it and renamed once complete, so an interrupted save leaves no half
checkpoint, and nothing else is touched):
  jpaged.json   {"format": "jpaged-checkpoint", "version": 1, "config": ModelConfig fields, "source": path}
  params/       the `LlamaParams` pytree, orbax StandardCheckpointer, dtype as saved
  tokenizer/    `tokenizer.save_pretrained` (tokenizer.json, chat template, ...)
`load` rebuilds the pytree structure from the config alone (shapes are a function of it).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp

from jpaged.device.config import ModelConfig
from jpaged.device.params import abstract_params, cast_params
from jpaged.weights.loader import LoadedModel

FORMAT, VERSION = "jpaged-checkpoint", 1
MANIFEST = "jpaged.json"


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` is a directory with a manifest (`jpaged.json`): written by `save`, or meant
    to be (`read_config` and `load` then say what is wrong with it)."""
    return (pathlib.Path(path) / MANIFEST).is_file()


def read_config(directory: str | os.PathLike) -> ModelConfig:
    """The model's configuration from a checkpoint's manifest (no parameter is read)."""
    manifest = pathlib.Path(directory).absolute() / MANIFEST
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{manifest}: not a readable jpaged checkpoint manifest ({' '.join(str(e).split())})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{manifest}: not a jpaged checkpoint manifest (format {FORMAT!r} expected)")
    if data.get("version") != VERSION:
        raise ValueError(f"{manifest}: checkpoint version {data.get('version')!r}, expected {VERSION}: "
                         "convert the model again with this jpaged (jpaged convert)")
    try:
        return ModelConfig.from_dict(data["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{manifest}: a malformed model config ({e})") from e


def save(loaded: LoadedModel, directory: str | os.PathLike) -> pathlib.Path:
    """Writes `loaded` to `directory` (which must not exist) and returns its absolute path."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    if directory.exists():
        raise ValueError(f"{directory} already exists: give a new directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.with_name(f".{directory.name}.partial-{os.getpid()}")
    try:
        partial.mkdir()
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(partial / "params", loaded.params)
        loaded.tokenizer.save_pretrained(partial / "tokenizer")
        config = loaded.config.to_dict()
        manifest = {"format": FORMAT, "version": VERSION, "config": config, "source": str(loaded.path)}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
        partial.rename(directory)  # published whole, or not at all
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return directory


def load(directory: str | os.PathLike, dtype=jnp.float32) -> LoadedModel:
    """Reads a directory written by `save`; params are cast to `dtype`."""
    import orbax.checkpoint as ocp
    import transformers

    directory = pathlib.Path(directory).absolute()
    if not is_checkpoint(directory):
        raise ValueError(f"{directory}: not a jpaged checkpoint (no {MANIFEST})")
    config = read_config(directory)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            saved = checkpointer.metadata(directory / "params")
            saved = getattr(saved, "item_metadata", saved)  # orbax versions differ here
            target = abstract_params(config, jax.tree.leaves(saved)[0].dtype)
            params = checkpointer.restore(directory / "params", target)
    except Exception as e:  # noqa: BLE001 - orbax's own errors: missing, truncated or mismatched arrays
        raise ValueError(f"{directory / 'params'}: cannot restore the parameters ({' '.join(str(e).split())[:300]})") from e
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory / "tokenizer")
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory / 'tokenizer'}: no usable tokenizer files ({' '.join(str(e).split())})") from e
    return LoadedModel(config, cast_params(params, dtype), tokenizer, directory)
