"""`jpaged serve`, tested with the official `openai` client on a free loopback port: completions and
chat completions, streamed and not, equal to `LLM.generate`; 32 concurrent streaming clients batched
together, each with the tokens it gets alone; bad requests answered with 400s while others stream;
a client that disconnects mid-stream frees its blocks; API keys; limits; metrics; SIGTERM."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import uvicorn

from jpaged import SamplingParams
from jpaged.entrypoints.server import ServerConfig, build_app

MODEL = "smol"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server in a thread of this process, on the session's model."""

    def __init__(self, engine, config: ServerConfig):
        self.engine, self.port = engine, free_port()
        self.app = build_app(engine, config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, **kw)

    def async_client(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key=api_key, max_retries=0)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()

    def metric(self, name: str, default: float | None = None, **labels) -> float:
        """A sample of /metrics (`default` when absent: a labelled series appears at its first use)."""
        _, text = self.raw("GET", "/metrics")
        want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        for line in text.decode().splitlines():
            if line.startswith(name + want + " "):
                return float(line.split()[-1])
        if default is not None:
            return default
        raise KeyError(f"{name}{want} not in /metrics")

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished():
            assert time.monotonic() < deadline, "requests still in the engine"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.app.state.loop.stop()  # stopped by the lifespan already, unless the server failed


@pytest.fixture(scope="module")
def server(make_llm):
    running = Running(make_llm(num_blocks=256, max_num_seqs=64).engine, ServerConfig(model_name=MODEL, max_waiting=64))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(make_llm):
    """An LLM of its own (the server's engine is stepped by the server's thread alone)."""
    return make_llm(num_blocks=256)


def assert_all_free(engine) -> None:
    stats = engine.stats()
    assert stats["num_free_blocks"] == engine.num_blocks - 1 and stats["num_seqs"] == 0, stats


# ---------------------------------------------------------------- equal to LLM.generate

def test_completions_equal_generate(server, reference):
    client = server.client()
    prompts = ["The capital of France is", "List three colors:"]
    expected = [o.outputs[0].text for o in reference.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == sum(
        len(reference.tokenizer(p).input_ids) for p in prompts)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == expected[0]
    assert_all_free(server.engine)


def test_chat_completions_equal_chat(server, reference):
    client = server.client()
    (expected,) = reference.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text and "Paris" in choice.message.content
    assert choice.finish_reason == expected.outputs[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_sampling_fields_n_seed_stop_logprobs_beams(server, reference):
    client = server.client()
    seeded = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, n=3, temperature=0.9,
                                       seed=11)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, n=3, temperature=0.9,
                                      seed=11)
    assert [c.text for c in seeded.choices] == [c.text for c in again.choices] and len(seeded.choices) == 3
    (expected,) = reference.generate("Once upon a time", SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10),
                                     use_tqdm=False)
    assert [c.text for c in seeded.choices] == [o.text for o in expected.outputs]
    r = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=20, temperature=0,
                                  stop=[" five"], logprobs=2)
    (choice,) = r.choices
    assert " five" not in choice.text and choice.finish_reason == "stop"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
    assert all(len(top) >= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    beams = client.completions.create(model=MODEL, prompt="The best fruit is", max_tokens=6,
                                      extra_body={"beam_width": 3, "temperature": 0})
    (expected,) = reference.generate("The best fruit is", SamplingParams(beam_width=3, temperature=0, max_tokens=6),
                                     use_tqdm=False)
    assert [c.text for c in beams.choices] == [o.text for o in expected.outputs]


# ---------------------------------------------------------------- concurrency

def test_32_concurrent_streaming_clients_are_batched(server):
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]

    async def one(client, prompt):
        text = ""
        async for chunk in await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0,
                stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    async def concurrently():
        client = server.async_client()
        return await asyncio.gather(*(one(client, p) for p in prompts))

    async def one_at_a_time():
        client = server.async_client()
        return [await one(client, p) for p in prompts]

    batches_before = server.metric("jpaged_decode_batch_size_bucket", le="1.0"), server.metric(
        "jpaged_decode_batch_size_count")
    together = asyncio.run(concurrently())
    ones, count = server.metric("jpaged_decode_batch_size_bucket", le="1.0"), server.metric(
        "jpaged_decode_batch_size_count")
    assert count - batches_before[1] > ones - batches_before[0], "no decode step ran more than one request"
    assert all(together) and together == asyncio.run(one_at_a_time())
    assert server.metric("jpaged_time_to_first_token_seconds_count") >= 64
    server.wait_idle()
    assert_all_free(server.engine)


