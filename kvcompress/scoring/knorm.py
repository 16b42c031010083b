"""Knorm: keep the keys with the smallest L2 norm (arXiv 2406.11430).

Low-norm keys were found to draw high attention; the score needs no query and no extra pass, and is unchanged
by RoPE or rerotation (rotations keep norms). Computed from the cached keys at each eviction, in float32 (in
bfloat16 many norms tie).
"""

from __future__ import annotations

import torch

from .base import Scorer


class Knorm(Scorer):
    name = "knorm"

    def eviction_scores(self, layer, keys, values, slot_valid) -> torch.Tensor:
        return -torch.linalg.vector_norm(keys.float(), dim=-1)
