"""The OpenAI API's request and response shapes, for `jpaged serve` (no HTTP here).

Requests are checked field by field: every field of the OpenAI API that jpaged supports
(`model`, `prompt` or `messages`, `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`,
`n`, `stop`, `seed`, `logprobs` (and `top_logprobs` for chat), `stream`, `stream_options`,
`user`) and jpaged's own (`top_k`, `beam_width`, `ignore_eos`) become `SamplingParams`; any other
field, or a value jpaged refuses, raises `ApiError` with a message that says what to change, which
the server sends back as an OpenAI-style error body with the status it names.

Structured output (`SamplingParams.structured_outputs`): OpenAI's `response_format` (`{"type": "text"}`:
none; `{"type": "json_object"}`: any JSON object; `{"type": "json_schema", "json_schema": {"name", "schema",
"strict", "description"}}`: the schema, enforced whatever `strict` says, as vLLM does), vLLM's
`structured_outputs` (`{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`) and its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. One constraint per request. A
constraint is checked here as far as its shape goes; whether it compiles, when the engine admits the
request (`LLMEngine.check_request`), before it is queued.

Chat messages: `content` a string or a list of text parts (`[{"type": "text", "text": ...}]`,
joined with newlines, as vLLM does); roles system, developer (sent as system), user, assistant.

Responses follow the OpenAI API: `text_completion` / `chat.completion` objects, and for
`"stream": true` the chunks of server-sent events (`*.chunk` objects, then `data: [DONE]`).
`finish_reason` is OpenAI's "stop" or "length", or as vLLM sends them "abort" (cut short at
shutdown) and "error" (a failed engine step).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Optional

from jpaged.core.sampling_params import SamplingParams
from jpaged.core.structured_output import KINDS, StructuredOutputsParams
from jpaged.engine import CompletionOutput, RequestOutput

# vLLM's older structured-output fields, and the StructuredOutputsParams field each one sets
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FIELDS = {"response_format", "structured_outputs", *GUIDED}
# vLLM's structured_outputs options that jpaged does not implement, accepted at their defaults
STRUCTURED_NEUTRAL = {"disable_fallback": (False,), "disable_any_whitespace": (False,),
                      "disable_additional_properties": (False,), "whitespace_pattern": (None,),
                      "structural_tag": (None,)}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
                     "stream", "stream_options", "user", "top_k", "beam_width", "ignore_eos", *STRUCTURED_FIELDS}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt"}) | {"messages", "max_completion_tokens", "top_logprobs"}
DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default
# the chat roles accepted, and the role the chat template sees (tools are not supported: no "tool")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# fields jpaged does not implement, accepted at the values that change nothing (clients send them)
NEUTRAL = {"presence_penalty": (0, None), "frequency_penalty": (0, None), "logit_bias": ({}, None),
           "best_of": (1, None), "echo": (False, None), "suffix": (None,), "parallel_tool_calls": (None,),
           "tools": (None, []), "tool_choice": (None, "none")}


class ApiError(Exception):
    """A request the server refuses: `status` (400, 401, 404, 413, 503...) and an OpenAI error type."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """One checked request: its prompts (text, token ids, or for chat one conversation), the
    sampling parameters, and how to answer."""

    chat: bool
    prompts: list
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool  # whether choices carry logprobs
    model: str
    max_tokens_given: bool  # False: generate to the end of the context (the chat API's default)
    constraint_field: Optional[str] = None  # the field that carried params.structured_outputs


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError("the request body nests JSON too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def parse_request(data: dict, *, chat: bool, model_name: str) -> ParsedRequest:
    """Checks a decoded request body. Raises ApiError naming the field to change."""
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(k for k in set(data) - allowed if data[k] not in NEUTRAL.get(k, ()))
    if unknown:
        neutral = [f"{k} only as {' or '.join(json.dumps(v) for v in NEUTRAL[k])}" for k in unknown if k in NEUTRAL]
        raise ApiError(f"unsupported field(s) {', '.join(map(repr, unknown))}"
                       + (f" (accepted: {'; '.join(neutral)})" if neutral else "")
                       + f"; this server understands {', '.join(sorted(allowed))}", param=unknown[0])
    data = {k: v for k, v in data.items() if v is not None}  # null is the default, as in OpenAI's API
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(f"'user' must be a string, got {user!r:.40}", param="user")
    model = data.get("model", model_name)
    if model != model_name:
        raise ApiError(f"the model {model!r} does not exist: this server serves {model_name!r}", status=404,
                       param="model", code="model_not_found")
    if chat:
        prompts = [_messages(data.get("messages"))]
    else:
        prompts = _prompts(data.get("prompt"))
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(f"'stream' must be true or false, got {stream!r}", param="stream")
    options = data.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError("'stream_options' goes with \"stream\": true", param="stream_options")
        if not (isinstance(options, dict) and set(options) <= {"include_usage"}
                and isinstance(options.get("include_usage", False), bool)):
            raise ApiError("'stream_options' may only hold 'include_usage': true or false", param="stream_options")
    options = options or {}
    name = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = data.get(name)
    if max_tokens is None and not chat:
        max_tokens = DEFAULT_MAX_TOKENS
    max_tokens_given = max_tokens is not None
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens  # set per prompt by the server
    logprobs, num_logprobs = _logprobs(data, chat)
    fields = dict(
        max_tokens=max_tokens, temperature=data.get("temperature", 1.0), top_p=data.get("top_p", 1.0),
        n=data.get("n", 1), seed=data.get("seed"), logprobs=num_logprobs, top_k=data.get("top_k", 0),
        beam_width=data.get("beam_width", 1), ignore_eos=data.get("ignore_eos", False))
    stop = data.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    constraint, constraint_field = _structured_outputs(data)
    try:
        params = SamplingParams(**fields, structured_outputs=constraint)
    except ValueError as e:
        message = str(e).replace("max_tokens", name, 1) if str(e).startswith("max_tokens") else str(e)
        raise ApiError(message, param=next((f for f in (name, *fields) if message.startswith(f)), None)) from None
    return ParsedRequest(chat=chat, prompts=prompts, params=params, stream=stream,
                         include_usage=bool(options.get("include_usage", False)), logprobs=logprobs, model=model,
                         max_tokens_given=max_tokens_given, constraint_field=constraint_field)


def constraint_error(message: str, field: Optional[str]) -> ApiError:
    """A 400 for a constraint that `StructuredOutputsParams` or the engine refused (its message starts with
    "structured_outputs"), naming the request field that carried it when that was another one."""
    if field is not None and field != "structured_outputs":
        message = f"{message} (sent as '{field}')"
    return ApiError(message, param=field)


def engine_error(message: str, chat: bool, index: int = 0, count: int = 1) -> ApiError:
    """A 400 for prompt `index` of `count` or the sampling parameters, refused by the engine (its prompt
    checks, `LLMEngine.check_request`, the context, the pool), naming the field its message starts with
    (n, beam_width, or the prompt's: then, of several prompts, which one)."""
    field = next((f for f in ("n", "beam_width") if message.startswith(f + "=")), None)
    if field is None and message.startswith(("prompt", "the prompt", "a prompt")):
        field = "messages" if chat else "prompt"
        if count > 1:
            message = f"prompt {index} of {count}: {message}"
    return ApiError(message, param=field)


def _structured_outputs(data: dict) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's output constraint, and the field that carried it (None, None without one): from
    `response_format`, `structured_outputs` or a `guided_*` field; more than one is refused."""
    found = []  # (where, field, StructuredOutputsParams field, value)
    if data.get("response_format") is not None:
        kind_value = _response_format(data["response_format"])
        if kind_value is not None:
            found.append(("response_format", "response_format", *kind_value))
    spec = data.get("structured_outputs")
    if spec is not None:
        names = ", ".join(map(repr, KINDS))
        if not isinstance(spec, dict):
            raise ApiError(f"'structured_outputs' must be an object with one of {names}, got {spec!r:.40}",
                           param="structured_outputs")
        unknown = sorted(k for k in set(spec) - set(KINDS) if spec[k] not in STRUCTURED_NEUTRAL.get(k, ()))
        if unknown:
            raise ApiError(f"unsupported 'structured_outputs' field(s) {', '.join(map(repr, unknown))}; this server "
                           f"understands {names}", param="structured_outputs")
        given = [k for k in KINDS if spec.get(k) not in (None, False)]
        if not given:
            raise ApiError(f"'structured_outputs' needs one of {names}", param="structured_outputs")
        found += [(f"structured_outputs.{k}", "structured_outputs", k, spec[k]) for k in given]
    found += [(f, f, kind, data[f]) for f, kind in GUIDED.items() if data.get(f) is not None]
    if not found:
        return None, None
    if len(found) > 1:
        raise ApiError(f"a request takes one output constraint, got {len(found)} at once: "
                       f"{', '.join(repr(where) for where, *_ in found)}; send only one", param=found[0][1])
    ((where, field, kind, value),) = found
    if kind == "choice" and not isinstance(value, list):
        raise ApiError(f"'{where}' must be a list of non-empty strings, got {value!r:.40}", param=field)
    try:
        return StructuredOutputsParams(**{kind: value}), field
    except ValueError as e:
        raise constraint_error(str(e), field) from None


def _response_format(fmt) -> Optional[tuple[str, Any]]:
    """OpenAI's `response_format` as (StructuredOutputsParams field, value); None for `{"type": "text"}`."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    keys = {k for k, v in fmt.items() if v is not None} if isinstance(fmt, dict) else set()
    if kind == "text" and keys == {"type"}:
        return None
    if kind == "json_object" and keys == {"type"}:
        return "json_object", True
    if kind == "json_schema" and keys == {"type", "json_schema"}:
        spec = fmt["json_schema"]
        where = "'response_format.json_schema'"
        if not isinstance(spec, dict):
            raise ApiError(f"{where} must be an object {{'name': str, 'schema': {{...}}, 'strict': bool}}, got "
                           f"{spec!r:.40}", param="response_format")
        unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if unknown:
            raise ApiError(f"unsupported {where} field(s) {', '.join(map(repr, unknown))}; this server understands "
                           "'name', 'schema', 'strict', 'description'", param="response_format")
        if not isinstance(spec.get("name"), str):
            raise ApiError(f"{where[:-1]}.name' must be a string (the schema's name), got {spec.get('name')!r:.40}",
                           param="response_format")
        if not isinstance(spec.get("schema"), dict):
            raise ApiError(f"{where[:-1]}.schema' must be a JSON schema (an object), got {spec.get('schema')!r:.40}",
                           param="response_format")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise ApiError(f"{where[:-1]}.strict' must be true or false, got {spec['strict']!r:.40}",
                           param="response_format")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise ApiError(f"{where[:-1]}.description' must be a string", param="response_format")
        return "json", spec["schema"]
    if kind in ("text", "json_object", "json_schema"):
        fields = "'type'" + (", 'json_schema'" if kind == "json_schema" else "")
        raise ApiError(f"'response_format' of type {kind!r} has the fields {fields} (no others), got "
                       f"{', '.join(map(repr, sorted(keys)))}", param="response_format")
    raise ApiError("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
                   f"'json_schema': {{'name': ..., 'schema': {{...}}}}}}, got {fmt!r:.60}", param="response_format")


def _messages(messages) -> list[dict]:
    """The chat API's `messages`, as {"role", "content"} dicts with text content: `content` is a string
    or a list of text parts (`[{"type": "text", "text": ...}]`, joined with newlines, as vLLM does);
    roles are OpenAI's: system, developer (OpenAI's newer name for system, sent as system), user,
    assistant."""
    if not (isinstance(messages, list) and messages):
        raise ApiError("'messages' must be a non-empty list of {'role': ..., 'content': ...}", param="messages")
    conversation = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"'{where}' must be an object {{'role': ..., 'content': ...}}, got {type(m).__name__}",
                           param="messages")
        role = m.get("role")
        if not (isinstance(role, str) and role in ROLES):
            raise ApiError(f"'{where}.role' must be one of {', '.join(map(repr, ROLES))}, got {role!r}",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list) and content:
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"'{where}.content[{j}]' must be a text part {{'type': 'text', 'text': str}}"
                                   + (f"; this model reads text only, not {kind!r}" if isinstance(kind, str) and
                                      kind != "text" else ""), param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise ApiError(f"'{where}.content' must be a string or a non-empty list of text parts "
                           f"[{{'type': 'text', 'text': str}}], got {content!r:.40}", param="messages")
        conversation.append({"role": ROLES[role], "content": content})
    return conversation


