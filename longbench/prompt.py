"""The official prompt construction of ``pred.py``: template, middle truncation, chat template, tokenisation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .tasks import Task

__all__ = ["build_prompt", "encode_prompt"]


def build_prompt(
    task: Task, record: Mapping[str, Any], tokenizer: Any, max_length: int, chat_template: bool
) -> tuple[str, bool]:
    """The text given to the model, and whether the chat template wrapped it.

    Truncation happens on the raw prompt, before any chat template, with the tokenizer's default special tokens
    (so a BOS counts towards ``max_length``): beyond the cap, the first and last ``max_length // 2`` tokens are
    decoded separately and joined as a string, because the head holds the instructions and the tail the
    question. The re-tokenised result can differ from the cap by a few tokens, as upstream.
    """
    prompt = task.prompt.format(**record)
    ids = tokenizer(prompt, truncation=False).input_ids
    if len(ids) > max_length:
        half = int(max_length / 2)
        prompt = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
            ids[-half:], skip_special_tokens=True
        )
    if not (chat_template and task.uses_chat_template):
        return prompt, False
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), True


def encode_prompt(task: Task, record: Mapping[str, Any], tokenizer: Any, max_length: int, chat_template: bool) -> Any:
    """Token ids of the prompt (a ``BatchEncoding`` of one row).

    A chat template writes its own BOS where the model wants one, so templated text is tokenised without
    special tokens; adding them would give the double BOS that KVCache-Factory had to fix. Raw prompts keep the
    tokenizer's defaults, as in pred.py.
    """
    prompt, templated = build_prompt(task, record, tokenizer, max_length, chat_template)
    return tokenizer(prompt, truncation=False, return_tensors="pt", add_special_tokens=not templated)
