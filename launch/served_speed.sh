#!/usr/bin/env bash
# Served speed on an H200 without network: WG-KV or one upstream baseline on the workloads of
# benchmarks/workloads.json, measured with `python -m sglang.bench_serving` (benchmarks/served_speed.py).
#   bash launch/served_speed.sh setup                                   (with .kit; a machine's first step)
#   bash launch/served_speed.sh run upstream BASELINE WORKLOADS [served_speed args]   BASELINE: fa3, fa3_fp8, flashinfer, flashinfer_fp8
#   bash launch/served_speed.sh run wgkv CONFIG WORKLOADS [served_speed args]         CONFIG: bf16, fp8
#     (FRESH_TRITON_CACHE=1: the run starts from an empty Triton cache of its own)
#   bash launch/served_speed.sh tests-beside-warm WORKLOAD     GPU tests while a FlashInfer server warms up
#   bash launch/served_speed.sh beside-warm WORKLOAD CMD...     CMD while a FlashInfer server warms up
#   bash launch/served_speed.sh chain NAME 'LINE' ...   the lines one after another, detached (they outlast
#     a step), each a command run with OUT=/tmp/NAME and $S = "bash launch/served_speed.sh run", from a copy
#     of the tree of their own: a later step's copy replaces this checkout's files under a starting server
#   bash launch/served_speed.sh collect NAME [SECONDS]   every minute for SECONDS (540) or until the chain ends, /tmp/NAME and its
#     log as $OUT/NAME.tgz (no traces, no caches); then its Triton cache and the log's tail
# Parts, bench_serving lines, server logs and the compile caches that grew come back in $OUT; merge the
# parts on the networked machine with `python -m benchmarks.served_report merge PARTS...`. The order of
# the steps, what each moves in and how long they take: launch/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in tests-beside-warm|beside-warm|run)
    [ -f /tmp/pp ] || { echo "no /tmp/pp: this machine is fresh; run '$0 setup' (with .kit moved in) on it first" >&2; exit 3; } ;;
esac
case "${1:-}" in
setup)
    bash .kit/install.sh | tail -1 > /tmp/pp
    python3 launch/register_entry_points.py /tmp/site
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader ;;
tests-beside-warm)
    # GPU tests while an upstream server of workload ${2:-W3} starts and takes its warm-up request in
    # the background (FlashInfer's cold compile, ~300 s, costs no step of its own); the cache comes
    # back as $OUT/fi_cache.tgz. With .kit2 moved in, after `setup`.
    warm=${2:-W3}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    bash launch/h200.sh kit2
    OUT=/tmp/warm bash "$0" run upstream flashinfer "$warm" --warm-only --tag warm > /tmp/warm.log 2>&1 &
    warm_pid=$!
    . /tmp/pp
    export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
    python3 -m pytest -q -p no:cacheprovider tests/test_triton_decode.py tests/test_gpu_pool.py tests/test_triton_gate.py \
        tests/test_evictor_gpu.py tests/test_evictor_scores.py \
        2>&1 | tail -30 | tee "$OUT/gpu_tests.log" || true
    wait $warm_pid || echo "warm-up server failed: see $OUT/warm.log"
    cp /tmp/warm.log "$OUT/warm.log"; cp /tmp/warm/fi_cache.tgz "$OUT/" 2>/dev/null || true ;;
beside-warm)
    # beside-warm WORKLOAD CMD...: CMD (e.g. `bash launch/h200.sh logprob-floor`, GPU work that times
    # nothing) while an upstream server of WORKLOAD starts and takes its warm-up request in the
    # background (its first start on a machine: FlashInfer's compiles, ~150-300 s); the cache comes back
    # as $OUT/fi_cache.tgz and later upstream runs on the machine start warm. After `setup` and `kit2`.
    warm=$2; shift 2; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    OUT=/tmp/warm bash "$0" run upstream flashinfer "$warm" --warm-only --tag warm > /tmp/warm.log 2>&1 &
    warm_pid=$!
    sleep 15  # its sweep of leftover servers runs before CMD starts its own
    KEEP_SERVERS=1 "$@" || echo "beside-warm: command rc=$?"
    wait $warm_pid || echo "warm-up server failed: see $OUT/warm.log"
    cp /tmp/warm.log "$OUT/warm.log"; cp /tmp/warm/fi_cache.tgz "$OUT/" 2>/dev/null || true ;;
