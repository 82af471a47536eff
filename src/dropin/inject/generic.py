"""Handlers for torch.nn layers: Linear (+ activation), Conv2d (+ BatchNorm2d) (+ activation), Conv1d (+ activation;
conv2d's kernels), GroupNorm (+ activation), and the layers that are one functional op: BatchNorm2d (not folded:
training mode, or not after a conv), the activations (ReLU, ReLU6 and Hardtanh(0, 6), GELU, SiLU, Hardswish,
Hardsigmoid, Sigmoid, LeakyReLU(0.01), Tanh, Mish, ELU(alpha=1), SELU, CELU(alpha=1), Softplus(beta=1, threshold=20);
inplace=True too, whose result they return without writing their input; the others, and other parameters, are named
with the reason they stay torch), max / average / adaptive average pooling (1-D too), LayerNorm, Softmax and LogSoftmax.
Subclasses that keep their base's forward (or make its one functional call alone: `registry.computes_as`) are
handled as the base.

Fusions take the siblings that run next on a module's output alone: in an nn.Sequential, a declared chain, or a
chain that tracing the parent's forward finds (see Site.following).
"""
import functools
from typing import Callable, Optional

from torch import nn

from .. import nn as dnn
from .. import ops
from ..ops.activations import ACTIVATIONS
from .registry import computes_as, fusion_roles, passive, register

passive(nn.Identity, nn.Flatten, nn.Unflatten, dnn.Derived)
passive(nn.Sequential, when=lambda m: len(m) == 0)  # (the identity: ShuffleNetV2's stride-1 branch1)
passive(nn.ModuleList, nn.ModuleDict, when=lambda m: len(m) == 0)  # (no layers to run: HF ConvNeXt's first stage's
# downsampling layers)
passive(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
        when=lambda m: not m.training or m.p == 0)

_ACTIVATIONS = {  # module type -> fn(module) -> the dropin activation it computes, or None
    nn.ReLU: lambda m: "relu",
    nn.SiLU: lambda m: "silu",
    nn.GELU: lambda m: {"none": "gelu", "tanh": "gelu_tanh"}.get(m.approximate),
    nn.Hardtanh: lambda m: "relu6" if (m.min_val, m.max_val) == (0.0, 6.0) else None,  # nn.ReLU6 too
    nn.Hardswish: lambda m: "hardswish",
    nn.Hardsigmoid: lambda m: "hardsigmoid",
    nn.Sigmoid: lambda m: "sigmoid",
    nn.LeakyReLU: lambda m: "leaky_relu" if m.negative_slope == 0.01 else None,  # (the kernels' slope)
    nn.Tanh: lambda m: "tanh",
    nn.Mish: lambda m: "mish",
    nn.ELU: lambda m: "elu" if m.alpha == 1.0 else None,  # (the kernels' parameters, torch's defaults)
    nn.SELU: lambda m: "selu",
    nn.CELU: lambda m: "celu" if m.alpha == 1.0 else None,
    nn.Softplus: lambda m: "softplus" if (m.beta, m.threshold) == (1.0, 20.0) else None,
}
_NO_KERNEL = (nn.PReLU,)
fusion_roles(heads=(nn.Linear, nn.Conv2d, nn.Conv1d, nn.GroupNorm), followers=(nn.BatchNorm2d, *_ACTIVATIONS))


def activation_name(module: nn.Module) -> Optional[str]:
    """The dropin activation name computed by `module` (an activation module or a subclass that keeps its
    forward), or None."""
    base = next((t for t in type(module).__mro__ if t in _ACTIVATIONS), None)
    return _ACTIVATIONS[base](module) if base is not None and computes_as(module, base) else None


def fused_activation(following: list, config) -> tuple:
    """(activation, (its name,)) for the first of `following` where it is a fusable activation; (None, ())."""
    if config.fusions and following:
        name, module = following[0]
        act = activation_name(module)
        if act is not None:
            return act, (name,)
    return None, ()


def conv_reason(conv: nn.Module) -> Optional[str]:
    if not computes_as(conv, nn.Conv2d):
        return f"{type(conv).__name__} does not compute as an nn.Conv2d"
    if conv.padding_mode != "zeros":
        return f"padding_mode '{conv.padding_mode}': dropin conv2d pads with zeros only"
    return None


def convnext_reason(conv: nn.Module, fc1: nn.Module, act: nn.Module, fc2: nn.Module, config) -> Optional[str]:
    """Why a ConvNeXt block of these layers (its LayerNorm checked by the caller) does not run as
    nn.ConvNeXtBlock, or None."""
    if not config.fusions:
        return "fusions are off in the config"
    if not (computes_as(fc1, nn.Linear) and computes_as(fc2, nn.Linear)):
        return "its MLP's layers do not compute as nn.Linear"
    reason = conv_reason(conv) or sparse_layers_reason([conv, fc1, fc2], config, "a layer", "sparse kernels, unfused")
    if reason:
        return reason
    return None if activation_name(act) is not None else f"its activation {type(act).__name__} has no dropin kernel"


