"""Per-architecture facts the hooks need, gathered in one place so that scoring stays model-agnostic.

Scores come from the module's own post-RoPE queries (handed over by the session's attention function), so
the adapter only locates the decoder, its attention modules, sliding-window layers and rotary embedding, and
the functions rerotation and CriticalKV reuse (each model file's ``apply_rotary_pos_emb``, ``o_proj``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

import torch
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma3_text")


@dataclasses.dataclass
class ModelLayout:
    """Where the pieces of a supported decoder live."""

    decoder: nn.Module  # the module that owns `layers`, `rotary_emb` and receives input_ids / attention_mask
    attention_modules: list[nn.Module]  # one per decoder layer, in layer order
    sliding_layers: frozenset[int]  # layer indices whose cache is a sliding window (never compressed)
    rotary_emb: nn.Module | None
    # the full-attention layers, in order: the ones kvcompress compresses (asked for on every forward)
    compressed_layers: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.compressed_layers = [i for i in range(len(self.attention_modules)) if i not in self.sliding_layers]


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def inspect_model(model: nn.Module) -> ModelLayout:
    """Validate that ``model`` is a supported decoder and locate its attention modules."""
    config = text_config(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"kvcompress does not support model_type {model_type!r} ({type(model).__name__}); supported "
            f"architectures: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    decoder = None
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and hasattr(module, "embed_tokens"):
            decoder = module
            break
    if decoder is None:
        raise ValueError(f"could not find the decoder layers of {type(model).__name__}")
    attention = [layer.self_attn for layer in decoder.layers]
    for index, module in enumerate(attention):
        if getattr(module, "layer_idx", index) != index:
            raise ValueError(f"attention module {index} reports layer_idx={module.layer_idx}")
    return ModelLayout(
        decoder=decoder,
        attention_modules=attention,
        sliding_layers=frozenset(_sliding_layer_indices(config)),
        rotary_emb=getattr(decoder, "rotary_emb", None),
    )


def _sliding_layer_indices(config) -> list[int]:
    """Mirror how transformers' DynamicCache decides which layers get a sliding-window cache."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        window = getattr(config, "sliding_window", None)
        layer_types = ["sliding_attention" if window is not None else "full_attention"] * config.num_hidden_layers
    return [i for i, kind in enumerate(layer_types) if kind != "full_attention"]


def full_attention_inv_freq(rotary_emb: nn.Module | None) -> torch.Tensor | None:
    """The RoPE frequencies of the full-attention (compressed) layers: Gemma 3 keeps one set per layer type."""
    if rotary_emb is None:
        return None
    return getattr(rotary_emb, "full_attention_inv_freq", getattr(rotary_emb, "inv_freq", None))


def rotary_function(module: nn.Module) -> Callable:
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


def value_projection_weight(module: nn.Module) -> torch.Tensor:
    return module.o_proj.weight
