"""TOVA (token omission via attention): keep what the newest query attends to most.

A slot's score is the attention of the last real query of the latest forward (the prompt's last token, then
each decoded token), averaged over all query heads of the layer and shared by every KV head, so the layer's
heads keep the same slots (TOVA is layer-shared by construction). Each forward's scores replace the earlier
ones, as the original re-ranks the whole cache at every step.
"""

from __future__ import annotations

import torch

from ..kernels.attention import observed_attention
from .base import AttentionCall, Scorer


class TOVA(Scorer):
    name = "tova"
    combine = "replace"

    def observed_queries(self, new_valid: torch.Tensor, replay: bool) -> torch.Tensor:
        """The last real query of each sequence (the last position under left padding)."""
        last = new_valid.long().cumsum(-1).argmax(-1, keepdim=True)  # first index holding the final count
        return torch.zeros_like(new_valid).scatter_(-1, last, True) & new_valid

    def first_observed(self, length: int) -> int:
        return length - 1  # left padding: the last position is always a real token

    def attend(self, call: AttentionCall, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        summed, output = observed_attention(
            call.queries, call.keys, call.slot_valid, call.observed, call.scaling, softcap=call.softcap,
            values=call.values if call.may_fuse and call.length == 1 else None, all_live=call.all_live,
            first_row=self.first_observed(call.length), coded=call.coded,
        )
        head_mean = summed.sum(1, keepdim=True) / call.queries.shape[1]
        return head_mean.expand_as(summed).contiguous(), output
