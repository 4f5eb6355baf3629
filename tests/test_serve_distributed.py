"""`jpaged serve` over two processes (`--coordinator-address ... --num-processes 2 --process-id I`,
`jpaged.engine.lockstep`): process 0 serves HTTP and hands every step's new requests and aborts to
process 1; both run one engine, data parallel 2 x tensor parallel 3 over their 2 x 3 forced CPU devices.

Held to: the official `openai` client gets, for completions and chat, streamed and not, several at
once (one of them cut mid-stream), exactly the text and token counts of the one-process engine; a
process that goes away ends the other within seconds with one `error: ...` line naming it, process 0
first answering its clients with the error (streamed: an error event; else a 500). The servers run as
`python -m jpaged.entrypoints.cli serve` in processes of their own (forced devices act only before JAX
starts), with output to files and killed past a deadline; the compilation cache is the suite's.
The link between the processes (`distributed.Link`) and the step handoff (`Lockstep`) are also
tested alone, in this process: messages in order, an orderly end, a peer gone or silent.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import openai
import pytest

from jpaged import SamplingParams
from jpaged.device.distributed import Link, LinkLost
from jpaged.engine.lockstep import Abort, AddRequest, Lockstep
from workers import REPO_ROOT, worker_env

MODEL = "smol"
START_TIMEOUT = 300  # loading, joining; the first requests compile (from the cache after one run)
EXIT_WITHIN = 30  # seconds a process may take to end once the other went away (measured: well under 1)
ENGINE_FLAGS = ["--num-blocks", "128", "--max-num-seqs", "8", "--data-parallel-size", "2", "--tensor-parallel-size",
                "3", "--served-model-name", MODEL]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compile_cache() -> str:
    """The suite's compilation cache (tests/workers.py) as `--compile-cache`."""
    setting = os.environ.get("JPAGED_JAX_CACHE", "")
    return "none" if setting == "0" else setting or str(REPO_ROOT / ".jax_cache")


class Pair:
    """`jpaged serve` as process 0 (HTTP on a free port) and process 1 of 2, started at once."""

    def __init__(self):
        self.port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
        self.logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
        argv = [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--port", str(self.port), *ENGINE_FLAGS,
                "--compile-cache", compile_cache(), "--coordinator-address", coordinator, "--num-processes", "2",
                "--join-timeout", "120"]
        self.procs = [subprocess.Popen([*argv, "--process-id", str(i)], stdout=log, stderr=subprocess.STDOUT, text=True,
                                       env=worker_env(3), cwd=REPO_ROOT) for i, log in enumerate(self.logs)]
        deadline = time.monotonic() + START_TIMEOUT
        while not self.healthy():
            for i, proc in enumerate(self.procs):
                assert proc.poll() is None, f"process {i} ended ({proc.returncode}):\n{self.log(i)[-4000:]}"
            assert time.monotonic() < deadline, f"not serving after {START_TIMEOUT} s:\n{self.log(0)[-4000:]}"
            time.sleep(0.25)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def healthy(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def metric(self, name: str, **labels) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/metrics")
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "") + " "
        lines = [line for line in conn.getresponse().read().decode().splitlines() if line.startswith(want)]
        return float(lines[0].split()[-1]) if lines else 0.0

    def log(self, i: int) -> str:
        self.logs[i].seek(0)
        return self.logs[i].read()

    def kill(self, i: int) -> float:
        """SIGKILLs process `i`; returns the time it was killed."""
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=30)
        return time.monotonic()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def streamed_text(stream, chat: bool) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return "".join(c.choices[0].text for c in stream)


# the requests: (chat, stream, prompt or messages, extra sampling) — greedy unless a seed says otherwise
REQUESTS = [
    (False, False, "The capital of France is", {}),
    (False, True, "1, 2, 3, 4,", {}),
    (True, False, [{"role": "user", "content": "Name a colour."}], {}),
    (True, True, [{"role": "user", "content": "What is the capital of France?"}], {}),
    (False, False, "Once upon a time, in a small village,", {"n": 2, "temperature": 0.8, "seed": 7}),
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def expected(llm):
    """Each request's texts and token counts on the one-process, one-device engine."""
    engine, results = llm.engine, []
    for chat, _, prompt, extra in REQUESTS:
        prompt = engine.chat_prompt(prompt) if chat else prompt
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                **{"temperature": 0.0, **extra})
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        results.append([(o.text, len(o.token_ids)) for o in out.outputs])
    return results


@pytest.fixture(scope="module")
def pair(expected):  # the references first: no engine of this process computes beside the servers
    running = Pair()
    yield running
    running.close()


