#!/usr/bin/env bash
# The serving benchmark on the H200 (device tool): Llama-3.1-8B configuration, dummy weights,
# upstream SGLang dense attention vs WG-KV at the same --mem-fraction-static
# (benchmarks/serving_throughput.py; defaults there: 32 x (32768 + 256) tokens, mem fraction 0.5).
#
# Preparation here (as for launch/h200.sh; git-ignored, travel through `carry`):
#   mkdir -p .kit .kit2 && cp ../shared/device-kit/wheels/* .kit/ && mv .kit/sglang-*.whl .kit2/
#   printf '/.kit/\n/.kit2/\n' >> .git/info/exclude
# Device calls, in ONE message (same machine, back to back; /tmp survives between them):
#   1. carry [".kit"]:  bash launch/serving_bench.sh setup                       (~1-2 min)
#   2. carry [".kit2"]: bash launch/serving_bench.sh run upstream [bench args]   (~3-4 min)
#   3.                  bash launch/serving_bench.sh run wgkv [bench args]       (~3-5 min)
# Each run writes $OUT/serving_throughput.<server>.json and the server log; then, here:
#   python benchmarks/serving_throughput.py --merge <part files> --out benchmarks/results/serving/serving_throughput_h200.json
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
setup)
    bash .kit/install.sh | tail -1 > /tmp/pp
    python3 launch/register_entry_points.py /tmp/site
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader ;;
run)
    server=$2; shift 2
    if [ -d .kit2 ] && [ ! -e /tmp/sglang-wheel-installed ]; then
        bash .kit/install.sh .kit2 >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .kit2/*.whl
        touch /tmp/sglang-wheel-installed
    fi
    . /tmp/pp
    export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    python3 benchmarks/serving_throughput.py --server "$server" --label "H200 Llama-3.1-8B (dummy weights)" \
        --part-out "$OUT/serving_throughput.$server.json" "$@" ;;
*)
    sed -n 2,16p "$0"; exit 2 ;;
esac
