"""Prefix (radix) caching with write-gated KV admission: SGLang radix-cache backend ``wgkv_snapshot``.

:func:`register` adds the backend to SGLang's registry (``register_radix_cache_backend``); the WG-KV
plugin calls it and selects it by default (``--radix-cache-backend wgkv_snapshot``) unless
``--disable-radix-cache`` is given. See :mod:`radix_ext.factory` and
:mod:`radix_ext.snapshot_radix_cache`.
"""
