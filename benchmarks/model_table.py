"""Markdown tables of whole-model results (`dropin inject MODEL --bench --json`, benchmarks/results/<gpu>/inject-*.json),
for the README and closing notes: per model, each provider's median ms (or the reason it did not run) and its
speed-up over the original in eager; for a `--generate` file, decoding tokens/s per batch and provider.
Usage: python benchmarks/model_table.py benchmarks/results/h200/inject-resnet50.json [...]"""
import json
import sys

PROVIDERS = ("original", "original_graph", "original_compile", "original_compile_ro",
             "dropin", "dropin_graph", "dropin_compile", "dropin_compile_ro")


def _cell(row, notes: list) -> str:
    if row is None:
        return "-"
    if not row.get("median_ms"):
        reason = row.get("error") or row.get("note") or "not run"
        if reason not in notes:
            notes.append(reason)
        return f"n/a ({notes.index(reason) + 1})"
    spread = row.get("process_median_ms")
    note = f" ({min(spread):.2f}-{max(spread):.2f})" if spread and len(spread) > 1 else ""
    return f"{row['median_ms']:.2f}{note} / {row.get('speedup_vs_original', 0):.2f}x"


def table(paths: list) -> str:
    """One row per result file: median ms (the processes' range where several ran) / speed-up over the original
    in eager; the reasons of the modes that did not run numbered below."""
    lines = ["| model | " + " | ".join(PROVIDERS) + " |", "|---|" + "---|" * len(PROVIDERS)]
    notes: list = []
    decoding = []
    for path in paths:
        result = json.load(open(path))
        env, rows = result["env"], result["rows"]
        if "decode_tokens_per_s" in rows[0]:
            decoding.append(_decode_table(env, rows))
            continue
        by_provider = {r["provider"]: r for r in rows}
        first = rows[0]
        model = f"{first['model']} ({first['dtype']}, batch {first['batch']}, {first['mode']}; {env['gpu']})"
        lines.append(f"| {model} | " + " | ".join(_cell(by_provider.get(p), notes) for p in PROVIDERS) + " |")
    lines += [""] + [f"({i}) {reason}" for i, reason in enumerate(notes, 1)]
    return "\n\n".join(["\n".join(lines), *decoding])


def _decode_table(env: dict, rows: list) -> str:
    """Decoding tokens/s (the steps after the prefill) per batch and provider, with the speed-up over the original
    in eager at that batch."""
    first = rows[0]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    lines = [f"{first['model']} generate(): {first['prompt']}-token prompt, {first['new_tokens']} new tokens; "
             f"decode tokens/s / speed-up ({env['gpu']})", "",
             "| batch | " + " | ".join(providers) + " |", "|---|" + "---|" * len(providers)]
    for batch in dict.fromkeys(r["batch"] for r in rows):
        cells = {r["provider"]: f"{r['decode_tokens_per_s']:.0f} / {r['speedup_vs_original']:.2f}x"
                 if r.get("decode_tokens_per_s") else r.get("error") or r.get("note") or "n/a"
                 for r in rows if r["batch"] == batch}
        lines.append(f"| {batch} | " + " | ".join(cells.get(p, "-") for p in providers) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
