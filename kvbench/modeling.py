"""Loading the experiment's model and tokenizer onto this rank's device."""

from __future__ import annotations

from typing import Any

import torch

from .experiment import ModelSpec
from .sharding import Shard

__all__ = ["computed_dtype", "load_model", "input_device"]


def _device(shard: Shard) -> torch.device:
    """One model per process: ``cuda:LOCAL_RANK`` when there is a GPU, else the CPU."""
    return torch.device(f"cuda:{shard.local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def _embedded(spec: ModelSpec) -> bool:
    from kvcompress.models import DEFAULT_ALIAS, model_names

    return spec.path in (DEFAULT_ALIAS, *model_names())


def computed_dtype(spec: ModelSpec, shard: Shard) -> str:
    """The dtype the model computes in, known before it loads: ``auto`` of an embedded model is the machine's
    (``kvcompress.models.default_dtype``); elsewhere the config's value (``auto``: the checkpoint's own)."""
    if spec.dtype != "auto" or not _embedded(spec):
        return spec.dtype
    from kvcompress.models import default_dtype

    return str(default_dtype(_device(shard))).removeprefix("torch.")


def load_model(spec: ModelSpec, shard: Shard) -> tuple[Any, Any]:
    """Returns ``(model, tokenizer)`` in eval mode. ``device_map`` (e.g. ``auto``) spreads a model too large for
    one device and then replaces the per-rank placement."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = spec.dtype if spec.dtype == "auto" else getattr(torch, spec.dtype)
    if _embedded(spec):  # an embedded model, by name
        from kvcompress.models import load_model as load_embedded

        model, tokenizer = load_embedded(
            spec.path, dtype=getattr(torch, computed_dtype(spec, shard)),
            attn_implementation=spec.attn_implementation,
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec.path)
        model = AutoModelForCausalLM.from_pretrained(
            spec.path, dtype=dtype, attn_implementation=spec.attn_implementation, device_map=spec.device_map
        )
    if spec.device_map is None:
        model = model.to(_device(shard))
    if model.generation_config.pad_token_id is None:  # silences generate()'s per-call warning; batch size is 1
        model.generation_config.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
    return model.eval(), tokenizer


def input_device(model: Any) -> torch.device:
    """Where the prompt's ids must go: the embedding's device, also under a multi-device ``device_map``."""
    return model.get_input_embeddings().weight.device
