"""Structured output through `jpaged serve` (issue 30), with the official `openai` client: OpenAI's
`response_format` (a JSON schema, `client.chat.completions.parse` with a pydantic model, any JSON
object), vLLM's `structured_outputs` and `guided_*` fields, streamed and not; a constraint that does not
compile is a 400 naming the problem while other requests go on; an unconstrained request batched with
constrained ones gets the tokens it gets alone.

The server runs on the shared `llm` fixture's engine (no new model, no new KV pool); greedy throughout.
Regexes use [0-9], not \\d (llguidance's \\d, like Python's, matches every Unicode digit)."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import openai
import pydantic
import pytest

from jpaged.entrypoints.server import ServerConfig
from test_server import MODEL, QUESTION, Running, assert_all_free

PERSON = {"type": "object", "properties": {  # nested object, array, enums, integer bounds, bounded strings
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["engineer", "doctor", "teacher"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"], "additionalProperties": False},
    "skills": {"type": "array", "items": {"type": "string", "enum": ["python", "rust", "jax"]},
               "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "role", "address", "skills"], "additionalProperties": False}
ALICE = [{"role": "user", "content": "Describe Alice, a 30-year-old engineer from Paris, as JSON."}]
PHONE = "[0-9]{3}-[0-9]{4}"
CITIES = ["Paris", "London", "Rome"]
PLAIN = "The capital of France is"  # the unconstrained request: 24 tokens, whatever shares its batch


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    country: str = pydantic.Field(max_length=12)


class Trip(pydantic.BaseModel):
    traveller: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=30)
    cities: list[City] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def server(llm):
    running = Running(llm.engine, ServerConfig(model_name=MODEL))
    yield running
    running.wait_idle()
    running.stop()


@pytest.fixture(scope="module")
def alone(server) -> str:
    """The unconstrained request's text when it runs alone."""
    r = server.client().completions.create(model=MODEL, prompt=PLAIN, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24
    return r.choices[0].text


def test_json_schema_response_format_in_chat(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=ALICE, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    (choice,) = r.choices
    assert choice.finish_reason == "stop"  # the schema was complete: the constraint ended it
    person = json.loads(choice.message.content)
    jsonschema.validate(person, PERSON)
    assert person["name"] == "Alice" and person["address"]["city"] == "Paris"
    assert_all_free(server.engine)


def test_parse_with_a_pydantic_model(server):
    r = server.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Bob travels for 5 days to Paris and Rome. Answer in JSON."}],
        response_format=Trip, max_tokens=80, temperature=0)
    trip = r.choices[0].message.parsed
    assert isinstance(trip, Trip) and 1 <= trip.days <= 30 and 1 <= len(trip.cities) <= 2
    assert all(isinstance(c, City) for c in trip.cities)


@pytest.mark.parametrize("fields, check", [
    ({"structured_outputs": {"json_object": True}}, lambda text: isinstance(json.loads(text), dict)),
    ({"structured_outputs": {"regex": PHONE}}, lambda text: re.fullmatch(PHONE, text)),
    ({"structured_outputs": {"choice": CITIES}}, lambda text: text in CITIES),
    ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    ({"guided_regex": PHONE}, lambda text: re.fullmatch(PHONE, text)),
    ({"guided_choice": CITIES, "response_format": {"type": "text"}}, lambda text: text in CITIES),
], ids=["json_object", "regex", "choice", "response_format-json_object", "guided_regex", "guided_choice"])
def test_completions_constrained_streamed_and_not(server, fields, check):
    client = server.client()
    prompt = "Q: What is 12 times 12?\nA:"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body=fields)
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and check(choice.text), choice.text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                            extra_body=fields))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_constraints_get_400s_while_another_request_runs(server, alone):
    client = server.client()
    streamed, started = [], threading.Event()

    def stream():
        for chunk in client.completions.create(model=MODEL, prompt=PLAIN, max_tokens=24, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            streamed.append(chunk.choices[0].text)
            started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    chat = dict(model=MODEL, messages=QUESTION, max_tokens=8)
    bad = {  # request fields -> the message (the engine's, from compiling the constraint, for the first four)
        "bad schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}},
            "structured_outputs: the json constraint does not compile: Invalid type: strin (sent as "
            "'response_format')"),
        "dangling $ref": ({"structured_outputs": {"json": {"properties": {"a": {"$ref": "#/nope"}}}}},
                          "structured_outputs: the json constraint does not compile: Pointer '/nope' does not exist"),
        "look-behind regex": ({"guided_regex": "(?<=a)b"}, "look-around, including look-ahead and look-behind, is "
                                                           "not supported"),
        "unknown rule": ({"structured_outputs": {"grammar": "start: foo"}}, 'unknown name: "foo"'),
        "regex that is no regex": ({"structured_outputs": {"regex": "[0-9"}},
                                   "structured_outputs.regex does not compile: unterminated character set"),
        "two at once": ({"guided_choice": ["a", "b"], "response_format": {"type": "json_object"}},
                        "a request takes one output constraint, got 2 at once: 'response_format', 'guided_choice'; "
                        "send only one"),
        "two in structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
                                      "got 2 at once: 'structured_outputs.regex', 'structured_outputs.choice'"),
        "empty structured_outputs": ({"structured_outputs": {}}, "'structured_outputs' needs one of 'json', 'regex'"),
        "unknown response_format": ({"response_format": {"type": "xml"}}, "'response_format' must be {'type': 'text'}"),
        "schema-less json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                                    "'response_format.json_schema.schema' must be a JSON schema (an object), got "
                                    "None"),
        "beam search": ({"structured_outputs": {"regex": "a"}, "beam_width": 2, "temperature": 0},
                        "structured outputs are not supported with beam search"),
    }
    for name, (fields, message) in bad.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**chat, extra_body=fields)
        assert message in info.value.message, (name, info.value.message)
        assert info.value.status_code == 400
    assert thread.is_alive(), "the stream ended before the bad requests were answered: make it longer"
    thread.join()
    assert "".join(streamed) == alone  # the stream went on, untouched
    server.wait_idle()
    assert_all_free(server.engine)


def test_unconstrained_request_batched_with_constrained_ones(server, alone):
    async def together():
        client = server.async_client()
        return await asyncio.gather(
            client.completions.create(model=MODEL, prompt=PLAIN, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}),
            client.chat.completions.create(model=MODEL, messages=ALICE, max_tokens=80, temperature=0, response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}),
            client.completions.create(model=MODEL, prompt="The phone number of the office is", max_tokens=20,
                                      temperature=0, extra_body={"structured_outputs": {"regex": PHONE}}),
            client.completions.create(model=MODEL, prompt="My favourite city is", max_tokens=20, temperature=0,
                                      extra_body={"guided_choice": CITIES}))

    batched = server.metric("jpaged_decode_batch_size_count") - server.metric("jpaged_decode_batch_size_bucket",
                                                                             le="1.0")
    plain, person, phone, city = asyncio.run(together())
    assert server.metric("jpaged_decode_batch_size_count") - server.metric(
        "jpaged_decode_batch_size_bucket", le="1.0") > batched, "no decode step ran more than one request"
    assert plain.choices[0].text == alone
    jsonschema.validate(json.loads(person.choices[0].message.content), PERSON)
    assert re.fullmatch(PHONE, phone.choices[0].text) and city.choices[0].text in CITIES
    server.wait_idle()
    assert_all_free(server.engine)
