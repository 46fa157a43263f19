"""FlashInfer decode over the folded-head paged layout (same contract as
:func:`sglang_wgkv.attention.reference.paged_decode_attention`).

B requests x H_kv KV heads become ``S = B * H_kv`` sequences with one KV head each; sequence
``s = b * H_kv + h`` owns query heads ``h*group .. (h+1)*group - 1``, so q ``[B, Hq, D]`` is read as
``[S, group, D]`` without a copy, and FlashInfer's ragged page lists carry the per-head lengths.

Host syncs: :meth:`FoldedPagedDecode.plan` needs the page counts on the host (``kv_indptr``): pass it
as a CPU tensor (the scheduler's copy) and nothing syncs; ``kv_indices`` and ``kv_last_page_len``
may stay on the GPU. FlashInfer's split-kv schedule depends only on the page counts, so the lengths
in the last page may change between runs without a new plan (:attr:`last_page_len` buffer).
"""

import math

import torch

from sglang_wgkv.config import PAGE_SIZE

_DECODE_GROUPS = (1, 2, 3, 4, 8)  # group sizes FlashInfer 0.6's CUDA-core decode kernels are built for


class FoldedPagedDecode:
    """Plan once per batch and page structure, run once per layer that shares it.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim : attention shape of the model (``num_q_heads % num_kv_heads == 0``).
    max_batch_size : most requests per batch; buffers hold ``max_batch_size * num_kv_heads`` sequences.
    max_pages : most pages listed by one plan (sum over the folded sequences).
    float_workspace : FlashInfer's split-kv scratch (``>= 128 MiB`` recommended, zero-initialised);
        may be shared by wrappers whose runs do not overlap (one stream).

    The buffers FlashInfer reads are owned here (FlashInfer's CUDA-graph mode), so :meth:`run` can be
    captured in a CUDA graph: a replay reads whatever the last :meth:`plan` for that batch size wrote.
    Like FlashInfer's own ``plan``, a new plan must not be issued while runs of the previous plan of
    this object are still to be enqueued.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_batch_size: int,
        max_pages: int,
        device: torch.device | str,
        q_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
        sm_scale: float | None = None,
        float_workspace: torch.Tensor | None = None,
    ):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group = num_q_heads // num_kv_heads
        if self.group not in _DECODE_GROUPS:
            raise ValueError(
                f"GQA group {self.group} not among FlashInfer's CUDA-core decode groups {_DECODE_GROUPS}"
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype or q_dtype
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.max_seqs = max_batch_size * num_kv_heads
        self.max_pages = max_pages
        self.workspace = (
            float_workspace
            if float_workspace is not None
            else torch.zeros(128 << 20, dtype=torch.uint8, device=self.device)
        )
        self._indptr = torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=self.device)
        self._indices = torch.zeros(max(max_pages, 1), dtype=torch.int32, device=self.device)
        self._last = torch.ones(self.max_seqs, dtype=torch.int32, device=self.device)
        self._host_ones = torch.ones(self.max_seqs, dtype=torch.int32)
        self._wrappers = {}
        self._num_seqs = None

    def _wrapper(self, num_seqs: int):
        w = self._wrappers.get(num_seqs)
        if w is None:
            import flashinfer

            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=self._indptr[: num_seqs + 1],
                paged_kv_indices_buffer=self._indices,
                paged_kv_last_page_len_buffer=self._last[:num_seqs],
            )
            self._wrappers[num_seqs] = w
        return w

    @property
    def last_page_len(self) -> torch.Tensor:
        """``[S]`` device buffer of the current plan; may be rewritten in place (same page counts)."""
        return self._last[: self._num_seqs]

    @property
    def indices_buffer(self) -> torch.Tensor:
        """``[max_pages]`` device buffer the runs read page ids from."""
        return self._indices

    def plan(
        self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor | None, kv_last_page_len: torch.Tensor | None
    ) -> None:
        """Parameters
        ----------
        kv_indptr : ``[S + 1]`` int32, ``S = B * num_kv_heads``; on the CPU (a CUDA tensor is copied
            to the host: one sync).
        kv_indices : ``[>= kv_indptr[-1]]`` int32 page ids, any device (entries past nnz ignored), or
            None when the caller writes :attr:`indices_buffer` itself before the runs (e.g. inside a
            captured graph).
        kv_last_page_len : ``[S]`` int32 tokens in each sequence's last page (``1..16``), any device,
            or None when the caller writes :attr:`last_page_len` before the runs.
        """
        S = kv_indptr.numel() - 1
        if S <= 0 or S % self.num_kv_heads or S > self.max_seqs:
            raise ValueError(
                f"kv_indptr must be [B * {self.num_kv_heads} + 1] with B <= "
                f"{self.max_seqs // self.num_kv_heads}, got {tuple(kv_indptr.shape)}"
            )
        for name, t in (
            ("kv_indptr", kv_indptr),
            ("kv_indices", kv_indices),
            ("kv_last_page_len", kv_last_page_len),
        ):
            if t is not None and t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        if kv_indices is None:
            kv_indices = self._indices
        if kv_last_page_len is not None and kv_last_page_len.shape != (S,):
            raise ValueError(f"kv_last_page_len must be [{S}], got {tuple(kv_last_page_len.shape)}")
        indptr = kv_indptr.cpu()
        nnz = int(indptr[-1])
        if nnz > self.max_pages or kv_indices.numel() < nnz:
            raise ValueError(
                f"{nnz} pages listed: kv_indices has {kv_indices.numel()}, max_pages {self.max_pages}"
            )
        w = self._wrapper(S)
        # FlashInfer's CUDA-core decode plan reads only the page counts; the dummy lengths it copies
        # are overwritten below (stream-ordered), so a device kv_last_page_len costs no sync.
        w.plan(
            indptr,
            kv_indices[:nnz],
            self._host_ones[:S],
            self.group,
            1,
            self.head_dim,
            PAGE_SIZE,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=self.sm_scale,
        )
        if kv_last_page_len is not None:
            self._last[:S].copy_(kv_last_page_len, non_blocking=True)
        self._num_seqs = S

    def run(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q ``[B, Hq, D]``; k_pages, v_pages ``[P, 16, D]`` (the pool). Returns ``[B, Hq, D]``."""
        if self._num_seqs is None:
            raise RuntimeError("run() before plan()")
        S, D = self._num_seqs, self.head_dim
        B = S // self.num_kv_heads
        if q.shape != (B, self.num_q_heads, D) or q.dtype != self.q_dtype:
            raise ValueError(
                f"q must be {self.q_dtype} [{B}, {self.num_q_heads}, {D}], got {q.dtype} {tuple(q.shape)}"
            )
        if k_pages.shape != v_pages.shape or k_pages.dim() != 3 or k_pages.shape[1:] != (PAGE_SIZE, D):
            raise ValueError(
                f"k_pages/v_pages must be [P, {PAGE_SIZE}, {D}], got {tuple(k_pages.shape)}, "
                f"{tuple(v_pages.shape)}"
            )
        if k_pages.dtype != self.kv_dtype or q.device != self.device or k_pages.device != self.device:
            raise ValueError("k_pages dtype/device do not match the wrapper")
        qf = q.reshape(S, self.group, D)
        o = self._wrappers[S].run(
            qf,
            (k_pages.unsqueeze(2), v_pages.unsqueeze(2)),
            out=None if out is None else out.view(S, self.group, D),
        )
        return o.view(B, self.num_q_heads, D)


def folded_paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """One-shot plan + run with the reference's signature (tests, single layers).

    q ``[B, Hq, D]``; k_pages/v_pages ``[P, 16, D]``; kv_indptr ``[B*Hkv + 1]``; kv_indices;
    kv_last_page_len ``[B*Hkv]``. Returns ``[B, Hq, D]``.
    """
    B, Hq, D = q.shape
    S = kv_indptr.numel() - 1
    if S % B:
        raise ValueError(f"kv_indptr has {S} sequences, not a multiple of the batch {B}")
    indptr = kv_indptr.to(torch.int32).cpu()
    dec = FoldedPagedDecode(
        Hq, S // B, D, B, max(int(indptr[-1]), 1), q.device, q.dtype, k_pages.dtype, sm_scale
    )
    dec.plan(indptr, kv_indices.to(torch.int32), kv_last_page_len.to(torch.int32))
    return dec.run(q, k_pages, v_pages)
