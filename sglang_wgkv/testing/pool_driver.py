"""Drives a DualCachePool the way an attention backend does, over synthetic per-layer q/k/v."""

import torch

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention.reference import paged_decode_attention, vertical_slash_attention


def run_extend(pool, slots, prefix_lens, extend_lens, q, k, v, admit, window):
    """q: [L, N, Hq, D] packed over requests; returns [L, N, Hq, D]."""
    plan = pool.begin_extend(slots, prefix_lens, extend_lens)
    outs = []
    for layer in range(q.shape[0]):
        out = torch.empty_like(q[layer])
        off = 0
        for b, (r, S, n) in enumerate(zip(slots, prefix_lens, extend_lens)):
            # the served path reads the context with the plan's host-known page columns (no sync)
            ck, cv, cpos, cadm = pool.gather_context(layer, r, S, plan.context_gcols[b][layer])
            exact = pool.gather_context(layer, r, S)
            assert all(torch.equal(a, e) for a, e in zip((ck, cv, cpos, cadm), exact)), (layer, r, S)
            kk = torch.cat([ck, k[layer, off : off + n].to(ck.dtype)])
            vv = torch.cat([cv, v[layer, off : off + n].to(cv.dtype)])
            pos = torch.arange(S, S + n)
            kpos = torch.cat([cpos, pos])
            adm = torch.cat([cadm, admit[layer, off : off + n]])
            out[off : off + n] = vertical_slash_attention(
                q[layer, off : off + n],
                kk,
                vv,
                adm,
                torch.tensor([0, n]),
                torch.tensor([0, kk.shape[0]]),
                pos,
                kpos,
                window,
            )
            off += n
        pool.write_extend(layer, k[layer], v[layer], admit[layer])
        outs.append(out)
    return torch.stack(outs)


def run_decode(pool, slots, seq_lens, q, k, v, admit):
    """One decode step: q [L, B, Hq, D], k/v [L, B, H, D], admit [L, B, H] -> [L, B, Hq, D]."""
    pool.begin_decode(slots, seq_lens)
    outs = []
    for layer in range(q.shape[0]):
        pool.write_decode(layer, k[layer], v[layer], admit[layer])
        rows, num_pages, last, _ = pool.decode_page_rows(layer)
        indptr, indices, last_len = build_folded_indices(rows, num_pages, last)
        outs.append(paged_decode_attention(q[layer], pool.k_pages, pool.v_pages, indptr, indices, last_len))
    return torch.stack(outs)
