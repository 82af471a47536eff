"""Activation functions shared by the fused epilogues (linear, conv, swiglu): Triton helpers and references;
and the standalone elementwise op (`activation`, `relu`, `gelu`, `silu`), forward and backward, one kernel.

Names: "relu", "relu6" (min(max(x, 0), 6)), "gelu" (exact, erf), "gelu_tanh" (tanh approximation), "silu",
"hardswish" (x * relu6(x + 3) / 6), "hardsigmoid" (relu6(x + 3) / 6), "sigmoid", "leaky_relu" (torch's default
negative slope, 0.01). Inside kernels the activation is a `tl.constexpr` string; "none" is the identity.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from ._common import check_float, is_dense, joint_dims
from ._dispatch import Checks, Launch, Shortcuts, Unary, absent, plan, switch, torch_op, writing

ACTIVATIONS = ("relu", "relu6", "gelu", "gelu_tanh", "silu", "hardswish", "hardsigmoid", "sigmoid", "leaky_relu")

_REFS = {
    "relu": F.relu,
    "relu6": F.relu6,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "sigmoid": torch.sigmoid,
    "leaky_relu": F.leaky_relu,
}


def check_activation(activation) -> str:
    """Returns the kernel name of `activation` ("none" for None); ValueError for anything unknown."""
    if activation is None:
        return "none"
    if activation not in ACTIVATIONS:
        raise ValueError(f"argument 'activation' must be None or one of {ACTIVATIONS}, got {activation!r}")
    return activation


def activation_ref(x: torch.Tensor, activation) -> torch.Tensor:
    """The PyTorch activation, or x itself for None."""
    return x if activation is None else _REFS[activation](x)


_SQRT1_2 = tl.constexpr(0.7071067811865476)
_SQRT2_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _relu6(z):
    return tl.where(z < 0.0, 0.0, tl.where(z > 6.0, 6.0, z))  # NaN stays NaN, as in torch


@triton.jit
def apply_activation(z, ACT: tl.constexpr):
    """act(z) for an fp32 tensor z."""
    if ACT == "relu":
        y = tl.where(z < 0.0, 0.0, z)  # NaN stays NaN, as in torch
    elif ACT == "relu6":
        y = _relu6(z)
    elif ACT == "gelu":
        y = 0.5 * z * (1.0 + tl.math.erf(z * _SQRT1_2))
    elif ACT == "gelu_tanh":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u)
        y = z * tl.sigmoid((z + 0.044715 * z * z * z) * (2.0 * _SQRT2_PI))
    elif ACT == "silu":
        y = z * tl.sigmoid(z)
    elif ACT == "hardswish":
        y = z * _relu6(z + 3.0) / 6.0
    elif ACT == "hardsigmoid":
        y = _relu6(z + 3.0) / 6.0
    elif ACT == "sigmoid":
        y = tl.sigmoid(z)
    elif ACT == "leaky_relu":
        y = tl.where(z > 0.0, z, z * 0.01)  # NaN stays NaN
    else:
        y = z
    return y


@triton.jit
def activation_grad(z, ACT: tl.constexpr):
    """d act(z) / dz for an fp32 tensor z."""
    if ACT == "relu":
        d = tl.where(z > 0.0, 1.0, 0.0)
    elif ACT == "relu6":
        d = tl.where((z > 0.0) & (z < 6.0), 1.0, 0.0)  # 0 at both kinks, as torch's hardtanh_backward
    elif ACT == "gelu":
        d = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2)) + z * _INV_SQRT_2PI * tl.exp(-0.5 * z * z)
    elif ACT == "gelu_tanh":
        # 1 - s as sigmoid(-u), not by subtraction: it cancels where s saturates
        u = (z + 0.044715 * z * z * z) * (2.0 * _SQRT2_PI)
        s = tl.sigmoid(u)
        d = s + z * s * tl.sigmoid(-u) * 2.0 * _SQRT2_PI * (1.0 + 3.0 * 0.044715 * z * z)
    elif ACT == "silu":
        s = tl.sigmoid(z)
        d = s * (1.0 + z * tl.sigmoid(-z))
    elif ACT == "hardswish":  # torch's hardswish_backward: 0 up to -3, x / 3 + 1/2 strictly inside, 1 from 3
        d = tl.where(z <= -3.0, 0.0, tl.where(z < 3.0, z / 3.0 + 0.5, 1.0))
    elif ACT == "hardsigmoid":  # 1/6 strictly inside (-3, 3), as torch's hardsigmoid_backward
        d = tl.where((z > -3.0) & (z < 3.0), 1.0 / 6.0, 0.0)
    elif ACT == "sigmoid":  # s (1 - s) with 1 - s as sigmoid(-z): no cancellation where s saturates
        d = tl.sigmoid(z) * tl.sigmoid(-z)
    elif ACT == "leaky_relu":  # the slope at 0, as torch's leaky_relu_backward
        d = tl.where(z > 0.0, 1.0, 0.01)
    else:
        d = tl.full(z.shape, 1.0, tl.float32)
    return d


# --- The standalone elementwise op: act(x) and its backward, one kernel for every activation -------------

@triton.jit
def _act_kernel(x_ptr, dy_ptr, out_ptr,
                numel, S1, S2, S3,
                sx0, sx1, sx2, sx3, sd0, sd1, sd2, sd3, so0, so1, so2, so3,
                ACT: tl.constexpr, GRAD: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr):
    """out = act(x), or (GRAD) out = dy * act'(x), fp32 math. FLAT: all three share one dense layout and
    element i sits at offset i in each; else element i of the logical [S0, S1, S2, S3] is read and written
    through each tensor's own strides. Grid (blocks of BLOCK elements,)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    if FLAT:
        ox = i
        od = i
        oo = i
    else:
        i3 = i % S3
        t = i // S3
        i2 = t % S2
        t = t // S2
        i1 = t % S1
        i0 = t // S1
        ox = i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3
        od = i0 * sd0 + i1 * sd1 + i2 * sd2 + i3 * sd3
        oo = i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3
    x = tl.load(x_ptr + ox, mask=ok, other=0.0).to(tl.float32)
    if GRAD:
        out = tl.load(dy_ptr + od, mask=ok, other=0.0).to(tl.float32) * activation_grad(x, ACT)
    else:
        out = apply_activation(x, ACT)
    tl.store(out_ptr + oo, out.to(out_ptr.dtype.element_ty), mask=ok)


