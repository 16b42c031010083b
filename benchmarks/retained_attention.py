"""How much of the attention the full model pays to the prompt while answering lands on the tokens a method keeps.

For each prompt: the full-cache model answers greedily; then, with eager attention, the answer tokens are fed
one by one on the full cache and their attention rows over the prompt are recorded (every layer, every head).
Each method compresses the same prompt; its retained share is the attention mass of those rows on the slots it
kept, divided by their mass on the whole prompt, averaged over layers, heads and answer tokens. 1.0 means the
method kept everything the answer looked at. Offline, on the embedded default model.

    python benchmarks/retained_attention.py --budget-fraction 0.2 --out results/retained_attention.md
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.models import load_default_model

WORDS = ("river stone lantern meadow harbor violet copper orchard thunder pebble falcon willow ember quartz "
         "saddle marble canyon juniper beacon glacier").split()


def passkey_prompt(tokenizer, seed: int, filler_sentences: int) -> str:
    """A passkey buried at a random depth in filler text (the classic retrieval probe)."""
    rng = random.Random(seed)
    key = rng.randint(10000, 99999)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "." for _ in range(filler_sentences)]
    sentences.insert(rng.randint(0, filler_sentences), f"The pass key is {key}. Remember it. {key} is the pass key.")
    text = " ".join(sentences) + "\n\nWhat is the pass key? Answer with the number only."
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def methods(budget: int) -> dict[str, KVCacheCompressionParameters]:
    split = dict(start_size=32, recent_size=64, intermediate_size=budget - 96)
    grouped = dict(start_size=32, recent_size=64, intermediate_size=(budget - 96) // 32 * 32, strategy="per_group")
    return {
        "streaming (start+recent)": KVCacheCompressionParameters.from_budget(budget, start_size=32,
                                                                             recent_size=budget - 32),
        "h2o sum": KVCacheCompressionParameters(method="h2o", score_aggregation="sum", **split),
        "h2o norm_sum": KVCacheCompressionParameters(method="h2o", **split),
        "snapkv sum": KVCacheCompressionParameters(score_aggregation="sum", **split),
        "snapkv norm_sum": KVCacheCompressionParameters(**split),
        "snapkv per_group": KVCacheCompressionParameters(**grouped),
        "snapkv + kvcrush": KVCacheCompressionParameters(refined_algorithm="kvcrush", **split),
        "snapkv + criticalkv": KVCacheCompressionParameters(refined_algorithm="criticalkv", **split),
    }


@torch.no_grad()
def answer_attention(model, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[torch.Tensor], str]:
    """Per layer (H, answer tokens, prompt length) attention rows of the full-cache answer, renormalised."""
    answer = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)[0, input_ids.shape[1]:]
    length = input_ids.shape[1]
    out = model(input_ids, use_cache=True)
    cache, rows = out.cache, [[] for _ in range(model.config.num_hidden_layers)]
    for token in answer[:-1]:
        step = model(token.view(1, 1), cache=cache, use_cache=True, output_attentions=True)
        for layer, weights in enumerate(step.attentions):
            prompt_part = weights[0, :, 0, :length].float()
            rows[layer].append(prompt_part / prompt_part.sum(-1, keepdim=True))
    return [torch.stack(r, dim=1) for r in rows], answer


@torch.no_grad()
def kept_positions(model, input_ids: torch.Tensor, params: KVCacheCompressionParameters) -> list[torch.Tensor]:
    with KVCacheCompressor(params)(model) as session:
        model(input_ids, use_cache=True)
        return [session.layers[i].true_positions[0].clone() for i in sorted(session.layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--filler-sentences", type=int, default=140, help="about 14 tokens each")
    parser.add_argument("--budget-fraction", type=float, default=0.2)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/retained_attention.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model(attn_implementation="eager")
    shares: dict[str, list[float]] = {}
    lengths = []
    started = time.perf_counter()
    for seed in range(args.prompts):
        prompt = passkey_prompt(tokenizer, seed, args.filler_sentences)
        input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        lengths.append(input_ids.shape[1])
        rows, answer = answer_attention(model, input_ids, args.new_tokens)
        budget = int(args.budget_fraction * input_ids.shape[1])
        for name, params in methods(budget).items():
            kept = kept_positions(model, input_ids, params)
            share = torch.stack([layer_rows[:, :, positions].sum(-1).mean()
                                 for layer_rows, positions in zip(rows, kept)])
            shares.setdefault(name, []).append(share.mean().item())
        print(f"prompt {seed}: {input_ids.shape[1]} tokens, "
              f"answer {tokenizer.decode(answer, skip_special_tokens=True)!r}"
              f" ({time.perf_counter() - started:.0f} s)", flush=True)
    lines = [
        f"Retained attention share at {args.budget_fraction:.0%} of the prompt (SmolLM2-135M-Instruct, "
        f"{args.prompts} passkey prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"{args.new_tokens - 1} answer queries)",
        "",
        "| method | retained share (mean) | min | max |",
        "|---|---|---|---|",
    ]
    for name, values in shares.items():
        lines.append(f"| {name} | {sum(values) / len(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    lines += ["", f"Command: `python benchmarks/retained_attention.py --prompts {args.prompts} --filler-sentences "
              f"{args.filler_sentences} --budget-fraction {args.budget_fraction} --new-tokens {args.new_tokens}`"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
