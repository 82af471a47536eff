"""Drop-in for torch.nn.Linear: dropin.ops.linear, optionally with a fused activation."""
from typing import Optional

import torch

from ..ops import linear
from .module import DropinModule


class Linear(DropinModule):
    """`activation(linear(x))` for an nn.Linear (its own weight and bias), in one kernel."""

    def __init__(self, original: torch.nn.Linear, activation: Optional[str] = None, absorbs: tuple = ()):
        super().__init__(original, absorbs)
        self.activation = activation
        self.kernel = "linear" + (f"+{activation}" if activation else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.activation)
