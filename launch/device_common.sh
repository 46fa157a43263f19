# Shared by launch/h200.sh and launch/served_speed.sh (sourced): servers left by a cut call, and
# Triton's compile cache across device machines.

# A device call cut by its time limit kills its client, not the servers it started in their own
# sessions: left up, one holds GPU memory the next call's servers count on (2026-12-03: an upstream
# server got a pool of 47,931 tokens instead of 93,052 beside one). Stop them before starting others.
stop_leftover_servers() {
    pkill -f -- '-m sglang(_wgkv)?\.launch_server' && sleep 10 || true
}

# A fresh machine compiles every Triton kernel on first use (our decode, prefill, pool and gate kernels,
# SGLang's own): tens of seconds of each lease. The cache is keyed by each kernel's source, options,
# Triton version and GPU, so a cache from another H200 with the same kit is valid; a changed kernel
# simply misses. Here: tar xzf triton_cache.tgz -C .tc  (then carry [".tc"] with a later call).
triton_cache_restore() {
    if [ -d .tc/cache ] && [ ! -d ~/.triton/cache ]; then
        mkdir -p ~/.triton && cp -r .tc/cache ~/.triton/cache
    fi
    TRITON_CACHE_BEFORE=$(du -s ~/.triton/cache 2>/dev/null | cut -f1 || true)
}
triton_cache_save() {  # $1: folder the cache goes back in (when it grew during the call)
    local after
    after=$(du -s ~/.triton/cache 2>/dev/null | cut -f1 || true)
    if [ -n "$after" ] && [ "$after" != "${TRITON_CACHE_BEFORE:-}" ]; then
        tar czf "$1/triton_cache.tgz" -C ~/.triton cache
    fi
}
