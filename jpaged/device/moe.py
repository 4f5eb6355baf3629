"""The sparse MLP of a mixture of experts: route, sort by expert, one grouped matmul, combine.

A sparse layer (`ModelConfig.is_moe`) replaces the gated MLP by `num_experts` gated MLPs of
`moe_intermediate_size` each and a router: every token runs the `num_experts_per_tok` experts whose
router probabilities are highest, and their outputs are summed weighted by those probabilities.

  route       probabilities = softmax(h @ router) in float32; the top k (ties: the lower expert id
              first, as `torch.topk` and `lax.top_k` both choose); renormalized to sum to 1 where the
              family says (`norm_topk_prob`; Mixtral always). HF's `Qwen2Moe/Qwen3Moe/Mixtral/Olmoe`
              sparse blocks route so.
  compute     the pairs (token, expert) sorted by expert, then a grouped matmul, weighted, scattered
              back onto their tokens, two ways that give the same sum:
              - tiled (`tiled_experts`, on a CPU): the sorted pairs cut into tiles within one expert;
                a scan runs the tiles that hold pairs, each reading its own expert's weights alone.
                A decode step reads only the chosen experts' weights (llama.cpp's `mul_mat_id`): a
                row of k experts reads k / num_experts of the layer's expert weights. XLA's CPU
                `ragged_dot` computes every group over every row (64 experts, 8 rows: 136 ms
                against 4 ms gathered; AMD EPYC Zen 3, 2 cores).
              - grouped (`grouped_experts`, elsewhere): one `jax.lax.ragged_dot` per projection.
              Experts no pair chose form empty groups and cost nothing.
  shared      Qwen2-MoE's shared expert: a gated MLP every token runs, scaled by sigmoid(h . w_gate).
  reference   `dense_reference`: every expert on every token, masked by the routing (tests only).

Expert parallelism (`ExpertSharding`): the experts' stacked axis is split over a mesh axis (the
`experts` logical axis of `jpaged.device.sharding`); each device runs the pairs routed to its own
experts on all the step's tokens (the tokens are replicated on that axis, as tensor parallelism has
them after each all-reduce), and one `psum` over the axis combines the partial outputs: one
all-reduce of f32[tokens, hidden] per sparse layer, the same collective tensor parallelism uses
after the MLP. Under tensor parallelism without it, each expert's intermediate axis is split
instead (`expert_mlp`), and the same `psum` sums the partial products.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jpaged.device.params import from_storage
from jpaged.device.quant import QuantizedWeight, dequantize, quantized_matmul, quantized_matmuls


def route(h, router, *, top_k: int, renormalize: bool):
    """(weights f32[N, k], experts i32[N, k]) of tokens h f[N, hidden] under router f[hidden, E]: the k
    highest softmax probabilities (in float32) and their expert ids, renormalized to sum to 1 if asked."""
    logits = jnp.einsum("th,he->te", h.astype(router.dtype), router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _dot(spec: str, x, w):
    """`einsum(spec, x, w)` accumulated in float32, `x` rounded to the weight's dtype."""
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _slice(a, index):
    """a[index] of the leading axes `index` (traced), the trailing two axes whole (a dynamic slice: only
    that expert's weights are read)."""
    starts = (*index, *(0,) * (a.ndim - len(index)))
    sizes = (1,) * len(index) + a.shape[len(index):]
    return jax.lax.dynamic_slice(a, starts, sizes).reshape(a.shape[len(index):])


def _expert(w, layer, e):
    """Expert `e`'s weight of one projection, f[in, out]: `w` f[L, E, in, out] (a layer stack, read at
    `layer`) or f[E, in, out] (one layer's); bfloat16 bits become bfloat16."""
    return from_storage(_slice(w, (layer, e) if w.ndim == 4 else (e,)))


def _expert_rows(w: QuantizedWeight, layer, e) -> QuantizedWeight:
    """Expert `e` of `w`, int8 or float rows [(L,) E, out, in] (`jpaged.device.quant.quantize_params`,
    `float_row_params`), as one layer of a stack of [L * E] weights (`of_layer`): the native kernels read it
    in place, without copying it out of the stack."""
    num = w.values.shape[-3]
    values = w.values.reshape(-1, *w.values.shape[-2:])
    scales = None if w.scales is None else w.scales.reshape(-1, *w.scales.shape[-2:])
    index = e if w.values.ndim == 3 else layer * num + e
    return w.replace(values=values, scales=scales).of_layer(jnp.asarray(index, jnp.int32))


