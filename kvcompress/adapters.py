"""Per-architecture facts the hooks need, gathered in one place so that scoring stays model-agnostic.

Scores are recomputed from the attention module's own weights (no eager attention required), so the adapter
must reproduce exactly how each architecture forms its queries: a plain ``q_proj``, a fused ``qkv_proj``
(Phi-3), a per-head ``q_norm`` (Qwen3, Gemma 3), its own ``apply_rotary_pos_emb`` (partial rotary on Phi-3),
its scaling and Gemma 2's logit soft-capping.
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


def rotary_function(module: nn.Module) -> Callable:
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


def project_queries(
    module: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Queries with RoPE, shape (B, H_q, q, d), exactly as the module's forward computes them."""
    batch, length, _ = hidden_states.shape
    head_dim = module.head_dim
    if hasattr(module, "q_proj"):
        queries = module.q_proj(hidden_states)
    else:  # Phi-3: fused projection, queries first
        num_heads = module.config.num_attention_heads
        queries = module.qkv_proj(hidden_states)[..., : num_heads * head_dim]
    queries = queries.view(batch, length, -1, head_dim)
    if hasattr(module, "q_norm"):
        queries = module.q_norm(queries)
    queries = queries.transpose(1, 2)
    cos, sin = position_embeddings
    rotated, _ = rotary_function(module)(queries, queries, cos, sin)
    return rotated


def attention_logits(module: nn.Module, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scaled (and soft-capped where the model does it) logits, float32, shape (B, H_kv, G, q, T).

    Query heads are grouped by their KV head instead of repeating the keys, so GQA costs no key copy.
    """
    batch, num_q_heads, length, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    grouped = queries.view(batch, num_kv_heads, num_q_heads // num_kv_heads, length, head_dim)
    logits = torch.matmul(grouped, keys.unsqueeze(2).transpose(-1, -2)).float() * module.scaling
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def value_projection_weight(module: nn.Module) -> torch.Tensor:
    return module.o_proj.weight
