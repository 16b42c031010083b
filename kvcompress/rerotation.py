"""RoPE delta rotation: move cached keys from the position they were encoded at to a new (compact) position.

RoPE is a rotation per position, R(a)R(b) = R(a + b), so a key encoded at position p becomes the key it would
have been at p' by applying R(p' - p). The angles are computed in float32 from the model's own ``inv_freq``
(scaled variants such as linear, llama3 and yarn are pure rotations too), without ``attention_scaling``, which
is a magnitude factor already present in the cached key.
"""

from __future__ import annotations

import torch
from torch import nn

from .adapters import rotary_function

# inv_freq of these types depends on the sequence length, so a cached key cannot be moved by a fixed rotation.
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def check_rerotation_supported(rotary_emb: nn.Module | None, model_name: str) -> None:
    if rotary_emb is None or not hasattr(rotary_emb, "inv_freq"):
        raise ValueError(f"rerotate_keys=True needs a model with rotary position embeddings; {model_name} has none")
    rope_type = getattr(rotary_emb, "rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
        raise ValueError(
            f"rerotate_keys=True is not supported for rope_type={rope_type!r}: its frequencies change with the "
            "sequence length, so a kept key is not a pure rotation of its new position"
        )


def rotate_keys(
    attention_module: nn.Module, keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Rotate ``keys`` (B, H_kv, T, d) by ``delta`` positions, in float32, with the model's own RoPE code:
    (B, T) for every head alike, or (B, H_kv, T) when each head keeps its own slots."""
    if delta.dim() == 3:  # each head a sequence of its own
        batch, heads, total, head_dim = keys.shape
        rotated = rotate_keys(attention_module, keys.reshape(batch * heads, 1, total, head_dim),
                              delta.reshape(batch * heads, total), inv_freq)
        return rotated.view(batch, heads, total, head_dim)
    angles = delta.to(torch.float32).unsqueeze(-1) * inv_freq.to(device=keys.device, dtype=torch.float32)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    rotated, _ = rotary_function(attention_module)(keys.float(), keys.float(), cos, sin)
    return rotated.to(keys.dtype)
