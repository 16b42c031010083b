"""KVzap: scores against an independent reference, eviction by them, weight files refused when they do not fit, and
the training's pieces against float64 definitions.

The reference score of a token is its surrogate applied to the layer's input hidden states computed outside any
session: the decoder's residual stream (``output_hidden_states``) through the layer's own ``input_layernorm``.
"""

import dataclasses

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress import surrogate as surrogates
from kvcompress.train_scorer import _fit_mlp, _RidgeSums, fit_report, spearman, train_surrogate
from tiny_models import (
    TinyTokenizer,
    kvzap_reference_scores,
    random_kvzap_weights,
    random_tokens,
    scorer_parameters,
    tiny_model,
)

PROMPT, DECODE_STEPS = 60, 4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prompt_and_decoded_tokens_are_scored_by_their_own_hidden_states(arch):
    """Nothing is evicted (budget above the length): every slot's score is its token's reference score, for the
    prompt's tokens (one forward) and for each decoded token (scored once, when it arrives)."""
    model = tiny_model(arch)
    params = scorer_parameters("kvzap", arch, start_size=4, intermediate_size=200, recent_size=8)
    ids = random_tokens(PROMPT)
    with KVCacheCompressor(params)(model):
        out = model.generate(ids, max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS, do_sample=False,
                             return_dict_in_generate=True)
    reference = kvzap_reference_scores(model, out.sequences[:, :-1], arch)  # the last token never entered the cache
    for index in reference:
        state = out.past_key_values.layers[index]
        assert state.tracked_slots == PROMPT + DECODE_STEPS - 1
        # kept on KVzip's scale: the predicted score, not its log
        torch.testing.assert_close(state.head_scores[0].double(), reference[index].exp(), rtol=1e-5, atol=1e-7)


def test_eviction_keeps_each_heads_highest_predicted_scores():
    """With per-head selection and a uniform budget, each KV head's scored area holds its top reference scores."""
    model = tiny_model("llama")
    params = scorer_parameters("kvzap", start_size=4, intermediate_size=16, recent_size=8, head_selection="per_head")
    ids = random_tokens(PROMPT)
    reference = kvzap_reference_scores(model, ids)
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        model(ids, use_cache=True)
    assert len(session.layers) == model.config.num_hidden_layers  # the layers stay readable after the block
    for index, state in session.layers.items():
        for head in range(reference[index].shape[0]):
            kept = set(state.true_positions[0, head].tolist())
            windows = set(range(4)) | set(range(PROMPT - 8, PROMPT))
            chosen, left = sorted(kept - windows), sorted(set(range(4, PROMPT - 8)) - kept)
            assert windows <= kept and len(chosen) == 16
            # a repeated token scores exactly alike (KVzap reads the token's hidden state): ties go either way
            assert reference[index][head, chosen].min() >= reference[index][head, left].max() - 1e-6


def test_weight_files_that_do_not_fit_are_refused(tmp_path):
    model = tiny_model("llama")
    path = random_kvzap_weights("llama")
    with pytest.raises(surrogates.SurrogateMismatchError, match="trained for 'tiny-llama'"):
        surrogates.for_model(tiny_model("llama", seed=1), str(path))  # the same architecture, other weights
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(4 * [0x41])
    damaged.write_bytes(bytes(data))
    with pytest.raises(surrogates.SurrogateMismatchError, match="checksum"):
        surrogates.load(damaged)
    with pytest.raises(ValueError, match=r"scorer_options\['weights'\] must be a surrogate file or one of the shipped"):
        surrogates.for_model(model, "no-such-model")
    with pytest.raises(ValueError, match="no shipped weights for this LlamaForCausalLM"):
        with KVCacheCompressor(KVCacheCompressionParameters(method="kvzap"))(model):
            pass
    assert surrogates.for_model(model, str(path)).fingerprint == surrogates.model_fingerprint(model)


