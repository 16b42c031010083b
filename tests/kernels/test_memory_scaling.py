"""A compressed prefill allocates no length × length buffer.

H2O scores (and computes the attention output of) every query inside the session's attention function. Doing that
for every query at once would allocate B · H · L² float32 logits, which is exactly what makes other libraries' H2O
unusable at long contexts. The scorer works in query chunks whose size is bounded linearly in the forward's length;
this test checks the consequence on the whole prefill: the largest single allocation ``torch.profiler`` records
grows linearly (×4 at most, plus slack) when the prompt grows ×4, where a quadratic buffer would grow ×16. The last
test removes the chunk bound and checks that the same measurement then flags the prefill, so the check can fail.
"""

import contextlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.kernels import attention
from tiny_models import TinyTokenizer, random_tokens, tiny_model

SHORT, LONG = 512, 2048  # the prompt grows ×4: linear buffers grow ≤ ×4, a length² buffer ×16
LINEAR_GROWTH_LIMIT = 6.0
BUDGET = dict(start_size=8, intermediate_size=48, recent_size=8)


def _params(method: str, strategy: str) -> KVCacheCompressionParameters:
    if strategy == "per_group":
        return KVCacheCompressionParameters(
            method=method, strategy="per_group", group_size=8, **BUDGET
        )
    return KVCacheCompressionParameters(method=method, **BUDGET)


def largest_allocation(model, params, length: int, padded: bool = False) -> int:
    """Bytes of the largest single tensor allocation of one prefill of ``length`` tokens (uncompressed: no params)."""
    ids = random_tokens(length, batch=2 if padded else 1)
    kwargs = {}
    if padded:  # the second sequence is left-padded by a quarter of the prompt
        mask = torch.ones_like(ids)
        mask[1, : length // 4] = 0
        kwargs["attention_mask"] = mask
    session = KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) if params else contextlib.nullcontext()
    with torch.no_grad(), session:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(ids, use_cache=True, logits_to_keep=1, **kwargs)
    # An operator's self memory is what it allocated and did not free itself: its output tensors (and, for
    # aten::empty and friends, the buffers composite operators build their results in).
    return max(event.self_cpu_memory_usage for event in prof.events())


@pytest.fixture(params=["native", "torch"])
def backend(request, monkeypatch):
    """H2O's fused pass on CPU: the compiled kernel (its buffers are torch allocations, so the profiler sees
    them) or the torch chunks."""
    if request.param == "torch":
        monkeypatch.setenv("KVCOMPRESS_NATIVE", "0")
    return request.param


@pytest.mark.parametrize("strategy", ["per_token", "per_group"])
@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_largest_prefill_allocation_grows_linearly(backend, method, strategy):
    model = tiny_model("llama")
    params = _params(method, strategy)
    short = largest_allocation(model, params, SHORT)
    long = largest_allocation(model, params, LONG)
    assert long / short <= LINEAR_GROWTH_LIMIT, (
        f"{method}/{strategy}: the largest allocation grew from {short} to {long} bytes (×{long / short:.1f}) "
        f"when the prompt grew ×{LONG // SHORT}: something scales with length²"
    )
    assert long < LONG * LONG * 4, f"an allocation of {long} bytes is as large as one float32 {LONG}² matrix"


def test_kvzip_reconstruction_allocates_like_the_prefill():
    """KVzip's reconstruction passes (a chunk of 256 replayed over the whole prompt, all layers held until they
    share one budget): no allocation grows with length², and none exceeds the uncompressed prefill's largest
    by more than the attention chunks of one pass."""
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(method="kvzip", budget_allocation="global",
                                          scorer_options={"chunk_size": 256}, **BUDGET)
    short = largest_allocation(model, params, SHORT)
    long = largest_allocation(model, params, LONG)
    assert long / short <= LINEAR_GROWTH_LIMIT, f"KVzip: the largest allocation grew ×{long / short:.1f}"
    uncompressed = largest_allocation(model, None, LONG)
    assert long <= 2 * uncompressed, f"KVzip: {long} bytes at once; the uncompressed prefill's largest: {uncompressed}"


def test_padded_batch_prefill_allocates_nothing_larger_than_the_model_does(backend):
    """With padding transformers itself builds a (B, 1, L, L) mask; scoring must stay far below it."""
    model = tiny_model("llama")
    compressed = largest_allocation(model, _params("h2o", "per_token"), LONG, padded=True)
    uncompressed = largest_allocation(model, None, LONG, padded=True)
    assert compressed <= uncompressed, (
        f"padded H2O prefill: a {compressed}-byte allocation, the uncompressed prefill's largest is {uncompressed}"
    )


def test_the_measurement_flags_an_unbounded_chunk(monkeypatch):
    """Without the chunk bound H2O scores every query at once: the test above must then fail."""
    monkeypatch.setenv("KVCOMPRESS_NATIVE", "0")  # the torch chunks (the kernel's blocks are fixed sizes)
    monkeypatch.setattr(attention, "chunk_elements", lambda batch, length, hidden: 1 << 40)
    monkeypatch.setattr(attention, "ROW_BLOCK", 1 << 30)
    model = tiny_model("llama")
    params = _params("h2o", "per_token")
    short = largest_allocation(model, params, SHORT)
    long = largest_allocation(model, params, LONG)
    assert long / short > 10, f"an unbounded chunk grew only ×{long / short:.1f}: the measurement is blind"
