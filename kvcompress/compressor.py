"""The entry points: ``compress(model, method, budget)`` and ``KVCacheCompressor(parameters)(model)``, both giving a
``CompressionSession`` (``session.py``) to use as a context manager."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from .budget import FractionalBudget, parse_budget
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
        return CompressionSession(model, self.parameters, self.tokenizer,
                                  recipe={"parameters": self.parameters.to_dict()})


def compress(
    model: nn.Module, method: str = "snapkv", budget: int | float | str = 0.2, tokenizer: Any = None,
    **overrides: Any,
) -> "CompressionSession":
    """The one-line entry point: ``with kvcompress.compress(model, method="kvzip", budget=0.2): model.generate(...)``.

    ``method`` is a preset name (``kvcompress.method_names()``: every registered scorer and ``streaming_llm``),
    ``budget`` the slots each layer keeps: a number (``512``), or a fraction of everything each sequence has seen
    (``0.2`` or ``"20%"``), resolved again at every prompt of a chat and as decoding goes on, per sequence of a
    batch (``kvcompress.budget.BudgetPlan``). ``overrides`` set any other parameter (``strategy="per_group"``,
    ...). ``tokenizer`` serves methods that build prompts of their own (KVzip).
    """
    from .presets import NONE, preset

    if method == NONE:
        raise ValueError("method='none' keeps the full cache: run the model without kvcompress.compress")
    budget = parse_budget(budget)
    recipe = {"method": method, "budget": budget, "overrides": overrides}
    if isinstance(budget, int):
        return CompressionSession(model, preset(method, budget, **overrides), tokenizer, recipe=recipe)

    def parameters_for(slots: int) -> KVCacheCompressionParameters:
        return preset(method, slots, **overrides)

    fraction = FractionalBudget.of(budget, parameters_for)
    return CompressionSession(model, parameters_for(fraction.slots(1024)), tokenizer, fraction, recipe)


def session_from_recipe(model: nn.Module, recipe: Mapping[str, Any], tokenizer: Any = None) -> "CompressionSession":
    """A new session made as ``recipe`` (``CompressionSession.recipe``) says: ``compress``'s method, budget and
    overrides, or a ``KVCacheCompressor``'s parameters."""
    if "parameters" in recipe:
        return KVCacheCompressor(recipe["parameters"], tokenizer)(model)
    return compress(model, recipe["method"], recipe["budget"], tokenizer, **recipe["overrides"])