def fold_reason(bn: nn.Module, conv: Optional[nn.Module] = None) -> Optional[str]:
    """Why `bn` cannot fold into `conv` now, or None."""
    if not computes_as(bn, nn.BatchNorm2d):
        return f"{type(bn).__name__} does not compute as an nn.BatchNorm2d"
    if bn.training:
        return "training mode: BatchNorm normalizes with batch statistics, which do not fold into a conv"
    if bn.running_mean is None or bn.running_var is None:
        return "no running statistics (track_running_stats=False): batch statistics do not fold into a conv"
    if conv is not None and conv.out_channels != bn.num_features:
        return f"{bn.num_features} features after a conv of {conv.out_channels} channels"
    return None


def _sparse_or_pruned(module: nn.Module, site, sparsified: type) -> tuple:
    """(the sparse drop-in where the config's threshold asks for it and the weight is frozen, or the reason a
    torch.nn.utils.prune'd module stays torch, or None; the note for a dense drop-in's description: the
    sparsity and why it stays dense, "" without a threshold)."""
    threshold, note = site.config.sparse_threshold, ""
    if threshold is not None:
        sparsity = dnn.sparse.weight_sparsity(module)
        if sparsity >= threshold and not dnn.sparse.trains_weight(module):
            return sparsified(module), ""
        why = dnn.sparse.NO_WEIGHT_GRAD if sparsity >= threshold else f"under the {threshold:.1%} threshold"
        note = f" ({sparsity:.1%} zeros, dense: {why})"
    if dnn.sparse.pruned(module):
        return ("pruned by torch.nn.utils.prune (a forward pre-hook masks its weight): only the sparse path "
                "(InjectConfig.sparse) applies the mask" + note), note
    return None, note


def sparse_layers_reason(layers: list, config, what: str, kernel: str) -> Optional[str]:
    """Why a fusing handler leaves these layers of its module to their own handlers (the sparse kernels, or the
    reason a pruned layer stays torch), or None."""
    threshold = config.sparse_threshold
    if threshold is not None and any(dnn.sparse.weight_sparsity(m) >= threshold for m in layers):
        return f"{what} has at least {threshold:.1%} zeros ({kernel})"
    if any(dnn.sparse.pruned(m) for m in layers):
        return f"{what} is pruned by torch.nn.utils.prune (only the sparse path applies the mask)"
    return None


@register(nn.Linear, op="linear")
def linear(module: nn.Linear, site):
    """Sparse kernels where the config's threshold asks for them and the weight is frozen, else dense (with the
    sparsity and the reason in the kernel's description when the config has a threshold)."""
    if computes_as(site.parent, nn.MultiheadAttention):
        return ("nn.MultiheadAttention's forward reads this projection's weight and bias itself "
                "(F.multi_head_attention_forward): it never calls the module")
    done, note = _sparse_or_pruned(module, site, dnn.SparsifiedLinear)
    if done is not None:
        return done
    act, absorbs = fused_activation(site.following(), site.config)
    new = dnn.Linear(module, act, absorbs)
    new.kernel += note
    return new


@register(nn.Conv2d, op="conv2d")
def conv2d(module: nn.Conv2d, site):
    """As linear: sparse (unfused: a following BatchNorm and activation run as their own kernels) where the
    config asks for it, else dense with the BatchNorm folded and the activation fused when they follow."""
    reason = conv_reason(module)
    if reason:
        return reason
    done, note = _sparse_or_pruned(module, site, dnn.SparsifiedConv2d)
    if done is not None:
        return done
    following = site.following() if site.config.fusions else []
    if following and fold_reason(following[0][1], module) is None:
        (bn_name, bn), following = following[0], following[1:]
        act, absorbs = fused_activation(following, site.config)
        new = dnn.ConvBNAct(module, bn, act, (bn_name, *absorbs))
    else:
        act, absorbs = fused_activation(following, site.config)
        new = dnn.Conv2d(module, act, absorbs)
    new.kernel += note
    return new


@register(nn.Conv1d, op="conv1d")
def conv1d(module: nn.Conv1d, site):
    """Any padding mode ('reflect', 'replicate', 'circular': F.pad first, in torch), a following activation fused."""
    act, absorbs = fused_activation(site.following(), site.config)
    return dnn.Conv1d(module, act, absorbs)


@register(nn.GroupNorm, op="group_norm")
def group_norm(module: nn.GroupNorm, site):
    act, absorbs = fused_activation(site.following(), site.config)
    return dnn.GroupNorm(module, act, absorbs)


def _batch_norm(m, x):
    """nn.BatchNorm2d's forward (running-statistics update, momentum None = cumulative average) on dropin's op. The
    tensors are read from the original's dicts (each nn.Module.__getattr__ costs ~1 us of host time a call)."""
    bn = m.original
    if x.dim() != 4:
        raise ValueError(f"expected 4D input (got {x.dim()}D input)")
    buffers, parameters = bn._buffers, bn._parameters
    running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
    batches = buffers.get("num_batches_tracked")
    momentum = bn.momentum or 0.0
    if bn.training and bn.track_running_stats and batches is not None:
        batches.add_(1)
        momentum = bn.momentum if bn.momentum is not None else 1.0 / float(batches)
    training = bn.training or running_mean is None and running_var is None
    stats = not bn.training or bn.track_running_stats
    return ops.batch_norm(x, running_mean if stats else None, running_var if stats else None, parameters.get("weight"),
                          parameters.get("bias"), training, momentum, bn.eps)


