"""The decoder of every family, as pure functions over `LlamaParams`, reading and writing a paged `KVCache`.

`forward(params, cache, inputs, config=, backend=) -> (cache, hidden)` runs every layer in one
`lax.scan` over the stacked layer parameters. The KV pool rides in the scan *carry* (never as
scanned inputs/outputs, which would copy the whole pool every step) and is updated in place at
the traced layer index: with the cache donated, a step writes only its new tokens' K/V.

One decoder, the families as data (`jpaged.device.config.ModelConfig`): what differs between
layers of one model (Gemma's local and global layers: their sliding window and RoPE base) rides in
the scan as per-layer arrays, not as Python branches, so every layer stays one scanned body; what
differs between families (biases, q/k norms, norm offset, sandwich norms, activation, soft-caps,
embedding scale) is static configuration, and a family without it compiles none of it.

Math follows HF transformers' modeling files (`LlamaForCausalLM`, `Qwen2`/`Qwen3`, `Mistral`,
`Gemma2`/`Gemma3ForCausalLM`, `Phi3`): RMSNorm computed in float32, rotate-half RoPE (with the
scaling rules of `ModelConfig.rope_scaling`), grouped-query attention, a gated MLP, tied or untied
LM head.

Precision: activations are float32 between the matmuls (the residual stream, norms, RoPE, the
attention's q/k/v and softmax), whatever the parameters' dtype. Every matmul accumulates in float32
(`preferred_element_type`); with 16-bit parameters its activation operand is rounded to their dtype
first, so that the dot is 16 x 16 -> 32 bits (a float32 x bfloat16 dot widens the weights to float32
instead). With float32 parameters the computation is exactly what it was before 16-bit parameters.
Parameters may come in their CPU storage form (`jpaged.device.params.to_storage`: bfloat16 as uint16
bit patterns), bit-cast back where they are used.

`sequence_logits(params, sequences, config=)` runs the same forward over whole token sequences
(teacher forcing, through a scratch pool of their own): a differentiable function of the
parameters, for fine-tuning them (`notebooks/finetune_then_serve.ipynb`) and for checks.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.device.attention.xla import FULL_WINDOW, XLABackend
from jpaged.device.batch import ModelInputs, pack_rows
from jpaged.device.config import ModelConfig, rope_inv_freq
from jpaged.device.kv_cache import KVCache
from jpaged.device.moe import ExpertSharding, sparse_mlp
from jpaged.device.params import EXPERT_LEAVES, LlamaParams, from_storage
from jpaged.device.quant import QuantizedWeight, native_max_rows, quantized_matmul, quantized_matmuls, take_rows

_SCRATCH_BLOCK_SIZE = 16
_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
_LM_HEAD_CHUNK = 4096  # vocabulary columns per dot of a 16-bit LM head on a CPU (`_lm_head`)


def _matmul(spec: str, x, w):
    """`jnp.einsum(spec, x, w)` of float32 activations `x` and a parameter `w`, accumulated and returned
    in float32; a 16-bit `w` takes `x` rounded to its dtype (a 16 x 16 -> 32-bit dot); an int8 `w`
    (`QuantizedWeight`, whose layout says the same einsum) takes `x` as it is (`quantized_matmul`)."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w)
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _matmuls(spec: str, x, ws) -> list:
    """`[_matmul(spec, x, w) for w in ws]`; `QuantizedWeight`s go together (`quantized_matmuls`: one native
    call for all of them where the kernel takes them)."""
    if all(isinstance(w, QuantizedWeight) for w in ws):
        return quantized_matmuls(x, ws)
    return [_matmul(spec, x, w) for w in ws]


def _output_projection(attn, wo):
    """attn f32[t, heads, head_dim] @ wo [heads, head_dim, hidden] -> f32[t, hidden], a dense `wo` as
    [heads * head_dim, hidden] (a view): XLA's CPU dot contracting two axes of a parameter first copies
    it into another layout, in every step (the float32 decode step's largest cost after its products).
    An int8 or 16-bit-rows `wo` (`QuantizedWeight`) is stored [hidden, heads * head_dim] already."""
    if isinstance(wo, QuantizedWeight):
        return _matmul("tnd,ndh->th", attn, wo)
    return _matmul("tk,kh->th", attn.reshape(attn.shape[0], -1), wo.reshape(-1, wo.shape[-1]))


