"""KVCrush representative selection by binary head-behaviour signatures.

Units the coarse top-k left out are not all alike: some are favoured by one set of heads, some by another.
KVCrush keeps a few *representatives* spread over those behaviours instead of simply the next-best scores:
each candidate gets an H-bit signature (bit h = head h ranks it in the top half of the row's candidates,
step 1), the signatures are ordered by Hamming distance to an anchor (step 2–3), and the representatives
are taken at evenly spaced positions of that order, one per bucket (step 4; GenAI's ``kvcrush.cpp``).

Exact rules (all deterministic, per row, independent of the other rows of the batch):

* **Signature bit**: with ``n`` candidates, bit h of a unit is 1 iff its head-h score is *strictly greater*
  than the head-h score ranked ``floor(n/2)`` (0-based, descending) among the candidates. With distinct scores
  that is exactly the top ``floor(n/2)`` (an odd middle unit gets 0, as in GenAI/contrib "top ⌊N/2⌋ → 1"); a tie
  across the boundary gives all tied units 0, so equal scores always get equal bits whatever their position.
* **Anchor** (H bits, shared by the whole row): ``zeros``; ``ones``; ``alternate`` = ``h % 2`` (0, 1, 0, 1 …);
  ``random`` = ``torch.randint(0, 2, (H,))`` from a CPU ``torch.Generator`` seeded with ``seed`` (the same for
  every row, layer and call, and the same on every device); ``mean`` = per head the *fraction* of the row's
  candidates with bit 1 (the mean signature). A majority bit would be useless here: the half split gives every
  head at most ``floor(n/2)`` ones, so a majority anchor would always equal ``zeros``.
* **Order**: ascending L1 distance between signature and anchor (the Hamming distance for the binary
  anchors), ties by ascending unit index.
* **Spacing**: with ``n`` sorted candidates and ``k`` to select, positions ``floor(i·n/k)`` for
  ``i = 0 … k−1``: the first unit of each of ``k`` equal buckets. Since ``n/k ≥ 1`` the positions are distinct.
"""

from __future__ import annotations

import torch

from kvcompress.selection.adaptive import check_num_select, descending_order

from ..parameters import KVCRUSH_ANCHORS


def head_signatures(head_scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``(B, H, U)`` bool signature bits (see the module docstring); False outside the candidates."""
    batch, heads, units = head_scores.shape
    mask = candidates[:, None, :].expand(batch, heads, units)
    ranked = head_scores.gather(-1, descending_order(head_scores, mask))
    middle = (candidates.sum(dim=-1) // 2).clamp(max=units - 1)
    threshold = ranked.gather(-1, middle[:, None, None].expand(batch, heads, 1))
    return mask & (head_scores > threshold)


def kvcrush_anchor_bits(
    anchor: str, signatures: torch.Tensor, candidates: torch.Tensor, seed: int = 0
) -> torch.Tensor:
    """``(B, H)`` float anchor for each row, entries in [0, 1] (see the module docstring)."""
    batch, heads, _ = signatures.shape
    device = signatures.device
    if anchor == "zeros":
        bits = torch.zeros(heads, dtype=torch.bool, device=device)
    elif anchor == "ones":
        bits = torch.ones(heads, dtype=torch.bool, device=device)
    elif anchor == "alternate":
        bits = torch.arange(heads, device=device) % 2 == 1
    elif anchor == "random":
        generator = torch.Generator(device="cpu").manual_seed(seed)
        bits = torch.randint(0, 2, (heads,), generator=generator).bool().to(device)
    elif anchor == "mean":
        return signatures.sum(dim=-1) / candidates.sum(dim=-1, keepdim=True).clamp(min=1)
    else:
        raise ValueError(f"kvcrush_anchor must be one of {', '.join(map(repr, KVCRUSH_ANCHORS))}, got {anchor!r}")
    return bits.float().expand(batch, heads)


def kvcrush_select(
    head_scores: torch.Tensor,
    candidates: torch.Tensor,
    num_select: torch.Tensor,
    anchor: str,
    seed: int = 0,
) -> torch.Tensor:
    """Pick ``num_select[b]`` representative candidates per row by KVCrush.

    Args:
        head_scores: ``(B, H, U)`` per-KV-head accumulated score of each unit (token or page).
        candidates: ``(B, U)`` bool, the units this step may choose from.
        num_select: ``(B,)`` int64, at most the number of candidates of the row (may be 0).
        anchor: one of ``KVCRUSH_ANCHORS``.
        seed: seed of the ``random`` anchor.

    Returns:
        ``(B, U)`` bool, exactly ``num_select[b]`` True per row, all among the candidates.
    """
    check_num_select(num_select, candidates)
    batch, heads, units = head_scores.shape
    signatures = head_signatures(head_scores, candidates)
    anchor_bits = kvcrush_anchor_bits(anchor, signatures, candidates, seed)
    if anchor == "mean":  # n·|s − mean| = |n·s − Σs| in integers: equal distances tie exactly, not up to rounding
        counts = signatures.sum(dim=-1, keepdim=True)
        distance = (signatures.long() * candidates.sum(dim=-1)[:, None, None] - counts).abs().sum(dim=1).float()
    else:
        distance = (signatures.float() - anchor_bits[:, :, None]).abs().sum(dim=1)
    # Non-candidates get a distance above every candidate's so the stable ascending sort puts them last.
    order = torch.sort(torch.where(candidates, distance, float("inf")), dim=-1, stable=True).indices
    slot = torch.arange(units, device=head_scores.device).expand(batch, units)
    wanted = slot < num_select[:, None]
    position = torch.where(wanted, slot * candidates.sum(dim=-1, keepdim=True) // num_select.clamp(min=1)[:, None], 0)
    chosen = order.gather(-1, position)
    picked = torch.zeros(batch, units, dtype=torch.int32, device=head_scores.device)
    return picked.scatter_add_(-1, chosen, wanted.int()) > 0
