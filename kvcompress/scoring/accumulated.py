"""Accumulated attention (H2O, SnapKV): the attention each slot receives, summed over the observed queries.

The shared part of the two methods, which differ only in which queries they observe and whether a prompt's
window is pooled. Scores add up over forwards (``combine = "add"``); at eviction ``score_aggregation``
turns them into the ranking score: ``sum`` ranks by total attention received, which favours old tokens that
had more steps to collect it (H2O); ``norm_sum`` divides by the number of queries that observed each slot.
"""

from __future__ import annotations

import torch

from ..kernels.attention import observed_attention
from ..slots import by_head
from .base import AttentionCall, Scorer


class AccumulatedAttention(Scorer):
    combine = "add"

    def pooling(self, call: AttentionCall) -> tuple[str, int, str] | None:
        """How a prompt's window scores are pooled along the slots (``"max"`` or ``"avg"``, kernel, ``"centred"`` or
        ``"forward"``); None: not."""
        return None

    def attend(self, call: AttentionCall, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        pool = self.pooling(call)
        # a pooled window keeps the original attention for the output and scores beside it
        fuse = call.may_fuse and pool is None
        return observed_attention(
            call.queries, call.keys, call.slot_valid, call.observed, call.scaling, softcap=call.softcap,
            pooling=pool, values=call.values if fuse else None, all_live=call.all_live, coded=call.coded,
            first_row=self.first_observed(call.length),
        )

    def eviction_scores(self, layer, keys, values, slot_valid) -> torch.Tensor:
        if self.parameters.score_aggregation == "norm_sum":
            return layer.head_scores / by_head(layer.counts).clamp(min=1.0)
        return layer.head_scores
