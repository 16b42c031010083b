"""KVzip: keep what the model needs to reconstruct the context (arXiv 2505.23416).

After a prompt is prefilled, the session feeds the model, on top of the full cache, the request to repeat the
context followed by the context itself ("\\n\\nRepeat the previous context exactly." + the chat template's turn
change + the prompt's tokens, in chunks of ``chunk_size``; a later chunk is introduced by "\\n\\nRepeat the part
of the previous context exactly, starting with" and the previous chunk's last 8 tokens). A cached slot's score
is the most attention it receives from any reconstruction query of any query head of its KV group: a token the
model must look at to reproduce the text, such as each digit of a number, scores high even if no question has
asked for it yet. The reconstruction tokens are dropped from the cache layer by layer, so every pass sees only
the prompt, and the prompt is then evicted on these scores (query-agnostic: the same for any later question).
A prompt that opens with the chat template's header (system prompt, start of the user turn) is reconstructed
from after it, as kvpress does: a repetition that begins with template tokens is not text the model copies
well. The header's slots keep score 0 (kvpress evicts them first); the start area keeps its first tokens.

Scores use the exact softmax of the reconstruction forward over every cached slot (kvpress approximates it over
4 sinks + the chunk's own slots); the scores lie in [0, 1]. On CPU the reconstruction passes and decode steps run
in the compiled kernel (``native.py``) in its maximum mode: output and scores in one pass, its work handed to
threads as they come free, faster than one masked sdpa call that gives no scores (``benchmarks/attention_kernel.py``
times both, and the path without the kernel, ``prefix_max_attention``); on GPUs in the Triton kernels'
maximum mode (``kernels/triton_attention.py``).

Decoded tokens, and prompt tokens again, are then scored by the same rule as they are queried: each decode
step's attention raises a slot's score to the maximum it has received (``combine = "max"``), so a decoded token
that leaves the recent window competes with the prompt on the most attention any later query gave it.
"""

from __future__ import annotations

import torch

from ..kernels import native
from ..kernels.attention import observed_attention
from ..kernels.reconstruction import prefix_max_attention
from .base import AttentionCall, Scorer

FIRST_REQUEST = "\n\nRepeat the previous context exactly."
NEXT_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"
TAIL_TOKENS = 8  # tokens of the previous chunk that introduce the next one
PLAIN_TURN_CHANGE = "\n"  # between the request and the repetition when the tokenizer has no chat template


