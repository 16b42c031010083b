"""RULER's metrics, against hand cases derived from the evaluator's definitions and, when the
package is installed, against its own functions."""

from __future__ import annotations

import importlib.util
import random

import pytest

from ruler.metrics import (
    METRICS,
    average_score,
    metric_name,
    postprocess_prediction,
    score_task,
    string_match_all,
    string_match_all_per_sample,
    string_match_part,
    string_match_part_per_sample,
)


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        (None, ""),
        ("", ""),
        ("  1234567  ", "1234567"),
        ("\n\t 42 \r\n", "42"),  # strip first (whitespace controls go), then strip again
        ("a\tb\x00c\x1fd", "a\nb\nc\nd"),  # every character in \x00-\x1f becomes a newline
        ("\x01 x \x02", "x"),  # non-whitespace controls survive the first strip, become newlines, then go
        ("a\x7fb", "a\x7fb"),  # DEL is outside the range
        ("Answer: 12, 34.", "Answer: 12, 34."),  # no punctuation removal, no first-line cut
    ],
)
def test_postprocess_prediction(raw, clean):
    assert postprocess_prediction(raw) == clean


def test_string_match_all_counts_the_share_of_references_found():
    assert string_match_all(["the numbers are 111 and 222"], [["111", "222"]]) == 100.0
    assert string_match_all(["only 111"], [["111", "222"]]) == 50.0  # partial
    assert string_match_all(["nothing"], [["111", "222"]]) == 0.0
    assert string_match_all(["111", "nothing"], [["111"], ["222"]]) == 50.0  # mean over samples
    assert string_match_all(["a"], [["a", "b", "c"]]) == 33.33  # rounded to 2 decimals
    assert string_match_all_per_sample(["a"], [["a", "b", "c"]]) == [pytest.approx(100 / 3)]  # not rounded
    assert string_match_all_per_sample(["a b", "x"], [["a", "b"], ["y"]]) == [100.0, 0.0]


def test_matching_ignores_case_on_both_sides():
    assert string_match_all(["the word is APPLE-pie"], [["apple-PIE"]]) == 100.0
    assert string_match_part(["KEY-value"], [["nothing", "key-VALUE"]]) == 100.0
    uuid = "5E3B3C7A-0D2F-4A8B-9C1D-2E3F4A5B6C7D"
    assert string_match_all_per_sample([uuid.lower()], [[uuid]]) == [100.0]


def test_substrings_count_even_inside_longer_words_or_numbers():
    assert string_match_all(["12345678"], [["1234567"]]) == 100.0
    assert string_match_part(["start"], [["art"]]) == 100.0
    assert string_match_all(["1234567"], [["12345678"]]) == 0.0  # the reference must be in the prediction


def test_string_match_part_needs_any_one_reference():
    assert string_match_part(["Paris"], [["Paris", "the French capital"]]) == 100.0
    assert string_match_part(["London"], [["Paris", "France"]]) == 0.0
    assert string_match_part(["Paris", "x", "France"], [["Paris"], ["y"], ["Paris", "France"]]) == 66.67
    assert string_match_part_per_sample(["Paris", "x"], [["paris", "France"], ["y"]]) == [100.0, 0.0]


def test_score_task_cleans_predictions_and_picks_the_metric():
    assert metric_name("qa_1") == metric_name("qa_2") == "string_match_part"
    for task in ("niah_single_1", "niah_multivalue", "vt", "cwe", "fwe"):
        assert metric_name(task) == "string_match_all"
    # qa: one of two answers is enough; niah: both values are needed.
    assert score_task("qa_2", ["  Paris\x00"], [["Paris", "Lyon"]]) == 100.0
    assert score_task("niah_multivalue", ["1111111", None], [["1111111", "2222222"], ["3333333"]]) == 25.0
    with pytest.raises(ValueError, match="not a RULER task"):
        metric_name("longbench_qa")


def test_bad_inputs_raise_instead_of_being_zipped_away():
    for metric in (*METRICS.values(), string_match_all_per_sample, string_match_part_per_sample):
        with pytest.raises(ValueError, match="predictions for"):
            metric(["a", "b"], [["a"]])
        with pytest.raises(ValueError, match="no predictions"):
            metric([], [])
        with pytest.raises(ValueError, match="at least one reference"):
            metric(["a"], [[]])


def test_average_is_the_unweighted_mean_of_task_scores():
    assert average_score({"niah_single_1": 100.0, "niah_single_2": 50.0, "qa_1": 0.0}) == 50.0
    with pytest.raises(ValueError):
        average_score({})


@pytest.mark.skipif(
    importlib.util.find_spec("long_context_eval") is None,
    reason='needs nvidia-long-context-eval: pip install --no-deps "nvidia-long-context-eval==26.3"',
)
def test_agrees_with_the_package_metrics():
    from long_context_eval.eval.synthetic import constants as official

    rng = random.Random(0)
    alphabet = "abAB12 "
    for _ in range(200):
        n = rng.randint(1, 6)
        refs = [
            ["".join(rng.choices(alphabet, k=rng.randint(1, 2))) for _ in range(rng.randint(1, 4))] for _ in range(n)
        ]
        preds = ["".join(rng.choices(alphabet, k=rng.randint(0, 8))) for _ in range(n)]
        assert string_match_all(preds, refs) == official.string_match_all(preds, refs)
        assert string_match_part(preds, refs) == official.string_match_part(preds, refs)
        assert string_match_all_per_sample(preds, refs) == official.string_match_all_per_sample(preds, refs)
        assert string_match_part_per_sample(preds, refs) == official.string_match_part_per_sample(preds, refs)
