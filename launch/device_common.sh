# Shared by launch/h200.sh and launch/served_speed.sh (sourced): servers left by a step stopped at its
# time limit, and FlashInfer's and Triton's compile caches across machines.

# A step stopped at its time limit kills its client, not the servers it started in their own
# sessions: left up, one holds GPU memory the next step's servers size their pools by. Stop them first.
stop_leftover_servers() {
    pkill -f -- '-m sglang(_wgkv)?\.launch_server' && sleep 10 || true
}

# A fresh machine compiles every Triton kernel on first use (our decode, prefill, pool and gate kernels,
# SGLang's own): tens of seconds of each fresh machine. The cache is keyed by each kernel's source,
# options, Triton version and GPU, so a cache from another H200 with the same kit is valid; a changed
# kernel simply misses. Keep $OUT/triton_cache.tgz as .tc/ and move .tc in with a later step.
triton_cache_restore() {  # .tc/triton_cache.tgz as a step returned it (~6 MB), or its unpacked cache/
    if [ ! -d ~/.triton/cache ]; then
        if [ -f .tc/triton_cache.tgz ]; then
            mkdir -p ~/.triton && tar xzf .tc/triton_cache.tgz -C ~/.triton
        elif [ -d .tc/cache ]; then
            mkdir -p ~/.triton && cp -r .tc/cache ~/.triton/cache
        fi
    fi
    TRITON_CACHE_BEFORE=$(du -s ~/.triton/cache 2>/dev/null | cut -f1 || true)
}
triton_cache_save() {  # $1: folder the cache goes back in (when it grew during the step)
    local after
    after=$(du -s ~/.triton/cache 2>/dev/null | cut -f1 || true)
    if [ -n "$after" ] && [ "$after" != "${TRITON_CACHE_BEFORE:-}" ]; then
        tar czf "$1/triton_cache.tgz" -C ~/.triton cache
    fi
}

# FlashInfer's JIT cache (ninja builds under ~/.cache/flashinfer) from .fi/fi_cache.tgz, as a step
# returned it. Ninja rebuilds a module when an output is newer than the mtime its deps log recorded, or
# older than an input (the headers the kit's wheel just installed, dated now): so unpack with tar (mtimes
# as built, never a copy that touches them) and date the installed headers back before any build
# (tests/test_device_recipes.py).
fi_cache_restore() {
    [ -f .fi/fi_cache.tgz ] && [ ! -d ~/.cache/flashinfer ] || return 0
    mkdir -p ~/.cache && tar xzf .fi/fi_cache.tgz -C ~/.cache
    local d site=${KIT_SITE:-/tmp/site}  # where .kit/install.sh put the wheels
    for d in "$site/flashinfer/data" "$site/tvm_ffi/include"; do
        if [ -d "$d" ]; then find "$d" -exec touch -h -d 2026-01-01 {} +; fi
    done
}