def _prompts(prompt) -> list:
    """The completions API's `prompt`: a string, a list of strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return list(prompt)
    raise ApiError("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                   param="prompt")


def _logprobs(data: dict, chat: bool) -> tuple[bool, Optional[int]]:
    """(whether to return logprobs, how many top tokens): `logprobs: int` for completions; `logprobs:
    bool` with `top_logprobs: int` for chat."""
    if not chat:
        value = data.get("logprobs")
        return value is not None, value
    wanted, top = data.get("logprobs", False), data.get("top_logprobs")
    if not isinstance(wanted, bool):
        raise ApiError(f"'logprobs' must be true or false, got {wanted!r}", param="logprobs")
    if top is not None and not wanted:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if top is not None and not (isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= 20):
        raise ApiError(f"'top_logprobs' must be an integer in [0, 20], got {top!r}", param="top_logprobs")
    return wanted, (top or 0) if wanted else None


# ---- responses ----------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def completion_logprobs(output: CompletionOutput, tokenizer, start: int = 0) -> Optional[dict]:
    """The completions API's logprobs of tokens start.. of an output (None without logprobs)."""
    if output.logprobs is None:
        return None
    tokens = output.token_ids[start:]
    entries = output.logprobs[start:len(output.token_ids)]
    strings = [tokenizer.decode([t]) for t in tokens]
    return {"tokens": strings, "token_logprobs": [top.get(t) for t, top in zip(tokens, entries)],
            "top_logprobs": [{tokenizer.decode([i]): lp for i, lp in top.items()} for top in entries],
            "text_offset": []}


