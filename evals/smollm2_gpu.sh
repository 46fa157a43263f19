#!/usr/bin/env bash
# Train the SmolLM2-135M write gates (one run, all λ) and evaluate them against the baselines.
#
#   bash evals/smollm2_gpu.sh MODEL OUT [TRAIN_BUDGET_S] [EVAL_BUDGET_S]
#
# MODEL: HF dir, .gguf or "embedded". Needs .cache/corpus (python -m sglang_wgkv.training corpus) and
# $RULER (python -m evals.ruler). Writes OUT/g/lam{λ}.safetensors and OUT/meta.tgz (gate configs,
# training log, eval results and logs). Overrides: LAMS, STEPS, SEQ_LEN, BACKEND, RULER, NLL_LENGTHS,
# NLL_ROWS, DEVICE.
set -uo pipefail
model=$1
out=$2
train_s=${3:-170}
eval_s=${4:-100}
run=${RUN_DIR:-/tmp/wgkv_run}
meta=$(mktemp -d)
mkdir -p "$out/g"
timeout $((train_s + 60)) python3 -m sglang_wgkv.training train --model "$model" --corpus .cache/corpus \
    --out "$run" --lams "${LAMS:-0.003,0.01,0.03,0.1}" --steps "${STEPS:-3000}" --seq-len "${SEQ_LEN:-4096}" \
    --time-budget-s "$train_s" --val-every 150 --val-rows 4 --ckpt-every 100 --log-every 10 \
    --backend "${BACKEND:-sdpa}" --device "${DEVICE:-auto}" --model-id SmolLM2-135M-Instruct 2>&1 \
    | tr '\r' '\n' | grep -v '^gates: ' > "$meta/train.log"
echo "train rc=${PIPESTATUS[0]}" >> "$meta/train.log"
gates=$(ls -d "$run"/lam* | paste -sd,)
timeout $((eval_s + 60)) python3 -m evals.run --model "$model" --gates "$gates" --corpus .cache/corpus \
    --ruler "${RULER:-.cache/ruler.json}" --nll-lengths "${NLL_LENGTHS:-2048,4096,8192}" \
    --nll-rows "${NLL_ROWS:-6}" --device "${DEVICE:-auto}" --out "$meta/results.json" \
    --time-budget-s "$eval_s" > "$meta/eval.log" 2>&1
echo "eval rc=$?" >> "$meta/eval.log"
for d in "$run"/lam*; do
    cp "$d/gates.safetensors" "$out/g/$(basename "$d").safetensors"
    cp "$d/gates.json" "$meta/$(basename "$d").json"
done
cp "$run/log.jsonl" "$meta/"
tar czf "$out/meta.tgz" -C "$meta" .
tail -n 3 "$meta/train.log" "$meta/eval.log"
