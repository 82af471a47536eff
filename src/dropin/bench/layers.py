"""Suites of the ops the model zoo brought in, each against torch eager and torch.compile:
- "group_norm": dropin.ops.group_norm vs F.group_norm (Stable Diffusion's UNet: 32 groups, SiLU after it, fused in
  dropin's kernel; a ResNet with GroupNorm in fp32);
- "conv1d": dropin.ops.conv1d vs F.conv1d (Whisper's two input convs with GELU, fused in dropin's kernel; Mamba's
  causal depthwise conv; fp32 without TF32);
- "activations": dropin.ops.activation vs torch's functions, every activation the zoo's models use, on a MobileNet
  stage's activations.
Each forward and forward + backward (the gradients of every input). Quick cases (interpreter, or --quick): tiny
shapes.
"""
import math

import torch

from dropin import ops
from dropin.ops.activations import activation_ref
from dropin.ops.conv1d import conv1d_ref
from dropin.ops.group_norm import group_norm_ref

from .harness import TORCH_DTYPES, Case, allow_tf32, compiled, randn, with_backward


def _case(name: str, dtype: str, inputs: tuple, providers: dict, reference, backward: bool, flops: float,
          bytes_fwd: float, bytes_bwd: float, context=None) -> Case:
    """A forward case, or its forward + backward (every input differentiated, one upstream gradient)."""
    shapes, out_shape = inputs

    def make_inputs():
        args = tuple(randn(*s, dtype=dtype) for s in shapes)
        return args + ((randn(*out_shape, dtype=dtype),) if backward else ())
    if backward:
        providers = {k: with_backward(fn, len(shapes), len(shapes)) for k, fn in providers.items()}
        reference = with_backward(reference, len(shapes), len(shapes))
    return Case(name=f"{name} {dtype} {'fwd+bwd' if backward else 'fwd'}", dtype=dtype, make_inputs=make_inputs,
                providers=providers, reference=reference, backward=backward, flops=flops * (3 if backward else 1),
                bytes=bytes_fwd + (bytes_bwd if backward else 0), **({"context": context} if context else {}))


# --- group_norm ----------------------------------------------------------------------------------------------

def group_norm_case(shape: tuple, groups: int, activation, dtype: str, backward: bool, label: str) -> Case:
    def ours(x, w, b):
        return ops.group_norm(x, groups, w, b, activation=activation)

    def eager(x, w, b):  # (also the float64 reference)
        return group_norm_ref(x, groups, w, b, activation=activation)
    size, n = TORCH_DTYPES[dtype].itemsize, math.prod(shape)
    act = f"+{activation}" if activation else ""
    return _case(f"{label} {'x'.join(map(str, shape))} groups {groups}{act}", dtype,
                 ((shape, (shape[1],), (shape[1],)), shape),
                 {"dropin": ours, "torch": eager, "torch_compile": compiled(eager)}, eager, backward, 0,
                 2 * n * size, 3 * n * size)  # (forward: x read, y written; backward: dy and x read, dx written)


def group_norm_cases(quick: bool) -> list[Case]:
    """Suite "group_norm"."""
    if quick:
        shapes = [((2, 8, 5, 7), 4, "silu", "fp32", "tiny"), ((2, 6, 9), 3, None, "fp16", "tiny")]
    else:
        shapes = [((8, 320, 64, 64), 32, "silu", "bf16", "sd-unet"),
                  ((8, 1280, 16, 16), 32, "silu", "bf16", "sd-mid"),
                  ((16, 256, 56, 56), 32, None, "bf16", "resnet-gn"),
                  ((16, 256, 56, 56), 32, None, "fp32", "resnet-gn")]
    return [group_norm_case(*shape, backward, label) for *shape, label in shapes for backward in (False, True)]


# --- conv1d --------------------------------------------------------------------------------------------------

def conv1d_case(x_shape: tuple, w_shape: tuple, stride: int, padding: int, groups: int, activation, dtype: str,
                backward: bool, label: str) -> Case:
    def ours(x, w, b):
        return ops.conv1d(x, w, b, stride, padding, groups=groups, activation=activation)

    def eager(x, w, b):  # (also the float64 reference)
        return conv1d_ref(x, w, b, stride, padding, groups=groups, activation=activation)
    (n, _, length), (c_out, c_in, k) = x_shape, w_shape
    out_len = (length + 2 * padding - k) // stride + 1
    size = TORCH_DTYPES[dtype].itemsize
    x_bytes, w_bytes, y_bytes = [math.prod(s) * size for s in (x_shape, w_shape, (n, c_out, out_len))]
    act = f"+{activation}" if activation else ""
    return _case(f"{label} {'x'.join(map(str, x_shape))} k{k} s{stride} -> {c_out}{act}", dtype,
                 ((x_shape, w_shape, (c_out,)), (n, c_out, out_len)),
                 {"dropin": ours, "torch": eager, "torch_compile": compiled(eager)}, eager, backward,
                 2 * n * c_out * out_len * c_in * k, x_bytes + w_bytes + y_bytes, y_bytes + 2 * (x_bytes + w_bytes),
                 context=(lambda: allow_tf32(False, torch.backends.cudnn)) if dtype == "fp32" else None)


def conv1d_cases(quick: bool) -> list[Case]:
    """Suite "conv1d"."""
    if quick:
        shapes = [((2, 5, 30), (8, 5, 3), 1, 1, 1, "gelu", "fp32", "tiny"),
                  ((2, 6, 17), (6, 1, 4), 1, 3, 6, None, "fp16", "tiny depthwise")]
    else:
        shapes = [((8, 80, 3000), (384, 80, 3), 1, 1, 1, "gelu", "bf16", "whisper-conv1"),
                  ((8, 384, 3000), (384, 384, 3), 2, 1, 1, "gelu", "bf16", "whisper-conv2"),
                  ((8, 1536, 1024), (1536, 1, 4), 1, 3, 1536, None, "bf16", "mamba-depthwise"),
                  ((8, 80, 3000), (384, 80, 3), 1, 1, 1, "gelu", "fp32", "whisper-conv1")]
    return [conv1d_case(*shape, backward, label) for *shape, label in shapes for backward in (False, True)]


# --- activations ---------------------------------------------------------------------------------------------

ZOO_ACTIVATIONS = ("relu6", "hardswish", "hardsigmoid", "silu", "mish", "leaky_relu", "elu", "gelu", "gelu_tanh",
                   "sigmoid", "tanh")  # (relu: the conv2d and linear suites' epilogues and the overhead suite)


def activation_case(shape: tuple, kind: str, dtype: str, backward: bool, label: str) -> Case:
    def ours(x):
        return ops.activation(x, kind)

    def eager(x):  # (also the float64 reference)
        return activation_ref(x, kind)
    size, n = TORCH_DTYPES[dtype].itemsize, math.prod(shape)
    return _case(f"{label} {kind} {'x'.join(map(str, shape))}", dtype, ((shape,), shape),
                 {"dropin": ours, "torch": eager, "torch_compile": compiled(eager)}, eager, backward, 0,
                 2 * n * size, 3 * n * size)


def activation_cases(quick: bool) -> list[Case]:
    """Suite "activations"."""
    shape, dtype, label = ((3, 5, 7), "fp32", "tiny") if quick else ((64, 96, 56, 56), "bf16", "mobilenet")
    kinds = ZOO_ACTIVATIONS[:3] if quick else ZOO_ACTIVATIONS
    return [activation_case(shape, kind, dtype, backward, label) for kind in kinds for backward in (False, True)]