# ---------------------------------------------------------------- bad requests and disconnects

def test_bad_requests_get_400s_while_others_stream(server, reference):
    client = server.client()
    (expected,) = reference.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    streamed, errors = [], {}

    def stream():
        for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                                    stream=True):
            if chunk.choices:
                streamed.append(chunk.choices[0].delta.content or "")

    thread = threading.Thread(target=stream)
    thread.start()
    bad = {
        "malformed JSON": (b'{"model": "smol", "prompt": ', "not valid JSON"),
        "not an object": (b'["a list"]', "must be a JSON object"),
        "invalid temperature": (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(),
                                "temperature must be a number >= 0"),
        "unknown field": (json.dumps({"model": MODEL, "prompt": "x", "frequency_penalty": 0.5}).encode(),
                          "unsupported field(s) 'frequency_penalty' (accepted: frequency_penalty only as 0 or null)"),
        "prompt too long": (json.dumps({"model": MODEL, "prompt": "word " * 9000}).encode(), "the model's context"),
        "prompt too long with max_tokens": (json.dumps({"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4}
                                                       ).encode(), "shorten the prompt to at most 8191 tokens"),
        "no prompt": (json.dumps({"model": MODEL}).encode(), "'prompt' must be"),
        "bad n with greedy": (json.dumps({"model": MODEL, "prompt": "x", "n": 2, "temperature": 0}).encode(),
                              "2 identical samples"),
        "deeply nested JSON": (b"[" * 100000 + b"]" * 100000, "nests JSON too deeply"),
        "max_tokens past the context": (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**9}).encode(),
                                        "exceed the model's context of 8192 tokens: ask for at most"),
        "max_completion_tokens": (json.dumps({"model": MODEL, "messages": QUESTION, "max_completion_tokens": 0}
                                             ).encode(), "max_completion_tokens must be"),
        "beam search with logprobs": (json.dumps({"model": MODEL, "prompt": "x", "beam_width": 2, "logprobs": 1,
                                                  "temperature": 0}).encode(), "not returned with beam search"),
        "stream_options without a stream": (json.dumps({"model": MODEL, "prompt": "x", "stream_options": {
            "include_usage": True}}).encode(), "goes with \"stream\": true"),
        "top_logprobs out of range": (json.dumps({"model": MODEL, "messages": QUESTION, "logprobs": True,
                                                  "top_logprobs": 30}).encode(), "'top_logprobs' must be"),
        "user not a string": (json.dumps({"model": MODEL, "prompt": "x", "user": {"id": 1}}).encode(),
                              "'user' must be a string"),
        "n above max_num_seqs": (json.dumps({"model": MODEL, "prompt": "x", "n": 99}).encode(),
                                 "n=99 is more sequences than the engine runs at once"),
        "a bad prompt of several": (json.dumps({"model": MODEL, "prompt": [[5, 6], [5, 10**9]]}).encode(),
                                    "prompt 1 of 2: prompt token id 1000000000 is outside the vocabulary"),
    }
    params = {"user not a string": "user", "n above max_num_seqs": "n", "prompt too long": "prompt",
              "a bad prompt of several": "prompt"}
    for name, (body, message) in bad.items():
        path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
        status, text = server.raw("POST", path, body)
        error = json.loads(text)["error"]
        errors[name] = (status, error["type"])
        assert status == 400 and message in error["message"], (name, status, error)
        assert name not in params or error["param"] == params[name], (name, error)
    status, text = server.raw("POST", "/v1/completions", json.dumps({"model": "gpt-4", "prompt": "x"}).encode())
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    # fields jpaged does not implement pass at the values that change nothing (clients send them);
    # max_tokens null is the default (16)
    neutral = {"model": MODEL, "prompt": "x", "max_tokens": None, "temperature": 0, "presence_penalty": 0,
               "frequency_penalty": 0, "logit_bias": {}, "ignore_eos": True}
    status, text = server.raw("POST", "/v1/completions", json.dumps(neutral).encode())
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 16
    # null is a field's default, as in OpenAI's API (the openai client sends it for an explicit None)
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "seed": None, "stop": None,
             "user": None, "logprobs": None}
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, **nulls}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 3, **nulls,
                                                 "top_logprobs": None})):
        status, text = server.raw("POST", path, json.dumps(body).encode())
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, (path, text)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=None, top_p=None,
                                     n=None).usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="top_p must be in"):
        client.completions.create(model=MODEL, prompt="hi", top_p=2.0)
    thread.join()
    assert "".join(streamed) == expected.outputs[0].text  # the stream went on, untouched
    assert set(errors.values()) == {(400, "invalid_request_error")}
    server.wait_idle()
    assert_all_free(server.engine)