def ask(client, chat: bool, stream: bool, prompt, extra: dict) -> list[tuple[str, int | None]]:
    """One request's choices as (text, completion tokens; None when streamed)."""
    kwargs = dict(model=MODEL, max_tokens=MAX_TOKENS, stream=stream, extra_body={"ignore_eos": True},
                  **{"temperature": 0.0, **extra})
    if chat:
        r = client.chat.completions.create(messages=prompt, **kwargs)
    else:
        r = client.completions.create(prompt=prompt, **kwargs)
    if stream:
        return [(streamed_text(r, chat), None)]
    choices = sorted(r.choices, key=lambda c: c.index)
    texts = [c.message.content if chat else c.text for c in choices]
    assert r.usage.completion_tokens == MAX_TOKENS * len(choices)
    return [(t, MAX_TOKENS) for t in texts]


def cut_mid_stream(client) -> int:
    """Streams a long completion, closes it after 2 chunks (the server aborts it); returns chunks read."""
    stream = client.completions.create(model=MODEL, prompt="Tell me a very long story.", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    read = 0
    for _ in stream:
        read += 1
        if read == 2:
            break
    stream.close()
    return read


def test_two_processes_serve_the_one_process_tokens_to_concurrent_clients(pair, expected):
    aborted = pair.metric("jpaged_completions_finished_total", reason="abort")
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS) + 1) as pool:
        cut = pool.submit(cut_mid_stream, pair.client)
        futures = [pool.submit(ask, pair.client, *request) for request in REQUESTS]
        got = [f.result() for f in futures]
        assert cut.result() == 2
    for (chat, stream, prompt, _), have, want in zip(REQUESTS, got, expected):
        assert [t for t, _ in have] == [t for t, _ in want], (chat, stream, prompt)
        assert all(n is None or n == m for (_, n), (_, m) in zip(have, want))
    deadline = time.monotonic() + 60
    while pair.metric("jpaged_completions_finished_total", reason="abort") < aborted + 1:
        assert time.monotonic() < deadline, "the request cut mid-stream was not aborted"
        time.sleep(0.1)
    # after the abort, both processes still step alike: a request again gives the one-process tokens
    assert ask(pair.client, *REQUESTS[0]) == expected[0]
    assert all(proc.poll() is None for proc in pair.procs)
    assert "process 1 of 2 follows process 0" in pair.log(1) and "jpaged serving" not in pair.log(1)


def in_flight(pair: Pair):
    """A streamed and a plain request, both decoding (the stream has sent its first chunks)."""
    pool = concurrent.futures.ThreadPoolExecutor(2)
    long = dict(model=MODEL, prompt="Tell me a very long story.", max_tokens=400, temperature=0,
                extra_body={"ignore_eos": True})
    plain = pool.submit(pair.client.completions.create, **long)
    stream = pair.client.completions.create(stream=True, **long)
    chunks = iter(stream)
    next(chunks), next(chunks)
    deadline = time.monotonic() + 60
    while pair.metric("jpaged_requests", state="running") < 2:
        assert time.monotonic() < deadline, "the plain request did not start"
        time.sleep(0.1)
    return pool, plain, chunks


def test_killing_process_1_ends_process_0_which_answers_its_clients_with_the_error(pair):
    pool, plain, chunks = in_flight(pair)
    killed = pair.kill(1)
    with pytest.raises(openai.APIError, match="process 1 of 2 went away"):
        for _ in chunks:
            pass
    with pytest.raises(openai.InternalServerError, match="process 1 of 2 went away"):
        plain.result(timeout=EXIT_WITHIN)
    pool.shutdown()
    assert pair.procs[0].wait(timeout=EXIT_WITHIN) == 1
    took = time.monotonic() - killed
    lines = error_lines(pair.log(0))
    assert len(lines) == 1 and lines[0].startswith("error: process 1 of 2 went away (its connection closed"), lines
    assert "process 0 stops serving too" in lines[0]
    print(f"process 0 ended {took:.2f} s after process 1 was killed")


def test_killing_process_0_ends_process_1():
    running = Pair()
    try:
        pool, plain, chunks = in_flight(running)
        killed = running.kill(0)
        with pytest.raises(openai.APIConnectionError):
            plain.result(timeout=EXIT_WITHIN)
        pool.shutdown()
        assert running.procs[1].wait(timeout=EXIT_WITHIN) == 1
        took = time.monotonic() - killed
        lines = error_lines(running.log(1))
        assert lines == ["error: process 0 of 2 went away (its connection closed: killed or crashed?): process 1 "
                         "stops too"], running.log(1)[-2000:]
        print(f"process 1 ended {took:.2f} s after process 0 was killed")
    finally:
        running.close()


