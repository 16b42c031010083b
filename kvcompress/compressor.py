"""The context manager: routes a model's attention through the scorer and evicts, and detaches on exit or error.

The state lives in the cache (``cache.py``: compressed layers own their slots' scores, positions and layout, and
report the true sequence length), so ``generate`` resumes a compressed cache like any other: a chat's next turn,
chunked prefill, questions on a copy of one compressed document. The session holds only the forward in flight.

Data flow of one forward: the decoder pre-hook adopts the cache (its full-attention layers become compressed
layers), and gives the forward the 2-D mask of the layers' physical layout (left padding, filler) and, with
``rerotate_keys``, compact positions; each full-attention module's attention call goes through the session
(``attention_function``), which hands it to the scorer of ``algorithm`` (``scoring/registry.py``): the scorer
reads the module's own queries and keys (computing the attention output in the same pass where that is
cheaper), the session combines the scores into the layer's state and, once the layer is over budget, evicts
(gather + optional rerotation). Evictions that need every layer's scores (a decode step's, a global budget's)
wait for the decoder post-hook; a scorer that reconstructs the context (KVzip) has the post-hook first run its
reconstruction passes over the full cache, then evict every layer at once.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections import defaultdict
from typing import Any, Callable, Mapping

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .adapters import ModelLayout, inspect_model, value_projection_weight
from .attention_function import install as install_attention_function
from .budget import BudgetPlan, budget_slots, check_budget
from .cache import CompressedLayer, adopt_cache
from .kernels.attention import observation_counts
from .kernels.value_norm import projected_value_l1
from .masks import additive_mask, decoder_mask, new_token_validity, positions_from_mask, shared_layout
from .parameters import KVCacheCompressionParameters
from .ragged import folded_attention, folded_head_of_new, per_new_slot
from .rerotation import check_rerotation_supported
from .scoring.base import AttentionCall
from .selection.evict import evict
from .state import ForwardState, LayerState

_ACTIVE_MODELS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


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


class CompressionSession:
    """One attachment of a compressor to one model; use it as a context manager."""

    def __init__(
        self,
        model: nn.Module,
        parameters: KVCacheCompressionParameters,
        tokenizer: Any = None,
        prompt_budget: Callable[[int], int] | None = None,
        prompt_parameters: Callable[[int], KVCacheCompressionParameters] | None = None,
    ):
        """``prompt_budget`` / ``prompt_parameters`` (``kvcompress.compress`` with a fractional budget): each
        new sequence's slots follow its prompt's real tokens, and the parameters are those of the batch's
        longest prompt; a shorter prompt of a batch keeps the same windows and a smaller scored area."""
        self.model = model
        self.tokenizer = tokenizer
        self.budget = BudgetPlan(parameters, prompt_budget, prompt_parameters)
        self.scorer = parameters.scorer(parameters)
        self.layout: ModelLayout | None = None
        self.cache: DynamicCache | None = None  # the cache of the latest forward (its layers own their state)
        self.evictions = 0  # forwards of the cache's sequence that evicted
        self._forward: ForwardState | None = None  # the forward in flight
        self._attended = 0  # compressed layers of the forward in flight that ran the session's attention
        self.timings: dict[str, float] = defaultdict(float)
        self._handles: list[Any] = []
        # the layout every compressed layer shares, with this forward's tokens, and whether it is all live; None
        # when the layers' layouts differ (budgets of their own)
        self._forward_layout: tuple[torch.Tensor, bool] | None = None
        # evictions run when the forward ends: a decode step's (all layers at once), a reconstructed prompt's
        self._due: list[tuple[nn.Module, CompressedLayer]] = []
        self._reconstruct_due = False
        self._replaying = False  # inside a context-reconstruction pass (KVzip): nothing joins the sequence
        self._forward_tokens: torch.Tensor | None = None  # the current forward's ids, for reconstruction
        self._restore_attention = None
        self._observation: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}  # see _observe
        self._context: tuple[DynamicCache, torch.Tensor] | None = None  # a prefilled context and its 2-D mask
        self._evicting = True  # False while generate() answers after a prefilled context

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "CompressionSession":
        if self.model in _ACTIVE_MODELS:
            raise RuntimeError(
                f"a KVCacheCompressor is already attached to this {type(self.model).__name__}; nested or concurrent "
                "compression of one model is not supported"
            )
        layout = inspect_model(self.model)
        if self.parameters.rerotate_keys:
            if layout.sliding_layers:
                raise ValueError(
                    "rerotate_keys=True is not supported for models with sliding-window layers: their keys keep "
                    "true positions while compressed layers would use compact ones"
                )
            check_rerotation_supported(layout.rotary_emb, type(self.model).__name__)
        self.tokenizer = self._tokenizer_if_needed()
        self.scorer.bind(self.model, self.tokenizer)
        self.layout = layout
        try:
            self._handles.append(
                layout.decoder.register_forward_pre_hook(self._before_decoder, with_kwargs=True)
            )
            self._handles.append(layout.decoder.register_forward_hook(self._after_decoder, with_kwargs=True))
            compressed = [layout.attention_modules[i] for i in layout.compressed_layers]
            self._restore_attention = install_attention_function(compressed, self._attend)
        except BaseException:
            self._detach()
            raise
        _ACTIVE_MODELS.add(self.model)
        return self

    def __exit__(self, *exc_info) -> None:
        self._detach()

    def _tokenizer_if_needed(self):
        """The tokenizer given, else (only for scorers that build prompts) the one saved beside the model."""
        if self.tokenizer is not None or not self.scorer.reconstructs:
            return self.tokenizer
        path = getattr(self.model, "name_or_path", "") or ""
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path, local_files_only=True) if path else None
        except (OSError, ValueError):
            return None

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._restore_attention is not None:
            self._restore_attention()
            self._restore_attention = None
        self.cache = self._forward = self._forward_layout = self._forward_tokens = self._context = None
        self._due.clear()
        self._reconstruct_due = self._replaying = False
        _ACTIVE_MODELS.discard(self.model)

    # ------------------------------------------------------------------ compress a context once, ask after
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DynamicCache:
        """Run a context through the model and compress it, before any question is seen (query-agnostic).

        Questions then follow with ``generate``, each on its own copy of the compressed context. ``attention_mask``
        (B, T) marks real tokens of a left-padded batch. Returns the compressed cache.
        """
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions_from_mask(mask), cache=cache,
                   use_cache=True, logits_to_keep=1)
        self._context = cache, mask
        return cache

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> torch.Tensor:
        """Greedy answer (B, ≤ max_new_tokens) to ``input_ids`` (a question, and the answer's opening) that follow
        the context given to ``prefill``, at their true positions.

        As in the query-agnostic protocol of KVzip and kvpress, the question and the answer are not compressed.
        Each question runs plain ``generate`` on a copy of the compressed context (``copy.deepcopy(cache)``: the
        cache owns its state), so every question sees the same compressed context and no other question.
        Finished sequences are padded with their end token.
        """
        if self._context is None:
            raise RuntimeError("kvcompress: call session.prefill(context_ids) before session.generate(question_ids)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        context, context_mask = self._context
        eos = eos_token_id if eos_token_id is not None else self.model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
        new_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        self._evicting = False
        try:
            sequences = self.model.generate(
                input_ids=input_ids, attention_mask=torch.cat([context_mask, new_mask.to(context_mask)], dim=-1),
                cache=copy.deepcopy(context), max_new_tokens=max_new_tokens,
                min_new_tokens=0 if eos else max_new_tokens, do_sample=False, num_beams=1,
                eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
            )
        finally:
            self._evicting = True
        return sequences[:, input_ids.shape[1]:]

    @property
    def parameters(self) -> KVCacheCompressionParameters:
        """The parameters in force (a fractional budget's are those of the current sequence's prompt)."""
        return self.budget.parameters

    @property
    def compressed_layers(self) -> list[int]:
        return self.layout.compressed_layers

    @property
    def layers(self) -> dict[int, LayerState]:
        """The eviction state of each compressed layer of the latest cache the session ran on."""
        if self.cache is None:
            return {}
        return {index: self.cache.layers[index].state for index in self.compressed_layers
                if index < len(self.cache.layers) and getattr(self.cache.layers[index], "state", None) is not None}

    # ------------------------------------------------------------------ decoder hooks
    def _before_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.compressed_layers:
            return None
        replay = self._replaying
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if not replay:
            self._forward_tokens = tokens  # None when the caller gives embeddings
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        batch, length = tokens.shape[:2]
        if length == 0:
            raise ValueError("kvcompress: the input has no tokens (empty prompt); give at least one token")
        cache_key = "past_key_values" if "past_key_values" in kwargs and "cache" not in kwargs else "cache"
        cache = kwargs.get(cache_key)
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(module.config, "use_cache", True)
        if cache is None:
            if not use_cache:
                self._forward = None
                return None
            cache = DynamicCache(config=module.config)
            kwargs[cache_key] = cache
        adopt_cache(cache, self.compressed_layers, len(self.layout.attention_modules))
        self.cache = cache
        seen = cache.get_seq_length()
        states = [cache.layers[index].state for index in self.compressed_layers]
        if states[0] is not None and states[0].slot_valid.shape[0] != batch:
            raise ValueError(
                f"kvcompress: the cache holds {states[0].slot_valid.shape[0]} sequences, the input {batch}; continue "
                "a compressed cache with the same batch"
            )
        if length > 1 and self._evicting and not replay and any(s is not None and s.folded_heads for s in states):
            raise ValueError(
                f"kvcompress: budget_allocation={self.parameters.budget_allocation!r} compresses one prompt; this "
                "cache already holds its per-head selection and is not compressed again. Ask each question on the "
                "compressed context with session.prefill(context) then session.generate(question), or start a new "
                "cache (chat turns that compress again need a budget_allocation of 'uniform', 'global' or 'pyramid')"
            )
        device = tokens.device
        mask = kwargs.get("attention_mask")
        new_valid = new_token_validity(mask, batch, length, seen, device)
        if seen == 0:
            self.evictions = 0
            previous = self.parameters
            params = self.budget.start_sequence(new_valid, self.compressed_layers)
            if params != previous:
                self.scorer = params.scorer(params)
                self.scorer.bind(self.model, self.tokenizer)
        given = kwargs.get("position_ids")
        # without position ids transformers numbers the new tokens after the cache's true length, as we do
        true_positions = given.expand(batch, -1) if given is not None else (
            seen + torch.arange(length, device=device)).expand(batch, -1)
        positions = true_positions
        if self.parameters.rerotate_keys:  # every layer keeps the same slots' count: one compact position each
            live = states[0].live if states[0] is not None else torch.zeros(batch, dtype=torch.long, device=device)
            positions = (live[:, None] + new_valid.long().cumsum(-1) - 1).clamp(min=0)
        kwargs["position_ids"] = positions
        # one layout for every layer (the decoder's mask describes it), or None (each layer's own, _layer_layout)
        self._forward_layout = shared_layout(states, new_valid)
        kwargs["attention_mask"] = decoder_mask(module, tokens, mask, self._forward_layout, cache, positions,
                                                bool(self.layout.sliding_layers))
        self._forward = ForwardState(valid=new_valid, positions=positions.to(torch.long),
                                     true_positions=true_positions.to(torch.long), replay=replay)
        if not replay:  # what an earlier forward that failed half-way may have left
            self._due.clear()
            self._reconstruct_due = False
        self._attended = 0
        self._observation.clear()
        return args, kwargs

    def _after_decoder(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        forward, self._forward = self._forward, None
        self._forward_layout = None
        if forward is None or forward.replay:  # a reconstruction pass: its tokens were dropped layer by layer
            return
        if self._attended != len(self.compressed_layers):
            raise RuntimeError(
                f"kvcompress: {len(self.compressed_layers) - self._attended} compressed layers ran without the "
                "session's attention function (was config._attn_implementation changed inside the `with` block?)"
            )
        due, self._due = self._due, []
        reconstruct, self._reconstruct_due = self._reconstruct_due, False
        slack = self.budget.slack(forward.valid.shape[-1], self._evicting)
        if reconstruct:
            # as in evict: only the sequences over budget evict now (and are reconstructed), as they would alone
            state = due[0][1].state
            over = state.live > self.budget.layer_slots(state) + slack
            self._reconstruct(self.cache, self._forward_tokens, forward, forward.valid & over[:, None])
        self._forward_tokens = None
        if due:  # a decode step's evictions, or a prompt's whose layers share one budget or were reconstructed
            allocate = forward.valid.shape[-1] > 1 and self.parameters.layers_share_budget
            self._evict(due, slack, allocate=allocate)
        self.evictions += forward.evicted or bool(due)

    def _reconstruct(self, cache: DynamicCache, tokens: torch.Tensor | None, forward: ForwardState,
                     selected: torch.Tensor) -> None:
        """The scorer's context-reconstruction passes (KVzip) over the full cache of this prompt, each sequence's
        ``selected`` tokens; the passes' forwards score and drop their own slots (``_record``)."""
        if tokens is None:
            raise ValueError(
                f"kvcompress: algorithm={self.parameters.algorithm!r} reconstructs the prompt from its token ids; "
                "pass input_ids, not inputs_embeds"
            )
        started = time.perf_counter()
        following = forward.true_positions[:, -1:] + 1  # the prompt's last token is real (left padding)
        self._replaying = True
        try:
            self.scorer.reconstruct(self.layout.decoder, cache, tokens, selected, following, self.layout.sliding_layers)
        finally:
            self._replaying = False
        self.timings["reconstruction"] += time.perf_counter() - started

    # ------------------------------------------------------------------ attention call
    def _attend(self, module, query, key, value, attention_mask, original, **kwargs):
        """The module's attention call: its output, with this forward's scores recorded (and eviction done).

        The scorer sees the module's own post-RoPE queries and the updated cache; where it computes the
        attention output in the same pass (H2O and decode steps, KVzip's reconstruction), the original function
        does not run. Training-mode calls (dropout) and calls that return attention weights always keep the
        original function for the output.
        """
        forward = self._forward
        if forward is None:
            return original(module, query, key, value, attention_mask, **kwargs)
        started = time.perf_counter()
        layer = self.cache.layers[module.layer_idx]
        state = self._layer_state(layer, module.layer_idx, key)
        folds = state.folded_heads
        cached = key.shape[-2] - query.shape[2] * (folds or 1)
        if state.length != cached:
            raise RuntimeError(
                f"kvcompress: layer {module.layer_idx} holds {cached} cached slots but its scores cover "
                f"{state.length}; the cache was modified outside the compressor"
            )
        self._attended += 1
        output = head_scores = None
        layout, all_live = self._layer_layout(state)
        if folds:  # heads of their own lengths (ragged.py): selected once, never scored again
            heads = torch.cat([state.slot_head, folded_head_of_new(folds, query.shape[2], query.shape[0],
                                                                   query.device)], dim=-1)
            output = folded_attention(query, key, value, layout, heads, folds,
                                      kwargs.get("scaling") or module.scaling, kwargs.get("softcap"))
        elif self.parameters.intermediate_size > 0:  # else only fixed windows survive: scores are never read
            call = AttentionCall(
                module=module, queries=query, keys=key, values=value, slot_valid=layout,
                observed=self._observe(key.shape[-2])[0], scaling=kwargs.get("scaling") or module.scaling,
                softcap=kwargs.get("softcap"), all_live=all_live,
                # the caller may want the original's weights (output_attentions) or its dropout
                may_fuse=not kwargs.get("dropout") and not kwargs.get("output_attentions"),
                positions=forward.positions, replay=forward.replay,
            )
            head_scores, output = self.scorer.attend(call, state)
        if not forward.replay:  # a reconstruction pass is timed as a whole ("reconstruction")
            self.timings["attention_and_scoring" if output is not None else "scoring"] += time.perf_counter() - started
        if output is None:
            if self._forward_layout is None:  # this layer's own length: the decoder's mask cannot fit it
                attention_mask = None if all_live and query.shape[2] == 1 else additive_mask(layout, query)
            result = original(module, query, key, value, attention_mask, **kwargs)
        else:
            result = output, None
        self._record(module, layer, head_scores)
        return result

    def _layer_layout(self, state: LayerState) -> tuple[torch.Tensor, bool]:
        """This forward's slot layout of a layer (its cached slots, then the new tokens) and whether it is all
        live: the shared one when every layer has the same, else the layer's own."""
        if self._forward_layout is not None:
            return self._forward_layout
        new_valid = self._forward.valid
        if state.folded_heads:  # one slot per head and token (ragged.fold_new_tokens)
            new_valid = per_new_slot(new_valid, state.folded_heads)
        layout = torch.cat([state.slot_valid, new_valid], dim=-1)
        # asking an accelerator whether all are live would wait for it in every layer: assume not (masks are safe)
        return layout, layout.device.type == "cpu" and bool(layout.all())

    def _observe(self, total: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The queries the scorer observes in this forward, and for accumulated attention their counts over
        ``total`` slots; computed once per forward and layer length (every layer's, unless budgets differ)."""
        if total not in self._observation:
            observed = self.scorer.observed_queries(self._forward.valid, self._forward.replay)
            counts = None
            if observed is not None and self.scorer.combine == "add":
                counts = observation_counts(observed, total)
            self._observation[total] = observed, counts
        return self._observation[total]

    def _layer_state(self, layer: CompressedLayer, index: int, keys: torch.Tensor) -> LayerState:
        """The layer's state; a layer seen for the first time in a sequence (empty cache) starts empty."""
        if layer.state is None:
            layer.state = LayerState.empty(keys.shape[0], keys.shape[1], keys.device,
                                           per_head=self.parameters.head_selection == "per_head")
            self.budget.start_layer(layer.state, index)
        return layer.state

    def _record(self, module: nn.Module, layer: CompressedLayer, head_scores: torch.Tensor | None) -> None:
        """Combine a forward's scores into the layer's state and evict once the layer is over budget."""
        forward, state = self._forward, layer.state
        started = time.perf_counter()
        length = forward.valid.shape[-1]
        if forward.replay:  # the reconstruction's own slots leave the cache; only the scores remain
            if head_scores is not None:
                state.merge(head_scores, self.scorer.combine)
            layer.drop_newest(length)
            return
        value_norms = None
        if self.parameters.refined_algorithm == "criticalkv":
            value_norms = projected_value_l1(
                layer.values[:, :, -length:], value_projection_weight(module), module.num_key_value_groups
            )
        total = layer.physical_length
        counts = self._observe(total)[1] if head_scores is not None else None
        state.append(head_scores, counts, forward.positions, forward.true_positions, forward.valid, value_norms,
                     combine=self.scorer.combine)
        self.timings["scoring"] += time.perf_counter() - started
        slack = self.budget.slack(length, self._evicting)
        if total > self.budget.fewest_slots(state) + slack:
            scored_later = self.scorer.reconstructs and self.parameters.intermediate_size > 0
            if length == 1:  # a decode step: every due layer is evicted at once when the forward ends
                self._due.append((module, layer))
            elif scored_later or self.parameters.layers_share_budget:
                # evicted with every layer when the forward ends: after the reconstruction passes that score it
                # (KVzip), or when all layers' scores are known for one budget shared across layers
                self._due.append((module, layer))
                self._reconstruct_due = self._reconstruct_due or scored_later
            else:  # a prefill evicts right away, so that at most one layer at a time holds the whole prompt
                self._evict([(module, layer)], slack)
                forward.evicted = True

    def _evict(self, layers: list[tuple[nn.Module, CompressedLayer]], slack: float, allocate: bool = False) -> None:
        inv_freq = self.layout.rotary_emb.inv_freq if self.parameters.rerotate_keys else None
        evict(layers, self.scorer, self.budget, slack, allocate, inv_freq, self.timings)
