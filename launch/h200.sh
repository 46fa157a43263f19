#!/usr/bin/env bash
# The WG-KV SGLang server on an H200 without network, with ../shared/device-kit and the embedded
# model (SmolLM2-135M-Instruct GGUF, real weights), one verb per step (docs/offline-h200.md):
#   setup (with .kit, first) | kit3 (with .kit3) | kit2 (with .kit2) | part (with one .model/*.gguf.pN piece) |
#   router-kit (with .router: SGLang's router, which the kit lacks)
#   serve-bench | serve-soak | serve-eval | memory | programs | logprob-floor | gpu-tests | train-speed |
#   train-sweep | train-eval   [their args]   (in the step that brings the last model piece, or later)
# Each verb's one-line comment below says what it runs and where its results go ($OUT). The folders
# moved in, the order of the steps and how long they take: launch/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
M=/tmp/m
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in serve-bench|serve-eval|serve-soak|programs|gpu-tests|logprob-floor|memory|train-speed|train-sweep|train-eval)
    [ -f /tmp/pp ] || { echo "no /tmp/pp: this machine is fresh; run '$0 setup' (with .kit moved in) on it first" >&2; exit 3; } ;;
esac
case "${1:-}" in
setup)
    bash .kit/install.sh | tail -1 > /tmp/pp
    python3 launch/register_entry_points.py /tmp/site
    mkdir -p "$M" && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader ;;
part)  # mkdir: `served_speed.sh setup` makes no $M
    mkdir -p "$M" && cp .model/$GGUF.p? "$M"/ ;;
