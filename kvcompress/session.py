"""The session: one attachment of a compressor to one model, its lifecycle and its two decoder hooks.

``__enter__`` installs the hooks and routes the compressed layers' attention calls through the session;
``__exit__`` (or an error) removes them. The state lives in the cache (``cache.py``: compressed layers own their
slots' scores, positions and layout, and report the true sequence length), so ``generate`` resumes a compressed
cache like any other: a chat's next turn, chunked prefill, questions on a copy of one compressed document.

One forward: the decoder pre-hook adopts the cache (its full-attention layers become compressed layers), starts
a sequence's budgets (``budget.py``), gives the forward its positions and mask (``masks.py``) and builds the
``Forward`` (``forward.py``), whose ``attend`` every compressed layer's attention call runs top to bottom (the
scorer's pass, the layer's state, eviction). The post-hook runs what waits for every layer: a scorer's
reconstruction passes (KVzip), then the due evictions (a decode step's, a budget the layers share).
"""

from __future__ import annotations

import copy
import os
import time
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .adapters import ModelLayout, inspect_model
from .attention_function import install as install_attention_function
from .budget import BudgetPlan, FractionalBudget
from .cache import CacheReport, adopt_cache, cache_report
from .chat import DocumentPrompt, document_prompt
from .forward import Forward
from .layer import CompressedLayer
from .masks import decoder_mask, new_token_validity, positions_from_mask, shared_layout
from .parameters import KVCacheCompressionParameters
from .quantization import check_layout
from .rerotation import check_rerotation_supported

