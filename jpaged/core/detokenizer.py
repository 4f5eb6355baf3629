"""Incremental detokenization with stop strings (no JAX).

Decoding a whole output every step costs O(length) per token; instead each step decodes only a
short window (`prefix_offset:` against `prefix_offset:read_offset`), as HF's and vLLM's
streamers do, and holds back text while its last bytes form an incomplete UTF-8 character.
"""

from __future__ import annotations

from typing import Optional, Sequence as Seq

from jpaged.core.sequence import Sequence


def append_text(tokenizer, seq: Sequence) -> str:
    """Detokenizes `seq`'s newest token into `seq.text`; returns the new text (possibly '')."""
    ids = seq.output_token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=True)
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
