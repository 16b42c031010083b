"""Where KVzip ranks a RULER needle: per compressed layer and query head, the rank of each needle token among the
context's slots by the most attention its reconstruction queries give it (KVzip's score takes the maximum over the
query heads of a KV group), beside the group's maximum and mean, and the maximum of each head's attention times
the norm of what the slot adds to that head's output, ‖W_O v‖ (KVzip+'s weighting, from the KVzap paper), and that
norm alone.

A method keeps a needle token in a layer only if its rank there is below the layer's budget; this shows which layer
and head lose it, and whether one head's broad attention (a copy head) decides a whole group's ranking. The
record's context is prefilled and reconstructed once with a budget above its length (nothing evicted), through a
registered subclass of the KVzip scorer that also keeps each query head's maxima.

    python benchmarks/kvzip_needle_ranks.py configs/ruler/gemma3-270m-4k.yaml --task niah_single_2_4096 \
        --records 0 --out results/ruler_gemma3_270m_4k/kvzip_needle_ranks.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import kvcompress
from kvbench.experiment import load_experiment
from kvbench.modeling import load_model
from kvbench.sharding import Shard
from kvcompress.scoring.kvzip import KVzip


class KVzipPerHead(KVzip):
    """KVzip, keeping per layer the most attention each query head's reconstruction queries give each context slot."""

    name = "kvzip-per-head"
    maxima: dict[int, torch.Tensor] = {}  # layer -> (H, T) over the cached context
    contributions: dict[int, torch.Tensor] = {}  # layer -> (H, T): ||W_O^h v|| of each context slot, per query head

    def attend(self, call, state):
        if call.replay:
            queries, keys = call.queries[0].float(), call.keys[0].float()  # (H, q, d), (H_kv, T, d)
            group = queries.shape[0] // keys.shape[0]
            length, total = queries.shape[1], keys.shape[1]
            logits = queries @ keys.repeat_interleave(group, 0).transpose(-1, -2) * call.scaling
            if call.softcap:
                logits = call.softcap * torch.tanh(logits / call.softcap)
            causal = torch.arange(total)[None, :] <= (total - length + torch.arange(length))[:, None]
            weights = logits.masked_fill(~causal, float("-inf")).softmax(-1)[..., : total - length].amax(1)
            layer = call.module.layer_idx
            seen = self.maxima.get(layer)
            self.maxima[layer] = weights if seen is None else torch.maximum(seen, weights[:, : seen.shape[1]])
            if layer not in self.contributions:
                values = call.values[0].float()[:, : total - length].repeat_interleave(group, 0)  # (H, T, d)
                output = call.module.o_proj.weight.float()  # (D, H * d)
                per_head = output.view(output.shape[0], queries.shape[0], -1).permute(1, 2, 0)  # (H, d, D)
                self.contributions[layer] = (values @ per_head).norm(dim=-1)
        return super().attend(call, state)


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each slot's rank by score, 0 the highest."""
    order = scores.argsort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    return rank


def needle_positions(tokenizer, context_ids: list[int], needle: str) -> list[int]:
    """The context positions of the tokens that spell the needle (its first occurrence)."""
    for start in range(len(context_ids)):
        text = tokenizer.decode(context_ids[start:start + 16])
        if text.strip().startswith(needle[:2]) and needle in text:
            return [p for p in range(start, start + 16)
                    if (piece := tokenizer.decode([context_ids[p]]).strip()) and piece in needle]
    raise ValueError(f"needle {needle!r} not found in the context")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a RULER runner config (its model, records and chat template)")
    parser.add_argument("--task", required=True, help="a task of the config, with its length (niah_single_2_4096)")
    parser.add_argument("--records", type=int, nargs="+", default=[0], help="record ids")
    parser.add_argument("--out", type=Path, required=True, help="markdown file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kvcompress.register(KVzipPerHead)
    experiment = load_experiment(args.config)
    model, tokenizer = load_model(experiment.model, Shard())
    records = {r["_id"]: r for r in experiment.benchmark.load_records(experiment.options, args.task,
                                                                       experiment.output_dir)}
    lines = [f"# KVzip's needle ranks: {experiment.model.path}, {args.task}", "",
             f"`python benchmarks/kvzip_needle_ranks.py {args.config} --task {args.task} --records "
             f"{' '.join(map(str, args.records))} --out {args.out}` ({time.strftime('%Y-%m-%d')})", "",
             "Rank (0 = highest) of each needle token among the context's slots, by the most attention a query "
             "head's reconstruction queries give it; KVzip's score is the group's maximum.", ""]
    for record_id in args.records:
        record = records[str(record_id)]
        prompt = experiment.benchmark.prompt(experiment.options, args.task, record, tokenizer,
                                             experiment.model.chat_template)
        length = prompt.prefill_length
        context = torch.tensor([prompt.input_ids[:length]])
        needle = needle_positions(tokenizer, prompt.input_ids[:length], str(record["outputs"][0]))
        KVzipPerHead.maxima, KVzipPerHead.contributions = {}, {}
        with kvcompress.compress(model, method=KVzipPerHead.name, budget=length + 1, tokenizer=tokenizer):
            model(context, use_cache=True)
        lines += [f"## record {record_id}: needle {record['outputs'][0]!r} at positions {needle} of {length}", "",
                  "| layer | scores | needle tokens' ranks | median score |", "|---|---|---|---|"]
        kv_heads = model.config.num_key_value_heads
        for layer, maxima in sorted(KVzipPerHead.maxima.items()):
            for kv, group in enumerate(maxima.chunk(kv_heads)):  # a KV head's query heads
                rows = [(f"query head {kv * len(group) + head}", group[head]) for head in range(len(group))]
                norms = KVzipPerHead.contributions[layer].chunk(kv_heads)[kv]
                rows += [(f"KV head {kv}: group maximum (KVzip)", group.amax(0)),
                         (f"KV head {kv}: group mean", group.mean(0)),
                         (f"KV head {kv}: group maximum of attention x ‖W_O v‖ (KVzip+)", (group * norms).amax(0)),
                         (f"KV head {kv}: ‖W_O v‖ alone (group maximum)", norms.amax(0))]
                for label, scores in rows:
                    rank = ranks(scores)
                    lines.append(f"| {layer} | {label} | {', '.join(str(int(rank[p])) for p in needle)} "
                                 f"| {float(scores.median()):.4f} |")
        lines.append("")
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
