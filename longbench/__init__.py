"""LongBench (v1 and LongBench-E) evaluation of KV-cache compression settings, faithful to the official pipeline.

Modules: ``tasks`` (prompts, lengths, metric per task), ``metrics`` and ``evaluate`` (the official scoring,
quirks included), ``data`` (loading and validation), ``prompt`` and ``predict`` (the official generation rules,
resumable), ``experiment`` (YAML), ``sharding`` (multi-process runs), ``report`` (tables and plot), ``cli``.
Importing the package loads neither torch nor transformers; generation does.
"""
