"""The benchmark harness: statistics, correctness verdicts, error rows, result files (small torch cases)."""
import csv
import json
import math
import statistics

import pytest
import torch

from dropin import _runtime
from dropin.bench import harness
from dropin.bench.harness import Case, Skipped
from _tol import TOLERANCES

ROW_KEYS = {"case", "class", "provider", "dtype", "median_ms", "mean_ms", "min_ms", "max_ms", "tflops", "gbps",
            "pct_of_ceiling", "correct", "rel_err", "fallback", "peak_mib", "graph_ms", "graph_pct_of_ceiling"}


class FallbackMatmul:
    """A provider that reports having fallen back to torch."""
    fallback = True

    def __call__(self, a, b):
        return torch.matmul(a, b)


def _raise(a, b):
    raise ValueError("boom")


def _raise_with_cause(a, b):
    try:
        raise KeyError("the reason")
    except KeyError as e:
        raise RuntimeError("at 1:2:\n  source excerpt") from e


def mm_case(name="mm", dtype="fp32", **providers):
    return Case(name=name, dtype=dtype,
                make_inputs=lambda: (harness.randn(8, 5, dtype=dtype), harness.randn(5, 3, dtype=dtype)),
                providers=providers or {"dropin": torch.matmul, "torch": torch.matmul},
                reference=torch.matmul, flops=2 * 8 * 5 * 3, bytes=4 * (8 * 5 + 5 * 3 + 8 * 3))


def run(case):
    return {r["provider"]: r for r in harness.run_case(case, warmup_ms=1, rep_ms=1)}


def test_summarize():
    assert harness.summarize([3.0, 1.0, 10.0, 2.0]) == {
        "median_ms": 2.5, "mean_ms": 4.0, "min_ms": 1.0, "max_ms": 10.0}


def test_time_fn_gives_samples():
    times = harness.time_fn(lambda: torch.ones(4).sum(), warmup_ms=1, rep_ms=1)
    assert len(times) >= (3 if _runtime.INTERPRET else 1) and all(t >= 0 for t in times)


def test_rel_error():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert harness.rel_error(ref.float(), ref) == 0
    assert harness.rel_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert math.isnan(harness.rel_error(torch.tensor([3.0, math.nan]), ref))
    assert math.isnan(harness.rel_error(torch.tensor([3.0, math.inf]), ref))
    # NaN where the reference has NaN too is not an error
    assert harness.rel_error(torch.tensor([math.nan, 4.0]), torch.tensor([math.nan, 4.0])) == 0
    with pytest.raises(ValueError, match="shape"):
        harness.rel_error(torch.zeros(3), ref)


def test_rel_error_of_tuples_is_the_worst():
    ref = (torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64))
    assert harness.rel_error((ref[0].float(), torch.tensor([1.5])), ref) == pytest.approx(0.5)
    assert math.isnan(harness.rel_error((torch.tensor([3.0, math.nan]), torch.tensor([1.0])), ref))
    with pytest.raises(ValueError, match="outputs"):
        harness.rel_error((ref[0],), ref)


def test_backward_cases_use_the_backward_tolerance():
    """A case whose outputs include gradients (a tuple) is held to DESIGN.md's backward column."""
    def with_grad(scale):
        return lambda a, b: (torch.matmul(a, b), torch.matmul(a, b).sum(0) * scale)
    case = mm_case(dtype="fp32", dropin=with_grad(1 + 5e-5))  # no torch peer: no 2x rule here
    case.reference, case.backward = with_grad(1), True
    row = run(case)["dropin"]
    assert row["tol"] == TOLERANCES[torch.float32][1] == 1e-4
    assert row["rel_err"] == pytest.approx(5e-5, rel=0.05) and row["correct"] is True


def test_with_backward_and_optional():
    a, b = harness.randn(4, 3, dtype="fp32"), harness.randn(3, 2, dtype="fp32")
    g = harness.randn(4, 2, dtype="fp32")
    out, grad_a = harness.with_backward(torch.matmul, n_args=2, n_grads=1)(a, b, g)
    torch.testing.assert_close(out, a @ b)
    torch.testing.assert_close(grad_a, g @ b.T)
    assert not a.requires_grad
    assert harness.optional("math", "pi") == math.pi
    assert harness.optional("no_such_module_here", "x") is None


