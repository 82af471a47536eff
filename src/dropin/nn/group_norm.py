"""Drop-in for torch.nn.GroupNorm: dropin.ops.group_norm, with a following activation fused."""
from typing import Optional

import torch

from ..ops.group_norm import group_norm
from .module import DropinModule


class GroupNorm(DropinModule):
    """`activation(group_norm(x))` for an nn.GroupNorm (its own weight and bias, or none: affine=False), one op."""

    def __init__(self, original: torch.nn.GroupNorm, activation: Optional[str] = None, absorbs: tuple = ()):
        super().__init__(original, absorbs)
        self.activation = activation
        self.kernel = "group_norm" + (f"+{activation}" if activation else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.original
        return group_norm(x, norm.num_groups, *self._weight_bias(), norm.eps, self.activation)