class KVzip(Scorer):
    name = "kvzip"
    combine = "max"
    reconstructs = True
    scores_folded_layers = True
    # Every (layer, KV head) shares one budget by score: reconstruction attention is sharp in some layers and heads
    # and nearly absent in others, and a per-layer ("global") share loses the needles a few heads hold (RULER
    # needles with each allocation: results/ruler_runner_smollm2_2k_heads/). The folded cache this gives is
    # compressed again at every turn (``scores_folded_layers``).
    allocation = "global_adaptive"
    # the reference's selection (KVzip's code and kvpress's KVzipPress): a pure top-k of every head's scores but 4
    # sinks, no recent window, no per-head floor. Reserving slots away from the top-k costs the needles most at
    # small budgets (RULER at 4k, 10 % kept: results/ruler_smollm2_4k/)
    reference_selection = {"start_size": 4, "recent_size": 0, "adaptive_floor": 0.0}
    options = {"chunk_size": 2048}
    minimums = {"chunk_size": 1}

    def __init__(self, parameters):
        super().__init__(parameters)
        self.first_request: list[int] | None = None
        self.next_request: list[int] | None = None
        self.turn_change: list[int] | None = None
        self.header: list[int] = []

    def bind(self, model, tokenizer) -> None:
        if tokenizer is None:
            raise ValueError(
                "method='kvzip' needs the model's tokenizer to build its reconstruction prompt: pass it as "
                "KVCacheCompressor(params, tokenizer=tokenizer) or kvcompress.compress(model, ..., tokenizer=tokenizer)"
            )

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        self.first_request = encode(FIRST_REQUEST)
        self.next_request = encode(NEXT_REQUEST)
        header, change = template_around_user_message(tokenizer)
        self.turn_change = encode(change)
        self.header = encode(header)

    def observed_queries(self, new_valid: torch.Tensor, replay: bool) -> torch.Tensor | None:
        # A prompt's own queries are not observed: its slots are scored by the reconstruction that follows it.
        return new_valid if replay or new_valid.shape[-1] == 1 else None

    def attend(self, call: AttentionCall, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if call.observed is None:
            return None, None
        if (call.length > 1 and call.all_live and call.may_fuse and not call.softcap and call.keys.device.type == "cpu"
                and native.kernel() is None):
            # a reconstruction pass on CPU without the compiled kernel: torch's flash attention does the work
            output, scores = prefix_max_attention(call.queries, *call.dense_keys_values(), call.scaling)
            return scores, output
        return observed_attention(
            call.queries, call.keys, call.slot_valid, call.observed, call.scaling, softcap=call.softcap,
            values=call.values if call.may_fuse else None, all_live=call.all_live, reduce="max", coded=call.coded,
        )

    def replay_inputs(self, context: list[list[int]]) -> list[list[list[int]]]:
        """The reconstruction passes for a batch: per pass, one token list per sequence (empty once a sequence's
        context is used up). ``context`` holds each sequence's real tokens of the prompt, in order."""
        size = self.settings["chunk_size"]
        context = [tokens[len(self.header):] if self.header and tokens[: len(self.header)] == self.header else tokens
                   for tokens in context]
        passes = max((len(tokens) + size - 1) // size for tokens in context)
        inputs = []
        for number in range(passes):
            rows = []
            for tokens in context:
                chunk = tokens[number * size : (number + 1) * size]
                if not chunk:
                    rows.append([])
                elif number == 0:
                    rows.append(self.first_request + self.turn_change + chunk)
                else:
                    tail = tokens[number * size - TAIL_TOKENS : number * size]
                    rows.append(self.next_request + tail + self.turn_change + chunk)
            inputs.append(rows)
        return inputs


    @torch.no_grad()
    def reconstruct(self, decoder, cache, tokens, selected, following, sliding_layers) -> None:
        """The reconstruction passes over the full cache of this prompt.

        Each pass is a forward of the decoder on top of the cache, at the positions that follow the prompt
        (``following`` (B, 1)); each sequence of a batch reconstructs its own ``selected`` tokens (B, q) bool
        (its real tokens, left-padded to the longest; a sequence that fits its budget is scored too, for the
        chunk, turn or decode step that later takes it over). The compressed layers drop the pass's slots right
        after their attention, so each pass sees only the prompt and at most one layer at a time holds the extra
        chunk; sliding-window layers, which would push prompt tokens out of their window, are restored after every
        pass (holding the previous pass, they would shift the next one's masks and windows).
        """
        context = [row[valid].tolist() for row, valid in zip(tokens, selected.to(tokens.device))]
        sliding = {index: _layer_snapshot(cache.layers[index]) for index in sliding_layers
                   if index < len(cache.layers)}
        for rows in self.replay_inputs(context):
            width = max(len(row) for row in rows)
            ids = torch.tensor([[0] * (width - len(row)) + row for row in rows], device=tokens.device)
            real = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=tokens.device)
            mask = torch.cat([torch.ones(len(rows), cache.get_seq_length(), dtype=real.dtype,
                                         device=real.device), real], dim=-1)
            positions = following.to(real.device) + (real.cumsum(-1) - 1).clamp(min=0)
            try:
                decoder(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            finally:  # every pass sees the prompt alone: a sliding layer's window (and length) as the prompt left it
                for index, snapshot in sliding.items():
                    cache.layers[index].__dict__.update(snapshot)


def _layer_snapshot(layer) -> dict:
    """What restores a cache layer whose tensors its updates replace (they never write into them)."""
    return {name: value.clone() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
            for name, value in vars(layer).items()}


def template_around_user_message(tokenizer) -> tuple[str, str]:
    """What the chat template puts before a user message (its header: system prompt, start of the user turn)
    and between the message and the assistant's reply: the reconstruction request is a user turn, the repetition
    the assistant's answer. ``("", "\\n")`` without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", PLAIN_TURN_CHANGE
    marker = "KVZIP-CONTEXT-END"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    return text[: text.index(marker)], text[text.index(marker) + len(marker) :]
