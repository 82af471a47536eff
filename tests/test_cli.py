"""The `dropin` command line."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import dropin.nn as dnn
from dropin import _runtime
from dropin.cli import MODELS, SUITES, main
from dropin.inject import registry
from _tol import gpu

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


def test_bench_matmul_quick(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "matmul", "--quick", "--no-save", *FAST])
    out = capsys.readouterr().out
    assert "[PASSED]" in out or "[FAILED]" in out
    assert rc == (1 if "[FAILED]" in out else 0)
    assert not any(tmp_path.iterdir())  # --no-save


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


def test_bench_no_matching_case(capsys):
    assert main(["bench", "matmul", "--quick", "--no-save", "--cases", "no-such-case"]) == 2
    assert "no case" in capsys.readouterr().err



def _tiny_cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 3))


@pytest.mark.parametrize("flags", [["--verify"], ["--channels-last", "--batch", "2"]])
def test_inject_prints_the_report(capsys, monkeypatch, flags):
    monkeypatch.setitem(MODELS, "resnet18", _tiny_cnn)
    assert main(["inject", "resnet18", "--image-size", "8", *flags]) == 0
    out = capsys.readouterr().out
    assert "conv2d+bn+relu" in out and "AdaptiveAvgPool2d" in out
    assert ("verified: output within" in out) == ("--verify" in flags)
    assert ("channels_last" in out) == ("--channels-last" in flags)


class _OffByOne(dnn.Linear):
    def forward(self, x):
        return super().forward(x) + 1.0


def test_inject_verification_failure_exits_1(capsys, monkeypatch):
    monkeypatch.setitem(MODELS, "resnet18", _tiny_cnn)
    monkeypatch.setitem(registry.HANDLERS, nn.Linear, ("linear", lambda module, site: _OffByOne(module)))
    assert main(["inject", "resnet18", "--image-size", "8", "--verify"]) == 1
    assert "first replaced module whose output diverged: '5'" in capsys.readouterr().err


@gpu
@pytest.mark.parametrize("model", ["resnet18", "resnet50"])
def test_inject_torchvision_resnet(capsys, model):
    assert main(["inject", model, "--batch", "2", "--verify", "--channels-last"]) == 0
    assert ("BasicBlock" if model == "resnet18" else "Bottleneck") in capsys.readouterr().out
