"""KeyDiff: keep the most distinctive keys (arXiv 2504.15364).

Per KV head, the anchor is the mean of the live slots' unit-normalised keys and a slot's score is minus its
cosine similarity to the anchor: keys unlike the rest are kept. No query is read, so it is the same for any
question; computed from the cached keys at each eviction (the anchor follows the cache as it changes).
"""

from __future__ import annotations

import torch

from .base import Scorer


class KeyDiff(Scorer):
    name = "keydiff"

    def eviction_scores(self, layer, keys, values, slot_valid) -> torch.Tensor:
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)  # (B, H_kv, T, d)
        live = slot_valid[:, None, :, None].to(unit.dtype)
        anchor = (unit * live).sum(2) / live.sum(2).clamp(min=1.0)  # (B, H_kv, d)
        cosine = torch.nn.functional.cosine_similarity(unit, anchor.unsqueeze(2), dim=-1)
        return -cosine
