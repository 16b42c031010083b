"""What the benchmarks share: model shapes with random weights, the tokenizer KVzip needs for them, peak memory,
busy processes, medians and ratios.

Free of kvcompress imports, so that the peer's scripts (kvpress, in its own virtualenv with an older
transformers) build the same models and measure them the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
DEMO_TEXT = ROOT / "kvcompress" / "data" / "demo_report.txt"
CHAT_TEMPLATE = (  # for the random models' tokenizer: a user turn, then the assistant's
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# random-weight shapes by name: (transformers config class name, config fields)
SHAPES = {
    "tiny-llama": ("LlamaConfig", _TINY),
    "tiny-llama-512": ("LlamaConfig", {**_TINY, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6,
                                       "num_attention_heads": 8, "num_key_value_heads": 8}),
    "tiny-qwen3": ("Qwen3Config", {**_TINY, "head_dim": 16}),
    "llama-7b-shape": ("LlamaConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)),
    "llama3-8b-shape": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
}


# ---------------------------------------------------------------------------------------------------- models
def tiny_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with a chat template, trained here on kvcompress's demo report, with ids below
    ``vocab_size``: what KVzip needs to write its reconstruction request for a random tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 512), special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([DEMO_TEXT.read_text(encoding="utf-8")], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def random_model(name: str, device: str, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """A model of shape ``name`` (``SHAPES``) with random weights (seed 0), built on ``device``: no download."""
    import transformers

    class_name, fields = SHAPES[name]
    config = getattr(transformers, class_name)(**fields, max_position_embeddings=131072, pad_token_id=0,
                                               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                              dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


def build_model(name: str, device: str, dtype: torch.dtype):
    """(model, tokenizer, vocabulary range to draw prompt tokens from, description): the embedded default model
    (``default``, kvcompress's loader) or a random-weight shape of ``SHAPES``."""
    if name == "default":
        from kvcompress.models import load_default_model

        model, tokenizer = load_default_model(dtype=dtype, attn_implementation="sdpa")
        return model.to(device), tokenizer, (100, model.config.vocab_size), "SmolLM2-135M-Instruct (kvcompress.models)"
    model = random_model(name, device, dtype)
    return model, tiny_tokenizer(model.config.vocab_size), (3, model.config.vocab_size), describe_shape(name)


def describe_shape(name: str) -> str:
    fields = SHAPES[name][1]
    return (f"{name}: random weights, {fields['num_hidden_layers']} layers, hidden {fields['hidden_size']}, "
            f"{fields['num_attention_heads']} q / {fields['num_key_value_heads']} kv heads, vocabulary "
            f"{fields['vocab_size']}")


# ---------------------------------------------------------------------------------------------------- memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: nothing to trim
    _LIBC = None


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _reset_high_water_mark() -> bool:
    """Linux >= 4.0: writing 5 to clear_refs resets the process's RSS high-water mark (VmHWM) to its RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _high_water_mark_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def cpu_memory_method() -> str:
    return "hwm" if _reset_high_water_mark() else "sampled"


class PeakMemory:
    """Peak bytes above the level at entry.

    CUDA: the allocator's statistics. CPU: the kernel's RSS high-water mark (VmHWM), reset at entry, so every
    run of one process gets its own exact peak; where that is unavailable, a thread sampling the RSS.
    """

    def __init__(self, device: str, interval_s: float = 0.002):
        self.device, self.interval_s = device, interval_s
        self.peak = 0
        self.base = 0
        self._thread = None

    def __enter__(self) -> "PeakMemory":
        release_memory()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = self.peak = _rss_bytes()
        if not _reset_high_water_mark():
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            return
        if self._thread is None:
            self.peak = _high_water_mark_bytes()
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def fixed_malloc_thresholds(threshold: int = 1 << 20) -> bool:
    """glibc: fix the mmap and trim thresholds, so freed large blocks go back to the system at once.

    By default glibc raises its mmap threshold after each large free (up to 32 MiB) and then keeps freed
    blocks in its heap, so the RSS also counts fragmentation and varies by a few hundred MiB between identical
    runs. With fixed thresholds the RSS follows the live tensors; it makes every large allocation a fresh
    mapping (page faults), which is why only the memory probes use it, never the timed runs.
    """
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(-3, threshold)) and bool(_LIBC.mallopt(-1, threshold))  # M_MMAP_, M_TRIM_THRESHOLD


# ---------------------------------------------------------------------------------------------------- running
def synchronize(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` processes that keep a core busy for as long as the block runs (a shared machine)."""
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        if processes:
            time.sleep(1.0)  # let the scheduler see them
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


def write_results(stem: str | Path, results: dict, table: str) -> Path:
    """``<stem>.json`` (the results) and ``<stem>.md`` (their table), folders created; returns the stem's path."""
    out = Path(stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=float))
    out.with_suffix(".md").write_text(table)
    return out


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def gpu_description() -> dict:
    """The GPU's name and memory, and the CUDA version, where there is one."""
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda}