@pytest.mark.parametrize("module,note", [("no_such_module_here", "not installed"),
                                         ("math", "skipped: interpreter" if harness._runtime.INTERPRET else None)])
def test_optional_provider(module, note):
    provider = harness.optional_provider(module, "sqrt", lambda f: lambda x: f(x) + 1)
    if note is None:
        assert provider(4.0) == 3.0
    else:
        with pytest.raises(harness.Skipped, match=note):
            provider(4.0)


def test_peak_memory():
    def allocate_64_mib():
        return torch.empty(2**24, device=_runtime.KERNEL_DEVICE).sum()
    peak = harness.peak_memory_mib(allocate_64_mib)
    if _runtime.INTERPRET:
        assert peak is None
    else:
        assert 64 <= peak < 66
    assert all(r["peak_mib"] == peak if peak is None else r["peak_mib"] >= 0 for r in run(mm_case()).values())


def test_graph_time():
    """The CUDA-graph time of a 256 MiB copy (memory-bound, launch cost negligible) is within 25% of the
    event-timed median; a provider that syncs with the host cannot be captured: no graph time, a note."""
    src = torch.randn(2**26, device=_runtime.KERNEL_DEVICE)
    dst = torch.empty_like(src)
    graph = harness.graph_time_ms(lambda: dst.copy_(src))
    if _runtime.INTERPRET:
        assert graph is None
        return
    events = statistics.median(harness.time_fn(lambda: dst.copy_(src)))
    assert 0.75 * events < graph < 1.25 * events
    syncing = {"copy": lambda a, b: torch.matmul(a, b).cpu().to(a.device),
               "item": lambda a, b: torch.matmul(a, b) * (a.sum().item() != 0)}  # (Liger's fused linear CE)
    for name, provider in syncing.items():
        rows = run(mm_case(dropin=provider, torch=torch.matmul))
        assert rows["dropin"]["graph_ms"] is None and "no CUDA-graph time" in rows["dropin"]["graph_note"], name
        assert rows["torch"]["graph_ms"] > 0, name
        torch.randn(4, device=_runtime.KERNEL_DEVICE)  # (random draws still work: no capture was left open)


def test_correct_rows_and_speedup():
    rows = run(mm_case())
    for row in rows.values():
        assert ROW_KEYS <= row.keys()
        assert row["correct"] is True and row["rel_err"] < 1e-6 and row["fallback"] is False
        assert row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert row["tflops"] > 0 and row["gbps"] > 0
    assert rows["dropin"]["speedup_vs"] == {
        "torch": pytest.approx(rows["torch"]["median_ms"] / rows["dropin"]["median_ms"])}
    assert "speedup_vs" not in rows["torch"]
    assert harness.case_passed(list(rows.values()))


def test_wrong_provider_fails_the_case():
    rows = run(mm_case(dropin=lambda a, b: torch.matmul(a, b) + 0.01, torch=torch.matmul))
    assert rows["dropin"]["correct"] is False and rows["dropin"]["rel_err"] > 1e-5
    assert rows["torch"]["correct"] is True
    assert not harness.case_passed(list(rows.values()))


def test_worse_than_twice_torch_fails_within_tolerance():
    off_by_1_5e2 = lambda a, b: torch.matmul(a, b) * (1 + 1.5e-2)  # noqa: E731  (bf16 tolerance: 2e-2)
    row = run(mm_case(dtype="bf16", dropin=off_by_1_5e2, torch=torch.matmul))["dropin"]
    assert row["rel_err"] < TOLERANCES[torch.bfloat16][0]
    assert row["correct"] is False and "2x torch" in row["error"]


def test_tolerance_depends_on_dtype():
    off_by_1e3 = lambda a, b: torch.matmul(a, b) * (1 + 1e-3)  # noqa: E731
    assert run(mm_case(dtype="bf16", dropin=off_by_1e3))["dropin"]["correct"] is True
    assert run(mm_case(dtype="fp32", dropin=off_by_1e3))["dropin"]["correct"] is False


def test_nan_never_passes():
    row = run(mm_case(dropin=lambda a, b: torch.matmul(a, b) * math.nan))["dropin"]
    assert row["correct"] is False and math.isnan(row["rel_err"]) and "NaN" in row["error"]


