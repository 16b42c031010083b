"""H2O (heavy hitters): every query's attention, accumulated over the prompt and every decode step."""

from __future__ import annotations

import torch

from .accumulated import AccumulatedAttention


class H2O(AccumulatedAttention):
    name = "h2o"

    def observed_queries(self, new_valid: torch.Tensor, replay: bool) -> torch.Tensor:
        return new_valid
