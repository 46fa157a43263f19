#!/usr/bin/env bash
# Issue 40's long-context workloads on one H200 (Llama-3.1-8B configuration with the context extended,
# dummy weights, WG-KV with 25% random admission, --mem-fraction-static 0.9), measured with SGLang's
# own client (sglang.bench_serving, one request). docs/long-context.md says what they exercise.
#
#   id   request               WG-KV server                                  upstream
#   W5   524,288 + 128         --wgkv-overcommit 4                           fa3 (and fa3 + FP8 KV): timed
#   W6   1,000,000 + 128       --wgkv-overcommit 4                           its refusal, bf16 and FP8
#   W6B  1,000,000 + 128       --kv-budget 4096 (the README's serve command) -
#   W6R  1,000,000 + 128       W6's server, the request's own kv_budget 4096 -
#   W7   2,000,000 + 128       --wgkv-overcommit 4 (detached: start, then collect)  its refusal
#
# Usage (repository root, after launch/served_speed.sh setup; OUT defaults to $OUT or /tmp/long):
#   bash launch/long_context.sh model                   # the model directory (word-level tokenizer)
#   bash launch/long_context.sh wgkv W5|W6|W6B|W6R      # start, warm up, time one request, stop
#   bash launch/long_context.sh upstream W5 [fp8]       # the same for upstream fa3 (W5 only)
#   bash launch/long_context.sh refusal W6|W7 [fp8]     # upstream's answer to the request, then stop
#   bash launch/long_context.sh start W7                # detached: server + client in the background
#   bash launch/long_context.sh collect W7              # later: the client's result (or its progress)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/long}
MODEL=${MODEL:-/tmp/llama8b-long}
PORT=${PORT:-30000}
mkdir -p "$OUT"
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
python -c "import datasets" 2>/dev/null || export PYTHONPATH="benchmarks/offline_imports${PYTHONPATH:+:$PYTHONPATH}"

COMMON="--model-path $MODEL --port $PORT --load-format dummy --disable-radix-cache --sampling-backend pytorch
 --disable-prefill-cuda-graph --incremental-streaming-output --log-level info --mem-fraction-static 0.9
 --max-running-requests 4 --cuda-graph-max-bs-decode 4"
ADMIT="--wgkv-random-admission 0.25"

context_of() { case $1 in W5) echo 528384 ;; W6 | W6B | W6R) echo 1048576 ;; W7) echo 2097152 ;; esac; }
input_of() { case $1 in W5) echo 524288 ;; W6 | W6B | W6R) echo 1000000 ;; W7) echo 2000000 ;; esac; }
wgkv_of() { case $1 in W6B) echo "$ADMIT --kv-budget 4096" ;; *) echo "$ADMIT --wgkv-overcommit 4" ;; esac; }
body_of() {
	[ "$1" = W6R ] || return 0
	echo '{"sampling_params": {"max_new_tokens": 128, "temperature": 0.0, "ignore_eos": true,' \
		'"custom_params": {"wgkv": {"kv_budget": 4096}}}}'
}

start_server() { # name engine workload [extra args]
	local name=$1 engine=$2 w=$3
	shift 3
	local cmd=(python -m sglang_wgkv.launch_server)
	[ "$engine" = upstream ] && cmd=(python -m sglang.launch_server --attention-backend fa3)
	# shellcheck disable=SC2086
	nohup "${cmd[@]}" $COMMON --context-length "$(context_of "$w")" "$@" >"$OUT/$name.server.log" 2>&1 &
	echo $! >"$OUT/$name.pid"
	for _ in $(seq 450); do
		curl -sf "localhost:$PORT/health" >/dev/null && return 0
		kill -0 "$(cat "$OUT/$name.pid")" 2>/dev/null || break
		sleep 2
	done
	tail -40 "$OUT/$name.server.log"
	return 1
}

stop_server() {
	local pid
	pid=$(cat "$OUT/$1.pid")
	kill "$pid" 2>/dev/null || true
	for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
	kill -9 "$pid" 2>/dev/null || true
}

bench() { # name input_len output_len seed [extra body]
	local extra=()
	[ -n "${5:-}" ] && extra=(--extra-request-body "$5")
	python -m sglang.bench_serving --backend sglang --base-url "http://127.0.0.1:$PORT" \
		--dataset-name random-ids --tokenize-prompt --random-input-len "$2" --random-output-len "$3" \
		--random-range-ratio 1 --num-prompts 1 --request-rate inf --warmup-requests 0 --seed "$4" \
		--disable-tqdm --ready-check-timeout-sec 300 --output-file "$OUT/$1.jsonl" "${extra[@]}"
}

timed() { # name workload: a short warm-up (Triton compiles), the timed request, the server's state
	bench "$1.warmup" 8192 16 2
	bench "$1" "$(input_of "$2")" 128 1 "$(body_of "$2")"
	curl -s "localhost:$PORT/server_info" >"$OUT/$1.server_info.json"
	tail -1 "$OUT/$1.jsonl"
}

case ${1:-} in
model)
	python -c "from pathlib import Path; from benchmarks.served_speed import model_dir; model_dir(Path('$MODEL'))"
	;;
wgkv)
	w=$2
	# shellcheck disable=SC2046
	start_server "wgkv_$w" wgkv "$w" $(wgkv_of "$w")
	timed "wgkv_$w" "$w" || true
	stop_server "wgkv_$w"
	;;
upstream)
	w=$2 kv=()
	[ "${3:-}" = fp8 ] && kv=(--kv-cache-dtype fp8_e4m3)
	name="upstream_${w}${3:+_$3}"
	start_server "$name" upstream "$w" "${kv[@]}"
	timed "$name" "$w" || true
	stop_server "$name"
	;;
refusal)
	w=$2 kv=()
	[ "${3:-}" = fp8 ] && kv=(--kv-cache-dtype fp8_e4m3)
	name="refusal_${w}${3:+_$3}"
	start_server "$name" upstream "$w" "${kv[@]}"
	python - "$PORT" "$(input_of "$w")" "$OUT/$name.json" <<'EOF'
import json, random, sys, requests
port, n, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ids = [random.Random(1).randrange(1000, 100000) for _ in range(n)]
r = requests.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": ids,
    "sampling_params": {"max_new_tokens": 128, "ignore_eos": True}}, timeout=3600)
info = requests.get(f"http://127.0.0.1:{port}/server_info", timeout=60).json()
rec = {"status": r.status_code, "body": r.text[:2000], "max_total_num_tokens": info.get("max_total_num_tokens")}
json.dump(rec, open(out, "w"), indent=1)
print(rec)
EOF
	stop_server "$name"
	;;
start)
	w=$2
	# shellcheck disable=SC2046
	start_server "wgkv_$w" wgkv "$w" $(wgkv_of "$w")
	nohup bash -c "$(declare -f bench timed input_of body_of); OUT='$OUT' PORT='$PORT' timed wgkv_$w $w" \
		>"$OUT/wgkv_$w.client.log" 2>&1 &
	echo "started wgkv_$w; collect it with: bash launch/long_context.sh collect $w"
	;;
collect)
	w=$2
	if [ -s "$OUT/wgkv_$w.jsonl" ]; then
		tail -1 "$OUT/wgkv_$w.jsonl"
		stop_server "wgkv_$w"
	else
		tail -5 "$OUT/wgkv_$w.client.log" || true
		grep -E "Prefill batch|Decode batch" "$OUT/wgkv_$w.server.log" | tail -3 || true
	fi
	;;
*)
	sed -n '2,20p' "$0"
	exit 2
	;;
esac
