"""Handlers for timm models beyond the generic ones: its GELU and GELUTanh modules (F.gelu's two forms) as dropin's
activations, fused into a preceding conv or linear; its LayerNorm2d (channels first) as dropin layer_norm where
timm's fast norm is off (its default); ConvNeXt's block (ConvNeXtBlock with its MLP of linears and a channels-last
LayerNorm) -> nn.ConvNeXtBlock; its FastAdaptiveAvgPool (NCHW or NHWC) -> dropin adaptive_avg_pool2d; its attention
(timm.layers.Attention: ViT's, DeiT's) and the Swin transformer's WindowAttention -> dropin attention between their
injected linears (nn.timm_attention), where their forward is the code dropin follows."""
from typing import Optional

from torch import nn

from .. import nn as dnn
from .. import ops
from .generic import activation_module, activation_name, channels_first_layer_norm, convnext_reason
from .registry import computes_as, register, unfollowed, when_imported


def _attention_reason(module: nn.Module, reference: type, parameters: set, reads: tuple) -> Optional[str]:
    """Why a timm attention module stays torch (its forward is not `reference`'s, or a timm version whose forward
    takes other arguments or lacks what dropin reads), or None."""
    if type(module).forward is not reference.forward:
        return f"{type(module).__name__} has a forward of its own: its linears are injected one by one"
    why = unfollowed(module, parameters, reads, "timm 1.0")
    return why and f"{why}: its linears are injected one by one"


@when_imported("timm.layers")
def _register_layers():
    from timm.layers import activations, norm

    activation_module(activations.GELU, lambda m: "gelu" if "forward" not in vars(m) else None)
    activation_module(activations.GELUTanh, lambda m: "gelu_tanh" if "forward" not in vars(m) else None)

    @register(norm.LayerNorm2d, op="layer_norm")
    def layer_norm_2d(module, site):
        if module._fast_norm:
            return "timm's fast norm is on (its own kernels): left to torch"
        return channels_first_layer_norm(module)


def _fast_adaptive_avg_pool(m, x):
    """timm's FastAdaptiveAvgPool: the mean over H and W of NCHW or NHWC (pooled as its NCHW view), kept as 1 x 1
    in the input's format or flattened."""
    nhwc = tuple(m.original.dim) == (1, 2)
    y = ops.adaptive_avg_pool2d(x.permute(0, 3, 1, 2) if nhwc else x, 1)
    return y.flatten(1) if m.original.flatten else y.permute(0, 2, 3, 1) if nhwc else y


@when_imported("timm.layers")
def _register_pool():
    from timm.layers.adaptive_avgmax_pool import FastAdaptiveAvgPool

    @register(FastAdaptiveAvgPool, op="adaptive_avg_pool2d")
    def fast_adaptive_avg_pool(module, site):
        if tuple(module.dim) not in ((2, 3), (1, 2)):
            return f"input format with spatial dims {tuple(module.dim)}: dropin pools NCHW's and NHWC's"
        return dnn.Op(module, "adaptive_avg_pool2d", _fast_adaptive_avg_pool)


@when_imported("timm.layers")
def _register_attention():
    from timm.layers import Attention

    @register(Attention, op="attention")
    def attention(module, site):
        reads = ("qkv", "q_norm", "k_norm", "attn_drop", "proj", "proj_drop", "num_heads", "head_dim", "scale")
        return (_attention_reason(module, Attention, {"self", "x", "attn_mask", "is_causal"}, reads)
                or dnn.timm_attention.TimmAttention(module))


@when_imported("timm.models.swin_transformer")
def _register_window_attention():
    from timm.models.swin_transformer import WindowAttention

    @register(WindowAttention, op="attention")
    def window_attention(module, site):
        reads = ("qkv", "attn_drop", "proj", "proj_drop", "num_heads", "scale", "_get_rel_pos_bias")
        return (_attention_reason(module, WindowAttention, {"self", "x", "mask"}, reads)
                or dnn.timm_attention.TimmWindowAttention(module))


@when_imported("timm.models.convnext")
def _register_convnext_block():
    from timm.layers import Mlp
    from timm.models.convnext import ConvNeXtBlock

    def reason(block, config):
        if type(block).forward is not ConvNeXtBlock.forward:
            return f"{type(block).__name__} has a forward of its own"
        mlp = block.mlp
        if block.use_conv_mlp or type(mlp).forward is not Mlp.forward:
            return "its MLP is not timm's Mlp of linears"
        if not isinstance(block.shortcut, nn.Identity):
            return "its shortcut is not the identity"
        if not (isinstance(mlp.norm, nn.Identity) and mlp.drop1.p == 0 and mlp.drop2.p == 0):
            return "its MLP normalizes or drops its hidden units"
        if not computes_as(block.norm, nn.LayerNorm):
            return f"its norm {type(block.norm).__name__} does not compute as an nn.LayerNorm"
        return convnext_reason(block.conv_dw, mlp.fc1, mlp.act, mlp.fc2, config)

    @register(ConvNeXtBlock, op="conv2d")
    def convnext_block(block, site):
        why = reason(block, site.config)
        if why:
            return f"{why}: not fused as a block; its modules are injected one by one"
        return dnn.ConvNeXtBlock(block, "conv_dw", "norm", "mlp.fc1", "mlp.fc2", activation_name(block.mlp.act),
                                 "gamma" if block.gamma is not None else None, "drop_path")
