#!/usr/bin/env bash
# FlashAttention-3 (sgl_kernel/flash_ops.abi3.so from sglang-kernel 0.4.5) for an H200 without network,
# so that `python -m sglang.launch_server` runs with no --attention-backend (SGLang's Hopper default, fa3).
#   bash launch/fa3_kit.sh split [--piece-mib N] [--codec xz|zstd]   networked machine: pieces + manifest in .fa3/
#   bash launch/fa3_kit.sh join                                       host: one step per piece (launch/README.md)
#   bash launch/fa3_kit.sh serve-check                                host: sglang.launch_server, no --attention-backend
# `join` stashes the pieces a step brought in /tmp/fa3; the step that brings the last one joins them,
# checks every SHA-256 and installs both files into the kit's site (/tmp/site), then imports FA3.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
split)
    shift
    python3 -m launch.fa3_kit split --out .fa3 "$@" ;;
join)
    shift
    [ -f /tmp/pp ] || { echo "no /tmp/pp: run 'launch/h200.sh setup' (with .kit moved in) on this machine first" >&2; exit 3; }
    if [ -d .kit2 ] && [ ! -e /tmp/sglang-wheel-installed ]; then bash launch/h200.sh kit2; fi
    . /tmp/pp
    python3 -m launch.fa3_kit join --src .fa3 --stash /tmp/fa3 --site "${KIT_SITE:-/tmp/site}" "$@" | tee /tmp/fa3.status
    if grep -q '^FA3 installed' /tmp/fa3.status; then
        python3 -c "from sgl_kernel.flash_attn import flash_attn_with_kvcache; print('FA3 imports:', flash_attn_with_kvcache.__module__)"
        touch /tmp/fa3-installed
    fi ;;
serve-check)
    shift
    [ -e /tmp/fa3-installed ] || { echo "FA3 is not installed here: the join steps come first" >&2; exit 3; }
    . /tmp/pp && . launch/device_common.sh && stop_leftover_servers
    export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    python3 -m launch.fa3_kit serve-check --out "$OUT/fa3_serve_check.json" "$@" ;;
*)
    sed -n 2,8p "$0"; exit 2 ;;
esac