# The functions an Op runs (module level, so that a whole injected model pickles: torch.save(model)). They read the
# original's attributes (`m.original`: nn.Module's own lookups, which torch.compile reads without tracing them).
def _activation_op(m, x, name: str):
    return ops.activation(x, name)


def _max_pool2d(m, x):
    o = m.original
    return ops.max_pool2d(x, o.kernel_size, o.stride, o.padding, o.dilation, o.ceil_mode)


def _avg_pool2d(m, x):
    o = m.original
    return ops.avg_pool2d(x, o.kernel_size, o.stride, o.padding, o.ceil_mode, o.count_include_pad, o.divisor_override)


def _adaptive_avg_pool2d(m, x):
    return ops.adaptive_avg_pool2d(x, m.original.output_size)


def _adaptive_avg_pool1d(m, x):  # ([N, C, L] or [C, L] as an image of one row)
    size = m.original.output_size
    return ops.adaptive_avg_pool2d(x.unsqueeze(-2), (1, size[0] if isinstance(size, tuple) else size)).squeeze(-2)


def _layer_norm(m, x):
    o = m.original
    parameters = o._parameters  # (as `_batch_norm`'s)
    return ops.layer_norm(x, o.normalized_shape, parameters.get("weight"), parameters.get("bias"), o.eps)


def _layer_norm_channels_first(m, x):
    return _layer_norm(m, x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def channels_first_layer_norm(module: nn.LayerNorm) -> dnn.Op:
    """The drop-in of a LayerNorm subclass whose forward normalizes dim 1 of [N, C, H, W] by permuting it last and
    back (torchvision's LayerNorm2d, HF ConvNeXt's channels_first LayerNorm)."""
    return dnn.Op(module, "layer_norm (channels first)", _layer_norm_channels_first)


@register(nn.BatchNorm2d, op="batch_norm")
def batch_norm2d(module: nn.BatchNorm2d, site):
    return dnn.Op(module, "batch_norm", _batch_norm)


@register(*_ACTIVATIONS, op="activation")
def activation(module: nn.Module, site):
    name = activation_name(module)
    if name is None:
        return f"{module}: dropin's activations are {', '.join(ACTIVATIONS)}"
    return dnn.Op(module, name, functools.partial(_activation_op, name=name))


def activation_module(kind: type, name_of: Callable) -> None:
    """Registers another library's activation module type: name_of(module) is the dropin activation it computes (or
    None); it runs as dropin's activation op and fuses into a preceding conv / linear as torch's activations do."""
    _ACTIVATIONS[kind] = name_of
    fusion_roles(followers=(kind,))
    register(kind, op="activation")(activation)


@register(*_NO_KERNEL, op=None)
def activation_without_kernel(module: nn.Module, site):
    return f"dropin has no {type(module).__name__} kernel (its activations: {', '.join(ACTIVATIONS)})"


@register(nn.MaxPool2d, op="max_pool2d")
def max_pool2d(module: nn.MaxPool2d, site):
    if module.return_indices:
        return "return_indices=True: dropin max_pool2d returns no indices"
    return dnn.Op(module, "max_pool2d", _max_pool2d)


@register(nn.AvgPool2d, op="avg_pool2d")
def avg_pool2d(module: nn.AvgPool2d, site):
    return dnn.Op(module, "avg_pool2d", _avg_pool2d)


@register(nn.AdaptiveAvgPool2d, op="adaptive_avg_pool2d")
def adaptive_avg_pool2d(module: nn.AdaptiveAvgPool2d, site):
    return dnn.Op(module, "adaptive_avg_pool2d", _adaptive_avg_pool2d)


@register(nn.AdaptiveAvgPool1d, op="adaptive_avg_pool2d")
def adaptive_avg_pool1d(module: nn.AdaptiveAvgPool1d, site):
    return dnn.Op(module, "adaptive_avg_pool2d (one row)", _adaptive_avg_pool1d)


@register(nn.LayerNorm, op="layer_norm")
def layer_norm(module: nn.LayerNorm, site):
    return dnn.Op(module, "layer_norm", _layer_norm)


def _softmax(m, x, fn):
    return fn(x, m.original.dim)


@register(nn.Softmax, nn.LogSoftmax, op="softmax")
def softmax(module: nn.Module, site):
    if module.dim is None:
        return "dim=None: torch picks the dim from the input's rank (deprecated); dropin's softmax takes a dim"
    name = "log_softmax" if isinstance(module, nn.LogSoftmax) else "softmax"
    return dnn.Op(module, name, functools.partial(_softmax, fn=getattr(ops, name)))
