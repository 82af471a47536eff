"""Markdown table of dropin's standing per case from result files (benchmarks/results/<gpu>/<suite>.json):
median ms of each provider (event-timed, and GPU-only from CUDA-graph replays where measured) and dropin's
ratio against each, for closing notes and docs/perf-notes.md.
    python benchmarks/standings.py benchmarks/results/h200/attention.json [...]"""
import json
import sys


def standings(path: str) -> str:
    result = json.load(open(path))
    cases: dict = {}
    for row in result["rows"]:
        cases.setdefault(row["case"], {})[row["provider"]] = row
    lines = [f"{result['env']['suite']} ({result['env']['gpu']}, {result['env']['date']}): "
             "provider median ms [GPU-only ms], dropin's speed-up (event / GPU-only)",
             "", "| case | dropin | peers |", "|---|---|---|"]
    for case, rows in cases.items():
        ours = rows.get("dropin")
        if not ours or not ours["median_ms"]:
            lines.append(f"| {case} | {ours and ours.get('error', 'no time')} | |")
            continue

        def cell(r):
            graph = f" [{r['graph_ms']:.3f}]" if r.get("graph_ms") else ""
            return f"{r['median_ms']:.3f}{graph}"
        peers = []
        for name, r in rows.items():
            if name == "dropin" or not r["median_ms"]:
                continue
            ratio = f"{r['median_ms'] / ours['median_ms']:.2f}x"
            if r.get("graph_ms") and ours.get("graph_ms"):
                ratio += f" / {r['graph_ms'] / ours['graph_ms']:.2f}x"
            peers.append(f"{name} {cell(r)}: {ratio}")
        verdict = "" if ours["correct"] else " FAILED"
        lines.append(f"| {case}{verdict} | {cell(ours)} | {'; '.join(peers)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(standings(p) for p in sys.argv[1:]))
