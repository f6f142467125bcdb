#!/usr/bin/env bash
# Launch a real SGLang server with KV events and metrics enabled, in place of `kvlb emulate --engine sglang`.
# Needs a GPU host with `pip install "sglang[all]"` (CUDA). Override any variable from the environment:
#   MODEL=Qwen/Qwen3-32B-FP8 PORT=30001 EVENT_PORT=5567 REPLAY_PORT=5568 ./launch.sh
set -euo pipefail

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-30000}
PAGE_SIZE=${PAGE_SIZE:-16}          # the balancer's block size for this pool must equal it
DP_SIZE=${DP_SIZE:-1}               # one publisher per DP rank, on EVENT_PORT + rank
EVENT_PORT=${EVENT_PORT:-5557}
REPLAY_PORT=${REPLAY_PORT:-5558}    # with DP, ranks use REPLAY_PORT + rank: keep the two ranges apart
TOPIC=${TOPIC:-}

# "publisher": "zmq" is required: SGLang's default publisher is "null" and publishes nothing.
# "tcp://*:PORT" makes the engine bind (a host address would make it connect out instead).
KV_EVENTS_CONFIG=$(printf '{"publisher":"zmq","endpoint":"tcp://*:%s","replay_endpoint":"tcp://*:%s","topic":"%s","buffer_steps":10000,"hwm":100000}' \
  "$EVENT_PORT" "$REPLAY_PORT" "$TOPIC")

exec python -m sglang.launch_server \
  --model-path "$MODEL" \
  --host "$HOST" --port "$PORT" \
  --page-size "$PAGE_SIZE" \
  --dp-size "$DP_SIZE" \
  --enable-metrics \
  --enable-cache-report \
  --kv-events-config "$KV_EVENTS_CONFIG" \
  "$@"
