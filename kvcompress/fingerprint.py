"""What identifies a model for a stored compressed context: its architecture, the configuration fields that shape
its cache, and a checksum of the weights the cache depends on (the decoder: embeddings and every layer).

A context's keys and values are only meaningful for the weights that produced them, so a stored context names its
model and ``load`` refuses another. The checksum covers every decoder weight by its shape and an evenly spaced sample
of at most ``SAMPLE`` elements (first and last included), rounded to bfloat16, so that the same checkpoint loaded in
float32 or bfloat16 matches (the dtype is checked on its own) and a model on a GPU sends a few hundred kilobytes per
weight to the host rather than all of them. Another checkpoint, a fine-tune or a merged adapter changes every
sampled matrix; an edit of a few elements could pass unseen, which is the price of fingerprinting an 8B model in
well under a second. Identities are kept per model until a weight is replaced or written in place.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any

import torch
from torch import nn

from .adapters import inspect_model, text_config

SAMPLE = 65_536  # elements of each weight the checksum reads
# the text configuration's fields a cache's shape and meaning depend on (the dtype is checked apart)
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rope_theta", "rope_parameters", "rope_scaling", "sliding_window",
                 "layer_types", "max_position_embeddings", "query_pre_attn_scalar", "attn_logit_softcapping")

_IDENTITIES: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, dict[str, Any]]]" = weakref.WeakKeyDictionary()


def model_identity(model: nn.Module) -> dict[str, Any]:
    """``{"architecture", "config", "weights"}``: the model's class, the ``CONFIG_FIELDS`` it has (JSON values),
    and the weights' checksum (hex)."""
    decoder = inspect_model(model).decoder
    weights = [(name, parameter.detach()) for name, parameter in decoder.named_parameters()]
    key = tuple((weight.data_ptr(), weight._version) for _, weight in weights)
    cached = _IDENTITIES.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    config = text_config(model)
    fields = {name: getattr(config, name) for name in CONFIG_FIELDS if getattr(config, name, None) is not None}
    identity = {"architecture": type(model).__name__, "config": json.loads(json.dumps(fields, default=str)),
                "weights": _weights_checksum(weights)}
    _IDENTITIES[model] = key, identity
    return identity


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two identities, in words (empty when they are the same model)."""
    differences = []
    if saved.get("architecture") != current["architecture"]:
        differences.append(f"architecture {saved.get('architecture')} vs {current['architecture']}")
    saved_config = saved.get("config", {})
    for name in sorted(set(saved_config) | set(current["config"])):
        if saved_config.get(name) != current["config"].get(name):
            differences.append(f"config.{name} {saved_config.get(name)!r} vs {current['config'].get(name)!r}")
    if not differences and saved.get("weights") != current["weights"]:
        differences.append("the weights (same architecture and configuration, another checkpoint)")
    return differences


def _weights_checksum(weights: list[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, weight in weights:
        flat = weight.reshape(-1)
        if flat.numel() > SAMPLE:
            flat = flat[torch.arange(SAMPLE, device=flat.device) * (flat.numel() - 1) // (SAMPLE - 1)]
        digest.update(f"{name}:{tuple(weight.shape)}".encode())
        digest.update(flat.to(device="cpu", dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
