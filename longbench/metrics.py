"""The official LongBench metrics (``LongBench/metrics.py``), with the official names, signatures and quirks.

Every function takes ``(prediction, ground_truth, **kwargs)`` and returns a score in [0, 1]; the classification
metric reads ``all_classes`` from the keywords. Published numbers are only comparable when every quirk of the
official code is reproduced, so the quirks are kept on purpose (``docs/longbench.md`` lists them). Two of them are
plain bugs; their corrected behaviour is available through ``fixes=`` (names in ``METRIC_FIXES``), never by
default.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import re
import string
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence

import jieba
from rouge import Rouge

__all__ = [
    "METRIC_FIXES", "METRICS", "normalize_answer", "normalize_zh_answer", "f1_score", "qa_f1_score",
    "qa_f1_zh_score", "rouge_score", "rouge_zh_score", "classification_score", "retrieval_score",
    "retrieval_zh_score", "count_score", "code_sim_score", "fuzz_ratio", "check_fixes",
]

jieba.setLogLevel(logging.WARNING)  # jieba announces its dictionary build on stderr at DEBUG level

METRIC_FIXES: dict[str, str] = {
    "classification_iteration": (
        "classification_score drops every class that is a proper substring of the answer; the official loop "
        "removes from the list it iterates and so skips the entry after each removal"
    ),
    "rouge_recursion": (
        "rouge_score raises Python's recursion limit for the LCS reconstruction of long '.'-free texts, which the "
        "official run loses to a RecursionError scored 0.0 (typical for Chinese summaries)"
    ),
}

_ASCII_PUNCTUATION = frozenset(string.punctuation)
_ZH_PUNCTUATION = _ASCII_PUNCTUATION | frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)  # the official list: note that 《 is missing while 》 is present


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower, drop ASCII punctuation, drop English articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _ASCII_PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lower, drop ASCII and the listed CJK punctuation, delete all whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ZH_PUNCTUATION).split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs) -> float:
    """Token-multiset F1. Returns the int 0 when nothing overlaps (two empty lists included), as upstream."""
    num_same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if num_same == 0:
        return 0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """F1 over jieba words, each normalised after segmentation (so punctuation never merges words)."""

    def tokens(text: str) -> list[str]:
        words = (normalize_zh_answer(word) for word in jieba.cut(text, cut_all=False))
        return [word for word in words if word]

    return f1_score(tokens(prediction), tokens(ground_truth))


# Frames on the official stack when ``rouge_score`` runs: eval.py's module, ``scorer``, ``rouge_score``.
_OFFICIAL_STACK_DEPTH = 3
_OFFICIAL_RECURSION_LIMIT = 1000  # CPython's default, which eval.py never changes


def _stack_depth() -> int:
    depth, frame = 0, sys._getframe(1)
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return depth


@contextlib.contextmanager
def _recursion_limit(limit: int) -> Iterator[None]:
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F of the ``rouge`` package 1.0.1 (not ``rouge-score``); any error scores 0.0.

    The package reconstructs the LCS recursively, so long '.'-free sentence pairs exceed the recursion limit and
    score 0.0 upstream. Whether that happens depends on the stack headroom, so the official mode gives the call
    the headroom it has under eval.py (limit 1000 at depth 3), whatever depth this process calls from;
    ``fixes={"rouge_recursion"}`` gives it enough for any input instead. Upstream's bare ``except`` also swallows
    KeyboardInterrupt; here only exceptions score 0.0, which changes no score.
    """
    depth = _stack_depth()
    if "rouge_recursion" in kwargs.get("fixes", ()):
        limit = max(sys.getrecursionlimit(), depth + len(prediction.split()) + len(ground_truth.split()) + 100)
    else:
        limit = _OFFICIAL_RECURSION_LIMIT + depth - _OFFICIAL_STACK_DEPTH
    try:
        with _recursion_limit(limit):
            scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:
        return 0.0
    return scores["rouge-l"]["f"]


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L over jieba words joined by spaces; Chinese punctuation stays as tokens."""
    return rouge_score(
        " ".join(jieba.cut(prediction, cut_all=False)), " ".join(jieba.cut(ground_truth, cut_all=False)), **kwargs
    )


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/k when the answer is among the k classes named in the prediction (case-sensitive substrings).

    Classes that are proper substrings of the answer do not count against it ("City" inside "big city"). The
    official loop removes them from the list it is iterating, which skips the element after each removal; that
    is reproduced unless ``fixes`` contains ``"classification_iteration"``.
    """
    matches = [name for name in kwargs["all_classes"] if name in prediction]
    if "classification_iteration" in kwargs.get("fixes", ()):
        matches = [name for name in matches if not (name in ground_truth and name != ground_truth)]
    else:
        for name in matches:
            if name in ground_truth and name != ground_truth:
                matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    """Share of the numbers (``\\d+``, any Unicode digits) in the prediction that equal the target string."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return float(sum(1 for number in numbers if number == target) / len(numbers))


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Fraction of numbers in the prediction equal to N of the answer's "Paragraph N" (IndexError without it)."""
    return _fraction_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """As ``retrieval_score`` with the answer's "段落N"."""
    return _fraction_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return _fraction_equal(prediction, str(ground_truth))


def fuzz_ratio(s1: str | None, s2: str | None) -> int:
    """``fuzzywuzzy.fuzz.ratio`` 0.18 as the official setup runs it: its guards around difflib's SequenceMatcher.

    fuzzywuzzy silently switches to python-Levenshtein when that is importable, which scores long lines very
    differently (difflib's autojunk heuristic applies from 200 characters on). Calling difflib here directly
    makes the score independent of what else is installed.
    """
    if s1 is None or s2 is None:
        return 0
    if s1 == s2:  # checked before emptiness, so "" vs "" is 100
        return 100
    if not s1 or not s2:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Edit similarity of the first generated line that holds no backtick, ``#`` or ``//`` (else "")."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz_ratio(line, ground_truth) / 100


METRICS: dict[str, Callable[..., float]] = {
    function.__name__: function
    for function in (
        qa_f1_score, qa_f1_zh_score, rouge_score, rouge_zh_score, classification_score, retrieval_score,
        retrieval_zh_score, count_score, code_sim_score,
    )
}


def check_fixes(fixes: Collection[str]) -> frozenset[str]:
    """Validates metric fix names (from a config or an API caller) against ``METRIC_FIXES``."""
    unknown = sorted(set(fixes) - set(METRIC_FIXES))
    if unknown:
        raise ValueError(f"unknown metric fix(es) {unknown}; allowed: {sorted(METRIC_FIXES)}")
    return frozenset(fixes)
