"""Drop-in for the modules that are one functional op: pooling, norms, standalone activations."""
from typing import Callable

import torch

from .module import DropinModule


class Op(DropinModule):
    """`fn(self, x)`: one dropin op on the original module's settings (`self.original`) and tensors (shared)."""

    def __init__(self, original: torch.nn.Module, kernel: str, fn: Callable):
        super().__init__(original)
        self.kernel = kernel
        object.__setattr__(self, "fn", fn)  # a plain attribute, like `original`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)
