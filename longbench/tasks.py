"""The LongBench v1 and LongBench-E task table: prompt, generation length, metric and pipeline rules per task.

Everything here is copied from the official repository (THUDM/LongBench at 2e00731, ``LongBench/config`` and
``pred.py`` / ``eval.py``), typos and stray spaces included, because a single changed character in a prompt
changes the model's output and with it the score. A LongBench-E task (``qasper_e``) is the same task on a
length-balanced sample: it shares everything with its base task except the data and the length buckets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

__all__ = [
    "Task", "TASKS", "V1_TASKS", "E_TASKS", "ENGLISH16", "TASK_GROUPS", "CHAT_TEMPLATE_EXCEPTIONS",
    "FIRST_LINE_TASKS", "resolve_tasks",
]

# config/dataset2prompt.json, verbatim (note "asconcisely", the leading space in qasper's "\n\n Answer" and the
# trailing spaces in multi_news, passage_count, passage_retrieval_en and lcc).
_QA_MULTI_DOC = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give "
    "me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered "
    "based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer "
    "\"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}\n\nArticle: "
        f"{{context}}\n\n Answer the question based on the above article {_QASPER_RULES}\n\nQuestion: {{input}}"
        "\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
        "\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _QA_MULTI_DOC,
    "2wikimqa": _QA_MULTI_DOC,
    "musique": _QA_MULTI_DOC,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, "
        "write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other "
        "words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of "
        "unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, "
        "3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract "
        "is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the "
        "paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc."
        "\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
        "请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是："
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# pred.py: "chat models are better off without build prompts on these tasks".
CHAT_TEMPLATE_EXCEPTIONS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# eval.py keeps only the first line of the prediction for these (few-shot answers run on into the next example).
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


@dataclasses.dataclass(frozen=True)
class Task:
    """One LongBench configuration. ``base`` is the name the official scripts key prompts and metrics by."""

    name: str
    base: str
    category: str
    language: str
    metric: str
    max_new_tokens: int

    @property
    def prompt(self) -> str:
        return PROMPTS[self.base]

    @property
    def uses_chat_template(self) -> bool:
        return self.base not in CHAT_TEMPLATE_EXCEPTIONS

    @property
    def first_line_only(self) -> bool:
        return self.base in FIRST_LINE_TASKS

    @property
    def is_longbench_e(self) -> bool:
        return self.name != self.base


# (name, category, language, metric, max_new_tokens from config/dataset2maxlen.json), in the official order.
_V1 = [
    ("narrativeqa", "Single-doc QA", "en", "qa_f1_score", 128),
    ("qasper", "Single-doc QA", "en", "qa_f1_score", 128),
    ("multifieldqa_en", "Single-doc QA", "en", "qa_f1_score", 64),
    ("multifieldqa_zh", "Single-doc QA", "zh", "qa_f1_zh_score", 64),
    ("hotpotqa", "Multi-doc QA", "en", "qa_f1_score", 32),
    ("2wikimqa", "Multi-doc QA", "en", "qa_f1_score", 32),
    ("musique", "Multi-doc QA", "en", "qa_f1_score", 32),
    ("dureader", "Multi-doc QA", "zh", "rouge_zh_score", 128),
    ("gov_report", "Summarization", "en", "rouge_score", 512),
    ("qmsum", "Summarization", "en", "rouge_score", 512),
    ("multi_news", "Summarization", "en", "rouge_score", 512),
    ("vcsum", "Summarization", "zh", "rouge_zh_score", 512),
    ("trec", "Few-shot", "en", "classification_score", 64),
    ("triviaqa", "Few-shot", "en", "qa_f1_score", 32),
    ("samsum", "Few-shot", "en", "rouge_score", 128),
    ("lsht", "Few-shot", "zh", "classification_score", 64),
    ("passage_count", "Synthetic", "en", "count_score", 32),
    ("passage_retrieval_en", "Synthetic", "en", "retrieval_score", 32),
    ("passage_retrieval_zh", "Synthetic", "zh", "retrieval_zh_score", 32),
    ("lcc", "Code", "code", "code_sim_score", 64),
    ("repobench-p", "Code", "code", "code_sim_score", 64),
]
# pred.py's LongBench-E list (no Chinese tasks, no narrativeqa, musique or qmsum).
_E_BASES = [
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
]

V1_TASKS: tuple[str, ...] = tuple(row[0] for row in _V1)
E_TASKS: tuple[str, ...] = tuple(f"{base}_e" for base in _E_BASES)
TASKS: dict[str, Task] = {row[0]: Task(row[0], row[0], *row[1:]) for row in _V1}
TASKS.update({f"{base}_e": dataclasses.replace(TASKS[base], name=f"{base}_e") for base in _E_BASES})

# The 16 English and code tasks whose unweighted mean the KV-compression papers report, in their column order.
ENGLISH16: tuple[str, ...] = tuple(name for name in V1_TASKS if TASKS[name].language != "zh")

TASK_GROUPS: dict[str, tuple[str, ...]] = {"all": V1_TASKS, "longbench_e": E_TASKS, "english16": ENGLISH16}


def resolve_tasks(spec: str | Iterable[str]) -> list[str]:
    """Expands group names (``all``, ``longbench_e``, ``english16``) and task names into task names.

    Order follows the spec, duplicates are dropped, so ``[english16, multifieldqa_zh]`` means 17 tasks.
    """
    items: Sequence[str] = [spec] if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for item in items:
        if item in TASK_GROUPS:
            expanded = TASK_GROUPS[item]
        elif item in TASKS:
            expanded = (item,)
        else:
            raise ValueError(
                f"unknown task {item!r}; allowed: the groups {sorted(TASK_GROUPS)} or the task names "
                f"{list(TASKS)}"
            )
        names.extend(name for name in expanded if name not in names)
    if not names:
        raise ValueError("the task list is empty")
    return names
