#!/usr/bin/env bash
# Idempotent build of the llama.cpp peer (benchmark-only: never a dependency of jpaged).
#   1. the llama-cpp-python sdist (pinned below) from PyPI; its vendor/llama.cpp is the source;
#   2. cmake Release build of `llama-server` and `llama-quantize` only, native CPU flags
#      (GGML_NATIVE: -march=native), no network code (no OpenSSL/CURL, no prebuilt web UI);
#   3. the one package llama.cpp's GGUF converter needs that the jpaged venv lacks (sentencepiece,
#      which it imports before falling back to tokenizer.json) into pylib/, for PYTHONPATH;
#   4. `llama-server --version`, the ggml cmake options and the ISA macros of -march=native (the
#      CPU features ggml's kernels are compiled for) saved as build_info.txt, for the benchmarks' JSON.
# The cache folder (default ~/.cache/jpaged/llama.cpp-<version>, outside git) holds the sources
# (src/), the build (build/bin/llama-server, build/bin/llama-quantize), pylib/ and build_info.txt;
# the GGUF converter is src/convert_hf_to_gguf.py (bench/peers/make_gguf.py runs it).
# Re-running skips every step already done; the last line printed is the cache folder.
# LLAMA_CPP_ISA=avx2: built for AVX2 alone instead of -march=native (GGML_NATIVE off; AVX, AVX2, FMA, F16C
# and BMI2 on, every AVX-512 option off), in its own cache folder (llama.cpp-<version>-avx2): the peer of
# jpaged's AVX2 code paths on a CPU that has more (bench/latency.py --isa avx2).
# Usage: bash bench/peers/build_llama_cpp.sh            LLAMA_CPP_ISA=avx2 bash bench/peers/build_llama_cpp.sh
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ISA="${LLAMA_CPP_ISA:-native}"
case "$ISA" in
  native) ISA_FLAGS=(-DGGML_NATIVE=ON); SUFFIX="" ;;
  avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX512=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                   -DGGML_AVX_VNNI=OFF); SUFFIX="-avx2" ;;
  *) echo "[build_llama_cpp] LLAMA_CPP_ISA must be native or avx2, not '$ISA'" >&2; exit 2 ;;
esac
CACHE="${LLAMA_CPP_DIR:-$HOME/.cache/jpaged/llama.cpp-$VERSION$SUFFIX}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${JPAGED_PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$CACHE"

if [ ! -f "$CACHE/src/CMakeLists.txt" ]; then
  echo "[build_llama_cpp] downloading the llama-cpp-python==$VERSION sdist" >&2
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$TMP"
  tar xzf "$TMP"/llama_cpp_python-"$VERSION".tar.gz -C "$TMP"
  rm -rf "$CACHE/src"
  mv "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$CACHE/src"
fi

BIN="$CACHE/build/bin"
if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-quantize" ]; then
  echo "[build_llama_cpp] building llama-server and llama-quantize with $JOBS jobs (minutes)" >&2
  GEN=()
  command -v ninja >/dev/null && GEN=(-G Ninja)
  cmake -S "$CACHE/src" -B "$CACHE/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    "${ISA_FLAGS[@]}" -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
  cmake --build "$CACHE/build" --config Release -j "$JOBS" --target llama-server llama-quantize >&2
fi

if [ ! -d "$CACHE/pylib/sentencepiece" ]; then
  echo "[build_llama_cpp] installing the converter's sentencepiece into $CACHE/pylib" >&2
  "$PY" -m pip install -q --no-deps --target "$CACHE/pylib" "sentencepiece>=0.1.98,<0.3.0" >&2
fi

if [ ! -s "$CACHE/build_info.txt" ]; then
  # ggml's CPU backend takes its ISA from the compiler's -march=native macros (its system_info line,
  # logged only at trace verbosity with a model loaded, names the same ones)
  { echo "source: vendor/llama.cpp of the llama-cpp-python==$VERSION sdist (PyPI), ISA: $ISA"
    "$BIN/llama-server" --version 2>&1
    OPTIONS='NATIVE|OPENMP|LLAMAFILE|CPU_REPACK'
    [ "$ISA" = native ] || OPTIONS="$OPTIONS|AVX[A-Z0-9_]*|FMA|F16C|BMI2"  # -march=native ignores these
    echo "cmake: $(grep -E "^GGML_($OPTIONS):" "$CACHE/build/CMakeCache.txt" | tr '\n' ' ')"
    if [ "$ISA" = native ]; then
      echo "-march=native ISA macros: $(c++ -march=native -dM -E -x c++ /dev/null \
        | grep -oE '__(AVX[A-Z0-9_]*|FMA|F16C|AMX_[A-Z0-9]*)__' | sort -u | tr '\n' ' ')"
    fi
  } > "$CACHE/build_info.txt"
  cat "$CACHE/build_info.txt" >&2
fi
echo "$CACHE"
