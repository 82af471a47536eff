"""Activation functions shared by the fused epilogues (linear, conv, swiglu): Triton helpers and references;
and the standalone elementwise op (`activation`, `relu`, `gelu`, `silu`), forward and backward, one kernel.

Names: "relu", "relu6" (min(max(x, 0), 6)), "gelu" (exact, erf), "gelu_tanh" (tanh approximation), "silu",
"hardswish" (x * relu6(x + 3) / 6), "hardsigmoid" (relu6(x + 3) / 6), "sigmoid", "leaky_relu" (torch's default
negative slope, 0.01), "tanh", "mish" (x * tanh(softplus(x))), "elu" and "celu" (alpha 1: the same function), "selu",
"softplus" (beta 1, threshold 20). Inside kernels the activation is a `tl.constexpr` string; "none" is the
identity.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from ._common import check_float, is_dense, joint_dims
from ._dispatch import Checks, Launch, Shortcuts, Unary, absent, plan, switch, torch_op, writing

ACTIVATIONS = ("relu", "relu6", "gelu", "gelu_tanh", "silu", "hardswish", "hardsigmoid", "sigmoid", "leaky_relu",
               "tanh", "mish", "elu", "selu", "celu", "softplus")

# The activations whose torch backward lays its gradient out as the activation's input, not as the upstream
# gradient (threshold_backward and leaky_relu_backward take the input as their first operand); the others' follow dy.
INPUT_LAYOUT_GRADS = ("relu", "leaky_relu")

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
    "tanh": torch.tanh,
    "mish": F.mish,
    "elu": F.elu,
    "selu": F.selu,
    "celu": F.celu,
    "softplus": F.softplus,
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
_SELU_SCALE = tl.constexpr(1.0507009873554804934193349852946)
_SELU_ALPHA_SCALE = tl.constexpr(1.6732632423543772848170429916717 * 1.0507009873554804934193349852946)


@triton.jit
def _relu6(z):
    return tl.where(z < 0.0, 0.0, tl.where(z > 6.0, 6.0, z))  # NaN stays NaN, as in torch


@triton.jit
def _exp_neg(x):
    """exp(x) for x <= 0 to about 1 ulp in fp32 (positive x reads as 0; NaN stays NaN). tl.exp, ex2.approx of
    x * log2(e), loses |x| * 2^-24 of relative accuracy to that product's rounding (about 1e-6 at x = -20, where
    these activations' tails are exp itself): here 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 with ln 2 in two
    parts (Cody-Waite: n * hi is exact), exp(r) by its Taylor polynomial to r^7 (|r| <= 0.35: truncation under 6e-9).
    Below -104 exp(x) rounds to 0 in fp32."""
    xc = tl.minimum(tl.maximum(x, -104.0), 0.0)
    n = tl.floor(xc * 1.4426950408889634 + 0.5)
    r = xc - n * 0.693145751953125
    r = r - n * 1.4286068203094173e-06
    p = r * (1.0 / 5040.0) + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    return tl.where(x == x, p * tl.exp2(n), x)


@triton.jit
def _sigmoid(z):
    """sigmoid(z) from w = exp(-|z|) (`_exp_neg`): 1 / (1 + w) from 0, w / (1 + w) below, where it is w's own
    accuracy (tl.sigmoid's exp loses it in the negative tail)."""
    w = _exp_neg(-tl.abs(z))
    return tl.where(z >= 0.0, 1.0, w) / (1.0 + w)


@triton.jit
def _expm1(x):
    """exp(x) - 1 for x <= 0 to fp32 accuracy: above -1 (exp(x) - 1 cancels there) x + x^2 (1/2! + x (1/3! + ...))
    to x^11 / 11! (truncation under 1e-8 relative), elsewhere exp(x) - 1 (whose cancellation costs at most
    e / (e - 1))."""
    p = x * (1.0 / 39916800.0) + 1.0 / 3628800.0
    p = p * x + 1.0 / 362880.0
    p = p * x + 1.0 / 40320.0
    p = p * x + 1.0 / 5040.0
    p = p * x + 1.0 / 720.0
    p = p * x + 1.0 / 120.0
    p = p * x + 1.0 / 24.0
    p = p * x + 1.0 / 6.0
    p = p * x + 0.5
    return tl.where(x > -1.0, x + x * x * p, _exp_neg(x) - 1.0)


@triton.jit
def _log1p_unit(u):
    """log(1 + u) for u in [0, 1], as 2 atanh(s) = u - s (u - 2 s^2 (1/3 + s^2 / 5 + ... + s^12 / 15)), s = u / (2 + u)
    <= 1/3 (truncation under 2e-9 relative): u exact and the rest at most a third of it, and no log of a number
    near 1 (whose fast GPU log loses the relative accuracy)."""
    s = u / (2.0 + u)
    s2 = s * s
    q = s2 * (1.0 / 15.0) + 1.0 / 13.0
    q = q * s2 + 1.0 / 11.0
    q = q * s2 + 1.0 / 9.0
    q = q * s2 + 1.0 / 7.0
    q = q * s2 + 1.0 / 5.0
    q = q * s2 + 1.0 / 3.0
    return u - s * (u - 2.0 * s2 * q)


@triton.jit
def _tanh(z):
    """tanh(z): z's sign on tanh(a), a = |z|; below 0.55 a + a^3 P(a^2), P tanh's Taylor series to a^17 (truncation
    under 1e-8 relative; 1 - exp cancels there), elsewhere 1 - 2w / (1 + w), w = exp(-2a) (2w / (1 + w) <= 1/2: no
    cancellation; w underflows to 0 where tanh is 1, never inf / inf)."""
    a = tl.abs(z)
    s = a * a
    p = s * (6404582.0 / 10854718875.0) - 929569.0 / 638512875.0
    p = p * s + 21844.0 / 6081075.0
    p = p * s - 1382.0 / 155925.0
    p = p * s + 62.0 / 2835.0
    p = p * s - 17.0 / 315.0
    p = p * s + 2.0 / 15.0
    p = p * s - 1.0 / 3.0
    w = _exp_neg(-2.0 * a)
    t = tl.where(a < 0.55, a + a * s * p, 1.0 - 2.0 * w / (1.0 + w))
    return tl.where(z < 0.0, -t, t)


@triton.jit
def _mish_parts(z):
    """(p, r, q), q = p + r: tanh(softplus(z)) = p / q and 1 - tanh(softplus(z)) = r / q, from w = exp(-|z|) <= 1:
    (w^2 + 2w, 2) below 0 and (1 + 2w, 2w^2) from 0 (((1 + e)^2 - 1) / ((1 + e)^2 + 1), e = exp(z), the second
    over e^2): sums of positive terms, so no cancellation and no overflow."""
    w = _exp_neg(-tl.abs(z))
    neg = z < 0.0
    p = tl.where(neg, w * (w + 2.0), 1.0 + 2.0 * w)
    r = tl.where(neg, 2.0, 2.0 * w * w)
    return p, r, p + r


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
    elif ACT == "tanh":
        y = _tanh(z)
    elif ACT == "mish":
        p, r, q = _mish_parts(z)
        y = z * p / q
    elif ACT == "elu" or ACT == "celu":  # (celu(x, alpha) is elu(x / alpha) * alpha: one function at alpha 1)
        y = tl.where(z <= 0.0, _expm1(z), z)
    elif ACT == "selu":
        y = tl.where(z <= 0.0, _SELU_ALPHA_SCALE * _expm1(z), _SELU_SCALE * z)
    elif ACT == "softplus":
        # max(z, 0) + log1p(exp(-|z|)): no overflow. Torch's threshold (z itself above 20) needs no branch in fp32:
        # log1p(exp(-z)) < 2.1e-9 there, under half an ulp of z (and sigmoid(z), the gradient, rounds to 1)
        y = tl.where(z > 0.0, z, 0.0) + _log1p_unit(_exp_neg(-tl.abs(z)))
    else:
        y = z
    return y


@triton.jit
def activation_grad(z, ACT: tl.constexpr):
    """d act(z) / dz for an fp32 tensor z."""
    if ACT == "relu":  # as torch's threshold_backward: 0 at 0, 1 at NaN (the upstream gradient passes)
        d = tl.where(z <= 0.0, 0.0, 1.0)
    elif ACT == "relu6":  # 0 at both kinks, 1 at NaN, as torch's hardtanh_backward
        d = tl.where((z <= 0.0) | (z >= 6.0), 0.0, 1.0)
    elif ACT == "gelu":  # (tl.exp's ex2.approx would lose up to 0.5 z^2 ulps more than torch's expf)
        d = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2)) + z * _INV_SQRT_2PI * _exp_neg(-0.5 * z * z)
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
    elif ACT == "tanh":  # 1 - tanh^2 as 4w / (1 + w)^2, w = exp(-2|z|): no cancellation where tanh saturates
        w = _exp_neg(-2.0 * tl.abs(z))
        d = 4.0 * w / ((1.0 + w) * (1.0 + w))
    elif ACT == "mish":  # torch's mish_backward: t + z sigmoid(z) (1 - t^2), t = tanh(softplus(z)) = p / q,
        # 1 - t^2 = r (q + p) / q^2
        p, r, q = _mish_parts(z)
        d = p / q + z * _sigmoid(z) * (r * (q + p) / (q * q))
    elif ACT == "elu" or ACT == "celu":  # torch's elu_backward from the input: exp(z) up to 0 (1 at 0), NaN -> 1
        d = tl.where(z <= 0.0, _exp_neg(z), 1.0)
    elif ACT == "selu":  # as elu's, scaled: alpha * scale at 0
        d = tl.where(z <= 0.0, _SELU_ALPHA_SCALE * _exp_neg(z), _SELU_SCALE)
    elif ACT == "softplus":
        d = _sigmoid(z)
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
    return torch.empty_like(x if dy is None or act in INPUT_LAYOUT_GRADS else dy)


