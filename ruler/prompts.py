"""kvpress's split of a RULER record's ``input`` into context, question and answer prefix, and per-task limits.

NVIDIA kvpress (``evaluation/benchmarks/ruler/create_huggingface_dataset.py``) cuts the input at the *last*
match of the task family's question opening (the qa instruction appears twice, before and after the documents),
then cuts the rest at the first "The special magic" (niah) or "Answer:" (the others). The context keeps whatever
precedes the question (few-shot examples included), the question keeps its trailing space and the answer prefix
has no leading one, so ``context + question + answer_prefix == input`` exactly. Compressing the context alone,
then reading the question, is the protocol of kvpress's leaderboard.

Standard library only: another virtual environment, with an older transformers, imports this module too.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["MAX_NEW_TOKENS", "PromptParts", "max_new_tokens", "split_input", "task_family"]

# The family is the task name up to its first underscore, as in kvpress: niah_*, vt, cwe, fwe, qa_*.
_QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
_ANSWER_PATTERNS = {
    "niah": re.compile(r"The special magic"),
    "vt": re.compile(r"Answer:"),
    "cwe": re.compile(r"Answer:"),
    "fwe": re.compile(r"Answer:"),
    "qa": re.compile(r"Answer:"),
}
# RULER's tokens_to_generate per family (data/synthetic/constants.py), kvpress's max_new_tokens.
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


@dataclasses.dataclass(frozen=True)
class PromptParts:
    """The three pieces of a RULER input; concatenated they give the input back."""

    context: str
    question: str
    answer_prefix: str


def task_family(task: str) -> str:
    """``niah``, ``vt``, ``cwe``, ``fwe`` or ``qa``: the part of the task name before its first underscore."""
    family = task.split("_")[0]
    if family not in MAX_NEW_TOKENS:
        raise ValueError(f"not a RULER task: {task!r} (families: {', '.join(MAX_NEW_TOKENS)})")
    return family


def max_new_tokens(task: str) -> int:
    """Tokens to generate for ``task``: niah 128, vt 30, cwe 120, fwe 50, qa 32."""
    return MAX_NEW_TOKENS[task_family(task)]


def split_input(task: str, text: str) -> PromptParts:
    """Splits a record's ``input`` as kvpress does; ``ValueError`` when the task's patterns are not in it."""
    family = task_family(task)
    questions = list(_QUESTION_PATTERNS[family].finditer(text))
    if not questions:
        raise ValueError(f"no {family} question ({_QUESTION_PATTERNS[family].pattern!r}) in the {task} input")
    start = questions[-1].start()
    answer = _ANSWER_PATTERNS[family].search(text, start)
    if answer is None:
        raise ValueError(f"no answer prefix ({_ANSWER_PATTERNS[family].pattern!r}) after the {task} question")
    return PromptParts(text[:start], text[start : answer.start()], text[answer.start() :])
