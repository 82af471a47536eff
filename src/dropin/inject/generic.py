"""Handlers for torch.nn layers: Linear (+ activation), Conv2d (+ BatchNorm2d) (+ activation).

Fusions take the siblings that follow in an nn.Sequential (see Site.following). The BatchNorm and standalone
activation handlers only say why those modules stay torch (no dropin batch_norm or standalone activation op
yet; their handlers replace these when the ops land).
"""
from typing import Optional

from torch import nn

from .. import nn as dnn
from .registry import passive, register

passive(nn.Identity, nn.Flatten, nn.Unflatten)
passive(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
        when=lambda m: not m.training or m.p == 0)

_ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu"}
_FUSED_ONLY = ("fused only right after a Linear or Conv2d in an nn.Sequential, with fusions on")


def activation_name(module: nn.Module) -> Optional[str]:
    """The dropin activation name computed by `module`, or None."""
    if type(module) is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}[module.approximate]
    return _ACTIVATIONS.get(type(module))


def _activation(following: list, config) -> tuple:
    """(activation, (its name,)) for the first of `following` where it is a fusable activation; (None, ())."""
    if config.fusions and following:
        name, module = following[0]
        act = activation_name(module)
        if act is not None:
            return act, (name,)
    return None, ()


def conv_reason(conv: nn.Module) -> Optional[str]:
    if type(conv) is not nn.Conv2d:
        return f"{type(conv).__name__} is not an nn.Conv2d"
    if conv.padding_mode != "zeros":
        return f"padding_mode '{conv.padding_mode}': dropin conv2d pads with zeros only"
    return None


def fold_reason(bn: nn.Module, conv: Optional[nn.Module] = None) -> Optional[str]:
    """Why `bn` cannot fold into `conv` now, or None."""
    if type(bn) is not nn.BatchNorm2d:
        return f"{type(bn).__name__} is not an nn.BatchNorm2d"
    if bn.training:
        return "training mode: BatchNorm normalizes with batch statistics, which do not fold into a conv"
    if bn.running_mean is None or bn.running_var is None:
        return "no running statistics (track_running_stats=False): batch statistics do not fold into a conv"
    if conv is not None and conv.out_channels != bn.num_features:
        return f"{bn.num_features} features after a conv of {conv.out_channels} channels"
    return None


@register(nn.Linear, op="linear")
def linear(module: nn.Linear, site):
    act, absorbs = _activation(site.following(), site.config)
    return dnn.Linear(module, act, absorbs)


@register(nn.Conv2d, op="conv2d")
def conv2d(module: nn.Conv2d, site):
    reason = conv_reason(module)
    if reason:
        return reason
    following = site.following() if site.config.fusions else []
    if following and fold_reason(following[0][1], module) is None:
        (bn_name, bn), following = following[0], following[1:]
        act, absorbs = _activation(following, site.config)
        return dnn.ConvBNAct(module, bn, act, (bn_name, *absorbs))
    act, absorbs = _activation(following, site.config)
    return dnn.Conv2d(module, act, absorbs)


@register(nn.BatchNorm2d, op=None)
def batch_norm2d(module: nn.BatchNorm2d, site):
    why = fold_reason(module) or "not folded into a conv (only right after a dropin Conv2d in an nn.Sequential)"
    return f"{why}; no standalone dropin batch_norm kernel yet"


@register(nn.ReLU, nn.GELU, nn.SiLU, op=None)
def activation(module: nn.Module, site):
    return f"no standalone dropin {activation_name(module)} kernel yet ({_FUSED_ONLY})"
