"""The mixed step of :class:`~sglang_wgkv.memory.dual_pool.DualCachePool`: one forward that extends
some requests (prefill chunks) and decodes others (SGLang's ``--enable-mixed-chunk``).

A decode row of a mixed batch is, to SGLang, an extend of one token after ``seq_len - 1`` cached ones.
Here it stays a decode row: its step is :meth:`~.decode_step.DecodeStep.begin_decode` (ring page,
lazy promotion of its ring victim in every layer) and its attention reads its pages in place, as in
a decode forward. Taken as a one-token extend it would leave the same state (the one token leaving
the ring is promoted iff its flag is set, the new one lands in slot ``pos % W``) but every layer
would gather its whole cached context into the prefill attention's key list: a copy of each decode
row's context per layer, and a host sync when one has global entries.

Both plans live through the forward; they touch disjoint request slots and share only the
allocator::

    begin_mixed            once: reserve both worst cases, begin_extend (prefill rows), begin_decode
                           (decode rows; promotes every layer's victims now)
    per layer              write_extend / extend_inputs (prefill rows) and write_decode* /
                           decode_page_rows (decode rows), in either order

A part of the pool (a base class of ``DualCachePool``): it reads and writes only the pool's own state.
"""

import numpy as np
import torch

from sglang_wgkv.memory.decode_step import DecodePlan
from sglang_wgkv.memory.extend_plan import ExtendPlan


class MixedStep:
    """``begin_mixed`` once per mixed forward; the per-layer writes are those of the extend and the
    decode step; ``mixed_worst_case`` is the scheduler's worst case for such a forward."""

    def mixed_worst_case(self, prefix_lens, extend_lens, decode_lens) -> int:
        """Pages :meth:`begin_mixed` reserves: :meth:`extend_bound` of every prefill row (what the
        scheduler's guards count for a chunk) plus :meth:`decode_worst_case` of the decode rows."""
        ext = sum(self.extend_bound(int(S), int(n)) for S, n in zip(prefix_lens, extend_lens))
        return ext + self.decode_worst_case(decode_lens)

    def begin_mixed(
        self,
        ext_slots,
        prefix_lens,
        extend_lens,
        dec_slots,
        dec_lens,
        dec_slots_dev: torch.Tensor | None = None,
        dec_lens_dev: torch.Tensor | None = None,
    ) -> tuple[ExtendPlan, DecodePlan]:
        """Prepare a forward that extends ``ext_slots`` by ``extend_lens`` after ``prefix_lens`` cached
        tokens and decodes ``dec_slots`` at positions ``dec_lens`` (= their cached lengths).

        Raises ValueError (a slot in both parts, or a row ``begin_extend`` / ``begin_decode`` refuses)
        or PoolExhausted (both steps' worst cases do not fit), nothing modified either way. ``dec_*_dev``: optional device copies of the decode
        rows' host lists (as :meth:`begin_decode`'s)."""
        ext_slots, dec_slots = list(map(int, ext_slots)), list(map(int, dec_slots))
        both = set(ext_slots) & set(dec_slots)
        if both:
            raise ValueError(f"request slots {sorted(both)} both extend and decode in one forward")
        if not ext_slots or not dec_slots:
            raise ValueError("a mixed forward has prefill rows and decode rows")
        self.check_decode_rows(dec_slots, dec_lens)  # begin_extend checks its own rows before any change
        self.allocator.ensure(self.mixed_worst_case(prefix_lens, extend_lens, np.asarray(dec_lens)))
        extend = self.begin_extend(ext_slots, prefix_lens, extend_lens)
        decode = self.begin_decode(
            dec_slots, dec_lens, req_slots_dev=dec_slots_dev, seq_lens_dev=dec_lens_dev
        )
        self._extend = extend  # begin_decode ended the extend plan; this forward runs both
        self.mixed_forwards += 1
        self.mixed_prefill_tokens_max = max(self.mixed_prefill_tokens_max, sum(extend.extend_lens))
        return extend, decode