def test_fingerprint_is_the_same_in_float32_and_bfloat16_and_follows_weights_written_in_place():
    model = tiny_model("llama")
    first = surrogates.model_fingerprint(model)
    assert first == surrogates.model_fingerprint(tiny_model("llama", dtype=torch.bfloat16))
    with torch.no_grad():  # another checkpoint loaded into the same module objects
        model.load_state_dict(tiny_model("llama", seed=1).state_dict())
    assert surrogates.model_fingerprint(model) == surrogates.model_fingerprint(tiny_model("llama", seed=1)) != first


def test_ridge_solution_matches_float64_least_squares_and_spearman_its_definition():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(500, 6, generator=generator, dtype=torch.float64) * torch.tensor([1, 10, 0.1, 1, 5, 2.0])
    targets = features @ torch.randn(6, 2, generator=generator, dtype=torch.float64) + 3.0
    targets += 0.01 * torch.randn(500, 2, generator=generator, dtype=torch.float64)
    sums = _RidgeSums(6, 2)
    for rows in (slice(0, 200), slice(200, 500)):  # accumulated in pieces, as context by context
        sums.add(features[rows], targets[rows])
    weight, bias = sums.solve(1e-9)  # a near-exact fit: stretched to the targets' spread by about 1
    design = torch.cat([features, torch.ones(500, 1, dtype=torch.float64)], 1)
    solution = torch.linalg.lstsq(design, targets).solution
    torch.testing.assert_close(weight.double(), solution[:6].t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bias.double(), solution[6], rtol=1e-4, atol=1e-4)
    x = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    assert spearman(x, x).item() == pytest.approx(1.0)
    assert spearman(x, -x).item() == pytest.approx(-1.0)
    # ranks 1..5 against 2,1,4,3,5: 1 - 6·Σd²/(n(n²-1)) = 1 - 6·4/120
    assert spearman(x, torch.tensor([[2.0], [1.0], [4.0], [3.0], [5.0]])).item() == pytest.approx(0.8)


