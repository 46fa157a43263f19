#!/usr/bin/env bash
# H200 recipe for a real Llama / Qwen3 checkpoint with trained gates: GPU kernels (Triton prefill,
# Triton split-KV decode under SGLang's decode CUDA graphs), bounded capacity with the SnapKV cap.
#   bash launch/h200_model.sh MODEL_DIR GATES [launcher args]
# MODEL_DIR: an HF model folder on the machine; GATES: a gate checkpoint trained for it
# (`python -m sglang_wgkv.training train ...`: gates.safetensors + gates.json, or the authors' .pt),
# or `fresh` (admit every token). The launcher refuses gates of another shape before loading weights.
# On a host without network, install the kit first (launch/h200.sh setup: .kit + .kit2 wheels,
# entry points registered into /tmp/site); for a config-only folder add
# `--load-format dummy --skip-tokenizer-init` (see launch/configs/).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: bash launch/h200_model.sh MODEL_DIR GATES [launcher args]}
gates=${2:?usage: bash launch/h200_model.sh MODEL_DIR GATES [launcher args]}
shift 2
[ -f /tmp/pp ] && . /tmp/pp
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
exec python3 -m sglang_wgkv.launch_server --model-path "$model" --wgkv-gates "$gates" \
    --mem-fraction-static 0.8 --kv-budget 4096 --sampling-backend pytorch \
    --cuda-graph-max-bs-decode 32 "$@"