def _project(x, gate, up, down, activation, layer, e):
    """Expert `e` on the rows x f[T, hidden]: down(activation(x gate) * (x up)), f32[T, hidden]."""
    if isinstance(gate, QuantizedWeight):  # int8 or float rows: the native kernels on few rows, in place
        g, u = quantized_matmuls(x, [_expert_rows(gate, layer, e), _expert_rows(up, layer, e)])
        return quantized_matmul(activation(g) * u, _expert_rows(down, layer, e))
    hidden = activation(_dot("th,hi->ti", x, _expert(gate, layer, e))) * _dot("th,hi->ti", x, _expert(up, layer, e))
    return _dot("ti,ih->th", hidden, _expert(down, layer, e))


def _sorted_pairs(weights, experts, num_local, first_expert):
    """The step's (token, expert) pairs sorted by this device's expert (a stable sort: a token's pairs keep
    their order; pairs of experts elsewhere last): (order i32[A], group sizes i32[num_local], weights
    f32[A] of the sorted pairs, 0 for pairs routed elsewhere)."""
    local = experts.reshape(-1) - first_expert
    mine = (local >= 0) & (local < num_local)
    group = jnp.where(mine, local, num_local)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)
    return order, sizes, jnp.where(mine, weights.reshape(-1), 0.0)[order]


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """The rows of a tile of `tiled_experts` for a step of `num_pairs` (token, expert) pairs: about the
    pairs an expert gets (a power of two, 1 to 64), so a tile is rarely mostly padding."""
    per_expert = max(1, num_pairs // max(1, num_experts))
    return min(64, 1 << (per_expert.bit_length() - 1))


def tiled_experts(h, weights, experts, gate, up, down, activation, *, layer=None, first_expert=0):
    """sum_j weights[t, j] * expert_{experts[t, j]}(h[t]) for each token t, over the experts this device
    holds: `gate`, `up` f[(L,) E_local, hidden, I] and `down` f[(L,) E_local, I, hidden] (a layer stack read
    at `layer`, or one layer's; or int8 / float rows, `QuantizedWeight`s of rows [(L,) E_local, out, in]) are
    experts [first_expert, first_expert + E_local). Pairs routed elsewhere add nothing. Returns f32[N, hidden].

    The pairs are sorted by expert and cut into tiles of `tile_rows` rows, each within one expert (a
    group's last tile padded); a scan runs the tiles that hold pairs, each reading its expert's three
    weights alone, and adds its rows' weighted outputs onto their tokens. Experts no pair chose cost
    nothing: no tile reads them. (XLA's CPU `ragged_dot` computes every group over every row.)"""
    n, k = experts.shape
    num_pairs, num_local = n * k, (gate.values.shape[-3] if isinstance(gate, QuantizedWeight) else gate.shape[-3])
    order, sizes, pair_weights = _sorted_pairs(weights, experts, num_local, first_expert)
    rows = tile_rows(num_pairs, num_local)
    tiles = (sizes + rows - 1) // rows
    tile_end = jnp.cumsum(tiles)
    group_start = jnp.cumsum(sizes) - sizes
    max_tiles = -(-num_pairs // rows) + min(num_local, num_pairs)  # sum of ceil(size / rows) <= this

    def tile(y, j):
        e = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), num_local - 1)
        start = group_start[e] + (j - (tile_end[e] - tiles[e])) * rows
        index = start + jnp.arange(rows)
        valid = index < group_start[e] + sizes[e]
        index = jnp.minimum(index, num_pairs - 1)
        tokens = order[index] // k
        out = _project(h[tokens], gate, up, down, activation, layer, e)
        w = jnp.where(valid, pair_weights[index], 0.0)
        return y.at[tokens].add(jnp.where(valid[:, None], out * w[:, None], 0.0))

    def step(y, j):
        return jax.lax.cond(j < tile_end[-1], tile, lambda y, j: y, y, j), None

    y, _ = jax.lax.scan(step, jnp.zeros((n, h.shape[-1]), jnp.float32), jnp.arange(max_tiles))
    return y


def grouped_experts(h, weights, experts, gate, up, down, activation, *, layer=None, first_expert=0):
    """`tiled_experts`' sum as one `jax.lax.ragged_dot` per projection over the sorted pairs (a grouped
    matmul where the backend has one: GPUs, TPUs), then weighted and scattered back onto the tokens."""
    def whole(w):  # this layer's experts f[E, in, out]
        if isinstance(w, QuantizedWeight):
            if w.values.ndim == 4:
                w = w.replace(values=w.values[layer], scales=None if w.scales is None else w.scales[layer])
            return dequantize(w)
        return from_storage(w[layer] if w.ndim == 4 else w)

    gate, up, down = (whole(w) for w in (gate, up, down))
    n, k = experts.shape
    order, sizes, pair_weights = _sorted_pairs(weights, experts, gate.shape[0], first_expert)
    tokens = order // k
    x = h[tokens]

    def ragged(x, w):
        return jax.lax.ragged_dot(x.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32)

    out = ragged(activation(ragged(x, gate)) * ragged(x, up), down)
    out = jnp.where(pair_weights[:, None] != 0, out * pair_weights[:, None], 0.0)  # rows past the groups: undefined
    return jnp.zeros((n, h.shape[-1]), jnp.float32).at[tokens].add(out)


