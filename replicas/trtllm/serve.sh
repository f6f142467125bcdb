#!/usr/bin/env bash
# Launch a real trtllm-serve with KV events and iteration stats, in place of `kvlb emulate --engine trtllm`.
# Needs a GPU host with TensorRT-LLM installed (pypi.nvidia.com). Override from the environment:
#   MODEL=Qwen/Qwen3-32B-FP8 PORT=8001 ./serve.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8000}
CONFIG=${CONFIG:-$HERE/extra-llm-api-config.yaml}

exec trtllm-serve "$MODEL" \
  --host "$HOST" --port "$PORT" \
  --backend pytorch \
  --config "$CONFIG" \
  "$@"
