"""A document and its questions as the model reads them: the chat template cut where the document ends, so that the
document is compressed before any question is seen (the query-agnostic protocol of KVzip and kvpress).

With a chat template the rendering is kvpress's (``kvpress/pipeline.py``): the user message is the document followed
by a separator no template or document contains, rendered with ``add_generation_prompt=True`` and cut at the
separator. The head (template header, document) is what a session prefills and compresses; a question follows it
after a blank line inside the same user turn, then the template's end of that turn and the assistant's header.
Tokenising the two pieces apart gives the document the same ids whatever question follows; cutting the ids of a
whole rendered prompt instead can split a token across the boundary. Without a template (a base model) the head is
the document and a question follows after a blank line, closed by ``Answer:``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DocumentPrompt", "document_prompt"]

BASE_MODEL_ANSWER = "\nAnswer:"  # what a base model's question ends with (kvcompress generate's prompt)
QUESTION_SEPARATOR = "\n\n"  # between the document and a question, as ``kvcompress generate --question`` writes it


@dataclasses.dataclass(frozen=True)
class DocumentPrompt:
    """The prompt around a document: ``head`` (template header and document) and ``turn_end`` (what closes a
    question's user turn and opens the answer); ``templated``: whether a chat template wrote them."""

    head: str
    turn_end: str
    templated: bool

    def head_ids(self, tokenizer: Any) -> list[int]:
        """The head's ids (the tokenizer's special tokens only where no template wrote them)."""
        return list(tokenizer.encode(self.head, add_special_tokens=not self.templated))

    def question_text(self, question: str) -> str:
        """The text that follows the head for ``question``: a blank line, the question, then the end of the turn."""
        return QUESTION_SEPARATOR + question + self.turn_end

    def question_ids(self, tokenizer: Any, question: str) -> list[int]:
        return list(tokenizer.encode(self.question_text(question), add_special_tokens=False))


def document_prompt(tokenizer: Any, document: str, chat_template: bool = True) -> DocumentPrompt:
    """The prompt of ``document`` for ``tokenizer``: its chat template cut at the document's end, or (no template,
    or ``chat_template=False``) the plain text."""
    if not chat_template or getattr(tokenizer, "chat_template", None) is None:
        return DocumentPrompt(document, BASE_MODEL_ANSWER, templated=False)
    separator = "\n" + "#" * len(document)  # kvpress's: cannot occur in the template or the document
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": document + separator}], add_generation_prompt=True, tokenize=False,
        enable_thinking=False,
    )
    head, turn_end = rendered.split(separator)
    return DocumentPrompt(head, turn_end, templated=True)
