"""2-D pooling with torch.nn.functional semantics: max_pool2d, avg_pool2d, adaptive_avg_pool2d; fwd and bwd.

All three share two kernels, read and written through strides (NCHW, channels_last or any view, no copies),
on tiles of BLOCK_P output pixels x BLOCK_C channels (channels_last input: channels along the fast axis):
- `_pool_fwd_kernel`: each output takes its window's max (first max in window order; NaN propagates as in
  torch: a NaN wins, the last one in window order) or mean, fp32 math. Max pooling keeps the argmax as a
  flat int32 index ih * W + iw (torch's index convention) for the backward.
- `_pool_bwd_kernel`: a gather, deterministic without atomics: each input pixel visits the outputs whose
  windows hold it and adds their gradients (max: where the saved argmax is this pixel; mean: / divisor).
- `_global_avg_kernel`: output size 1 (ResNet's / CvT's global pool) as a plain reduction over H*W.
Adaptive windows are torch's: [floor(o*I/O), ceil((o+1)*I/O)).
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from ._common import FLOAT_DTYPES, check_float, empty_in, is_channels_last, pixel, pixel_tiles
from ._dispatch import Checks, Differentiable, Launch, Shortcuts, absent, plan, switch, torch_op, writing

# --- 1. References ---------------------------------------------------------------------------------------

max_pool2d_ref = F.max_pool2d
avg_pool2d_ref = F.avg_pool2d
adaptive_avg_pool2d_ref = F.adaptive_avg_pool2d


# --- 2. Kernels ------------------------------------------------------------------------------------------

@triton.jit
def _plane(offs, H, W):
    """(n, h, w) of flat pixel indices: n int64, h and w int32 (offsets within one sample's planes are int32:
    fewer registers for the address math of every tap; each sample holds fewer than 2^31 elements)."""
    n, h, w = pixel(offs, H, W)
    return n, h.to(tl.int32), w.to(tl.int32)


@triton.jit
def _window(o, I, O, S: tl.constexpr, PAD: tl.constexpr, K: tl.constexpr, DIL: tl.constexpr,
            ADAPTIVE: tl.constexpr):
    """Output index o's window along one axis: [first, end) in input coordinates (not clipped to [0, I))."""
    if ADAPTIVE:
        first = o * I // O
        end = ((o + 1) * I + O - 1) // O
    else:
        first = o * S - PAD
        end = first + (K - 1) * DIL + 1
    return first, end


@triton.jit
def _avg_count(first, end, I, PAD: tl.constexpr, COUNT_PAD: tl.constexpr):
    """The window's share of the divisor along one axis, as torch's avg_pool2d counts it."""
    if COUNT_PAD:
        count = tl.minimum(end, I + PAD) - first
    else:
        count = tl.minimum(end, I) - tl.maximum(first, 0)
    return count


@triton.jit
def _divisor(oh, ow, H, W, OH, OW, KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
             PH: tl.constexpr, PW: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr,
             DIVISOR: tl.constexpr):
    if DIVISOR != 0:
        d = tl.full(oh.shape, DIVISOR, tl.float32)
    else:
        h0, h1 = _window(oh, H, OH, SH, PH, KH, 1, ADAPTIVE)
        w0, w1 = _window(ow, W, OW, SW, PW, KW, 1, ADAPTIVE)
        d = (_avg_count(h0, h1, H, PH, COUNT_PAD) * _avg_count(w0, w1, W, PW, COUNT_PAD)).to(tl.float32)
    return d


