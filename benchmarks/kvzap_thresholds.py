#!/usr/bin/env python
"""Which ``score_threshold`` keeps what share of KVzap's scored area, read off records that are not evaluated.

A threshold is in KVzap's units (a predicted KVzip score, the most attention a slot would receive), so how much it
keeps depends on the model and the text. This runs the model once over each record's context as the RULER runner
renders it (context first: the chat template's header and the context), with KVzap scoring every slot and a budget
above the context (nothing evicted), and reports, for each share asked for, the threshold whose best-head scores
leave that share of the scored area (the slots between the start and recent windows, over every compressed layer
and record). Calibrate on records of another generator seed than the evaluated ones:

    kvcompress-ruler generate --tokenizer default --tasks niah_single_1,niah_single_2 --lengths 4096 --samples 3 \
        --seed 7 --out /tmp/calibration
    python benchmarks/kvzap_thresholds.py /tmp/calibration/*/validation.jsonl --records 3 \
        --out results/kvzap/thresholds_smollm2_4k
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcompress import compress  # noqa: E402
from kvcompress.models import load_model  # noqa: E402
from ruler.chat import encode_prompt  # noqa: E402
from ruler.prompts import split_input  # noqa: E402


@torch.no_grad()
def best_head_scores(model, tokenizer, path: Path, records: int) -> torch.Tensor:
    """Every scored slot's best-head KVzap score over the compressed layers of the first ``records`` records."""
    task = path.parent.name.rsplit("_", 1)[0]
    scores = []
    for line in path.read_text(encoding="utf-8").splitlines()[:records]:
        prompt = encode_prompt(tokenizer, split_input(task, json.loads(line)["input"]), "context_first")
        context = torch.tensor([prompt.input_ids[: prompt.prefill_length]])
        with compress(model, method="kvzap", budget=10 * context.shape[1], tokenizer=tokenizer) as session:
            model(context, use_cache=True)
            start, recent = session.parameters.start_size, session.parameters.recent_size  # never thresholded
            scores += [state.head_scores[0].amax(0)[start:-recent] for state in session.layers.values()]
    return torch.cat(scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records_files", nargs="+", type=Path, help="RULER validation.jsonl files")
    parser.add_argument("--records", type=int, default=3, help="per file")
    parser.add_argument("--keep", type=float, nargs="+", default=[0.3, 0.2, 0.1, 0.05],
                        help="shares of the scored area to find thresholds for")
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="writes OUT.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    by_file = {path: best_head_scores(model, tokenizer, path, args.records) for path in args.records_files}
    everything = torch.cat(list(by_file.values()))
    table = ["| share kept | threshold | log | " + " | ".join(p.parent.name for p in by_file) + " |",
             "|---|---|---|" + "---|" * len(by_file)]
    for share in args.keep:
        threshold = float(everything.quantile(1 - share))
        kept = [f"{float((scores >= threshold).double().mean()):.3f}" for scores in by_file.values()]
        table.append(f"| {share:g} | {threshold:.3g} | {math.log(threshold):.2f} | " + " | ".join(kept) + " |")
    text = (f"# KVzap thresholds for {args.model} (float32)\n\nCommand: `python benchmarks/kvzap_thresholds.py "
            f"{shlex.join(sys.argv[1:] if argv is None else argv)}`\n\nThe threshold whose best-head scores keep "
            "each share of the scored area (between the preset's windows, over every compressed layer) of the "
            f"first {args.records} records of each file together, and the share it keeps in each file alone.\n\n"
            + "\n".join(table) + "\n")
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
