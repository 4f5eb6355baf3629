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
import re
import shutil
import sys

import jax
import jax.numpy as jnp

from jpaged.device.config import ModelConfig
from jpaged.device.params import abstract_params, cast_params
from jpaged.weights.loader import LoadedModel, load_tokenizer_dir

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

    directory = pathlib.Path(directory).absolute()
    if not is_checkpoint(directory):
        raise ValueError(f"{directory}: not a jpaged checkpoint (no {MANIFEST})")
    config = read_config(directory)
    undo = _quiet_orbax_leftovers()  # from before the restore: a failed read's leftovers start before it returns
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            saved = checkpointer.metadata(directory / "params")
            saved = getattr(saved, "item_metadata", saved)  # orbax versions differ here
            target = abstract_params(config, jax.tree.leaves(saved)[0].dtype)
            params = checkpointer.restore(directory / "params", target)
        undo()  # every read completed: nothing is left to quiet
    except Exception as e:  # noqa: BLE001 - orbax's own errors: missing, truncated or mismatched arrays
        raise ValueError(f"{directory / 'params'}: cannot restore the parameters ({_reason(e)}): the checkpoint is "
                         "damaged: convert the model again (jpaged convert)") from None
    return LoadedModel(config, cast_params(params, dtype), load_tokenizer_dir(directory / "tokenizer"), directory)


def _reason(error: BaseException) -> str:
    """One short clause for why orbax could not restore: the damaged array and TensorStore's reason
    when the chain of errors names them (a file cut short), else the first line of the innermost error."""
    chain, e = [], error
    while e is not None and len(chain) < 20:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:  # TensorStore: 'OUT_OF_RANGE: Error reading "layers.wq/0.0" in OCDBT database at ...: <why>'
        match = re.search(r'(?:([A-Z_]+): )?Error reading "([^"/]+)(?:/[^"]*)?"[^:]*(?::\s*(.*))?', str(e))
        if match:
            why = " ".join((match[3] or match[1] or "unreadable").split())
            return f"array {match[2]!r} is unreadable: {why[:160]}"
    text = " ".join(str(chain[-1]).split()) or type(chain[-1]).__name__
    return text[:200] + ("..." if len(text) > 200 else "")


def _quiet_orbax_leftovers():
    """After a failed restore, orbax has closed its event loop while TensorStore still completes the
    other reads; each completion then fails in the background ('Event loop is closed', or the
    read's own error), reported through `sys.unraisablehook`, or printed through `sys.excepthook`
    when the completion's callback runs on one of TensorStore's threads, before and after our one-line
    error. Drops those reports (and only those) until the returned function is called (after a restore
    that succeeded; after a failed one they go on arriving): they carry nothing the ValueError did not
    say."""
    previous_unraisable, previous_except = sys.unraisablehook, sys.excepthook

    def leftover(value) -> bool:
        return (isinstance(value, RuntimeError) and str(value) == "Event loop is closed") or (
            str(value).startswith("Encountered error while reading array index"))

    def unraisable_hook(unraisable) -> None:
        if not leftover(unraisable.exc_value):
            previous_unraisable(unraisable)

    def except_hook(kind, value, traceback) -> None:
        if not leftover(value):
            previous_except(kind, value, traceback)

    sys.unraisablehook, sys.excepthook = unraisable_hook, except_hook

    def undo() -> None:
        if sys.unraisablehook is unraisable_hook and sys.excepthook is except_hook:
            sys.unraisablehook, sys.excepthook = previous_unraisable, previous_except

    return undo
