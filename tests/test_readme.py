"""The README's quick start runs as written (with a short text and fewer new tokens, to keep the suite fast)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_quick_start_runs():
    from kvcompress.models import DefaultModelUnavailableError, default_gguf_path

    try:
        default_gguf_path()
    except DefaultModelUnavailableError as error:
        pytest.skip(f"default model not installed: {error}")
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("max_new_tokens=256", "max_new_tokens=8")
    namespace = {"long_text": "Remember: the harbor gate code is 7310. " + "Waves rolled in slowly. " * 120
                 + "What is the harbor gate code?"}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["out"].shape[1] > namespace["inputs"]["input_ids"].shape[1]
    assert namespace["session"].timings["selection"] > 0  # the prompt (> 224 tokens) was compressed


@pytest.mark.slow
def test_chat_example_runs_and_turn_two_reads_turn_one():
    from kvcompress.models import DefaultModelUnavailableError, default_gguf_path, load_default_model

    try:
        default_gguf_path()
    except DefaultModelUnavailableError as error:
        pytest.skip(f"default model not installed: {error}")
    text = README.read_text(encoding="utf-8")
    section = text[text.index("**Chat with a compressed cache.**"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("max_new_tokens=64", "max_new_tokens=6")
    model, tokenizer = load_default_model()
    document = (" ".join(["The harbour was quiet in the morning fog."] * 40) + " The passkey is 48213. Remember it. "
                + " ".join(["Gulls circled above the fishing boats."] * 40))
    namespace = {"kvcompress": __import__("kvcompress"), "model": model, "tokenizer": tokenizer,
                 "long_document": document}
    exec(compile(code, str(README), "exec"), namespace)
    cache_length = namespace["turn2"]["input_ids"].shape[1]
    answer = tokenizer.decode(namespace["out"][0, cache_length:], skip_special_tokens=True)
    assert "48213" in answer, answer
