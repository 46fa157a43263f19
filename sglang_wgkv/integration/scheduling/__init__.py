"""Which requests SGLang's scheduler runs, and together, with the dual pool's pages in mind (hooks on
its memory checks and its prefill pass; what a request would do to the pool, not what it asked for).

``overcommit``     ``--wgkv-overcommit``: decode steps and prefills admitted by the dual pool's pages
``prefill_guard``  which requests a prefill batch may take, by the capacity plan's mode
``long_requests``  requests bounded by the evictor: their own ``kv_budget``, or longer than the pool
``mixed_batches``  which forward a pass builds while requests decode (``--wgkv-forward-tokens``)
``running_knee``   new requests held past the running batch's knee (``--wgkv-running-knee``)
"""