def _act_impl(x, dy: Optional[torch.Tensor], act: str, traced: bool = False):
    """act(x) (dy None) or dy * act'(x), in the layout torch gives: that of x, or for the gradient of dy
    (`INPUT_LAYOUT_GRADS`: of x), where that is dense. traced: under torch.compile (`_dispatch`)."""
    out = _act_out(x, dy, act)
    if x.numel() > 0:
        _act_planned(x, dy, out, act, traced)[0](x, dy, out)
    return out


@torch_op("dropin::activation", mutates_args=())
def _act_op(x: torch.Tensor, dy: Optional[torch.Tensor], act: str) -> torch.Tensor:
    return _act_impl(x, dy, act, traced=True)


_act = switch(_act_op, _act_impl)


# Activations whose derivative the output gives exactly (by its sign, and relu6's by its cap): activation_grad of
# the output equals that of the input, NaN included. Their backward reads the output, as torch's relu does: the
# next op (a conv, a linear) saves that same tensor as its input, where the input would be one more kept for the
# backward.
FROM_OUTPUT = ("relu", "relu6", "leaky_relu")


def stores_preactivation(activation: str, needs) -> bool:
    """Whether a product or a convolution with this activation fused keeps its pre-activation for the backward:
    where a gradient is wanted (any of `needs`) and the activation is not one of FROM_OUTPUT, whose backward reads
    the output instead (`derivative_at`)."""
    return activation != "none" and activation not in FROM_OUTPUT and any(needs)