def rms_norm(x, weight, eps, offset: float = 0.0):
    """RMSNorm over the trailing axes that `weight` has (the last, or [heads, head_dim] for a norm over a
    whole q/k projection: OLMoE), in float32, scaled by (offset + weight) (Gemma: offset 1)."""
    x32 = x.astype(jnp.float32)
    axes = tuple(range(-weight.ndim, 0))
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def _row_lengths(inputs: ModelInputs):
    """i32[N]: the context length (after this step) of each packed token's row (padding: 0)."""
    real = inputs.context_lens > 0
    row_end = jnp.where(real, inputs.logits_index, jnp.iinfo(jnp.int32).max)  # real rows first, ascending
    row = jnp.searchsorted(row_end, jnp.arange(inputs.token_ids.shape[0]), side="left")
    return jnp.where(row < row_end.shape[0], inputs.context_lens[jnp.minimum(row, row_end.shape[0] - 1)], 0)


def rope_tables(config: ModelConfig, inputs: ModelInputs):
    """cos, sin f32[R, N, head_dim] for the step's packed tokens under each of the model's R distinct
    RoPEs (R = 1, or 2 where the sliding layers have their own base), and i32[L]: each layer's RoPE."""
    ropes = sorted({config.layer_rope(layer) for layer in range(config.num_layers)}, key=repr)
    layer_rope = np.asarray([ropes.index(config.layer_rope(layer)) for layer in range(config.num_layers)], np.int32)
    positions = inputs.positions.astype(jnp.float32)
    tables = []
    for theta, scaling in ropes:
        inv_freq, attention_factor = rope_inv_freq(config.head_dim, theta, scaling,
                                                   max_position_embeddings=config.max_position_embeddings)
        if scaling is not None and scaling.rope_type == "dynamic":
            # dynamic NTK (HF's rule): the base grows with the row's length past max_position_embeddings
            dim, max_len = config.head_dim, config.max_position_embeddings
            seq_len = jnp.maximum(_row_lengths(inputs), max_len).astype(jnp.float32)
            base = theta * ((scaling.factor * seq_len / max_len) - (scaling.factor - 1)) ** (dim / (dim - 2))
            exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
            freqs = positions[:, None] / (base[:, None] ** exponents)
        else:
            freqs = positions[:, None] * jnp.asarray(inv_freq)  # [N, D/2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        tables.append((jnp.cos(emb) * attention_factor, jnp.sin(emb) * attention_factor))
    cos, sin = (jnp.stack(t) for t in zip(*tables))
    return cos, sin, layer_rope


