"""Drop-in for torchvision's ConvNeXt block (CNBlock): its depthwise conv, LayerNorm, MLP, layer scale and residual
as dropin calls on the block's own tensors, without its nine module calls."""
import torch

from ..ops import conv2d, layer_norm, linear
from .module import DropinModule


class ConvNeXtBlock(DropinModule):
    """`x + layer_scale * block(x)` for torchvision's CNBlock, whose block is (depthwise Conv2d, Permute to channels
    last, LayerNorm, Linear, GELU, Linear, Permute back): dropin conv2d, layer_norm, linear + the activation in one
    kernel, linear, then the layer scale and the residual as one torch addcmul (one rounding: the original rounds
    the scaled branch first). In training with a stochastic depth probability, torchvision's stochastic depth on
    the scaled branch, then the add. The block's children stay registered under their names (state_dict keys are
    the block's) and are not injected: the forward reads their tensors."""

    kernel = "conv2d (depthwise) + layer_norm + linear+activation + linear + addcmul (layer scale, residual)"

    def __init__(self, original: torch.nn.Module, activation: str):
        super().__init__(original)
        self._adopt_children()
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, _, norm, fc1, _, fc2, _ = self._modules["block"]
        y = conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        y = layer_norm(y.permute(0, 2, 3, 1), norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        y = linear(linear(y, fc1.weight, fc1.bias, self.activation), fc2.weight, fc2.bias).permute(0, 3, 1, 2)
        scale, depth = self._parameters["layer_scale"], self._modules["stochastic_depth"]
        if self.training and depth.p > 0:
            from torchvision.ops import stochastic_depth  # (the block is torchvision's: it is installed)
            return stochastic_depth(scale * y, depth.p, depth.mode, True) + x
        return torch.addcmul(x, scale, y)
