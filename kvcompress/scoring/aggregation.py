"""Turning accumulated attention into the score eviction ranks by (reference §4).

``sum`` ranks by total attention received, which favours old tokens that had more steps to collect it (H2O).
``norm_sum`` divides by the number of queries that observed each slot: mean attention per observing query.
"""

from __future__ import annotations

import torch

from ..state import LayerState


def head_eviction_scores(state: LayerState, aggregation: str) -> torch.Tensor:
    """Per-KV-head score (B, H_kv, T), float32."""
    if aggregation == "norm_sum":
        return state.head_scores / state.counts.clamp(min=1.0).unsqueeze(1)
    return state.head_scores
