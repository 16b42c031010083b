"""The evaluation runner shared by LongBench and RULER: experiment YAML, resumable and sharded predictions under a
KV-cache compression setting, the benchmark's official scores, reports.

Modules: ``experiment`` and ``config`` (YAML), ``benchmark`` (what a benchmark supplies, and the registry),
``generation`` (one sample under a setting, both compression protocols, real KV bytes), ``predict`` and
``predictions`` (durable, resumable prediction files), ``sharding`` (torchrun / accelerate ranks), ``modeling``,
``layout``, ``evaluate``, ``report``, ``cli``. The benchmarks themselves live in ``longbench`` and ``ruler``.
Importing the package loads neither torch nor transformers; generation does.
"""
