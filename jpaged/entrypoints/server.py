"""`jpaged serve`: an OpenAI-compatible HTTP server in front of one engine.

One `LLMEngine` is stepped by one background thread (`EngineLoop`); HTTP handlers (Starlette on
uvicorn, asyncio) add requests to it and read their outputs from per-request queues, so requests
from every client share the engine's continuous batching. Endpoints:

  POST /v1/completions, POST /v1/chat/completions   OpenAI's, with "stream": true as server-sent events
  GET  /v1/models                                   the one model served
  GET  /health                                      200 while serving (no key needed)
  GET  /metrics                                     Prometheus text: queues, KV blocks, prefix-cache hit
                                                    rate, preemptions, tokens, time to first token and
                                                    inter-token latency histograms, decode batch sizes,
                                                    executables compiled while serving (0 after a warm-up
                                                    that covered every shape), the start-up warm-up's
                                                    executables and time

Who may come in: the server binds 127.0.0.1 unless told otherwise; with an API key (`--api-key`
or `JPAGED_API_KEY`) every endpoint but /health needs `Authorization: Bearer KEY` (401 otherwise).
Request bodies are bounded (413), prompts by the model's context (400), and the waiting queue
(503 past it). A client that disconnects before its answer (streamed or not) aborts its request,
which frees its blocks. An engine that can step no more (`app.state.fail`: a process of a
multi-process engine went away) answers every open request with a 500 error naming why (streamed: an
error event), and every later one with a 503.
SIGTERM: the server stops listening (new connections are refused, requests on open connections
get 503), running requests get a grace period to finish, the rest are aborted (their streams end
with a last chunk, `finish_reason: "abort"` as vLLM sends it, and [DONE]), and the process ends by
that signal (uvicorn re-raises it, so the exit status says SIGTERM). Any other path or method: a
JSON error body (404, 405), as for every refused request. Start and stop are logged at INFO
(`jpaged.server`), a serving address without an API key at WARNING.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import threading
import time
from typing import Callable, Optional

from jpaged.engine import LLMEngine, RequestOutput
from jpaged.entrypoints import openai_protocol as api

logger = logging.getLogger("jpaged.server")  # `jpaged serve` shows its INFO lines

API_KEY_ENV = "JPAGED_API_KEY"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the server admits requests (see the module docstring)."""

    model_name: str = "jpaged"
    api_key: Optional[str] = None
    max_request_bytes: int = 1 << 20
    max_waiting: int = 256  # requests queued but not yet running, past which new ones get 503
    grace_period_s: float = 30.0  # after SIGTERM, how long running requests may take to finish

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a key, or none to serve without one")
        for name, flag, value, what in (
                ("max_waiting", "--max-waiting", self.max_waiting, "requests that may wait for the engine"),
                ("max_request_bytes", "--max-request-bytes", self.max_request_bytes, "the largest request body")):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"bad server limit {name}={value!r}: {flag} ({what}) must be an integer >= 1")
        g = self.grace_period_s
        if not (isinstance(g, (int, float)) and not isinstance(g, bool) and 0 <= g < float("inf")):
            raise ValueError(f"bad server limit grace_period_s={g!r}: --grace-period (seconds running requests "
                             "get to finish after SIGTERM) must be a number >= 0")


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (several servers per process in
    tests). Updated by the engine loop after every step and by the handlers as tokens arrive."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Gauge("jpaged_requests", "Requests in the engine, by state", ["state"], registry=r)
        self.blocks = Gauge("jpaged_kv_blocks", "KV blocks of the device pool, by state", ["state"], registry=r)
        self.hit_rate = Gauge("jpaged_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache",
                              registry=r)
        self.preemptions = Gauge("jpaged_preemptions", "Preemptions since the engine started", registry=r)
        self.generated = Counter("jpaged_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("jpaged_completions_finished", "Completions finished (one per choice, or per "
                                "beam-search hypothesis), by finish reason", ["reason"], registry=r)
        self.ttft = Histogram("jpaged_time_to_first_token_seconds", "Time to the first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("jpaged_inter_token_latency_seconds", "Time between a request's tokens", registry=r,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.compiles = Counter("jpaged_compiles", "Executables built while serving, after the start-up warm-up "
                                "(JAX compiles one per new batch shape; 0 when the warm-up covered every shape)",
                                registry=r)
        self.warm_up_executables = Gauge("jpaged_warm_up_executables", "Executables the start-up warm-up compiled "
                                         "or loaded from the compilation cache (0: no warm-up)", registry=r)
        self.warm_up_seconds = Gauge("jpaged_warm_up_seconds", "Time the start-up warm-up took", registry=r)
        self.compile_seconds = Counter("jpaged_compile_seconds", "Time steps spent building executables",
                                       registry=r)
        self.batch = Histogram("jpaged_decode_batch_size", "Sequences in a decode step", registry=r,
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.drafts = Gauge("jpaged_spec_decode_draft_tokens", "Speculative decoding: draft tokens since the "
                            "engine started, proposed and accepted", ["state"], registry=r)
        self.draft_position = Gauge("jpaged_spec_decode_acceptance_rate", "Speculative decoding: the rate at "
                                    "which the draft at each position is accepted", ["position"], registry=r)

    def observe_engine(self, engine: LLMEngine) -> None:
        """The queues and the pool as they stand (before the first step: every gauge shows from the start)."""
        self._queues_and_pool(engine.num_waiting(), len(engine.scheduler.running), len(engine.scheduler.swapped),
                              engine.stats())

    def observe_step(self, engine: LLMEngine, record) -> None:
        """A step observer: the queues, the pool, the decode batch."""
        self._queues_and_pool(record.num_waiting, record.num_running, record.num_swapped, record.kv.usage())
        s = engine.scheduler
        self.hit_rate.set(s.num_cached_prompt_tokens / s.num_prompt_tokens if s.num_prompt_tokens else 0.0)
        self.preemptions.set(s.num_preemptions)
        if record.kind == "decode":
            self.batch.observe(record.num_rows)
        self.compiles.inc(sum(c.compile_seconds > 0 for c in record.calls))
        self.compile_seconds.inc(record.compile_seconds)
        spec = engine.spec_counts if engine.proposer is not None else None
        if spec is not None:
            self.drafts.labels("proposed").set(spec["num_proposed"])
            self.drafts.labels("accepted").set(spec["num_accepted"])
            for j, (a, p) in enumerate(zip(spec["accepted_by_position"], spec["proposed_by_position"])):
                if p:
                    self.draft_position.labels(str(j + 1)).set(a / p)

    def _queues_and_pool(self, waiting: int, running: int, swapped: int, usage: dict) -> None:
        for state, value in (("waiting", waiting), ("running", running), ("swapped", swapped)):
            self.requests.labels(state).set(value)
        for state in ("used", "free", "cached"):
            self.blocks.labels(state).set(usage[f"num_{state}_blocks"])


class EngineLoop:
    """Steps one engine from a background thread; asyncio code adds requests and awaits outputs.

    Invariant: a request id is in `_queues` from its admission until its finished output has been
    delivered; outputs are delivered in the engine's order, each to the event loop that added it."""

    def __init__(self, engine: LLMEngine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._failure: Optional[str] = None  # why the engine can step no more (`fail`)
        self._observer = lambda record: metrics.observe_step(engine, record)
        engine.add_observer(self._observer)
        self._thread = threading.Thread(target=self._run, name="jpaged-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops stepping (idempotent): the step under way ends first."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        with contextlib.suppress(ValueError):  # the engine may outlive its server (a notebook's, a test's)
            self.engine.remove_observer(self._observer)

    def add(self, request_id: str, prompt, params) -> asyncio.Queue:
        """Queues a request (raises ValueError when the engine refuses it); returns its output queue."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._failure is not None:
                raise api.ApiError(self._failure, status=503, type="server_error")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception:
            with self._lock:
                del self._queues[request_id]
            raise
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> bool:
        """Aborts a request at the next step; False when it had finished already."""
        try:
            self.engine.abort(request_id)
        except ValueError:  # finished meanwhile
            return False
        finally:
            self._wake.set()
        return True

    def abort_all(self) -> int:
        """Aborts every request not finished; returns how many."""
        with self._lock:
            ids = list(self._queues)
        return sum(self.abort(request_id) for request_id in ids)

    def fail(self, message: str) -> int:
        """The engine can step no more (a process of a multi-process engine went away, its step stuck in
        a collective): stops stepping (without waiting for the step under way) and ends every request in
        flight with `message`, an `api.ApiError` in its queue (its handler answers with that error);
        later requests are refused with it. Returns how many requests it ended."""
        self._stopping = True
        self._wake.set()
        error = api.ApiError(message, status=500, type="server_error")
        with self._lock:
            self._failure = message
            targets, self._queues = list(self._queues.values()), {}
        for loop, queue in targets:
            loop.call_soon_threadsafe(queue.put_nowait, error)
        return len(targets)

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # noqa: BLE001 - a bug must not kill the loop that serves everyone
                time.sleep(0.1)  # and must not spin
                if self._stopping:  # the engine failed as a whole (`fail`), which says why
                    break
                logger.exception("an engine step raised")
                continue
            for out in outputs:
                if out.finished:  # counted here: an aborted request's handler is gone
                    for c in out.outputs:
                        self.metrics.finished.labels(c.finish_reason or "unknown").inc()
                with self._lock:
                    target = self._queues.pop(out.request_id, None) if out.finished else self._queues.get(
                        out.request_id)
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, out)


def build_app(engine: LLMEngine, config: ServerConfig = ServerConfig(), *,
              on_stop: Optional[Callable[[], None]] = None):
    """The ASGI application (Starlette), with its engine loop started and stopped by its lifespan;
    `on_stop()` is called once that loop has stopped (e.g. `Lockstep.stop`: the other processes end).
    `app.state.fail(message)`: the engine can step no more; every request in flight gets a 500 error
    with `message`, every later one a 503 with it (`EngineLoop.fail`)."""
    import contextlib

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    metrics = Metrics()
    metrics.observe_engine(engine)
    if engine.warm_up_summary is not None:
        metrics.warm_up_executables.set(engine.warm_up_summary.num_executables)
        metrics.warm_up_seconds.set(engine.warm_up_summary.seconds)
    loop = EngineLoop(engine, metrics)
    state = {"admitting": True, "aborted": 0, "failure": None}  # aborted: requests cut at shutdown
    tokenizer = engine.tokenizer

    def error(e: api.ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), config.api_key.encode()):
            raise api.ApiError("a valid API key is needed: send 'Authorization: Bearer <key>'", status=401,
                               type="authentication_error", code="invalid_api_key")

    async def read_body(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > config.max_request_bytes:
            raise api.ApiError(_too_large(config.max_request_bytes), status=413)
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > config.max_request_bytes:
                raise api.ApiError(_too_large(config.max_request_bytes), status=413)
        return api.parse_json(body)

    def admit(parsed: api.ParsedRequest, request_id: str) -> list[tuple[str, asyncio.Queue]]:
        """Queues one engine request per prompt; all or none."""
        if not state["admitting"]:
            raise api.ApiError(state["failure"] or "the server is shutting down", status=503, type="server_error")
        if len(parsed.prompts) > config.max_waiting:
            raise api.ApiError(f"a request may carry at most {config.max_waiting} prompts (--max-waiting), got "
                               f"{len(parsed.prompts)}: split it", param="prompt")
        if engine.num_waiting() + len(parsed.prompts) > config.max_waiting:
            raise api.ApiError(f"too many requests are waiting ({config.max_waiting}): retry later", status=503,
                               type="server_error")
        queues = []
        try:
            for i, prompt in enumerate(parsed.prompts):
                if parsed.chat:
                    prompt = engine.chat_prompt(prompt)
                text, ids = engine.tokenize(prompt)
                prompt, params = {"prompt": text, "prompt_token_ids": ids}, parsed.params  # tokenized once
                room = engine.max_model_len - len(ids)
                if room < 1:  # no max_tokens could help: the prompt itself must shrink
                    raise ValueError(f"the prompt has {len(ids)} tokens, and the model's context of "
                                     f"{engine.max_model_len} tokens leaves none to generate: shorten the prompt "
                                     f"to at most {engine.max_model_len - 1} tokens")
                if not parsed.max_tokens_given:  # to the end of the context, as the chat API does
                    params = dataclasses.replace(params, max_tokens=room)
                elif params.max_tokens > room:
                    raise ValueError(f"the prompt's {len(ids)} tokens and max_tokens={params.max_tokens} exceed the "
                                     f"model's context of {engine.max_model_len} tokens: ask for at most "
                                     f"{room} tokens")
                rid = f"{request_id}-{i}"
                queues.append((rid, loop.add(rid, prompt, params)))
        except ValueError as e:
            for rid, _ in queues:
                loop.abort(rid)
            message = str(e)
            if message.startswith("structured_outputs"):  # the constraint does not compile (engine.check_request)
                raise api.constraint_error(message, parsed.constraint_field) from None
            raise api.engine_error(message, parsed.chat, i, len(parsed.prompts)) from None  # (i: the loop's)
        return queues

    class Tracker:
        """Time to first token and inter-token latency of one engine request, into the metrics."""

        def __init__(self):
            self.start, self.last, self.tokens = time.monotonic(), None, 0

        def update(self, out: RequestOutput) -> None:
            now, tokens = time.monotonic(), sum(len(c.token_ids) for c in out.outputs)
            new = tokens - self.tokens
            if new > 0:
                if self.last is None:
                    metrics.ttft.observe(now - self.start)
                else:
                    for _ in range(new):
                        metrics.itl.observe((now - self.last) / new)
                metrics.generated.inc(new)
                self.last, self.tokens = now, tokens

    async def final_outputs(queues, trackers) -> list[RequestOutput]:
        results = []
        for (_, queue), tracker in zip(queues, trackers):
            while True:
                out = await queue.get()
                if isinstance(out, api.ApiError):  # the engine failed as a whole (EngineLoop.fail)
                    raise out
                tracker.update(out)
                if out.finished:
                    results.append(out)
                    break
        return results

    async def stream(parsed: api.ParsedRequest, request_id: str, queues, trackers):
        created = int(time.time())
        n = parsed.params.beam_width if parsed.params.use_beam_search else parsed.params.n
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        finals: list[RequestOutput] = []
        try:
            if parsed.chat:
                for p in range(len(queues)):
                    for i in range(n):
                        yield api.sse(api.chunk(parsed, request_id, created, p * n + i, None, None, role=True))
            for p, ((_, queue), tracker) in enumerate(zip(queues, trackers)):
                while True:
                    out = await queue.get()
                    if isinstance(out, api.ApiError):  # the engine failed as a whole: an error event ends it
                        yield api.sse(out.body())
                        return
                    tracker.update(out)
                    for c in out.outputs:
                        index = p * n + c.index
                        chars, tokens = sent.get(index, (0, 0))
                        if parsed.params.use_beam_search and not out.finished:
                            continue  # beams are reordered until the search ends: send the final ones
                        text, finish = c.text[chars:], api.finish_reason(c) if out.finished else None
                        if text or finish or len(c.token_ids) > tokens:
                            logprobs = None
                            if parsed.logprobs:
                                logprobs = (api.chat_logprobs(c, tokenizer, parsed.params.logprobs or 0, tokens)
                                            if parsed.chat else api.completion_logprobs(c, tokenizer, tokens))
                            yield api.sse(api.chunk(parsed, request_id, created, index, text, finish, logprobs))
                            sent[index] = (len(c.text), len(c.token_ids))
                    if out.finished:
                        finals.append(out)
                        break
            if parsed.include_usage:
                yield api.sse({"id": request_id, "object": "chat.completion.chunk" if parsed.chat else "text_completion",
                               "created": created, "model": parsed.model, "choices": [], "usage": api.usage(finals)})
            yield api.sse("[DONE]")
        finally:  # the client went away (or the stream ended): nothing of it may keep running
            for rid, _ in queues:
                loop.abort(rid)

    async def disconnected(request: Request) -> None:
        """Returns when the client closes its connection (the body has been read already)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def generate(request: Request, chat: bool):
        try:
            check_key(request)
            parsed = api.parse_request(await read_body(request), chat=chat, model_name=config.model_name)
            request_id = api.new_id(chat)
            queues = admit(parsed, request_id)
        except api.ApiError as e:
            return error(e)
        trackers = [Tracker() for _ in queues]  # every prompt's clock starts at admission
        if parsed.stream:
            return StreamingResponse(stream(parsed, request_id, queues, trackers), media_type="text/event-stream")
        outputs = asyncio.ensure_future(final_outputs(queues, trackers))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({outputs, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not outputs.done():  # the client went away (or the server is cancelling us): abort
                outputs.cancel()
                for rid, _ in queues:
                    loop.abort(rid)
        if not outputs.done() or outputs.cancelled():
            return Response(status_code=499)  # nobody reads it
        try:
            outputs = outputs.result()
        except api.ApiError as e:  # the engine failed as a whole (EngineLoop.fail)
            return error(e)
        failed = [o for o in outputs if o.error is not None]
        if failed:
            return error(api.ApiError(f"the request failed in the engine: {failed[0].error}", status=500,
                                      type="server_error"))
        return JSONResponse(api.response(parsed, request_id, outputs, tokenizer))

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def models(request: Request):
        try:
            check_key(request)
        except api.ApiError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "jpaged",
             "max_model_len": engine.max_model_len}]})

    async def health(request: Request):
        return Response(status_code=200 if state["admitting"] else 503)

    async def metrics_endpoint(request: Request):
        try:
            check_key(request)
        except api.ApiError as e:
            return error(e)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:  # uvicorn has stopped accepting and waited for open requests (its graceful timeout)
            state["admitting"] = False
            deadline = time.monotonic() + config.grace_period_s
            while engine.has_unfinished() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            state["aborted"] += loop.abort_all()
            while engine.has_unfinished() and time.monotonic() < deadline + 10:
                await asyncio.sleep(0.05)
            loop.stop()
            if on_stop is not None:
                on_stop()
            logger.info("jpaged stopped: %s", f"{state['aborted']} request(s) past the grace period were aborted"
                        if state["aborted"] else "every request finished")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    allowed = {r.path: " or ".join(sorted(r.methods - {"HEAD"})) for r in routes}
    endpoints = ", ".join(f"{methods} {path}" for path, methods in allowed.items())

    async def http_error(request: Request, exc: HTTPException):
        """An unknown path (404) or method (405) gets an OpenAI-style JSON error body, as any other error."""
        if exc.status_code == 404:
            message = f"there is no endpoint {request.url.path}: this server has {endpoints}"
        elif exc.status_code == 405:
            message = (f"{request.url.path} takes {allowed.get(request.url.path, 'another method')}, "
                       f"not {request.method}")
        else:
            message = str(exc.detail)
        return JSONResponse(api.ApiError(message, status=exc.status_code).body(), status_code=exc.status_code,
                            headers=exc.headers)

    def fail(message: str) -> int:
        state["admitting"], state["failure"] = False, message
        return loop.fail(message)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.engine, app.state.loop, app.state.metrics, app.state.admission = engine, loop, metrics, state
    app.state.fail = fail
    return app


def serve(engine: LLMEngine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, *, app=None) -> None:
    """Serves until SIGTERM or SIGINT: then admission stops, running requests have the grace period
    to finish, and the rest are aborted. `app`: `build_app(engine, config, ...)` made already."""
    import uvicorn

    app = app if app is not None else build_app(engine, config)

    state = app.state.admission

    def abort_the_rest() -> None:  # past the grace period: aborted requests end their streams properly
        state["aborted"] += app.state.loop.abort_all()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # stop admitting at once; uvicorn drains the open connections
            if state["admitting"]:
                state["admitting"] = False
                timer = threading.Timer(config.grace_period_s, abort_the_rest)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                logger.info("jpaged serving %s on http://%s:%d (OpenAI API under /v1)", config.model_name,
                            host, port)

    # uvicorn cancels the handlers still running past its own timeout: give the aborted ones time to end
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=int(config.grace_period_s) + 10))
    if config.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who can reach it may use it (--api-key)", host)
    server.run()


def _too_large(limit: int) -> str:
    return (f"the request body is over {limit} bytes: send a smaller request, or start the server with a larger "
            "--max-request-bytes")


def api_key_from(arg: Optional[str]) -> Optional[str]:
    """`--api-key`, else the environment's JPAGED_API_KEY, else None (no key needed)."""
    return arg if arg is not None else os.environ.get(API_KEY_ENV) or None
