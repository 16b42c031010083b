"""The README's and docs/usage.md's code runs as written (with short texts and fewer new tokens, to keep the suite
fast): the quick start, the chat whose second turn asks about the first turn's document, the score threshold."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
USAGE = README.parent / "docs" / "usage.md"


def _readme_code(heading: str, short_answer: tuple[str, str], page: Path = README) -> str:
    """The first Python block after ``heading`` in ``page``, its ``max_new_tokens`` shortened; skips without the
    model."""
    from kvcompress.models import ModelUnavailableError, embedded_model

    try:
        embedded_model().package_locations()
    except ModelUnavailableError as error:
        pytest.skip(f"default model not installed: {error}")
    text = page.read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)
    return code.replace(*short_answer)


@pytest.mark.slow
def test_quick_start_runs():
    code = _readme_code("## Quick start", ("max_new_tokens=256", "max_new_tokens=8"))
    namespace = {"long_text": "Remember: the harbor gate code is 7310. " + "Waves rolled in slowly. " * 120
                 + "What is the harbor gate code?"}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["out"].shape[1] > namespace["inputs"]["input_ids"].shape[1]
    assert namespace["session"].timings["selection"] > 0  # the prompt (> 224 tokens) was compressed


@pytest.mark.slow
def test_chat_example_runs_and_turn_two_reads_turn_one():
    code = _readme_code("## Chat with a compressed cache", ("max_new_tokens=64", "max_new_tokens=6"), USAGE)
    from kvcompress.models import load_default_model

    model, tokenizer = load_default_model()
    document = (" ".join(["The harbour was quiet in the morning fog."] * 40) + " The passkey is 48213. Remember it. "
                + " ".join(["Gulls circled above the fishing boats."] * 40))
    namespace = {"kvcompress": __import__("kvcompress"), "model": model, "tokenizer": tokenizer,
                 "long_document": document}
    exec(compile(code, str(USAGE), "exec"), namespace)
    cache_length = namespace["turn2"]["input_ids"].shape[1]
    answer = tokenizer.decode(namespace["out"][0, cache_length:], skip_special_tokens=True)
    assert "48213" in answer, answer


@pytest.mark.slow
def test_threshold_example_keeps_less_than_its_budget():
    code = _readme_code("## Keep what scores above a threshold", ("max_new_tokens=512", "max_new_tokens=4"), USAGE)
    from kvcompress.models import load_default_model

    model, tokenizer = load_default_model()
    text = "The courier's code word is amber. " + "Rain fell on the quiet town all day. " * 60 + "The code word?"
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    namespace = {"kvcompress": __import__("kvcompress"), "model": model, "tokenizer": tokenizer, "inputs": inputs}
    exec(compile(code, str(USAGE), "exec"), namespace)
    assert 0 < namespace["kept"] < 0.5  # the budget (half the prompt) is a cap the threshold stays under


def _run_on_the_report(heading: str, short_answer: tuple[str, str]) -> None:
    """Run the README's block after ``heading`` on a made-up report whose factory is built in Trondheim."""
    code = _readme_code(heading, short_answer)
    from kvcompress.models import load_default_model

    model, tokenizer = load_default_model()
    document = ("The annual report was written by Ada Lund. " + "Sales grew steadily across the region. " * 40
                + "The new battery factory will be built in Trondheim. " + "Costs were kept under control. " * 40)
    namespace = {"kvcompress": __import__("kvcompress"), "model": model, "tokenizer": tokenizer,
                 "long_text": document}
    exec(compile(code, str(README), "exec"), namespace)


@pytest.mark.slow
def test_document_once_questions_after_runs(capsys):
    _run_on_the_report("**Compress a document once", ("max_new_tokens=64", "max_new_tokens=12"))
    answers = capsys.readouterr().out.strip().splitlines()
    assert len(answers) == 2 and all(answers), answers
    assert "Trondheim" in answers[1], answers


@pytest.mark.slow
def test_store_and_reuse_a_context_runs(tmp_path, monkeypatch, capsys):
    """The stored document answers after a load as the session that compressed it would."""
    question = 'ask("Where will the factory be built?"'
    monkeypatch.chdir(tmp_path)
    _run_on_the_report("**Store a compressed document", (question, question + ", max_new_tokens=12"))
    assert (tmp_path / "report.kvc.safetensors").exists()
    answer = capsys.readouterr().out.strip()
    assert "Trondheim" in answer, answer
