"""Drop-ins for torch.nn.Linear and HF's Conv1D (GPT-2's transposed linear): dropin.ops.linear, optionally with a
fused activation."""
from typing import Optional

import torch

from ..ops import linear
from .module import DropinModule


class Linear(DropinModule):
    """`activation(linear(x))` for an nn.Linear (its own weight and bias), in one kernel."""

    def __init__(self, original: torch.nn.Module, activation: Optional[str] = None, absorbs: tuple = ()):
        super().__init__(original, absorbs)
        self.activation = activation
        self.kernel = "linear" + (f"+{activation}" if activation else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, *self._weight_bias(), self.activation)


class TransposedLinear(Linear):
    """`activation(x @ weight + bias)` for HF's Conv1D (transformers.pytorch_utils.Conv1D, weight [in, out]): the
    linear of the weight's transposed view, the Conv1D's own parameters read at each call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._weight_bias()
        return linear(x, weight.t(), bias, self.activation)
