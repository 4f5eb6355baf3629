"""How the parameters, the KV pool and a step's inputs are laid out over devices (`jax.sharding`).

A `ShardingStrategy` is a set of *rules*, from logical axes to the axes of a `Mesh` whose axes are
`data` and `model`. Every array the runner places names its logical axes (`PARAM_AXES`, `POOL_AXES`,
...); a rule maps a logical axis to a mesh axis (split over it) or to None (replicated). Swapping
how the pool is laid out is a change of rules alone: the model and the scheduler do not change.

Logical axes:
  layers        the stacked layer axis of every layer parameter and of the pool
  blocks        the pool's block axis (block ids)
  kv_pair       the pool's K/V axis (a block's keys at 0, its values at 1: side by side in memory)
  block_slots   the token slots inside a block
  kv_heads      K/V heads (the pool, wk, wv)
  heads         query heads (wq, wo)
  head_dim      the dimension inside a head (never split: a head stays on one device)
  embed         the hidden (model) dimension
  mlp           the MLP's intermediate dimension (a mixture of experts: its shared expert's)
  experts       a mixture of experts' stacked expert axis (expert parallelism: each device holds its
                share of every sparse layer's experts; `jpaged.device.moe`)
  expert_mlp    each expert's intermediate dimension (tensor parallelism inside the experts)
  vocab         the vocabulary (embedding rows, LM head columns)
  tokens        the packed tokens and rows of a step's inputs

Named strategies (rule sets):
  `replicated()`       everything on every device (one device, or copies);
  `tensor_parallel()`  Megatron-style: q/k/v split by heads, o by heads on its input axis, MLP gate/up
                       by columns and down by rows, norms, embedding and LM head replicated; the pool
                       split by KV heads, so one block table serves every device (the paper's 4.6).
                       Two all-reduces per layer (after o and after down). A mixture of experts splits
                       each expert's intermediate axis likewise; `tensor_parallel(experts=True)` splits
                       the experts instead (expert parallelism over the tensor-parallel devices, vLLM's
                       `--enable-expert-parallel`), whole experts on each device.
  `expert_parallel()`  the experts split over the mesh axis `model`, everything else replicated (attention
                       runs whole on each device); the sparse layers' partial sums are combined by one
                       all-reduce (psum) per layer.
  `data_parallel()`    the pool split by blocks over the mesh axis `data` (each device owns a slice of
                       the blocks and runs the requests placed there: `jpaged.core.partitioned`), the
                       step's tokens split likewise, weights replicated; the whole step runs per
                       device under `shard_map`, with no collective but the logits' final gather.
  `data_and_tensor_parallel()`  both, on a 2-D mesh (data x model): the step's `shard_map` makes the
                       data axis manual, the attention backend's nested one the model axis.

Invariants (checked by `check`):
  - `head_dim`, `kv_pair` and `block_slots` are never split: a head and a block are never cut;
  - `heads` and `kv_heads` map to the same mesh axis (a device holds the KV heads its query heads read);
  - the heads divide by that axis' size; KV heads that do not (fewer KV heads than devices) are
    replicated at load by `kv_head_replication` (never split inside a head), and the strategy reports
    the factor;
  - `blocks` and `tokens` map to the same mesh axis (a device runs the tokens of the requests whose
    blocks it owns), and no weight axis maps to it (each data rank holds the whole model, or its
    tensor-parallel share of it on the other axis: `data_and_tensor_parallel()` on a 2-D mesh).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jpaged.device.moe import ExpertSharding

MESH_AXES = ("data", "model")
LOGICAL_AXES = ("layers", "blocks", "kv_pair", "block_slots", "kv_heads", "head_dim", "embed", "heads", "mlp",
                "experts", "expert_mlp", "vocab", "tokens")

# logical axes of each array, by the name of its field
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"),
    "mlp_norm": ("layers", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "bq": ("layers", "heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "post_attn_norm": ("layers", "embed"),
    "post_mlp_norm": ("layers", "embed"),
    "router": ("layers", "embed", None),  # every device routes every token: never split
    "experts_gate": ("layers", "experts", "embed", "expert_mlp"),
    "experts_up": ("layers", "experts", "embed", "expert_mlp"),
    "experts_down": ("layers", "experts", "expert_mlp", "embed"),
    "shared_w_gate": ("layers", "embed", "mlp"),
    "shared_w_up": ("layers", "embed", "mlp"),
    "shared_w_down": ("layers", "mlp", "embed"),
    "shared_expert_gate": ("layers", "embed"),
}
# a q/k norm over the whole projection (OLMoE: `ModelConfig.qk_norm_whole`) is split with its heads
WHOLE_QK_NORM_AXES = {"q_norm": ("layers", "heads", "head_dim"), "k_norm": ("layers", "kv_heads", "head_dim")}
POOL_AXES = ("layers", "blocks", "kv_pair", "block_slots", "kv_heads", "head_dim")
Q_AXES = ("tokens", "heads", "head_dim")  # a step's queries (and attention output) inside a layer
KV_AXES = ("tokens", "kv_heads", "head_dim")  # a step's new K/V inside a layer


@dataclasses.dataclass(frozen=True)
class ShardingStrategy:
    """Rules from logical axes to mesh axes (a tuple of (logical axis, mesh axis or None) pairs).

    Axes without a rule are replicated. Frozen and hashable: it is static configuration. Build the
    named ones with `replicated()` / `tensor_parallel()`, or your own: `ShardingStrategy(name="mine",
    rules=(("heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model")))`.
    """

    name: str = "custom"
    rules: tuple[tuple[str, Optional[str]], ...] = ()

    def __post_init__(self):
        rules = dict(self.rules)
        if len(rules) != len(self.rules):
            raise ValueError(f"sharding rules name a logical axis twice: {self.rules}")
        for logical, mesh_axis in self.rules:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"sharding rule for unknown logical axis {logical!r}: the axes are "
                                 f"{', '.join(LOGICAL_AXES)}")
            if mesh_axis is not None and not isinstance(mesh_axis, str):
                raise ValueError(f"sharding rule {logical!r} -> {mesh_axis!r}: a mesh axis name or None")
        for logical in ("head_dim", "kv_pair", "block_slots"):
            if rules.get(logical) is not None:
                raise ValueError(f"sharding rules split {logical!r}: a head and a block are never cut")
        if rules.get("heads") != rules.get("kv_heads"):
            raise ValueError("sharding rules must map 'heads' and 'kv_heads' to the same mesh axis "
                             f"(got {rules.get('heads')!r} and {rules.get('kv_heads')!r})")

    @property
    def rule_map(self) -> Mapping[str, Optional[str]]:
        return dict(self.rules)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes the rules name (a mesh must have them all)."""
        return tuple(sorted({a for _, a in self.rules if a is not None}))

    def spec(self, logical_axes) -> P:
        """The `PartitionSpec` of an array with these logical axes."""
        rules = self.rule_map
        return P(*(rules.get(a) for a in logical_axes))

    def axis_size(self, logical: str, mesh: Mesh) -> int:
        """How many ways `logical` is split on `mesh` (1: replicated)."""
        axis = self.rule_map.get(logical)
        return 1 if axis is None else mesh.shape[axis]

    # ---- checks -----------------------------------------------------------------------------

    def check(self, mesh: Mesh, config) -> None:
        """Raises ValueError (one line) unless this strategy can lay out a model of `config`
        (`jpaged.device.config.ModelConfig`) on `mesh`. Reads no weight: call it before loading."""
        missing = [a for a in self.mesh_axes if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"the mesh (axes {', '.join(map(repr, mesh.axis_names))}) lacks the axis "
                             f"{', '.join(map(repr, missing))} that sharding strategy {self.name!r} names")
        rules = self.rule_map
        dp = self.axis_size("blocks", mesh)
        if dp > 1 or self.axis_size("tokens", mesh) > 1:
            if rules.get("blocks") != rules.get("tokens"):
                raise ValueError("sharding rules must map 'blocks' and 'tokens' to the same mesh axis (data parallel: "
                                 "a device runs the tokens of the requests whose blocks it holds)")
            split = [a for a in ("heads", "kv_heads", "mlp", "experts", "expert_mlp", "vocab", "embed", "layers")
                     if rules.get(a) == rules["blocks"]]
            if split:
                raise ValueError(f"sharding rules map {', '.join(map(repr, split))} to the data axis "
                                 f"{rules['blocks']!r} too: under data parallelism the weights are not split by rank")
        tp = self.axis_size("heads", mesh)
        if config.num_heads % tp:
            raise ValueError(f"the model's {config.num_heads} query heads do not divide over "
                             f"{tp} devices (tensor parallel size): use a size that divides {config.num_heads}")
        if config.num_kv_heads % tp and tp % config.num_kv_heads:
            raise ValueError(f"the model's {config.num_kv_heads} KV heads and tensor parallel size {tp} do not "
                             "divide one another: a KV head is never split, so one must divide the other")
        ep = self.axis_size("experts", mesh)
        if ep > 1 and not config.is_moe:
            raise ValueError(f"expert parallel size {ep}: the model ({config.architecture}) has no experts")
        if config.is_moe and config.num_experts % ep:
            raise ValueError(f"expert parallel size {ep} does not divide the model's {config.num_experts} experts: "
                             f"use a size that divides {config.num_experts}")
        if rules.get("experts") is not None and rules.get("experts") == rules.get("expert_mlp"):
            raise ValueError("sharding rules map 'experts' and 'expert_mlp' to the same mesh axis")
        mlp = config.shared_expert_intermediate_size if config.is_moe else config.intermediate_size
        for logical, size in (("mlp", mlp), ("vocab", config.vocab_size),
                              ("embed", config.hidden_size), ("layers", config.num_layers),
                              ("expert_mlp", config.moe_intermediate_size if config.is_moe else 0)):
            n = self.axis_size(logical, mesh)
            if size and size % n:  # (0: the model has no such axis)
                raise ValueError(f"the model's {logical} size {size} does not divide over {n} devices "
                                 f"(axis {self.rule_map[logical]!r})")

    def kv_head_replication(self, mesh: Mesh, config) -> int:
        """How many copies of each KV head the pool holds: tensor parallel size / KV heads when there
        are fewer KV heads than devices on the heads' axis, else 1 (the duplication factor)."""
        tp = self.axis_size("kv_heads", mesh)
        return tp // config.num_kv_heads if tp > config.num_kv_heads else 1

    # ---- shardings --------------------------------------------------------------------------

    def named(self, mesh: Mesh, logical_axes) -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical_axes))

    def param_shardings(self, mesh: Mesh, params):
        """A pytree of `NamedSharding`s matching `params` (a `LlamaParams`; None leaves stay None)."""
        def sharding(path, leaf):
            name = getattr(path[-1], "name", None)
            if name in WHOLE_QK_NORM_AXES and leaf.ndim == 3:
                return self.named(mesh, WHOLE_QK_NORM_AXES[name])
            return self.named(mesh, PARAM_AXES[name])

        return jax.tree_util.tree_map_with_path(sharding, params)

    def expert_sharding(self, mesh: Mesh) -> Optional[ExpertSharding]:
        """How a step on `mesh` runs the sparse layers (`jpaged.device.moe.ExpertSharding`): the mesh axes of
        `experts` and `expert_mlp` where either is split, else None."""
        axes = [self.rule_map.get(a) if self.axis_size(a, mesh) > 1 else None for a in ("experts", "expert_mlp")]
        return ExpertSharding(mesh, *axes) if any(axes) else None

    def pool_sharding(self, mesh: Mesh) -> NamedSharding:
        """The KV pool's sharding, f[layers, blocks, 2 (K, V), block_size, kv_heads, head_dim]."""
        return self.named(mesh, POOL_AXES)

    def replicated(self, mesh: Mesh) -> NamedSharding:
        """Step inputs (block tables, slots, the attention plan) and outputs (logits, tokens)."""
        return NamedSharding(mesh, P())


