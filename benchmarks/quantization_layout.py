#!/usr/bin/env python
"""Which grouping of the quantized keys loses least: per slot (kvcompress's, groups of channels) or per channel
(KIVI's keys, groups of tokens), at 8 and 4 bits, on a real model's cache.

The model prefills a long prompt but its last ``--tail`` tokens; the cache is then quantized and dequantized in
place (values per slot in every case: KIVI's too), and the last tokens run over it. Against the same run over the
unquantized cache: the mean KL divergence of the next-token distributions and the share of positions whose top
token is unchanged. The same grid in every grouping (``kvcompress.quantization``: a float16 scale and minimum per
group).

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


def per_slot(channels: int):
    """Groups of ``channels`` consecutive channels of one slot (kvcompress's layout)."""
    return lambda tensor, bits: dequantize(quantize(tensor, bits, channels), tensor.dtype)


def per_channel(tokens: int):
    """Groups of ``tokens`` consecutive slots of one channel (KIVI's keys); the slots past the last whole group as
    they are, as KIVI keeps them in full precision."""
    def quantized(tensor: torch.Tensor, bits: int) -> torch.Tensor:
        whole = tensor.shape[-2] // tokens * tokens
        head = tensor[..., :whole, :].transpose(-1, -2)  # (..., d, T): a channel's slots contiguous
        grouped = dequantize(quantize(head, bits, tokens), tensor.dtype).transpose(-1, -2)
        return torch.cat([grouped, tensor[..., whole:, :]], dim=-2)
    return quantized


# name -> (keys, values)
LAYOUTS = {
    "keys per slot, 64 channels; values per slot, 64": (per_slot(64), per_slot(64)),
    "keys per channel, 64 tokens (KIVI); values per slot, 64": (per_channel(64), per_slot(64)),
    "keys per slot, 32 channels (default); values per slot, 64": (per_slot(32), per_slot(64)),
    "keys per slot, 16 channels; values per slot, 64": (per_slot(16), per_slot(64)),
    "keys per channel, 32 tokens; values per slot, 64": (per_channel(32), per_slot(64)),
    "keys per slot, 64 channels; values per channel, 64 tokens": (per_slot(64), per_channel(64)),
}


def measure(model, ids: torch.Tensor, tail: int, bits: int) -> list[dict]:
    prefix, last = ids[:, :-tail], ids[:, -tail:]
    with torch.no_grad():
        cache = model(prefix, use_cache=True).past_key_values
        reference = model(last, past_key_values=copy.deepcopy(cache), use_cache=True).logits.float()
        rows = []
        for name, (keys_by, values_by) in LAYOUTS.items():
            quantized = copy.deepcopy(cache)
            for layer in quantized.layers:
                layer.keys, layer.values = keys_by(layer.keys, bits), values_by(layer.values, bits)
            logits = model(last, past_key_values=quantized, use_cache=True).logits.float()
            kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1).mean()
            same = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
            rows.append(dict(layout=name, bits=bits, kl=float(kl), top1_same=float(same)))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tail", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "quantization_layout")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model("default", dtype=torch.float32)
    text = files("kvcompress").joinpath("data", "demo_report.txt").read_text(encoding="utf-8")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    rows = [row for bits in (8, 4) for row in measure(model, ids, args.tail, bits)]
    lines = [f"# Key grouping at 8 and 4 bits (SmolLM2-135M, float32, demo prompt of {ids.shape[1]:,} tokens)", "",
             f"`python benchmarks/quantization_layout.py --tail {args.tail}`: the last "
             f"{args.tail} tokens over the quantized cache of the others, against the unquantized cache.", "",
             "| layout | bits | KL (nats) | top-1 unchanged |", "|---|---:|---:|---:|"]
    lines += [f"| {row['layout']} | {row['bits']} | {row['kl']:.5f} | {row['top1_same']:.3f} |" for row in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
