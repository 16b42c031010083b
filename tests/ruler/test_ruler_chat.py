"""Chat prompts for the two protocols: kvpress's rendering, the answer prefix opening the assistant turn, and the
token boundary after the context."""

from __future__ import annotations

import pytest

from ruler.chat import PROTOCOLS, chat_prompt, encode_prompt
from ruler.prompts import PromptParts, split_input

PARTS = PromptParts(
    context="Some special magic numbers are hidden.\nOne of the special magic numbers for a-b is: 1234567.\n",
    question="What is the special magic number for a-b mentioned in the provided text? ",
    answer_prefix="The special magic number for a-b mentioned in the provided text is",
)


class CharTokenizer:
    """One token per character; BOS (id 1) only with special tokens; a template that trims the content."""

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template
        self.template_kwargs: list[dict] = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        assert not tokenize
        self.template_kwargs.append(kwargs)
        text = "<s>" + "".join(f"<|{m['role']}|>{m['content'].strip()}<|end|>" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(char) for char in text]


def test_chat_template_wraps_context_and_question_and_the_prefix_opens_the_reply():
    tokenizer = CharTokenizer("template")
    prompt = chat_prompt(tokenizer, PARTS)
    assert prompt.head == "<s><|user|>" + PARTS.context
    assert prompt.tail == PARTS.question + "<|end|><|assistant|>" + PARTS.answer_prefix
    assert tokenizer.template_kwargs == [{"enable_thinking": False}]  # as kvpress, for Qwen3-style templates


def test_both_protocols_share_the_ids_and_differ_in_what_is_prefilled_first():
    tokenizer = CharTokenizer("template")
    prompt = chat_prompt(tokenizer, PARTS)
    query_aware, context_first = (encode_prompt(tokenizer, PARTS, protocol) for protocol in PROTOCOLS)
    assert query_aware.input_ids == context_first.input_ids == [ord(c) for c in prompt.text]  # no extra BOS
    assert query_aware.prefill_length == len(prompt.text)
    assert context_first.prefill_length == len(prompt.head)
    with pytest.raises(ValueError, match="unknown protocol"):
        encode_prompt(tokenizer, PARTS, "question_first")


def test_without_a_chat_template_the_prompt_is_rulers_input():
    tokenizer = CharTokenizer(None)
    prompt = chat_prompt(tokenizer, PARTS)
    assert prompt.text == PARTS.context + PARTS.question + PARTS.answer_prefix
    encoded = encode_prompt(tokenizer, PARTS, "context_first")
    assert encoded.input_ids[0] == 1 and encoded.input_ids[1:] == [ord(c) for c in prompt.text]  # default BOS
    assert encoded.prefill_length == 1 + len(PARTS.context)


def test_smollm2_chat_prompt_equals_its_template_on_context_plus_question():
    """The real default tokenizer: the split changes nothing in the rendered text, and the boundary is exact."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from kvcompress.models import converted_model_dir

    folder = converted_model_dir()
    if not (folder / "config.json").is_file():
        pytest.skip("the default model is not converted yet (python -c 'from kvcompress.models import "
                    "load_default_model as l; l()')")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = "A special magic number is hidden.\nThe grass is green.\n" + PARTS.question + PARTS.answer_prefix
    parts = split_input("niah_single_1", text)
    prompt = chat_prompt(tokenizer, parts)
    messages = [{"role": "user", "content": parts.context + parts.question}]
    assert prompt.text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + (
        parts.answer_prefix
    )
    assert prompt.tail.endswith("<|im_end|>\n<|im_start|>assistant\n" + parts.answer_prefix)
    encoded = encode_prompt(tokenizer, parts, "context_first")
    assert encoded.input_ids == tokenizer.encode(prompt.text, add_special_tokens=False)
    assert tokenizer.decode(encoded.input_ids[: encoded.prefill_length]) == prompt.head
