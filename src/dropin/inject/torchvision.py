"""Handlers for torchvision models: ResNet's BasicBlock and Bottleneck -> nn.ResidualBlock (eval mode); ResNet's
stem conv1 -> bn1 -> relu declared a chain, so the generic Conv2d handler fuses it; Swin's shifted-window attention
(functional code on its children's weights) -> nn.WindowAttention (one dropin attention a window); ConvNeXt's
block -> nn.ConvNeXtBlock (its ops on the block's tensors), its LayerNorm2d (channels first) -> dropin layer_norm;
MaxViT's relative positional attention -> nn.MaxVitAttention; torchvision's Permute and MaxViT's SwapAxes and window
(de)partitions (views and copies) are passive."""
from typing import Optional

from torch import nn

from .. import nn as dnn
from .generic import (activation_name, channels_first_layer_norm, conv_reason, convnext_reason, fold_reason,
                      sparse_layers_reason)
from .registry import chain, computes_as, passive, register


def _block_reason(block: nn.Module, pairs: list, config):
    if not config.fusions:
        return "fusions are off in the config"
    if activation_name(block.relu) != "relu":
        return f"its activation is {type(block.relu).__name__}, not nn.ReLU"
    convs = [(getattr(block, conv), getattr(block, bn)) for conv, bn in pairs]
    shortcut = block.downsample
    if shortcut is not None:
        if type(shortcut) is not nn.Sequential or len(shortcut) != 2:
            return "its downsample is not an nn.Sequential(conv, bn)"
        convs.append((shortcut[0], shortcut[1]))
    for conv, bn in convs:
        reason = conv_reason(conv) or fold_reason(bn, conv)
        if reason:
            return reason
    return sparse_layers_reason([conv for conv, _ in convs], config, "a conv", "sparse_conv2d, unfused")


def _convnext_reason(block: nn.Module, config) -> Optional[str]:
    """Why torchvision's CNBlock does not run as nn.ConvNeXtBlock (its block must be the layers it builds), or
    None."""
    layers = list(block.block)
    kinds = (nn.Conv2d, Permute, nn.LayerNorm, nn.Linear, nn.GELU, nn.Linear, Permute)
    if len(layers) != len(kinds) or not all(computes_as(m, kind) if kind is not Permute else type(m) is Permute
                                            for m, kind in zip(layers, kinds)):
        return "its block is not (Conv2d, Permute, LayerNorm, Linear, GELU, Linear, Permute)"
    conv, first, _, fc1, act, fc2, last = layers
    if list(first.dims) != [0, 2, 3, 1] or list(last.dims) != [0, 3, 1, 2]:
        return "its permutes are not to channels last and back"
    return convnext_reason(conv, fc1, act, fc2, config)


try:
    from torchvision.models.convnext import CNBlock, LayerNorm2d
    from torchvision.models.maxvit import (RelativePositionalMultiHeadAttention, SwapAxes, WindowDepartition,
                                           WindowPartition)
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet
    from torchvision.models.swin_transformer import ShiftedWindowAttention, ShiftedWindowAttentionV2
    from torchvision.ops.misc import Permute
except ImportError:  # torchvision is optional: no handlers without it
    pass
else:
    chain(ResNet, "conv1", "bn1", "relu")
    passive(Permute, SwapAxes, WindowPartition, WindowDepartition)  # (views and copies: Swin's, ConvNeXt's and
    # MaxViT's layout changes)
    _PAIRS = {BasicBlock: [("conv1", "bn1"), ("conv2", "bn2")],
              Bottleneck: [("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3")]}

    @register(BasicBlock, Bottleneck, op="conv2d")
    def resnet_block(block: nn.Module, site):
        pairs = _PAIRS[type(block)]
        reason = _block_reason(block, pairs, site.config)
        if reason:
            return f"{reason}: not fused as a block; its modules are injected one by one"
        return dnn.ResidualBlock(block, pairs, "downsample" if block.downsample is not None else None)

    @register(ShiftedWindowAttention, ShiftedWindowAttentionV2, op="attention")
    def swin_attention(module: nn.Module, site):
        return dnn.WindowAttention(module)

    @register(RelativePositionalMultiHeadAttention, op="attention")
    def maxvit_attention(module: nn.Module, site):
        if type(module).forward is not RelativePositionalMultiHeadAttention.forward:
            return f"{type(module).__name__} has a forward of its own: its linears are injected one by one"
        return dnn.MaxVitAttention(module)

    @register(CNBlock, op="conv2d")
    def convnext_block(block: nn.Module, site):
        reason = _convnext_reason(block, site.config)
        if reason:
            return f"{reason}: not fused as a block; its modules are injected one by one"
        return dnn.ConvNeXtBlock(block, "block.0", "block.2", "block.3", "block.5", activation_name(block.block[4]),
                                 "layer_scale", "stochastic_depth")

    @register(LayerNorm2d, op="layer_norm")
    def layer_norm_2d(module: nn.LayerNorm, site):
        return channels_first_layer_norm(module)
