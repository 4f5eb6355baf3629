"""Structured output in the engine (`SamplingParams(structured_outputs=...)`, llguidance): every output
of the default model, greedy and sampled, validates against its JSON schema, regex or choice, over
many requests in one batch with unconstrained requests beside them (whose tokens do not change);
constrained sequences keep their outputs through preemption (recompute and swap) and a pause / resume
in their middle; a constraint that does not compile is refused at admission. The sampler's mask on
its own: a constrained row draws only allowed tokens."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jpaged import LLMEngine, SamplingParams, StructuredOutputsParams
from jpaged.device.sampler import SamplingInputs, sample

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
RATING = {"type": "object", "additionalProperties": False, "required": ["score", "verdict"],
          "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10},
                         "verdict": {"enum": ["good", "bad"]}}}
PHONE = r"[0-9]{3}-[0-9]{4}"
CITIES = ["Paris", "London", "Rome", "Berlin"]


def check(constraint: StructuredOutputsParams, text: str) -> None:
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.json_object:
        assert isinstance(json.loads(text), dict)
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.choice is not None:
        assert text in constraint.choice, text


@pytest.fixture(scope="module")
def requests(llm):
    """(prompts, params): constrained requests of every kind, greedy and sampled (n = 2 among them),
    and unconstrained ones beside them."""
    ask = lambda text: llm.chat_prompt([{"role": "user", "content": text}])  # noqa: E731
    json_kw = dict(max_tokens=160)
    items = [
        (ask("Describe a person as JSON."), SamplingParams(temperature=0, **json_kw, structured_outputs={"json": PERSON})),
        (ask("Describe a person as JSON."), SamplingParams(temperature=0.9, seed=1, n=2, **json_kw,
                                                           structured_outputs={"json": PERSON})),
        (ask("Rate this film as JSON."), SamplingParams(temperature=0.7, seed=2, max_tokens=40,
                                                        structured_outputs={"json": RATING})),
        (ask("List two colors as a JSON object."),
         SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json_object": True})),
        (ask("Give me a phone number."), SamplingParams(temperature=0.8, seed=3, max_tokens=16,
                                                        structured_outputs={"regex": PHONE})),
        (ask("Which city is the capital of Italy?"), SamplingParams(temperature=0, max_tokens=8,
                                                                    structured_outputs={"choice": CITIES})),
        (ask("Write a haiku about the sea."), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        (ask("Name three fruits."), SamplingParams(temperature=0.8, seed=4, max_tokens=24, ignore_eos=True)),
    ]
    return [p for p, _ in items], [s for _, s in items]


def _texts(outs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def together(llm, requests):
    prompts, params = requests
    return _texts(llm.generate(prompts, params, use_tqdm=False))


def test_every_constrained_output_validates_and_unconstrained_ones_do_not_change(llm, requests, together):
    prompts, params = requests
    for outputs, p in zip(together, params):
        for tokens, text, reason in outputs:
            if p.structured_outputs is not None:
                assert reason == "stop", (text, reason)  # the constraint completed before max_tokens
                check(p.structured_outputs, text)
    alone = _texts(llm.generate(prompts[-2:], params[-2:], use_tqdm=False))
    assert together[-2:] == alone
    samples = [t for t, _, _ in together[1]]
    assert samples[0] != samples[1], "two samples of one constrained request drew alike"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_sequences_keep_their_outputs_through_preemption(make_llm, requests, together, mode):
    prompts, params = requests
    llm = make_llm(num_blocks=24, preemption_mode=mode, swap_space=0.25 if mode == "swap" else 0.0, watermark=0.0)
    assert _texts(llm.generate(prompts, params, use_tqdm=False)) == together
    assert llm.engine.stats()["num_preemptions"] > 0, "the pool was meant to be too small"
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.num_blocks - 1 and not llm.engine._matchers


def test_a_pause_in_the_middle_of_a_constrained_sequence_changes_nothing(default_model, llm, requests, together,
                                                                         tmp_path):
    prompts, params = requests
    engine = LLMEngine(loaded=default_model, num_blocks=128)
    for i in range(4):
        engine.add_request(str(i), prompts[i], params[i])
    for _ in range(6):
        engine.step()
    engine.save(tmp_path / "paused")
    del engine
    resumed = LLMEngine.restore(tmp_path / "paused", loaded=default_model)
    finished = {}
    while resumed.has_unfinished():
        for out in resumed.step():
            if out.finished:
                finished[out.request_id] = out
    assert [[(c.token_ids, c.text, c.finish_reason) for c in finished[str(i)].outputs] for i in range(4)] == together[:4]


@pytest.mark.parametrize("constraint, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "does not compile"),
    ({"grammar": "start: foo"}, "does not compile"),
    ({"regex": "("}, "regex does not compile"),
    ({"choice": []}, "non-empty strings"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
])
def test_a_constraint_that_does_not_compile_is_refused_at_admission(llm, constraint, message):
    engine = llm.engine
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", "hello", SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="not supported with beam search"):
        SamplingParams(beam_width=2, structured_outputs={"choice": ["a", "b"]})


def test_a_lark_grammar_and_a_gbnf_grammar_constrain_the_output(llm):
    lark = 'start: "yes" | "no" | "maybe"'
    gbnf = 'root ::= "A" [0-9] [0-9]'
    outs = llm.generate(["Answer:", "Code:"], [
        SamplingParams(temperature=0.8, seed=5, max_tokens=8, structured_outputs={"grammar": lark}),
        SamplingParams(temperature=0.8, seed=6, max_tokens=8, structured_outputs={"grammar": gbnf})], use_tqdm=False)
    assert outs[0].outputs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"A[0-9][0-9]", outs[1].outputs[0].text)


def test_the_sampler_draws_only_allowed_tokens():
    vocab, n = 70, 64
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, vocab)) * 3, jnp.float32)
    allowed_ids = [3, 17, 40, 69]
    words = np.zeros((n, -(-vocab // 32)), np.int64)
    for t in allowed_ids:
        words[:, t // 32] |= 1 << (t % 32)
    params = SamplingInputs(temperature=jnp.asarray([0.0] * 8 + [1.5] * (n - 8), jnp.float32),
                            top_k=jnp.zeros(n, jnp.int32), top_p=jnp.ones(n, jnp.float32),
                            seed=jnp.arange(n, dtype=jnp.uint32), sample_index=jnp.zeros(n, jnp.int32),
                            step=jnp.arange(n, dtype=jnp.int32), allowed=jnp.asarray(words.astype(np.uint32).view(np.int32)))
    out = sample(logits, jnp.zeros(n, jnp.int32), params, num_top=0)
    tokens = np.asarray(out.token_ids)
    assert set(tokens.tolist()) <= set(allowed_ids) and len(set(tokens[8:].tolist())) > 1
    best = max(allowed_ids, key=lambda t: float(logits[0, t]))
    assert (tokens[:8] == best).all()  # greedy: the most likely allowed token


def test_ignore_eos_holds_under_a_constraint_that_could_end(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    any_text = {"regex": r"[^\x00]*"}
    free, kept = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=any_text),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, structured_outputs=any_text)], use_tqdm=False)
    assert free.outputs[0].finish_reason == "stop" and len(free.outputs[0].token_ids) < 30
    assert kept.outputs[0].finish_reason == "length" and len(kept.outputs[0].token_ids) == 30
