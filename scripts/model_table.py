"""Markdown table of whole-model results (`dropin inject MODEL --bench --json`, benchmarks/results/<gpu>/inject-*.json):
per model, each provider's median ms (or the reason it did not run) and its speed-up over the original in eager,
for the README and closing notes. Usage: python scripts/model_table.py benchmarks/results/h200/inject-resnet50.json
[...]"""
import json
import sys

PROVIDERS = ("original", "original_graph", "original_compile", "original_compile_ro",
             "dropin", "dropin_graph", "dropin_compile", "dropin_compile_ro")


def _cell(row) -> str:
    if row is None:
        return "-"
    if not row.get("median_ms"):
        return f"{row.get('error') or row.get('note') or 'not run'}"
    spread = row.get("process_median_ms")
    note = f" ({min(spread):.2f}-{max(spread):.2f})" if spread and len(spread) > 1 else ""
    return f"{row['median_ms']:.2f}{note} / {row.get('speedup_vs_original', 0):.2f}x"


def table(paths: list) -> str:
    lines = ["| model | " + " | ".join(PROVIDERS) + " |", "|---|" + "---|" * len(PROVIDERS)]
    for path in paths:
        result = json.load(open(path))
        env, rows = result["env"], result["rows"]
        by_provider = {r["provider"]: r for r in rows}
        first = rows[0]
        model = f"{first['model']} ({first['dtype']}, batch {first['batch']}, {first['mode']}; {env['gpu']})"
        lines.append(f"| {model} | " + " | ".join(_cell(by_provider.get(p)) for p in PROVIDERS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
