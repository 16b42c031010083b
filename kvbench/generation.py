"""One sample's greedy generation under a compression setting, with the cache's real key/value bytes.

Both protocols of the KV-compression literature run through here. When the prompt's ``prefill_length`` covers
all of it (LongBench, RULER ``query_aware``), the whole prompt goes to ``model.generate`` inside the compressor,
so the question is seen when the prompt is compressed. When it covers the context only (RULER ``context_first``,
kvpress's leaderboard protocol), ``session.prefill`` compresses the context first and ``session.generate`` reads
the question and answers on the compressed context (a setting with a ``context_store`` loads the context, compressed
once into the store, afresh for every question). The full cache runs the whole prompt through plain
``generate`` either way: with nothing evicted the two protocols compute the same thing. A setting with a
``prefill_chunk_size`` prefills in chunks through ``session.prefill``: the context (``context_first``), or the
whole prompt but its last token, which then opens the answer (``query_aware``).

The KV bytes are measured, not derived from the budget: ``kv_bytes`` is what the cache's key and value tensors
hold once the prompt is compressed (for ``query_aware`` at the end of generation, decoded tokens included, unless
it was prefilled in chunks), and ``full_kv_bytes`` what the uncompressed cache holds for the same tokens (each
compressed layer's bytes per slot times the tokens it has seen; layers kvcompress does not compress, such as
sliding windows, count as they are).

The full cache is measured over the same tokens as the compressed settings, so that its bytes and theirs can be
divided: under ``context_first`` over the context (what the compressed settings hold once it is compressed, before
the question and the answer are fed), otherwise over every token it saw. Its cache holds more than the context at
the end of generation, and nothing is evicted, so the context's share is taken from it layer by layer
(``kvcompress.cache.full_cache_bytes``): a layer's bytes per token times the context's tokens, or what a sliding
window would have held then. (Predictions made before this measured the full cache over the whole prompt and answer
under ``context_first`` too; the report notices the difference per sample.) Under ``query_aware`` the settings' own
answers differ in length, so the bytes of two settings cover different tokens; each setting's ``full_kv_bytes`` is
the reference for its ``kv_bytes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from .benchmark import Prompt
from .modeling import input_device
from .settings import CompressionSetting

__all__ = ["Generated", "cache_bytes", "generate"]

GREEDY = {"num_beams": 1, "do_sample": False, "temperature": 1.0}


@dataclasses.dataclass(frozen=True)
class Generated:
    new_ids: list[int]
    kv_bytes: int
    full_kv_bytes: int


def cache_bytes(cache: Any, tokens: int) -> tuple[int, int]:
    """(bytes held, bytes the full cache would hold for ``tokens`` tokens) of a batch-of-one cache."""
    from kvcompress.cache import full_cache_bytes, kv_cache_bytes

    return kv_cache_bytes(cache), full_cache_bytes(cache, tokens)


@torch.no_grad()
def generate(model: Any, tokenizer: Any, setting: CompressionSetting, prompt: Prompt) -> Generated:
    """Greedy new tokens for ``prompt`` (batch size 1) under ``setting``, and the cache's bytes."""
    ids = torch.tensor([prompt.input_ids], device=input_device(model))
    options = {**GREEDY, **prompt.generation}
    chunked = setting.prefill_chunk_size is not None and not setting.is_full_cache
    if setting.is_full_cache or not (prompt.context_first or chunked):
        compression = contextlib.nullcontext() if setting.is_full_cache else setting.compression(model, tokenizer)
        with compression:
            output = model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **options)
        new_ids = output.sequences[0, ids.shape[1]:].tolist()
        # the last token is returned, never fed: the cache holds the prompt and all new tokens but one
        seen = ids.shape[1] + len(new_ids) - 1
        if setting.is_full_cache:  # what it held once the tokens the settings are measured over were fed
            _, full_kv_bytes = cache_bytes(output.cache, prompt.prefill_length if prompt.context_first else seen)
            return Generated(new_ids, full_kv_bytes, full_kv_bytes)
        kv_bytes, full_kv_bytes = cache_bytes(output.cache, seen)
        return Generated(new_ids, kv_bytes, full_kv_bytes)
    unsupported = sorted(set(options) - set(GREEDY) - {"max_new_tokens", "eos_token_id"})
    if unsupported:
        raise ValueError(f"the context-first protocol does not take the generation option(s) {unsupported}")
    prefill_length = prompt.prefill_length if prompt.context_first else ids.shape[1] - 1
    context, question = ids[:, :prefill_length], ids[:, prefill_length:]
    if setting.context_store is not None and not prompt.context_first:
        raise ValueError(f"setting {setting.name!r}: context_store serves the context-first protocol, where the "
                         "context is compressed before the question")
    stored = setting.context_store is not None
    session = setting.stored_context(model, tokenizer, context) if stored else setting.compression(model, tokenizer)
    with session:
        cache = session.context[0] if stored else session.prefill(context, chunk_size=setting.prefill_chunk_size)
        kv_bytes, full_kv_bytes = cache_bytes(cache, prefill_length)
        answer = session.generate(question, max_new_tokens=options["max_new_tokens"],
                                  eos_token_id=options.get("eos_token_id"))
    eos = options.get("eos_token_id", model.generation_config.eos_token_id)
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    new_ids = answer[0].tolist()
    for position, token in enumerate(new_ids):  # finished sequences are padded with their end token
        if token in eos:
            new_ids = new_ids[: position + 1]
            break
    return Generated(new_ids, kv_bytes, full_kv_bytes)
