"""What a session offers around its forwards: its cache, byte report and timings readable after the block, one
context at a time, and documents and questions given as text (``prefill_text`` / ``ask``)."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor, compress
from kvcompress.cache import full_cache_bytes, kv_cache_bytes
from kvcompress.chat import document_prompt
from tiny_models import TinyTokenizer, random_tokens, tiny_model


class TemplateTokenizer(TinyTokenizer):
    """The tiny vocabulary with a chat template that wraps each message and opens the assistant's turn."""

    chat_template = "template"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        assert not tokenize
        text = "<s>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def test_the_cache_report_and_timings_outlive_the_block():
    """Before, ``session.cache`` was None and ``session.layers`` empty after the block, and the timings had no
    prefill or decode totals."""
    model = tiny_model("llama")
    with compress(model, method="snapkv", budget=40) as session:
        out = model.generate(random_tokens(90), max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
    assert session.cache is out.cache and sorted(session.layers) == [0, 1]
    report = session.report()
    assert report.tokens == 94  # the prompt and every new token but the last, which is returned, not fed
    assert report.kv_bytes == kv_cache_bytes(out.cache) and report.full_kv_bytes == full_cache_bytes(out.cache, 94)
    assert report.kept_fraction == pytest.approx(report.kv_bytes / report.full_kv_bytes)
    assert report.timings["prefill"] > 0 and report.timings["decode"] > 0
    assert 0 < report.compression_seconds < report.timings["prefill"] + report.timings["decode"]
    assert "94 tokens seen" in str(report)


def test_context_calls_outside_the_block_are_refused():
    model = tiny_model("llama")
    session = KVCacheCompressor(KVCacheCompressionParameters())(model)
    with pytest.raises(RuntimeError, match="session.prefill runs inside the `with` block"):
        session.prefill(random_tokens(20))
    with session:
        session.prefill(random_tokens(20))
    with pytest.raises(RuntimeError, match="session.generate runs inside the `with` block"):
        session.generate(random_tokens(3), max_new_tokens=2)


def test_a_second_prefill_starts_a_new_context():
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8)
    question = random_tokens(5, seed=3)
    with KVCacheCompressor(params)(model) as session:
        session.prefill(random_tokens(80, seed=1))
        session.prefill(random_tokens(70, seed=2))
        answer = session.generate(question, max_new_tokens=6)
    with KVCacheCompressor(params)(model) as session:
        session.prefill(random_tokens(70, seed=2))
        assert torch.equal(session.generate(question, max_new_tokens=6), answer)


def test_a_document_and_its_questions_as_text():
    model = tiny_model("llama")
    tokenizer = TemplateTokenizer()
    document, question = "the quay was closed at dawn. " * 6, "when was the quay closed?"
    with compress(model, method="kvzip", budget=0.5, tokenizer=tokenizer) as session:
        with pytest.raises(RuntimeError, match="prefill_text"):
            session.ask(question)
        session.prefill_text(document)
        assert session.cache.get_seq_length() == len("<s><|user|>" + document)  # the head: header and document
        answer = session.ask(question, max_new_tokens=4)
        tail = tokenizer.encode("\n\n" + question + "<|end|><|assistant|>")
        assert answer == tokenizer.decode(session.generate(torch.tensor([tail]), max_new_tokens=4)[0]).strip()
    with compress(model, method="snapkv", budget=0.5) as session:
        with pytest.raises(ValueError, match="prefill_text needs a tokenizer"):
            session.prefill_text(document)


def test_document_prompt_without_a_template_is_plain_text():
    rendered = document_prompt(TinyTokenizer(), "a report")
    assert (rendered.head, rendered.question_text("why?")) == ("a report", "\n\nwhy?\nAnswer:")
    templated = document_prompt(TemplateTokenizer(), "a report")
    assert templated.head == "<s><|user|>a report"
    assert templated.head + templated.question_text("why?") == TemplateTokenizer().apply_chat_template(
        [{"role": "user", "content": "a report\n\nwhy?"}], add_generation_prompt=True, tokenize=False)
