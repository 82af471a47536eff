"""`dropin zoo` under the interpreter (--tiny, no speed): the list, rows of real and fake models, resume and merge,
failures and the time limit, the table and its summary. The fake models are tests/bench/zoo_fakes.py's."""
import json
import os
import time
from pathlib import Path

import pytest

from dropin.cli import main

FAKES = str(Path(__file__).parent)
ROW_KEYS = {"model", "dtype", "versions", "status", "error", "input", "replaced", "covered", "left", "left_modules",
            "coverage_modules", "coverage_flops", "coverage_time", "verification", "verified", "err_vs_fp64",
            "torch_err_vs_fp64", "err_limit", "first_output_s", "note", "seconds", "date"}


@pytest.fixture
def fakes(monkeypatch):
    # the zoo's worker processes import zoo_fakes (and dropin, from src/ where PYTHONPATH says so)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [FAKES, os.environ.get("PYTHONPATH")])))


def rows_of(path: Path) -> dict:
    return {(r["model"], r["dtype"]): r for r in json.loads(path.read_text())["rows"]}


def test_list_names_every_source_without_building(capsys, monkeypatch):
    torchvision = pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers")

    def no_building(*args, **kwargs):
        raise AssertionError("the list builds a model")
    monkeypatch.setattr(torchvision.models, "get_model", no_building)
    monkeypatch.setattr(transformers.AutoConfig, "for_model", no_building)
    assert main(["zoo", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = {line.split()[0] for line in lines}
    assert {"torchvision/resnet18", "torchvision/mobilenet_v2", "torchvision/vit_b_16", "hf/llama", "hf/gpt2",
            "hf/cvt"} <= names
    assert len(names) >= 80 and "torchvision/resnet18  float32" in lines and "hf/llama  bfloat16" in lines
    assert "hf/llama  float32" not in lines  # text models: bfloat16 only
    assert main(["zoo", "--list", "--models", "resnet1*", "hf/*", "--dtype", "bfloat16"]) == 0
    picked = capsys.readouterr().out.split()
    assert "torchvision/resnet18" in picked and "torchvision/resnet101" in picked and "hf/bert" in picked
    assert "torchvision/resnet50" not in picked and "float32" not in picked
    assert main(["zoo", "--list", "--models", "no_such_model*"]) == 2


def test_shards_split_the_models_without_rows(tmp_path, capsys):
    """--shard I/N: runs side by side take disjoint equal shares of the chosen models that have no row."""
    pytest.importorskip("torchvision")
    common = ["zoo", "--list", "--models", "resnet*", "--file", str(tmp_path / "zoo.json")]
    assert main(common) == 0
    every = capsys.readouterr().out.splitlines()
    shares = []
    for index in range(3):
        assert main([*common, "--shard", f"{index}/3"]) == 0
        shares.append(capsys.readouterr().out.splitlines())
    assert sorted(sum(shares, [])) == sorted(every) and max(map(len, shares)) - min(map(len, shares)) <= 1
    from dropin.bench.zoo import save_row, versions

    done = every[0].split()
    save_row(tmp_path / "zoo.json", {}, {"model": done[0], "dtype": done[1], "versions": versions()})
    assert main([*common, "--shard", "0/1"]) == 0
    assert capsys.readouterr().out.splitlines() == every[1:]
    for bad in ("3/3", "1", "a/2"):
        assert main([*common, "--shard", bad]) == 2


def test_tiny_run_rows_resume_and_failures(tmp_path, capsys, fakes):
    """Two real-shaped models and a broken one: rows with every field, the broken model's failure does not stop
    the run; a second run skips them, and a new model merges into the same file."""
    path = tmp_path / "zoo.json"
    argv = ["zoo", "--tiny", "--no-speed", "--dtype", "float32", "--file", str(path)]
    assert main([*argv, "--models", "zoo_fakes:raises", "zoo_fakes:convnet", "hf/llama"]) == 0
    rows = rows_of(path)
    assert set(rows) == {(m, "float32") for m in ("zoo_fakes:raises", "zoo_fakes:convnet", "hf/llama")}
    broken = rows["zoo_fakes:raises", "float32"]
    assert broken["status"] == "failed" and "RuntimeError: this model is broken" in broken["error"]
    for model in ("zoo_fakes:convnet", "hf/llama"):
        row = rows[model, "float32"]
        assert ROW_KEYS <= set(row) and row["status"] == "ok", row
        assert row["verified"] and row["err_vs_fp64"] <= row["err_limit"] and row["replaced"] > 0
        assert row["coverage_flops"] > 0.9 and row["first_output_s"] > 0
        assert set(row["versions"]) == {"torch", "triton", "transformers", "dropin"}
        assert "speed not measured" in row["note"]
    llama = rows["hf/llama", "float32"]
    assert llama["left"] == len(llama["left_modules"]) and all(m["reason"] for m in llama["left_modules"])
    before = path.read_text()
    start = time.monotonic()
    assert main([*argv, "--models", "zoo_fakes:convnet", "hf/llama"]) == 0
    assert time.monotonic() - start < 10 and path.read_text() == before  # skipped: rows exist
    assert "has a row" in capsys.readouterr().err
    assert main([*argv, "--models", "zoo_fakes:convnet", "--dtype", "both"]) == 0  # bfloat16: a new row
    merged = rows_of(path)
    assert set(merged) == set(rows) | {("zoo_fakes:convnet", "bfloat16")}
    assert all(merged[k] == rows[k] for k in rows)


def test_zero_initialized_parameters_are_drawn(tmp_path, fakes):
    """A parameter that the model's init leaves all zero (timm's heads) is drawn at random: the output is not zeros,
    so that the check against float64 can fail (torch's own error is then above zero)."""
    path = tmp_path / "zoo.json"
    assert main(["zoo", "--tiny", "--no-speed", "--dtype", "float32", "--file", str(path), "--models",
                 "zoo_fakes:zero_head"]) == 0
    row = rows_of(path)["zoo_fakes:zero_head", "float32"]
    assert row["status"] == "ok" and row["torch_err_vs_fp64"] > 0 and row["err_vs_fp64"] > 0, row


def test_time_limit_stops_a_model(tmp_path, fakes):
    path = tmp_path / "zoo.json"
    start = time.monotonic()
    assert main(["zoo", "--tiny", "--dtype", "float32", "--file", str(path), "--models", "zoo_fakes:slow",
                 "--time-limit", "4"]) == 0
    assert time.monotonic() - start < 30
    row = rows_of(path)["zoo_fakes:slow", "float32"]
    assert row["status"] == "timeout" and "time limit (4 s)" in row["error"]


def test_budget_leaves_a_model_for_the_next_run(tmp_path, fakes):
    """A model cut short by --budget gets no row (it runs next time)."""
    path = tmp_path / "zoo.json"
    assert main(["zoo", "--tiny", "--dtype", "float32", "--file", str(path), "--models", "zoo_fakes:slow",
                 "--budget", "4"]) == 0
    assert not path.exists() or not rows_of(path)


def test_runs_side_by_side_share_the_file(tmp_path):
    """Two zoo runs writing one result file at once (one a GPU) keep every row of both: each row merges into the
    file as it is on disk, under a lock; a row of the same key replaces the old one."""
    import subprocess
    import sys

    path = tmp_path / "zoo.json"
    writer = ("import sys; from pathlib import Path; from dropin.bench.zoo import save_row\n"
              "for i in range(40): save_row(Path(sys.argv[1]), {}, {'model': sys.argv[2] + str(i), 'dtype': 'bf16', "
              "'versions': {}, 'n': 1})")
    runs = [subprocess.Popen([sys.executable, "-c", writer, str(path), name]) for name in ("a", "b")]
    assert [run.wait(timeout=120) for run in runs] == [0, 0]
    assert set(rows_of(path)) == {(name + str(i), "bf16") for name in ("a", "b") for i in range(40)}
    from dropin.bench.zoo import save_row

    save_row(path, {}, {"model": "a0", "dtype": "bf16", "versions": {}, "n": 2})
    rows = rows_of(path)
    assert len(rows) == 80 and rows["a0", "bf16"]["n"] == 2 and rows["b0", "bf16"]["n"] == 1


def row(model, dtype, status="ok", **fields):
    base = {"model": model, "dtype": dtype, "versions": {}, "status": status, "error": None, "note": None,
            "verified": True, "left_modules": []}
    return {**base, **fields}


def test_table_and_summary_from_rows(tmp_path, capsys):
    rows = [row("torchvision/resnet50", "bfloat16", coverage_flops=0.99, err_vs_fp64=3e-3, eager_speedup=1.2,
                best_speedup=1.05, best_dropin="dropin_graph", best_original="original_compile_ro",
                first_output_s=12.5, compile_s={"original": 40.0, "dropin": 30.0}),
            row("torchvision/mobilenet_v2", "bfloat16", coverage_flops=0.80, err_vs_fp64=4e-3, eager_speedup=0.9,
                best_speedup=0.7, best_dropin="dropin", best_original="original_graph", first_output_s=60.0,
                left_modules=[{"name": f"f.{i}", "type": "ReLU6", "reason": "no handler"} for i in range(3)]),
            row("torchvision/resnet50", "float32", coverage_flops=0.97, err_vs_fp64=1e-2, verified=False,
                eager_speedup=1.1, best_speedup=1.0, best_dropin="dropin", best_original="original"),
            row("hf/gemma", "bfloat16", "timeout", error="ran out of its time limit (600 s)"),
            row("timm/resnet50", "bfloat16", "skipped", error="timm is not installed")]
    path = tmp_path / "zoo.json"
    path.write_text(json.dumps({"env": {}, "rows": rows}))
    assert main(["zoo", "--table", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == (tmp_path / "zoo.md").read_text()
    lines = out.splitlines()
    resnet = next(line for line in lines if line.startswith("| torchvision/resnet50 | bfloat16"))
    assert "99.0%" in resnet and "1.20x" in resnet and "1.05x (dropin_graph / original_compile_ro)" in resnet
    assert "12.5 s" in resnet and "40.0 s" in resnet
    assert "left: ReLU6 x3" in out and "verification FAILED" in out and "timeout: ran out" in out
    summary = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
               for line in out.split("\n\n")[1].splitlines()[2:] if line.startswith("| ")}
    assert summary["crashes (failed, timeout, crashed; bar: 0)"][0] == "1 (25%) (not met)"
    flops = next(v for k, v in summary.items() if k.startswith(">= 95% of FLOPs"))
    assert flops[0] == "2 (50%) (not met)"
    verified = next(v for k, v in summary.items() if k.startswith("verified"))
    assert verified[0] == "2 (50%) (not met)"
    best = next(v for k, v in summary.items() if k.startswith("best mode"))
    assert best == ["2 (50%) (not met)", "1 (33%) (not met)", "1 (100%) (met)"]
    assert "Skipped (not buildable here, not counted): timm/resnet50" in out


def test_torchvision_inputs_fit_each_model():
    """Every torchvision classifier of the zoo runs its own forward on the zoo's inputs, full and tiny (on the meta
    device: shapes alone, nothing allocated): a size the model refuses (MaxViT's partitions, the ViTs' fixed size)
    fails here, not as a zoo row. RegNets are left out: their constructors read values (meta tensors hold none)."""
    import torch

    from dropin.bench import zoo_models

    refused = []
    for model in zoo_models.catalog()[0]:
        if not model.name.startswith("torchvision/") or model.name.startswith("torchvision/regnet_"):
            continue
        for tiny in (True, False):
            with torch.device("meta"), torch.no_grad():
                module, inputs = model.build(tiny)
                try:
                    module.eval()(*inputs)
                except Exception as e:  # (any refusal: torch's, or the model's own assertions)
                    refused.append(f"{model.name} (tiny {tiny}, {tuple(inputs[0].shape)}): {type(e).__name__}: {e}")
    assert not refused, "\n".join(refused)
