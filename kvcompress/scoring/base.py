"""What a scoring method is, as the session sees it: one class per method, described by a few declarations.

A scorer answers two questions for one compressed layer:

* during each forward, through the session's attention function (``attend``): what this forward's queries say
  about every slot, and, where that is cheaper, the attention output computed in the same pass;
* at each eviction (``eviction_scores``): the per-KV-head score (B, H_kv, T) that selection ranks by, higher
  kept. Methods that look only at the cache (key norms, key diversity, expected attention) compute it here.

Its class attributes declare the rest, so the session never compares method names:

* ``combine``: how a forward's scores meet the slots' earlier ones: ``"add"`` (accumulated attention, H2O /
  SnapKV, where ``score_aggregation`` applies), ``"max"`` (the most attention a slot ever received, KVzip),
  ``"replace"`` (only the newest observation counts, TOVA) or ``"once"`` (a slot is scored when it arrives and
  keeps that score: ``attend`` returns the new slots' scores only, KVzap);
* ``reads_hidden_states``: the session hands each attention call the layer's input hidden states (KVzap);
* ``uses_window``: ``window_size`` and ``snapkv_kernel_size`` apply;
* ``reconstructs``: after a prompt the session runs the scorer's context-reconstruction passes before it evicts
  (KVzip); the prompt's own forward then evicts nothing;
* ``scores_folded_layers``: its rule applies to a folded (head-wise) layer, so a folded cache takes further
  prompts that compress again: the most attention a slot receives (KVzip), which the layer's own attention
  computes (``ragged.folded_attention``), or a score of each new token alone (``combine="once"``, KVzap), folded
  as the layer's new slots are; a method without it compresses a head-wise cache once;
* ``allocation``: the ``budget_allocation`` the method's presets use (KVzip: ``"global_adaptive"``, over every
  layer and head);
* ``options``: method-specific settings (name -> default), given as ``scorer_options`` in the parameters;
  ``minimums`` bounds the numeric ones from below, ``choices`` lists the values a string one may take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from ..layer import CompressedLayer
    from ..parameters import KVCacheCompressionParameters
    from ..quantization import CodedSlots


@dataclasses.dataclass
class AttentionCall:
    """One compressed layer's attention call in one forward, with the session's view of the slots."""

    module: nn.Module
    queries: torch.Tensor  # (B, H, q, d): the module's post-RoPE queries
    # (B, H_kv, T, d): the cache after this forward's update (its last q slots are new); of a quantized layer whose
    # oldest slots only codes hold, the slots after them (``coded`` holds the first ones: pass it on to
    # ``observed_attention``, or read ``dense_keys_values()``)
    keys: torch.Tensor
    values: torch.Tensor
    slot_valid: torch.Tensor  # (B, T) bool: live slots (padding and filler are dead)
    observed: torch.Tensor | None  # (B, q) bool: the queries the scorer observes this forward, or None
    scaling: float
    softcap: float | None
    all_live: bool  # every slot is live and every query real: masks can be skipped
    may_fuse: bool  # the caller accepts an output computed here (no dropout, no returned weights)
    positions: torch.Tensor  # (B, q) int64: the RoPE positions the queries were rotated to
    replay: bool = False  # a context-reconstruction pass (KVzip), not part of the sequence
    hidden_states: torch.Tensor | None = None  # (B, q, D): the attention module's input, for reads_hidden_states
    coded: CodedSlots | None = None  # a quantized layer's oldest slots, which only codes hold

    def dense_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's keys and values (B, H_kv, T, d) in full precision."""
        return (self.keys, self.values) if self.coded is None else self.coded.dense()

    @property
    def length(self) -> int:
        return self.queries.shape[2]


