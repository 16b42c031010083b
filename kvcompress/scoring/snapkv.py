"""SnapKV: the attention of a prompt's last ``window_size`` queries, pooled along the slots (max-pooled as the
paper's LongBench runs, or averaged as kvpress and the reference code's default: ``scorer_options={"pooling":
"avg"}``), then each decode step's query (accumulated as H2O does).

The pool is centred on each slot, as the paper's. ``scorer_options={"pool_direction": "forward"}`` pools each slot
with the ``snapkv_kernel_size - 1`` slots before it instead: a question's attention lands on the key and the first
tokens of the value it asks for, and the answer then reads the value forward, so a high score is carried over the
slots that follow it rather than half of it spent on the text before the value (a long value, such as a UUID,
keeps its end).
"""

from __future__ import annotations

import torch

from .accumulated import AccumulatedAttention
from .base import AttentionCall


class SnapKV(AccumulatedAttention):
    name = "snapkv"
    uses_window = True
    options = {"pooling": "max", "pool_direction": "centred"}
    choices = {"pooling": ("max", "avg"), "pool_direction": ("centred", "forward")}

    def observed_queries(self, new_valid: torch.Tensor, replay: bool) -> torch.Tensor:
        length = new_valid.shape[-1]
        window = self.parameters.window_size
        if length <= window:
            return new_valid
        return new_valid & (torch.arange(length, device=new_valid.device) >= length - window)

    def first_observed(self, length: int) -> int:
        return max(0, length - self.parameters.window_size)

    def pooling(self, call: AttentionCall) -> tuple[str, int, str] | None:
        if call.length == 1:
            return None
        return self.settings["pooling"], self.parameters.snapkv_kernel_size, self.settings["pool_direction"]
