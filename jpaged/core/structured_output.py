"""Structured output: constrain what a request generates to a JSON schema, a regex, a choice of strings
or a grammar (vLLM's structured outputs), through `llguidance` (host side, no JAX).

Why llguidance: a Rust library with a small Python API and no Python dependencies, a numpy bitmask
API (one packed int32 row of ceil(vocab / 32) words per sequence: what the device sampler unpacks),
grammars compiled lazily (a schema is ready in milliseconds, so no request waits for a compile), and
JSON schema, regex and Lark grammars in one matcher; sglang-jax uses it. `xgrammar` pulls torch, which
jpaged runs without; `outlines-core` compiles regexes to token-level automata ahead, which is slow for
large schemas.

Vocabulary. A `StructuredOutputsParams` (vLLM's name and fields: exactly one of `json`, `regex`,
`choice`, `grammar`, `json_object`) becomes a grammar (`GrammarCompiler.grammar`, cached by its
text); each constrained sequence has a *matcher* (`llguidance.LLMatcher`) that has consumed the
sequence's generated tokens. Before a step samples a constrained sequence, its matcher writes the
sequence's row of the allowed-token bitmask (`fill_bitmask`); after, it consumes the token drawn. A
matcher that reached the grammar's end allows only the end-of-sequence token. Matchers are
generation state: the engine owns them (one per sequence), rebuilds them by replaying a sequence's
tokens (`GrammarCompiler.matcher(..., tokens)`), and so keeps them through preemption (the tokens are
never lost) and pause / resume.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Any, Optional, Sequence as Seq

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")
_CACHE_SIZE = 256  # compiled grammars kept (by their text)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex` (the whole output
    matches it), `choice` (the output is one of these strings), `grammar` (a Lark grammar, or GBNF as
    llama.cpp writes it), `json_object` (any JSON object). Checked on construction (the grammar
    itself when the engine compiles it, at admission)."""

    json: Optional[Any] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    json_object: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")
            object.__setattr__(self, "json", schema)
        if self.regex is not None:
            if not isinstance(self.regex, str):
                raise ValueError(f"structured_outputs.regex must be a string, got {type(self.regex).__name__}")
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"structured_outputs.regex does not compile: {e}") from None
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty Lark or GBNF grammar")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be True or False, got {self.json_object!r}")

    @property
    def key(self) -> str:
        """The constraint as text: what compiled grammars are cached by."""
        kind = next(k for k in KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        return f"{kind}:{json.dumps(value, sort_keys=True) if kind in ('json', 'choice') else value}"


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into llguidance grammars (cached by their text) and matchers, for
    one tokenizer (a HF tokenizer: `llguidance.hf.from_tokenizer`). Thread-safe."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Seq[int]):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=min(eos_token_ids) if eos_token_ids else None)
        self._lock = threading.Lock()
        self._cache: dict[str, str] = {}  # constraint text -> grammar (llguidance's serialized form)

    def _compile(self, key: str, params: StructuredOutputsParams) -> str:
        import llguidance

        if params.json is not None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(params.json)
        elif params.json_object:
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        elif params.regex is not None:
            grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
        elif params.choice is not None:
            grammar = llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in params.choice))
        else:
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                text = any_to_lark(params.grammar)  # Lark as it is; GBNF (llama.cpp's) translated
            except Exception as e:  # noqa: BLE001 - the translator's own errors: the grammar is bad
                raise ValueError(f"structured_outputs: the grammar does not compile: {e}") from None
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        ok, error = _validate(llguidance, grammar, self.tokenizer)
        if not ok:
            raise ValueError(f"structured_outputs: the {key.split(':', 1)[0]} constraint does not compile: {error}")
        return grammar

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The grammar of `params` (ValueError naming the problem when it does not compile)."""
        key = params.key
        with self._lock:
            if key not in self._cache:
                if len(self._cache) >= _CACHE_SIZE:
                    self._cache.pop(next(iter(self._cache)))  # the oldest
                self._cache[key] = self._compile(key, params)
            return self._cache[key]

    def matcher(self, params: StructuredOutputsParams, tokens: Seq[int] = ()):
        """A new matcher of `params`' grammar that has consumed `tokens` (a sequence's generated ones)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(params))
        if tokens and matcher.consume_tokens(list(tokens)) is False:
            raise ValueError(f"structured_outputs: the tokens do not follow the grammar: {matcher.get_error()}")
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return matcher

    @property
    def bitmask_words(self) -> int:
        """int32 words of a sequence's bitmask row: ceil(vocab / 32)."""
        return -(-self.vocab_size // 32)

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """An all-allowed bitmask of `rows` rows (rows without a constraint stay so)."""
        return np.full((rows, self.bitmask_words), -1, np.int32)


def fill_bitmask(matcher, bitmask: np.ndarray, row: int) -> None:
    """Writes the tokens `matcher` allows next into row `row` of `bitmask` (1 bits: allowed)."""
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)


def _validate(llguidance, grammar: str, tokenizer) -> tuple[bool, str]:
    result = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if isinstance(result, tuple):  # (ok, message) in some releases
        return bool(result[0]), str(result[1])
    return (not result, str(result or ""))  # an error message, or "" when valid
