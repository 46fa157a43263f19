"""The ``wgkv`` attention backend: what each forward does to the dual pool and how attention runs.

``attn_backend``   ``WGKVAttnBackend``: a forward's step (extend, decode, mixed) and its layers
``decode_layer``   one layer of a decode step (torch reference or kernels) and the step's rows
``decode_graphs``  decode under SGLang's CUDA graphs: static rows, replay preparation, padding slot
``gates``          the served write gates and the pre-RoPE key they read
``batch_slots``    the batch's host request slots, recorded by a ``ForwardBatch.init_new`` hook
``prefill_vertical``  FA3 or the Triton kernel for the prefill's vertical range, chosen at start-up
"""
