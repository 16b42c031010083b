"""The official LongBench metrics on hand-computed cases, quirks included."""

from __future__ import annotations

import difflib
import random
import sys

import pytest

from longbench import metrics
from longbench.metrics import (
    classification_score,
    code_sim_score,
    count_score,
    f1_score,
    fuzz_ratio,
    normalize_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)

IDENTICAL = 2 / (2 + 1e-8)  # rouge's F = 2PR/(P+R+1e-8) at P = R = 1: 0.999999995


# ---------------------------------------------------------------------------------------------- qa_f1
@pytest.mark.parametrize(
    "text, normalised",
    [
        ("The Cat, a dog!", "cat dog"),  # articles and ASCII punctuation go
        ("state-of-the-art", "stateoftheart"),  # hyphens are deleted, not split
        ("1,000,000 and 3.14", "1000000 and 314"),
        ("“Hamlet”", "“hamlet”"),  # Unicode quotes stay
        ("New\xa0York", "new york"),  # str.split splits on Unicode whitespace
        ("The The", ""),
        ("Straße", "straße"),  # lower(), not casefold()
    ],
)
def test_normalize_answer(text, normalised):
    assert normalize_answer(text) == normalised


def test_qa_f1_hand_computed():
    assert qa_f1_score("The cat sat.", "cat") == pytest.approx(2 / 3)  # P = 1/2, R = 1
    assert qa_f1_score("a cat, a cat", "the cat") == pytest.approx(2 / 3)  # multiset: 1 of 2 predicted "cat"s
    assert qa_f1_score("1,000,000", "1000000") == 1.0
    assert qa_f1_score("state-of-the-art", "state of the art") == 0
    assert qa_f1_score("“Hamlet”", "Hamlet") == 0
    assert qa_f1_score("Straße", "STRASSE") == 0


def test_f1_without_overlap_is_the_int_zero():
    for value in (f1_score([], []), qa_f1_score("", ""), qa_f1_score("The The", "the")):
        assert value == 0 and type(value) is int


def test_qa_f1_zh_uses_jieba_words():
    # 我/爱/北京/天安门 against 北京: P = 1/4, R = 1.
    assert qa_f1_zh_score("我爱北京天安门", "北京") == pytest.approx(0.4)
    assert qa_f1_zh_score("北京。", "北京") == 1.0  # 。 is in the list and its empty token is dropped


def test_qa_f1_zh_quirks():
    assert qa_f1_zh_score("《红楼梦》", "红楼梦") == pytest.approx(2 / 3)  # 《 is missing from the list, 》 is not
    assert qa_f1_zh_score("５个", "5个") == pytest.approx(0.5)  # full-width digits are not mapped


# ---------------------------------------------------------------------------------------------- rouge
def test_rouge_identical_texts_score_just_below_one():
    assert rouge_score("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(IDENTICAL, abs=1e-15)
    assert rouge_score("the cat", "the cat") < 1.0


def test_rouge_counts_unique_tokens():
    assert rouge_score("the the the cat", "the cat") == pytest.approx(IDENTICAL, abs=1e-15)


def test_rouge_no_lowercasing_no_punctuation_stripping():
    assert rouge_score("Cat", "cat") == 0.0
    assert rouge_score("cat,", "cat") == 0.0


def test_rouge_is_summary_level_over_sentences_split_on_dots():
    # Union LCS: "a c" and "b d" each match part of "a b c d"; all 4 reference words are covered.
    # (A sentence-agnostic ROUGE-L, like rouge-score's, gives LCS("a c b d", "a b c d") = 3, i.e. 0.75.)
    assert rouge_score("a c. b d", "a b c d") == pytest.approx(IDENTICAL, abs=1e-15)


@pytest.mark.parametrize("prediction", ["", "...", " "])
def test_rouge_empty_predictions_score_zero(prediction):
    assert rouge_score(prediction, "the cat") == 0.0


def _random_words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(2000)}" for _ in range(count))


