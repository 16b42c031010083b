"""A RULER record as the model reads it: the chat template around context and question, the answer prefix opening
the assistant's turn, and the tokens for the two compression protocols.

With a chat template the rendering is kvpress's (``kvpress/pipeline.py``): the user message is the context
followed by a separator, rendered with ``add_generation_prompt=True, enable_thinking=False`` and cut at the
separator. The first piece (template header, context) is what ``context_first`` compresses before the question
is seen; the question, the template's end of the user turn with the assistant header, and the answer prefix
follow it. So the user turn holds context + question and the answer prefix starts the assistant's reply.

Without a chat template the text is RULER's own input (context + question + answer prefix) and the context is
tokenised with the tokenizer's default special tokens, as RULER's HF client does. kvpress instead writes
``bos_token`` and puts ``\\n`` between question and answer prefix.

The head and the tail are tokenised separately, without special tokens once a template wrote them, and both
protocols get the same ids: only what is compressed differs. ``query_aware`` prefills (and compresses) the whole
prompt at once; ``context_first`` prefills the head, then feeds the tail. The tokenizer is duck-typed
(``chat_template``, ``apply_chat_template``, ``encode``): nothing here imports transformers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from .prompts import PromptParts

__all__ = ["PROTOCOLS", "ChatPrompt", "EncodedPrompt", "Protocol", "chat_prompt", "encode_prompt"]

Protocol = Literal["query_aware", "context_first"]
PROTOCOLS: tuple[Protocol, ...] = ("query_aware", "context_first")


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """The prompt text in two pieces: ``head`` (template header and context) and ``tail`` (question, end of the
    user turn, assistant header, answer prefix)."""

    head: str
    tail: str

    @property
    def text(self) -> str:
        return self.head + self.tail


@dataclasses.dataclass(frozen=True)
class EncodedPrompt:
    """The prompt's token ids and how many of them the first forward pass takes (and compresses): all of them
    for ``query_aware``, the head for ``context_first``; the rest are fed after."""

    input_ids: list[int]
    prefill_length: int


def _templated(tokenizer: Any, chat_template: bool) -> bool:
    return chat_template and getattr(tokenizer, "chat_template", None) is not None


def chat_prompt(tokenizer: Any, parts: PromptParts, chat_template: bool = True) -> ChatPrompt:
    """The text of the prompt, cut where ``context_first`` stops compressing; ``chat_template=False`` gives RULER's
    raw input even when the tokenizer has a template."""
    if not _templated(tokenizer, chat_template):
        return ChatPrompt(parts.context, parts.question + parts.answer_prefix)
    separator = "\n" + "#" * len(parts.context)  # kvpress's: cannot occur in the template or the context
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts.context + separator}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    head, turn_end = rendered.split(separator)
    return ChatPrompt(head, parts.question + turn_end + parts.answer_prefix)


def encode_prompt(tokenizer: Any, parts: PromptParts, protocol: Protocol, chat_template: bool = True) -> EncodedPrompt:
    """Token ids of ``chat_prompt``; the head's ids end exactly at the context, whatever the protocol."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")
    prompt = chat_prompt(tokenizer, parts, chat_template)
    templated = _templated(tokenizer, chat_template)
    head = list(tokenizer.encode(prompt.head, add_special_tokens=not templated))
    tail = list(tokenizer.encode(prompt.tail, add_special_tokens=False))
    return EncodedPrompt(head + tail, len(head) + len(tail) if protocol == "query_aware" else len(head))