def derivative_at(activation: str, preactivation, output):
    """What a fused activation's backward evaluates activation_grad at: the output for FROM_OUTPUT activations,
    else the kept pre-activation (None where none is)."""
    return output if activation in FROM_OUTPUT else preactivation


class _ActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, act):
        y = _act(x, None, act)
        ctx.save_for_backward(y if act in FROM_OUTPUT else x)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy):
        (saved,) = ctx.saved_tensors
        return _act(saved, dy, ctx.act), None


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
    return None if forward_run is None else Unary(forward_run, act in FROM_OUTPUT, backward_run,
                                                  lambda dy, x: _act_impl(x, dy, act))


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def activation(input: torch.Tensor, activation: str) -> torch.Tensor:
    """`activation(input)` elementwise, for activation "relu", "relu6", "gelu" (exact, erf), "gelu_tanh", "silu",
    "hardswish", "hardsigmoid", "sigmoid", "leaky_relu", "tanh", "mish", "elu", "selu", "celu" or "softplus", as
    torch's F.relu / F.relu6 / F.gelu / F.gelu(approximate="tanh") / F.silu / F.hardswish / F.hardsigmoid /
    torch.sigmoid / F.leaky_relu / torch.tanh / F.mish / F.elu / F.selu / F.celu / F.softplus with their default
    arguments (negative slope 0.01, alpha 1, beta 1, threshold 20); fp32 math, backward included.
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
