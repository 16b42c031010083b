"""LongBench (v1 and LongBench-E) for the shared evaluation runner (``kvbench``), faithful to the official pipeline.

Modules: ``tasks`` (prompts, lengths, metric per task), ``metrics`` and ``evaluate`` (the official scoring,
quirks included), ``data`` (loading and validation), ``prompt`` (the official prompt construction), ``benchmark``
(LongBench's part of an experiment), ``cli`` (``kvcompress-longbench``). Importing the package loads neither torch
nor transformers.
"""