def chat_logprobs(output: CompletionOutput, tokenizer, num_top: int, start: int = 0) -> Optional[dict]:
    """The chat API's logprobs (`{"content": [...]}`) of tokens start.. of an output."""
    if output.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, top in zip(output.token_ids[start:], output.logprobs[start:len(output.token_ids)]):
        best = sorted(top.items(), key=lambda kv: -kv[1])[:num_top]
        content.append({**entry(token_id, top.get(token_id)), "top_logprobs": [entry(t, lp) for t, lp in best]})
    return {"content": content}


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(output: CompletionOutput) -> Optional[str]:
    """OpenAI's finish reasons, "stop" and "length", and the engine's own two, as vLLM sends them:
    "abort" (cut short: at shutdown past the grace period) and "error" (a failed step). A cut answer
    must not look finished: "stop" would say the model ended it, "length" that max_tokens did."""
    return output.finish_reason


def response(request: ParsedRequest, request_id: str, outputs: list[RequestOutput], tokenizer) -> dict:
    """The whole (non-streamed) response to a request, from its finished outputs (one per prompt)."""
    choices, n = [], len(outputs[0].outputs)
    for p, out in enumerate(outputs):
        for c in out.outputs:
            choice: dict[str, Any] = {"index": p * n + c.index, "finish_reason": finish_reason(c)}
            if request.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
                choice["logprobs"] = (chat_logprobs(c, tokenizer, request.params.logprobs or 0)
                                      if request.logprobs else None)
            else:
                choice["text"] = c.text
                choice["logprobs"] = completion_logprobs(c, tokenizer) if request.logprobs else None
            choices.append(choice)
    return {"id": request_id, "object": "chat.completion" if request.chat else "text_completion",
            "created": int(time.time()), "model": request.model, "choices": choices, "usage": usage(outputs)}


def chunk(request: ParsedRequest, request_id: str, created: int, index: int, text: Optional[str],
          finish: Optional[str], logprobs: Optional[dict] = None, role: bool = False) -> dict:
    """One streamed chunk: `text` new since the last chunk of choice `index`."""
    if request.chat:
        delta = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": request.model, "choices": [choice]}


def sse(data) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
