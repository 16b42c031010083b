"""The entry points: ``compress(model, method, budget)`` and ``KVCacheCompressor(parameters)(model)``, both giving a
``CompressionSession`` (``session.py``) to use as a context manager."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from .budget import budget_slots, check_budget
from .parameters import KVCacheCompressionParameters
from .session import CompressionSession


class KVCacheCompressor:
    """Compress the KV cache of a transformers model while it runs.

    >>> with KVCacheCompressor(eviction_parameters=params)(model):
    ...     model.generate(**inputs)
    """

    def __init__(
        self,
        eviction_parameters: KVCacheCompressionParameters | Mapping[str, Any] | None = None,
        tokenizer: Any = None,
    ):
        """``tokenizer``: the model's, for methods that build prompts of their own (KVzip's reconstruction
        request); when absent they load it from the model's folder (``model.name_or_path``) if they need it."""
        if eviction_parameters is None:
            eviction_parameters = KVCacheCompressionParameters()
        elif isinstance(eviction_parameters, Mapping):
            eviction_parameters = KVCacheCompressionParameters.from_dict(eviction_parameters)
        elif not isinstance(eviction_parameters, KVCacheCompressionParameters):
            raise TypeError(
                "eviction_parameters must be a KVCacheCompressionParameters or a mapping of its fields, got "
                f"{type(eviction_parameters).__name__}"
            )
        self.parameters = eviction_parameters
        self.tokenizer = tokenizer

    def __call__(self, model: nn.Module) -> "CompressionSession":
        return CompressionSession(model, self.parameters, self.tokenizer)


def compress(
    model: nn.Module, method: str = "snapkv", budget: int | float = 0.2, tokenizer: Any = None, **overrides: Any
) -> "CompressionSession":
    """The one-line entry point: ``with kvcompress.compress(model, method="kvzip", budget=0.2): model.generate(...)``.

    ``method`` is a preset name (``kvcompress.presets.method_names()``: every registered scorer and
    ``streaming_llm``), ``budget`` the slots each layer keeps: a number, or a fraction of each prompt's tokens
    (applied per sequence of a batch). ``overrides`` set any other parameter (``strategy="per_group"``, ...).
    ``tokenizer`` serves methods that build prompts of their own (KVzip).
    """
    from .presets import NONE, preset

    if method == NONE:
        raise ValueError("method='none' keeps the full cache: run the model without kvcompress.compress")
    check_budget(budget)
    if isinstance(budget, int):
        return CompressionSession(model, preset(method, budget, **overrides), tokenizer)

    def prompt_budget(tokens: int) -> int:
        return budget_slots(budget, tokens)

    def prompt_parameters(tokens: int) -> KVCacheCompressionParameters:
        return preset(method, prompt_budget(tokens), **overrides)

    nominal = prompt_parameters(1024)  # validates the method and overrides before any prompt arrives
    return CompressionSession(model, nominal, tokenizer, prompt_budget, prompt_parameters)
