"""Models of one's own for `dropin zoo --models zoo_fakes:FUNCTION` in tests/bench/test_zoo.py (this folder on
PYTHONPATH): FUNCTION(tiny) returns (model, inputs)."""
import time

import torch
from torch import nn


def convnet(tiny: bool):
    """A conv -> BatchNorm -> ReLU -> pool -> linear classifier at 8x8 images: quick under the interpreter."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    return model, (torch.randn(2, 3, 8, 8),)


def raises(tiny: bool):
    """A model whose forward raises."""
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("this model is broken")
    return Broken(), (torch.randn(2, 4),)


def slow(tiny: bool):
    """A model that takes a minute to build."""
    time.sleep(60)
    return nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),)


def zero_head(tiny: bool):
    """An MLP whose last layer starts at zero, as timm's classifier heads do."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    nn.init.zeros_(model[2].weight), nn.init.zeros_(model[2].bias)
    return model, (torch.randn(4, 16),)
