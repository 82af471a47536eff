"""A suite re-measured against its committed figures: per case, dropin's median over the new runs (the median of
each run's median) against the committed median, flagged where they differ by more than the tolerance (3%), with
the peers' same ratio beside it: a peer that moved as much points at the machine, not at dropin's code. GPU-only
times (CUDA-graph replays) are compared too where both sides have them: event times of small cases carry the host's
launch cost, which varies from one machine to the next.
    python benchmarks/remeasure.py BEFORE.json RUN.json [RUN.json ...] [--tolerance 0.03]
where the runs are `dropin bench SUITE --no-save --json RUN.json` (the same cases as BEFORE, or a part of them)."""
import argparse
import json
import statistics


def medians(paths: list[str]) -> dict:
    """{(case, provider): {"event": median over runs, "graph": median over runs or None}} of the rows with times."""
    times: dict = {}
    for path in paths:
        for row in json.load(open(path))["rows"]:
            if row.get("median_ms"):
                entry = times.setdefault((row["case"], row["provider"]), {"event": [], "graph": []})
                entry["event"].append(row["median_ms"])
                if row.get("graph_ms"):
                    entry["graph"].append(row["graph_ms"])
    return {key: {kind: statistics.median(values) if values else None for kind, values in entry.items()}
            for key, entry in times.items()}


def compare(before_path: str, run_paths: list[str], tolerance: float) -> tuple[str, int]:
    """A Markdown table of the cases the runs hold, and how many of dropin's medians moved beyond the tolerance
    (event and GPU-only both: a case whose GPU-only time holds is not counted where its event time moved)."""
    before, after = medians([before_path]), medians(run_paths)
    env = json.load(open(before_path))["env"]
    lines = [f"{env['suite']}: {len(run_paths)} runs against the figures of {env['date'][:16]} ({env['gpu']}); "
             f"after / before of each median, event [GPU-only]; '!' beyond {tolerance:.0%}",
             "", "| case | dropin | peers |", "|---|---|---|"]
    moved = 0

    def ratio(key, kind):
        old, new = before.get(key, {}).get(kind), after[key][kind]
        return new / old if old and new else None

    def cell(key):
        event, graph = ratio(key, "event"), ratio(key, "graph")
        text = f"{event:.3f}" if event else "-"
        return text + (f" [{graph:.3f}]" if graph else "")

    for case in dict.fromkeys(case for case, _ in after):
        ours = (case, "dropin")
        if ours not in after:
            continue
        event, graph = ratio(ours, "event"), ratio(ours, "graph")
        off = event is not None and abs(event - 1) > tolerance and (graph is None or abs(graph - 1) > tolerance)
        moved += off
        peers = "; ".join(f"{provider} {cell((case, provider))}" for c, provider in after
                          if c == case and provider != "dropin")
        lines.append(f"| {case} | {cell(ours)}{' !' if off else ''} | {peers} |")
    lines.append(f"\n{moved} of dropin's medians moved beyond {tolerance:.0%}")
    return "\n".join(lines), moved


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args()
    print(compare(args.before, args.runs, args.tolerance)[0])