def test_content_parts_roles_and_unknown_endpoints(server, reference):
    """Issue 32: OpenAI's list-of-parts content (current clients send it) reads as its joined text; an
    unknown role or a non-text part is refused naming the message; any other path or method gets a
    JSON error body."""
    client = server.client()
    system, question = "Answer in one short sentence.", ["What is the capital", "of France?"]
    (expected,) = reference.chat([{"role": "system", "content": system},
                                  {"role": "user", "content": "\n".join(question)}],
                                 SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for role in ("system", "developer"):  # developer: OpenAI's newer name for system
        r = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
            {"role": role, "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": part} for part in question]}])
        assert r.choices[0].message.content == expected.outputs[0].text
    for messages, message in (
            ([{"role": "wizard", "content": "hi"}], "'messages[0].role' must be one of 'system', 'developer', "
                                                    "'user', 'assistant', got 'wizard'"),
            ([{"role": "user", "content": "hi"}, {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}],
             "'messages[1].content[0]' must be a text part {'type': 'text', 'text': str}; this model reads text only, "
             "not 'image_url'"),
            ([{"role": "user", "content": 3}], "'messages[0].content' must be a string or a non-empty list of text "
                                               "parts")):
        status, text = server.raw("POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": messages}
                                                                                ).encode())
        error = json.loads(text)["error"]
        assert status == 400 and error["message"].startswith(message), error
        assert error["param"] == "messages"
    for method, path, status, message in (
            ("POST", "/v1/embeddings", 404, "there is no endpoint /v1/embeddings: this server has POST "
                                            "/v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
                                            "GET /metrics"),
            ("GET", "/v1/completions", 405, "/v1/completions takes POST, not GET"),
            ("POST", "/v1/models", 405, "/v1/models takes GET, not POST")):
        got, text = server.raw(method, path, b'{"model": "smol", "input": "hi"}')
        assert got == status and json.loads(text) == {"error": {"message": message, "type": "invalid_request_error",
                                                                "param": None, "code": None}}, text
    with pytest.raises(openai.NotFoundError, match="there is no endpoint /v1/embeddings"):
        client.embeddings.create(model=MODEL, input="hi")
    server.wait_idle()
    assert_all_free(server.engine)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_client_that_disconnects_frees_its_blocks(server, stream):
    aborted = server.metric("jpaged_completions_finished_total", default=0.0, reason="abort")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "stream": stream,
                       "ignore_eos": True})  # minutes of decoding unless it is aborted
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    try:
        if stream:
            response = conn.getresponse()
            assert response.status == 200
            assert response.read1(1 << 16).startswith(b"data: ")  # the first event: the request is running
        else:
            deadline = time.monotonic() + 30
            while server.metric("jpaged_generation_tokens_total") == 0 or not server.engine.has_unfinished():
                assert time.monotonic() < deadline, "the request did not start"
                time.sleep(0.05)
        assert server.engine.has_unfinished()
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away
        conn.close()
    server.wait_idle(timeout=30)
    assert_all_free(server.engine)
    assert server.metric("jpaged_completions_finished_total", reason="abort") == aborted + 1


