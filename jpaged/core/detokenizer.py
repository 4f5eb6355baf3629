"""Incremental detokenization with stop strings (no JAX).

Decoding a whole output every step costs O(length) per token; instead each step decodes only a
short window (`prefix_offset:` against `prefix_offset:read_offset`), as HF's and vLLM's
streamers do, and holds back text while its last bytes form an incomplete UTF-8 character.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence as Seq

from jpaged.core.sequence import Sequence

Decode = Callable[[Seq[int]], str]


def decoder(tokenizer) -> Decode:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=True)`, two windows of it a token: a fast HF
    tokenizer that cleans up no spaces decodes in its Rust backend directly (what its `decode` does,
    without ~6 us of Python a call); any other tokenizer through its `decode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and backend is not None and not tokenizer.clean_up_tokenization_spaces:
        return functools.partial(backend.decode, skip_special_tokens=True)  # (no Python frame a call)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def append_text(decode: Decode, seq: Sequence) -> str:
    """Detokenizes `seq`'s newest token into `seq.text` (`decode`: a `decoder`); returns the new text
    (possibly '')."""
    ids = seq.output_token_ids
    prefix = decode(ids[seq.prefix_offset:seq.read_offset]) if seq.read_offset > seq.prefix_offset else ""
    full = decode(ids[seq.prefix_offset:])
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        new_text = full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.text += new_text
        return new_text
    return ""


def find_stop(text: str, stops: Seq[str], new_chars: int) -> Optional[int]:
    """Index where the earliest stop string starts in `text`, searching only where the last
    `new_chars` characters could complete one; None when there is none."""
    if not stops:
        return None
    start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stream_safe_length(text: str, stops: Seq[str]) -> int:
    """Length of the prefix of `text` that can be streamed: a suffix that could still grow into a
    stop string is held back, so nothing streamed is ever retracted."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return len(text) - held