_ACTIVE_MODELS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class CompressionSession:
    """One attachment of a compressor to one model; use it as a context manager."""

    def __init__(
        self,
        model: nn.Module,
        parameters: KVCacheCompressionParameters,
        tokenizer: Any = None,
        fraction: FractionalBudget | None = None,
        recipe: dict[str, Any] | None = None,
    ):
        """``fraction`` (``kvcompress.compress`` with a fractional budget): every sequence keeps that fraction of
        what it has seen, with the windows of its own length (``budget.BudgetPlan``). ``recipe``: how the session
        was made (``compressor.session_from_recipe`` makes it again), which a stored context records."""
        self.model = model
        self.recipe = recipe if recipe is not None else {"parameters": parameters.to_dict()}
        self.tokenizer = tokenizer
        self.budget = BudgetPlan(parameters, fraction)
        self.scorer = parameters.scorer(parameters)
        self.layout: ModelLayout | None = None
        self.cache: DynamicCache | None = None  # the cache of the latest forward (its layers own their state)
        self.evictions = 0  # forwards of the cache's sequence that evicted
        # seconds by part (scoring, selection, compaction, reconstruction, ...) and in all: "prefill" (the model's
        # multi-token forwards) and "decode" (its one-token forwards), as the host sees them
        self.timings: dict[str, float] = defaultdict(float)
        self._clock: float | None = None  # when the model's forward in flight started
        self._forward: Forward | None = None  # the forward in flight (forward.py)
        self._handles: list[Any] = []
        self._reading_codes: list[CompressedLayer] = []  # layers whose attention reads codes (the forward's)
        self._replaying = False  # inside a context-reconstruction pass (KVzip): nothing joins the sequence
        self._restore_attention = None
        # a prefilled context: its cache, 2-D mask and token ids; kept after the block, for the next one
        self._context: tuple[DynamicCache, torch.Tensor, torch.Tensor] | None = None
        self._document: DocumentPrompt | None = None  # the chat template around a context given as text
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
        for index in layout.compressed_layers[:1]:  # every attention module of a model has one head size
            check_layout(layout.attention_modules[index].head_dim, self.parameters.kv_bits,
                         self.parameters.kv_key_group_size, self.parameters.kv_value_group_size)
        self.tokenizer = self._tokenizer_if_needed()
        self.scorer.bind(self.model, self.tokenizer)
        self.layout = layout
        try:
            self._handles.append(
                layout.decoder.register_forward_pre_hook(self._before_decoder, with_kwargs=True)
            )
            self._handles.append(layout.decoder.register_forward_hook(self._after_decoder, with_kwargs=True))
            self._handles.append(self.model.register_forward_pre_hook(self._start_clock))
            self._handles.append(self.model.register_forward_hook(self._stop_clock, with_kwargs=True))
            compressed = [layout.attention_modules[i] for i in layout.compressed_layers]
            if self.scorer.reads_hidden_states:
                self._handles.extend(module.register_forward_pre_hook(self._before_attention, with_kwargs=True)
                                     for module in compressed)
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
        # the latest cache stays readable (``report``), and a prefilled context waits for the next block's questions
        self._read_codes_in([])
        self._forward = None
        self._replaying = False
        _ACTIVE_MODELS.discard(self.model)

    # ------------------------------------------------------------------ compress a context once, ask after
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                chunk_size: int | None = None) -> DynamicCache:
        """Run a context through the model and compress it, before any question is seen (query-agnostic).

        Questions then follow with ``generate``, each on its own copy of the compressed context. ``attention_mask``
        (B, T) marks real tokens of a left-padded batch. Returns the compressed cache.

        ``chunk_size`` feeds the context ``chunk_size`` tokens at a time and brings the cache back to its budget
        after each chunk, so it never holds more than the budget plus one chunk per layer: a context whose full
        cache would not fit can be compressed. Each chunk is scored by the method's own rule over the slots kept
        so far plus the chunk (KVzip reconstructs the chunk's own tokens over that cache, and a kept slot's score
        is the most any reconstruction gave it). Chunks are cut from the context's end, so the first may be
        shorter and each sequence of a left-padded batch is cut where it would be alone; a fractional budget is a
        fraction of the whole context.

        A session holds one context, kept after the ``with`` block (a later block asks on, ``save`` stores it): a
        second ``prefill`` starts a new one and drops the previous.
        """
        self._check_attached("prefill")
        self._document = None
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive integer (tokens per forward) or None, got {chunk_size!r}")
        length = input_ids.shape[-1]
        chunk_size = chunk_size or max(length, 1)
        # an empty context still goes through the model once, whose hook names the problem
        ends = range(length % chunk_size or chunk_size, length + 1, chunk_size) if length else [0]
        positions = positions_from_mask(mask)
        cache = DynamicCache(config=self.model.config)
        self.budget.whole_prompt = mask.bool()
        try:
            for end in ends:
                start = max(0, end - chunk_size)
                self.model(input_ids=input_ids[:, start:end], attention_mask=mask[:, :end],
                           position_ids=positions[:, start:end], cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            self.budget.whole_prompt = None
        self._context = cache, mask, input_ids
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
        self._check_attached("generate")
        if self._context is None:
            raise RuntimeError("kvcompress: call session.prefill(context_ids) before session.generate(question_ids)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        context, context_mask, _ = self._context
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

    def prefill_text(self, document: str, chunk_size: int | None = None) -> DynamicCache:
        """``prefill`` for a document given as text: the session's tokenizer renders it in the model's chat template,
        cut where the document ends (``kvcompress.chat``), so that questions asked with ``ask`` continue the same
        user turn, and the document's ids are the same whatever question follows. Returns the compressed cache."""
        if self.tokenizer is None:
            raise ValueError("kvcompress: session.prefill_text needs a tokenizer: compress(model, ..., tokenizer=...)")
        rendered = document_prompt(self.tokenizer, document)
        ids = torch.tensor([rendered.head_ids(self.tokenizer)], device=self.model.device)
        cache = self.prefill(ids, chunk_size=chunk_size)
        self._document = rendered
        return cache

    def ask(self, question: str, max_new_tokens: int = 64) -> str:
        """The greedy answer, as text, to ``question`` about the document given to ``prefill_text``: the question
        closes the document's user turn and the assistant answers, on a copy of the compressed document."""
        if self._document is None:
            raise RuntimeError("kvcompress: call session.prefill_text(document) before session.ask(question)")
        ids = torch.tensor([self._document.question_ids(self.tokenizer, question)], device=self.model.device)
        answer = self.generate(ids, max_new_tokens=max_new_tokens)[0]
        return self.tokenizer.decode(answer, skip_special_tokens=True).strip()

    # ------------------------------------------------------------------ a context that outlives the process
    def save(self, target: str | os.PathLike) -> dict[str, Any]:
        """Store the prefilled context in ``target`` (a path, or any fsspec URL: ``s3://...``, ``memory://...``):
        one safetensors file, written whole or not at all, that ``kvcompress.load`` turns back into this session's
        state in any process (``kvcompress.context_file`` describes it). Returns its summary (tokens, KV bytes)."""
        from .context_file import save_context

        return save_context(self, target)

    @property
    def context(self) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """The prefilled context: its compressed cache, 2-D mask and token ids (B, T)."""
        if self._context is None:
            raise RuntimeError("kvcompress: the session holds no context; call session.prefill(context_ids) first")
        return self._context

    @property
    def context_ids(self) -> torch.Tensor:
        """The context's token ids (B, T): a plain ``model.generate`` on ``context_cache()`` takes ids that begin
        with them."""
        return self.context[2]

    def context_cache(self) -> DynamicCache:
        """A copy of the compressed context's cache, for a plain ``model.generate(ids, past_key_values=...)``
        inside the ``with`` block (ids that begin with ``context_ids``; the new prompt is compressed as a chat turn)."""
        return copy.deepcopy(self.context[0])

    @property
    def document(self) -> DocumentPrompt | None:
        """The chat template around a context given as text (``prefill_text``), else None."""
        return self._document

    def adopt_context(self, cache: DynamicCache, mask: torch.Tensor, ids: torch.Tensor,
                      document: dict[str, Any] | None = None) -> None:
        """Take a context compressed elsewhere (a stored one) as this session's prefilled context."""
        self._context = cache, mask, ids
        self._document = None if document is None else DocumentPrompt(**document)
        self.cache = cache

    def report(self) -> CacheReport:
        """What the latest cache holds against the full cache for the tokens it has seen, and the session's
        timings; readable during and after the ``with`` block."""
        if self.cache is None:
            raise RuntimeError("kvcompress: the session has run no forward yet; nothing to report")
        return cache_report(self.cache, dict(self.timings))

    def _check_attached(self, name: str) -> None:
        if not self._handles:
            raise RuntimeError(f"kvcompress: session.{name} runs inside the `with` block that attaches the session")

    @property
    def parameters(self) -> KVCacheCompressionParameters:
        """The parameters in force (a fractional budget's are those of the current sequence's prompt)."""
        return self.budget.parameters

    @property
    def compressed_layers(self) -> list[int]:
        return self.layout.compressed_layers

    @property
    def layers(self) -> dict[int, CompressedLayer]:
        """Each compressed layer of the latest cache the session ran on that tracks its slots (keys, values and
        their eviction state)."""
        if self.cache is None:
            return {}
        return {index: self.cache.layers[index] for index in self.compressed_layers
                if index < len(self.cache.layers) and getattr(self.cache.layers[index], "started", False)}

    # ------------------------------------------------------------------ the model's forward, timed
    def _start_clock(self, module: nn.Module, args: tuple) -> None:
        self._clock = time.perf_counter()

    def _stop_clock(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        tokens = _forward_inputs(args, kwargs)[1]
        if self._clock is not None and tokens is not None:
            self.timings["prefill" if tokens.shape[1] > 1 else "decode"] += time.perf_counter() - self._clock
        self._clock = None

    # ------------------------------------------------------------------ decoder hooks
    def _before_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.compressed_layers:
            return None
        replay = self._replaying
        token_ids, tokens = _forward_inputs(args, kwargs)
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
        layers = [cache.layers[index] for index in self.compressed_layers]
        self._read_codes_in(layers)
        if layers[0].started and layers[0].slot_valid.shape[0] != batch:
            raise ValueError(
                f"kvcompress: the cache holds {layers[0].slot_valid.shape[0]} sequences, the input {batch}; continue "
                "a compressed cache with the same batch"
            )
        if (length > 1 and self._evicting and not replay and not self.scorer.scores_folded_layers
                and any(layer.folded_heads is not None for layer in layers)):
            raise ValueError(
                f"kvcompress: with method={self.parameters.method!r}, budget_allocation="
                f"{self.parameters.budget_allocation!r} compresses one prompt; this cache already holds its per-head "
                "selection and is not compressed again. Ask each question on the compressed context with "
                "session.prefill(context) then session.generate(question), or start a new cache (chat turns that "
                "compress again need method='kvzip' or 'kvzap', or a budget_allocation of 'uniform', 'global' or "
                "'pyramid')"
            )
        device = tokens.device
        mask = kwargs.get("attention_mask")
        new_valid = new_token_validity(mask, batch, length, seen, device)
        if seen == 0:  # the scorer reads the method's own fields, which a fraction's parameters share
            self.evictions = 0
            self.budget.start_sequence(new_valid, self.compressed_layers)
        elif self._evicting and not replay:
            self.budget.follow(mask, batch, length, seen, dict(zip(self.compressed_layers, layers)), device)
        given = kwargs.get("position_ids")
        # without position ids transformers numbers the new tokens after the cache's true length, as we do
        true_positions = given.expand(batch, -1) if given is not None else (
            seen + torch.arange(length, device=device)).expand(batch, -1)
        positions = true_positions
        if self.parameters.rerotate_keys:  # every layer keeps the same slots' count: one compact position each
            live = layers[0].live if layers[0].started else torch.zeros(batch, dtype=torch.long, device=device)
            positions = (live[:, None] + new_valid.long().cumsum(-1) - 1).clamp(min=0)
        kwargs["position_ids"] = positions
        # one layout for every layer (the decoder's mask describes it), or None (each layer's own)
        layout = shared_layout(layers, new_valid)
        kwargs["attention_mask"] = decoder_mask(module, tokens, mask, layout, cache, positions,
                                                bool(self.layout.sliding_layers))
        self._forward = Forward(
            valid=new_valid, positions=positions.to(torch.long), true_positions=true_positions.to(torch.long),
            cache=cache, scorer=self.scorer, budget=self.budget, timings=self.timings, layout=layout, replay=replay,
            evicting=self._evicting, tokens=token_ids,
            inv_freq=self.layout.rotary_emb.inv_freq if self.parameters.rerotate_keys else None,
        )
        return args, kwargs

    def _after_decoder(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        forward, self._forward = self._forward, None
        self._read_codes_in([])
        if forward is None or forward.replay:  # a reconstruction pass: its tokens were dropped layer by layer
            return
        if forward.attended != len(self.compressed_layers):
            raise RuntimeError(
                f"kvcompress: {len(self.compressed_layers) - forward.attended} compressed layers ran without the "
                "session's attention function (was config._attn_implementation changed inside the `with` block?)"
            )
        slack = self.budget.slack(forward.length, self._evicting)
        if forward.reconstructs:
            self._reconstruct(forward, forward.valid)
        if forward.due:  # a decode step's evictions, or a prompt's whose layers share one budget or were reconstructed
            forward.evict(forward.due, slack, allocate=forward.length > 1 and self.parameters.layers_share_budget)
        self.evictions += forward.evicted or bool(forward.due)

    def _read_codes_in(self, layers: list[CompressedLayer]) -> None:
        """Let the attention of ``layers`` read their codes (``Forward.attend``), and no other layer's: a layer's
        ``update`` returns only its full-precision slots while it is set, which only the session's attention reads,
        so that it is cleared when the forward ends or fails (the next one's start) and when the session ends."""
        for layer in self._reading_codes:
            layer.attention_reads_codes = False
        for layer in layers:
            layer.attention_reads_codes = True
        self._reading_codes = layers

    def _reconstruct(self, forward: Forward, selected: torch.Tensor) -> None:
        """The scorer's context-reconstruction passes (KVzip) over the full cache of this prompt, each sequence's
        ``selected`` tokens; the passes' forwards score and drop their own slots (``Forward.attend``)."""
        if forward.tokens is None:
            raise ValueError(
                f"kvcompress: method={self.parameters.method!r} reconstructs the prompt from its token ids; "
                "pass input_ids, not inputs_embeds"
            )
        started = time.perf_counter()
        following = forward.true_positions[:, -1:] + 1  # the prompt's last token is real (left padding)
        self._replaying = True
        try:
            self.scorer.reconstruct(self.layout.decoder, forward.cache, forward.tokens, selected, following,
                                    self.layout.sliding_layers)
        finally:
            self._replaying = False
        self.timings["reconstruction"] += time.perf_counter() - started

    # ------------------------------------------------------------------ attention call
    def _before_attention(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Keep a compressed layer's input hidden states for its attention call (scorers that read them)."""
        if self._forward is not None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self._forward.hidden_states[module.layer_idx] = hidden

    def _attend(self, module, query, key, value, attention_mask, original, **kwargs):
        """The module's attention call (``attention_function``): the forward in flight's (``Forward.attend``), or
        the original function outside one."""
        if self._forward is None:
            return original(module, query, key, value, attention_mask, **kwargs)
        return self._forward.attend(module, query, key, value, attention_mask, original, **kwargs)


def _forward_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A forward's token ids (None for embeddings) and what it is fed, ids or embeddings: (B, q, ...)."""
    token_ids = kwargs.get("input_ids", args[0] if args else None)
    return token_ids, token_ids if token_ids is not None else kwargs.get("inputs_embeds")
