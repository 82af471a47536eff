"""Shape classes of `dropin bench matmul` and `dropin bench conv2d`: every class runs (scaled down) with its rows
named, checked and measured; the per-class summary and its bars; `--class` selects; the full sizes fit each
class's definition."""
import contextlib
import io
import json
import math

from types import SimpleNamespace

import pytest

from dropin import _runtime
from dropin.bench import classes, conv2d, matmul
from dropin.cli import main

SUITES = {"matmul": matmul.MATMUL_CLASSES, "conv2d": conv2d.CONV2D_CLASSES}
FAST = ["--quick", "--no-save", "--warmup", "1", "--rep", "1"]


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_class_runs_checked_and_summarized(suite, tmp_path, monkeypatch):
    """One run of every class of the suite, scaled down (one run a suite: on the GPU it takes 60-110 s): each
    class's rows named by its cases; dropin and torch ran, were checked against float64 and passed on every case;
    each row has its peak memory (a number on the GPU) and dropin's row the bars; the per-class summaries in the
    file; the exit code; --no-save writes nothing but the --json file; the interpreter's note."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "result.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", suite, *FAST, "--json", str(path)])
    result, out = json.loads(path.read_text()), out.getvalue()
    assert list(tmp_path.iterdir()) == [path]  # --no-save
    assert ("timings and speed-ups are not meaningful" in out) == _runtime.INTERPRET

    expected = {c.name: {case.name for case in c.cases(quick=True)} for c in SUITES[suite]}
    got = {}
    for r in result["rows"]:
        got.setdefault(r["class"], set()).add(r["case"])
    assert got == expected and all(got.values())

    ran = [r for r in result["rows"] if r["provider"] in ("dropin", "torch")]
    assert ran and all(r["correct"] is True and math.isfinite(r["rel_err"]) for r in ran), \
        [(r["case"], r["provider"], r.get("error")) for r in ran if r["correct"] is not True]
    assert all(r["median_ms"] > 0 and "peak_mib" in r for r in ran)
    assert all((r["peak_mib"] is None) == _runtime.INTERPRET for r in ran)
    ours = [r for r in ran if r["provider"] == "dropin"]
    assert all(r["bars"].keys() == {"speed", "memory"} for r in ours)
    assert all((r["bars"]["memory"] is None) == _runtime.INTERPRET for r in ours)
    assert rc == 0 and "[FAILED]" not in out

    summaries = {s["class"]: s for s in result["classes"]}
    assert list(summaries) == [c.name for c in SUITES[suite]]
    for c in SUITES[suite]:
        s = summaries[c.name]
        assert s["cases"] == len(c.cases(quick=True)) and s["geomean_speedup"] > 0
        assert s["worst_case"] in {case.name for case in c.cases(quick=True)}
        assert s["incorrect"] == [] and s["memory_judged"] == (0 if _runtime.INTERPRET else s["cases"])


def test_case_names_are_unique():
    """Rows are grouped by case name: two cases of one suite with one name would merge."""
    for suite, shape_classes in SUITES.items():
        for quick in (True, False):
            names = [case.name for case in classes.suite_cases(shape_classes, quick)]
            assert len(names) == len(set(names)), suite


def _row(case, provider, ms, peak, correct=True):
    return {"case": case, "class": "c", "provider": provider, "median_ms": ms, "peak_mib": peak,
            "pct_of_ceiling": None, "correct": correct}


def test_summary_bars(monkeypatch):
    """Speed bar 0.9x torch per case, memory bar torch's peak + 256 MiB, geomean and worst case."""
    monkeypatch.setattr(_runtime, "INTERPRET", False)  # (the speed bar is not judged from interpreter timings)
    rows = [_row("fast", "torch", 2.0, 100), _row("fast", "dropin", 1.0, 356),
            _row("slow", "torch", 0.8, 0), _row("slow", "dropin", 1.0, 257),
            _row("wrong", "torch", 1.0, 10), _row("wrong", "dropin", 1.0, 10, correct=False)]
    for theirs, ours in zip(rows[::2], rows[1::2]):
        ours["speedup_vs"] = {"torch": theirs["median_ms"] / ours["median_ms"]}
    [s] = classes.summarize(rows)
    assert s["geomean_speedup"] == pytest.approx((2.0 * 0.8 * 1.0) ** (1 / 3))
    assert (s["worst_case"], s["worst_speedup"]) == ("slow", pytest.approx(0.8))
    assert s["below_speed_bar"] == ["slow"] and s["over_memory_bar"] == ["slow"] and s["incorrect"] == ["wrong (dropin)"]
    assert rows[1]["bars"] == {"speed": True, "memory": True}
    assert s["speed_judged"] == s["memory_judged"] == 3
    text = classes.format_summary([s])
    assert "geomean 1.17x" in text and "below speed bar: slow" in text and "incorrect: wrong (dropin)" in text
    monkeypatch.setattr(_runtime, "INTERPRET", True)
    assert classes.summarize(rows)[0]["speed_judged"] == 0 and rows[1]["bars"]["speed"] is None