kit3)  # transformers: the tree and .kit together leave it no room in setup's step
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .kit3/*.whl
    (. /tmp/pp; python3 -c "import transformers; print('transformers', transformers.__version__)") ;;
kit2)
    bash .kit/install.sh .kit2 >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .kit2/*.whl
    touch /tmp/sglang-wheel-installed ;;
router-kit)  # sglang-router into the kit's site: launch_router, benchmarks/router_speed.py
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .router/*.whl
    (. /tmp/pp; python3 -c "import sglang_router, sys; print('sglang_router', sglang_router.__file__)") ;;
serve-bench|serve-eval|serve-soak|programs|gpu-tests|logprob-floor|memory|train-speed|train-sweep|train-eval)
    mode=$1; shift
    . launch/device_common.sh
    # KEEP_SERVERS=1 (served_speed.sh beside-warm) keeps the warm-up server started beside this step
    [ "${KEEP_SERVERS:-0}" = 1 ] || stop_leftover_servers
    cp .model/$GGUF.p? "$M"/ 2>/dev/null || true
    if [ -d .kit2 ] && [ ! -e /tmp/sglang-wheel-installed ]; then bash "$0" kit2; fi
    [ -f "$M"/$GGUF ] || cat "$M"/$GGUF.p? > "$M"/$GGUF
    (cd "$M" && echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c -)
    . /tmp/pp
    export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1 SGLANG_WGKV_GGUF="$M/$GGUF" SGLANG_WGKV_CACHE=/tmp/wgkv-cache
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    triton_cache_restore
    fi_cache_restore
    trap 'triton_cache_save "$OUT"' EXIT  # every mode's exit, exec'd ones aside
    python3 -m sglang_wgkv.embedded_model
    if [ "$mode" = gpu-tests ]; then
        # pytest [args] on this machine (default: every gpu-marked test), JUnit XML and log to $OUT
        python3 -m pytest --version >/dev/null 2>&1 || { echo "pytest is not installed here"; exit 2; }
        # shellcheck disable=SC2086
        python3 -m pytest -q -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" ${*:--m gpu tests} 2>&1 | tee "$OUT/gpu_tests.log"
        exit "${PIPESTATUS[0]}"
    fi
    if [ "$mode" = logprob-floor ]; then
        # issue 15: the bf16 paths' greedy logprobs against float32 (benchmarks/logprob_floor.py)
        python3 -m benchmarks.logprob_floor --out "$OUT" "$@"; exit $?
    fi
    if [ "$mode" = programs ]; then
        export WGKV_TEST_STARTUP_TIMEOUT=900
        exec python3 -m benchmarks.constrained_programs --servers "${SERVERS:-wgkv,disable-wgkv}" --log-dir "$OUT" \
            --server-args "--mem-fraction-static 0.5 $*" --baseline-args "--attention-backend flashinfer" \
            --out "$OUT/h200_programs.json"
    fi
    # WARM_FI=1: a dense FlashInfer server of the embedded model on CPUs 0-7 compiles
    # FlashInfer's kernels beside this step's own work, for later `memory`/`programs`/`serve-eval` steps
    # on the same machine; it is stopped once healthy and the cache comes back as $OUT/fi_cache.tgz
    # --mem-fraction-static counts the whole GPU, other processes' memory included: beside the step's own
    # server (0.5) the warm-up server takes 0.75 and starts once that server is up
    warm=""
    warm_start() {
        [ "${WARM_FI:-0}" = 1 ] || return 0
        pin=""; command -v taskset >/dev/null && pin="taskset -c 0-7"
        $pin setsid python3 -m sglang_wgkv.launch_server --port 30001 --disable-wgkv --attention-backend flashinfer \
            --mem-fraction-static "$1" > "$OUT/warm_fi.log" 2>&1 &
        warm=$!
    }
    warm_finish() {
        [ -n "$warm" ] || return 0
        for _ in $(seq 1 150); do
            python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30001/health_generate', timeout=30)" \
                2>/dev/null && { echo "FlashInfer warm-up server healthy"; break; }
            kill -0 "$warm" 2>/dev/null || { echo "warm-up server died"; tail -30 "$OUT/warm_fi.log"; break; }
            sleep 2
        done
        kill -- -"$warm" 2>/dev/null || true
        if [ -d ~/.cache/flashinfer ]; then tar czf "$OUT/fi_cache.tgz" -C ~/.cache flashinfer; fi
    }
    if [ "$mode" = train-speed ]; then
        # issue 16: benchmarks/train_speed.py [args] (random SmolLM2-shaped weights) on CPUs 8-15
        warm_start 0.15
        pin=""; command -v taskset >/dev/null && pin="taskset -c 8-15"
        $pin timeout "${TRAIN_SPEED_S:-420}" python3 -m benchmarks.train_speed --out "$OUT/train_speed_h200.json" "$@" \
            > "$OUT/train_speed.log" 2>&1 || echo "train_speed rc=$?" >> "$OUT/train_speed.log"
        tail -12 "$OUT/train_speed.log"
        warm_finish
        exit 0
    fi
    if [ "$mode" = train-sweep ]; then
        [ -d /tmp/corpus ] || cp -r .cache/corpus /tmp/corpus || { echo "no .cache/corpus: move it in with this step"; exit 2; }
        lams=${LAMS:-0.01,0.03,0.1,0.3} steps=${STEPS:-2000}
        timeout "${TRAIN_S:-520}" python3 -m sglang_wgkv.training train --model "$M/$GGUF" --corpus /tmp/corpus \
            --out /tmp/sweep --lams "$lams" --steps "$steps" --seq-len 4096 --backend "${BACKEND:-flex}" \
            --val-every 500 --val-rows 4 --ckpt-every 100 --log-every 20 --model-id SmolLM2-135M-Instruct "$@" \
            2>&1 | tr '\r' '\n' | grep -v '^gates: ' > "$OUT/train.log" || true
        cp /tmp/sweep/log.jsonl "$OUT/" 2>/dev/null || true
        done_steps=$(python3 -c "import torch; print(torch.load('/tmp/sweep/trainer_state.pt', weights_only=True)['step'])" 2>/dev/null || echo 0)
        echo "trained $done_steps of $steps steps"
        if [ "$done_steps" = "$steps" ]; then
            meta=$(mktemp -d)
            for d in /tmp/sweep/lam*; do
                cp "$d/gates.safetensors" "$OUT/$(basename "$d").safetensors"; cp "$d/gates.json" "$meta/$(basename "$d").json"
            done
            cp /tmp/sweep/log.jsonl "$OUT/train.log" "$meta/"; tar czf "$OUT/sweep_meta.tgz" -C "$meta" .
        fi
        tail -5 "$OUT/train.log"
        exit 0
    fi
    if [ "$mode" = train-eval ]; then
        gates=$(ls -d /tmp/sweep/lam* | paste -sd,)
        timeout $((${EVAL_S:-500} + 120)) python3 -m evals.run --model "$M/$GGUF" --gates "$gates" --corpus /tmp/corpus \
            --ruler evals/data/ruler_2k_8k.json.gz --out "$OUT/sweep_eval.json" --time-budget-s "${EVAL_S:-500}" "$@" \
            > "$OUT/sweep_eval.log" 2>&1 || echo "evals.run rc=$?" >> "$OUT/sweep_eval.log"
        tail -5 "$OUT/sweep_eval.log"
        exit 0
    fi
    if [ "$mode" = memory ]; then
        # issue 14: peak GPU memory (and RSS) of the README server's defaults against upstream's, one after
        # the other, same phases (benchmarks/serving_memory.py) -> $OUT/memory_{wgkv,upstream}_h200.json
        python3 -m benchmarks.serving_memory --label wgkv_h200 --out "$OUT" --log "$OUT/memory_wgkv_h200.log" -- "$@" || true
        python3 -m benchmarks.serving_memory --label upstream_h200 --out "$OUT" --log "$OUT/memory_upstream_h200.log" \
            -- --disable-wgkv --attention-backend flashinfer "$@" || true
        exit 0
    fi
    if [ "$mode" = serve-eval ]; then
        # straight into $OUT (a step stopped at its time limit still returns the finished configurations);
        # an earlier step's results on this machine are resumed
        mkdir -p /tmp/served && cp -r /tmp/served/. "$OUT"/
        python3 -m evals.served --ruler evals/data/ruler_2k_8k.json.gz --engine h200 --out "$OUT/h200.json" \
            --summary "$OUT/summary.json" "$@" || true
        cp -r "$OUT"/. /tmp/served/
        exit 0
    fi
    [ "$mode" = serve-soak ] && export SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1
    setsid python3 -m sglang_wgkv.launch_server --port 30000 --mem-fraction-static 0.5 "$@" > "$OUT/server.log" 2>&1 &
    server=$!
    for _ in $(seq 1 130); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30000/health_generate', timeout=30)" \
            2>/dev/null && break
        kill -0 $server 2>/dev/null || { tail -50 "$OUT/server.log"; exit 1; }
        sleep 2
    done
    warm_start 0.75
    if [ "$mode" = serve-soak ]; then
        # shellcheck disable=SC2086
        python3 -m sglang_wgkv.testing.soak --url http://127.0.0.1:30000 --server-log "$OUT/server.log" \
            --out "$OUT/soak.json" ${SOAK_ARGS:---requests 1000 --concurrency 32 --checkpoint-every 100 --new-tokens 32 --pressure-items 200 --pressure-tokens 256 --pressure-batch 8 --time-budget-s 200} \
            > "$OUT/soak.log" 2>&1 || { tail -40 "$OUT/soak.log"; tail -60 "$OUT/server.log"; }
    else
        python3 launch/bench_serving.py --url http://127.0.0.1:30000 --out "$OUT/bench.json" || tail -60 "$OUT/server.log"
    fi
    kill -- -$server 2>/dev/null || true
    warm_finish ;;
*)
    sed -n 2,8p "$0"; exit 2 ;;
esac
