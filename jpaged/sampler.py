"""Token sampling on the device: greedy, temperature, top-k, top-p, seeded per (seed, sample, step).

Every row carries its own seed: the token at output step t of sample i of a request is drawn with
the key `fold_in(key(seed + i), t)`, so it never depends on what else shares the batch or on how
often the request was preempted, and sample i of a request with seed s draws exactly the tokens of
a single-sample request with seed s + i. Log-probabilities are those of the model's raw
distribution (log_softmax of the logits, before temperature and filtering), as vLLM reports them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingInputs:
    """Per-row sampling settings, padded to the batch bucket.

    temperature f32[B] (0 = greedy), top_k i32[B] (0 = off), top_p f32[B] (1 = off),
    seed u32[B], sample_index i32[B], step i32[B] (output tokens the sample already has).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    sample_index: jax.Array
    step: jax.Array


@struct.dataclass
class SamplerOutput:
    """token_ids i32[B], logprobs f32[B] (of the chosen token), top_ids i32[B, K], top_logprobs f32[B, K]."""

    token_ids: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def row_key(seed, sample_index, step):
    """The key of output step `step` of sample `sample_index`: a function of those and the seed alone."""
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32) + sample_index.astype(jnp.uint32)), step)


def filter_top_k_top_p(logits, top_k, top_p):
    """Masks to -inf every logit outside the top-k and outside the top-p nucleus. logits f32[B, V]."""
    vocab = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)  # descending
    ranks = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (ranks < k) & (mass_before < top_p[:, None])  # rank 0 is always kept
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("num_top", "use_filter"))
def sample(logits, rows, params: SamplingInputs, *, num_top: int = 1, use_filter: bool = False) -> SamplerOutput:
    """Samples one token for each entry of `rows` from `logits[rows]`.

    logits f32[N, V]; rows i32[B] (which logits row each sample reads: the samples of one request
    share their prompt's row). `use_filter` compiles in the top-k/top-p sort (only when a row needs it).
    """
    logits = logits[rows].astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    if use_filter:
        scaled = filter_top_k_top_p(scaled, params.top_k, params.top_p)
    keys = jax.vmap(row_key)(params.seed, params.sample_index, params.step)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, scaled)
    token_ids = jnp.where(params.temperature > 0, drawn, greedy).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids.astype(jnp.int32),
                         top_logprobs=top_logprobs)
