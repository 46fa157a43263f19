#!/usr/bin/env bash
# WORKERS SGLang servers (WG-KV by default) behind SGLang's router, cache-aware policy, started through
# `python -m sglang_wgkv.launch_router` (refuses workers that are no SGLang server or disagree). The
# router listens on ROUTER_PORT, worker i on ROUTER_PORT+1+i (127.0.0.1); arguments go to every server.
#   bash launch/router.sh --kv-budget 4096                   # two WG-KV servers of the README command
#   GPUS="0 1" bash launch/router.sh --model-path M          # one server per GPU
#   GPUS="0 0" bash launch/router.sh --model-path M --mem-fraction-static F --max-total-tokens T
#                                                             # two on one GPU (docs/scale-out.md)
# Environment: WORKERS (default: the number of GPUS entries, else 2), GPUS (worker i's
# CUDA_VISIBLE_DEVICES; a GPU listed twice starts its servers one after the other, each measuring the
# memory the one before left), ROUTER_PORT (30000), HOST (0.0.0.0), POLICY (cache_aware),
# ROUTER_ARGS (more router flags), SERVER=upstream (`sglang.launch_server`, no plugin), PYTHON (.venv's,
# after scripts/setup.sh), LOG_DIR (/tmp/wgkv-router). Ctrl-C stops the router and every worker.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    bash scripts/setup.sh
    PYTHON=.venv/bin/python
fi
read -r -a gpus <<< "${GPUS:-}"
WORKERS=${WORKERS:-$(( ${#gpus[@]} > 0 ? ${#gpus[@]} : 2 ))}
ROUTER_PORT=${ROUTER_PORT:-30000}
LOG_DIR=${LOG_DIR:-/tmp/wgkv-router}
mkdir -p "$LOG_DIR"
if [ "${SERVER:-wgkv}" = upstream ]; then
    launcher=(-m sglang.launch_server) plugins=none
else
    launcher=(-m sglang_wgkv.launch_server) plugins=${SGLANG_PLUGINS:-}
fi

pids=()
stop_workers() {  # each worker runs in its own session: its scheduler and detokenizer go with it
    for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap stop_workers EXIT
trap 'exit 130' INT TERM

wait_healthy() {  # $1: worker URL, $2: its pid
    until "$PYTHON" -c "import requests, sys; sys.exit(requests.get('$1/health', timeout=10).status_code != 200)" 2>/dev/null; do
        kill -0 "$2" 2>/dev/null || { echo "worker $1 exited; see $LOG_DIR" >&2; exit 1; }
        sleep 5
    done
}

urls=()
for ((i = 0; i < WORKERS; i++)); do
    port=$((ROUTER_PORT + 1 + i)) url=http://127.0.0.1:$((ROUTER_PORT + 1 + i))
    gpu=${gpus[i]:-}
    env ${gpu:+CUDA_VISIBLE_DEVICES=$gpu} ${plugins:+SGLANG_PLUGINS=$plugins} \
        setsid "$PYTHON" "${launcher[@]}" --host 127.0.0.1 --port "$port" "$@" > "$LOG_DIR/worker$i.log" 2>&1 &
    pids+=($!) urls+=("$url")
    # a GPU shared with a later worker: that one starts once this one holds its memory
    if [ -n "$gpu" ] && [[ " ${gpus[*]:i+1} " == *" $gpu "* ]]; then wait_healthy "$url" "${pids[-1]}"; fi
    echo "worker $i: $url (log $LOG_DIR/worker$i.log)"
done
# (sglang_wgkv.launch_router waits for every worker, up to the router's --worker-startup-timeout-secs)
# shellcheck disable=SC2086
"$PYTHON" -m sglang_wgkv.launch_router --host "${HOST:-0.0.0.0}" --port "$ROUTER_PORT" \
    --policy "${POLICY:-cache_aware}" --worker-urls "${urls[@]}" ${ROUTER_ARGS:-}
