"""Shape classes: named groups of a suite's cases, and each class's summary against the bars of issue 25.

A suite made of classes lists `ShapeClass`es; `suite_cases` builds their cases (full sizes on the GPU, scaled-down
ones under the interpreter or --quick), each case's rows then name its class (`class`). `summarize` gives per
class dropin's geomean speed-up over torch (cuBLAS / cuDNN), its worst case and the cases that miss a bar:
speed (dropin >= 0.9x torch), memory (dropin's peak <= torch's + 256 MiB), correctness. It also marks each dropin
row with the bars it meets (`bars`: True / False, None where not measured, e.g. memory under the interpreter).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from dropin import _runtime

if TYPE_CHECKING:
    from .harness import Case

SPEED_BAR = 0.9          # dropin's median speed-up over torch, per case
MEMORY_SLACK_MIB = 256   # dropin's peak may exceed torch's by this much


@dataclass
class ShapeClass:
    """One class: every shape in each of `dtypes`, the first shape also in each of `first_dtypes`.

    build(shape, dtype) -> Case; shapes: the full sizes (GPU); quick: scaled-down ones with the class's character
    (the interpreter, --quick)."""
    name: str
    about: str
    build: Callable[[tuple, str], "Case"]
    shapes: list[tuple]
    quick: list[tuple]
    dtypes: tuple[str, ...] = ("bf16", "fp16")
    first_dtypes: tuple[str, ...] = ("fp32", "tf32")

    def cases(self, quick: bool) -> list[Case]:
        """The class's cases; under the interpreter without bf16 (its tl.dot reads bfloat16 as uint16 there)."""
        cases = []
        for i, shape in enumerate(self.quick if quick else self.shapes):
            for dtype in self.dtypes + (self.first_dtypes if i == 0 else ()):
                if _runtime.INTERPRET and dtype == "bf16":
                    continue
                case = self.build(shape, dtype)
                case.group = self.name
                cases.append(case)
        return cases


def suite_cases(classes: list[ShapeClass], quick: bool) -> list[Case]:
    """Every class's cases, in class order."""
    return [case for shape_class in classes for case in shape_class.cases(quick)]


def _bars(ours: dict, torch_row: dict | None) -> dict:
    """{"speed": ..., "memory": ...} of one dropin row against its case's torch row (None: not measured; speed
    is not judged from the interpreter's CPU timings)."""
    speed = None if _runtime.INTERPRET else ours.get("speedup_vs", {}).get("torch")
    theirs = torch_row and torch_row.get("peak_mib")
    return {"speed": None if speed is None else speed >= SPEED_BAR,
            "memory": None if ours.get("peak_mib") is None or theirs is None
            else ours["peak_mib"] <= theirs + MEMORY_SLACK_MIB}


def _failed(providers: dict) -> str:
    """The providers of one case whose result was incorrect, named (a peer's failure is no dropin's)."""
    return ", ".join(p for p, r in providers.items() if r["correct"] is False)


def summarize(rows: list[dict]) -> list[dict]:
    """One summary per class, in the rows' order; sets each dropin row's `bars`."""
    by_class: dict[str, dict[str, dict[str, dict]]] = {}
    for r in rows:
        if r.get("class") is not None:
            by_class.setdefault(r["class"], {}).setdefault(r["case"], {})[r["provider"]] = r
    summaries = []
    for name, cases in by_class.items():
        ours = {case: providers["dropin"] for case, providers in cases.items() if "dropin" in providers}
        for case, row in ours.items():
            row["bars"] = _bars(row, cases[case].get("torch"))
        speedups = {case: r["speedup_vs"]["torch"] for case, r in ours.items() if "torch" in r.get("speedup_vs", {})}
        pct = [r["pct_of_ceiling"] for r in ours.values() if r["pct_of_ceiling"] is not None]
        worst = min(speedups, key=speedups.get) if speedups else None
        summaries.append({
            "class": name, "cases": len(cases),
            "geomean_speedup": math.exp(statistics.fmean(map(math.log, speedups.values()))) if speedups else None,
            "worst_case": worst, "worst_speedup": speedups.get(worst),
            "median_pct_of_ceiling": statistics.median(pct) if pct else None,
            "speed_judged": sum(r["bars"]["speed"] is not None for r in ours.values()),
            "memory_judged": sum(r["bars"]["memory"] is not None for r in ours.values()),
            "below_speed_bar": [case for case, r in ours.items() if r["bars"]["speed"] is False],
            "over_memory_bar": [case for case, r in ours.items() if r["bars"]["memory"] is False],
            "incorrect": [f"{case} ({failed})" for case, providers in cases.items() if (failed := _failed(providers))]})
    return summaries


def format_summary(summaries: list[dict]) -> str:
    """The per-class lines printed under the suite's table."""
    lines = [f"=== classes: dropin vs torch, bars: speed >= {SPEED_BAR}x per case, peak memory <= torch's + "
             f"{MEMORY_SLACK_MIB} MiB ==="]
    for s in summaries:
        geomean = "-" if s["geomean_speedup"] is None else f"{s['geomean_speedup']:.2f}x"
        worst = "-" if s["worst_case"] is None else f"{s['worst_speedup']:.2f}x ({s['worst_case']})"
        pct = "" if s["median_pct_of_ceiling"] is None else f", median {s['median_pct_of_ceiling']:.0f}% of roofline"
        lines.append(f"{s['class']}: {s['cases']} cases, geomean {geomean}, worst {worst}{pct}; below the speed "
                     f"bar {len(s['below_speed_bar'])} of {s['speed_judged']} judged, over the memory bar "
                     f"{len(s['over_memory_bar'])} of {s['memory_judged']} judged, incorrect {len(s['incorrect'])}")
        for key in ("below_speed_bar", "over_memory_bar", "incorrect"):
            lines += [f"  {key.replace('_', ' ')}: {case}" for case in s[key]]
    return "\n".join(lines)
