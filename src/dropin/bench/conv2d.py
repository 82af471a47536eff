"""Suite "conv2d": dropin vs torch (cuDNN), checked against float64 references.

Shape classes (bench/classes.py), each in bf16 and fp16, the first shape of the NCHW classes also in fp32 with
cuDNN's TF32 allowed ("tf32") and off (true fp32, "fp32"): seed 000's seven convs and seed 003's single-channel
image (true fp32), ResNet-50's distinct convs (batch 64, channels_last), CvT-13's embedding and a depthwise conv,
ResNet-50's late convs and the zoo's depthwise convs (ConvNeXt, MobileNetV2, EfficientNet) at batch 8,
conv + BatchNorm (+ identity) + ReLU fused vs the eager sequence (the one class with torch.compile beside: a lone
conv compiles to the cuDNN call), forward + backward, large images with few channels, non-square and large
kernels, dilated and padded, strided, 1x1 at large sizes (NCHW, as users pass them) and a 3x3 in NCHW beside
channels_last.
Quick cases (interpreter, or --quick): each class scaled down.
"""
import functools

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

from dropin import ops
from dropin.ops.conv2d import conv2d_ref, fold_batchnorm

from .classes import ShapeClass, suite_cases
from .harness import TORCH_DTYPES, Case, allow_tf32, compiled, randn, with_backward


def _torch_conv(x, w, stride, padding, dilation, groups):
    return F.conv2d(x, w, None, stride, padding, dilation, groups)


def _text(v) -> str:
    """A stride / padding / dilation for a case name: '2', or '2,3' for a pair that differs."""
    a, b = _pair(v)
    return f"{a}" if a == b else f"{a},{b}"


