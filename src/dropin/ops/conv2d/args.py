"""conv2d's argument checks, with torch's errors named for the argument; `conv_args` also checks sparse_conv2d's."""
from typing import Optional

import torch

from .._gemm import check_operands
from ..activations import check_activation
from .planning import conv_out_hw


def _pair(op: str, value, name: str, positive: bool) -> tuple:
    # the common cases, an int and a module's pair of ints, checked in few steps (Dynamo traces each)
    if type(value) is int and (value > 0 or not positive and value == 0):
        return value, value
    if type(value) is tuple and len(value) == 2:
        first, second = value
        if type(first) is int and type(second) is int and (
                first > 0 and second > 0 if positive else first >= 0 and second >= 0):
            return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 1:
        value = (value[0], value[0])
    if not (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise RuntimeError(f"{op}: expected '{name}' to be a single integer value or a list of 2 values, "
                           f"but got {name}={value!r}")
    if positive and min(value) <= 0:
        raise RuntimeError(f"{op}: argument '{name}' must be positive, but got {name}={list(value)}")
    if not positive and min(value) < 0:
        raise RuntimeError(f"{op}: negative '{name}' is not supported, but got {name}={list(value)}")
    return tuple(value)


def _same_padding(KH, KW, dilation) -> tuple:
    """torch's padding='same': total = dilation * (k - 1), the odd one extra on the bottom / right."""
    pads = []
    for k, d in ((KH, dilation[0]), (KW, dilation[1])):
        total = d * (k - 1)
        pads += [total // 2, total - total // 2]
    return tuple(pads)


def conv_args(op: str, input: torch.Tensor, weight_shape, bias: Optional[torch.Tensor], stride, padding,
              dilation, groups) -> tuple:
    """Checks F.conv2d's shapes and geometry arguments as torch does (errors named for `op`); returns (x: input
    as 4-D, stride, pads (top, bottom, left, right), dilation, unbatched)."""
    if input.dim() not in (3, 4):
        raise RuntimeError(f"{op}: expected 3-D (unbatched) or 4-D (batched) 'input', but got input of size "
                           f"{list(input.shape)}")
    if len(weight_shape) != 4:
        raise RuntimeError(f"{op}: expected 4-D 'weight' [out_channels, in_channels / groups, kH, kW], but got "
                           f"weight of size {list(weight_shape)}")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
        raise RuntimeError(f"{op}: non-positive 'groups' is not supported, got groups={groups!r}")
    stride = _pair(op, stride, "stride", True)
    dilation = _pair(op, dilation, "dilation", True)
    KH, KW = weight_shape[2:]
    if isinstance(padding, str):
        if padding == "valid":
            pads = (0, 0, 0, 0)
        elif padding == "same":
            if stride != (1, 1):
                raise RuntimeError(f"{op}: padding='same' is not supported for strided convolutions "
                                   f"(argument 'stride' is {list(stride)})")
            pads = _same_padding(KH, KW, dilation)
        else:
            raise RuntimeError(f"{op}: invalid 'padding' string {padding!r}; expected 'same' or 'valid'")
    else:
        ph, pw = _pair(op, padding, "padding", False)
        pads = (ph, ph, pw, pw)
    unbatched = input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    C, H, W = x.shape[1:]
    cout = weight_shape[0]
    if cout % groups != 0:
        raise RuntimeError(f"{op}: given groups={groups}, expected 'weight' to be divisible by {groups} at "
                           f"dimension 0, but got weight of size {list(weight_shape)}")
    if weight_shape[1] * groups != C:
        raise RuntimeError(f"{op}: given groups={groups}, weight of size {list(weight_shape)}, expected 'input' "
                           f"{list(input.shape)} to have {weight_shape[1] * groups} channels, but got {C}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != cout):
        raise RuntimeError(f"{op}: expected 'bias' to be 1-dimensional with {cout} elements, but got bias of "
                           f"size {list(bias.shape)}")
    padded = (H + pads[0] + pads[1], W + pads[2] + pads[3])
    if padded[0] < dilation[0] * (KH - 1) + 1 or padded[1] < dilation[1] * (KW - 1) + 1:
        raise RuntimeError(f"{op}: calculated padded 'input' size per channel ({padded[0]} x {padded[1]}) is "
                           f"smaller than the dilated kernel size ({dilation[0] * (KH - 1) + 1} x "
                           f"{dilation[1] * (KW - 1) + 1}) of 'weight'")
    return x, stride, pads, dilation, unbatched


def check_conv2d(input, weight, bias, residual, out, stride, padding, dilation, groups, activation) -> tuple:
    """conv2d's argument checks (those that hold for every call of these shapes, dtypes and devices; `check_out`
    has the rest); (act, stride, pads, dilation, unbatched)."""
    act = check_activation(activation)
    check_operands("conv2d", input=input, weight=weight, bias=bias, residual=residual, out=out)
    x, stride, pads, dilation, unbatched = conv_args("conv2d", input, weight.shape, bias, stride, padding,
                                                     dilation, groups)
    out_shape = [x.shape[0], weight.shape[0], *conv_out_hw(*x.shape[2:], *weight.shape[2:], stride, pads, dilation)]
    for name, t in (("residual", residual), ("out", out)):
        if t is not None and list(t.shape) != out_shape[unbatched:]:
            raise RuntimeError(f"conv2d: expected '{name}' of the output's size {out_shape[unbatched:]}, but got "
                               f"{list(t.shape)}")
    return act, stride, pads, dilation, unbatched


def _span(t: torch.Tensor) -> tuple:
    """[first, last] byte address that t's elements touch."""
    extent = sum((size - 1) * st for size, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size() - 1


def check_out(out: torch.Tensor, *tensors) -> None:
    """conv2d's checks of `out` that depend on more than shapes: no autograd, no element written twice, no overlap
    with an operand (a residual may be `out` itself: each element is read before it is written; eager only)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (out, *tensors)):
        raise RuntimeError("conv2d: out= is for inference: it does not support automatic differentiation, but one "
                           "of the arguments requires grad")
    if any(size > 1 and st == 0 for size, st in zip(out.shape, out.stride())):
        raise RuntimeError("conv2d: 'out' has elements that share memory (a stride of 0); it must not")
    if torch.compiler.is_compiling():
        return  # traced tensors have no addresses
    first, last = _span(out)
    input, weight, bias, residual = tensors
    for name, t in (("input", input), ("weight", weight), ("bias", bias), ("residual", residual)):
        if t is None or t.numel() == 0 or name == "residual" and (t.data_ptr(), t.stride()) == (out.data_ptr(),
                                                                                                 out.stride()):
            continue
        lo, hi = _span(t)
        if lo <= last and first <= hi:
            raise RuntimeError(f"conv2d: 'out' overlaps '{name}' in memory; dropin cannot write it in place")
