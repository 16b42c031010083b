"""The masks of a compressed forward: which new tokens are real, the slot layout every compressed layer shares,
the mask the decoder gets (transformers' 2-D mask in the layers' physical layout, per layer type on hybrid
models), and one layer's own additive mask where the layers' layouts differ.

Each compressed layer owns its slot layout (``CompressedLayer.slot_valid``: dead slots, left padding or filler, sit at
the left); with the same budget in every layer they all hold the same one, so one 2-D mask describes them and
transformers' own mask code stays correct after eviction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layer import CompressedLayer


def new_token_validity(mask, batch: int, length: int, seen: int, device) -> torch.Tensor:
    """Which new tokens are real. A given 2-D mask must cover the whole sequence so far plus the new tokens."""
    if mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(
            "kvcompress needs a 2-D attention_mask (batch, tokens) or none; 4-D and dict masks cannot be "
            "re-laid out after eviction"
        )
    if mask.shape[-1] != seen + length:
        raise ValueError(
            f"attention_mask covers {mask.shape[-1]} tokens, but the sequence has seen {seen} plus {length} new "
            f"ones; pass a mask over all {seen + length}"
        )
    return mask[:, -length:].to(device=device, dtype=torch.bool)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch, as ``generate`` derives them from its 2-D mask."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def shared_layout(layers: list[CompressedLayer], new_valid: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """The layout (B, T + q) every compressed layer has in this forward (its cached slots, then the new tokens)
    and whether it is all live, or None when the layers' layouts differ. One read from the device for all layers
    (on an accelerator each read waits for the work queued before it)."""
    if not any(layer.started for layer in layers):
        return new_valid, bool(new_valid.all())
    if any(not layer.started or not layer.shares_layout for layer in layers):
        return None
    first = layers[0].slot_valid
    if any(layer.tracked_slots != first.shape[-1] for layer in layers[1:]):
        return None
    layout = torch.cat([first, new_valid], dim=-1)
    others = [layer.slot_valid for layer in layers[1:]]
    same = torch.stack(others).eq(first).all() if others else layout.new_ones(())
    same, live = torch.stack([same, layout.all()]).tolist()
    return (layout, live) if same else None


def decoder_mask(decoder, tokens: torch.Tensor, given: torch.Tensor | None, shared: tuple[torch.Tensor, bool] | None,
                 cache, positions: torch.Tensor, sliding: bool):
    """The attention mask the decoder gets: none when every slot is live; the shared layout as a 2-D mask,
    padded on the left to the sequence's length (transformers reads it at kv_offset + slot,
    ``CompressedLayer.get_mask_sizes``); per layer type on hybrid models (``sliding``); None for the compressed
    layers when their layouts differ (the session's attention function masks each)."""
    compact = None
    if shared is not None:
        layout, live = shared
        if live:
            return None
        batch, length = tokens.shape[:2]
        seen = cache.get_seq_length()
        padding = torch.ones(batch, seen + length - layout.shape[-1], dtype=torch.bool, device=layout.device)
        compact = torch.cat([padding, layout], dim=-1).to(given.dtype if given is not None else torch.long)
    if sliding:
        return per_layer_type_masks(decoder, tokens, given, compact, cache, positions)
    return compact


def per_layer_type_masks(decoder, tokens, true_mask, compact_mask, cache, positions) -> dict[str, torch.Tensor]:
    """Masks for hybrid models: compressed layers index the compacted slots, sliding layers the true sequence.

    The decoders of hybrid models (Gemma 2/3, Qwen with ``layer_types``) accept this mapping in place of a 2-D
    mask, so both kinds of layer get a mask that matches their own cache.
    """
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    shape_only = torch.empty(*tokens.shape[:2], 0, dtype=decoder.embed_tokens.weight.dtype, device=tokens.device)
    common = dict(config=decoder.config, inputs_embeds=shape_only, cache=cache, position_ids=positions)
    return {
        # None: compressed layers of different lengths, each masked by the session's attention function
        "full_attention": None if compact_mask is None else create_causal_mask(attention_mask=compact_mask, **common),
        "sliding_attention": create_sliding_window_causal_mask(attention_mask=true_mask, **common),
    }


def additive_mask(layout: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """(B, 1, q, T) additive mask of one layer: a query sees the live slots up to its own (causal); a padding
    query that would see nothing sees everything instead (finite output, never read)."""
    length, total = queries.shape[2], layout.shape[-1]
    rows = torch.arange(total - length, total, device=layout.device)
    allowed = (torch.arange(total, device=layout.device)[None, :] <= rows[:, None]) & layout[:, None, :]
    allowed |= ~allowed.any(-1, keepdim=True)
    mask = torch.zeros(allowed.shape, dtype=queries.dtype, device=queries.device)
    return mask.masked_fill_(~allowed, torch.finfo(queries.dtype).min).unsqueeze(1)
