"""The context manager leaves no trace: no hooks, the model's own attention implementation, identical logits,
after a normal exit or an exception."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from tiny_models import random_tokens, tiny_model

PARAMS = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8)


def _hook_count(model):
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(getattr(m, "_forward_hooks_with_kwargs", {}))
        for m in model.modules()
    )


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


class Boom(Exception):
    pass


def _raise_in_generation(model, ids, exception):
    class Processor:
        calls = 0

        def __call__(self, input_ids, scores):
            Processor.calls += 1
            if Processor.calls == 3:
                raise exception
            return scores

    model.generate(ids, max_new_tokens=10, do_sample=False, logits_processor=[Processor()])


@pytest.mark.parametrize("exit_kind", ["normal", "exception", "keyboard_interrupt"])
def test_exit_restores_model(exit_kind):
    model = tiny_model("llama")
    ids = random_tokens(60)
    before_hooks, before_logits = _hook_count(model), _logits(model, ids)
    compressor = KVCacheCompressor(PARAMS)
    if exit_kind == "normal":
        with compressor(model):
            assert _hook_count(model) > before_hooks
            assert model.config._attn_implementation == "kvcompress_sdpa"
            model.generate(ids, max_new_tokens=5, do_sample=False)
    else:
        exception = Boom() if exit_kind == "exception" else KeyboardInterrupt()
        with pytest.raises(type(exception)):
            with compressor(model):
                _raise_in_generation(model, ids, exception)
    assert _hook_count(model) == before_hooks
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_logits(model, ids), before_logits)
    with compressor(model):  # re-entering works after any exit
        model.generate(ids, max_new_tokens=2, do_sample=False)


def test_nested_use_is_refused():
    model = tiny_model("llama")
    with KVCacheCompressor(PARAMS)(model):
        with pytest.raises(RuntimeError, match="already attached"):
            with KVCacheCompressor(PARAMS)(model):
                pass
    assert _hook_count(model) == 0
    assert model.config._attn_implementation == "sdpa"


def test_other_models_keep_their_attention_while_a_session_runs():
    """The wrapper is registered globally; a model without a session must get its own function unchanged."""
    compressed, bystander = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = random_tokens(40)
    expected = _logits(bystander, ids)
    with KVCacheCompressor(PARAMS)(compressed):
        bystander.config._attn_implementation = "kvcompress_sdpa"  # even if it names the wrapper
        torch.testing.assert_close(_logits(bystander, ids), expected, rtol=0, atol=0)
    bystander.config._attn_implementation = "sdpa"


def test_unsupported_architecture_lists_supported_ones():
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="supported architectures: llama, mistral"):
        with KVCacheCompressor(PARAMS)(model):
            pass
    assert _hook_count(model) == 0
