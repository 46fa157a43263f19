"""SGLang 0.5.17 integration of WG-KV, through SGLang's plugin API only (the one package here that
imports sglang). One subpackage per thing it serves:

``plugin``      how WG-KV enters SGLang: entry points, the hooks, settings, the process's runtime
``pools``       SGLang's KV memory as the dual pool: capacity plan, request and token pools, KV dtype
``scheduling``  which requests the scheduler runs, and together: guards on SGLang's memory checks
``requests``    what one request may set, what is refused with a 400, what its response reports
``backend``     the ``wgkv`` attention backend: a forward's steps, the decode layer, CUDA graphs, gates
"""
