"""Unstructured-sparse conv2d: F.conv2d with a pruned weight [Cout, Cin / groups, KH, KW] kept in
sparse_linear's chunked CSR (`sparsify(weight, groups=...)`: rows are output channels, columns torch's
flattening (input channel, kh, kw)), reading only the non-zero weight bytes and skipping the zero work.

Kernel: sparse_linear's `sparse_kernel` in its CONV mode, an implicit GEMM over the sparse weight: the tokens
are output pixels (BLOCK_M consecutive pixels of one image, so a weight entry's input reads are one row
segment of NCHW x), each entry's column decoded to (input channel, kh, kw) and read through conv2d's `conv_tap`
(padding, stride and dilation by masks and index arithmetic; no im2col). The input gradient (weights frozen)
is the same kernel in TRANSPOSED mode over the weight's `transposed` copy (built by `sparsify`). CUDA cores,
fp32 accumulation: a win where the conv is memory- or latency-bound (small batches); with many pixels the
dense tensor-core conv is faster (docs/perf-notes.md has the measurements).
"""
from typing import Optional

import torch

from .. import _runtime
from . import _autotune
from ._dispatch import Launch, Shortcuts, absent, plan, switch, torch_op, writing
from ._common import is_channels_last
from .conv2d import conv_args, conv_out_hw
from .sparse import SparseShortcut, SparseWeight, check_sparse_operands, find_shortcut, sparse_kernel

# Candidates (BLOCK_N output channels, BLOCK_M pixels, products a step, warps); BLOCK_C covers the chunks (up to
# 64: beyond, K is split over programs and the fp32 partials summed), BLOCK_P = products / (BLOCK_N * BLOCK_C *
# BLOCK_M), at least 1. The first is the default when not tuning.
_CONFIGS = [(8, 32, 8192, 4), (4, 64, 8192, 4), (16, 16, 8192, 4), (8, 16, 4096, 4), (4, 32, 4096, 4)]
MAX_BLOCK_C = 64


