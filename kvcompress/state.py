"""What the compressor remembers per sequence (shared by all layers) and per compressed layer.

Every tensor here is indexed by physical cache slot, so one gather with the kept indices compacts the cache and
its bookkeeping together.

The slot layout is the same in every compressed layer: all layers keep the same number of slots per sequence,
and slots that hold no live token of a sequence (left padding, or filler when a sequence keeps fewer tokens than
the widest one in the batch) sit at the left, exactly like left padding. So one 2-D attention mask describes
every compressed layer, and transformers' own mask code stays correct after eviction.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class SequenceState:
    """Per-sequence facts, identical for every compressed layer."""

    cache_id: int  # id() of the transformers cache these facts describe
    seen: torch.Tensor  # (B,) int64: real tokens processed so far (the next true position)
    slot_valid: torch.Tensor  # (B, T) bool: the slot holds a live token of the sequence
    forward_valid: torch.Tensor | None = None  # (B, q) bool: which tokens of the current forward are real
    forward_positions: torch.Tensor | None = None  # (B, q) int64: RoPE positions the current forward uses
    forward_true_positions: torch.Tensor | None = None  # (B, q) int64: their positions in the full sequence
    total: int = 0  # slots ever appended, padding included (the length of generate's 2-D mask)
    evictions: int = 0

    @property
    def live(self) -> torch.Tensor:
        return self.slot_valid.sum(-1)


@dataclasses.dataclass
class LayerState:
    """Accumulated importance of every slot of one layer."""

    head_scores: torch.Tensor  # (B, H_kv, T) float32: summed attention per KV head
    counts: torch.Tensor  # (B, T) float32: how many observed queries could see the slot (norm_sum divisor)
    rope_positions: torch.Tensor  # (B, T) int64: position the cached key is currently rotated to
    true_positions: torch.Tensor  # (B, T) int64: the slot's position in the full sequence
    value_norms: torch.Tensor | None = None  # (B, T) float32: mean over heads of ||v W_o||_1 (CriticalKV)

    @property
    def length(self) -> int:
        return self.counts.shape[-1]

    def append(self, step_head_scores, step_counts, rope_positions, true_positions, value_norms=None) -> None:
        """Add one forward's observations: old slots accumulate, new slots are appended."""
        old = self.length
        self.head_scores = torch.cat(
            [self.head_scores + step_head_scores[..., :old], step_head_scores[..., old:]], dim=-1
        )
        self.counts = torch.cat([self.counts + step_counts[..., :old], step_counts[..., old:]], dim=-1)
        self.rope_positions = torch.cat([self.rope_positions, rope_positions], dim=-1)
        self.true_positions = torch.cat([self.true_positions, true_positions], dim=-1)
        if value_norms is not None:
            self.value_norms = value_norms if self.value_norms is None else torch.cat([self.value_norms, value_norms], -1)

    def gather(self, keep: torch.Tensor) -> None:
        """Keep only the slots ``keep`` (B, K), in that order."""
        self.head_scores = self.head_scores.gather(-1, keep.unsqueeze(1).expand(-1, self.head_scores.shape[1], -1))
        self.counts = self.counts.gather(-1, keep)
        self.rope_positions = self.rope_positions.gather(-1, keep)
        self.true_positions = self.true_positions.gather(-1, keep)
        if self.value_norms is not None:
            self.value_norms = self.value_norms.gather(-1, keep)

    @classmethod
    def empty(cls, batch: int, kv_heads: int, device: torch.device) -> "LayerState":
        return cls(
            head_scores=torch.zeros(batch, kv_heads, 0, device=device),
            counts=torch.zeros(batch, 0, device=device),
            rope_positions=torch.zeros(batch, 0, dtype=torch.long, device=device),
            true_positions=torch.zeros(batch, 0, dtype=torch.long, device=device),
        )