def test_rouge_recursion_quirk_and_its_fix():
    short = (_random_words(300, 1), _random_words(300, 2))
    long = (_random_words(600, 1), _random_words(600, 2))
    assert 0 < rouge_score(*short) == rouge_score(*short, fixes={"rouge_recursion"})
    assert rouge_score(*long) == 0.0  # the LCS reconstruction exceeds the recursion limit upstream
    assert rouge_score(*long, fixes={"rouge_recursion"}) > 0.0
    assert sys.getrecursionlimit() == 1000  # restored


def test_rouge_recursion_headroom_does_not_depend_on_the_callers_depth():
    near_limit = (_random_words(505, 3), _random_words(505, 4))  # fits the official headroom, not 300 frames less
    direct = rouge_score(*near_limit)
    assert direct > 0

    def nested(depth: int) -> float:
        return rouge_score(*near_limit) if depth == 0 else nested(depth - 1)

    assert nested(300) == direct


def test_rouge_zh_segments_with_jieba():
    # {北京, 天安门} against {我, 爱, 北京, 天安门}: P = 1, R = 1/2.
    assert rouge_zh_score("北京天安门", "我爱北京天安门") == pytest.approx(2 * 0.5 / (1.5 + 1e-8))
    assert rouge_zh_score("我爱北京天安门", "我爱北京天安门") == pytest.approx(IDENTICAL, abs=1e-15)


# ---------------------------------------------------------------------------------------------- classification
TREC = ["City", "Country", "Other location", "location", "Date"]


@pytest.mark.parametrize(
    "prediction, ground_truth, classes, expected",
    [
        ("City", "City", TREC, 1.0),
        ("City or Country", "City", TREC, 0.5),
        ("city", "City", TREC, 0.0),  # case-sensitive
        ("Other location", "Other location", ["location", "Other location"], 1.0),  # substring of the answer drops
        ("other location", "location", ["location", "other location"], 0.5),
        ("big city", "big city", ["big", "city", "big city"], 0.5),  # the iteration bug skips "city"
        ("City", "City", ["City", "City"], 0.5),  # duplicate classes count twice
        ("Mountain", "Mountain", TREC, 0.0),  # an answer outside all_classes
        ("", "City", TREC, 0.0),
    ],
)
def test_classification_official(prediction, ground_truth, classes, expected):
    assert classification_score(prediction, ground_truth, all_classes=classes) == expected


def test_classification_iteration_fix_is_opt_in():
    classes = ["big", "city", "big city"]
    assert classification_score("big city", "big city", all_classes=classes) == 0.5
    assert classification_score("big city", "big city", all_classes=classes, fixes={"classification_iteration"}) == 1.0


# ---------------------------------------------------------------------------------------------- retrieval, count
@pytest.mark.parametrize(
    "prediction, expected",
    [
        ("Paragraph 7", 1.0),
        ("7", 1.0),
        ("段落7", 1.0),
        ("Paragraph 7 and 8", 0.5),
        ("Paragraph 7 and Paragraph 8", 0.5),
        ("Paragraph 7 (out of 30 paragraphs)", 0.5),
        ("Paragraph 07", 0.0),
        ("Paragraph ７", 0.0),  # full-width digits match \d but are not "7"
        ("Paragraph ٧", 0.0),
        ("the seventh one", 0.0),
    ],
)
def test_retrieval_score(prediction, expected):
    assert retrieval_score(prediction, "Paragraph 7") == expected


def test_retrieval_needs_paragraph_n_in_the_answer():
    with pytest.raises(IndexError):
        retrieval_score("7", "7")


@pytest.mark.parametrize("prediction, expected",
                         [("段落5", 1.0), ("第5段", 1.0), ("段落五", 0.0), ("段落5和段落6", 0.5)])
def test_retrieval_zh_score(prediction, expected):
    assert retrieval_zh_score(prediction, "段落5") == expected


