"""RULER (NVIDIA's synthetic long-context benchmark) for KV-cache compression settings, offline.

Modules: ``generate`` and ``cli`` (the records, made by the official generator scripts of
``nvidia-long-context-eval`` and cached), ``prompts`` (kvpress's split of a record into context, question and
answer prefix; standard library only), ``chat`` (the chat prompt and its tokens for the two compression
protocols), ``metrics`` (RULER's string-match scores). docs/ruler.md describes the pipeline and its deviations.
"""