def replicated() -> ShardingStrategy:
    """Every array whole on every device."""
    return ShardingStrategy(name="replicated", rules=())


def tensor_parallel(*, vocab: bool = False, experts: bool = False) -> ShardingStrategy:
    """Megatron-style tensor parallelism over the mesh axis `model`, the pool split by KV heads.
    `vocab=True` also splits the embedding and the LM head by vocabulary. A mixture of experts splits each
    expert's intermediate axis, or with `experts=True` the experts themselves (expert parallelism)."""
    rules = (("heads", "model"), ("kv_heads", "model"), ("mlp", "model"),
             ("experts", "model") if experts else ("expert_mlp", "model"))
    if vocab:
        rules += (("vocab", "model"),)
    name = "tensor_parallel" + ("_vocab" if vocab else "") + ("_experts" if experts else "")
    return ShardingStrategy(name=name, rules=rules)


def expert_parallel() -> ShardingStrategy:
    """The experts split over the mesh axis `model`; attention and every other weight replicated."""
    return ShardingStrategy(name="expert_parallel", rules=(("experts", "model"),))


def data_parallel() -> ShardingStrategy:
    """The pool split by blocks and the step's tokens by rank over the mesh axis `data`; weights replicated."""
    return ShardingStrategy(name="data_parallel", rules=(("blocks", "data"), ("tokens", "data")))


