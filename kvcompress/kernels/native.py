"""The fused CPU attention kernel (``fused_attention.cpp``), compiled for this machine on first use.

Why compiled here rather than shipped: the kernel is built against the installed torch (its headers, its BLAS
and its vector instructions), which a wheel could not match for every torch/CPU pair; torch's extension loader
caches the build (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), so the compiler runs once
per machine and torch version (about a minute). Without a compiler, or with ``KVCOMPRESS_NATIVE=0``, the torch
implementation in ``attention.py`` is used: same results, slower H2O prefills and decode steps.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from kvcompress.models import cpu_has_native_bfloat16

logger = logging.getLogger(__name__)

# one module: the fused attention kernel, and quantized slots' codes; the header both include
SOURCES = (Path(__file__).with_name("fused_attention.cpp"), Path(__file__).with_name("quantized_slots.cpp"))
HEADERS = (Path(__file__).with_name("quantized_slots.h"),)
# Query rows per block and keys per block: a block of logits (rows × keys floats) stays in the core's cache while
# it is exponentiated and multiplied with the values (chosen on SmolLM2 shapes: benchmarks/attention_kernel.py).
ROW_BLOCK = 64
KEY_BLOCK = 512
STALE_LOCK_SECONDS = 15 * 60
# The vector-instruction flags torch's own kernels are built with, by the capability torch detects at run time.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

_lock = threading.Lock()
_kernel: ModuleType | None = None
_tried = False


def enabled() -> bool:
    """Whether the kernel may be used (``KVCOMPRESS_NATIVE=0`` turns it off, e.g. to compare both paths)."""
    return os.environ.get("KVCOMPRESS_NATIVE", "1") != "0"


def kernel() -> ModuleType | None:
    """The compiled kernel module, or None where it cannot be built (warned once)."""
    global _kernel, _tried
    if not enabled():
        return None
    if _tried:  # every call after the first: no lock on the hot path
        return _kernel
    with _lock:
        if not _tried:
            _tried = True
            try:
                _kernel = _build()
            except Exception as error:  # no compiler, no BLAS symbol, an unsupported platform
                warnings.warn(
                    f"kvcompress: the fused CPU attention kernel could not be built ({type(error).__name__}: "
                    f"{str(error).strip().splitlines()[-1] if str(error).strip() else error!r}); using the torch "
                    "implementation (same results, slower H2O prefills and decode steps)",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return _kernel


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """The kernel handles CPU tensors in float32 and bfloat16 (``input_dtype``), float16 through float32 copies
    of one layer's queries, keys and values (the torch implementation it replaces computes in float32 too, chunk
    by chunk, slower and with more memory); anything else takes the torch implementation."""
    # is_cpu rather than device.type: asked in every layer of every decode step, and it builds no device object
    return (queries.is_cpu and keys.is_cpu and values.is_cpu and queries.dtype in _DTYPES and keys.dtype in _DTYPES
            and values.dtype in _DTYPES)


def input_dtype(kernel: ModuleType, dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel takes a layer's queries, keys and values in: bfloat16 as they are where the CPU
    multiplies bfloat16 natively and the BLAS has a bfloat16 GEMM (products 3 × faster than on float32 copies,
    scores as exact: float32 accumulation), float32 copies otherwise (emulated bfloat16 products are slower than
    float32 ones)."""
    return torch.bfloat16 if dtype == torch.bfloat16 and _bfloat16_inputs(kernel) else torch.float32


@functools.cache
def _bfloat16_inputs(kernel: ModuleType) -> bool:
    """Asked once per kernel: the answer is the machine's, and the question comes in every layer's decode step."""
    return kernel.bfloat16_products() and cpu_has_native_bfloat16()


def _build() -> ModuleType:
    from torch.utils.cpp_extension import LIB_EXT, get_default_build_root, load

    capability = torch.backends.cpu.get_cpu_capability()
    # -fopenmp: at::parallel_for is a header template around `#pragma omp parallel`; compiled without it the
    # kernel ran on one thread whatever torch's thread count (it links torch's own libgomp, already loaded)
    flags = ["-O3", "-fopenmp"]
    if capability in _CAPABILITY_FLAGS:
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *_CAPABILITY_FLAGS[capability]]
    name = build_name(SOURCES + HEADERS, capability, flags)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    )
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(directory / "lock")
    if _built(directory / f"{name}{LIB_EXT}"):
        logger.debug("kvcompress: loading the fused CPU attention kernel from %s", directory)
    else:
        logger.info("kvcompress: compiling the fused CPU attention kernel (once per machine, ~1 min) in %s", directory)
    return load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(directory), verbose=False)


def _built(library: Path) -> bool:
    """Whether torch's loader will only load ``library``: it exists (the build folder is named after the source
    text and the flags) and is newer than the installed torch, whose headers ninja would otherwise rebuild it
    against. Decides the message only, so that a run says it waits for a compiler when it does, and only then."""
    try:
        return library.stat().st_mtime >= Path(torch.__file__).stat().st_mtime
    except FileNotFoundError:
        return False


def build_name(sources: tuple[Path, ...], capability: str, flags: list[str]) -> str:
    """One build per set of source files (their places and their texts) and flags: two checkouts or installs
    sharing torch's build cache would otherwise rebuild over each other each time the other one ran (a minute
    inside a run)."""
    texts = [part for source in sources for part in (str(source.resolve()), source.read_text())]
    fingerprint = hashlib.sha1("\0".join([*texts, *flags]).encode()).hexdigest()
    return f"kvcompress_fused_attention_{capability.lower()}_{fingerprint[:10]}"


def _remove_stale_lock(lock: Path) -> None:
    """torch's loader waits forever on the lock file of a build that was killed half-way; a build takes about a
    minute, so a lock older than ``STALE_LOCK_SECONDS`` is such a leftover."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
            logger.warning("kvcompress: removed a stale build lock %s (an interrupted earlier build)", lock)
    except FileNotFoundError:
        pass


def prepare() -> int:
    """Builds (or finds) the kernel ahead of its first use and says whether the fused pass will use it; the exit
    status for scripts/env.sh."""
    built = kernel()
    state = "ready" if built else "unavailable (torch fallback)"
    print(f"kvcompress: fused CPU attention kernel {state}", file=sys.stderr)
    return 0 if built or not enabled() else 1