run)
    server=$2 config=$3 workloads=$4; shift 4
    case "$server:$config" in
    upstream:fa3*)
        [ -e /tmp/fa3-installed ] || { echo "FA3 is not installed on this machine: the launch/fa3_kit.sh join steps come first" >&2; exit 3; } ;;
    wgkv:*)
        [ -e /tmp/fa3-installed ] || echo "FA3 is not installed on this machine: WG-KV's prefill runs its vertical range in Triton (runs[].prefill_vertical)" >&2 ;;
    esac
    if [ -d .kit2 ] && [ ! -e /tmp/sglang-wheel-installed ]; then bash launch/h200.sh kit2; fi
    # (served_speed.py also refuses to start a server while another process holds the GPU)
    . launch/device_common.sh && stop_leftover_servers
    fi_cache_restore
    touch /tmp/fi_mark  # a module built during this step is newer (a rebuild keeps du's size)
    triton_cache_restore
    . /tmp/pp
    export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    if [ -n "${FRESH_TRITON_CACHE:-}" ]; then  # what a new user's first server compiles, start-up included
        export TRITON_CACHE_DIR; TRITON_CACHE_DIR=$(mktemp -d /tmp/triton_fresh.XXXX)
        echo "Triton cache for this run: $TRITON_CACHE_DIR (empty)"
    fi
    if [ "$server" = upstream ]; then pick=(--baseline "$config"); else pick=(--wgkv-config "$config"); fi
    python3 -m benchmarks.served_speed --server "$server" "${pick[@]}" --workloads "$workloads" --out-dir "$OUT" "$@"
    if [ -n "$(find ~/.cache/flashinfer -name '*.so' -newer /tmp/fi_mark 2>/dev/null)" ]; then
        find ~/.cache/flashinfer -name '*.so' -newer /tmp/fi_mark | sed 's/^/FlashInfer built: /'
        tar czf "$OUT/fi_cache.tgz" -C ~/.cache flashinfer
    fi
    if [ -n "${FRESH_TRITON_CACHE:-}" ]; then  # later runs on this machine start warm from it
        mkdir -p ~/.triton/cache && cp -r "$TRITON_CACHE_DIR"/. ~/.triton/cache/
    fi
    triton_cache_save "$OUT" ;;
chain)
    name=$2; shift 2; base=${CHAIN_DIR:-/tmp}
    rm -rf "$base/tree.$name" && cp -a . "$base/tree.$name"
    printf '%s\n' "$@" > "$base/$name.lines"
    mkdir -p "$base/$name"
    (cd "$base/tree.$name" && OUT="$base/$name" S="bash launch/served_speed.sh run" setsid nohup bash -c '
        while IFS= read -r line; do echo "chain: $line"; eval "$line" || echo "chain: rc=$? for: $line"; done < "$0"
        echo "chain: all done"' "$base/$name.lines" > "$base/$name.log" 2>&1 < /dev/null &)
    echo "chain $name: $# lines started; log $base/$name.log, results $base/$name" ;;
collect)
    name=$2 secs=${3:-540} base=${CHAIN_DIR:-/tmp}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    end=$((SECONDS + secs))
    while :; do
        tar czf "$OUT/.t" --exclude='*.trace.json.gz' --exclude='*triton_cache*' --exclude='fi_cache*' \
            -C "$base" "$name" "$name.log" && mv "$OUT/.t" "$OUT/$name.tgz"
        left=$((end - SECONDS)); [ "$left" -gt 0 ] || break
        grep -q '^chain: all done' "$base/$name.log" 2>/dev/null && break  # nothing more will land
        sleep $((left < 60 ? left : 60))
    done
    cp "$base/$name/triton_cache.tgz" "$OUT/" 2>/dev/null || true
    tail -3 "$base/$name.log" ;;
*)
    sed -n 2,16p "$0"; exit 2 ;;
esac