def test_class_option_selects(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["bench", "matmul", *FAST, "--class", "decode", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert {r["class"] for r in result["rows"]} == {"decode"} and [s["class"] for s in result["classes"]] == ["decode"]
    assert main(["bench", "conv2d", *FAST, "--class", "no-such-class"]) == 2
    err = capsys.readouterr().err
    assert "no class 'no-such-class'" in err and all(c.name in err for c in conv2d.CONV2D_CLASSES)


def test_help_names_every_class(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # (argparse would wrap lines at the hyphens of the names)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(c.name in out for shape_classes in SUITES.values() for c in shape_classes)


def _products(shape_class):
    """(m, n, k) of each full-size case of a matmul class (bmm: per product; linear: tokens, out, in)."""
    return [shape[-3:] if len(shape) == 4 and isinstance(shape[3], int) else shape[:3]
            for shape in shape_class.shapes]


def test_full_sizes_fit_their_class():
    by_name = {c.name: c for shape_classes in SUITES.values() for c in shape_classes}
    assert all(min(m, n) <= 16 and k <= 2**20 for m, n, k in _products(by_name["few-rows"]))
    assert all(k >= 64 * max(m, n) for m, n, k in _products(by_name["long-k"]))
    assert all(any(v % 2 for v in shape) for shape in _products(by_name["odd"]))
    assert all(m >= 64 * n for m, n, _ in _products(by_name["tall-skinny"]))
    assert all(n >= 64 * m for m, n, _ in _products(by_name["short-wide"]))
    assert all(max(shape[1:]) <= 128 and shape[0] >= 256 for shape in by_name["batched-small"].shapes)
    assert all(1 <= t <= 16 and {n, k} == {4096, 11008} for t, n, k in by_name["decode"].shapes)
    images = by_name["large-image"].shapes
    assert all(256 <= min(s[4]) and max(s[4]) <= 1024 and 3 <= s[2] <= 64 and s[1] <= 8 for s in images)
    assert {s[5] for s in by_name["kernels"].shapes} == {(5, 7), (5, 9), (7, 7)}
    assert all(s[2] == s[3] == s[6]["groups"] and s[1] == 8 for s in by_name["depthwise"].shapes)
    assert all(s[1] == 8 and s[4][0] <= 14 for s in by_name["small-batch"].shapes)
    assert all(s[6].get("dilation", 1) != 1 for s in by_name["dilated"].shapes)
    assert all(s[6]["stride"] > 1 for s in by_name["strided"].shapes)
    assert all(s[5] == (1, 1) and min(s[4]) >= 256 for s in by_name["pointwise"].shapes)
    assert {s[6].get("channels_last", False) for s in by_name["layouts"].shapes} == {False, True}
    resnet = by_name["resnet50"]
    assert resnet.dtypes == ("bf16", "fp16") and all(s[1] == 64 for s in resnet.shapes)
    assert all(c.build(c.shapes[0], "bf16").make_inputs is not None for c in by_name.values())


def test_dtype_rule():
    """Every shape in bf16 and fp16 (bf16 left out under the interpreter), the first also in fp32 and tf32."""
    shape_class = classes.ShapeClass("c", "", lambda shape, dtype: SimpleNamespace(shape=shape, dtype=dtype),
                                     shapes=[(1,), (2,)], quick=[(3,)])
    got = [(case.shape[0], case.dtype, case.group) for case in shape_class.cases(quick=False)]
    expected = [(1, "bf16"), (1, "fp16"), (1, "fp32"), (1, "tf32"), (2, "bf16"), (2, "fp16")]
    assert got == [(n, d, "c") for n, d in expected if not (_runtime.INTERPRET and d == "bf16")]
    assert [case.shape for case in shape_class.cases(quick=True)] == [(3,)] * (3 if _runtime.INTERPRET else 4)
    assert all("fp16" in c.dtypes for shape_classes in SUITES.values() for c in shape_classes if "bf16" in c.dtypes)
