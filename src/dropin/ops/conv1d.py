"""1-D convolution (torch.nn.functional.conv1d semantics) as dropin's conv2d on views of height 1: input [N, C, L]
as [N, C, 1, L], weight [Cout, C / groups, K] as [Cout, C / groups, 1, K] (views of the same tensors: no copy, and
conv2d's autograd gives the gradients of the 1-D tensors through them), the output viewed back as [N, Cout, L'].
Its kernels, plans, shortcuts and registered ops are conv2d's; a length-last layout with unit channel stride
([N, L, C] transposed) reads as channels_last."""
from typing import Optional

import torch
import torch.nn.functional as F

from .activations import activation_ref
from .conv2d import conv2d


def conv1d_ref(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, activation=None, residual=None):
    y = F.conv1d(input, weight, bias, stride, padding, dilation, groups)
    return activation_ref(y if residual is None else y + residual, activation)


def _single(value, name: str):
    """An int or a 1-element tuple / list as an int (padding also 'same' / 'valid'); RuntimeError naming the
    argument otherwise."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if isinstance(value, int) and not isinstance(value, bool) or name == "padding" and isinstance(value, str):
        return value
    raise RuntimeError(f"conv1d: expected '{name}' to be a single integer value or a list of 1 value, but got "
                       f"{name}={value!r}")


def _as_2d(stride, padding, dilation) -> tuple:
    """conv2d's stride, padding and dilation for a conv1d's (height 1: stride and dilation 1, no padding)."""
    s, p, d = _single(stride, "stride"), _single(padding, "padding"), _single(dilation, "dilation")
    return (1, s), p if isinstance(p, str) else (0, p), (1, d)


def conv1d(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, stride=1, padding=0,
           dilation=1, groups: int = 1, activation: Optional[str] = None,
           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`activation(F.conv1d(input, weight, bias, stride, padding, dilation, groups) + residual)` in one kernel
    (dropin.ops.conv2d on height-1 views).

    input [N, C, L] or unbatched [C, L], any strides; weight [Cout, C / groups, K]; bias [Cout] or None; stride /
    padding / dilation an int or a 1-element tuple, padding also 'valid' or 'same' (stride 1 only, the odd extra
    element on the right as in torch); activation and residual (of the output's size) as conv2d's. Zeros padding:
    other padding modes pad first (F.pad), as nn.Conv1d does. float32 / float16 / bfloat16, fp32 accumulation."""
    if not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
        raise RuntimeError(f"conv1d: expected 2-D (unbatched) or 3-D (batched) 'input', but got "
                           f"{list(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise RuntimeError(f"conv1d: expected 3-D 'weight' [out_channels, in_channels / groups, k], but got "
                           f"{list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    stride, padding, dilation = _as_2d(stride, padding, dilation)
    rows = input.dim() - 1  # the length dim: height 1 goes before it
    y = conv2d(input.unsqueeze(rows), weight.unsqueeze(2), bias, stride, padding, dilation, groups, activation,
               None if residual is None else residual.unsqueeze(residual.dim() - 1))
    return y.squeeze(rows)