def _act_plan(x, dy: Optional[torch.Tensor], out, act: str, traced: bool):
    """The launch of `_act_impl`'s signature: (run, copies), run(x, dy, out) writes out; copies: whether run
    copies x and dy first."""
    layouts = [x.stride(), (x if dy is None else dy).stride(), out.stride()]
    flat = layouts[0] == layouts[1] == layouts[2] and is_dense(x)
    dims = [] if flat else joint_dims(x.shape, layouts)
    copies = len(dims) > 4  # more than 4 dims that do not merge (rare >= 5-D views): copies in out's layout, flat
    if copies:
        flat, dims = True, []
    dims = [(1, (0, 0, 0))] * (4 - len(dims)) + dims
    block = 2048
    scalars = (x.numel(), *(s for s, _ in dims[1:]), *(st[k] for k in range(3) for _, st in dims))
    launch = Launch(_act_kernel, (_runtime.cdiv(x.numel(), block),),
                    dict(ACT=act, GRAD=dy is not None, FLAT=flat, BLOCK=block, num_warps=8), traced=traced)

    def run(x, dy, out):
        if copies:
            x, dy = (None if t is None else torch.empty_like(out).copy_(t) for t in (x, dy))
        launch(x, absent(x, traced) if dy is None else dy, out, *scalars)
    return run, copies


_plans: dict = {}


def _act_planned(x, dy: Optional[torch.Tensor], out, act: str, traced: bool):
    """`_act_plan`'s (run, copies) for this signature (shapes, strides, dtypes, 16-byte alignment: what Triton
    specializes on; out, a new tensor, is aligned and laid out by them; the device), made once. traced: made
    anew."""
    if traced:
        return _act_plan(x, dy, out, act, traced)
    key = (act, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
           None if dy is None else (dy.stride(), dy.dtype, dy.data_ptr() & 15))
    found = _plans.get(key)  # (plan's look-up inlined: this runs on every call of a small op)
    if found is None:
        found = plan(_plans, key, lambda: _act_plan(x, dy, out, act, traced))
    return found


