"""The device sampler against numpy references: top-k/top-p filtering, the CDF draw, seeding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.device.sampler import (SamplerOutput, SamplingInputs, draw, filter_top_k_top_p, packed, row_key,
                                   row_max_argmax, sample, unpacked)


def reference_filter(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Sort-based top-k then top-p (on the top-k-renormalized distribution), as HF's warpers do."""
    out = logits.astype(np.float64).copy()
    order = np.argsort(-out, kind="stable")
    if top_k > 0:
        out[order[top_k:]] = -np.inf
    probs = np.exp(out - out.max())
    probs /= probs.sum()
    sorted_probs = probs[order]
    mass_before = np.cumsum(sorted_probs) - sorted_probs
    if top_p < 1.0:  # 1.0 is "off" (float rounding can push the tail's mass_before to 1.0)
        out[order[mass_before >= top_p]] = -np.inf
    return out


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (40, 0.8), (3, 0.01),
                                          (0, 1e-38), (0, 1e-45)])  # (a subnormal top_p: the top token stays)
def test_filter_matches_sort_reference(top_k, top_p):
    rng = np.random.default_rng(top_k * 100 + int(top_p * 10))
    logits = (rng.standard_normal((4, 1000)) * 3).astype(np.float32)
    got = np.asarray(filter_top_k_top_p(jnp.asarray(logits), jnp.full(4, top_k, jnp.int32),
                                        jnp.full(4, top_p, jnp.float32)))
    for row in range(4):
        expected = reference_filter(logits[row], top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[row]), np.isfinite(expected))


def test_filter_per_row_settings():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32))
    got = np.asarray(filter_top_k_top_p(logits, jnp.array([2, 0, 10], jnp.int32), jnp.array([1.0, 0.3, 0.6])))
    for row, (k, p) in enumerate([(2, 1.0), (0, 0.3), (10, 0.6)]):
        expected = reference_filter(np.asarray(logits[row]), k, p)
        np.testing.assert_array_equal(np.isfinite(got[row]), np.isfinite(expected))