# ---------------------------------------------------------------- the link and the handoff alone


def link_pair(**kwargs):
    """Process 0's and process 1's ends of a `Link` over loopback TCP, and what each was told was lost."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        one = socket.create_connection(listener.getsockname())
        zero, _ = listener.accept()
    lost: dict[int, list[str]] = {0: [], 1: []}
    ends = [Link({1: zero}, process_id=0, num_processes=2, heartbeat_s=0.05, on_lost=lost[0].append, **kwargs),
            Link({0: one}, process_id=1, num_processes=2, heartbeat_s=0.05, on_lost=lost[1].append, **kwargs)]
    return ends, (zero, one), lost


def test_a_link_hands_messages_over_in_order_and_ends_in_order():
    (zero, one), _, lost = link_pair(timeout_s=5)
    for i in range(3):
        zero.send([i, "x" * 100_000 * i])
    assert [one.receive()[0] for _ in range(3)] == [0, 1, 2]
    zero.close()
    assert one.receive() is None and one.receive() is None  # process 0 stopped
    one.close()
    time.sleep(0.3)  # heartbeats would have failed by now
    assert lost == {0: [], 1: []} and zero.lost is None and one.lost is None


def test_a_process_that_goes_away_is_noticed_at_once_on_the_other_side():
    (zero, one), (_, one_socket), lost = link_pair(timeout_s=30)
    start = time.monotonic()
    one_socket.shutdown(socket.SHUT_RDWR)  # as a killed process's system closes its sockets
    assert zero.wait_lost(5) and time.monotonic() - start < 1
    assert lost[0] == ["process 1 of 2 went away (its connection closed: killed or crashed?)"]
    with pytest.raises(LinkLost, match="process 1 of 2 went away"):
        zero.send("more")
    assert one.wait_lost(5)
    with pytest.raises(LinkLost):
        one.receive()


def test_a_silent_process_is_given_up_after_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        silent = socket.create_connection(listener.getsockname())  # connected, never sends a heartbeat
        conn, _ = listener.accept()
    lost = []
    link = Link({1: conn}, process_id=0, num_processes=2, heartbeat_s=0.05, timeout_s=0.5, on_lost=lost.append)
    try:
        assert link.wait_lost(10)
        assert lost == ["process 1 of 2 sent nothing for 0.5 s, not even its heartbeat (hung, or its machine "
                        "unreachable)"]
    finally:
        silent.close()
        link.close()


class Recorder:
    """A link that keeps what process 0 sends."""

    lost = None

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def wait_lost(self, timeout):
        return False


def test_lockstep_hands_over_each_steps_requests_with_their_seeds_and_aborts(llm):
    link = Recorder()
    lockstep = Lockstep(llm.engine, link)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    lockstep.add_request("a", "The capital of France is", greedy)
    lockstep.add_request("b", [1, 2, 3], SamplingParams(temperature=0.8, max_tokens=3))  # no seed: drawn here
    with pytest.raises(ValueError, match="already in use"):
        lockstep.add_request("a", "again", greedy)
    with pytest.raises(ValueError, match="prompt is empty"):
        lockstep.add_request("c", "  ", greedy)
    lockstep.abort("b")
    assert lockstep.has_unfinished() and lockstep.num_waiting() == 2
    outputs = {}
    while lockstep.has_unfinished():
        outputs.update((out.request_id, out) for out in lockstep.step() if out.finished)
    (step, *rest) = link.sent
    rng = np.random.default_rng(llm.engine.config.seed)  # the seeds a one-process engine draws, in order
    seeds = [int(rng.integers(2**32)) for _ in range(2)]
    ids = llm.engine.tokenize("The capital of France is")[1]
    assert step == [AddRequest("a", "The capital of France is", tuple(ids), dataclasses.replace(greedy, seed=seeds[0]),
                               step[0].arrival_time),
                    AddRequest("b", None, (1, 2, 3), SamplingParams(temperature=0.8, max_tokens=3, seed=seeds[1]),
                               step[1].arrival_time), Abort("b")]
    assert rest == [[]] * len(rest)  # nothing new in the later steps
    (alone,) = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    assert outputs["a"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outputs["b"].outputs[0].finish_reason == "abort"
    with pytest.raises(ValueError, match="no request 'a' in flight"):
        lockstep.abort("a")
