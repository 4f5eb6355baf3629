"""The tokenizer a GGUF file describes, built from its metadata with `tokenizers` alone: no torch.

HF transformers builds a GGUF file's tokenizer (`from_pretrained(..., gguf_file=...)`) through a GGUF
reader that imports torch. `load_tokenizer` builds the same tokenizer without it, for the byte-level
BPE vocabularies (`tokenizer.ggml.model = 'gpt2'`: SmolLM2, the default model; also Llama 3, Qwen2/3)
by mirroring HF's `integrations/gguf/gguf_tokenizer_mapping.py` (`byte_level_tokenizer`,
`GPT2Tokenizer`, `add_gguf_special_tokens`, `set_split_regex`, `get_gguf_tokenizer`):

  - the vocabulary is `tokenizer.ggml.tokens` by index, a token not spelled in GPT-2's byte alphabet
    respelled in it (its UTF-8 bytes); the merges are `tokenizer.ggml.merges`, split on their space;
  - a `BPE` model (no unknown token, no subword prefix/suffix), a `ByteLevel` pre-tokenizer (no prefix
    space) and decoder; for the `tokenizer.ggml.pre` values HF knows, the pre-tokenizer is instead the
    split regex the vocabulary was trained with, then `ByteLevel` without its own regex;
  - tokens typed CONTROL (3) in `tokenizer.ggml.token_type` are special added tokens (but for one not
    spelled in the byte alphabet: a llama.cpp mislabel, skipped), USER_DEFINED (4) ones plain added
    tokens; `<|endoftext|>`, GPT-2's default bos/eos/unk, is special too when the vocabulary has it;
  - bos/eos/unk/pad are the tokens of the `tokenizer.ggml.*_token_id`s, with `add_bos_token`,
    `add_eos_token` and `tokenizer.chat_template` as the file says.

One difference, on purpose: where the vocabulary lacks `<|endoftext|>`, HF appends it as a new token
(an id past the model's embedding); it is not added here.

Any other `tokenizer.ggml.model` (sentencepiece 'llama', 't5', ...) or a 'gpt2' file without merges is
left to HF's GGUF tokenizer, which needs torch: without torch that is a one-line ValueError naming the
key and what to install. `tests/test_tokenizer.py` checks the result against HF's own GGUF tokenizer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib

from jpaged.weights import gguf_file

_CONTROL, _USER_DEFINED = 3, 4

# HF's `GGUF_PRE_TOKENIZER_SPLITS` (transformers 5.24): `tokenizer.ggml.pre` -> the split regex. Any other
# value (GPT-2's own, 'smollm', ...) keeps `ByteLevel`'s built-in GPT-2 regex, as in HF.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN35_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"""
                 r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


def read_tokenizer_metadata(path: pathlib.Path) -> dict:
    """Every `tokenizer.*` key of a GGUF file, arrays read in full (the vocabulary and merges as lists
    of str, token types as a list of int), plus `general.architecture`; raises ValueError (or
    struct.error, UnicodeDecodeError) on a file it cannot read."""
    metadata = gguf_file.read(pathlib.Path(path), full_arrays=("tokenizer.",)).metadata
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.") or k == "general.architecture"}


def load_tokenizer(path: pathlib.Path):
    """The tokenizer `path`'s metadata describes, a `transformers.PreTrainedTokenizerFast` (see the
    module docstring); HF's GGUF tokenizer, when torch can be imported, for what is not built here."""
    path = pathlib.Path(path)
    metadata = read_tokenizer_metadata(path)
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2" and "tokenizer.ggml.merges" in metadata:
        return byte_level_bpe(metadata)
    if importlib.util.find_spec("torch") is None:
        what = f"tokenizer.ggml.model = {model!r}" + (" without tokenizer.ggml.merges" if model == "gpt2" else "")
        raise ValueError(f"{what}: jpaged builds byte-level BPE ('gpt2', with merges) tokenizers itself, and "
                         "leaves the others to HF's GGUF tokenizer, which needs torch (pip install torch)")
    import transformers

    with contextlib.redirect_stderr(io.StringIO()):  # HF prints a progress bar while it reads the file
        return transformers.PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)


def byte_level_bpe(metadata: dict):
    """The byte-level BPE tokenizer of a 'gpt2' GGUF file's `metadata` (`read_tokenizer_metadata`)."""
    import transformers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte alphabet (no torch)

    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or []
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()

    special = ["<|endoftext|>"] if "<|endoftext|>" in vocab else []  # GPT2Tokenizer's default bos/eos/unk
    special += [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
            if k == _USER_DEFINED and t in backend.get_vocab()]
    if user:
        backend.add_tokens(user)

    def token(key):
        i = metadata.get(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[i]

    config = {name: metadata[f"tokenizer.{key}"] for name, key in (
        ("chat_template", "chat_template"), ("add_bos_token", "ggml.add_bos_token"),
        ("add_eos_token", "ggml.add_eos_token")) if f"tokenizer.{key}" in metadata}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"), **config)
