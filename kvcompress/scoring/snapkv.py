"""SnapKV: the attention of a prompt's last ``window_size`` queries, pooled along the slots (max-pooled as the
paper's LongBench runs, or averaged as kvpress and the reference code's default: ``scorer_options={"pooling":
"avg"}``), then each decode step's query (accumulated as H2O does)."""

from __future__ import annotations

import torch

from .accumulated import AccumulatedAttention
from .base import AttentionCall


class SnapKV(AccumulatedAttention):
    name = "snapkv"
    uses_window = True
    options = {"pooling": "max"}
    choices = {"pooling": ("max", "avg")}

    def observed_queries(self, new_valid: torch.Tensor, replay: bool) -> torch.Tensor:
        length = new_valid.shape[-1]
        window = self.parameters.window_size
        if length <= window:
            return new_valid
        return new_valid & (torch.arange(length, device=new_valid.device) >= length - window)

    def first_observed(self, length: int) -> int:
        return max(0, length - self.parameters.window_size)

    def pooling(self, call: AttentionCall) -> tuple[str, int] | None:
        return (self.settings["pooling"], self.parameters.snapkv_kernel_size) if call.length > 1 else None
