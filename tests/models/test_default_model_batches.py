"""Left-padded batches on the real default model generate, per prompt, what that prompt generates alone."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor

models = pytest.importorskip("kvcompress.models")
FILLER = "The weather report mentioned clouds, light wind and a calm evening over the quiet hills. "
FACTS = ["The secret code of the blue door is 4821.", "Anna keeps her bicycle in the red shed.",
         "The meeting was moved to Thursday at noon.", "The capital of the invented land of Varnia is Oskel."]


@pytest.fixture(scope="module")
def default_model():
    try:
        # float32 whatever the CPU: the batch must reproduce the solo runs token for token, and bfloat16's
        # rounding differs between a padded batch's matrix products and a single sequence's.
        model, tokenizer = models.load_default_model(dtype=torch.float32)
    except models.ModelUnavailableError as error:
        pytest.skip(f"default model not installed: {error}")
    tokenizer.padding_side = "left"
    return model, tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    KVCacheCompressionParameters(start_size=16, intermediate_size=48, recent_size=32, decode_slack=4),
    KVCacheCompressionParameters(method="h2o", strategy="per_group", group_size=16, start_size=16,
                                 intermediate_size=48, recent_size=32, rerotate_keys=True),
], ids=["snapkv-per_token", "h2o-per_group-rerotate"])
def test_padded_batch_matches_solo_runs(default_model, params):
    model, tokenizer = default_model
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": FILLER * (3 + 4 * i) + fact + " " + FILLER * (2 + i)
              + "\nWhat was stated in the one sentence that is not about weather? Answer briefly."}],
            tokenize=False, add_generation_prompt=True)
        for i, fact in enumerate(FACTS)
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert batch.attention_mask.sum(-1).max() > params.max_cache_size  # every setting really evicts
    generation = dict(max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with KVCacheCompressor(params)(model), torch.no_grad():
        batched = model.generate(**batch, **generation)[:, batch.input_ids.shape[1]:]
        for row, prompt in enumerate(prompts):
            alone = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
            solo = model.generate(**alone, **generation)[0, alone.input_ids.shape[1]:]
            assert torch.equal(batched[row, : solo.shape[0]], solo), tokenizer.decode(batched[row])
