"""Handlers for the HF modules that many families share: transformers.activations' activation modules, mapped to
dropin's activations by what each forward computes (GELUActivation, GELUTanh / PytorchGELUTanh, NewGELUActivation,
FastGELUActivation, AccurateGELUActivation, SiLUActivation, MishActivation); those without a dropin kernel
(QuickGELUActivation, ...) are named with the reason, and LinearActivation (the identity) is passive; ConvNeXt's (and
ConvNeXt V2's) LayerNorm, channels last or first, runs dropin's layer_norm."""
import functools
import importlib

import torch.nn.functional as F

from .generic import activation_module, activation_without_kernel, channels_first_layer_norm, layer_norm
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
