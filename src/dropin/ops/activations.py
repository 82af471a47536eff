"""Activation functions shared by the fused epilogues (linear, conv, swiglu): Triton helpers and references.

Names: "relu", "gelu" (exact, erf), "gelu_tanh" (tanh approximation), "silu". Inside kernels the
activation is a `tl.constexpr` string; "none" is the identity.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")

_REFS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
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
def apply_activation(z, ACT: tl.constexpr):
    """act(z) for an fp32 tensor z."""
    if ACT == "relu":
        y = tl.where(z < 0.0, 0.0, z)  # NaN stays NaN, as in torch
    elif ACT == "gelu":
        y = 0.5 * z * (1.0 + tl.math.erf(z * _SQRT1_2))
    elif ACT == "gelu_tanh":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u)
        y = z * tl.sigmoid((z + 0.044715 * z * z * z) * (2.0 * _SQRT2_PI))
    elif ACT == "silu":
        y = z * tl.sigmoid(z)
    else:
        y = z
    return y


@triton.jit
def activation_grad(z, ACT: tl.constexpr):
    """d act(z) / dz for an fp32 tensor z."""
    if ACT == "relu":
        d = tl.where(z > 0.0, 1.0, 0.0)
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
    else:
        d = tl.full(z.shape, 1.0, tl.float32)
    return d
