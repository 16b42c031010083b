"""The task table against the official configuration files."""

from __future__ import annotations

import hashlib
import json

import pytest

from longbench.tasks import E_TASKS, ENGLISH16, PROMPTS, TASKS, V1_TASKS, resolve_tasks

# sha256 of config/dataset2prompt.json as transcribed in the spec (json.dumps, sorted keys, ensure_ascii=False).
PROMPTS_SHA256 = "e7d865d712fe45e2455f5e864ac474001d7758d68d349e76ffbcdd382483358f"

OFFICIAL_MAXLEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32, "2wikimqa": 32,
    "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64,
    "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}


def test_prompts_are_the_official_file_verbatim():
    digest = hashlib.sha256(json.dumps(PROMPTS, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    assert digest == PROMPTS_SHA256
    assert "asconcisely" in PROMPTS["narrativeqa"]
    assert "\n\n Answer the question based on the above article" in PROMPTS["qasper"]
    assert PROMPTS["passage_count"].endswith("The final answer is: ")
    assert PROMPTS["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    assert "{context}{input}" in PROMPTS["repobench-p"]


def test_task_counts_and_order():
    assert len(V1_TASKS) == 21 and len(E_TASKS) == 13 and len(TASKS) == 34
    assert V1_TASKS[0] == "narrativeqa" and V1_TASKS[-1] == "repobench-p"
    assert set(E_TASKS) == {f"{name}_e" for name in (
        "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
        "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")}


@pytest.mark.parametrize("name", list(TASKS))
def test_generation_length_is_official(name):
    assert TASKS[name].max_new_tokens == OFFICIAL_MAXLEN[TASKS[name].base]


def test_chat_template_exceptions_and_first_line_tasks():
    assert {name for name in V1_TASKS if not TASKS[name].uses_chat_template} == {
        "trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert {name for name in TASKS if TASKS[name].first_line_only} == {
        "trec", "triviaqa", "samsum", "lsht", "trec_e", "triviaqa_e", "samsum_e"}


def test_metrics_per_task():
    expected = {
        "multifieldqa_zh": "qa_f1_zh_score", "dureader": "rouge_zh_score", "vcsum": "rouge_zh_score",
        "gov_report": "rouge_score", "samsum": "rouge_score", "trec": "classification_score",
        "lsht": "classification_score", "triviaqa": "qa_f1_score", "passage_count": "count_score",
        "passage_retrieval_en": "retrieval_score", "passage_retrieval_zh": "retrieval_zh_score",
        "lcc": "code_sim_score", "repobench-p_e": "code_sim_score",
    }
    assert {name: TASKS[name].metric for name in expected} == expected


def test_english16_is_the_papers_task_list():
    assert ENGLISH16 == (
        "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
        "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
    )


def test_resolve_tasks():
    assert resolve_tasks("all") == list(V1_TASKS)
    assert resolve_tasks("longbench_e") == list(E_TASKS)
    assert resolve_tasks(["english16", "multifieldqa_zh", "qasper"]) == [*ENGLISH16, "multifieldqa_zh"]
    with pytest.raises(ValueError, match="unknown task 'qasperr'"):
        resolve_tasks(["qasperr"])