def apply_rope(x, cos, sin):
    """Rotate-half RoPE. x f[N, heads, D]; cos, sin f32[N, D]."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def forward(params: LlamaParams, cache: KVCache, inputs: ModelInputs, *, config: ModelConfig, backend,
            num_layers: Optional[int] = None, experts: Optional[ExpertSharding] = None, return_routing: bool = False):
    """Runs the decoder on the packed tokens of `inputs`, writing their K/V into `cache`.

    Returns (cache, hidden f[N, hidden]), one hidden state per packed token, after the final norm.
    `num_layers` (static): only the first layers (self-drafting's early exit; their K/V alone written).
    `experts` (static): how a sharded step splits the sparse layers' experts (`jpaged.device.moe`).
    `return_routing` (static, a mixture of experts): also the experts each token was routed to, i32[L, N, k]
    (a third result; `num_experts` for the step's padding tokens), to observe the routing (`sequence_routing`).
    """
    c = config
    norm = lambda x, w: rms_norm(x, w, c.rms_norm_eps, c.norm_offset)  # noqa: E731
    activation = _ACTIVATIONS[c.activation]
    x = from_storage(take_rows(params.embed, inputs.token_ids)).astype(jnp.float32)  # activations: float32
    if c.embedding_scale != 1.0:
        x = x * jnp.asarray(c.embedding_scale, x.dtype)
    cos, sin, layer_rope = rope_tables(c, inputs)
    windows = np.asarray([FULL_WINDOW if w is None else w for w in c.windows], np.int32)
    real = _row_lengths(inputs) > 0 if c.is_moe else None  # the step's real tokens: padding reads no expert

    def layer(carry, layer_inputs):
        x, pool = carry
        p, layer_id, rope_id, window = layer_inputs
        # this layer's parameters in their dtype; 16-bit rows stay bits (the native kernel reads them as
        # they are; a bit-cast of a parameter outside the scan's slicing is a copy on XLA's CPU backend)
        # (expert weights stay layer stacks, or bits: a sparse layer reads each chosen expert out of them alone)
        experts_only = {name: getattr(p, name) for name in EXPERT_LEAVES}
        p = jax.tree.map(from_storage, p.replace(**dict.fromkeys(EXPERT_LEAVES)),
                         is_leaf=lambda x: isinstance(x, QuantizedWeight)).replace(**experts_only)
        h = norm(x, p.attn_norm)
        q, k, v = _matmuls("th,hnd->tnd", h, (p.wq, p.wk, p.wv))
        if c.attention_bias:
            q, k, v = q + p.bq, k + p.bk, v + p.bv
        if c.qk_norm:
            q, k = norm(q, p.q_norm), norm(k, p.k_norm)
        if c.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -c.clip_qkv, c.clip_qkv) for a in (q, k, v))
        q, k = apply_rope(q, cos[rope_id], sin[rope_id]), apply_rope(k, cos[rope_id], sin[rope_id])
        pool, attn = backend.write_and_attend(q, k, v, pool, layer_id, inputs, c.attention_scale,
                                              window=window if c.has_windows else None,
                                              softcap=c.attn_logit_softcap)
        out = _output_projection(attn, p.wo)
        x = x + (norm(out, p.post_attn_norm) if c.sandwich_norms else out)
        h = norm(x, p.mlp_norm)
        routed = None
        if c.is_moe:
            out, routed = sparse_mlp(h, p, c, activation, experts, layer_id, token_mask=real)
        else:
            gate, up = _matmuls("th,hi->ti", h, (p.w_gate, p.w_up))
            out = _matmul("ti,ih->th", activation(gate) * up, p.w_down)
        x = x + (norm(out, p.post_mlp_norm) if c.sandwich_norms else out)
        return (x, pool), routed if return_routing else None

    layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
    if isinstance(params.layers, tuple):  # one LayerParams a layer (`unstack_layers`): the layers unrolled
        carry, routing = (x, cache.kv), []
        for i, p in enumerate(params.layers[:num_layers]):
            carry, routed = layer(carry, (p, i, int(layer_rope[i]), windows[i]))
            routing.append(routed)
        x, pool = carry
        routing = jnp.stack(routing) if return_routing else None
    elif num_layers is None or num_layers == c.num_layers:
        # the scan slices the float leaves; int8 and 16-bit rows stay stacks that the native kernels index
        stacks, sliced = _split_stacks(params.layers)

        def each_layer(carry, inputs):
            return layer(carry, (_layer_params(stacks, inputs[0], inputs[1]), *inputs[1:]))

        (x, pool), routing = jax.lax.scan(each_layer, (x, cache.kv), (sliced, layer_ids, layer_rope, windows))
    else:  # the first layers: each indexed from the stack in its iteration (a slice of the stack would be a copy)
        def first_layers(carry, inputs):
            layer_id = inputs[0]
            return layer(carry, (_layer_params(params.layers, None, layer_id), *inputs))

        (x, pool), routing = jax.lax.scan(first_layers, (x, cache.kv), (layer_ids[:num_layers], layer_rope[:num_layers],
                                                                   windows[:num_layers]))
    x = norm(x, from_storage(params.final_norm))
    if return_routing:
        if not c.is_moe:
            raise ValueError(f"return_routing: the model ({c.architecture}) has no experts")
        return KVCache(kv=pool), x, routing
    return KVCache(kv=pool), x


def _is_weight(leaf) -> bool:
    return isinstance(leaf, QuantizedWeight)


def _split_stacks(layers):
    """(stacks, rest) of stacked `LayerParams`: `stacks` holds the `QuantizedWeight` leaves and the experts'
    weights (None elsewhere), `rest` every other leaf (None where `stacks` has one), for a layer scan to slice."""
    stacks = jax.tree.map(lambda a: a if _is_weight(a) else None, layers, is_leaf=_is_weight)
    rest = jax.tree.map(lambda a: None if _is_weight(a) else a, layers, is_leaf=_is_weight)
    experts = {name: getattr(layers, name) for name in EXPERT_LEAVES}
    return stacks.replace(**experts), rest.replace(**dict.fromkeys(EXPERT_LEAVES))


def _layer_params(stacks, sliced, layer_id):
    """Layer `layer_id`'s parameters: each `QuantizedWeight` of `stacks` as `of_layer(layer_id)` (read in
    place by the native kernels), the experts' weights as the whole stacks (`jpaged.device.moe` reads the
    chosen experts of layer `layer_id` out of them), the other leaves from `sliced` (one layer's, as a scan
    hands them), or indexed from `stacks` when `sliced` is None."""
    experts = {name: getattr(stacks, name) for name in EXPERT_LEAVES}
    stacks = stacks.replace(**dict.fromkeys(EXPERT_LEAVES))
    if sliced is None:
        return jax.tree.map(lambda a: a.of_layer(layer_id) if _is_weight(a) else a[layer_id], stacks,
                            is_leaf=_is_weight).replace(**experts)
    return jax.tree.map(lambda a, b: a.of_layer(layer_id) if _is_weight(a) else b, stacks, sliced,
                        is_leaf=lambda a: a is None or _is_weight(a)).replace(**experts)


def compute_logits(params: LlamaParams, hidden, *, config: ModelConfig) -> jax.Array:
    """hidden f[..., hidden] -> float32 logits f[..., vocab] (soft-capped where the family caps them)."""
    if params.lm_head is None:
        logits = _matmul("...h,vh->...v", hidden, from_storage(params.embed))
    else:
        logits = _lm_head(hidden, params.lm_head)
    logits = logits.astype(jnp.float32)
    if config.final_logit_softcap is not None:
        logits = jnp.tanh(logits / config.final_logit_softcap) * config.final_logit_softcap
    return logits


def _lm_head(hidden, w):
    """hidden f[..., hidden] @ w [hidden, vocab] -> f32[..., vocab]; a `QuantizedWeight` head (int8 or float
    rows) of the rows the native kernel takes, `native_max_rows(w)`, is one `_matmul` (one row of the default
    model's 16-bit head: 1.5 ms; 64 rows on AMX tiles: 3-4 ms, XLA's dot 17 ms), and so is a float32 one. On
    a CPU, a 16-bit head (plain, or rows past the kernel's) and an int8 head past the kernel's rows are a
    scan over `_LM_HEAD_CHUNK` vocabulary columns at a time: XLA's CPU dot of one 16-bit row by the whole
    [576, 49152] head of the default model took 50-80 ms (float32: 4-6 ms), in chunks 6 ms; a 16-bit-rows
    head of 4-32 rows (XLA's dot in each chunk) 1.2-4x faster in chunks than in one call; an int8 head, whose
    XLA product dequantizes the weights it reads, writes and reads back 9 MB a chunk instead of the whole
    head's 113 MB of float32 (Q8_0, AMD EPYC Zen 4, 2 cores, kernel alone: 64 rows 52-60 -> 22-26 ms,
    128 rows 71 -> 42). A chunk's logits agree with one call's to float32 rounding (XLA's dot orders the sums
    its own way)."""
    vocab, size = w.shape[-1], _LM_HEAD_CHUNK
    num_chunks = vocab // size
    chunked_kind = isinstance(w, QuantizedWeight) and w.values.ndim == 2 and (w.is_16bit or not w.is_float)
    native = isinstance(w, QuantizedWeight) and math.prod(hidden.shape[:-1]) <= max(1, native_max_rows(w))
    if ((isinstance(w, QuantizedWeight) and (not chunked_kind or native))
            or (not isinstance(w, QuantizedWeight) and jnp.dtype(w.dtype).itemsize != 2)
            or num_chunks < 2 or jax.default_backend() != "cpu"):
        return _matmul("...h,hv->...v", hidden, from_storage(w))
    rows = hidden.reshape(-1, hidden.shape[-1])

    def columns(start, count):  # the head's vocabulary columns [start, start + count) (count static)
        if chunked_kind:  # the same kind of weight (its compute dtype too), fewer rows
            values, scales = (None if a is None else jax.lax.dynamic_slice_in_dim(a, start, count, 0)
                              for a in (w.values, w.scales))
            return w.replace(values=values, scales=scales, logical_shape=(w.logical_shape[0], count))
        return from_storage(jax.lax.dynamic_slice_in_dim(w, start, count, 1))

    def chunk(_, j):
        return None, _matmul("th,hv->tv", rows, columns(j * size, size))

    _, out = jax.lax.scan(chunk, None, jnp.arange(num_chunks))  # [chunks, rows, size]
    logits = jnp.moveaxis(out, 0, 1).reshape(rows.shape[0], num_chunks * size)
    if vocab > num_chunks * size:
        rest = columns(num_chunks * size, vocab - num_chunks * size)
        logits = jnp.concatenate([logits, _matmul("th,hv->tv", rows, rest)], 1)
    return logits.reshape(*hidden.shape[:-1], vocab)


class _Row(NamedTuple):  # the fields of `jpaged.device.batch.pack_rows`'s rows
    token_ids: Sequence[int]
    start_position: int
    slots: Sequence[int]
    block_table: Sequence[int]


def sequence_logits(params: LlamaParams, sequences: Sequence[Sequence[int]], *, config: ModelConfig,
                    backend=None) -> list[jax.Array]:
    """The logits f32[len(s), vocab] at every position of each token sequence in `sequences` (row t
    predicts token t + 1): the engine's prefill over a scratch KV pool holding these sequences alone,
    so a differentiable function of `params` (`jax.grad` of a loss built on it fine-tunes them).
    Token ids are static: each new set of lengths traces anew. `backend`: the XLA path by default."""
    inputs, cache, starts = _scratch_prefill(sequences, config, params)
    _, hidden = forward(params, cache, inputs, config=config, backend=backend or XLABackend())
    return [compute_logits(params, hidden[a:b], config=config) for a, b in zip(starts, starts[1:])]


def _scratch_prefill(sequences, config, params):
    """(inputs, a scratch KV pool, each sequence's start among the packed tokens and the end) of a prefill of
    `sequences` alone, each from position 0 in blocks of its own."""
    bs, rows, next_block = _SCRATCH_BLOCK_SIZE, [], 1  # block 0 is the null block
    for ids in sequences:
        n = len(ids)
        if n == 0:
            raise ValueError("sequence_logits: a sequence is empty")
        table = list(range(next_block, next_block - (-n // bs)))
        next_block += len(table)
        rows.append(_Row(list(ids), 0, [table[p // bs] * bs + p % bs for p in range(n)], table))
    inputs = pack_rows(rows, block_size=bs, q_tile=64, k_tile=128)
    cache = KVCache.create(config, next_block, bs, params.embed.dtype)
    return inputs, cache, [0, *itertools.accumulate(len(ids) for ids in sequences)]


def sequence_routing(params: LlamaParams, sequences: Sequence[Sequence[int]], *, config: ModelConfig,
                     backend=None) -> list[np.ndarray]:
    """The experts each token of each sequence is routed to, i32[num_layers, len(s), num_experts_per_tok] per
    sequence (a mixture of experts; the prefill `sequence_logits` runs): what `jpaged.entrypoints.viz`'s
    `draw_expert_load` counts."""
    inputs, cache, starts = _scratch_prefill(sequences, config, params)
    _, _, routing = forward(params, cache, inputs, config=config, backend=backend or XLABackend(), return_routing=True)
    routing = np.asarray(routing)
    return [routing[:, a:b] for a, b in zip(starts, starts[1:])]
