"""SGLang's KV memory as the dual pool: how the budget is split and the pool interfaces SGLang sees.

``capacity``    ``plan_capacity``: SGLang's KV budget split into logical tokens, request slots and
                pages (dense, bounded, overcommit), and the bounded plan's ``PromptRule``
``slot_costs``  the model shape a plan serves and the per-slot memory besides pages
``kv_pool``     ``MHATokenToKVPool`` facade: SGLang's logical token slots, no K/V in them
``req_pool``    ``ReqToTokenPool`` that owns each request's dual-pool slot (alloc, free, usage, stats)
``kv_dtype``    which ``--kv-cache-dtype`` the dual pool serves, on which path, with which scales
"""
