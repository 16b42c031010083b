"""Every Triton kernel launch compiled ahead of time for NVIDIA architectures, on CPU: no GPU, driver or network.

Triton's interpreter, which runs the kernels in the suite, has no shared memory: a launch whose blocks outgrow a
GPU's only fails at its first call there. Triton compiles for any target without a GPU, so this module compiles
the launches ``triton_blocks`` describes, exactly as the wrappers make them, for each architecture and reports
what they need. Two depths:

* ``"shared"``: lowering stops once Triton has allocated the shared memory (the TritonGPU passes of its
  ``make_llir`` up to ``allocate_shared_memory_nv``, which sets the module's ``ttg.shared``): a tenth of a second
  per launch, what the suite's check runs. ``tests/kernels/test_ahead_of_time.py`` holds it equal to the whole
  pipeline's bytes, so a Triton that changes its passes fails there instead of reporting wrong bytes.
* ``"cubin"``: the whole pipeline through Triton's own ptxas: shared memory, registers and spills
  (``benchmarks/gpu/compile_report.py``).

The compiles run in processes of their own (``triton_compile.py``: the interpreter off, a private Triton cache,
so nothing they build reaches a real run's), a share of the launches each.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict

import torch

from . import triton_blocks

ARCHITECTURES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]  # those Triton 3.6 targets, of SHARED_MEMORY
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
HEAD_DIMS = (64, 128, 256)


def launches(dtype: torch.dtype, head_dim: int, every_flag: bool = False) -> list[dict]:
    """The launches the wrappers make for ``dtype`` inputs of ``head_dim``, as compile cases (without a target):
    with ``every_flag`` each combination of the kernels' flags, else the widest, with every flag that adds a tile
    on (HAS_VALID, HAS_OBSERVED, NEED_OUTPUT, SCORES; MAXIMUM, a maximum over the tile a sum reduces, adds none) and
    8-bit codes, whose tiles are wider than 4-bit ones' and add to the launch without codes: that one too only where
    the coded launch pipelines fewer stages (the half-precision forward), so that either may need more. Codes in
    the default groups (``parameters``: 32 channels of a key, 64 of a value)."""
    choices = (False, True) if every_flag else (True,)
    codes = [dict(bits=bits, key_group=32, value_group=64) for bits in ((16, 8, 4) if every_flag else (16, 8))]
    found = {}
    for valid, observed, output in itertools.product(choices, repeat=3):
        for maximum, code in itertools.product((False, True) if every_flag else (False,), codes):
            found.update(dict.fromkeys(triton_blocks.scoring_launches(head_dim, dtype, valid, observed, output,
                                                                      maximum, **code)))
    for valid, scores in itertools.product(choices, repeat=2):
        for code in codes:
            found.update(dict.fromkeys(triton_blocks.decode_launches(head_dim, dtype, valid, scores, **code)))
    if not every_flag:
        coded = {(launch.kernel, launch.warps, launch.stages) for launch in found if launch.constexprs.get("BITS") == 8}
        found = {launch: None for launch in found if launch.constexprs.get("BITS") != 16
                 or (launch.kernel, launch.warps, launch.stages) not in coded}
    return [asdict(launch) | dict(dtype=DTYPES[dtype]) for launch in found]


def for_target(cases: list[dict], capability: tuple[int, int]) -> list[dict]:
    """The cases compiled for a device of compute capability ``capability``."""
    return [case | dict(target=capability[0] * 10 + capability[1]) for case in cases]


def widest_launches(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[dict]:
    """The widest launch of every kernel for every head dimension, dtype and architecture, as compile cases."""
    return [case for head_dim in head_dims for dtype in DTYPES for capability in ARCHITECTURES
            for case in for_target(launches(dtype, head_dim), capability)]


def compile_all(cases: list[dict], depth: str = "shared", workers: int | None = None) -> list[dict]:
    """Each case's ``shared`` bytes (``"cubin"``: also ``registers``, ``spill_stores``, ``spill_loads``), or its
    compile ``error``, in the cases' order; the cases are shared among ``workers`` processes (default: the CPUs)."""
    if depth not in ("shared", "cubin"):
        raise ValueError(f"depth must be 'shared' or 'cubin', got {depth!r}")
    workers = max(1, min(workers or len(os.sched_getaffinity(0)), len(cases)))
    share = math.ceil(len(cases) / workers)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_compile.py")
    with tempfile.TemporaryDirectory(prefix="kvcompress-aot-") as folder:
        environment = os.environ | {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": os.path.join(folder, "cache")}
        running = []
        for worker in range(workers):
            paths = [os.path.join(folder, f"{worker}.{name}") for name in ("cases", "results", "log")]
            with open(paths[0], "w") as written:
                json.dump(cases[worker * share:(worker + 1) * share], written)
            with open(paths[2], "w") as log:
                running.append((subprocess.Popen([sys.executable, script, depth, *paths[:2]], env=environment,
                                                 stdout=log, stderr=subprocess.STDOUT), paths))
        results = []
        for process, (_, results_path, log_path) in running:
            if process.wait() != 0:
                with open(log_path) as log:
                    raise RuntimeError(f"the compile process failed:\n{log.read()[-3000:]}")
            with open(results_path) as written:
                results += json.load(written)
    return results
