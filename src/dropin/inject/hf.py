"""Handlers for the HF modules that many families share: transformers.activations' activation modules, mapped to
dropin's activations by what each forward computes (GELUActivation, GELUTanh / PytorchGELUTanh, NewGELUActivation,
FastGELUActivation, AccurateGELUActivation, SiLUActivation, MishActivation); those without a dropin kernel
(QuickGELUActivation, ...) are named with the reason, and LinearActivation (the identity) is passive; ConvNeXt's (and
ConvNeXt V2's) LayerNorm, channels last or first, runs dropin's layer_norm; ConvNeXt's block (ConvNextLayer) runs as
nn.ConvNeXtBlock."""
import functools
import importlib

import torch.nn.functional as F

from .. import nn as dnn
from .generic import (activation_module, activation_name, activation_without_kernel, channels_first_layer_norm,
                      convnext_reason, layer_norm)
from .registry import passive, register, when_imported

_TANH_FORMULAS = ("NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation")  # 0.5 x (1 + tanh(...))
_WITHOUT_KERNEL = ("QuickGELUActivation", "ClippedGELUActivation", "LaplaceActivation", "ReLUSquaredActivation",
                   "SqrtSoftplusActivation", "XIELUActivation")


def _own_forward(name_of):
    """name_of, or None for a module whose forward is replaced on the instance (kernels' kernelize)."""
    return lambda m: None if "forward" in vars(m) else name_of(m)


def _calls_method(act, method) -> bool:
    return getattr(act, "__func__", None) is method


@when_imported("transformers.activations")
def _register():
    from transformers import activations as hf

    def gelu(m):  # its forward calls self.act: F.gelu, or the erf formula in Python
        return "gelu" if m.act is F.gelu or _calls_method(m.act, hf.GELUActivation._gelu_python) else None

    def gelu_tanh(m):  # self.act: F.gelu(approximate="tanh"), or the tanh formula in Python
        act = m.act
        torch_tanh = (isinstance(act, functools.partial) and act.func is F.gelu and not act.args
                      and act.keywords == {"approximate": "tanh"})
        return "gelu_tanh" if torch_tanh or _calls_method(act, hf.GELUTanh._gelu_tanh_python) else None

    def mish(m):  # self.act: F.mish, or x * tanh(F.softplus(x)) in Python (older torch)
        return "mish" if m.act is F.mish or _calls_method(m.act, hf.MishActivation._mish_python) else None

    name_of = {"GELUActivation": gelu, "GELUTanh": gelu_tanh, "SiLUActivation": lambda m: "silu",
               "MishActivation": mish, **{n: lambda m: "gelu_tanh" for n in _TANH_FORMULAS}}
    gelu_tanh_class = getattr(hf, "GELUTanh", None)
    if getattr(hf, "PytorchGELUTanh", gelu_tanh_class) is not gelu_tanh_class:
        name_of["PytorchGELUTanh"] = lambda m: "gelu_tanh"  # older transformers: F.gelu(approximate="tanh") itself
    for name, fn in name_of.items():
        if hasattr(hf, name):
            activation_module(getattr(hf, name), _own_forward(fn))
    register(*(getattr(hf, n) for n in _WITHOUT_KERNEL if hasattr(hf, n)), op=None)(activation_without_kernel)
    passive(hf.LinearActivation)


def _convnext_layer_norm(module, site):
    return channels_first_layer_norm(module) if module.data_format == "channels_first" else layer_norm(module, site)


def _register_convnext(module_name: str, class_name: str) -> None:
    register(getattr(importlib.import_module(module_name), class_name), op="layer_norm")(_convnext_layer_norm)


for _module_name, _class_name in (("transformers.models.convnext.modeling_convnext", "ConvNextLayerNorm"),
                                  ("transformers.models.convnextv2.modeling_convnextv2", "ConvNextV2LayerNorm")):
    when_imported(_module_name)(functools.partial(_register_convnext, _module_name, _class_name))


@when_imported("transformers.models.convnext.modeling_convnext")
def _register_convnext_layer():
    from transformers.models.convnext import modeling_convnext as hf

    def reason(block, config):
        if type(block).forward is not hf.ConvNextLayer.forward:
            return f"{type(block).__name__} has a forward of its own"
        norm = block.layernorm
        if type(norm) is not hf.ConvNextLayerNorm or norm.data_format != "channels_last":
            return "its LayerNorm is not a channels-last ConvNextLayerNorm"
        return convnext_reason(block.dwconv, block.pwconv1, block.act, block.pwconv2, config)

    @register(hf.ConvNextLayer, op="conv2d")
    def convnext_layer(block, site):
        why = reason(block, site.config)
        if why:
            return f"{why}: not fused as a block; its modules are injected one by one"
        scale = "layer_scale_parameter" if block.layer_scale_parameter is not None else None
        return dnn.ConvNeXtBlock(block, "dwconv", "layernorm", "pwconv1", "pwconv2", activation_name(block.act), scale,
                                 "drop_path")
