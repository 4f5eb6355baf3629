"""Paused engines: an `LLMEngine` in the middle of a run, written to a directory and read back
(`LLMEngine.save` / `LLMEngine.restore`), in this process or another, on this machine or another.

What is saved: the KV pools (device blocks and CPU swap blocks, in their storage dtype) and the
engine's host state (`LLMEngine.host_state`: the scheduler with its KV cache manager snapshot,
queues, sequence groups and beam state; requests queued or aborted since the last step; the seed
generator; statistics). Sampling is a function of each request's seed and position, so a restored
engine draws exactly the tokens the uninterrupted run draws. Compiled executables are not saved
(the restored engine compiles, or reads JAX's compilation cache); observers are not saved.

Layout of PATH (orbax `CheckpointManager`: every save is a numbered step directory, written under
a temporary name and renamed once complete, so an interrupted save leaves the previous one
readable; the two newest are kept):
  PATH/jpaged-engine.json   marks the directory as paused engines (format, version)
  PATH/<n>/manifest/        JSON: format and version, the model's identity (its config and a
                            fingerprint of its parameters), the pools' geometry, the engine's settings
  PATH/<n>/state/           the pools, and the host state as one pickle (a uint8 array)
Restoring checks the manifest before anything else is read: another model, block size, pool size
or dtype is refused with a message. Trust: the host state is a pickle, so restore only directories
you (or someone you trust) wrote, as with any pickle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import pickle

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.device.params import tied_head_view
from jpaged.device.quant import QuantizedWeight

FORMAT, VERSION = "jpaged-engine", 3  # 2: one KV pool, each block's K and V side by side; 3: the block manager counts its filled slots
MARKER = "jpaged-engine.json"
KEEP = 2  # saves kept in a directory, newest first
# what `restore` may change: where the model lives and how attention runs; nothing of the state's shape
RESTORE_OVERRIDES = ("model", "attention_backend", "interpret")


def saved_config(config) -> dict:
    """A `ModelConfig` as the manifest holds it (JSON: tuples become lists), to compare with one read back."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def model_identity(model) -> dict:
    """A `LoadedModel`'s config and a fingerprint of its parameters: sha256 over ~4,096 evenly
    spaced values of every array in params.py's layout, rounded to bfloat16 (so a model kept in
    float32 on a CPU and in bfloat16 on a GPU is the same model, and so is one whose dense weights
    are float rows, `jpaged.device.quant.float_rows`: sampled where each logical value lies)."""
    digest = hashlib.sha256()
    params = model.params
    if tied_head_view(params) and params.embed.is_float:  # a view of the embedding's rows: None in params.py's
        params = params.replace(lm_head=None)  # layout (an int8 head's view is hashed, as it always was)
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        if isinstance(leaf, QuantizedWeight) and leaf.is_float:
            samples = [_logical_sample(leaf)]
        else:  # arrays, and int8 weights' values and scales as they are stored
            samples = [_sample(jnp.ravel(array)) for array in jax.tree.leaves(leaf)]
        for sample in samples:
            digest.update(np.asarray(sample).astype(jnp.bfloat16).astype(np.float32).tobytes())
    return {"config": saved_config(model.config), "fingerprint": digest.hexdigest()[:32],
            "source": str(model.path)}


