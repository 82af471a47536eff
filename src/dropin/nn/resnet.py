"""Drop-in for a ResNet residual block (the torchvision BasicBlock / Bottleneck layout)."""
import torch

from .conv import ConvBNAct
from .module import DropinModule, Folded


class ResidualBlock(DropinModule):
    """`relu(bn_k(conv_k(... relu(bn_1(conv_1(x))))) + shortcut(x))` as k fused conv kernels (ConvBNAct), the last
    one adding the shortcut and applying the ReLU in its epilogue; the shortcut is x or a conv + BatchNorm.

    `pairs`: the (conv, bn) child names of `original` in order; `downsample`: the name of its nn.Sequential
    (conv, bn) shortcut or None. The children keep their names (state_dict keys are the block's): each conv
    becomes a ConvBNAct, each bn stays the original module (it runs only in training mode, through ConvBNAct),
    the downsample becomes Sequential(ConvBNAct, Folded bn).
    """

    def __init__(self, original: torch.nn.Module, pairs: list, downsample=None):
        super().__init__(original)
        children = dict(original.named_children())
        for conv, bn in pairs:
            children[conv] = ConvBNAct(children[conv], children[bn], "relu")
        if downsample is not None:
            conv, bn = children[downsample]
            children[downsample] = torch.nn.Sequential(ConvBNAct(conv, bn, absorbs=("1",)),
                                                       Folded(bn, into=f"{downsample}.0"))
        for name, child in children.items():
            self.add_module(name, child)
        self.chain = [name for name, _ in pairs]
        self.shortcut = downsample
        self.kernel = f"{len(pairs)} x conv2d+bn+relu (the last + residual)" + (
            ", shortcut conv2d+bn" if downsample else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        children = self._modules  # (not getattr: see DropinModule._weight_bias)
        shortcut = x if self.shortcut is None else children[self.shortcut](x)
        for name in self.chain[:-1]:
            x = children[name](x)
        return children[self.chain[-1]](x, residual=shortcut)
