"""How WG-KV enters SGLang, and what each process holds.

``register``    entry point ``sglang.srt.plugins: wgkv``: registers the ``wgkv`` attention backend, the
                radix-cache backend and every hook (the table of targets)
``hooks``       the hooks on server arguments, memory fraction, pool construction, idle check, stats
``settings``    ``ServingSettings``: WG-KV options handed from the launcher to the scheduler processes
``runtime``     the process's ``WGKVRuntime``: settings, capacity plan, dual pool, evictor, prefix
                cache; the KV heads of a tensor-parallel rank and usage summed over ranks
``metrics``     WG-KV series in SGLang's Prometheus exporter
``overlap``     the order of the scheduler's pool work against forwards under SGLang's overlap
                scheduler (hooks); ``forward_fence``: the event that work waits for
``cpu_compat``  entry point ``sglang.srt.platforms``: ``sgl_kernel`` import stand-in on CPU-only machines
"""
