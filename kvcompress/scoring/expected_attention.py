"""Expected Attention: the attention future queries are expected to pay, from the statistics of past ones
(arXiv 2510.00636; kvpress ``ExpectedAttentionPress`` defaults).

At each multi-token forward (a prompt, or a later turn) the layer's queries, rotated back to no position, give
per query head a mean μ and covariance Σ (the first ``n_sink`` positions and padding left out). Queries of the
next ``future_positions`` positions are modelled as N(R̄μ, R̄ΣR̄ᵀ), with R̄ the RoPE rotation averaged over
those positions, so a cached key k gets the log of its expected exponentiated logit,
``z = s·μ̃ᵀk + s²·kᵀΣ̃k / 2`` (s the softmax scale), and a slot's score is softmax_j z averaged over the query
heads of its KV group, times ‖v‖₂ (``value_norm``). No question is read: the scores are query-agnostic. They
are computed from the cached keys at each eviction with the statistics of the latest multi-token forward, so
decoded tokens are scored by the same expectation once they leave the recent window.
"""

from __future__ import annotations

import torch

from ..rerotation import rotate_keys
from ..slots import by_head
from .base import AttentionCall, Scorer

N_SINK = 4  # leading positions left out of the statistics and never evicted by this score (kvpress's n_sink)
STATISTICS_ELEMENTS = 1 << 24  # float32 query elements unrotated at once for the statistics (a chunk of rows)


class ExpectedAttention(Scorer):
    name = "expected_attention"
    options = {"future_positions": 512, "covariance": True, "value_norm": True, "epsilon": 0.0}
    minimums = {"future_positions": 1, "epsilon": 0.0}

    def bind(self, model, tokenizer) -> None:
        from ..adapters import full_attention_inv_freq, inspect_model

        layout = inspect_model(model)
        self.inv_freq = full_attention_inv_freq(layout.rotary_emb)
        if self.inv_freq is None:
            raise ValueError(f"method='expected_attention' needs rotary position embeddings; "
                             f"{type(model).__name__} has none")
        # the model's softmax scale, the same in every layer: known before any forward, so a cache loaded from a
        # stored context evicts at its first decode step as it would have in the process that compressed it
        self.scaling = next((layout.attention_modules[index].scaling for index in layout.compressed_layers), None)

    def observed_queries(self, new_valid: torch.Tensor, replay: bool) -> torch.Tensor | None:
        return new_valid if new_valid.shape[-1] > 1 and not replay else None

    def attend(self, call: AttentionCall, layer) -> tuple[None, None]:
        if call.observed is not None:
            layer.statistics.update(self._statistics(call))
        return None, None

    def _statistics(self, call: AttentionCall) -> dict[str, torch.Tensor]:
        """The unrotated queries' mean and covariance per query head, in two passes over chunks of rows (mean,
        then centred products): no float32 copy of all of a long prompt's queries exists at once."""
        inv_freq = self.inv_freq.to(device=call.queries.device, dtype=torch.float32)
        batch, heads, length, head_dim = call.queries.shape
        weight = (call.observed & (call.positions >= N_SINK)).float()  # (B, q)
        count = weight.sum(-1).clamp(min=1.0)[:, None, None]
        step = max(1, STATISTICS_ELEMENTS // (batch * heads * head_dim))
        chunks = [slice(start, start + step) for start in range(0, length, step)]

        def unrotated(rows: slice) -> torch.Tensor:  # (B, H, rows, d) float32 at position 0
            return rotate_keys(call.module, call.queries[:, :, rows].float(), -call.positions[:, rows], inv_freq)

        mean = sum(torch.einsum("bhqd,bq->bhd", unrotated(rows), weight[:, rows]) for rows in chunks) / count
        covariance = call.queries.new_zeros(batch, heads, head_dim, head_dim, dtype=torch.float32)
        for rows in chunks:
            centred = (unrotated(rows) - mean.unsqueeze(2)) * weight[:, None, rows, None]
            covariance += centred.transpose(-1, -2) @ centred
        covariance /= count.unsqueeze(-1)  # (B, H, d, d)
        rotation = averaged_rotation(call.positions[:, -1] + 1, self.settings["future_positions"], inv_freq,
                                     head_dim)  # (B, d, d)
        mean = torch.einsum("bij,bhj->bhi", rotation, mean)
        covariance = rotation.unsqueeze(1) @ covariance @ rotation.transpose(-1, -2).unsqueeze(1)
        if not self.settings["covariance"]:
            covariance = torch.zeros_like(covariance)
        return {"mean": mean, "covariance": covariance}

    def eviction_scores(self, layer, keys, values, slot_valid) -> torch.Tensor:
        batch, kv_heads, total, head_dim = keys.shape
        if "mean" not in layer.statistics:  # no multi-token forward yet (a one-token prompt): no information
            return torch.zeros(batch, kv_heads, total, device=keys.device)
        scale = self.scaling
        mean = layer.statistics["mean"].view(batch, kv_heads, -1, head_dim)  # (B, H_kv, G, d)
        covariance = layer.statistics["covariance"].view(batch, kv_heads, -1, head_dim, head_dim)
        keys = keys.float()
        logits = scale * torch.einsum("bkgd,bktd->bkgt", mean, keys)
        logits += (scale * scale / 2) * torch.einsum("bktd,bkgde,bkte->bkgt", keys, covariance, keys)
        sink = by_head(layer.true_positions) < N_SINK  # (B, H_kv or 1, T)
        scored = slot_valid[:, None] & ~sink
        logits.masked_fill_(~scored[:, :, None, :], float("-inf"))
        scores = torch.softmax(logits, dim=-1).nan_to_num_(0.0).mean(2)  # (B, H_kv, T)
        if self.settings["value_norm"]:
            scores = (scores + self.settings["epsilon"]) * torch.linalg.vector_norm(values.float(), dim=-1)
        top = scores.amax(-1, keepdim=True) + 1
        return torch.where(sink, top, scores)


def averaged_rotation(first: torch.Tensor, count: int, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """R̄ = mean of the RoPE rotations of positions first .. first + count - 1 (B, d, d), in transformers'
    rotate-half layout (dimension i pairs with i + r/2 among the first r = 2·len(inv_freq); the rest unrotated).

    Each R(p) is x·cos(pθ) + rotate_half(x)·sin(pθ), linear in (cos, sin): the mean is the same form with the
    mean cosine and sine.
    """
    half = inv_freq.shape[0]
    positions = first[:, None].float() + torch.arange(count, device=first.device, dtype=torch.float32)
    angles = positions[..., None] * inv_freq  # (B, F, r/2)
    cos, sin = angles.cos().mean(1), angles.sin().mean(1)  # (B, r/2)
    rotation = torch.eye(head_dim, device=first.device).repeat(first.shape[0], 1, 1)
    index = torch.arange(half, device=first.device)
    for block in (index, index + half):
        rotation[:, block, block] = cos
    rotation[:, index, index + half] = -sin  # out_i = x_i cos - x_{i+r/2} sin
    rotation[:, index + half, index] = sin  # out_{i+r/2} = x_{i+r/2} cos + x_i sin
    return rotation
