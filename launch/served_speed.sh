#!/usr/bin/env bash
# Served speed on the H200 (device tool): WG-KV against upstream SGLang --attention-backend flashinfer,
# measured with `python -m sglang.bench_serving` (benchmarks/served_speed.py; workloads W0-W4, W4L there).
#
# Preparation here (git-ignored folders that travel through `carry`):
#   mkdir -p .kit .kit2 && cp ../shared/device-kit/wheels/* .kit/ && mv .kit/sglang-*.whl .kit/sglang_kernel-*.whl .kit2/
#   printf '/.kit/\n/.kit2/\n/.fi/\n/.tc/\n' >> .git/info/exclude
# Device calls, in ONE message (same machine, back to back; /tmp and ~/.cache survive between them):
#   1. carry [".kit"]:         bash launch/served_speed.sh setup   (ALONE first: the tree is ~18 MiB)
#   (1b. carry [".kit2"]:      bash launch/served_speed.sh tests-beside-warm W3   GPU tests + cold FlashInfer cache)
#   (1c. after `h200.sh kit2` and the model's `part` calls, carry [".fi"]:
#        bash launch/served_speed.sh beside-warm W4 bash launch/h200.sh logprob-floor   any untimed GPU work)
#   2. carry [".kit2", ".fi"]: bash launch/served_speed.sh run wgkv W1,W0 [served_speed.py run args]
#   3.                         bash launch/served_speed.sh run upstream W1 [...]
# (.kit2 + .fi + the tree is ~62 MiB: carry .tc, if any, with a later call.) W4L's upstream run needs a
# call of its own (~380 s of decode plus the start).
# TP=2 (kind nvidia-h200-x2): add `--tp 2` to both runs (NVLink multicast off; rows get "tp": 2).
# Decode profile under load (issue 15: WG-KV's step at batch 128 is 16.8 ms against ~9 ms of bandwidth):
#   run wgkv W3 --profile-dir $OUT/prof --profile-workloads none --profile-load-workloads W3 --profile-steps 8
# Device time these calls took on 2026-12-01 (plan a lease with them; a session has 1,800 s):
#   setup 4-15 s; `run wgkv W1,W0,W2` with the W1/W0 decode and W2 prefill profiles 458 s (startup
#   ~140 s: 63 s of decode-graph capture, bs 1-64, then ~25 s of Triton compiles in the warm-up);
#   `run upstream W1,W2` with the W1 profile and a cold FlashInfer JIT 391 s; `run wgkv W2` alone
#   ~230 s (did not fit in 225 s). Session 4: W3 ~150 s (WG-KV) + ~250 s (upstream), W4 ~120 + ~190 s.
#   2026-12-01 night, one lease of 1,704 s: setup + GPU tests (52) + benchmarks/decode_fixed_cost.py 211 s;
#   `run wgkv W1,W0,W2` (W1 decode + W2 prefill profiles) 426 s; `run upstream W1,W2` (cold JIT) 398 s;
#   `run wgkv W3` with the load profile 233 s; `run upstream W3` (warm JIT) 324 s.
#   2026-12-02, two leases: call 1 setup 5 s; call 2 (carry .kit2) GPU tests (53) beside a
#   `run upstream W3 --warm-only` in the background that builds the FlashInfer cache (~300 s in all,
#   401 s); `run wgkv W3` with the load profile 278 s; `run upstream W3` (warm) 338 s. Second lease
#   (carry .kit2 + .fi): `run wgkv W3` 287 s; `run upstream W3` did not finish in the 373 s left.
#   2026-12-02 07:00, one lease of 1,451 s for 7 calls: setup 3 s; `run upstream W4` with the cold JIT
#   425 s; `run wgkv W4` 183 s; `run wgkv W3` 164 s; `run upstream W3` 284 s; `run wgkv W1,W0` 181 s;
#   `run upstream W1` 136 s. A call sent later, in a new message, found a fresh machine (idle > 30 s):
#   put every call of a lease in one message.
#   2026-12-03, one lease (machine start 181 s, held by the first call): setup 3 s; `tests-beside-warm W4`
#   (75 GPU tests passed, 5 skipped, beside the cold FlashInfer build) 298 s; `run wgkv W4` 179 s;
#   `run upstream W4` (warm) 241 s; h200.sh serve-soak 377 s; h200.sh programs 127 s. A first call made
#   before `setup` found no /tmp/pp: `setup` must be the first call that reaches the machine.
#   2026-12-03 16:07 (machine start 95 s): `run wgkv W4` after a kernel change did not finish in 230 s (its
#   server took 117 s to start, 61 s the lease before: Triton compiles the changed kernels on a fresh
#   machine); `run upstream W4` with .fi carried did not finish in 264 s. Give a W4 pair ~600 s.
#   2026-12-03 22:27 (machine start ~90 s): `run wgkv W4,W4L` 346 s (start 67 s, W4 35 s, W4L 62 s, plus
#   warm-ups and Triton compiles); `run upstream W4L` cut at 560 s: its first start on the machine took
#   ~210 s (decode-graph capture 56 s, then 96 s before its first forward, .fi carried) and its 7 waves of
#   10 requests take ~380 s: give it a call of its own after a `run upstream W4 --warm-only`. A call cut by
#   its limit left its server up (29 GB): `run` now stops leftovers first.
#   2026-12-04 04:10 (machine start ~90 s): `beside-warm W4 ... logprob-floor` 225 s (upstream's warm-up
#   compiled all three FlashInfer modules although .fi was carried: the old copy-and-touch restore, fixed
#   by fi_cache_restore); `run upstream W4L` 485 s (start 47 s); `run wgkv W4,W4L` 334 s (start 92 s);
#   `run upstream W4` 252 s (start 63 s).
#   2026-12-04 10:00 (machine start ~45 s, Triton and FlashInfer cold): `kit2 && run wgkv W1,W0 --profile-workloads
#   none` 244 s (start 115 s); each `--wgkv-extra` variant of it 186-219 s; `beside-warm W4 ...` 230 s; `run
#   upstream W1` after deleting ~/.cache/flashinfer and restoring it from the warm-up's tgz 166 s (start 61 s,
#   only cascade.so built: fi_cache_restore works; carry the tgz a W1 upstream run returns, it holds cascade).
#   2026-12-04 13:10 (four machines, 1,680 s): `kit2 && decode_fixed_cost.py --configs` (ten launch shapes) 33 s;
#   `run wgkv W1,W0 --profile-workloads W1 --profile-dir $OUT/prof` 269 s; `run upstream W1` (same profile
#   flags) 252 s; on a second machine `run wgkv W2` 200 s (carry .kit2 .fi .tc: .tc/triton_cache.tgz, the
#   ~6 MB tgz a call returns, fits beside them), `run upstream W2` 197 s; each W2 run with
#   `--profile-prefill-workloads W2` ~250 s. A call carrying .kit with .fi and .tc is over 64 MiB: `setup` alone.
# Next lease (issue 15; the extend step's Triton launches are opt-in until then): after `setup`, in one
# message, carry [".kit2", ".fi", ".tc"]:
#   bash launch/h200.sh kit2 && . /tmp/pp && PYTHONPATH=$PWD:/tmp/site python3 -m pytest -q -p no:cacheprovider \
#     tests/test_gpu_pool.py tests/test_gpu_serving.py && python3 benchmarks/extend_step.py --out $OUT/extend_step.json
#   run wgkv W2 --profile-workloads none; run wgkv W2 --tag ext --profile-workloads none --wgkv-extra
#   "--wgkv-extend-kernels"; run upstream W2 --profile-workloads none. Then `served_speed.py ab` the two
#   WG-KV parts; the default flips only where the GPU test passes and the served A/B is faster.
# WG-KV server variants (issue 15, e.g. the decode launch shape), each part against the default of the
# same lease: run wgkv W1 --tag pdl --wgkv-extra "--wgkv-decode-launch pdl=1" (one call per variant),
# then here: python benchmarks/served_speed.py ab <wgkv parts> --out benchmarks/results/serving/X.json --what '...'
# Triton's compile cache: a call that compiled kernels returns $OUT/triton_cache.tgz; keep it as
# .tc/triton_cache.tgz (mkdir -p .tc && cp triton_cache.tgz .tc/) and carry [".tc"] (with .kit2 and .fi)
# later: the servers' first starts then skip the compiles (launch/device_common.sh).
# To read a trace here (host gaps: trace_summary's largest_idle_gaps / inside), give --profile-dir
# under $OUT (a .trace.json.gz under 16 MB comes back).
# `run` writes part.<server>.<tag>.json, bench_serving's JSON lines and the server logs to $OUT. The
# first upstream run on a machine compiles FlashInfer's kernels (~3.5 min) and leaves the cache as
# $OUT/fi_cache.tgz: keep it as .fi/fi_cache.tgz (mkdir -p .fi && cp fi_cache.tgz .fi/) and carry .fi
# later, so later machines skip the compile (launch/device_common.sh fi_cache_restore says how). Then, here:
#   python benchmarks/served_speed.py merge <part files> --out-dir benchmarks/results/serving
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in tests-beside-warm|beside-warm|run)
    [ -f /tmp/pp ] || { echo "no /tmp/pp: this machine is fresh; call '$0 setup' (carry .kit) first, in the same message" >&2; exit 3; } ;;