class Scorer:
    """Base class of the scoring methods; subclasses set ``name`` and override what they need."""

    name: ClassVar[str]
    combine: ClassVar[str] = "replace"
    uses_window: ClassVar[bool] = False
    reconstructs: ClassVar[bool] = False
    reads_hidden_states: ClassVar[bool] = False
    scores_folded_layers: ClassVar[bool] = False
    allocation: ClassVar[str] = "uniform"
    # selection fields the method's reference sets otherwise than ``from_budget``'s defaults (a preset applies them;
    # ``start_size`` and ``recent_size`` are at most the budget)
    reference_selection: ClassVar[dict[str, Any]] = {}
    options: ClassVar[dict[str, Any]] = {}
    minimums: ClassVar[dict[str, float]] = {}
    choices: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(self, parameters: "KVCacheCompressionParameters"):
        self.parameters = parameters
        self.settings = {**self.options, **dict(parameters.scorer_options)}

    @classmethod
    def weights_checksum(cls, model: nn.Module, scorer_options: Mapping[str, Any]) -> str | None:
        """The checksum of the learned weights this method would score ``model`` with under ``scorer_options``,
        None for a method that learns nothing: what tells results of retrained weights from their predecessors'."""
        return None

    @classmethod
    def check_options(cls, given: dict[str, Any]) -> None:
        """Unknown or mistyped ``scorer_options`` fail on construction of the parameters, naming the allowed ones."""
        unknown = sorted(set(given) - set(cls.options))
        if unknown:
            allowed = ", ".join(f"{name} (default {value!r})" for name, value in cls.options.items()) or "none"
            raise ValueError(f"scorer_options {unknown} do not apply to method={cls.name!r}; allowed: {allowed}")
        for name, value in given.items():
            default = cls.options[name]
            kind = (int, float) if isinstance(default, float) else type(default)
            if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, kind):
                raise TypeError(
                    f"scorer_options[{name!r}] for method={cls.name!r} must be {type(default).__name__}, "
                    f"got {value!r}"
                )
            if name in cls.minimums and value < cls.minimums[name]:
                raise ValueError(
                    f"scorer_options[{name!r}] for method={cls.name!r} must be >= {cls.minimums[name]}, "
                    f"got {value!r}"
                )
            if name in cls.choices and value not in cls.choices[name]:
                raise ValueError(
                    f"scorer_options[{name!r}] for method={cls.name!r} must be one of "
                    f"{', '.join(map(repr, cls.choices[name]))}, got {value!r}"
                )

    def bind(self, model: nn.Module, tokenizer: Any) -> None:
        """Called when a session attaches to ``model``: take what the method needs from the model or tokenizer."""

    def observed_queries(self, new_valid: torch.Tensor, replay: bool) -> torch.Tensor | None:
        """Which queries of a forward (B, q) this method observes; None: it reads no query (the default)."""
        return None

    def first_observed(self, length: int) -> int:
        """A forward index no observed query precedes, known without reading ``observed_queries``' tensor (which
        would wait for an accelerator): the scoring pass starts there when it computes no output."""
        return 0

    def attend(self, call: AttentionCall, layer: "CompressedLayer") -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This forward's scores over all T slots (B, H_kv, T) float32 (over its q new slots (B, H_kv, q) when
        ``combine="once"``), or None, and the attention output (B, q, H, d) if it was computed here (else the
        model's own attention function runs)."""
        return None, None

    def reconstruct(self, decoder: nn.Module, cache: Any, tokens: torch.Tensor, selected: torch.Tensor,
                    following: torch.Tensor, sliding_layers: list[int]) -> None:
        """Run the context-reconstruction passes of a method that ``reconstructs`` (KVzip): forwards of the
        decoder over ``cache`` whose attention calls the session routes back to ``attend`` as replays."""
        raise NotImplementedError(f"{type(self).__name__} does not reconstruct the context")

    def eviction_scores(
        self, layer: "CompressedLayer", keys: torch.Tensor, values: torch.Tensor, slot_valid: torch.Tensor
    ) -> torch.Tensor:
        """The per-KV-head scores (B, H_kv, T) selection ranks by, higher kept; default: the combined scores.

        ``layer`` is the cache layer, which owns its slots' state: per-slot positions and counts are (B, T), or
        (B, H_kv, T) when each head keeps its own slots (``head_selection="per_head"``); ``kvcompress.slots.by_head``
        views either as (B, H_kv or 1, T)."""
        return layer.head_scores
