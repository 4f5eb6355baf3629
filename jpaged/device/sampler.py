"""Token sampling on the device: greedy, temperature, top-k, top-p, seeded per (seed, sample, step),
and the verification of draft tokens (speculative decoding).

Every row carries its own seed: the token at output step t of sample i of a request is drawn with
the key `fold_in(key(seed + i), t)`, so it never depends on what else shares the batch or on how
often the request was preempted, and sample i of a request with seed s draws exactly the tokens of
a single-sample request with seed s + i. Log-probabilities are those of the model's raw
distribution (log_softmax of the logits, before temperature and filtering), as vLLM reports them.

Draft verification (`SamplingInputs.draft` >= 0: the row's logits score a proposed token d, a point
mass, `jpaged.core.proposer`): greedy rows accept d when it is the argmax (and give the argmax);
random rows draw their token t from the row's filtered, tempered distribution p with the row's own
key, exactly as without a draft, and accept d when t == d (else t is the correction token). That is
standard speculative sampling with q = the point mass on d, coupled: d is accepted with probability
p(d), a rejection emits a token of p without d, renormalized, so the token emitted follows p exactly;
and it is the very token the row draws without speculation, so a seeded request's tokens depend
neither on which of its positions had drafts nor on what else shared the step (whose blocks and
token budget decide how many drafts a sequence gets).

Structured output (`SamplingInputs.allowed`): a constrained row draws only among its allowed tokens
(the others' logits -inf before temperature and filtering); log-probabilities stay the raw model's.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingInputs:
    """Per-row sampling settings, padded to the batch bucket.

    temperature f32[B] (0 = greedy), top_k i32[B] (0 = off), top_p f32[B] (1 = off),
    seed u32[B], sample_index i32[B], step i32[B] (output tokens the sample already has),
    draft i32[B] (the draft token the row verifies, -1: none; None: no row has one),
    allowed i32[B, ceil(V / 32)] (structured output: bit t % 32 of word t // 32 set where token t may
    be drawn, every bit of an unconstrained row; None: no row is constrained).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    sample_index: jax.Array
    step: jax.Array
    draft: Optional[jax.Array] = None
    allowed: Optional[jax.Array] = None


@struct.dataclass
class SamplerOutput:
    """token_ids i32[B], logprobs f32[B] (of the chosen token), top_ids i32[B, K], top_logprobs f32[B, K],
    accepted bool[B] (the row's draft was accepted: token_ids is the draft)."""

    token_ids: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    accepted: jax.Array


def packed(out: SamplerOutput) -> jax.Array:
    """`out` as one i32[B, 3 + 2K] array, read to the host in one transfer (`unpacked`): the columns are
    token_ids, the bits of logprobs, accepted, the K top_ids, the bits of the K top_logprobs. Reading the
    five fields with `jax.device_get` after a decode step cost the host ~0.27 ms, ~4% of a one-row bfloat16
    token; this one array with `np.asarray`, ~0.06 ms (AMD EPYC, 2 cores). numpy arrays (a stand-in device)
    pack alike."""
    xp = np if isinstance(out.token_ids, np.ndarray) else jnp

    def bits(x):
        x = xp.asarray(x, xp.float32)
        return x.view(np.int32) if xp is np else jax.lax.bitcast_convert_type(x, jnp.int32)

    return xp.concatenate([out.token_ids[:, None].astype(xp.int32), bits(out.logprobs)[:, None],
                           out.accepted[:, None].astype(xp.int32), out.top_ids.astype(xp.int32),
                           bits(out.top_logprobs)], axis=1)


def unpacked(rows: np.ndarray) -> dict[str, np.ndarray]:
    """`packed`'s rows read to the host, as SamplerOutput's fields by name (views of `rows`)."""
    k = (rows.shape[1] - 3) // 2
    return {"token_ids": rows[:, 0], "logprobs": rows[:, 1].view(np.float32), "accepted": rows[:, 2] != 0,
            "top_ids": rows[:, 3:3 + k], "top_logprobs": rows[:, 3 + k:].view(np.float32)}


def row_key(seed, sample_index, step):
    """The key of output step `step` of sample `sample_index`: a function of those and the seed alone."""
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32) + sample_index.astype(jnp.uint32)), step)


def _bisect_threshold(values, satisfied, iterations: int = 40):
    """Per row, the largest t (to float resolution) with `satisfied(values >= t)`, found by bisection.

    `satisfied` must hold at t = min(values) and be monotone (true below some t, false above).
    Forty halvings of the value range go below float32 spacing, so the kept set is exact (ties kept).
    """
    finite = jnp.where(jnp.isfinite(values), values, jnp.nan)
    lo = jnp.nanmin(finite, axis=-1, keepdims=True)
    hi = jnp.nanmax(finite, axis=-1, keepdims=True) + 1.0

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = satisfied(values >= mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, iterations, body, (lo, hi))
    return lo


def filter_top_k_top_p(logits, top_k, top_p):
    """Masks to -inf every logit outside the top-k, then outside the top-p nucleus of what remains
    (HF's and vLLM's order). logits f32[B, V]; top_k i32[B] (0 = off); top_p f32[B] (1 = off).

    Thresholds are found by bisection over logit values instead of a full sort of the vocabulary
    (a sort of [B, 49152] is the slowest op of a step on a CPU)."""
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    kth = _bisect_threshold(logits, lambda keep: jnp.sum(keep, axis=-1, keepdims=True) >= k)
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    nucleus = _bisect_threshold(
        logits, lambda keep: jnp.sum(jnp.where(keep, probs, 0.0), axis=-1, keepdims=True) >= top_p[:, None])
    nucleus = jnp.minimum(nucleus, jnp.max(logits, axis=-1, keepdims=True))  # the top token stays (a top_p of ~0)
    return jnp.where((logits >= nucleus) | (top_p[:, None] >= 1.0), logits, -jnp.inf)