esac
case "${1:-}" in
setup)
    bash .kit/install.sh | tail -1 > /tmp/pp
    python3 launch/register_entry_points.py /tmp/site
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader ;;
tests-beside-warm)
    # GPU tests while an upstream server of workload ${2:-W3} starts and takes its warm-up request in
    # the background (FlashInfer's cold compile, ~300 s, costs no call of its own); the cache comes
    # back as $OUT/fi_cache.tgz. Carry [".kit2"] after `setup`.
    warm=${2:-W3}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    bash launch/h200.sh kit2
    OUT=/tmp/warm bash "$0" run upstream "$warm" --warm-only --tag warm > /tmp/warm.log 2>&1 &
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
    # as $OUT/fi_cache.tgz and later upstream runs of the lease start warm. After `setup` and `kit2`.
    warm=$2; shift 2; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    OUT=/tmp/warm bash "$0" run upstream "$warm" --warm-only --tag warm > /tmp/warm.log 2>&1 &
    warm_pid=$!
    sleep 15  # its sweep of leftover servers runs before CMD starts its own
    KEEP_SERVERS=1 "$@" || echo "beside-warm: command rc=$?"
    wait $warm_pid || echo "warm-up server failed: see $OUT/warm.log"
    cp /tmp/warm.log "$OUT/warm.log"; cp /tmp/warm/fi_cache.tgz "$OUT/" 2>/dev/null || true ;;
run)
    server=$2 workloads=$3; shift 3
    if [ -d .kit2 ] && [ ! -e /tmp/sglang-wheel-installed ]; then bash launch/h200.sh kit2; fi
    # (served_speed.py also refuses to start a server while another process holds the GPU)
    . launch/device_common.sh && stop_leftover_servers
    fi_cache_restore
    touch /tmp/fi_mark  # a module built during this call is newer (a rebuild keeps du's size)
    triton_cache_restore
    . /tmp/pp
    export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    python3 benchmarks/served_speed.py run --server "$server" --workloads "$workloads" --out-dir "$OUT" "$@"
    if [ -n "$(find ~/.cache/flashinfer -name '*.so' -newer /tmp/fi_mark 2>/dev/null)" ]; then
        find ~/.cache/flashinfer -name '*.so' -newer /tmp/fi_mark | sed 's/^/FlashInfer built: /'
        tar czf "$OUT/fi_cache.tgz" -C ~/.cache flashinfer
    fi
    triton_cache_save "$OUT" ;;
*)
    sed -n 2,20p "$0"; exit 2 ;;
esac