def _act_out(x, dy: Optional[torch.Tensor], act: str):
    """The new output of act(x) (dy None) or dy * act'(x)."""
    return torch.empty_like(x if dy is None or act == "relu" else dy)


def _act_impl(x, dy: Optional[torch.Tensor], act: str, traced: bool = False):
    """act(x) (dy None) or dy * act'(x), in the layout torch gives: that of x, or for the gradient of dy
    (relu: of x), where that is dense. traced: under torch.compile (`_dispatch`)."""
    out = _act_out(x, dy, act)
    if x.numel() > 0:
        _act_planned(x, dy, out, act, traced)[0](x, dy, out)
    return out


@torch_op("dropin::activation", mutates_args=())
def _act_op(x: torch.Tensor, dy: Optional[torch.Tensor], act: str) -> torch.Tensor:
    return _act_impl(x, dy, act, traced=True)


_act = switch(_act_op, _act_impl)


class _ActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, act):
        ctx.save_for_backward(x)
        ctx.act = act
        return _act(x, None, act)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _act(x, dy, ctx.act), None


def _check(input, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"argument 'activation' must be one of {ACTIVATIONS}, got {activation!r}")
    _runtime.check_kernel_device(activation, input=input)
    check_float(activation, input=input)


def _act_shortcut(x, out, act: str):
    """activation's later eager calls of this signature (`Shortcuts`): input -> act(input), the plan on a new
    output laid out as this call's out; None where there is no work or the plan copies x."""
    if x.numel() == 0:
        return None
    run, copies = _act_planned(x, None, out, act, False)
    return None if copies else writing(out, lambda out, x: run(x, None, out))


def _act_grad_shortcut(x, out, act: str):
    """activation's later eager calls of this signature where autograd records them (`Unary`): the forward's plan
    as `_act_shortcut`'s, the backward's for each layout of dy; None where `_act_shortcut` is."""
    forward_run = _act_shortcut(x, out, act)

    def backward_run(dy, x):
        dx = _act_out(x, dy, act)
        run, copies = _act_planned(x, dy, dx, act, False)
        return None if copies else writing(dx, lambda dx, dy, x: run(x, dy, dx))
    return None if forward_run is None else Unary(forward_run, False, backward_run,
                                                  lambda dy, x: _act_impl(x, dy, act))


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def activation(input: torch.Tensor, activation: str) -> torch.Tensor:
    """`activation(input)` elementwise, for activation "relu", "relu6", "gelu" (exact, erf), "gelu_tanh", "silu",
    "hardswish", "hardsigmoid", "sigmoid" or "leaky_relu", as torch's F.relu / F.relu6 / F.gelu /
    F.gelu(approximate="tanh") / F.silu / F.hardswish / F.hardsigmoid / torch.sigmoid / F.leaky_relu (its default
    negative slope, 0.01); fp32 math, backward included.
    input of any shape and strides, float32 / float16 / bfloat16, read through its strides; the output is
    `torch.empty_like(input)` (a dense input's own layout: channels_last stays channels_last), as torch's."""
    key, shortcut = _shortcuts.find((input,), (activation,))
    if shortcut is not None:
        return shortcut(input)
    _checked.once((input,), (activation,), lambda: _check(input, activation))
    if torch.is_grad_enabled() and input.requires_grad:
        out = _ActivationFunction.apply(input, activation)
        _shortcuts.keep(key, lambda: _act_grad_shortcut(input, out, activation), grad=True)
        return out
    out = _act(input, None, activation)
    _shortcuts.keep(key, lambda: _act_shortcut(input, out, activation))
    return out


def relu(input: torch.Tensor) -> torch.Tensor:
    """`F.relu(input)` (NaN stays NaN; the gradient at 0 is 0); see `activation`."""
    return activation(input, "relu")


def gelu(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """`F.gelu(input, approximate)`: approximate "none" (erf) or "tanh"; see `activation`."""
    if approximate not in ("none", "tanh"):
        raise RuntimeError(f"gelu: argument 'approximate' must be 'none' or 'tanh', got {approximate!r}")
    return activation(input, "gelu" if approximate == "none" else "gelu_tanh")


def silu(input: torch.Tensor) -> torch.Tensor:
    """`F.silu(input)` = input * sigmoid(input); see `activation`."""
    return activation(input, "silu")