def test_raising_skipped_and_fallback_providers():
    rows = run(mm_case(dropin=FallbackMatmul(), torch=torch.matmul, boom=_raise, chained=_raise_with_cause,
                       gone=harness.skipped("skipped: not here")))
    assert rows["dropin"]["fallback"] is True and rows["dropin"]["correct"] is True
    assert rows["boom"]["correct"] is False and rows["boom"]["error"] == "ValueError: boom"
    assert rows["boom"]["median_ms"] is None
    assert rows["chained"]["error"].endswith("caused by KeyError: 'the reason'")
    assert rows["gone"]["note"] == "skipped: not here" and rows["gone"]["correct"] is None
    assert set(rows["dropin"]["speedup_vs"]) == {"torch"}
    assert not harness.case_passed(list(rows.values()))  # the raising provider fails the case
    del rows["boom"], rows["chained"]
    assert harness.case_passed(list(rows.values()))  # a skipped one does not


@pytest.mark.skipif(not _runtime.INTERPRET, reason="interpreter behaviour")
def test_compiled_is_skipped_under_interpreter():
    with pytest.raises(Skipped, match="interpreter"):
        harness.compiled(torch.matmul)(torch.ones(2, 2), torch.ones(2, 2))
    assert harness.measure_ceilings() == {}


def test_allow_tf32_restores():
    old = torch.backends.cuda.matmul.allow_tf32
    with harness.allow_tf32(not old):
        assert torch.backends.cuda.matmul.allow_tf32 is (not old)
    assert torch.backends.cuda.matmul.allow_tf32 is old


def test_run_suite_table_and_files(tmp_path, capsys):
    cases = [mm_case("good"), mm_case("bad", dropin=lambda a, b: -torch.matmul(a, b), torch=torch.matmul)]
    result = harness.run_suite("demo", cases, results_dir=tmp_path, json_path=tmp_path / "x.json",
                               csv_path=tmp_path / "x.csv", command="dropin bench demo", rep_ms=1)
    out = capsys.readouterr().out
    assert "[PASSED] good" in out and "[FAILED] bad" in out and "Passed: 1 | Failed: 1" in out
    assert harness.failed_cases(result["rows"]) == ["bad"]

    saved = json.loads((tmp_path / _runtime.gpu_slug() / "demo.json").read_text())
    assert saved == json.loads((tmp_path / "x.json").read_text())
    assert {"gpu", "torch", "triton", "dropin", "date", "command", "ceilings"} <= saved["env"].keys()
    assert saved["env"]["command"] == "dropin bench demo"
    assert len(saved["rows"]) == 4 and all(ROW_KEYS <= r.keys() for r in saved["rows"])
    if _runtime.INTERPRET:
        assert all(r["pct_of_ceiling"] is None for r in saved["rows"])

    with open(tmp_path / "x.csv") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 4 and ROW_KEYS | {"speedup_vs_torch"} <= lines[0].keys()


def test_update_replaces_the_cases_it_ran(tmp_path):
    """A suite measured in parts (--update): each run's cases replace their rows in the result file, in place;
    the other rows stay; env lists each part; results of another GPU or version do not merge."""
    harness.run_suite("demo", [mm_case("a"), mm_case("b")], results_dir=tmp_path, command="part 1", rep_ms=1)
    again = dict(dropin=torch.matmul, torch=torch.matmul, peer=torch.matmul)  # (tells the parts' rows apart)
    result = harness.run_suite("demo", [mm_case("b", **again), mm_case("c", **again)], results_dir=tmp_path,
                               command="part 2", rep_ms=1, update=True)
    saved = json.loads((tmp_path / _runtime.gpu_slug() / "demo.json").read_text())
    assert [(r["case"], r["provider"]) for r in saved["rows"]] == [
        ("a", "dropin"), ("a", "torch"), *((case, p) for case in "bc" for p in ("dropin", "torch", "peer"))]
    assert [p["command"] for p in saved["env"]["parts"]] == ["part 1", "part 2"]
    with pytest.raises(ValueError, match="cannot merge"):
        harness.merged(saved, dict(result, env=dict(result["env"], gpu="another GPU")))


def test_no_save_writes_nothing(tmp_path):
    harness.run_suite("demo", [mm_case()], results_dir=tmp_path, save=False, rep_ms=1)
    assert not any(tmp_path.iterdir())


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    harness.run_suite("demo", [mm_case()], results_dir=tmp_path, save=False, plot=True, rep_ms=1)
    png = tmp_path / _runtime.gpu_slug() / "demo.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
