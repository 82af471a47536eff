"""Drop-in for torch.nn.Conv1d: dropin.ops.conv1d (conv2d's kernels on height-1 views), with a following activation
fused; padding modes other than zeros pad first with F.pad (torch), as nn.Conv1d does."""
from typing import Optional

import torch
import torch.nn.functional as F

from ..ops.conv1d import conv1d
from .module import DropinModule


def _pads(conv: torch.nn.Conv1d) -> tuple:
    """(left, right): the padding nn.Conv1d adds to the length (padding 'same': the odd one on the right)."""
    if conv.padding == "valid":
        return 0, 0
    if conv.padding == "same":
        total = conv.dilation[0] * (conv.kernel_size[0] - 1)
        return total // 2, total - total // 2
    return conv.padding[0], conv.padding[0]


class Conv1d(DropinModule):
    """`activation(conv1d(x))` for an nn.Conv1d (its own weight and bias), one conv kernel: zeros padding in the
    kernel, 'reflect' / 'replicate' / 'circular' by F.pad before it."""

    def __init__(self, original: torch.nn.Conv1d, activation: Optional[str] = None, absorbs: tuple = ()):
        super().__init__(original, absorbs)
        self.activation = activation
        self.pads = None if original.padding_mode == "zeros" else _pads(original)
        self.kernel = ("conv1d" if self.pads is None else f"pad({original.padding_mode})+conv1d") + (
            f"+{activation}" if activation else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (weight, bias) = self.original, self._weight_bias()
        if self.pads is None:
            return conv1d(x, weight, bias, c.stride, c.padding, c.dilation, c.groups, self.activation)
        return conv1d(F.pad(x, self.pads, mode=c.padding_mode), weight, bias, c.stride, 0, c.dilation,
                      c.groups, self.activation)