def sparse_conv2d_ref(input, weight: SparseWeight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """F.conv2d on the dense weight."""
    w = weight.to_dense().to(input.dtype)
    return torch.nn.functional.conv2d(input, w, None if bias is None else bias.to(input.dtype), stride, padding,
                                      dilation, groups)


_plans: dict = {}


def _conv_impl(x, values, offsets, chunk_ptr, bias: Optional[torch.Tensor], rows: int, block_k: int,
               kernel: list[int], stride: list[int], pads: list[int], dilation: list[int], out_hw: list[int],
               transposed: bool, traced: bool = False) -> torch.Tensor:
    """y [B, rows, OH, OW] (NCHW, x's dtype) = the sparse conv of x [B, C, H, W] (NCHW contiguous) by the weight
    whose chunked CSR has `rows` rows; kernel = (KH, KW, groups); transposed: x is the output gradient and y
    the input gradient (rows = input channels, out_hw = the input's size). traced: under torch.compile
    (`_dispatch`)."""
    B, C, H, W = x.shape
    OH, OW = out_hw
    y = x.new_empty((B, rows, OH, OW))
    if y.numel() == 0:
        return y
    _conv_plan(x, values, offsets, chunk_ptr, bias, y, rows, block_k, kernel, stride, pads, dilation, transposed,
               traced)(x, values, offsets, chunk_ptr, bias, y)
    return y


def _conv_plan(x, values, offsets, chunk_ptr, bias, y, rows: int, block_k: int, kernel, stride, pads, dilation,
               transposed: bool, traced: bool = False):
    """run(x, values, offsets, chunk_ptr, bias, y): the conv's plan for this signature, made once (x NCHW
    contiguous; y as `_conv_impl` allocates it)."""
    key = None if traced else (
        x.shape, x.dtype, x.device, values.numel(), chunk_ptr.dtype, rows, block_k, *kernel, *stride, *pads,
        *dilation, *y.shape[2:], transposed, x.data_ptr() & 15, values.data_ptr() & 15, offsets.data_ptr() & 15,
        chunk_ptr.data_ptr() & 15, None if bias is None else bias.data_ptr() & 15)
    return plan(_plans, key, lambda: _make_plan(x, values, offsets, chunk_ptr, bias, y, rows, block_k, kernel, stride,
                                                pads, dilation, transposed, traced), traced)


def _make_plan(x, values, offsets, chunk_ptr, bias, y, rows, block_k, kernel, stride, pads, dilation, transposed,
               traced: bool):
    B, C, H, W = x.shape
    OH, OW = y.shape[2:]
    KH, KW, groups = kernel
    M = OH * OW
    chunks = (chunk_ptr.numel() - 1) // rows
    block_c = min(MAX_BLOCK_C, _runtime.next_power_of_2(max(chunks, 1)))
    splits = max(1, _runtime.cdiv(chunks, block_c))
    geometry = dict(CONV=True, KH=KH, KW=KW, ROWS_G=rows // groups, CH_G=C // groups, C_X=C,
                    STRIDE_H=stride[0], STRIDE_W=stride[1], PAD_H=pads[0], PAD_W=pads[2],
                    DIL_H=dilation[0], DIL_W=dilation[1], TRANSPOSED=transposed,
                    HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_K=block_k, BLOCK_C=block_c)

    def runner(cfg):
        block_n, block_m, products, warps = cfg
        per_step = products // (block_n * block_c * block_m)
        block_p = 1 << max(0, per_step.bit_length() - 1)  # the power of two at most per_step, at least 1
        m_tiles = _runtime.cdiv(M, block_m)
        launch = Launch(sparse_kernel, (_runtime.cdiv(rows, block_n), B * m_tiles, splits),
                        dict(geometry, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_P=block_p, num_warps=warps),
                        traced=traced)
        scalars = (M, rows, chunks, 0, H, W, OW, m_tiles)

        def run(x, values, offsets, chunk_ptr, bias, y):
            if splits == 1:
                launch(x, values, offsets, chunk_ptr, absent(y, traced) if bias is None else bias, y, *scalars)
                return
            partial = torch.empty((splits, *y.shape), device=y.device, dtype=torch.float32)
            launch(x, values, offsets, chunk_ptr, partial, partial, *scalars)
            total = partial.sum(0)
            y.copy_(total if bias is None else total + bias[:, None, None])
        return run

    key = ("conv", x.dtype, block_k, transposed, KH * KW, *map(_autotune.bucket, (B * M, rows, chunks)))

    def prepare(cfg):  # a launch to time: built once, so it is timed on its fast path
        run = runner(cfg)
        return lambda: run(x, values, offsets, chunk_ptr, bias, y)

    return runner(_autotune.pick("sparse_conv2d", key, _CONFIGS, prepare))


@torch_op("dropin::sparse_conv2d", mutates_args=())
def _conv_op(x: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, chunk_ptr: torch.Tensor,
             bias: Optional[torch.Tensor], rows: int, block_k: int, kernel: list[int], stride: list[int],
             pads: list[int], dilation: list[int], out_hw: list[int], transposed: bool) -> torch.Tensor:
    return _conv_impl(x, values, offsets, chunk_ptr, bias, rows, block_k, kernel, stride, pads, dilation, out_hw,
                      transposed, traced=True)


_conv = switch(_conv_op, _conv_impl)


class _SparseConv2dFunction(torch.autograd.Function):
    """Differentiable in x and bias; the compressed weight is frozen (its transposed copy comes along as
    tensors, t_*)."""

    @staticmethod
    def forward(ctx, x, values, offsets, chunk_ptr, t_values, t_offsets, t_ptr, bias, channels_last, rows, block_k,
                kernel, stride, pads, dilation, out_hw):
        ctx.save_for_backward(t_values, t_offsets, t_ptr)
        ctx.channels_last = channels_last
        ctx.geometry = (x.shape[1], block_k, kernel, stride, pads, dilation, list(x.shape[2:]))
        return _conv(x, values, offsets, chunk_ptr, bias, rows, block_k, kernel, stride, pads, dilation, out_hw,
                     False)

    @staticmethod
    def backward(ctx, dy):
        t_values, t_offsets, t_ptr = ctx.saved_tensors
        channels, block_k, kernel, stride, pads, dilation, in_hw = ctx.geometry
        need_x, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[7]
        dx = _conv(dy.contiguous(), t_values, t_offsets, t_ptr, None, channels, block_k, kernel, stride, pads,
                   dilation, in_hw, True) if need_x else None
        if need_x and ctx.channels_last:  # the input's memory format, as torch's gradient has
            dx = dx.contiguous(memory_format=torch.channels_last)
        dbias = dy.sum((0, 2, 3), dtype=torch.float32).to(dy.dtype) if need_bias else None
        return dx, None, None, None, None, None, None, dbias, *(None,) * 8


_shortcuts = Shortcuts(differentiable=True)


def sparse_conv2d(input: torch.Tensor, weight: SparseWeight, bias: Optional[torch.Tensor] = None, stride=1,
                  padding=0, dilation=1, groups: int = 1) -> torch.Tensor:
    """`F.conv2d(input, weight.to_dense(), bias, stride, padding, dilation, groups)` reading only the weight's
    non-zeros.

    input [N, C, H, W] or unbatched [C, H, W] (any strides; read as NCHW, a copy where it is not), weight a
    SparseWeight from `sparsify(conv_weight, groups=groups)`, bias [Cout] or None; stride / padding /
    dilation as F.conv2d's (padding also 'same' / 'valid'); all float32 / float16 / bfloat16 of one dtype
    (under torch.autocast cast to its dtype, as F.conv2d's operands); fp32 accumulation. The output is
    channels_last where the input is (as torch's). Differentiable in input (needs `transpose=True` at
    sparsify time, the default) and bias; the weight is frozen. Non-finite inputs reach only the outputs
    whose weights have a non-zero where they are read (the zeros are skipped, not multiplied)."""
    key, shortcut, tensors = find_shortcut(_shortcuts, input, weight, bias, (stride, padding, dilation, groups))
    if shortcut is not None:
        return shortcut(*tensors)
    check_sparse_operands("sparse_conv2d", input, weight, bias, "input", conv=True)
    if groups != weight.kernel[2]:
        raise ValueError(f"sparse_conv2d: argument 'groups' ({groups}) differs from the groups the weight was "
                         f"sparsified with ({weight.kernel[2]})")
    if torch.is_autocast_enabled(input.device.type):  # as torch.autocast casts F.conv2d's operands
        dtype = torch.get_autocast_dtype(input.device.type)
        input, weight, bias = input.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    x, stride, pads, dilation, unbatched = conv_args("sparse_conv2d", input, weight.conv_shape, bias, stride,
                                                     padding, dilation, groups)
    channels_last = is_channels_last(x)
    x = x.contiguous()
    b = None if bias is None else bias.contiguous()  # the kernel reads bias with unit stride
    KH, KW = weight.kernel[:2]
    out_hw = list(conv_out_hw(x.shape[2], x.shape[3], KH, KW, stride, pads, dilation))
    geometry = (weight.shape[0], weight.block_k, list(weight.kernel), list(stride), list(pads), list(dilation),
                out_hw)
    t = weight.transposed
    if torch.is_grad_enabled() and (x.requires_grad or bias is not None and bias.requires_grad):
        if t is None and x.requires_grad:
            raise RuntimeError("sparse_conv2d: the gradient of 'input' needs the transposed weight: build it with "
                               "sparsify(weight, transpose=True)")
        t = t or weight  # (only the bias gradient is wanted: the transposed weight is never read)
        y = _SparseConv2dFunction.apply(x, weight.values, weight.offsets, weight.chunk_ptr, t.values, t.offsets,
                                        t.chunk_ptr, b, channels_last, *geometry)
        if not (channels_last or unbatched):
            _shortcuts.keep(key, lambda: _sparse_conv2d_grad_shortcut(input, x, weight, bias, b, y, geometry, key[0]),
                            grad=True)
    else:
        y = _conv(x, weight.values, weight.offsets, weight.chunk_ptr, b, *geometry, False)
        if not (channels_last or unbatched):
            _shortcuts.keep(key, lambda: _sparse_conv2d_shortcut(input, x, weight, bias, b, y, geometry))
    if channels_last:
        y = y.contiguous(memory_format=torch.channels_last)
    return y.squeeze(0) if unbatched else y


def _sparse_conv2d_shortcut(input, x, weight, bias, b, y, geometry):
    """sparse_conv2d's later eager calls of this signature (`Shortcuts`): (input, values, offsets, chunk_ptr, bias)
    -> y, the conv's plan run on the call's own tensors and a new output laid out as this call's y (batched NCHW);
    None where a copy made an operand (an input not NCHW-contiguous, a strided bias) or there is no work."""
    if y.numel() == 0 or x.data_ptr() != input.data_ptr() or bias is not None and b.data_ptr() != bias.data_ptr():
        return None
    rows, block_k, kernel, stride, pads, dilation, _ = geometry
    run = _conv_plan(x, weight.values, weight.offsets, weight.chunk_ptr, b, y, rows, block_k, kernel, stride, pads,
                     dilation, False)
    return writing(y, lambda y, x, values, offsets, chunk_ptr, bias: run(x, values, offsets, chunk_ptr, bias, y))


def _sparse_conv2d_grad_shortcut(input, x, weight, bias, b, y, geometry, needs):
    """sparse_conv2d's later eager calls of this signature where autograd records them (`SparseShortcut`): the
    input's gradient the transposed conv of dy (made contiguous, as the Function does) into a new NCHW tensor; None
    where the call keeps no shortcut without autograd, or the input is empty."""
    forward_run = _sparse_conv2d_shortcut(input, x, weight, bias, b, y, geometry)
    if forward_run is None or x.numel() == 0:
        return None
    _, block_k, kernel, stride, pads, dilation, _ = geometry
    x_shape = x.shape

    def backward_run(dy, t_values, t_offsets, t_ptr):
        dx = dy.new_empty(x_shape)
        run = _conv_plan(dy.contiguous(), t_values, t_offsets, t_ptr, None, dx, x_shape[1], block_k, kernel, stride,
                         pads, dilation, True)
        return writing(dx, lambda dx, dy, *transposed: run(dy.contiguous(), *transposed, None, dx))
    return SparseShortcut(forward_run, backward_run, None, (0, 2, 3), needs)
