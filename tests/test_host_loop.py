"""The host loop's fast paths against references nobody here wrote: the tokenizer's own `decode`, plain
list slicing, and an engine on `bench/scheduler_overhead.py`'s stub device whose every token is known."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench.scheduler_overhead import decoding_engine
from jpaged.core.detokenizer import append_text, decoder
from jpaged.core.scheduler import Row
from jpaged.core.sequence import Sequence
from jpaged.device.batch import pack_rows


def test_token_slice_is_a_slice_of_token_ids():
    seq = Sequence(0, 0, (5, 6, 7), [8, 9])
    ids = seq.token_ids
    for start in range(6):
        for end in range(start, 7):
            assert seq.token_slice(start, end) == ids[start:end], (start, end)


@pytest.mark.parametrize("max_new", [1, 9])  # a decode step (one token a row), a ragged one
def test_packing_lays_rows_end_to_end(max_new):
    """`pack_rows` against a row-by-row numpy reference: tokens, positions and slots end to end, each
    row's last token's index, its context length and its block table (zero padded)."""
    rng = np.random.default_rng(max_new)
    rows = []
    for _ in range(13):
        n, start = int(rng.integers(1, max_new + 1)), int(rng.integers(0, 40))
        rows.append(Row(token_ids=rng.integers(0, 100, n).tolist(), start_position=start,
                        slots=rng.integers(0, 999, n).tolist(),
                        block_table=rng.integers(1, 50, -(-(start + n) // 4)).tolist()))
    inputs = pack_rows(rows, block_size=4, q_tile=2, k_tile=8)
    total = sum(len(r.token_ids) for r in rows)
    np.testing.assert_array_equal(inputs.token_ids[:total], np.concatenate([r.token_ids for r in rows]))
    np.testing.assert_array_equal(inputs.slot_mapping[:total], np.concatenate([r.slots for r in rows]))
    np.testing.assert_array_equal(inputs.positions[:total], np.concatenate(
        [np.arange(r.start_position, r.start_position + len(r.token_ids)) for r in rows]))
    assert not inputs.token_ids[total:].any() and not inputs.slot_mapping[total:].any()
    np.testing.assert_array_equal(inputs.logits_index[:len(rows)],
                                  np.cumsum([len(r.token_ids) for r in rows]) - 1)
    np.testing.assert_array_equal(inputs.context_lens[:len(rows)],
                                  [r.start_position + len(r.token_ids) for r in rows])
    for b, r in enumerate(rows):
        np.testing.assert_array_equal(inputs.block_tables[b], np.pad(r.block_table, (0, inputs.block_tables.shape[1]
                                                                                     - len(r.block_table))))
    assert not inputs.block_tables[len(rows):].any() and not inputs.context_lens[len(rows):].any()


def test_decoder_is_the_tokenizers_decode(default_model):
    """Random windows (special tokens and the pieces of multi-byte characters among them) decode as
    `tokenizer.decode(..., skip_special_tokens=True)` does; a tokenizer without a Rust backend is
    decoded through its own `decode`."""
    tokenizer = default_model.tokenizer
    decode = decoder(tokenizer)
    rng = random.Random(0)
    pieces = tokenizer("héllo 世界 🙂 naïve ", add_special_tokens=False).input_ids
    specials = sorted(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.choice((rng.randrange(len(tokenizer)), rng.choice(pieces), rng.choice(specials)))
               for _ in range(rng.randrange(0, 6))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids

    class Slow:
        def decode(self, ids, skip_special_tokens):
            return f"{list(ids)}{skip_special_tokens}"

    assert decoder(Slow())([1, 2]) == "[1, 2]True"


def test_incremental_text_is_the_whole_decode(default_model):
    """Token by token, `append_text` builds the text `decode` gives for the whole output, holding back
    the bytes of an unfinished character."""
    tokenizer = default_model.tokenizer
    decode = decoder(tokenizer)
    ids = tokenizer("Grüße, 世界! 🙂🙂 ok", add_special_tokens=False).input_ids
    seq = Sequence(0, 0, (1,))
    for token in ids:
        seq.append_token(token, 0.0)
        append_text(decode, seq)
        assert tokenizer.decode(seq.output_token_ids, skip_special_tokens=True).startswith(seq.text)
    assert seq.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stub_device_engine_appends_the_tokens_its_sampler_draws(default_model):
    """On the stub device the token of (seed, sample_index, step) is a known hash: every request's
    output is that sequence of tokens, so the sampling inputs (seed, sample index, step) reached the
    sampler row by row, and the tokens came back to their sequences."""
    num_seqs = 3
    engine = decoding_engine(default_model, num_seqs, 3, stub=True)
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(outputs) == num_seqs and engine.scheduler.block_manager.num_free_blocks == engine.num_blocks - 1
    for group_id, out in outputs.items():
        seed = np.uint64(engine_seed(engine, out))
        steps = np.arange(len(out.outputs[0].token_ids), dtype=np.uint64)
        want = (seed * np.uint64(40503) + steps * np.uint64(2654435761)) % np.uint64(32768) + np.uint64(256)
        assert out.outputs[0].token_ids == want.astype(int).tolist(), group_id


def engine_seed(engine, out) -> int:
    """The seed the engine drew for a request given none (its generator, in arrival order)."""
    rng = np.random.default_rng(engine.config.seed)
    return [int(rng.integers(2**32)) for _ in range(int(out.request_id) + 1)][-1]


def test_deferred_outputs_are_the_outputs_at_their_step(default_model):
    """A step's outputs are built when first read (`RequestOutput.deferred`): read steps later, they hold
    what an output built at the step (`_completions`, eagerly) held, whatever the sequences did since
    (more tokens, text held back for a stop string, finishing); they pickle, copy and compare as plain
    `RequestOutput`s, and every field stays readable."""
    import copy
    import dataclasses
    import pickle

    from jpaged import SamplingParams
    from jpaged.engine.outputs import RequestMetrics, RequestOutput

    engine = decoding_engine(default_model, 2, 3, stub=True)
    engine.add_request("stop", [300, 301], SamplingParams(max_tokens=12, stop=["e"], temperature=0.5, seed=1))
    engine.add_request("n2", [302, 303], SamplingParams(n=2, max_tokens=5, logprobs=2, seed=2))
    kept = []  # (deferred output, the same output built eagerly at its step)
    while engine.has_unfinished():
        s = engine.scheduler
        groups = {g.request_id: g for g in [*engine._new, *s.waiting, *s.running, *s.swapped]}
        for out in engine.step():
            group = groups[out.request_id]
            eager = RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids),
                                  engine._completions(group), group.is_finished,
                                  RequestMetrics(group.arrival_time, group.first_scheduled_time, group.first_token_time,
                                                 group.finished_time, group.num_preemptions, group.num_cached_tokens),
                                  group.error)
            assert "_build" in out.__dict__, "built at the step, not deferred"
            kept.append((out, eager))
    assert {out.request_id for out, _ in kept} >= {"stop", "n2", "0", "1"} and len(kept) > 10
    assert any(out.finished and out.outputs[0].finish_reason == "stop" for out, _ in kept if out.request_id == "stop")
    for i, (out, eager) in enumerate(kept):  # read long after their steps
        if i % 3 == 0:
            assert pickle.loads(pickle.dumps(out)) == eager
        elif i % 3 == 1:
            assert copy.deepcopy(out) == eager and dataclasses.asdict(out) == dataclasses.asdict(eager)
        assert out == eager and eager == out and repr(out) == repr(eager)
        assert "_build" not in out.__dict__
    n2 = [out for out, _ in kept if out.request_id == "n2"][-1]
    assert [len(o.logprobs) for o in n2.outputs] == [len(o.token_ids) for o in n2.outputs] == [5, 5]
    with pytest.raises(AttributeError):
        kept[0][0].no_such_field


def test_block_table_cache_packs_what_the_tables_say():
    """Packing with a `BlockTableCache` (the runner's, kept across steps) gives the arrays packing without one
    gives, step after step: tables kept (the same tuples), grown (new tuples), new ones whose object may
    reuse a dropped one's identity, and lists (converted every time, even when changed in place)."""
    from jpaged.device.batch import BlockTableCache, StepShapes

    shapes = StepShapes(block_size=4, q_tile=2, prefill_k_tile=8, decode_k_tile=8, max_num_seqs=8,
                        max_prefill_tokens=64, max_model_len=64, max_width=16, reads_plan=(False, False),
                        reads_tables=(True, True))
    rng = random.Random(0)
    cache, tables, mutable = BlockTableCache(), [tuple(rng.sample(range(1, 99), 3)) for _ in range(5)], [7, 8]
    for step in range(30):
        i = rng.randrange(len(tables))
        tables[i] = tables[i] + (rng.randrange(1, 99),) if len(tables[i]) < 16 else (rng.randrange(1, 99),)
        if step % 7 == 3:
            tables[rng.randrange(len(tables))] = tuple(rng.sample(range(1, 99), rng.randrange(1, 6)))  # a new table
        mutable[0] += 1  # a list changed in place
        rows = [Row([1], len(t) * 4 - 1, [5], t) for t in tables] + [Row([1], 7, [5], mutable)]
        with_cache = shapes.pack(rows, decode=True, table_cache=cache)
        np.testing.assert_array_equal(with_cache.block_tables, shapes.pack(rows, decode=True).block_tables)
        for b, r in enumerate(rows):
            assert with_cache.block_tables[b, :len(r.block_table)].tolist() == list(r.block_table)
