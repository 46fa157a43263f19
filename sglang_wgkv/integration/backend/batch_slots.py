"""Host request slots: SGLang's ForwardBatch has no host copy of ``req_pool_indices``;
:func:`record_batch_slots` (a ``ForwardBatch.init_new`` hook) records ``[req.req_pool_idx for req in
batch.reqs]`` on the batch and on the backend, and :func:`carry_batch_slots` (an
``EagerRunner.load_batch`` hook) onto the view of the batch the eager runner hands the backend, so no
step reads the device tensor back (a batch built elsewhere, e.g. a unit test's, falls back to
``.tolist()``, which waits for the GPU).
"""

from sglang_wgkv.integration.backend.attn_backend import WGKVAttnBackend


def record_batch_slots(result, cls, batch, model_runner, *args, **kwargs):
    """AFTER ``ForwardBatch.init_new``: the batch's host request slots, on the batch
    (``wgkv_req_slots``) and on a wgkv backend (``batch_slots``: CUDA-graph replay sees only a view
    of the batch). The scheduler builds each ForwardBatch right before running it."""
    backend = getattr(model_runner, "attn_backend", None)
    if isinstance(backend, WGKVAttnBackend):
        slots = [req.req_pool_idx for req in batch.reqs]
        result.wgkv_req_slots = slots
        backend.batch_slots = slots
        # SGLang truncates a chunked prompt's extend range; the last chunk reaches the full length.
        # Kept on the backend: the batch the model runner hands to init_forward_metadata may be a
        # copy without our attributes (seen on the CPU engine).
        backend.batch_prompt_ends = None
        backend.batch_decode_rows = mixed_decode_rows(batch)
        if batch.forward_mode.is_extend():
            prefill = batch.reqs[: len(batch.reqs) - backend.batch_decode_rows]
            backend.batch_prompt_ends = (
                slots[: len(prefill)],
                [req.extend_range.end >= len(req.full_untruncated_fill_ids) for req in prefill],
            )
    return None


def carry_batch_slots(result, runner, forward_batch, *args, **kwargs):
    """AFTER ``EagerRunner.load_batch``: the batch it returns is a ``dataclasses.replace`` of the live
    one over its static buffers, without the attributes set on the live one; the host slots go along
    (without them every eager extend read ``req_pool_indices`` back: a device-to-host copy behind the
    forward in flight, in the M1D profile's host waits)."""
    slots = getattr(forward_batch, "wgkv_req_slots", None)
    if slots is not None and result is not None and result is not forward_batch:
        result.wgkv_req_slots = slots
    return None


def mixed_decode_rows(batch) -> int:
    """The decode rows of a MIXED batch (0 for other modes): SGLang's ``mix_with_running`` appends the
    running requests after the prefill requests and keeps them as ``decoding_reqs``."""
    if not batch.forward_mode.is_mixed():
        return 0
    decoding = batch.decoding_reqs or []
    tail = batch.reqs[len(batch.reqs) - len(decoding) :]
    if not decoding or len(decoding) >= len(batch.reqs) or any(a is not b for a, b in zip(tail, decoding)):
        raise RuntimeError(
            f"a mixed batch of {len(batch.reqs)} requests whose {len(decoding)} decoding requests are "
            "not its last rows"
        )
    return len(decoding)
