"""Drop-in for a ConvNeXt block (torchvision's CNBlock, HF's ConvNextLayer, timm's ConvNeXtBlock): its depthwise
conv, LayerNorm, MLP, layer scale and residual as dropin calls on the block's own tensors, without its module
calls."""
from typing import Optional

import torch

from ..ops import conv2d, layer_norm, linear
from .module import DropinModule


class ConvNeXtBlock(DropinModule):
    """`x + drop_path(scale * fc2(act(fc1(norm(conv(x) to channels last)))) back to channels first)` for a ConvNeXt
    block whose layers are the depthwise Conv2d `conv`, the channels-last LayerNorm `norm` and the Linears `fc1` and
    `fc2` (their paths in the block), `scale` the name of its layer-scale parameter ([C, 1, 1] or [C]; none: 1),
    `drop` its stochastic depth module's: dropin conv2d, layer_norm, linear + the activation in one kernel, linear,
    then the layer scale and the residual as one torch addcmul (one rounding: the originals round the scaled branch
    first). In training the block's own stochastic depth module runs on the scaled branch (its random draws as the
    original's), then the add. The block's children stay registered under their names (state_dict keys are the
    block's) and are not injected: the forward reads their tensors."""

    kernel = "conv2d (depthwise) + layer_norm + linear+activation + linear + addcmul (layer scale, residual)"

    def __init__(self, original: torch.nn.Module, conv: str, norm: str, fc1: str, fc2: str, activation: str,
                 scale: Optional[str], drop: str):
        super().__init__(original)
        self._adopt_children()
        for name, path in (("conv", conv), ("norm", norm), ("fc1", fc1), ("fc2", fc2), ("drop", drop)):
            object.__setattr__(self, name, original.get_submodule(path))  # (plain attributes: not submodules)
        self.scale, self.activation = scale, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, norm, fc1, fc2 = self.conv, self.norm, self.fc1, self.fc2
        y = conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        y = layer_norm(y.permute(0, 2, 3, 1), norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        y = linear(linear(y, fc1.weight, fc1.bias, self.activation), fc2.weight, fc2.bias).permute(0, 3, 1, 2)
        scale = self._parameters.get(self.scale) if self.scale else None
        if scale is not None:
            scale = scale.view(-1, 1, 1)
        if self.training and not isinstance(self.drop, torch.nn.Identity):
            return self.drop(y if scale is None else scale * y) + x
        return x + y if scale is None else torch.addcmul(x, scale, y)