def dense_reference(h, weights, experts, gate, up, down, activation):
    """The same sum with every expert run on every token and masked by the routing (tests: the
    reference the other two paths are held to)."""
    num_experts = gate.shape[0]
    dense_w = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)
    hidden = activation(_dot("th,ehi->tei", h, gate)) * _dot("th,ehi->tei", h, up)
    out = _dot("tei,eih->teh", hidden, down)
    return jnp.einsum("teh,te->th", out, dense_w)


def _experts(h, weights, experts, gate, up, down, activation, layer, first_expert):
    """The routed experts' sum on this device: tiles on a CPU, `ragged_dot` elsewhere."""
    path = tiled_experts if jax.default_backend() == "cpu" else grouped_experts
    return path(h, weights, experts, gate, up, down, activation, layer=layer, first_expert=first_expert)


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """How a sharded step runs its sparse layers: the mesh, and the mesh axes (or None) that the `experts`
    and `expert_mlp` logical axes map to (`jpaged.device.sharding.ShardingStrategy.expert_sharding`).
    Static (hashable)."""

    mesh: jax.sharding.Mesh
    experts_axis: Optional[str]
    mlp_axis: Optional[str]

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for a in (self.experts_axis, self.mlp_axis) if a is not None)

    def run(self, h, weights, experts, gate, up, down, activation, layer):
        """The experts' sum under `shard_map` over the axes that split them, each device on its experts (and
        its share of their intermediate axis), then one psum over those axes."""
        lead = (None,) * (gate.ndim - 3)  # the layer axis of a stack
        in_spec = P(*lead, self.experts_axis, None, self.mlp_axis)
        out_spec = P(*lead, self.experts_axis, self.mlp_axis, None)
        experts_axis, axes = self.experts_axis, self.axes

        def local(h, weights, experts, gate, up, down, layer):
            first = jax.lax.axis_index(experts_axis) * gate.shape[-3] if experts_axis is not None else 0
            return jax.lax.psum(_experts(h, weights, experts, gate, up, down, activation, layer, first), axes)

        context = jax.sharding.get_abstract_mesh()
        nested = not context.empty and bool(context.manual_axes)  # inside the data-parallel step's shard_map
        layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
        return jax.shard_map(local, mesh=context if nested else self.mesh,
                             in_specs=(P(), P(), P(), in_spec, in_spec, out_spec, P()), out_specs=P(),
                             axis_names=frozenset(axes) if nested else frozenset(), check_vma=False)(
            h, weights, experts, gate, up, down, layer)


def sparse_mlp(h, p, config, activation, sharding: Optional[ExpertSharding] = None, layer=None, token_mask=None):
    """A sparse layer's MLP on tokens h f32[N, hidden] with layer parameters `p` (`LayerParams`; its expert
    leaves one layer's, or the whole layer stacks to be read at `layer`): the routed experts' weighted
    sum, plus the shared expert where the family has one. Returns (f32[N, hidden], the experts each token was
    routed to, i32[N, k]). `token_mask` bool[N]: the step's real tokens; a padding token is routed to no expert
    (its experts are `num_experts`, out of range: no pair, no tile, no weight read for it; its output is the
    shared expert's alone)."""
    weights, experts = route(h, p.router, top_k=config.num_experts_per_tok, renormalize=config.norm_topk_prob)
    if token_mask is not None:
        experts = jnp.where(token_mask[:, None], experts, config.num_experts)
    gate, up, down = p.experts_gate, p.experts_up, p.experts_down
    if sharding is None or not sharding.axes:
        out = _experts(h, weights, experts, gate, up, down, activation, layer, 0)
    else:
        out = sharding.run(h, weights, experts, gate, up, down, activation, layer)
    if p.shared_w_gate is not None:
        shared = activation(_dot("th,hi->ti", h, p.shared_w_gate)) * _dot("th,hi->ti", h, p.shared_w_up)
        shared = _dot("ti,ih->th", shared, p.shared_w_down)
        scale = jax.nn.sigmoid(_dot("th,h->t", h, p.shared_expert_gate))
        out = out + scale[:, None] * shared
    return out, experts
