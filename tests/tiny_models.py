"""Tiny random-initialised models of every supported architecture, built offline from configs (test helpers)."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import tempfile
from pathlib import Path

import torch
import transformers

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.scoring.kvzip import KVzip
from kvcompress.scoring.registry import scorer_class
from kvcompress.surrogate import load as load_surrogate
from kvcompress.surrogate import random_surrogate

torch.set_num_threads(1)


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op thread count (which the fused kernel's workers follow) set for the block, then restored:
    the suite runs at one thread (above), and a test that needs more hands them back however it ends."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

def both_cores():
    """``torch_threads`` for the suite's longest real-model tests: the machine's cores, two at most (CI's)."""
    return torch_threads(max(torch.get_num_threads(), min(2, os.cpu_count() or 1)))


_COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=None),
    "mistral_sliding": lambda: transformers.MistralConfig(**_COMMON, sliding_window=16),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**{**_COMMON, "num_hidden_layers": 2}, partial_rotary_factor=0.5),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=16, sliding_window=16, query_pre_attn_scalar=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=16, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}


def tiny_model(arch: str = "llama", attn_implementation: str = "sdpa", seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    if arch == "gemma2":  # soft-capped logits: transformers offers no sdpa path for Gemma 2
        attn_implementation = "eager"
    config = TINY_CONFIGS[arch]()
    config._attn_implementation = attn_implementation
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype).eval()


def random_tokens(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, _COMMON["vocab_size"], (batch, length), generator=generator)


class TinyTokenizer:
    """Characters to ids of the tiny vocabulary, no chat template: enough for methods that build prompts (KVzip)."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(character) % (_COMMON["vocab_size"] - 3) for character in text]


def scorer_parameters(method: str, arch: str = "llama", **sizes) -> KVCacheCompressionParameters:
    """Parameters for ``method`` with a window only where the method observes one; KVzap's weights are random
    ones made for ``tiny_model(arch)`` (the suite checks the mechanics; the shipped weights' quality is measured
    on the real models)."""

    window = 8 if scorer_class(method).uses_window else None
    if method == "kvzap":
        sizes["scorer_options"] = {"weights": str(random_kvzap_weights(arch)), **sizes.get("scorer_options", {})}
    return KVCacheCompressionParameters(method=method, window_size=window, **sizes)


@functools.lru_cache(maxsize=None)
def random_kvzap_weights(arch: str = "llama") -> Path:
    """A KVzap surrogate file with random weights for ``tiny_model(arch)``, written once per test process."""
    surrogate = random_surrogate(tiny_model(arch), seed=7, name=f"tiny-{arch}")
    return surrogate.save(Path(tempfile.mkdtemp(prefix="kvzap-")) / f"tiny-{arch}.safetensors")


def kvzap_reference_scores(model, ids, arch="llama"):
    """Per compressed layer, the random surrogate's log-scores (H_kv, T) of every token of ``ids``, computed without
    a session: the decoder's residual stream (``output_hidden_states``) through the layer's own ``input_layernorm``."""
    surrogate = load_surrogate(random_kvzap_weights(arch))
    with torch.no_grad():
        residual = model(ids, output_hidden_states=True).hidden_states
        layers = model.model.layers
        return {index: (layers[index].input_layernorm(residual[index])[0].double()
                        @ surrogate.weights[index].double().t() + surrogate.biases[index].double()).t()
                for index in surrogate.weights}


def kvzip_reference_scores(model, ids, params: KVCacheCompressionParameters) -> torch.Tensor:
    """KVzip's scores by definition, (layers, H_kv, T): the most attention each slot of ``ids`` receives from any
    query of any head of its group in the reconstruction passes, read from ``output_attentions`` of each pass run by
    hand (``model`` eager) on a copy of the prompt's full cache (zero in sliding-window layers)."""
    length = ids.shape[-1]
    with torch.no_grad():
        full = model(ids, use_cache=True).past_key_values
        scorer = KVzip(params)
        scorer.bind(model, TinyTokenizer())
        groups = model.config.num_attention_heads // model.config.num_key_value_heads
        expected = torch.zeros(model.config.num_hidden_layers, model.config.num_key_value_heads, length)
        for (row,) in scorer.replay_inputs([ids[0].tolist()]):
            replay = model(torch.tensor([row]), cache=copy.deepcopy(full), use_cache=True, output_attentions=True)
            for layer, weights in enumerate(replay.attentions):  # (1, H, n, T + n)
                if weights.shape[-1] != length + len(row):  # a sliding-window layer (never compressed): no scores
                    continue
                per_kv = weights[0, :, :, :length].unflatten(0, (-1, groups)).amax(dim=(1, 2))
                expected[layer] = torch.maximum(expected[layer], per_kv)
    return expected


BATCH_LENGTHS = (90, 61, 120, 37)  # the last one fits in the budget at first: it must evict on its own schedule
BATCH_NEW_TOKENS = 24


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, n) prompts as one left-padded batch: ids and 2-D attention mask."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1]:] = prompt[0]
        mask[row, width - prompt.shape[1]:] = 1
    return ids, mask


def generate_batch(model, params: KVCacheCompressionParameters, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``BATCH_NEW_TOKENS`` greedy tokens per sequence under a session with ``params``."""
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model):
        return model.generate(ids, attention_mask=mask, max_new_tokens=BATCH_NEW_TOKENS,
                              min_new_tokens=BATCH_NEW_TOKENS, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