@pytest.mark.parametrize("vocab, chunk", [(96, 8), (100, 8), (300, 128), (7, 128)])
def test_row_max_argmax_matches_numpy(vocab, chunk):
    """The chunked argmax against numpy's: ties go to the lowest index (within a chunk and across
    chunks), rows of -inf give 0, a vocabulary that is no multiple of the chunk is padded."""
    rng = np.random.default_rng(vocab)
    logits = rng.integers(-3, 4, (9, vocab)).astype(np.float32)  # small integers: many ties
    logits[1] = -np.inf
    logits[2] = 5.0
    logits[3, -1] = 9.0  # the max in the last (padded) chunk
    logits[4, [vocab // 2, vocab - 1, 0]] = 9.0  # tied in several chunks: the first wins
    logits[5] = rng.standard_normal(vocab)
    max_, index = row_max_argmax(jnp.asarray(logits), chunk)
    np.testing.assert_array_equal(np.asarray(index), np.argmax(logits, -1))
    np.testing.assert_array_equal(np.asarray(max_), logits.max(-1))
    assert index.dtype == jnp.int32


def test_draw_follows_the_distribution():
    probs = np.array([0.5, 0.25, 0.125, 0.0, 0.125])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    keys = jax.random.split(jax.random.key(0), 20000)
    tokens = np.asarray(jax.vmap(draw, in_axes=(0, None))(keys, logits))
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[3] == 0  # zero probability is never drawn
    expected = probs * len(tokens)
    chi2 = sum((counts[i] - expected[i]) ** 2 / expected[i] for i in range(len(probs)) if probs[i] > 0)
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_sample_seeding_and_greedy_rows():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((2, 50)).astype(np.float32))

    def run(temperature, seed, sample_index, step, rows=(0, 1)):
        params = SamplingInputs(temperature=jnp.asarray(temperature, jnp.float32), top_k=jnp.zeros(2, jnp.int32),
                                top_p=jnp.ones(2, jnp.float32), seed=jnp.asarray(seed, jnp.uint32),
                                sample_index=jnp.asarray(sample_index, jnp.int32), step=jnp.asarray(step, jnp.int32))
        return np.asarray(sample(logits, jnp.asarray(rows, jnp.int32), params, num_top=2).token_ids)

    greedy = run([0.0, 0.0], [1, 2], [0, 0], [0, 0])
    np.testing.assert_array_equal(greedy, np.asarray(jnp.argmax(logits, -1)))
    mixed = run([0.0, 1.0], [1, 2], [0, 0], [0, 0])
    assert mixed[0] == greedy[0]  # a greedy row is unaffected by sampled rows beside it
    # sample i of seed s draws as sample 0 of seed s + i
    assert run([1.0, 1.0], [7, 7], [3, 3], [5, 5])[0] == run([1.0, 1.0], [10, 10], [0, 0], [5, 5])[0]
    keys = [row_key(jnp.uint32(7), jnp.int32(i), jnp.int32(t)) for i, t in [(0, 0), (0, 1), (1, 0)]]
    data = [tuple(np.asarray(jax.random.key_data(k)).ravel()) for k in keys]
    assert len(set(data)) == 3


@pytest.mark.parametrize("num_top", [0, 1, 4])
def test_logprobs_match_a_float64_log_softmax(num_top):
    """Chosen and top log-probabilities per sample row (two samples share logits row 1) against
    numpy's float64 log-softmax; num_top=0 returns no top tokens."""
    logits = np.random.default_rng(3).standard_normal((3, 300)).astype(np.float32) * 4
    rows = np.asarray([0, 1, 1, 2], np.int32)
    n = len(rows)
    params = SamplingInputs(temperature=jnp.asarray([0.0, 0.0, 1.0, 0.7], jnp.float32), top_k=jnp.zeros(n, jnp.int32),
                            top_p=jnp.ones(n, jnp.float32), seed=jnp.arange(n, dtype=jnp.uint32),
                            sample_index=jnp.zeros(n, jnp.int32), step=jnp.zeros(n, jnp.int32))
    out = sample(jnp.asarray(logits), jnp.asarray(rows), params, num_top=num_top)
    x = logits.astype(np.float64)
    reference = x - x.max(-1, keepdims=True)
    reference -= np.log(np.exp(reference).sum(-1, keepdims=True))
    tokens = np.asarray(out.token_ids)
    assert list(tokens[:2]) == list(np.argmax(logits[rows[:2]], -1))  # the greedy rows
    np.testing.assert_allclose(np.asarray(out.logprobs), reference[rows, tokens], atol=1e-5)
    assert out.top_ids.shape == (n, num_top) and out.top_logprobs.shape == (n, num_top)
    if num_top:
        expected_ids = np.argsort(-reference, axis=-1, kind="stable")[rows, :num_top]
        np.testing.assert_array_equal(np.asarray(out.top_ids), expected_ids)
        np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(reference[rows], expected_ids, -1),
                                   atol=1e-5)


@pytest.mark.parametrize("num_top", [0, 3])
def test_packed_samples_read_back_bit_for_bit(num_top):
    """The one array the host reads (`packed`, on the device and on numpy alike) gives back every field
    of the sampler's output: ids exactly, log-probabilities bit for bit (-inf too)."""
    rng = np.random.default_rng(0)
    rows = 6
    logits = jnp.asarray(rng.normal(size=(rows, 300)) * 8, jnp.float32).at[1, :299].set(-jnp.inf)
    params = SamplingInputs(temperature=jnp.asarray([0, 0.7, 0, 1.2, 0, 0.5], jnp.float32),
                            top_k=jnp.zeros(rows, jnp.int32), top_p=jnp.ones(rows, jnp.float32),
                            seed=jnp.arange(rows, dtype=jnp.uint32), sample_index=jnp.zeros(rows, jnp.int32),
                            step=jnp.zeros(rows, jnp.int32), draft=jnp.asarray([-1, 3, 7, -1, 5, -1], jnp.int32))
    out = sample(logits, jnp.arange(rows, dtype=jnp.int32), params, num_top=num_top)
    want = {name: np.asarray(getattr(out, name)) for name in ("token_ids", "logprobs", "top_ids", "top_logprobs",
                                                               "accepted")}
    assert np.isneginf(want["top_logprobs"]).any() if num_top else want["top_ids"].shape == (rows, 0)
    host = SamplerOutput(**{name: np.asarray(value) for name, value in want.items()})
    for read in (np.asarray(jax.jit(packed)(out)), packed(host)):
        got = unpacked(read[:5])
        assert set(got) == set(want)
        for name, value in want.items():
            assert got[name].dtype == value.dtype and got[name].shape == value[:5].shape
            assert value[:5].tobytes() == got[name].tobytes(), name
