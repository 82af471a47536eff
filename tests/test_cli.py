"""The `dropin` command line."""
import json
import subprocess
import sys

import pytest

import dropin
from dropin import _runtime
from dropin.cli import SUITES, load_suite, main

FAST = ["--warmup", "1", "--rep", "1"]


def test_help_lists_suites(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(suite in out for suite in SUITES)


def test_info_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "dropin.cli", "info"], capture_output=True, text=True,
                         check=True).stdout
    for key in ("gpu:", "torch:", "triton:", "dropin:", f"interpreter: {_runtime.INTERPRET}"):
        assert key in out


def test_bench_bmm_files_and_filter(tmp_path, capsys):
    rc = main(["bench", "bmm", "--quick", "--cases", "fp16", "--results-dir", str(tmp_path),
               "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"), *FAST])
    out = capsys.readouterr().out
    assert out.count("fp16") >= 1 and "fp32" not in out.split("Passed:")[0]
    result = json.loads((tmp_path / _runtime.gpu_slug() / "bmm.json").read_text())
    assert {r["provider"] for r in result["rows"]} == {"dropin", "torch", "torch_compile"}
    assert result["env"]["command"].startswith("dropin bench bmm")
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.csv").exists()
    assert rc == (1 if "[FAILED]" in out else 0)


def test_bench_providers(tmp_path, capsys):
    """--providers keeps the named providers' rows alone, with --no-save only (the result file holds every
    provider); an unknown name lists the suite's."""
    rc = main(["bench", "bmm", "--quick", "--cases", "fp16", "--providers", "dropin,torch", "--no-save",
               "--results-dir", str(tmp_path), "--json", str(tmp_path / "r.json"), *FAST])
    assert rc == (1 if "[FAILED]" in capsys.readouterr().out else 0)
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert rows and {r["provider"] for r in rows} == {"dropin", "torch"}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert main(["bench", "bmm", "--quick", "--providers", "dropin"]) == 2
    assert "--no-save" in capsys.readouterr().err
    assert main(["bench", "bmm", "--quick", "--providers", "dropin,cublas", "--no-save"]) == 2
    assert "no provider cublas; its providers: dropin, torch, torch_compile" in capsys.readouterr().err


def test_bench_no_matching_case_lists_the_cases(capsys):
    assert main(["bench", "matmul", "--quick", "--no-save", "--cases", "no-such-case"]) == 2
    err = capsys.readouterr().err
    names = [c.name for c in load_suite("matmul")(quick=True)]
    assert "no case" in err and names and all(f"\n  {name}" in err for name in names)


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["inject", "--help"], ["zoo", "--help"],
                                  ["--version"]])
def test_help_and_version_import_no_torch(argv):
    """Help and --version are quick: neither imports torch nor dropin's kernels."""
    code = (f"import sys; from dropin.cli import main\n"
            f"try: main({argv!r})\nexcept SystemExit as e: assert e.code == 0\n"
            "assert not {'torch', 'triton', 'dropin.ops'} & set(sys.modules), 'imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (f"dropin {dropin.__version__}" if argv == ["--version"] else "usage: dropin") in run.stdout


@pytest.mark.parametrize("suite", ["swiglu", "rms_norm", "rope", "flce"])
def test_bench_llm_suites_quick(suite, capsys):
    """The LLM block suites run their quick cases (forward and forward + backward; flce: forward + backward) and
    pass."""
    rc = main(["bench", suite, "--quick", "--no-save", *FAST])
    out = capsys.readouterr().out
    assert "fwd+bwd" in out and "MiB" in out and "Failed: 0" in out
    assert rc == 0


@pytest.mark.parametrize("suite", ["group_norm", "conv1d", "activations"])
def test_bench_layer_suites_quick(suite, capsys):
    """The suites of the zoo's ops run their quick cases (forward and forward + backward) and pass."""
    rc = main(["bench", suite, "--quick", "--no-save", *FAST])
    out = capsys.readouterr().out
    assert "fwd+bwd" in out and "torch_compile" in out and "Failed: 0" in out
    assert rc == 0


def test_bench_sparse_quick(capsys):
    """The sparse suite's quick cases run every provider (sparse, dense torch, dense dropin) and pass."""
    rc = main(["bench", "sparse", "--quick", "--no-save", *FAST])
    out = capsys.readouterr().out
    assert "dropin_dense" in out and "x dense)" in out and "Failed: 0" in out
    assert rc == 0


def test_bench_overhead_rows_and_file(capsys, tmp_path):
    """`dropin bench overhead`: one row per (op, mode, provider) with host times; dropin rows carry the difference
    to torch's and the budget verdict; the JSON has the env and rows."""
    out_json = tmp_path / "overhead.json"
    assert main(["bench", "overhead", "--no-save", "--cases", "relu", "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "relu" in table and "no_grad" in table and "grad" in table
    result = json.loads(out_json.read_text())
    rows = {(r["mode"], r["provider"]): r for r in result["rows"]}
    assert set(rows) == {(m, p) for m in ("no_grad", "grad") for p in ("torch", "dropin")}
    assert all(r["host_us"] > 0 for r in rows.values())
    assert "over_torch_us" in rows["grad", "dropin"] and "within_budget" in rows["no_grad", "dropin"]
    assert result["env"]["suite"] == "overhead"


def test_bench_overhead_no_matching_case(capsys):
    assert main(["bench", "overhead", "--no-save", "--cases", "no-such-op"]) == 2
    assert "rms_norm" in capsys.readouterr().err  # the known cases are listed
