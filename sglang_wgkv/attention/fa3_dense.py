"""FA3 over the whole prefill when every key is visible to every later query: the vertical-slash
attention is then causal attention over the context and new rows, so one dense FA3 call
(``sgl_kernel``'s ``flash_attn_varlen_func``, Hopper) replaces the plan, the compaction, the vertical
pass and the band launch. ``WGKVAttnBackend`` takes it for an extend forward where either row holds:

| condition (every request of the forward) | why the attention is dense |
| --- | --- |
| keeps every token (``"admission": false``), is not bounded (no ``kv_budget`` of its own or the server's, no pool bound) and restored no cached prefix (``WGKVReqToTokenPool.slot_dense``) | each key is admitted: its context holds only its own rows, global entries in position order, read without page padding (``ExtendPlan.exact_global``) |
| has at most ``W_local`` tokens with this chunk (prefix + new rows) | no token has left its ring: every key is within the local window of every later query, admitted or not |

The keys are ``DualCachePool.extend_inputs``' packed rows: a request's cached context (global entries,
then the ring) and its new rows, in position order, so FA3's causal mask (aligned to the last key) is
the vertical-slash mask. :func:`dense_reference` is the torch statement of the call (the CPU checks run
it in FA3's place).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_wgkv.attention.fa3_vertical import load_sgl_kernel_fa3

FA3VarlenFn = Callable[..., object]  # flash_attn_varlen_func's signature


def load_fa3_dense(device: torch.device | str) -> FA3VarlenFn | None:
    """``flash_attn_varlen_func`` where FA3 runs, else None (:func:`~.fa3_vertical.load_sgl_kernel_fa3`)."""
    return load_sgl_kernel_fa3(device, "flash_attn_varlen_func")


def dense_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    return_softmax_lse=False,
    out=None,
    **_,
):
    """``flash_attn_varlen_func`` as :func:`dense_attention` and :func:`~.fa3_band.fa3_band` call it, in
    torch: per sequence, its rows of ``q [T, Hq, D]`` against its keys of ``k, v [Nk, Hk, D]``, query ``i``
    of ``n`` aligned to key ``m - n + i`` of ``m`` and seeing the keys up to it (``causal``), and from
    ``window_size[0]`` keys before it (``>= 0``: FA3's sliding window). With ``return_softmax_lse``
    returns ``(out, lse)``, the log-sum-exp ``[Hq, T]`` in float32; ``out`` given: written there."""
    if window_size[1] > 0:
        raise ValueError(f"keys after the aligned one (window_size {window_size}) are not stated here")
    T, Hq, D = q.shape
    Hk = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    if out is None:
        out = torch.empty(T, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(Hq, T, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        n, m = q1 - q0, k1 - k0
        if n > max_seqlen_q or m > max_seqlen_k:
            raise ValueError(
                f"sequence {b}: {n} rows, {m} keys over max_seqlen {max_seqlen_q}, {max_seqlen_k}"
            )
        if not n:
            continue
        kk = k[k0:k1].float().repeat_interleave(Hq // Hk, 1)
        vv = v[k0:k1].float().repeat_interleave(Hq // Hk, 1)
        s = torch.einsum("thd,nhd->htn", q[q0:q1].float(), kk) * scale
        last = m - n + torch.arange(n, device=q.device)[:, None]  # each query's own key index
        j = torch.arange(m, device=q.device)[None, :]
        visible = torch.ones(n, m, dtype=torch.bool, device=q.device)
        if causal or window_size[1] == 0:
            visible &= j <= last
        if window_size[0] >= 0:
            visible &= j >= last - window_size[0]
        s = s.masked_fill(~visible[None], float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        out[q0:q1] = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), vv).to(q.dtype)
    return (out, lse) if return_softmax_lse else out


def dense_attention(
    fa3: FA3VarlenFn,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    max_q: int,
    max_k: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the packed rows ``q [N, Hq, D]`` over ``keys, values [Nk, Hk, D]``; the
    indptrs ``[B + 1]`` int32 on the device, ``max_q``, ``max_k`` host ints. Returns ``[N, Hq, Dv]``
    (``out``, contiguous, when given)."""
    res = fa3(
        q,
        keys,
        values,
        qo_indptr,
        kv_indptr,
        max_q,
        max_k,
        softmax_scale=sm_scale,
        causal=True,
        **({"out": out} if out is not None else {}),
    )
    return res[0] if isinstance(res, tuple) else res