@pytest.mark.parametrize(
    "prediction, ground_truth, expected",
    [("12", "12", 1.0), ("There are 12 paragraphs.", "12", 1.0), ("5 or 6", "5", 0.5), ("05", "5", 0.0),
     ("-3", "3", 1.0), ("10.5", "10", 0.5), ("121", "21", 0.0), ("twelve", "12", 0.0), ("１２", "12", 0.0)],
)
def test_count_score(prediction, ground_truth, expected):
    assert count_score(prediction, ground_truth) == expected


# ---------------------------------------------------------------------------------------------- code_sim
@pytest.mark.parametrize(
    "prediction, expected",
    [
        ("return x", 1.0),
        ("\n\nreturn x", 1.0),  # leading newlines are stripped
        ("# a comment\nreturn x", 1.0),
        ("```python\nreturn x\n```", 1.0),  # lines with a backtick are skipped
        ("// note\nreturn x", 1.0),
        ("return x  # why\nreturn x", 1.0),  # a trailing comment disqualifies the line too
        ("# only comments\n# here", 0.0),  # no line left: "" against the answer
        ("", 0.0),
        ("   \nreturn x", 0.18),  # a whitespace-only first line is taken: round(100 * 2/11) = 18
        ("return x\r\nreturn y", 0.94),  # CRLF leaves "\r": round(100 * 16/17) = 94
    ],
)
def test_code_sim_score(prediction, expected):
    assert code_sim_score(prediction, "return x") == expected


def test_code_sim_skips_lines_with_hash_or_slashes_inside_strings():
    # 'color = "#fff"' is skipped although it is the answer; "x = 1" is compared instead.
    assert code_sim_score('color = "#fff"\nx = 1', 'color = "#fff"') == fuzz_ratio("x = 1", 'color = "#fff"') / 100
    assert code_sim_score('url = "http://a"\nx = 1', 'url = "http://a"') < 1.0


def test_fuzz_ratio_guards():
    assert fuzz_ratio("", "") == 100  # equality is checked before emptiness
    assert fuzz_ratio("", "x") == 0
    assert fuzz_ratio(None, "x") == 0
    assert fuzz_ratio("abcdefgh", "aXXXXXXX") == 12  # 100 * 2/16 = 12.5 rounds half to even


@pytest.mark.filterwarnings("ignore:Using slow pure-python SequenceMatcher")
def test_fuzz_ratio_equals_fuzzywuzzy_on_its_difflib_backend(monkeypatch):
    from fuzzywuzzy import fuzz

    monkeypatch.setattr(fuzz, "SequenceMatcher", difflib.SequenceMatcher)  # the backend of the official setup
    rng = random.Random(0)
    for _ in range(300):
        size = rng.choice([5, 40, 250])  # 250: difflib's autojunk heuristic applies from 200 characters
        a = "".join(rng.choice("ab cd(x)=") for _ in range(rng.randrange(1, size)))
        b = "".join(rng.choice("ab cd(x)=") for _ in range(rng.randrange(1, size)))
        assert fuzz_ratio(a, b) == fuzz.ratio(a, b)


@pytest.mark.filterwarnings("ignore:Using slow pure-python SequenceMatcher")
def test_code_sim_ignores_fuzzywuzzys_backend(monkeypatch):
    """Whatever fuzzywuzzy would use (python-Levenshtein when installed), the score stays difflib's."""
    from fuzzywuzzy import fuzz

    class Levenshteinish(difflib.SequenceMatcher):
        def ratio(self) -> float:
            return 0.99

    long_a, long_b = "x" * 150 + "abc" * 30, "y" * 150 + "abc" * 30
    before = code_sim_score(long_a, long_b)
    monkeypatch.setattr(fuzz, "SequenceMatcher", Levenshteinish)
    assert code_sim_score(long_a, long_b) == before == 0.0  # autojunk junks every popular character


def test_unknown_fix_is_rejected():
    with pytest.raises(ValueError, match="classification_iteration"):
        metrics.check_fixes({"rouge_recursoin"})
