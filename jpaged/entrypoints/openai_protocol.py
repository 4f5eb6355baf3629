"""The OpenAI API's request and response shapes, for `jpaged serve` (no HTTP here).

Requests are checked field by field: every field of the OpenAI API that jpaged supports
(`model`, `prompt` or `messages`, `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`,
`n`, `stop`, `seed`, `logprobs` (and `top_logprobs` for chat), `stream`, `stream_options`,
`user`) and jpaged's own (`top_k`, `beam_width`, `ignore_eos`) become `SamplingParams`; any other
field, or a value jpaged refuses, raises `ApiError` with a message that says what to change, which
the server sends back as an OpenAI-style error body with the status it names.

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
from jpaged.engine import CompletionOutput, RequestOutput

COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
                     "stream", "stream_options", "user", "top_k", "beam_width", "ignore_eos"}
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
        raise ApiError(f"unsupported field(s) {', '.join(map(repr, unknown))}; this server understands "
                       f"{', '.join(sorted(allowed))}", param=unknown[0])
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
    max_tokens = data.get(name)  # null is the default too
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
    try:
        params = SamplingParams(**fields)
    except ValueError as e:
        message = str(e).replace("max_tokens", name, 1) if str(e).startswith("max_tokens") else str(e)
        raise ApiError(message, param=next((f for f in (name, *fields) if message.startswith(f)), None)) from None
    return ParsedRequest(chat=chat, prompts=prompts, params=params, stream=stream,
                         include_usage=bool(options.get("include_usage", False)), logprobs=logprobs, model=model,
                         max_tokens_given=max_tokens_given)


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
