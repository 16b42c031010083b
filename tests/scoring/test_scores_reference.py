"""Hook scores against an independent reference: the attention weights eager attention returns.

The reference below re-derives the scores from ``output_attentions`` exactly as the algorithms are specified:
H2O sums every query row, SnapKV the last ``window`` rows of a multi-token step (a pool of kernel 7 per query head,
centred or over each slot and the 6 before it: the maximum, or the mean of the kernel's window with zeros past the
ends), every decode step adds its row; query heads sum into their KV head; norm_sum divides by the number of
observing queries.
"""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from tiny_models import random_tokens, tiny_model

PROMPT, WINDOW, DECODE_STEPS = 40, 8, 3


def _reference(attentions_per_step, method, kv_heads, pooling="max", direction="centred"):
    """Accumulated per-KV-head scores and counts of layer 0 from eager weights, one entry per forward."""
    scores = counts = None
    for weights in attentions_per_step:  # (1, H_q, q, T)
        weights = weights[0].double()
        heads, queries, total = weights.shape
        observed = list(range(queries)) if method == "h2o" else list(range(max(0, queries - WINDOW), queries))
        step = weights[:, observed].sum(1)  # (H_q, T)
        if method == "snapkv" and queries > 1:
            before, after = (6, 0) if direction == "forward" else (3, 3)
            padded = torch.nn.functional.pad(step, (before, after), value=float("-inf") if pooling == "max" else 0.0)
            windows = [padded[:, j : j + 7] for j in range(total)]
            step = torch.stack([w.max(-1).values if pooling == "max" else w.sum(-1) / 7 for w in windows], -1)
        step = step.view(kv_heads, heads // kv_heads, total).sum(1)
        step_counts = torch.zeros(total, dtype=torch.float64)
        for q in observed:
            step_counts[: total - queries + q + 1] += 1
        if scores is None:
            scores, counts = step, step_counts
        else:
            old = scores.shape[-1]
            scores = torch.cat([scores + step[:, :old], step[:, old:]], -1)
            counts = torch.cat([counts + step_counts[:old], step_counts[old:]])
    return scores, counts


def _run(model, ids, output_attentions):
    """Prefill PROMPT tokens, then DECODE_STEPS single-token steps; the per-forward attentions if asked."""
    attentions = []
    out = model(ids[:, :PROMPT], use_cache=True, output_attentions=output_attentions)
    attentions.append(out.attentions)
    for step in range(DECODE_STEPS):
        out = model(ids[:, PROMPT + step : PROMPT + step + 1], cache=out.past_key_values, use_cache=True,
                    output_attentions=output_attentions)
        attentions.append(out.attentions)
    return attentions


@pytest.mark.parametrize("output_attentions", [False, True], ids=["fused", "weights-requested"])
@pytest.mark.parametrize("method, pooling, direction", [("h2o", None, None), ("snapkv", "max", "centred"),
                                                        ("snapkv", "avg", "centred"), ("snapkv", "max", "forward"),
                                                        ("snapkv", "avg", "forward")])
@pytest.mark.parametrize("aggregation", ["sum", "norm_sum"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hook_scores_equal_eager_attention_weights(method, pooling, direction, aggregation, arch, output_attentions):
    """Nothing is evicted (budget > length), so an uncompressed eager run's weights are the reference.

    Without ``output_attentions`` H2O and decode steps take the fused path (attention output and scores in
    one pass); with it the model's own attention runs and the scores are computed beside it.
    """
    model = tiny_model(arch, attn_implementation="eager")
    params = KVCacheCompressionParameters(
        method=method, start_size=4, intermediate_size=500, recent_size=4, score_aggregation=aggregation,
        window_size=WINDOW if method == "snapkv" else None,
        scorer_options={"pooling": pooling, "pool_direction": direction} if pooling else {},
    )
    ids = random_tokens(PROMPT + DECODE_STEPS)
    with torch.no_grad():
        attentions = _run(model, ids, output_attentions=True)
        with KVCacheCompressor(params)(model) as session:
            compressed = _run(model, ids, output_attentions=output_attentions)
            states = dict(session.layers)
        if output_attentions:
            for expected, got in zip(attentions, compressed):
                for layer_expected, layer_got in zip(expected, got):
                    torch.testing.assert_close(layer_got, layer_expected, rtol=0, atol=0)
    for layer in range(model.config.num_hidden_layers):
        expected_scores, expected_counts = _reference([a[layer] for a in attentions], method,
                                                      model.config.num_key_value_heads, pooling, direction)
        state = states[layer]
        torch.testing.assert_close(state.head_scores[0].double(), expected_scores, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(state.counts[0].double(), expected_counts, rtol=0, atol=0)
        expected = expected_scores / expected_counts.clamp(min=1) if aggregation == "norm_sum" else expected_scores
        ranked = params.scorer(params).eviction_scores(state, None, None, None)
        torch.testing.assert_close(ranked[0].double(), expected, rtol=1e-4, atol=1e-6)