def test_predictions_are_stretched_to_the_targets_spread_keeping_their_ranks():
    """Least squares shrinks predictions toward the mean by the share of the variance it explains; stretched back,
    a head fitted less well keeps the range its KVzip scores have when heads compete for one budget."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3000, 5, generator=generator, dtype=torch.float64)
    noise = torch.randn(3000, 2, generator=generator, dtype=torch.float64) * torch.tensor([0.1, 2.0]).double()
    targets = features @ torch.randn(5, 2, generator=generator, dtype=torch.float64) + noise
    design = torch.cat([features, torch.ones(3000, 1, dtype=torch.float64)], 1)
    plain = design @ torch.linalg.lstsq(design, targets).solution
    assert plain[:, 1].std() < 0.9 * targets[:, 1].std()  # the noisy head's plain fit is narrower than its targets
    sums = _RidgeSums(5, 2)
    sums.add(features, targets)
    weight, bias = sums.solve(1e-9)
    ridge = features @ weight.double().t() + bias.double()
    torch.testing.assert_close(ridge.std(0), targets.std(0), rtol=1e-5, atol=0)
    torch.testing.assert_close(ridge.mean(0), targets.mean(0), rtol=0, atol=1e-5)
    mlp = _fit_mlp(features.float().bfloat16(), targets.float(), 8, seed=0)
    inner = torch.nn.functional.gelu(features.float().bfloat16().float() @ mlp[0].t() + mlp[1])
    torch.testing.assert_close((inner @ mlp[2].t() + mlp[3]).double().std(0), targets.std(0), rtol=1e-3, atol=0)
    for predicted in (ridge, plain):
        assert spearman(predicted, plain).min().item() == pytest.approx(1.0)


def test_training_on_a_tiny_model_gives_weights_that_load_for_it(tmp_path):
    """The whole training path (KVzip's recorded scores, ridge, held-out fit) on the tiny model's corpus contexts;
    the weights load for that model and a session runs with them."""
    model = tiny_model("llama")
    trained = train_surrogate(model, TinyTokenizer(), "tiny-llama", context_tokens=96, max_contexts=4,
                              held_out=0.25, log=lambda line: None)
    assert trained.fit["training_contexts"] == 3 and trained.fit["held_out_contexts"] == 1
    assert set(trained.fit["spearman"]) == {"0", "1"} and all(-1 <= v <= 1 for v in trained.fit["spearman"].values())
    assert "| mean |" in fit_report(trained) and "stretched to the spread" in fit_report(trained)
    earlier = dataclasses.replace(trained, fit={key: value for key, value in trained.fit.items()
                                                if key != "spread_matched"})  # a file trained before the stretch
    assert "stretched" not in fit_report(earlier)
    path = trained.save(tmp_path / "tiny.safetensors")
    params = KVCacheCompressionParameters(method="kvzap", start_size=4, intermediate_size=16, recent_size=8,
                                          scorer_options={"weights": str(path)})
    with KVCacheCompressor(params)(model), torch.no_grad():
        cache = model(random_tokens(PROMPT), use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[-2] == 28
    mlp = train_surrogate(model, TinyTokenizer(), "tiny-llama", context_tokens=96, max_contexts=4, held_out=0.25,
                          hidden_size=8, log=lambda line: None)
    assert mlp.kind == "mlp" and mlp.fit["hidden_size"] == 8 and "MLP 8 wide" in fit_report(mlp)
    assert all(-1 <= v <= 1 for v in mlp.fit["spearman"].values())


def test_mlp_surrogate_scores_by_their_definition_and_survive_a_round_trip(tmp_path):
    model = tiny_model("llama")
    surrogate = surrogates.random_surrogate(model, name="tiny-llama", hidden_size=16)
    hidden = torch.randn(2, 7, model.config.hidden_size)
    for layer in surrogate.weights:
        inner = torch.nn.functional.gelu(hidden.double() @ surrogate.hidden_weights[layer].double().t()
                                         + surrogate.hidden_biases[layer].double())
        expected = (inner @ surrogate.weights[layer].double().t() + surrogate.biases[layer].double()).transpose(1, 2)
        torch.testing.assert_close(surrogate.scores(layer, hidden).double(), expected, rtol=1e-5, atol=1e-5)
    loaded = surrogates.load(surrogate.save(tmp_path / "tiny-llama-mlp.safetensors"))
    assert loaded.kind == "mlp" and surrogates.load(random_kvzap_weights("llama")).kind == "linear"
    for layer in surrogate.weights:
        torch.testing.assert_close(loaded.scores(layer, hidden), surrogate.scores(layer, hidden), rtol=0, atol=0)


def test_the_default_weights_are_the_file_named_after_the_model_and_variants_go_by_name(tmp_path, monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(surrogates, "SHIPPED", tmp_path)
    surrogates.random_surrogate(model, name="tiny-llama").save(tmp_path / "tiny-llama.safetensors")
    surrogates.random_surrogate(model, name="tiny-llama", hidden_size=8).save(tmp_path / "tiny-llama-mlp.safetensors")
    assert surrogates.for_model(model).kind == "linear"  # "-mlp" sorts first, and is not the default
    assert surrogates.for_model(model, "tiny-llama-mlp").kind == "mlp"


def test_mlp_fit_learns_what_a_linear_map_cannot():
    """A target that is the absolute value of one feature: no linear map ranks it; the MLP does."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(4096, 6, generator=generator)
    targets = torch.stack([features[:, 0].abs(), features[:, 1]], 1)
    first_weight, first_bias, second_weight, second_bias = _fit_mlp(features.bfloat16(), targets, 32, seed=0)
    held_out = torch.randn(1000, 6, generator=generator)
    expected = torch.stack([held_out[:, 0].abs(), held_out[:, 1]], 1)
    predicted = torch.nn.functional.gelu(held_out @ first_weight.t() + first_bias) @ second_weight.t() + second_bias
    assert spearman(predicted, expected).min().item() > 0.9
    sums = _RidgeSums(6, 2)
    sums.add(features, targets)
    weight, bias = sums.solve(1e-3)
    assert spearman(held_out @ weight.t() + bias, expected)[0].item() < 0.2
