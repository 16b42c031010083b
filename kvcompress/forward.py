"""One forward of the model under a session, and each compressed layer's attention call in it, top to bottom.

The session's decoder pre-hook builds a ``Forward`` (which new tokens are real, their positions, the slot layout
every layer shares); every compressed layer's attention call then runs ``Forward.attend``:

1. the layer's slots (a layer's first forward of a sequence starts tracking them, with the plan's area for it);
2. the layer's slot layout for this forward (the shared one, else its own);
3. the attention: a folded layer's own (``ragged.folded_attention``, with the scores of a scorer whose rule it
   computes), else the scorer's pass, which returns this forward's scores and, where it computed it, the
   attention output; otherwise the model's own function;
4. the scores into the layer's state (``CompressedLayer.append_slots``; a reconstruction pass merges them and
   drops its own slots);
5. eviction: at once for a prefill's layer over budget (``selection.evict``), or marked due when the forward
   ends (a decode step's, a budget the layers share, a prompt KVzip reconstructs first).

What the forward collects (the due layers, whether a reconstruction is due, how many layers attended) is read
by the session's post-hook.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn

from .adapters import value_projection_weight
from .budget import BudgetPlan
from .kernels.attention import observation_counts
from .kernels.value_norm import projected_value_l1
from .layer import CompressedLayer
from .masks import additive_mask
from .ragged import fold_new_tokens
from .scoring.base import AttentionCall, Scorer
from .selection.evict import evict


@dataclasses.dataclass
class Forward:
    """The forward in flight: the same for every compressed layer, and what its layers leave for its end."""

    valid: torch.Tensor  # (B, q) bool: which tokens of the forward are real (not left padding)
    positions: torch.Tensor  # (B, q) int64: the RoPE positions the forward uses
    true_positions: torch.Tensor  # (B, q) int64: their positions in the uncompressed sequence
    cache: Any  # the DynamicCache the forward runs on
    scorer: Scorer
    budget: BudgetPlan
    timings: dict[str, float]
    # the layout every compressed layer shares, with this forward's tokens, and whether it is all live; None when
    # the layers' layouts differ (budgets of their own)
    layout: tuple[torch.Tensor, bool] | None = None
    replay: bool = False  # a context-reconstruction pass (KVzip): its tokens leave the cache after attention
    evicting: bool = True  # False while generate() answers after a prefilled context
    inv_freq: torch.Tensor | None = None  # the rotary frequencies, where kept keys are rerotated
    tokens: torch.Tensor | None = None  # the forward's token ids (None for embeddings), for reconstruction
    evicted: bool = False  # some layer evicted during this forward
    attended: int = 0  # compressed layers that ran this attention call
    due: list[tuple[nn.Module, CompressedLayer]] = dataclasses.field(default_factory=list)  # evict at the end
    # layer index -> its attention module's input hidden states (B, q, D), for scorers that read them
    hidden_states: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    _observation: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = dataclasses.field(
        default_factory=dict)

    @property
    def length(self) -> int:
        return self.valid.shape[-1]

    @property
    def reconstructs(self) -> bool:
        """Whether the scorer's reconstruction passes (KVzip) score this forward's tokens when it ends: every
        prompt forward that may evict, over budget or not, so that the slots of a chunk or a turn that fits its
        budget carry their scores when a later one evicts."""
        return (self.scorer.reconstructs and self.parameters.intermediate_size > 0 and self.length > 1
                and self.evicting and not self.replay)

    @property
    def parameters(self):
        return self.budget.parameters

    def attend(self, module: nn.Module, query, key, value, attention_mask, original, **kwargs):
        """The module's attention call: its output, with this forward's scores recorded (and eviction done).

        The scorer sees the module's own post-RoPE queries and the updated cache; where it computes the
        attention output in the same pass (H2O and decode steps, KVzip's reconstruction), the original function
        does not run. Training-mode calls (dropout) and calls that return attention weights always keep the
        original function for the output. Of a quantized layer, ``key`` and ``value`` hold the slots kept in full
        precision, after the oldest ones only codes hold (``layer.coded_slots``): the compiled and Triton kernels
        read those codes, the torch path and the model's own function a full-precision copy of them.
        """
        started = time.perf_counter()
        layer = self.cache.layers[module.layer_idx]
        self._start_layer(layer, module.layer_idx, key)
        coded = layer.coded_slots(key, value)
        total = key.shape[-2] if coded is None else coded.slots
        cached = total - layer.new_slots(query.shape[2])
        if layer.tracked_slots != cached:
            raise RuntimeError(
                f"kvcompress: layer {module.layer_idx} holds {cached} cached slots but its scores cover "
                f"{layer.tracked_slots}; the cache was modified outside the compressor"
            )
        self.attended += 1
        hidden_states = self.hidden_states.pop(module.layer_idx, None)  # read once: a long prompt's are large
        head_scores = None
        layout, all_live = self._layer_layout(layer)
        scaling = kwargs.get("scaling") or module.scaling
        # a folded layer (heads of their own lengths) attends itself, and scores where its scorer's rule applies
        # to it: the most attention a slot receives (KVzip's: reconstruction passes and decode steps), computed by
        # that attention, or a score of each new token alone (KVzap's), folded like the new slots
        scored = self.parameters.intermediate_size > 0  # with no scored area only fixed windows survive
        folded_rule = layer.folded_heads is not None and scored and self.scorer.scores_folded_layers
        per_token = self.scorer.combine == "once"
        folded_observed = self._observe(total)[0] if folded_rule and not per_token else None
        own = layer.own_attention(query, key, value, layout, scaling, kwargs.get("softcap"), folded_observed, all_live,
                                  coded)
        output = None
        if own is not None:
            output, head_scores = own
        if scored and (own is None or folded_rule and per_token):
            call = AttentionCall(
                module=module, queries=query, keys=key, values=value, slot_valid=layout,
                observed=self._observe(total)[0], scaling=scaling, softcap=kwargs.get("softcap"),
                all_live=all_live,
                # the caller may want the original's weights (output_attentions) or its dropout
                may_fuse=not kwargs.get("dropout") and not kwargs.get("output_attentions") and own is None,
                positions=self.positions, replay=self.replay,
                hidden_states=hidden_states, coded=coded,
            )
            head_scores, scorer_output = self.scorer.attend(call, layer)
            if own is None:
                output = scorer_output
            else:  # (B, H_kv, q) for the new tokens: one per new slot, in the folded layer's order
                head_scores = fold_new_tokens(head_scores.unsqueeze(-1)).squeeze(-1)
        if not self.replay:  # a reconstruction pass is timed as a whole ("reconstruction")
            self.timings["attention_and_scoring" if output is not None else "scoring"] += time.perf_counter() - started
        if output is None:
            if self.layout is None:  # this layer's own length: the decoder's mask cannot fit it
                attention_mask = None if all_live and query.shape[2] == 1 else additive_mask(layout, query)
            if coded is not None:
                key, value = coded.dense()
            result = original(module, query, key, value, attention_mask, **kwargs)
        else:
            result = output, None
        self._record(module, layer, head_scores)
        return result

    def evict(self, layers: list[tuple[nn.Module, CompressedLayer]], slack: float, allocate: bool = False) -> None:
        evict(layers, self.scorer, self.budget, slack, allocate, self.inv_freq, self.timings,
              decoding=self.length == 1)

    def _start_layer(self, layer: CompressedLayer, index: int, keys: torch.Tensor) -> None:
        """A layer seen for the first time in a sequence (empty cache) starts tracking its slots."""
        if not layer.started:
            layer.start_slots(keys.shape[0], keys.shape[1], keys.device,
                              per_head=self.parameters.head_selection == "per_head")
            parameters = self.parameters
            layer.start_quantization(parameters.kv_bits, parameters.kv_key_group_size,
                                     parameters.kv_value_group_size, parameters.kv_residual)
            self.budget.start_layer(layer, index)

    def _layer_layout(self, layer: CompressedLayer) -> tuple[torch.Tensor, bool]:
        """This forward's slot layout of a layer (its cached slots, then the new tokens) and whether it is all
        live: the shared one when every layer has the same, else the layer's own."""
        if self.layout is not None:
            return self.layout
        layout = layer.forward_layout(self.valid)
        # asking an accelerator whether all are live would wait for it in every layer: assume not (masks are safe)
        return layout, layout.device.type == "cpu" and bool(layout.all())

    def _observe(self, total: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The queries the scorer observes in this forward, and for accumulated attention their counts over
        ``total`` slots; computed once per forward and layer length (every layer's, unless budgets differ)."""
        if total not in self._observation:
            observed = self.scorer.observed_queries(self.valid, self.replay)
            counts = None
            if observed is not None and self.scorer.combine == "add":
                counts = observation_counts(observed, total)
            self._observation[total] = observed, counts
        return self._observation[total]

    def _record(self, module: nn.Module, layer: CompressedLayer, head_scores: torch.Tensor | None) -> None:
        """Combine the layer's scores into its state and evict once the layer is over budget."""
        length = self.length
        started = time.perf_counter()
        if self.replay:  # the reconstruction's own slots leave the cache; only the scores remain
            if head_scores is not None:
                layer.merge_scores(head_scores, self.scorer.combine)
            layer.drop_newest(length)
            return
        value_norms = None
        if self.parameters.refined_algorithm == "criticalkv":
            value_norms = projected_value_l1(
                layer.values[:, :, -length:], value_projection_weight(module), module.num_key_value_groups
            )
        total = layer.physical_length
        counts = self._observe(total)[1] if head_scores is not None else None
        layer.append_slots(head_scores, counts, self.positions, self.true_positions, self.valid, value_norms,
                     combine=self.scorer.combine)
        self.timings["scoring"] += time.perf_counter() - started
        slack = self.budget.slack(length, self.evicting)
        if self.budget.due(layer, total, slack):
            if length == 1:  # a decode step: every due layer is evicted at once when the forward ends
                self.due.append((module, layer))
            elif self.reconstructs or self.parameters.layers_share_budget:
                # evicted with every layer when the forward ends: after the reconstruction passes that score it
                # (KVzip), or when all layers' scores are known for one budget shared across layers
                self.due.append((module, layer))
            else:  # a prefill evicts right away, so that at most one layer at a time holds the whole prompt
                self.evict([(module, layer)], slack)
                self.evicted = True