def data_and_tensor_parallel(*, experts: bool = False) -> ShardingStrategy:
    """Both on a 2-D mesh: the pool split by blocks over `data` and by KV heads over `model`; the
    weights split Megatron-style over `model`, whole on each data rank (`experts=True`: the experts split
    over `model`, as `tensor_parallel(experts=True)`)."""
    return ShardingStrategy(name="data_and_tensor_parallel" + ("_experts" if experts else ""),
                            rules=tensor_parallel(experts=experts).rules + data_parallel().rules)


def data_and_expert_parallel() -> ShardingStrategy:
    """A 2-D mesh: the pool split by blocks over `data`, the experts over `model` (attention whole on each
    device of a data rank)."""
    return ShardingStrategy(name="data_and_expert_parallel", rules=expert_parallel().rules + data_parallel().rules)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A `Mesh` of shape (data, model) over the first data x tensor devices. Raises ValueError (one
    line) when more devices are asked for than exist."""
    devices = list(jax.devices() if devices is None else devices)
    n = tensor_parallel_size * data_parallel_size
    if n > len(devices):
        raise ValueError(f"{n} devices asked for (tensor parallel size {tensor_parallel_size} x data parallel "
                         f"size {data_parallel_size}), but JAX sees "
                         f"{len(devices)} ({devices[0].platform}); on a CPU, set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts")
    return Mesh(np.asarray(devices[:n]).reshape(data_parallel_size, tensor_parallel_size), MESH_AXES)


def replicate_kv_heads(params, factor: int):
    """`params` with every KV head of wk / wv (and bk / bv) repeated `factor` times, consecutively (KV head j of the
    result is KV head j // factor of the model), so that grouped-query attention with
    `num_kv_heads * factor` KV heads reads the same values: query head h reads KV head
    h // (num_heads / (num_kv_heads * factor)), which is a copy of h // (num_heads / num_kv_heads)."""
    if factor == 1:
        return params
    layers, repeat = params.layers, lambda x, axis: None if x is None else jnp.repeat(x, factor, axis=axis)  # noqa: E731
    whole_k_norm = layers.k_norm is not None and layers.k_norm.ndim == 3  # [L, kv_heads, head_dim] (OLMoE)
    layers = layers.replace(wk=repeat(layers.wk, 2), wv=repeat(layers.wv, 2), bk=repeat(layers.bk, 1),
                            bv=repeat(layers.bv, 1), k_norm=repeat(layers.k_norm, 1) if whole_k_norm else layers.k_norm)
    return params.replace(layers=layers)


@dataclasses.dataclass(frozen=True)
class ShardedBackend:
    """An attention backend (`jpaged.device.attention`) whose operations run per device under
    `jax.shard_map` on the local KV heads (and their query heads): a `pallas_call` cannot be split
    by jit alone. Every device runs the inner backend on its own heads' slice of the pool with the
    same (replicated) block tables, slots and attention plan; nothing is communicated."""

    inner: object
    mesh: Mesh
    strategy: ShardingStrategy

    @property
    def name(self) -> str:
        return self.inner.name

    def storage_dtype(self, dtype):
        return self.inner.storage_dtype(dtype)

    def _map(self, f, in_specs, out_specs):
        # inside the data-parallel step's shard_map (data axis manual), the heads' axis alone goes manual here
        context = jax.sharding.get_abstract_mesh()
        nested = not context.empty and bool(context.manual_axes)
        axes = {a for a in (self.strategy.rule_map.get("kv_heads"),) if a is not None}
        if nested:  # the data axis is already local here: the specs name the heads' axis alone
            only = lambda spec: P(*(x if x in axes else None for x in spec))  # noqa: E731
            in_specs, out_specs = (jax.tree.map(only, specs, is_leaf=lambda x: isinstance(x, P))
                                   for specs in (in_specs, out_specs))
        return jax.shard_map(f, mesh=context if nested else self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=axes if nested else frozenset(), check_vma=False)

    def write_kv(self, pool, layer, k, v, slot_mapping):
        spec, kv = self.strategy.spec(POOL_AXES), self.strategy.spec(KV_AXES)
        return self._map(self.inner.write_kv, (spec, P(), kv, kv, P()), spec)(pool, layer, k, v, slot_mapping)

    def attend(self, q, pool, layer, inputs, scale, *, window=None, softcap=None):
        spec, qs = self.strategy.spec(POOL_AXES), self.strategy.spec(Q_AXES)
        inputs_spec = jax.tree.map(lambda _: P(), inputs)

        def f(q, pool, layer, inputs, window):
            return self.inner.attend(q, pool, layer, inputs, scale, window=window, softcap=softcap)

        return self._map(f, (qs, spec, P(), inputs_spec, P()), qs)(q, pool, layer, inputs, window)

    def write_and_attend(self, q, k, v, pool, layer, inputs, scale, *, window=None, softcap=None):
        spec, qs, kv = self.strategy.spec(POOL_AXES), self.strategy.spec(Q_AXES), self.strategy.spec(KV_AXES)
        inputs_spec = jax.tree.map(lambda _: P(), inputs)

        def f(q, k, v, pool, layer, inputs, window):
            return self.inner.write_and_attend(q, k, v, pool, layer, inputs, scale, window=window, softcap=softcap)

        return self._map(f, (qs, kv, kv, spec, P(), inputs_spec, P()), (spec, qs))(q, k, v, pool, layer, inputs, window)

    def copy_blocks(self, pool, pairs):
        spec = self.strategy.spec(POOL_AXES)
        return self._map(self.inner.copy_blocks, (spec, P()), spec)(pool, pairs)