@triton.jit
def _pool_fwd_kernel(x_ptr, y_ptr, idx_ptr,
                     C, H, W, OH, OW, P,
                     sxn, sxc, sxh, sxw, syn, syc, syh, syw,
                     KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
                     PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, MODE: tl.constexpr,
                     COUNT_PAD: tl.constexpr, DIVISOR: tl.constexpr, STORE_IDX: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[n, c, oh, ow] = max or mean of x[n, c, window(oh, ow)]; MODE "max", "avg" or "adaptive" (mean over
    adaptive windows, KH x KW their largest size); grid (pixel tiles over N*OH*OW, channel tiles).
    idx (STORE_IDX) has y's strides."""
    offs_p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = offs_p < P
    c_ok = offs_c < C
    n, oh, ow = _plane(offs_p, OH, OW)
    cc = offs_c.to(tl.int64)[None, :]
    h0, h1 = _window(oh, H, OH, SH, PH, KH, DH, MODE == "adaptive")
    w0, w1 = _window(ow, W, OW, SW, PW, KW, DW, MODE == "adaptive")
    x_base = x_ptr + (n * sxn)[:, None] + cc * sxc
    if MODE == "max":
        acc = tl.full((BLOCK_P, BLOCK_C), float("-inf"), tl.float32)
        arg = tl.zeros((BLOCK_P, BLOCK_C), tl.int32)
        seen = tl.zeros((BLOCK_P, BLOCK_C), tl.int1)
    else:
        acc = tl.zeros((BLOCK_P, BLOCK_C), tl.float32)
    for kh in range(KH):
        ih = h0 + kh * DH
        h_ok = p_ok & (ih >= 0) & (ih < H) & (ih < h1)
        for kw in range(KW):
            iw = w0 + kw * DW
            ok = (h_ok & (iw >= 0) & (iw < W) & (iw < w1))[:, None] & c_ok[None, :]
            v = tl.load(x_base + (ih * sxh + iw * sxw)[:, None], mask=ok, other=0.0).to(tl.float32)
            if MODE == "max":
                # torch: the first valid tap, then any larger value or NaN
                take = ok & (~seen | (v > acc) | (v != v))
                acc = tl.where(take, v, acc)
                arg = tl.where(take, (ih * W + iw)[:, None], arg)
                seen = seen | ok
            else:
                acc += v
    if MODE != "max":
        d = _divisor(oh, ow, H, W, OH, OW, KH, KW, SH, SW, PH, PW, MODE == "adaptive", COUNT_PAD, DIVISOR)
        acc = tl.div_rn(acc, tl.broadcast_to(d[:, None], acc.shape))  # correctly rounded (plain / is not)
    offs_y = (n * syn + (oh * syh + ow * syw))[:, None] + cc * syc
    mask = p_ok[:, None] & c_ok[None, :]
    tl.store(y_ptr + offs_y, acc.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_IDX:
        tl.store(idx_ptr + offs_y, arg, mask=mask)


@triton.jit
def _outputs(i, t, I, O, S: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr, ADAPTIVE: tl.constexpr):
    """Candidate t (of a static count) among the outputs whose windows hold input index i along one axis:
    (o, valid)."""
    if ADAPTIVE:
        o = i * O // I + t
        ok = o < ((i + 1) * O + I - 1) // I
    else:  # tap t of output o covers i: o * S - PAD + t * DIL == i
        shifted = i + PAD - t * DIL
        o = tl.maximum(shifted, 0) // S
        ok = (shifted >= 0) & (shifted % S == 0) & (o < O)
    return o, ok


@triton.jit
def _pool_bwd_kernel(dy_ptr, idx_ptr, dx_ptr,
                     C, H, W, OH, OW, P,
                     sdn, sdc, sdh, sdw, sin, sic, sih, siw, sxn, sxc, sxh, sxw,
                     KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
                     PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, MODE: tl.constexpr,
                     COUNT_PAD: tl.constexpr, DIVISOR: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx[n, c, ih, iw] = sum of dy[n, c, oh, ow] over the outputs whose window holds (ih, iw) (max: whose
    argmax idx is it; mean: divided by the window's divisor); TH x TW candidate outputs per pixel (the
    taps for max / avg, the most overlapping adaptive windows); grid (pixel tiles over N*H*W, channel tiles)."""
    offs_p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = offs_p < P
    c_ok = offs_c < C
    n, ih, iw = _plane(offs_p, H, W)
    cc = offs_c.to(tl.int64)[None, :]
    dy_base = dy_ptr + (n * sdn)[:, None] + cc * sdc
    idx_base = idx_ptr + (n * sin)[:, None] + cc * sic
    here = (ih * W + iw)[:, None]
    acc = tl.zeros((BLOCK_P, BLOCK_C), tl.float32)
    for th in range(TH):
        oh, h_ok = _outputs(ih, th, H, OH, SH, PH, DH, MODE == "adaptive")
        h_ok = h_ok & p_ok
        for tw in range(TW):
            ow, w_ok = _outputs(iw, tw, W, OW, SW, PW, DW, MODE == "adaptive")
            ok = (h_ok & w_ok)[:, None] & c_ok[None, :]
            g = tl.load(dy_base + (oh * sdh + ow * sdw)[:, None], mask=ok, other=0.0).to(tl.float32)
            if MODE == "max":
                hit = tl.load(idx_base + (oh * sih + ow * siw)[:, None], mask=ok, other=-1) == here
                acc += tl.where(hit, g, 0.0)
            else:
                d = _divisor(oh, ow, H, W, OH, OW, KH, KW, SH, SW, PH, PW, MODE == "adaptive", COUNT_PAD, DIVISOR)
                d = tl.where(h_ok & w_ok, d, 1.0)[:, None]  # d may be 0 off the valid candidates
                acc += tl.div_rn(g, tl.broadcast_to(d, g.shape))
    offs_x = (n * sxn + (ih * sxh + iw * sxw))[:, None] + cc * sxc
    tl.store(dx_ptr + offs_x, acc.to(dx_ptr.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])


@triton.jit
def _global_avg_kernel(x_ptr, y_ptr,
                       C, HW, W,
                       sxn, sxc, sxh, sxw, syn, syc,
                       BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[n, c] = mean of x[n, c, :, :] (fp32 sum); grid (N, channel tiles)."""
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    x_base = x_ptr + n * sxn + offs_c.to(tl.int64)[None, :] * sxc
    acc = tl.zeros((BLOCK_HW, BLOCK_C), tl.float32)
    for s0 in range(0, HW, BLOCK_HW):
        s = s0 + tl.arange(0, BLOCK_HW)
        offs = (s // W) * sxh + (s % W) * sxw
        acc += tl.load(x_base + offs[:, None], mask=(s < HW)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    y = tl.div_rn(tl.sum(acc, axis=0), tl.zeros((BLOCK_C,), tl.float32) + HW)
    tl.store(y_ptr + n * syn + offs_c * syc, y.to(y_ptr.dtype.element_ty), mask=c_ok)


# --- 3. Launchers ----------------------------------------------------------------------------------------

def _adaptive_span(I: int, O: int) -> tuple:
    """Bounds along one axis: (largest adaptive window, most windows holding one input index)."""
    if I % O == 0:
        return I // O, 1
    return -(-I // O) + 1, -(-O // I) + 1


def _meta(mode, kernel, stride, padding, dilation, count_pad, divisor):
    return dict(KH=kernel[0], KW=kernel[1], SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1],
                DH=dilation[0], DW=dilation[1], MODE=mode, COUNT_PAD=count_pad, DIVISOR=divisor)


def _global(x, mode: str, out_hw) -> bool:
    """Whether the pooling is a global average (output size 1, N * C > 0): `_global_avg_kernel` on y [N, C]."""
    OH, OW = out_hw
    return mode == "adaptive" and (OH, OW) == (1, 1) and x.shape[0] * x.shape[1] > 0


_plans: dict = {}


def _fwd_plan(x, y, mode: str, kernel, stride, padding, dilation, out_hw, count_pad: bool, divisor: int,
              store_idx: bool, traced: bool = False):
    """run(x, y, idx): the forward's launch for this signature, made once (x's shape, strides, dtype, device and
    16-byte alignment and the pooling arguments: what the launch and y's layout follow); y as `_fwd_impl` allocates
    it, idx the argmax with store_idx, else an absent stand-in."""
    key = None if traced else ("fwd", x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, mode, *kernel,
                               *stride, *padding, *dilation, *out_hw, count_pad, divisor, store_idx)
    return plan(_plans, key, lambda: _make_fwd_plan(x, y, mode, kernel, stride, padding, dilation, out_hw,
                                                     count_pad, divisor, store_idx, traced), traced)


def _make_fwd_plan(x, y, mode, kernel, stride, padding, dilation, out_hw, count_pad, divisor, store_idx, traced):
    N, C, H, W = x.shape
    OH, OW = out_hw
    if _global(x, mode, out_hw):
        # merge H and W into one strided axis where the layout allows (NCHW: the plane is one unit-stride run); an
        # H of stride 0 (an expanded input) that does not merge keeps its own axis
        merged = x.stride(2) == W * x.stride(3)
        sxh, sxw = (0, x.stride(3)) if merged else x.stride()[2:]
        ww = H * W if merged else W
        block_c = min(_runtime.next_power_of_2(C), 64) if is_channels_last(x) else min(_runtime.next_power_of_2(C), 4)
        block_hw = max(2, min(_runtime.next_power_of_2(H * W), 2048 // block_c))
        launch = Launch(_global_avg_kernel, (N, _runtime.cdiv(C, block_c)),
                        dict(BLOCK_HW=block_hw, BLOCK_C=block_c, num_warps=4), traced=traced)
        scalars = (C, H * W, ww, x.stride(0), x.stride(1), sxh, sxw, C, 1)
        return lambda x, y, idx: launch(x, y, *scalars)
    P = N * OH * OW
    block_p, block_c = pixel_tiles(P, C, is_channels_last(x))
    launch = Launch(_pool_fwd_kernel, (_runtime.cdiv(P, block_p), _runtime.cdiv(C, block_c)),
                    dict(_meta(mode, kernel, stride, padding, dilation, count_pad, divisor), STORE_IDX=store_idx,
                         BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8), traced=traced)
    scalars = (C, H, W, OH, OW, P, *x.stride(), *y.stride())
    return lambda x, y, idx: launch(x, y, idx, *scalars)


def _fwd_impl(x, mode: str, kernel, stride, padding, dilation, out_hw, count_pad: bool, divisor: int,
              store_idx: bool, traced: bool = False):
    """x [N, C, H, W] (any strides) -> (y [N, C, OH, OW] in x's memory format, idx (int32 argmax in y's layout
    with store_idx, else empty)). traced: under torch.compile (`_dispatch`)."""
    N, C, H, W = x.shape
    OH, OW = out_hw
    if _global(x, mode, out_hw):
        # written as [N, C], returned as its [N, C, 1, 1] view (contiguous in both formats): a written tensor with
        # dims of size 1 is one whose strides Inductor may re-state, copying it onto itself (`_dispatch.absent`)
        y = x.new_empty((N, C))
        out = y.view(N, C, 1, 1)
        idx = y.new_empty(0, dtype=torch.int32)
    else:
        fmt = torch.channels_last if is_channels_last(x) else torch.contiguous_format
        y = out = empty_in((N, C, OH, OW), fmt, x.dtype, x.device)
        idx = empty_in(y.shape, fmt, torch.int32, x.device) if store_idx else \
            y.new_empty(0, dtype=torch.int32)
        if y.numel() == 0:
            return y, idx
    run = _fwd_plan(x, y, mode, kernel, stride, padding, dilation, out_hw, count_pad, divisor, store_idx, traced)
    run(x, y, idx if store_idx else absent(y, traced))
    return out, idx


def _bwd_plan(dy, idx, dx, channels_last: bool, mode: str, kernel, stride, padding, dilation, count_pad: bool,
              divisor: int, traced: bool = False):
    """run(dy, idx, dx): the backward's launch for this signature, made once (dy's shape, strides, dtype, device and
    alignment, idx's strides and alignment, dx's shape and format and the pooling arguments); idx is read for max
    pooling alone."""
    key = None if traced else ("bwd", dy.shape, dy.stride(), dy.dtype, dy.device, dy.data_ptr() & 15, idx.stride(),
                               idx.data_ptr() & 15, dx.shape, channels_last, mode, *kernel, *stride, *padding,
                               *dilation, count_pad, divisor)
    return plan(_plans, key, lambda: _make_bwd_plan(dy, idx, dx, channels_last, mode, kernel, stride, padding,
                                                     dilation, count_pad, divisor, traced), traced)


def _make_bwd_plan(dy, idx, dx, channels_last, mode, kernel, stride, padding, dilation, count_pad, divisor, traced):
    N, C, H, W = dx.shape
    OH, OW = dy.shape[2:]
    if mode == "adaptive":
        th, tw = _adaptive_span(H, OH)[1], _adaptive_span(W, OW)[1]
    else:
        th, tw = kernel
    P = N * H * W
    block_p, block_c = pixel_tiles(P, C, channels_last)
    launch = Launch(_pool_bwd_kernel, (_runtime.cdiv(P, block_p), _runtime.cdiv(C, block_c)),
                    dict(_meta(mode, kernel, stride, padding, dilation, count_pad, divisor), TH=th, TW=tw,
                         BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8), traced=traced)
    scalars = (C, H, W, OH, OW, P, *dy.stride(), *(idx if mode == "max" else dy).stride(), *dx.stride())
    if mode == "max":
        return lambda dy, idx, dx: launch(dy, idx, dx, *scalars)
    return lambda dy, idx, dx: launch(dy, absent(dy, traced), dx, *scalars)


def _bwd_impl(dy, idx, x_shape, channels_last: bool, mode: str, kernel, stride, padding, dilation,
              count_pad: bool, divisor: int, traced: bool = False):
    """dy [N, C, OH, OW] (any strides), idx the forward's argmax (max pooling) -> dx of shape x_shape, channels_last
    or contiguous."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    dx = empty_in(x_shape, fmt, dy.dtype, dy.device)
    if dx.numel() == 0:
        return dx
    if dy.numel() == 0:
        return dx.zero_()
    _bwd_plan(dy, idx, dx, channels_last, mode, kernel, stride, padding, dilation, count_pad, divisor, traced)(
        dy, idx, dx)
    return dx


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ------------------------------

@torch_op("dropin::pool2d", mutates_args=())
def _fwd_op(x: torch.Tensor, mode: str, kernel: list[int], stride: list[int], padding: list[int],
            dilation: list[int], out_hw: list[int], count_pad: bool, divisor: int,
            store_idx: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(x, mode, kernel, stride, padding, dilation, out_hw, count_pad, divisor, store_idx, traced=True)


@torch_op("dropin::pool2d_backward", mutates_args=())
def _bwd_op(dy: torch.Tensor, idx: torch.Tensor, x_shape: list[int], channels_last: bool, mode: str,
            kernel: list[int], stride: list[int], padding: list[int], dilation: list[int], count_pad: bool,
            divisor: int) -> torch.Tensor:
    return _bwd_impl(dy, idx, x_shape, channels_last, mode, kernel, stride, padding, dilation, count_pad, divisor,
                     traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_bwd = switch(_bwd_op, _bwd_impl)


# --- 5. Autograd -----------------------------------------------------------------------------------------

class _Pool2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *args):
        mode, kernel, stride, padding, dilation, out_hw, count_pad, divisor = args
        y, idx = _fwd(x, *args, mode == "max")
        ctx.save_for_backward(idx if mode == "max" else None)  # (as the grad shortcut saves: checkpointing compares)
        ctx.args = (list(x.shape), is_channels_last(x), mode, kernel, stride, padding, dilation, count_pad, divisor)
        return y

    @staticmethod
    def backward(ctx, dy):
        (idx,) = ctx.saved_tensors
        idx = dy.new_empty(0, dtype=torch.int32) if idx is None else idx
        return (_bwd(dy, idx, *ctx.args),) + (None,) * 8


# --- 6. Public functions ---------------------------------------------------------------------------------

def _pair(op: str, value, name: str) -> list:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value, value]
    if isinstance(value, (tuple, list)) and len(value) in (1, 2) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value[0], value[-1]]
    raise RuntimeError(f"{op}: '{name}' must either be a single int, or a tuple of two ints, but got {value!r}")


def _out_size(i: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling_output_shape: a window may start in the right padding only with ceil_mode, never past it."""
    o = (i + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (o - 1) * s >= i + p:
        o -= 1
    return o


def _check_input(op: str, input) -> None:
    _runtime.check_kernel_device(op, input=input)
    check_float(op, input=input)
    if input.dim() not in (3, 4) or 0 in input.shape[-3:]:
        raise RuntimeError(f"{op}: expected 3-D or 4-D 'input' with non-zero channel and spatial sizes, but got "
                           f"input of size {list(input.shape)}")


def _window_args(op: str, input, kernel_size, stride, padding, dilation, ceil_mode) -> tuple:
    """(kernel, stride, padding, dilation, out_hw) of max or average pooling, the arguments checked."""
    _check_input(op, input)
    kernel = _pair(op, kernel_size, "kernel_size")
    stride = kernel if stride is None or (isinstance(stride, (list, tuple)) and not stride) else \
        _pair(op, stride, "stride")
    padding, dilation = _pair(op, padding, "padding"), _pair(op, dilation, "dilation")
    for name, v in (("kernel_size", kernel), ("stride", stride), ("dilation", dilation)):
        if min(v) <= 0:
            raise RuntimeError(f"{op}: '{name}' should be greater than zero, but got {name}={v}")
    if min(padding) < 0 or any(p > k // 2 for p, k in zip(padding, kernel)):  # torch's rule (its CPU path)
        raise RuntimeError(f"{op}: 'padding' should be non-negative and at most half of the kernel size, but got "
                           f"padding={padding} and kernel_size={kernel}")
    out_hw = [_out_size(i, k, s, p, d, ceil_mode) for i, k, s, p, d in zip(input.shape[-2:], kernel, stride, padding,
                                                                           dilation)]
    if min(out_hw) <= 0:
        raise RuntimeError(f"{op}: given 'input' of size {list(input.shape)}, the calculated output size "
                           f"{out_hw} is too small")
    return kernel, stride, padding, dilation, out_hw


def _adaptive_args(op: str, input, output_size) -> tuple:
    """(kernel, out_hw) of adaptive average pooling (kernel: the largest window), the arguments checked."""
    size = [output_size, output_size] if output_size is None or isinstance(output_size, int) else output_size
    if isinstance(input, torch.Tensor) and input.dim() >= 2 and not input.is_floating_point() and isinstance(
            size, (list, tuple)) and len(size) == 2 and all((i if s is None else s) == 1 for s, i in zip(
            size, input.shape[-2:])):
        # torch's global pool is input.mean(), whose dtype check raises RuntimeError (CPU and CUDA)
        raise RuntimeError(f"{op}: argument 'input' has dtype {input.dtype}; dropin supports {FLOAT_DTYPES}")
    _check_input(op, input)
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(
            s is None or isinstance(s, int) and not isinstance(s, bool) for s in size)):
        raise RuntimeError(f"{op}: 'output_size' must be an int or a pair of ints (or None), got {output_size!r}")
    out_hw = [i if s is None else s for s, i in zip(size, input.shape[-2:])]
    if min(out_hw) < 0:
        raise RuntimeError(f"{op}: elements of 'output_size' must be greater than or equal to 0, got {out_hw}")
    return [_adaptive_span(i, o)[0] if o > 0 else 1 for i, o in zip(input.shape[-2:], out_hw)], out_hw


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def _apply(key, input, *args):
    """The pooling of input by args (`_fwd_impl`'s mode ... divisor); without autograd the call's shortcut kept
    under key (`Shortcuts`)."""
    x = input.unsqueeze(0) if input.dim() == 3 else input
    if torch.is_grad_enabled() and input.requires_grad:
        y = _Pool2dFunction.apply(x, *args)
        out = y.squeeze(0) if input.dim() == 3 else y
        _shortcuts.keep(key, lambda: _PoolShortcut.make(input, x, out, args), grad=True)
        return out
    y = _fwd(x, *args, False)[0]
    out = y.squeeze(0) if input.dim() == 3 else y
    _shortcuts.keep(key, lambda: _fwd_shortcut(x, y, out, *args))
    return out


def _fwd_shortcut(x, y, out, *args):
    """A pooling's later eager calls of this signature (`Shortcuts`): input -> out, the forward's plan run on the
    input (x, or its unbatched self at the same address) and a new output laid out as this call's out (y, or its
    unbatched view)."""
    if y.numel() == 0:
        return None
    run = _fwd_plan(x, y, *args, False)
    return writing(out, lambda out, input: run(input, out, out))


class _PoolShortcut(Differentiable):
    """A pooling's later eager calls of this signature where autograd records them (`Differentiable`): input -> out,
    the forward's plan on a new output (and argmax, saved, for max pooling) laid out as this call's, and the
    backward's for each layout of dy, into a new dx laid out as the op's own path lays it out."""

    def __init__(self, input, x, out, args):
        super().__init__()
        self.args, self.max, self.unbatched = args, args[0] == "max", input.dim() == 3
        y = x.new_empty(x.shape[:2]) if _global(x, args[0], args[5]) else torch.empty_strided(
            out.unsqueeze(0).shape if self.unbatched else out.shape,
            out.unsqueeze(0).stride() if self.unbatched else out.stride(), dtype=out.dtype, device=out.device)
        self.forward_run = _fwd_plan(x, y, *args, self.max, False)
        self.out = out.shape, out.stride(), out.dtype, out.device
        self.idx = (y.shape, y.stride()) if self.max else None
        self.x = list(x.shape), is_channels_last(x)

    @staticmethod
    def make(input, x, out, args):
        """The shortcut; None where there is no work."""
        return None if out.numel() == 0 else _PoolShortcut(input, x, out, args)

    def forward(self, ctx, input):
        shape, strides, dtype, device = self.out
        y = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        idx = torch.empty_strided(*self.idx, dtype=torch.int32, device=device) if self.max else y
        self.forward_run(input, y, idx)
        if self.max:
            ctx.save_for_backward(idx)
        return y

    def backward(self, ctx, dy):
        idx = ctx.saved_tensors[0] if self.max else dy
        run, (shape, strides) = self.backward_plan((dy,), lambda: self._backward_run(dy, idx))
        dx = torch.empty_strided(shape, strides, dtype=dy.dtype, device=dy.device)
        run(dy, idx, dx)
        return (dx,)

    def _backward_run(self, dy, idx):
        """(run(dy, idx, dx), dx's (shape, strides)) for a dy of this layout."""
        mode, kernel, stride, padding, dilation, _, count_pad, divisor = self.args
        x_shape, channels_last = self.x
        dx = empty_in(x_shape, torch.channels_last if channels_last else torch.contiguous_format, dy.dtype,
                      dy.device)
        dy = dy.unsqueeze(0) if self.unbatched else dy
        run = _bwd_plan(dy, idx if self.max else dy, dx, channels_last, mode, kernel, stride, padding, dilation,
                        count_pad, divisor)
        dx = dx.squeeze(0) if self.unbatched else dx
        return run, (dx.shape, dx.stride())


def max_pool2d(input: torch.Tensor, kernel_size, stride=None, padding=0, dilation=1,
               ceil_mode: bool = False) -> torch.Tensor:
    """`F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode)`.

    input [N, C, H, W] or unbatched [C, H, W], float32 / float16 / bfloat16, any strides; the output is
    channels_last where the input is. kernel_size / stride (default kernel_size) / padding / dilation an int
    or a pair, padding at most half the kernel. Padding never wins; ties go to the first max in window order
    and NaN propagates, as in torch; the gradient flows to the argmax (return_indices is not offered). A window
    wholly in the padding (only possible with dilation) gives -inf and no gradient (torch's CPU kernel routes
    that gradient to an element outside the window)."""
    args = ("max_pool2d", kernel_size, stride, padding, dilation, ceil_mode)
    key, shortcut = _shortcuts.find((input,), args)
    if shortcut is not None:
        return shortcut(input)
    window = _checked.once((input,), args, lambda: _window_args("max_pool2d", input, kernel_size, stride, padding,
                                                                dilation, ceil_mode))
    return _apply(key, input, "max", *window, True, 0)


def avg_pool2d(input: torch.Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: Optional[int] = None) -> torch.Tensor:
    """`F.avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)`.

    input [N, C, H, W] or [C, H, W], float32 / float16 / bfloat16, any strides (channels_last stays
    channels_last); fp32 sums. Divisor as torch's: divisor_override, else the window clipped to the padded
    input (count_include_pad) or to the input."""
    key, shortcut = _shortcuts.find((input,), ("avg_pool2d", kernel_size, stride, padding, ceil_mode,
                                               count_include_pad, divisor_override))
    if shortcut is not None:
        return shortcut(input)
    if divisor_override is not None and (not isinstance(divisor_override, int) or divisor_override == 0):
        raise RuntimeError(f"avg_pool2d: 'divisor_override' must be a non-zero int, got {divisor_override!r}")
    window = _checked.once((input,), ("avg_pool2d", kernel_size, stride, padding, ceil_mode),
                           lambda: _window_args("avg_pool2d", input, kernel_size, stride, padding, 1, ceil_mode))
    return _apply(key, input, "avg", *window, bool(count_include_pad), divisor_override or 0)


def adaptive_avg_pool2d(input: torch.Tensor, output_size) -> torch.Tensor:
    """`F.adaptive_avg_pool2d(input, output_size)`: output_size an int or a pair (None keeps that input size);
    windows [floor(o * I / O), ceil((o + 1) * I / O)). Output size 1 (a global pool) is one reduction per
    (n, channels). input [N, C, H, W] or [C, H, W], float32 / float16 / bfloat16, any strides."""
    args = ("adaptive_avg_pool2d", output_size)
    key, shortcut = _shortcuts.find((input,), args)
    if shortcut is not None:
        return shortcut(input)
    kernel, out_hw = _checked.once((input,), args, lambda: _adaptive_args("adaptive_avg_pool2d", input, output_size))
    return _apply(key, input, "adaptive", kernel, [1, 1], [0, 0], [1, 1], out_hw, True, 0)
