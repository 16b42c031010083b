#!/usr/bin/env python
"""The GPU table of the README from a folder of GPU results (``benchmarks/gpu/run.sh``'s output, committed as
``results/gpu/``): kvcompress's ``speed_*.json`` beside kvpress's ``peer_kvpress_*.json``, the
throughput and the correctness check. Writes ``summary.md`` in that folder and prints it.

    python benchmarks/gpu/report.py results/gpu
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# our method -> kvpress's press of the same algorithm
PEERS = {"snapkv": "SnapKVPress", "h2o": "ObservedAttentionPress", "kvzip": "KVzipPress",
         "kvzip-layers": "KVzipPress", "expected_attention": "ExpectedAttentionPress", "tova": "TOVAPress",
         "keydiff": "KeyDiffPress", "knorm": "KnormPress", "streaming": "StreamingLLMPress"}


def _f(value, pattern="{:.2f}") -> str:
    return "—" if value is None else pattern.format(value)


def speed_table(ours: dict, peer: dict | None) -> list[str]:
    env = ours["environment"]
    peers = {}
    if peer is not None:
        for block in peer["runs"]:
            peers[block["length"]] = block["presses"]
    lines = [f"{env.get('gpu', env['device'])}, {env['model']}, {env['dtype']}, {env['budget']} kept; × = against "
             "the same library's uncompressed sdpa run in the same process (decode: ms per token of the compressed "
             "cache over the full cache's).", "",
             "| length | method | prefill × | peak × | KV × | decode × | kvpress prefill × | peak × | KV × (effective) "
             "| decode × |", "|---|---|---|---|---|---|---|---|---|---|"]
    for setting in ours["settings"]:
        length = setting["length"]
        for row in setting["methods"]:
            press = peers.get(length, {}).get(PEERS.get(row["method"], ""), {})
            lines.append(
                f"| {length} | {row['method']} | {_f(row['prefill_x'])} | {_f(row['peak_x'])} "
                f"| {_f(row['kv_x'], '{:.3f}')} "
                f"| {_f(row['decode_x'])} | {_f(press.get('prefill_x'))} | {_f(press.get('peak_x'))} "
                f"| {_f(press.get('kv_x'), '{:.3f}')} ({_f(press.get('kv_effective_x'), '{:.3f}')}) "
                f"| {_f(press.get('decode_x'))} |")
    return lines


def throughput_table(data: dict) -> list[str]:
    env = data["environment"]
    lines = [f"Throughput at {env['length']} tokens in {env['memory_gib']:g} GiB ({env.get('gpu', env['device'])}):",
             "", "| method | sequences | × full | tokens / s | × full |", "|---|---|---|---|---|"]
    for row in data["methods"]:
        lines.append(f"| {row['method']} | {row.get('batch', '—')} | {_f(row.get('batch_x'))} "
                     f"| {_f(row.get('tokens_per_s'), '{:.0f}')} | {_f(row.get('tokens_per_s_x'))} |")
    return lines


def main(argv=None) -> int:
    folder = Path((argv or sys.argv[1:] or ["results/gpu"])[0])
    lines = ["# GPU results", ""]
    check = folder / "check.json"
    if check.is_file():
        data = json.loads(check.read_text())
        failed = [row for row in data["rows"] if row.get("passed") is False]
        lines += [f"Correctness on {data.get('gpu')}: {data['passed']} checks passed, {data['failed']} failed"
                  + "".join(f"; failed: {row.get('case', row.get('method'))} {row.get('error', '')[:120]}"
                            for row in failed), ""]
    for path in sorted(folder.glob("speed_*.json")):
        ours = json.loads(path.read_text())
        peer_path = folder / path.name.replace("speed_", "peer_kvpress_")
        peer = json.loads(peer_path.read_text()) if peer_path.is_file() else None
        lines += [f"## {path.stem}", "", *speed_table(ours, peer), ""]
        if ours.get("errors"):
            lines += ["Errors: " + "; ".join(f"{e['length']} {e['method']}: {e['error'][:160]}"
                                             for e in ours["errors"]), ""]
    for path in sorted(folder.glob("throughput_*.json")):
        lines += [f"## {path.stem}", "", *throughput_table(json.loads(path.read_text())), ""]
    text = "\n".join(lines)
    (folder / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
