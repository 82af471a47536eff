"""Drop-ins for modules whose forward is functional code: one dropin op (pooling, norms, standalone activations), or
the original's forward under dropin's route."""
from typing import Callable

import torch

from .. import route
from .module import DropinModule


class Op(DropinModule):
    """`fn(self, x)`: one dropin op on the original module's settings (`self.original`) and tensors (shared)."""

    def __init__(self, original: torch.nn.Module, kernel: str, fn: Callable):
        super().__init__(original)
        self.kernel = kernel
        object.__setattr__(self, "fn", fn)  # a plain attribute, like `original`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


class Routed(DropinModule):
    """A module whose forward computes with torch functions on its own tensors (torchvision's shifted-window
    attention: F.linear on its children's weights, matmuls, softmax), not by calling children: the original's
    forward runs under dropin's route (`dropin.route.use()`), so those calls run dropin's ops where dropin supports
    them and torch's otherwise (counted in `dropin.route_report()`). The original's children stay registered under
    their names (state_dict keys, parameters) and are not injected: the forward reads their tensors."""

    kernel = "its forward under dropin's route (F.linear, matmul, softmax, ...)"

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        self._adopt_children()  # (not `walks_children`: inject_ leaves them as they are)

    def forward(self, *args, **kwargs):
        with route.use():
            return self.original(*args, **kwargs)