def test_limits_and_endpoints(server, make_llm):
    status, text = server.raw("POST", "/v1/completions", b'{"prompt": "' + b"x" * (1 << 20) + b'"}')
    assert status == 413 and "--max-request-bytes" in json.loads(text)["error"]["message"], text
    status, text = server.raw("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(text)["data"]] == [MODEL]
    assert server.raw("GET", "/health")[0] == 200
    for name in ("jpaged_requests", "jpaged_kv_blocks", "jpaged_prefix_cache_hit_rate", "jpaged_preemptions",
                 "jpaged_generation_tokens_total", "jpaged_inter_token_latency_seconds_count"):
        assert server.raw("GET", "/metrics")[1].decode().count(name) >= 1, name
    assert server.metric("jpaged_kv_blocks", state="free") + server.metric("jpaged_kv_blocks", state="used") == 255
    # past the bounded waiting queue: 503, and the requests admitted still finish
    small = Running(make_llm(num_blocks=64, max_num_seqs=1).engine, ServerConfig(model_name=MODEL, max_waiting=2))
    try:
        async def burst():
            client = small.async_client()
            calls = [client.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True}) for i in range(8)]
            return await asyncio.gather(*calls, return_exceptions=True)

        results = asyncio.run(burst())
        refused = [r for r in results if isinstance(r, openai.APIStatusError)]
        served = [r for r in results if not isinstance(r, Exception)]
        assert refused and all(r.status_code == 503 and "too many requests are waiting" in r.message for r in refused)
        assert served and all(len(r.choices[0].text) > 0 for r in served)
        assert len(refused) + len(served) == 8
        with pytest.raises(openai.BadRequestError, match="at most 2 prompts"):
            small.client().completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2)
        small.wait_idle()
        assert_all_free(small.engine)
    finally:
        small.stop()


def test_every_gauge_shows_before_the_first_request(make_llm):
    fresh = Running(make_llm(num_blocks=32).engine, ServerConfig(model_name=MODEL))
    try:
        assert [fresh.metric("jpaged_requests", state=s) for s in ("waiting", "running", "swapped")] == [0, 0, 0]
        assert [fresh.metric("jpaged_kv_blocks", state=s) for s in ("used", "free", "cached")] == [0, 31, 0]
    finally:
        fresh.stop()


def test_api_keys(make_llm):
    keyed = Running(make_llm(num_blocks=32).engine, ServerConfig(model_name=MODEL, api_key="s3cret"))
    try:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
                status, text = keyed.raw(method, path, b'{"prompt": "hi"}', headers)
                assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", (path, key)
        assert keyed.raw("GET", "/health")[0] == 200  # no key needed
        with pytest.raises(openai.AuthenticationError):
            keyed.client(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        r = keyed.client(api_key="s3cret").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.choices[0].finish_reason == "length"
        assert keyed.raw("GET", "/v1/models", headers={"Authorization": "bearer s3cret"})[0] == 200
    finally:
        keyed.stop()


# ---------------------------------------------------------------- the command, and SIGTERM

def test_jpaged_serve_answers_and_drains_on_sigterm(tmp_path):
    port = free_port()
    env = {**os.environ, "JPAGED_API_KEY": "k3y"}
    grace = 15
    process = subprocess.Popen([sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--port", str(port),
                                "--num-blocks", "512", "--served-model-name", MODEL, "--grace-period", str(grace),
                                "--no-warm-up"],  # (the warm-up: tests/test_warm_up.py, tests/test_cli.py)
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y", max_retries=0)
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.stderr.read()
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "jpaged serve did not come up"
                time.sleep(0.5)
        short = client.completions.create(model=MODEL, prompt="Count to fifty:", max_tokens=40, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
        endless = client.completions.create(model=MODEL, prompt="Count to a million:", max_tokens=4000,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        first, _ = next(iter(short)), next(iter(endless))
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)  # nothing new comes in; the running requests have `grace` seconds
        rest = list(short)  # finishes within the grace period
        assert first.choices and [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        cut = list(endless)  # aborted past it: a last chunk, then [DONE] (the client's iteration just ends)
        # cut short, and saying so as vLLM does: not "stop" (the model ended it) nor "length" (max_tokens did)
        assert cut[-1].choices[0].finish_reason == "abort" and time.monotonic() - started >= grace - 1
        assert len(cut) < 4000
        assert process.wait(timeout=90) == -signal.SIGTERM  # drained, then ended by the signal (uvicorn's way)
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
        log = process.stderr.read()
        assert re.search(r"^INFO: jpaged serving smol on http://127\.0\.0\.1:\d+", log, re.M), log
        assert "\nINFO: jpaged stopped: 1 request(s) past the grace period were aborted" in log, log
        assert "Traceback" not in log and "WARNING" not in log, log  # starting and stopping are no warnings
    finally:
        if process.poll() is None:
            process.kill()
