#!/usr/bin/env python
"""Which grouping of the quantized keys loses least: per slot (kvcompress's, groups of channels) or per channel
(KIVI's keys, groups of tokens), at 8 and 4 bits, on a real model's cache.

The model prefills a long prompt but its last ``--tail`` tokens; the cache is then quantized and dequantized in
place (values per slot in every case: KIVI's too), and the last tokens run over it. Against the same run over the
unquantized cache: the mean KL divergence of the next-token distributions and the share of positions whose top
token is unchanged. The same affine grid in both groupings (``kvcompress.quantization``: float16 scale, one-byte
zero); the group is ``--group`` channels of a slot, or ``--group`` slots of a channel.

    python benchmarks/quantization_layout.py --out results/quantization_layout
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from importlib.resources import files
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcompress.models import load_model  # noqa: E402
from kvcompress.quantization import dequantize, quantize  # noqa: E402


def per_slot(tensor: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return dequantize(quantize(tensor, bits, group), tensor.dtype)


def per_channel(tensor: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Groups of ``group`` consecutive slots of one channel (the slots past the last whole group as they are, as
    KIVI keeps them in full precision)."""
    whole = tensor.shape[-2] // group * group
    head = tensor[..., :whole, :].transpose(-1, -2)  # (..., d, T): a channel's slots contiguous
    quantized = per_slot(head, bits, group).transpose(-1, -2)
    return torch.cat([quantized, tensor[..., whole:, :]], dim=-2)


LAYOUTS = {"per slot (kvcompress)": (per_slot, per_slot), "per channel keys (KIVI)": (per_channel, per_slot)}


def measure(model, ids: torch.Tensor, tail: int, bits: int, group: int) -> list[dict]:
    prefix, last = ids[:, :-tail], ids[:, -tail:]
    with torch.no_grad():
        cache = model(prefix, use_cache=True).past_key_values
        reference = model(last, past_key_values=copy.deepcopy(cache), use_cache=True).logits.float()
        rows = []
        for name, (keys_by, values_by) in LAYOUTS.items():
            quantized = copy.deepcopy(cache)
            for layer in quantized.layers:
                layer.keys, layer.values = keys_by(layer.keys, bits, group), values_by(layer.values, bits, group)
            logits = model(last, past_key_values=quantized, use_cache=True).logits.float()
            kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1).mean()
            same = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
            rows.append(dict(layout=name, bits=bits, group=group, kl=float(kl), top1_same=float(same)))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tail", type=int, default=128)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "quantization_layout")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model("default", dtype=torch.float32)
    text = files("kvcompress").joinpath("data", "demo_report.txt").read_text(encoding="utf-8")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    rows = [row for bits in (8, 4) for row in measure(model, ids, args.tail, bits, args.group)]
    lines = [f"# Key grouping at 8 and 4 bits (SmolLM2-135M, float32, demo prompt of {ids.shape[1]:,} tokens)", "",
             f"`python benchmarks/quantization_layout.py --tail {args.tail} --group {args.group}`: the last "
             f"{args.tail} tokens over the quantized cache of the others, against the unquantized cache.", "",
             "| layout | bits | KL (nats) | top-1 unchanged |", "|---|---:|---:|---:|"]
    lines += [f"| {row['layout']} | {row['bits']} | {row['kl']:.5f} | {row['top1_same']:.3f} |" for row in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
