"""One request through the HTTP server and the tokenizer manager: what it may set, what is refused
with SGLang's usual 400 instead of a 500 or a dead scheduler, what its response reports.

``control``      per-request ``tau``, ``admission`` and ``kv_budget`` (``custom_params.wgkv``), and
                 per-request usage in ``meta_info`` and the OpenAI responses
``usage_ledger`` the counts that usage comes from, without waiting for the forward in flight (overlap)
``validation``   bad input turned into a 400 (token ids, sampling parameters, unknown ``/generate``
                 fields, streamed rejections)
``constrained``  constrained decoding (regex, JSON schema, EBNF) on every device served
"""
