"""`dropin inject MODEL`: the report printed, the exit code of a failed verification."""
import pytest
from torch import nn

import dropin.nn as dnn
from dropin.cli import MODELS, main
from dropin.inject import registry
from _tol import gpu


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