def row_max_argmax(logits, chunk: int = 128):
    """Per row of logits f32[N, V]: (its largest value, the index of it, the lowest on ties as
    `jnp.argmax`), from each `chunk` of the row's maximum (a plain vectorized reduction), the first
    chunk holding the row's maximum, then the argmax inside that one chunk. XLA's CPU argmax over a
    whole row is a variadic (value, index) reduction that does not vectorize: 14 ms at 128 rows of
    49,152 logits, against under 1 ms this way. A row holding NaN gets an arbitrary index (XLA's CPU
    max may skip NaN): its logits are garbage either way. Pads the vocabulary with -inf to whole
    chunks only when `chunk` does not divide it."""
    n, vocab = logits.shape
    if vocab % chunk:
        logits = jnp.pad(logits, ((0, 0), (0, -vocab % chunk)), constant_values=-jnp.inf)
    chunks = logits.reshape(n, -1, chunk)
    chunk_max = jnp.max(chunks, axis=-1)  # [N, V / chunk]
    first = jnp.argmax(chunk_max, axis=-1)  # the first chunk that holds the row's max
    inside = jnp.argmax(jnp.take_along_axis(chunks, first[:, None, None], axis=1)[:, 0], axis=-1)
    return jnp.max(chunk_max, axis=-1), (first * chunk + inside).astype(jnp.int32)


def unpack_bitmask(words, vocab: int):
    """i32[B, W] packed bits -> bool[B, vocab]: token t is bit t % 32 of word t // 32."""
    bits = jnp.right_shift(words[:, :, None], jnp.arange(32, dtype=words.dtype)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(bool)


def draw(key, logits):
    """One token from softmax(logits) by inverting its CDF with a single uniform (exact, and far
    cheaper than Gumbel noise over the whole vocabulary)."""
    cdf = jnp.cumsum(jax.nn.softmax(logits))
    u = jax.random.uniform(key, dtype=cdf.dtype) * cdf[-1]
    return jnp.argmax(cdf > u)


@functools.partial(jax.jit, static_argnames=("num_top", "use_filter", "use_random"))
def sample(logits, rows, params: SamplingInputs, *, num_top: int = 1, use_filter: bool = False,
           use_random: bool = True) -> SamplerOutput:
    """Samples one token for each entry of `rows` from `logits[rows]`.

    logits f32[N, V]; rows i32[B] (which logits row each sample reads: the samples of one request
    share their prompt's row). `use_random` compiles in the random draw (only when a row has
    temperature > 0), `use_filter` the top-k/top-p filter (only when a row needs it), `num_top`
    the `num_top` most likely tokens per row (0: none, `top_ids` is [B, 0]).

    Greedy rows only read the logits (row max and argmax together, exp-sum) and never copy them: the
    log-probability of a token is `(logit - max) - log(sum(exp(logits - max)))`, the very operations
    of `jax.nn.log_softmax`, computed for the chosen and the top tokens only.
    """
    logits = logits.astype(jnp.float32)
    row_max, argmax = row_max_argmax(logits)
    log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1))  # [N]

    def logprob(values, at):  # values gathered from logits rows `at` -> their log-probabilities
        return (values - row_max[at]) - log_norm[at]

    token_ids = argmax[rows]
    row_logits = logits[rows]  # [B, V]: what each sample draws from (masked where constrained)
    if params.allowed is not None:
        row_logits = jnp.where(unpack_bitmask(params.allowed, logits.shape[-1]), row_logits, -jnp.inf)
        token_ids = row_max_argmax(row_logits)[1]
    draft = jnp.full(rows.shape, -1, jnp.int32) if params.draft is None else params.draft
    has_draft = draft >= 0
    accepted = has_draft & (token_ids == draft)  # greedy
    if use_random:
        temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
        scaled = row_logits / temperature[:, None]
        if use_filter:
            scaled = filter_top_k_top_p(scaled, params.top_k, params.top_p)
        keys = jax.vmap(row_key)(params.seed, params.sample_index, params.step)
        drawn = jax.vmap(draw)(keys, scaled)  # with a draft or without: the row's own draw from p
        token_ids = jnp.where(params.temperature > 0, drawn, token_ids)
        accepted = jnp.where(params.temperature > 0, has_draft & (drawn == draft), accepted)
    token_ids = token_ids.astype(jnp.int32)
    chosen = logprob(logits[rows, token_ids], rows)
    if num_top:  # per logits row, then per sample row; the top 1 is the argmax (lax.top_k also puts
        # the lowest index first on ties) and costs nothing more
        top_logits, top_ids = ((row_max[:, None], argmax[:, None]) if num_top == 1
                               else jax.lax.top_k(logits, num_top))
        top_ids, top_logprobs = top_ids[rows], logprob(top_logits[rows], rows[:, None])
    else:
        top_ids, top_logprobs = jnp.zeros((rows.shape[0], 0), jnp.int32), jnp.zeros((rows.shape[0], 0))
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids.astype(jnp.int32),
                         top_logprobs=top_logprobs, accepted=accepted)