def _sample(flat):
    """~4,096 evenly spaced values of a flat array (every one of a small one)."""
    return flat[::max(1, flat.size // 4096)]


def _logical_sample(w: QuantizedWeight) -> np.ndarray:
    """`_sample` of float rows' values in their logical layout ([*stack, *logical_shape]), gathered where
    they lie in the [*stack, out, in] rows (a view of them: nothing of the weight is copied)."""
    rows = np.asarray(w.values)
    rows = rows.view(jnp.bfloat16) if rows.dtype == np.uint16 else rows  # 16-bit rows: bfloat16 bits
    stack, shape = rows.shape[:-2], w.logical_shape
    order = [a for a in range(len(shape)) if a not in w.in_axes] + list(w.in_axes)
    split = rows.reshape(*stack, *(shape[a] for a in order))
    logical = split.transpose(*range(len(stack)), *(len(stack) + i for i in np.argsort(order)))
    index = _sample(np.arange(logical.size))
    return logical[np.unravel_index(index, logical.shape)].astype(np.float32)


def _manifest(engine) -> dict:
    runner, spec = engine.runner, engine.kv_cache_spec
    settings = {k: (str(v) if k == "model" and v is not None else v)
                for k, v in dataclasses.asdict(engine.config).items()}
    return {"format": FORMAT, "version": VERSION, "model": model_identity(engine.model),
            "kv": {"num_blocks": spec.num_blocks, "block_size": spec.block_size,
                   "num_cpu_blocks": spec.num_cpu_blocks, "dtype": engine.config.dtype,
                   "storage_dtype": str(runner.cache.kv.dtype)},
            "engine_config": settings, "num_steps": engine.num_steps}


def _manager(path: pathlib.Path, read_only: bool):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=not read_only, read_only=read_only,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(path, options=options)


def _one_process(done: str) -> None:
    if jax.process_count() > 1:
        raise ValueError(f"an engine spread over {jax.process_count()} processes (jax.distributed) cannot be {done}: "
                         "pausing runs in one process")


def save(engine, path) -> pathlib.Path:
    """Writes `engine` as the newest save in the directory `path` (made if missing; an existing
    directory must hold paused engines already). Returns the step directory written."""
    import orbax.checkpoint as ocp

    _one_process("saved")
    path = pathlib.Path(path).absolute()
    marker = path / MARKER
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not marker.is_file())):
        raise ValueError(f"{path}: exists and holds no paused engine ({MARKER}): give a new or empty directory")
    path.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"format": FORMAT, "version": VERSION}))
    manifest = _manifest(engine)
    host = np.frombuffer(pickle.dumps(engine.host_state(), protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    # orbax writes no empty array (an engine without swap space has no CPU blocks): those are left out
    state = {name: a for name, a in {**engine.runner.pool_state(), "host": host}.items() if np.size(a)}
    manifest["host_bytes"], manifest["arrays"] = int(host.size), sorted(state)
    with _manager(path, read_only=False) as manager:
        step = 0 if manager.latest_step() is None else manager.latest_step() + 1
        manager.save(step, args=ocp.args.Composite(manifest=ocp.args.JsonSave(manifest),
                                                   state=ocp.args.StandardSave(state)))
        manager.wait_until_finished()
    return path / str(step)


def read_manifest(path) -> tuple[int, dict]:
    """The newest complete save in `path`: (its step, its manifest). Raises ValueError naming what
    is missing or wrong."""
    import orbax.checkpoint as ocp

    path = pathlib.Path(path).absolute()
    marker = path / MARKER
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory (a directory written by LLMEngine.save)")
    try:
        head = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{marker}: not a paused jpaged engine ({' '.join(str(e).split())[:200]})") from e
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError(f"{marker}: not a paused jpaged engine (format {FORMAT!r} expected)")
    with _manager(path, read_only=True) as manager:
        step = manager.latest_step()
        if step is None:
            raise ValueError(f"{path}: holds no complete saved engine")
        try:
            manifest = manager.restore(step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))["manifest"]
        except Exception as e:  # noqa: BLE001 - orbax's own errors: missing or unreadable files
            raise ValueError(f"{path / str(step) / 'manifest'}: unreadable ({' '.join(str(e).split())[:300]})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path / str(step) / 'manifest'}: not a paused jpaged engine's manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{path / str(step) / 'manifest'}: saved by format version {manifest.get('version')!r}, "
                         f"this jpaged reads version {VERSION}")
    return step, manifest


def restore(cls, path, *, loaded=None, **overrides):
    """An engine of class `cls` built with the saved settings (and `overrides` among
    RESTORE_OVERRIDES) and the saved state. Raises ValueError, before any state is read, for a
    model or a pool geometry other than the saved ones; for a model of another configuration,
    before the engine is built (its weights read, its pool allocated)."""
    import orbax.checkpoint as ocp

    from jpaged.engine.config import EngineConfig
    from jpaged.weights import read_config

    _one_process("restored")
    path = pathlib.Path(path).absolute()
    step, manifest = read_manifest(path)
    where = path / str(step)
    other = sorted(set(overrides) - set(RESTORE_OVERRIDES))
    if other:
        raise ValueError(f"restore keeps the saved engine's settings: only {', '.join(RESTORE_OVERRIDES)} may be "
                         f"given, not {', '.join(other)}")
    kv = manifest["kv"]
    settings = {**manifest["engine_config"], "num_blocks": kv["num_blocks"], **overrides}
    saved = manifest["model"]
    # another architecture is refused from the model's config alone, before its weights are read (the
    # end-of-turn tokens are left out: the files' metadata may not name them all, see read_config)
    config = loaded.config if loaded is not None else read_config(settings["model"])
    if any(saved["config"].get(k) != v for k, v in saved_config(config).items() if k != "eos_token_ids"):
        source = loaded.path if loaded is not None else settings["model"] or "the default model"
        raise ValueError(f"{where}: saved with another model ({saved['source']}); {source} has another "
                         "configuration: give the saved model (model=... or loaded=...)")
    engine = cls(EngineConfig(**settings), loaded=loaded)
    have = model_identity(engine.model)
    if saved["config"] != have["config"] or saved["fingerprint"] != have["fingerprint"]:
        raise ValueError(f"{where}: saved with another model ({saved['source']}, fingerprint {saved['fingerprint']}); "
                         f"this one is {have['source']} (fingerprint {have['fingerprint']}): give the saved model "
                         "(model=... or loaded=...)")
    spec = engine.kv_cache_spec
    for name, value in (("num_blocks", spec.num_blocks), ("block_size", spec.block_size),
                        ("num_cpu_blocks", spec.num_cpu_blocks), ("dtype", engine.config.dtype)):
        if kv[name] != value:
            raise ValueError(f"{where}: saved with {name} {kv[name]}, this engine has {value}: restore with the "
                             "saved settings")
    pools = engine.runner.pool_state()
    shapes = {name: (np.shape(a), np.dtype(kv["storage_dtype"])) for name, a in pools.items()}
    shapes["host"] = ((manifest["host_bytes"],), np.uint8)
    target = {name: jax.ShapeDtypeStruct(*shapes[name]) for name in manifest["arrays"] if name in shapes}
    try:
        with _manager(path, read_only=True) as manager:
            state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        host = pickle.loads(np.asarray(state.pop("host")).tobytes())
    except Exception as e:  # noqa: BLE001 - orbax's errors (missing, truncated arrays) and unpickling's
        raise ValueError(f"{where / 'state'}: cannot read the saved state ({' '.join(str(e).split())[:300]})") from e
    engine.runner.load_pool_state({**pools, **state})  # an array left out was empty
    engine.load_host_state(host)
    return engine
