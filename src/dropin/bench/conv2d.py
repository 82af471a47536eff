"""Suite "conv2d": dropin vs torch (cuDNN) vs torch.compile, checked against float64 references.

Full cases (GPU): seed 000's seven convs and seed 003's single-channel image (fp32, NCHW, true fp32: cuDNN's
TF32 switched off for every provider), the ResNet-50 convs (batch 64, fp16/bf16, channels_last) and CvT-13's
embedding and depthwise convs, conv + BatchNorm (+ identity) + ReLU fused vs the eager sequence, and
forward + backward of four of them. Quick cases (interpreter, or --quick): tiny shapes.
"""
import functools

import torch
import torch.nn.functional as F

from dropin import ops
from dropin.ops.conv2d import conv2d_ref, fold_batchnorm

from .harness import TORCH_DTYPES, Case, allow_tf32, compiled, randn, with_backward


def _torch_conv(x, w, stride, padding, dilation, groups):
    return F.conv2d(x, w, None, stride, padding, dilation, groups)


def conv_case(name, batch, cin, cout, hw, kernel, dtype, stride=1, padding=0, dilation=1, groups=1,
              channels_last=False, backward=False):
    """One conv2d without bias: input [batch, cin, *hw], weight [cout, cin / groups, *kernel]. With backward:
    forward + the input and weight gradients for a random output gradient (3x the forward's FLOPs)."""
    (h, w), (kh, kw) = hw, kernel
    oh = (h + 2 * padding - dilation * (kh - 1) - 1) // stride + 1
    ow = (w + 2 * padding - dilation * (kw - 1) - 1) // stride + 1
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def make_inputs():
        x = randn(batch, cin, h, w, dtype=dtype).to(memory_format=fmt)
        weight = randn(cout, cin // groups, kh, kw, dtype=dtype).to(memory_format=fmt)
        if backward:
            return x, weight, randn(batch, cout, oh, ow, dtype=dtype).to(memory_format=fmt)
        return x, weight

    geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    torch_fn = functools.partial(_torch_conv, **geometry)
    providers = {"dropin": functools.partial(ops.conv2d, **geometry), "torch": torch_fn,
                 "torch_compile": compiled(torch_fn)}
    reference = functools.partial(conv2d_ref, **geometry)
    if backward:
        providers = {name: with_backward(fn, 2, 2) for name, fn in providers.items()}
        reference = with_backward(reference, 2, 2)
    layout = "NHWC" if channels_last else "NCHW"
    passes = 3 if backward else 1
    return Case(
        name=f"{name} {dtype} {layout} {batch}x{cin}x{h}x{w} k{kh}x{kw} s{stride} p{padding} -> {cout}"
             + (f" g{groups}" if groups > 1 else "") + (" fwd+bwd" if backward else ""),
        dtype=dtype, make_inputs=make_inputs, providers=providers, reference=reference, backward=backward,
        flops=passes * 2 * batch * oh * ow * cout * (cin // groups) * kh * kw,
        bytes=passes * TORCH_DTYPES[dtype].itemsize * (batch * cin * h * w + cout * cin // groups * kh * kw
                                                      + batch * cout * oh * ow),
        context=lambda: allow_tf32(dtype == "tf32", torch.backends.cudnn))


def _eager_conv_bn(x, w, mean, var, gamma, beta, identity, w_folded, b_folded, stride, padding):
    """conv -> BatchNorm (inference) -> (+ identity) -> relu, as the eager model runs it."""
    y = F.batch_norm(F.conv2d(x, w, None, stride, padding), mean, var, gamma, beta, False, 0.0, 1e-5)
    return F.relu(y if identity is None else y + identity)


def _dropin_conv_bn(x, w, mean, var, gamma, beta, identity, w_folded, b_folded, stride, padding):
    """The same as one dropin.conv2d with the BatchNorm folded into its weight and bias (once, at load time)."""
    return ops.conv2d(x, w_folded, b_folded, stride, padding, activation="relu", residual=identity)


def conv_bn_case(batch, cin, cout, hw, k, dtype, stride=1, padding=0, add=False):
    """conv + BN (+ identity) + ReLU at ResNet-50 sizes, channels_last: eager sequence vs one fused kernel."""
    oh = (hw + 2 * padding - k) // stride + 1
    fmt = torch.channels_last

    def make_inputs():
        x = randn(batch, cin, hw, hw, dtype=dtype).to(memory_format=fmt)
        w = (randn(cout, cin, k, k, dtype=dtype) / (cin * k * k) ** 0.5).to(memory_format=fmt)
        bn = torch.nn.BatchNorm2d(cout).to(x.device).eval()
        with torch.no_grad():
            bn.running_mean.normal_(0, 0.1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.normal_(1, 0.1)
            bn.bias.normal_(0, 0.1)
        stats = [t.to(TORCH_DTYPES[dtype]) for t in (bn.running_mean, bn.running_var, bn.weight, bn.bias)]
        identity = randn(batch, cout, oh, oh, dtype=dtype).to(memory_format=fmt) if add else None
        return (x, w, *stats, identity, *(t.detach() for t in fold_batchnorm(w, None, bn)))  # no graph

    geometry = dict(stride=stride, padding=padding)
    eager = functools.partial(_eager_conv_bn, **geometry)
    size = TORCH_DTYPES[dtype].itemsize
    return Case(
        name=f"conv+bn{'+add' if add else ''}+relu {dtype} NHWC {batch}x{cin}x{hw}x{hw} k{k}x{k} s{stride} -> {cout}",
        dtype=dtype, make_inputs=make_inputs,
        providers={"dropin": functools.partial(_dropin_conv_bn, **geometry), "torch": eager,
                   "torch_compile": compiled(eager)},
        reference=eager, flops=2 * batch * oh * oh * cout * cin * k * k,
        bytes=size * (batch * cin * hw * hw + cout * cin * k * k + (2 if add else 1) * batch * cout * oh * oh))


SEED000 = [((3, 3), 1, 0), ((3, 3), 1, 1), ((5, 5), 1, 2), ((6, 6), 2, 0), ((6, 6), 2, 3), ((1, 1), 1, 0),
           ((3, 3), 2, 1)]  # (kernel, stride, padding): batch 32, 16 -> 32 channels, 64x32 input


def _resnet50(dtype):
    """The distinct conv shapes of a ResNet-50 forward at batch 64 (224x224), channels_last."""
    shapes = [("stem", 3, 64, 224, 7, 2, 3), ("1x1", 64, 64, 56, 1, 1, 0), ("3x3", 64, 64, 56, 3, 1, 1),
              ("1x1", 64, 256, 56, 1, 1, 0), ("3x3", 128, 128, 56, 3, 2, 1), ("3x3", 256, 256, 14, 3, 1, 1),
              ("3x3", 512, 512, 7, 3, 1, 1), ("1x1", 512, 2048, 7, 1, 1, 0)]
    return [conv_case(f"resnet50 {name}", 64, cin, cout, (hw, hw), (k, k), dtype, stride, pad, channels_last=True)
            for name, cin, cout, hw, k, stride, pad in shapes]


def _cvt13(dtype):
    """CvT-13 at batch 64: the stage-1 patch embedding and the depthwise 3x3 q/k/v projections."""
    cases = [conv_case("cvt13 embed", 64, 3, 64, (224, 224), (7, 7), dtype, 4, 2, channels_last=True)]
    for channels, hw in ((64, 56), (192, 28), (384, 14)):
        for stride in (1, 2):
            cases.append(conv_case("cvt13 depthwise", 64, channels, channels, (hw, hw), (3, 3), dtype, stride, 1,
                                   groups=channels, channels_last=True))
    return cases


def conv2d_cases(quick: bool) -> list[Case]:
    """Suite "conv2d"."""
    if quick:
        return [conv_case("seed000", 2, 4, 8, (12, 10), (3, 3), "fp32", padding=1),
                conv_case("depthwise", 2, 8, 8, (9, 9), (3, 3), "fp16", 2, 1, groups=8, channels_last=True),
                conv_bn_case(2, 8, 16, 7, 3, "fp32", 1, 1, add=True),
                conv_case("seed000", 2, 4, 8, (9, 7), (3, 3), "fp32", 2, 1, backward=True)]
    return ([conv_case("seed000", 32, 16, 32, (64, 32), k, "fp32", s, p) for k, s, p in SEED000]
            + [conv_case("seed003", 1, 1, 1, (1000, 2000), (3, 3), "fp32", padding=1)]
            + _resnet50("fp16") + _resnet50("bf16") + _cvt13("bf16")
            + [conv_bn_case(64, 64, 64, 56, 3, "bf16", 1, 1), conv_bn_case(64, 256, 256, 14, 3, "bf16", 1, 1),
               conv_bn_case(64, 64, 256, 56, 1, "bf16", add=True), conv_bn_case(64, 512, 512, 7, 3, "bf16", 1, 1,
                                                                                   add=True)]
            + [conv_case("resnet50 3x3", 64, 64, 64, (56, 56), (3, 3), "bf16", 1, 1, channels_last=True,
                         backward=True),
               conv_case("resnet50 3x3", 64, 256, 256, (14, 14), (3, 3), "bf16", 1, 1, channels_last=True,
                         backward=True),
               conv_case("resnet50 1x1", 64, 64, 256, (56, 56), (1, 1), "bf16", channels_last=True, backward=True),
               conv_case("cvt13 depthwise", 64, 192, 192, (28, 28), (3, 3), "bf16", 1, 1, groups=192,
                         channels_last=True, backward=True)])
