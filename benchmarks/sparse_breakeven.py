"""Break-even sparsity per shape from a `dropin bench sparse` result file: for each shape (dtype, tokens or
conv batch, sizes), dropin's speed-up over torch's dense product at each sparsity (event-timed / GPU-only),
the lowest sparsity from which dropin is at least as fast (GPU-only where measured), and the weight bytes.
    python benchmarks/sparse_breakeven.py benchmarks/results/h200/sparse.json"""
import json
import re
import sys

CASE = re.compile(r"^(?P<shape>.+) (?P<sparsity>[\d.]+)% \(w (?P<bytes>[\d.]+)x dense\)$")


def breakeven(path: str) -> str:
    result = json.load(open(path))
    shapes: dict = {}
    for row in result["rows"]:
        match = CASE.match(row["case"])
        if match and row["provider"] in ("dropin", "torch"):
            point = shapes.setdefault(match["shape"], {}).setdefault(float(match["sparsity"]), {})
            point[row["provider"]], point["bytes"] = row, match["bytes"]
    lines = [f"sparse ({result['env']['gpu']}, {result['env']['date']}): dropin vs torch's dense product, "
             "speed-up event-timed / GPU-only; break-even: the lowest sparsity from which dropin is at least as "
             "fast (GPU-only where measured)", "",
             "| shape | speed-up by sparsity (weight bytes vs dense) | break-even |", "|---|---|---|"]
    for shape, points in shapes.items():
        cells, even = [], None
        for sparsity in sorted(points):
            ours, torch = points[sparsity].get("dropin"), points[sparsity].get("torch")
            if not (ours and torch and ours["median_ms"] and torch["median_ms"]):
                cells.append(f"{sparsity:g}%: -")
                continue
            ratio = torch["median_ms"] / ours["median_ms"]
            graph = ours.get("graph_ms") and torch.get("graph_ms") and torch["graph_ms"] / ours["graph_ms"]
            cells.append(f"{sparsity:g}%: {ratio:.2f}x" + (f" / {graph:.2f}x" if graph else "")
                         + f" ({points[sparsity]['bytes']}x)" + ("" if ours["correct"] else " FAILED"))
            if even is None and (graph or ratio) >= 1:
                even = sparsity
        lines.append(f"| {shape} | {'; '.join(cells)} | {'-' if even is None else f'{even:g}%'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(breakeven(p) for p in sys.argv[1:]))