def conv_case(name, batch, cin, cout, hw, kernel, dtype, stride=1, padding=0, dilation=1, groups=1,
              channels_last=False, backward=False):
    """One conv2d without bias: input [batch, cin, *hw], weight [cout, cin / groups, *kernel]; stride, padding and
    dilation an int or a pair. With backward: forward + the input and weight gradients for a random output
    gradient (3x the forward's FLOPs). No torch.compile beside: a lone conv compiles to the cuDNN call."""
    (h, w), (kh, kw) = hw, kernel
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def make_inputs():
        x = randn(batch, cin, h, w, dtype=dtype).to(memory_format=fmt)
        weight = randn(cout, cin // groups, kh, kw, dtype=dtype).to(memory_format=fmt)
        if backward:
            return x, weight, randn(batch, cout, oh, ow, dtype=dtype).to(memory_format=fmt)
        return x, weight

    geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    torch_fn = functools.partial(_torch_conv, **geometry)
    providers = {"dropin": functools.partial(ops.conv2d, **geometry), "torch": torch_fn}
    reference = functools.partial(conv2d_ref, **geometry)
    if backward:
        providers = {name: with_backward(fn, 2, 2) for name, fn in providers.items()}
        reference = with_backward(reference, 2, 2)
    layout = "NHWC" if channels_last else "NCHW"
    passes = 3 if backward else 1
    return Case(
        name=f"{name} {dtype} {layout} {batch}x{cin}x{h}x{w} k{kh}x{kw} s{_text(stride)} p{_text(padding)}"
             + (f" d{_text(dilation)}" if _pair(dilation) != (1, 1) else "") + f" -> {cout}"
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


def _shape(name, batch, cin, cout, hw, kernel, **options):
    """A class's shape: conv_case's arguments but the dtype (hw and kernel an int or a pair)."""
    return name, batch, cin, cout, _pair(hw), _pair(kernel), options


def _conv(**fixed):
    """A class's build: conv_case of a `_shape` with `fixed` options."""
    return lambda shape, dtype: conv_case(*shape[:6], dtype, **shape[6], **fixed)


# (kernel, stride, padding): batch 32, 16 -> 32 channels, 64x32 input
SEED000 = [((3, 3), 1, 0), ((3, 3), 1, 1), ((5, 5), 1, 2), ((6, 6), 2, 0), ((6, 6), 2, 3), ((1, 1), 1, 0),
           ((3, 3), 2, 1)]
# ResNet-50's distinct convs at batch 64 (224x224): name, cin, cout, size, kernel, stride, padding
RESNET50 = [("stem", 3, 64, 224, 7, 2, 3), ("1x1", 64, 64, 56, 1, 1, 0), ("3x3", 64, 64, 56, 3, 1, 1),
            ("1x1", 64, 256, 56, 1, 1, 0), ("3x3", 128, 128, 56, 3, 2, 1), ("3x3", 256, 256, 14, 3, 1, 1),
            ("3x3", 512, 512, 7, 3, 1, 1), ("1x1", 512, 2048, 7, 1, 1, 0)]
FP16_BF16 = dict(dtypes=("bf16", "fp16"), first_dtypes=())

CONV2D_CLASSES = [
    ShapeClass("seed", "seed 000's seven convs and seed 003's single-channel image, true fp32", _conv(),
               [_shape("seed000", 32, 16, 32, (64, 32), k, stride=s, padding=p) for k, s, p in SEED000]
               + [_shape("seed003", 1, 1, 1, (1000, 2000), 3, padding=1)],
               [_shape("seed000", 2, 4, 8, (12, 10), 3, padding=1)], dtypes=("fp32",), first_dtypes=()),
    ShapeClass("resnet50", "ResNet-50's distinct convs, batch 64, channels_last", _conv(channels_last=True),
               [_shape(f"resnet50 {name}", 64, cin, cout, hw, k, stride=s, padding=p)
                for name, cin, cout, hw, k, s, p in RESNET50],
               [_shape("resnet50 stem", 2, 3, 8, 20, 7, stride=2, padding=3),
                _shape("resnet50 3x3", 2, 8, 8, 7, 3, padding=1), _shape("resnet50 1x1", 2, 8, 16, 7, 1)],
               **FP16_BF16),
    ShapeClass("cvt13", "CvT-13's stage-1 patch embedding and a depthwise q/k/v projection, batch 64, "
               "channels_last", _conv(channels_last=True),
               [_shape("cvt13 embed", 64, 3, 64, 224, 7, stride=4, padding=2),
                _shape("cvt13 depthwise", 64, 64, 64, 56, 3, padding=1, groups=64)],
               [_shape("cvt13 depthwise", 2, 8, 8, 9, 3, stride=2, padding=1, groups=8)], **FP16_BF16),
    ShapeClass("fused", "conv + BatchNorm (+ identity) + ReLU as one kernel vs the eager sequence, channels_last "
               "(torch.compile beside)", lambda shape, dtype: conv_bn_case(*shape[:5], dtype, *shape[5:]),
               [(64, 64, 64, 56, 3, 1, 1), (64, 64, 256, 56, 1, 1, 0, True)], [(2, 8, 16, 7, 3, 1, 1, True)],
               **FP16_BF16),
    ShapeClass("backward", "forward + input and weight gradients, channels_last",
               _conv(channels_last=True, backward=True),
               [_shape("resnet50 3x3", 64, 64, 64, 56, 3, padding=1),
                _shape("cvt13 depthwise", 64, 192, 192, 28, 3, padding=1, groups=192)],
               [_shape("backward", 2, 4, 8, (9, 7), 3, stride=2, padding=1)], **FP16_BF16),
    ShapeClass("small-batch", "ResNet-50's late convs at the zoo's batch 8, NCHW as the models pass them: 32-128 "
               "output tiles on 132 SMs (K split)", _conv(),
               [_shape("resnet50 3x3", 8, 256, 256, 14, 3, padding=1),
                _shape("resnet50 3x3", 8, 512, 512, 7, 3, padding=1),
                _shape("resnet50 1x1", 8, 2048, 512, 7, 1), _shape("resnet50 1x1", 8, 1024, 256, 14, 1)],
               [_shape("resnet50 3x3", 2, 32, 32, 7, 3, padding=1)]),
    ShapeClass("depthwise", "the zoo's depthwise convs, batch 8, NCHW as the models pass them: ConvNeXt's 7x7, "
               "MobileNetV2's 3x3, EfficientNet's 5x5 stride 2", _conv(),
               [_shape("convnext", 8, 96, 96, 56, 7, padding=3, groups=96),
                _shape("convnext", 8, 768, 768, 7, 7, padding=3, groups=768),
                _shape("mobilenetv2", 8, 96, 96, 112, 3, stride=2, padding=1, groups=96),
                _shape("mobilenetv2", 8, 960, 960, 7, 3, padding=1, groups=960),
                _shape("efficientnet", 8, 144, 144, 56, 5, stride=2, padding=2, groups=144)],
               [_shape("convnext", 2, 8, 8, 9, 7, padding=3, groups=8),
                _shape("efficientnet", 2, 6, 6, (11, 10), 5, stride=2, padding=2, groups=6)]),
    ShapeClass("large-image", "256^2 to 1024^2 images with 3 to 64 channels, a few of them", _conv(),
               [_shape("large-image", 2, 3, 64, 1024, 3, padding=1),
                _shape("large-image", 8, 64, 64, 256, 3, padding=1)],
               [_shape("large-image", 1, 3, 8, (40, 36), 3, padding=1)]),
    ShapeClass("kernels", "non-square and large kernels: 5x7, 5x9, 7x7", _conv(),
               [_shape("kernels", 16, 64, 64, 56, (5, 7), padding=(2, 3)),
                _shape("kernels", 16, 64, 64, 56, (5, 9), padding=(2, 4)),
                _shape("kernels", 16, 64, 128, 56, 7, padding=3)],
               [_shape("kernels", 2, 4, 8, (12, 11), (5, 7), padding=(2, 3)),
                _shape("kernels", 2, 4, 8, 10, 7, padding=3)]),
    ShapeClass("dilated", "dilated and padded", _conv(),
               [_shape("dilated", 8, 256, 256, 64, 3, dilation=2, padding=2),
                _shape("dilated", 8, 128, 128, 64, 3, dilation=(4, 2), padding=(4, 2))],
               [_shape("dilated", 2, 4, 8, (13, 12), 3, dilation=2, padding=2),
                _shape("dilated", 2, 4, 8, 11, 3, dilation=(3, 1), padding=(4, 0))]),
    ShapeClass("strided", "strided: a 3x3 downsampling and a ViT's 16x16 patch embedding", _conv(),
               [_shape("strided", 32, 128, 256, 56, 3, stride=2, padding=1),
                _shape("strided", 32, 3, 768, 224, 16, stride=16)],
               [_shape("strided", 2, 4, 8, (13, 12), 3, stride=2, padding=1),
                _shape("strided", 2, 3, 16, 32, 8, stride=8)]),
    ShapeClass("pointwise", "1x1 at large spatial sizes", _conv(),
               [_shape("pointwise", 8, 64, 64, 256, 1), _shape("pointwise", 4, 32, 128, 512, 1)],
               [_shape("pointwise", 2, 8, 16, (24, 20), 1)]),
    ShapeClass("layouts", "one 3x3 in NCHW (as users pass it) and in channels_last", _conv(),
               [_shape("layouts", 32, 128, 128, 56, 3, padding=1),
                _shape("layouts", 32, 128, 128, 56, 3, padding=1, channels_last=True)],
               [_shape("layouts", 2, 8, 8, 9, 3, padding=1),
                _shape("layouts", 2, 8, 8, 9, 3, padding=1, channels_last=True)]),
]


def conv2d_cases(quick: bool) -> list[Case]:
    """Suite "conv2d": every class of CONV2D_CLASSES."""
    return suite_cases(CONV2D_CLASSES, quick)
