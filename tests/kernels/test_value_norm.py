"""projected_value_l1 against a slow per-query-head loop with F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kvcompress.kernels.value_norm import projected_value_l1


def slow_reference(values: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Per query head h: u = F.linear(v[kv(h)], W_o[:, h·d:(h+1)·d]), ‖u‖₁; mean per GQA group, then per KV head.

    Computed in float64 so the comparison measures the selector's float32 error only.
    """
    batch, kv_heads, tokens, head_dim = values.shape
    per_kv = []
    for kv in range(kv_heads):
        per_query = []
        for g in range(groups):
            h = kv * groups + g
            u = F.linear(values[:, kv].double(), weight[:, h * head_dim : (h + 1) * head_dim].double())
            per_query.append(u.abs().sum(dim=-1))  # (B, T)
        per_kv.append(torch.stack(per_query).mean(dim=0))
    return torch.stack(per_kv).mean(dim=0).float()


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("chunk_elements", [1 << 24, 50])
def test_matches_slow_loop(groups: int, chunk_elements: int) -> None:
    torch.manual_seed(groups)
    batch, kv_heads, tokens, head_dim, hidden = 2, 2, 7, 4, 10
    values = torch.randn(batch, kv_heads, tokens, head_dim)
    weight = torch.randn(hidden, kv_heads * groups * head_dim)
    got = projected_value_l1(values, weight, groups, chunk_elements=chunk_elements)
    assert got.shape == (batch, tokens) and got.dtype == torch.float32
    torch.testing.assert_close(got, slow_reference(values, weight, groups), atol=1e-5, rtol=1e-5)


def test_head_slices_are_not_interchangeable() -> None:
    """Zeroing one query head's slice of W_o changes only that head's term: checks the kv-major head layout."""
    torch.manual_seed(0)
    values = torch.randn(1, 2, 3, 4)
    weight = torch.randn(6, 2 * 3 * 4)
    weight[:, 4:8] = 0.0  # query head 1 = KV head 0, group member 1
    expected = slow_reference(values, weight, 3)
    torch.testing.assert_close(projected_value_l1(values, weight, 3), expected, atol=1e-5, rtol=1e-5)
    swapped = weight.clone()
    swapped[:, 4:8], swapped[:, 12:16] = weight[:, 12:16], weight[:, 4:8]
    assert not torch.allclose(projected_value_l1(values, swapped, 3), expected, atol=1e-3)


def test_low_precision_input_is_computed_in_float32() -> None:
    torch.manual_seed(1)
    values = torch.randn(1, 2, 5, 8).bfloat16()
    weight = torch.randn(16, 2 * 8).bfloat16()
    got = projected_value_l1(values, weight, 1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, slow_reference(values.float(), weight.float(), 1), atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_weight() -> None:
    with pytest.raises(ValueError, match="o_proj_weight"):
        projected_value_l1(torch.randn(1, 2, 3, 4), torch.randn(5, 12), 2)
