"""SGLang 0.5.17 integration of WG-KV, through SGLang's plugin API only.

``plugin``      entry point (``sglang.srt.plugins``): registers the ``wgkv`` backend and the hooks
``hooks``       the HookRegistry hooks (server args, pool construction, idle check, stats)
``settings``    WG-KV options handed from the launcher to the scheduler processes
``runtime``     the process's WGKVRuntime: settings, capacity plan, dual pool, evictor, prefix cache
``capacity``    plan_capacity: SGLang's KV budget split into logical tokens, request slots and pages
``kv_pool``     ``MHATokenToKVPool`` facade over the dual-cache pool
``req_pool``    ``ReqToTokenPool`` that owns each request's dual-cache slot
``key_capture`` pre-RoPE key capture (the gate's input)
``backend``     the ``wgkv`` attention backend
``cpu_compat``  ``sgl_kernel`` import stand-in for CPU-only machines (``sglang.srt.platforms`` entry point)
"""
