"""2-D convolution (torch.nn.functional.conv2d semantics) with a fused bias + activation epilogue; fwd and bwd.

Every pass is an implicit GEMM, read through strides (NCHW, channels_last or any other layout, no copies),
accumulated in fp32 with tl.dot, with masks for padding and edges; grid over (tiles, tiles, groups):
- forward `_conv_fwd_kernel`: output pixels (N*OH*OW) x output channels of a group, reduced over
  (KH, KW, Cin/groups); epilogue bias, activation, and the pre-activation kept for the backward.
- input gradient `_conv_dgrad_kernel` (a transposed convolution): input pixels (N*H*W) x input channels
  of a group, reduced over (KH, KW, Cout/groups), gathering from the output gradient; the stride and
  dilation are handled by masks (a tap contributes where ih + pad - kh*dil is a multiple of the stride).
- weight gradient `_conv_wgrad_kernel`: output channels x (Cin/groups*KH*KW), reduced over N*OH*OW, with
  an optional split of that reduction (fp32 partials summed afterwards) for small weights on large images.
- `_conv_act_grad_kernel`: grad of the activation and the bias gradient (per-tile column sums).
Fewer than 16 channels per group (stems) go forward through `_conv_fwd_rows_kernel` instead, over a copy of x
padded once per call (`_pad_kernel`), whole kernel rows a step.
One input channel per group (depthwise, any channel multiplier) also has direct kernels, the tuner's first
candidates in each pass (the implicit GEMM stays a candidate): [spatial tile of TH x TW pixels, channels]
tiles with the taps unrolled, int32 offsets inside an image and fp32 FMAs (`_conv_dw_fwd_kernel`,
`_conv_dw_dgrad_kernel`), and for the weight gradient per-tile tree sums of dz * x for each tap
(`_conv_dw_wgrad_kernel`) summed over the tiles by `_common.sum_partials_kernel`. A 3x3 of dilation 1 and row
stride 1 or 2 has a forward and a weight gradient that walk down the rows instead (`_conv_dw3_fwd_kernel`, whose
mirrored taps also give the input gradient of stride 1; `_conv_dw3_wgrad_kernel`, per-tile sums carried by FMAs).
float32 follows torch's rule for convolutions: tf32 when `torch.backends.cudnn.allow_tf32` (torch's default:
True) is set, otherwise true fp32 as tf32x3 (`_gemm.precision`).
"""
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from . import _autotune, _gemm
from ._common import column_sums, empty_in, is_channels_last, pixel, sum_partials_kernel, versions
from ._dispatch import (Checks, Differentiable, Launch, Shortcuts, absent, aligned, launch, plan, switch, torch_op,
                        writing)
from ._gemm import dot_acc, split_range
from .activations import activation_grad, activation_ref, apply_activation, check_activation
from .matmul import ProductShortcut, canonical_product, product_shortcut

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- 1. Reference ----------------------------------------------------------------------------------------

def conv2d_ref(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, activation=None, residual=None):
    y = F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    return activation_ref(y if residual is None else y + residual, activation)


def fold_batchnorm(conv_weight: torch.Tensor, conv_bias: Optional[torch.Tensor],
                   bn: torch.nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of one conv equal to conv -> bn with bn's running statistics (inference BatchNorm):
    weight * s per output channel and (bias - running_mean) * s + beta, s = gamma / sqrt(running_var + eps).
    Computed in float32, returned in the weight's dtype and layout; new tensors (bn is not changed), differentiable
    with respect to the conv's and bn's tensors (fine-tuning with a frozen BatchNorm)."""
    if bn.running_mean is None or bn.running_var is None:
        raise RuntimeError("fold_batchnorm: argument 'bn' tracks no running statistics "
                           "(track_running_stats=False); only an inference BatchNorm folds into a conv")
    if bn.num_features != conv_weight.shape[0]:
        raise RuntimeError(f"fold_batchnorm: argument 'bn' has {bn.num_features} features but 'conv_weight' has "
                           f"{conv_weight.shape[0]} output channels")
    scale = torch.rsqrt(bn.running_var.float() + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.float()
    shift = -bn.running_mean.float() if conv_bias is None else conv_bias.float() - bn.running_mean.float()
    shift = shift * scale + (bn.bias.float() if bn.bias is not None else 0.0)
    weight = (conv_weight.float() * scale.view(-1, 1, 1, 1)).to(conv_weight.dtype)
    return weight, shift.to(conv_weight.dtype)


# --- 2. Kernels ------------------------------------------------------------------------------------------

@triton.jit
def _epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, pix_y, pix_r, co, m_ok, n_ok, syc, src,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr):
    """Adds the bias and the residual (pixel offsets pix_y / pix_r, channel strides syc / src), keeps the
    pre-activation in z for the backward, stores act(.) in y."""
    mask = m_ok[:, None] & n_ok[None, :]
    co = co.to(tl.int64)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + co, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        acc = acc + tl.load(r_ptr + pix_r[:, None] + co[None, :] * src, mask=mask, other=0.0).to(tl.float32)
    offs_y = pix_y[:, None] + co[None, :] * syc
    if STORE_Z:
        tl.store(z_ptr + offs_y, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + offs_y, apply_activation(acc, ACT).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, z_ptr, r_ptr,
                     C_G, H, W, COUT_G, OH, OW, P, KH, KW,
                     sxn, sxc, sxh, sxw, swo, swc, swh, sww, syn, syc, syh, syw, srn, src, srh, srw,
                     STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                     DIL_H: tl.constexpr, DIL_W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     ACT: tl.constexpr, STORE_Z: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n, g*COUT_G + co, oh, ow] = act(sum_{kh, kw, c} x[n, g*C_G + c, ih, iw] * w[g*COUT_G + co, c, kh, kw]
    + bias + residual); grid (pixel tiles, channel tiles, groups). z (when STORE_Z) has y's strides."""
    g = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < P
    n_ok = offs_n < COUT_G
    n, oh, ow = pixel(offs_m, OH, OW)
    x_base = x_ptr + n * sxn + g * C_G * sxc
    co = g * COUT_G + offs_n
    w_base = w_ptr + co.to(tl.int64)[None, :] * swo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one flat loop over (kh, kw, channel block), so that num_stages pipelines loads across taps too
    c_blocks = tl.cdiv(C_G, BLOCK_K)
    for step in range(0, KH * KW * c_blocks):
        tap = step // c_blocks
        c0 = (step - tap * c_blocks) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        ih = oh * STRIDE_H - PAD_H + kh * DIL_H
        iw = ow * STRIDE_W - PAD_W + kw * DIL_W
        row_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        k_ok = offs_k < C_G - c0
        a_ptrs = (x_base + ih * sxh + iw * sxw)[:, None] + (c0 + offs_k)[None, :] * sxc
        b_ptrs = w_base + kh * swh + kw * sww + (c0 + offs_k)[:, None] * swc
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot_acc(acc, a, b, PRECISION)
    _epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, n * syn + oh * syh + ow * syw, n * srn + oh * srh + ow * srw,
              co, m_ok, n_ok, syc, src, HAS_BIAS, HAS_RES, ACT, STORE_Z)


@triton.jit
def _pad_kernel(x_ptr, xp_ptr, C_G, G, H, W, HP, WP, sxn, sxc, sxh, sxw,
                PAD_H: tl.constexpr, PAD_W: tl.constexpr, CP: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """xp[n, hp, wp, g * CP + c] = x[n, g * C_G + c, hp - PAD_H, wp - PAD_W], zero outside x and for c >= C_G:
    the padded channels_last copy that _conv_fwd_rows_kernel reads. Grid (N * HP, wp tiles, channel tiles)."""
    row = tl.program_id(0)
    n = (row // HP).to(tl.int64)
    ih = row % HP - PAD_H
    wp = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    gc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c = gc % CP
    iw = wp - PAD_W
    gc_ok = gc < G * CP
    src = x_ptr + n * sxn + ih * sxh + (iw * sxw)[:, None] + ((gc // CP) * C_G + c).to(tl.int64)[None, :] * sxc
    ok = (ih >= 0) & (ih < H) & ((iw >= 0) & (iw < W))[:, None] & ((c < C_G) & gc_ok)[None, :]
    v = tl.load(src, mask=ok, other=0.0)
    dst = xp_ptr + (row.to(tl.int64) * WP + wp)[:, None] * G * CP + gc[None, :]
    tl.store(dst, v, mask=(wp < WP)[:, None] & gc_ok[None, :])


@triton.jit
def _conv_fwd_rows_kernel(xp_ptr, w_ptr, y_ptr, bias_ptr, z_ptr, r_ptr,
                          G, HP, WP, COUT_G, OH, OW, P, KH, KW, KWP, COUT,
                          syn, syc, syh, syw, srn, src, srh, srw,
                          STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                          PRECISION: tl.constexpr, CP: tl.constexpr, ROW_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_conv_fwd_kernel's result for few channels per group (C_G < 16, e.g. a 3-channel stem), read from xp, x
    padded by _pad_kernel: [N, HP, WP, G * CP], CP >= C_G channels a group (a power of two), the conv's padding
    already in place. A kernel row's KW x CP (kw, c) values lie in one contiguous run of xp, so the reduction
    runs over whole rows, padded to ROW_PAD columns (chunks of ROW_PAD where a row is longer), BLOCK_K // ROW_PAD
    rows a step: no edge masks, CP-wide vector loads. The weight comes as _rows_weight lays it out, [KH, KWP, COUT]
    with the same (kw, c) columns (zeros where c >= C_G or past KW x CP): dense rows, pipelined like x."""
    ROWS: tl.constexpr = BLOCK_K // ROW_PAD
    g = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < P
    n_ok = offs_n < COUT_G
    n, oh, ow = pixel(offs_m, OH, OW)
    row_ptrs = xp_ptr + (((n * HP + oh * STRIDE_H) * WP + ow * STRIDE_W) * G + g) * CP
    co = g * COUT_G + offs_n
    rows = tl.arange(0, ROWS)
    offs_j = tl.arange(0, ROW_PAD)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, KW * CP, ROW_PAD):
        kw = (j0 + offs_j) // CP
        col = (kw * DIL_W * G * CP + offs_j % CP)[None, :] + (rows * (DIL_H * WP * G * CP))[:, None]
        w_rows = w_ptr + (rows[:, None] * KWP + j0 + offs_j[None, :])[:, :, None] * COUT + co[None, None, :]
        for kh0 in range(0, KH, ROWS):
            tap_ok = ((kh0 + rows) < KH)[:, None] & (kw < KW)[None, :]
            a = tl.load(row_ptrs[:, None, None] + (col + kh0 * DIL_H * WP * G * CP)[None, :, :],
                        mask=m_ok[:, None, None] & tap_ok[None, :, :], other=0.0)
            b = tl.load(w_rows + kh0 * KWP * COUT, mask=((kh0 + rows) < KH)[:, None, None] & n_ok[None, None, :],
                        other=0.0)
            acc = dot_acc(acc, tl.reshape(a, (BLOCK_M, BLOCK_K)), tl.reshape(b, (BLOCK_K, BLOCK_N)), PRECISION)
    _epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, n * syn + oh * syh + ow * syw, n * srn + oh * srh + ow * srw,
              co, m_ok, n_ok, syc, src, HAS_BIAS, HAS_RES, ACT, STORE_Z)


@triton.jit
def _phase_desc(x_ptr, N, C, H, W, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, TH: tl.constexpr,
                TW: tl.constexpr, BLOCK_C: tl.constexpr):
    """A TMA descriptor of dense channels_last x viewed by stride phase, [N, H / STRIDE_H, STRIDE_H, W / STRIDE_W,
    STRIDE_W * C] (the caller checks that the strides divide H and W), boxes [1, TH, 1, TW, BLOCK_C]."""
    return tl.make_tensor_descriptor(x_ptr, shape=[N, H // STRIDE_H, STRIDE_H, W // STRIDE_W, STRIDE_W * C],
                                     strides=[H * W * C, STRIDE_H * W * C, W * C, STRIDE_W * C, 1],
                                     block_shape=[1, TH, 1, TW, BLOCK_C])


@triton.jit
def _tap_box(x_desc, n, oh0, ow0, kh, kw, c0, C, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
             PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
             TH: tl.constexpr, TW: tl.constexpr, BLOCK_C: tl.constexpr):
    """[TH * TW, BLOCK_C]: what tap (kh, kw) reads for output pixels (oh0.., ow0..) of image n, channels c0..,
    through _phase_desc: input row STRIDE_H * oh + d is row oh + d // STRIDE_H of phase d % STRIDE_H, so the
    tap's pixels are one box of consecutive rows and columns of one phase; its parts outside the image read as
    zeros (the padding, without masks). d is shifted by STRIDE * PAD to stay >= 0 (integer division truncates)."""
    dh = kh * DIL_H + STRIDE_H * PAD_H - PAD_H
    dw = kw * DIL_W + STRIDE_W * PAD_W - PAD_W
    box = x_desc.load([n, oh0 + dh // STRIDE_H - PAD_H, dh % STRIDE_H, ow0 + dw // STRIDE_W - PAD_W,
                       dw % STRIDE_W * C + c0])
    return box.reshape(TH * TW, BLOCK_C)


@triton.jit
def _conv_fwd_tma_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, z_ptr, r_ptr,
                         N, C, H, W, COUT, OH, OW, syn, syc, syh, syw, srn, src, srh, srw, programs,
                         STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                         DIL_H: tl.constexpr, DIL_W: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                         PRECISION: tl.constexpr,
                         TH: tl.constexpr, TW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_conv_fwd_kernel's result for one group, x and w dense channels_last (Hopper TMA): a tile is TH x TW
    output pixels of one image x BLOCK_N output channels; per (tap, channel block) one box of x and one
    [BLOCK_N, BLOCK_K] box of w viewed as [COUT, KH*KW*C] (_tap_box: the x box, by stride phase, the padding
    read as zeros). Channels past C read zeros where STRIDE_W is 1, so the w columns there (the next tap's) add
    nothing; with a larger STRIDE_W the caller takes BLOCK_K dividing C. `programs` programs walk the (image,
    pixel tile, channel tile) tiles in one flattened loop: persistent, as matmul's TMA kernel, where they are
    fewer than the tiles (a tile's loads start while the previous tile's epilogue runs), one tile each where
    they are as many (more programs resident per SM: measured faster on small images)."""
    x_desc = _phase_desc(x_ptr, N, C, H, W, STRIDE_H, STRIDE_W, TH, TW, BLOCK_K)
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[COUT, KH * KW * C], strides=[KH * KW * C, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    tiles_w = tl.cdiv(OW, TW)
    tiles_hw = tl.cdiv(OH, TH) * tiles_w
    tiles_n = tl.cdiv(COUT, BLOCK_N)
    c_blocks = tl.cdiv(C, BLOCK_K)
    tile_c = tl.program_id(0) - programs  # the epilogue's own counter keeps it out of the load pipeline
    for tile in tl.range(tl.program_id(0), N * tiles_hw * tiles_n, programs, flatten=True):
        n, oh0, ow0, co0 = _tma_tile(tile, tiles_n, tiles_hw, tiles_w, TH, TW, BLOCK_N)
        acc = tl.zeros((TH * TW, BLOCK_N), dtype=tl.float32)
        for step in range(0, KH * KW * c_blocks):
            tap = step // c_blocks
            c0 = (step - tap * c_blocks) * BLOCK_K
            kh = tap // KW
            a = _tap_box(x_desc, n, oh0, ow0, kh, tap - kh * KW, c0, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H,
                         DIL_W, TH, TW, BLOCK_K)
            b = w_desc.load([co0, tap * C + c0])
            acc = dot_acc(acc, a, tl.trans(b), PRECISION)
        tile_c += programs
        n, oh0, ow0, co0 = _tma_tile(tile_c, tiles_n, tiles_hw, tiles_w, TH, TW, BLOCK_N)
        offs = tl.arange(0, TH * TW)
        oh = oh0 + offs // TW
        ow = ow0 + offs % TW
        co = co0 + tl.arange(0, BLOCK_N)
        n = n.to(tl.int64)
        _epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, n * syn + oh * syh + ow * syw, n * srn + oh * srh + ow * srw,
                  co, (oh < OH) & (ow < OW), co < COUT, syc, src, HAS_BIAS, HAS_RES, ACT, STORE_Z)


@triton.jit
def _conv_wgrad_tma_kernel(dz_ptr, x_ptr, part_ptr,
                           N, C, H, W, COUT, OH, OW, tiles_per_split,
                           STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr,
                           PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
                           KH: tl.constexpr, KW: tl.constexpr, PRECISION: tl.constexpr,
                           TH: tl.constexpr, TW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight gradient for one group, x and dz dense channels_last (Hopper TMA), one split's share:
    part[split, co, kh, kw, c] = sum over this split's output pixel tiles of dz[n, oh, ow, co] * x at the pixel
    tap (kh, kw) reads, in fp32. Per TH x TW pixel tile one box of dz [1, TH, TW, BLOCK_M] (zeros past the
    image) and the tap's box of x (_tap_box): acc[BLOCK_M, BLOCK_N] += dz^T @ x. Grid (taps * output-channel
    tiles * input-channel tiles, splits of the N * pixel tiles)."""
    x_desc = _phase_desc(x_ptr, N, C, H, W, STRIDE_H, STRIDE_W, TH, TW, BLOCK_N)
    dz_desc = tl.make_tensor_descriptor(dz_ptr, shape=[N, OH, OW, COUT], strides=[OH * OW * COUT, OW * COUT, COUT, 1],
                                        block_shape=[1, TH, TW, BLOCK_M])
    m_blocks = tl.cdiv(COUT, BLOCK_M)
    n_blocks = tl.cdiv(C, BLOCK_N)
    pid = tl.program_id(0)
    tap = pid // (m_blocks * n_blocks)
    co0 = pid // n_blocks % m_blocks * BLOCK_M
    c0 = pid % n_blocks * BLOCK_N
    kh = tap // KW
    tiles_w = tl.cdiv(OW, TW)
    tiles_hw = tl.cdiv(OH, TH) * tiles_w
    first = tl.program_id(1) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, N * tiles_hw)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(first, last):
        n, oh0, ow0, _ = _tma_tile(t, 1, tiles_hw, tiles_w, TH, TW, 1)
        a = dz_desc.load([n, oh0, ow0, co0]).reshape(TH * TW, BLOCK_M)
        b = _tap_box(x_desc, n, oh0, ow0, kh, tap - kh * KW, c0, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
                     TH, TW, BLOCK_N)
        acc = dot_acc(acc, tl.trans(a), b, PRECISION)
    co = co0 + tl.arange(0, BLOCK_M)
    c = c0 + tl.arange(0, BLOCK_N)
    offs = ((tl.program_id(1).to(tl.int64) * COUT + co[:, None]) * (KH * KW) + tap) * C + c[None, :]
    tl.store(part_ptr + offs, acc, mask=(co < COUT)[:, None] & (c < C)[None, :])


@triton.jit
def _tma_tile(tile, tiles_n, tiles_hw, tiles_w, TH: tl.constexpr, TW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Image, first output row and column, first output channel of the TMA kernels' tile `tile` (channel tiles
    innermost: programs running together share their x boxes through L2)."""
    pix = tile // tiles_n
    return pix // tiles_hw, (pix % tiles_hw) // tiles_w * TH, (pix % tiles_w) * TW, (tile % tiles_n) * BLOCK_N


@triton.jit
def conv_tap(pos, k, size, STRIDE: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Along one axis, where tap k of position pos reads and whether that is inside [0, size): the forward
    reads pos*STRIDE - PAD + k*DIL; TRANSPOSED (the input gradient) the output position (pos + PAD - k*DIL)
    / STRIDE, where that divides."""
    if TRANSPOSED:
        t = pos + PAD - k * DIL
        src = tl.maximum(t, 0) // STRIDE
        return src, (t >= 0) & (t % STRIDE == 0) & (src < size)
    src = pos * STRIDE - PAD + k * DIL
    return src, (src >= 0) & (src < size)


@triton.jit
def _spatial_tile(pid, OH, OW, TH: tl.constexpr, TW: tl.constexpr):
    """Image n (int64) and pixels (oh, ow) (int32, flat row-major) of spatial tile pid: TH x TW pixels; tiles run
    row-major within an image, images in order. m_ok: the pixel is inside the OH x OW image."""
    tiles_w = tl.cdiv(OW, TW)
    tiles_h = tl.cdiv(OH, TH)
    t = pid // tiles_w
    r = tl.arange(0, TH * TW)
    oh = (t % tiles_h) * TH + r // TW
    ow = (pid % tiles_w) * TW + r % TW
    return (t // tiles_h).to(tl.int64), oh, ow, (oh < OH) & (ow < OW)


@triton.jit
def _dw_gather(base, ph, pw, kh, kw, m_ok, n_ok, H, W, sh, sw,
               STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
               DIL_H: tl.constexpr, DIL_W: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Tap (kh, kw) of a depthwise tile in fp32, [pixels, channels]: base (pointers with the image and channel
    offsets in) read at the pixel that tap reads for pixel (ph, pw) (see conv_tap) of an H x W image with strides
    sh, sw (int32 offsets: the caller checks that an image's span fits); zero outside it."""
    h, h_ok = conv_tap(ph, kh, H, STRIDE_H, PAD_H, DIL_H, TRANSPOSED)
    w, w_ok = conv_tap(pw, kw, W, STRIDE_W, PAD_W, DIL_W, TRANSPOSED)
    ok = m_ok & h_ok & w_ok
    return tl.load(base + (h * sh + w * sw)[:, None], mask=ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _conv_dw_fwd_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, z_ptr, r_ptr,
                        H, W, COUT, COUT_G, OH, OW,
                        sxn, sxc, sxh, sxw, swo, swh, sww, syn, syc, syh, syw, srn, src, srh, srw,
                        STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                        DIL_H: tl.constexpr, DIL_W: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                        TH: tl.constexpr, TW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Direct convolution for one input channel per group (depthwise, any channel multiplier COUT_G): output
    channel co reads input channel co // COUT_G; fp32 FMAs on the CUDA cores (a tensor-core tile would be
    1/16 used in K); grid (N * spatial tiles of TH x TW output pixels, channel tiles over all COUT channels).
    The taps are unrolled (KH, KW constexpr), so all KH*KW loads of a tile are in flight together; with the
    weight's output channel innermost (_co_major) a tap's weights are one vector load."""
    n, oh, ow, m_ok = _spatial_tile(tl.program_id(0), OH, OW, TH, TW)
    co = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = co < COUT
    x_base = x_ptr + n * sxn + (co // COUT_G * sxc)[None, :]
    acc = tl.zeros((TH * TW, BLOCK_N), dtype=tl.float32)
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            xv = _dw_gather(x_base, oh, ow, kh, kw, m_ok, n_ok, H, W, sxh, sxw,
                            STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, False)
            acc += xv * tl.load(w_ptr + co * swo + kh * swh + kw * sww, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    _epilogue(acc, y_ptr + n * syn, z_ptr + n * syn, bias_ptr, r_ptr + n * srn, oh * syh + ow * syw,
              oh * srh + ow * srw, co, m_ok, n_ok, syc, src, HAS_BIAS, HAS_RES, ACT, STORE_Z)


@triton.jit
def _dw3_tile(OH, OW, W, COUT, sxw, STRIDE_W: tl.constexpr, PAD_W: tl.constexpr, TH: tl.constexpr,
              TW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The depthwise 3x3 walks' tile: image n, first output row oh0, output columns ow (valid: ow_ok), channels
    co (valid: n_ok), and each kernel column's input column offsets c0..c2 with their masks ok0..ok2 (valid
    column, pixel and channel). Grid (N * row tiles * column tiles, channel tiles)."""
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(OW, TW)
    tiles_h = tl.cdiv(OH, TH)
    t = pid // tiles_w
    oh0 = (t % tiles_h) * TH
    n = (t // tiles_h).to(tl.int64)
    ow = (pid % tiles_w) * TW + tl.arange(0, TW)
    co = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ow_ok = ow < OW
    n_ok = co < COUT
    mask = ow_ok[:, None] & n_ok[None, :]
    iw = ow * STRIDE_W - PAD_W
    c0 = (iw * sxw)[:, None]
    ok0 = mask & ((iw >= 0) & (iw < W))[:, None]
    ok1 = mask & ((iw + 1 >= 0) & (iw + 1 < W))[:, None]
    ok2 = mask & ((iw + 2 >= 0) & (iw + 2 < W))[:, None]
    return n, oh0, ow, co, ow_ok, n_ok, c0, c0 + sxw, c0 + 2 * sxw, ok0, ok1, ok2


@triton.jit
def _dw3_load(ih, x_base, H, sxh, c0, c1, c2, ok0, ok1, ok2):
    """Input row ih's three column-shifted loads (kw = 0, 1, 2; columns c0..c2, masks ok0..ok2; zeros for a row
    outside the H rows), in x's dtype."""
    x_row = x_base + ih * sxh
    row_ok = (ih >= 0) & (ih < H)
    return (tl.load(x_row + c0, mask=ok0 & row_ok, other=0.0), tl.load(x_row + c1, mask=ok1 & row_ok, other=0.0),
            tl.load(x_row + c2, mask=ok2 & row_ok, other=0.0))


@triton.jit
def _dw3_f32(x0, x1, x2):
    """_dw3_load's three loads in fp32."""
    return x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _dw3_x(ih, x_base, H, sxh, c0, c1, c2, ok0, ok1, ok2):
    """_dw3_load then _dw3_f32."""
    return _dw3_f32(*_dw3_load(ih, x_base, H, sxh, c0, c1, c2, ok0, ok1, ok2))


@triton.jit
def _conv_dw3_fwd_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, z_ptr, r_ptr,
                         H, W, COUT, COUT_G, OH, OW,
                         sxn, sxc, sxh, sxw, syn, syc, syh, syw, srn, src, srh, srw,
                         STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                         TH: tl.constexpr, TW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The depthwise 3x3 forward (dilation 1, STRIDE_H 1 or 2) as a walk down TH output rows of TW pixels x
    BLOCK_N channels: each input row is read once per kernel column (3 loads, not one per tap: 9) and feeds the
    up to three output rows it reaches through partial sums carried in registers (the rows unrolled); the loads
    run two input rows ahead of the sums (in program order, as the stores between them keep them). The nine
    weights (w_ptr: fp32 [9, COUT], _taps_f32) and the bias (the first sum of each output row) are loaded once.
    Output channel co reads input channel co // COUT_G. Grid (N * row tiles * column tiles, channel tiles)."""
    n, oh0, ow, co, ow_ok, n_ok, c0, c1, c2, ok0, ok1, ok2 = _dw3_tile(OH, OW, W, COUT, sxw, STRIDE_W, PAD_W, TH, TW,
                                                                       BLOCK_N)
    wp = w_ptr + co[None, :]
    w_ok = n_ok[None, :]
    w00 = tl.load(wp, mask=w_ok, other=0.0)
    w01 = tl.load(wp + COUT, mask=w_ok, other=0.0)
    w02 = tl.load(wp + 2 * COUT, mask=w_ok, other=0.0)
    w10 = tl.load(wp + 3 * COUT, mask=w_ok, other=0.0)
    w11 = tl.load(wp + 4 * COUT, mask=w_ok, other=0.0)
    w12 = tl.load(wp + 5 * COUT, mask=w_ok, other=0.0)
    w20 = tl.load(wp + 6 * COUT, mask=w_ok, other=0.0)
    w21 = tl.load(wp + 7 * COUT, mask=w_ok, other=0.0)
    w22 = tl.load(wp + 8 * COUT, mask=w_ok, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + co, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    x_base = x_ptr + n * sxn + (co // COUT_G * sxc)[None, :]
    rows = (x_base, H, sxh, c0, c1, c2, ok0, ok1, ok2)
    ih0 = oh0 * STRIDE_H - PAD_H
    R: tl.constexpr = (TH - 1) * STRIDE_H + 3  # the input rows the tile reads
    ahead = _dw3_load(ih0, *rows)
    ahead2 = _dw3_load(ih0 + 1, *rows)
    for r in tl.static_range(R):  # input row ih0 + r, kernel row kh of output row oh0 + (r - kh) / STRIDE_H
        x0, x1, x2 = ahead
        ahead = ahead2
        if r + 2 < R:
            ahead2 = _dw3_load(ih0 + r + 2, *rows)
        x0, x1, x2 = _dw3_f32(x0, x1, x2)  # (after the next load is issued: 2 registers fewer)
        if r >= 2:
            if r % STRIDE_H == 0:  # kernel row 2 ends output row (r - 2) / STRIDE_H: q's (stride 1) or p's
                if STRIDE_H == 1:
                    out = q + x0 * w20 + x1 * w21 + x2 * w22
                else:
                    out = p + x0 * w20 + x1 * w21 + x2 * w22
                oh = oh0 + (r - 2) // STRIDE_H
                _epilogue(out, y_ptr + n * syn, z_ptr + n * syn, bias_ptr, r_ptr + n * srn, oh * syh + ow * syw,
                          oh * srh + ow * srw, co, ow_ok & (oh < OH), n_ok, syc, src, False, HAS_RES, ACT, STORE_Z)
        if STRIDE_H == 1:
            if r >= 1:
                if r <= TH:  # kernel row 1 of output row r - 1
                    q = p + x0 * w10 + x1 * w11 + x2 * w12
        elif r % 2 == 1:  # kernel row 1 of output row (r - 1) / 2
            p = p + x0 * w10 + x1 * w11 + x2 * w12
        if r % STRIDE_H == 0:
            if r // STRIDE_H < TH:  # kernel row 0 of output row r / STRIDE_H
                if HAS_BIAS:
                    p = bias + x0 * w00 + x1 * w01 + x2 * w02
                else:
                    p = x0 * w00 + x1 * w01 + x2 * w02


@triton.jit
def _conv_dw_dgrad_kernel(dz_ptr, w_ptr, dx_ptr,
                          C, H, W, COUT_G, OH, OW,
                          sdn, sdc, sdh, sdw, swo, swh, sww, sxn, sxc, sxh, sxw,
                          STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr,
                          PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
                          KH: tl.constexpr, KW: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """Direct input gradient for one input channel per group: dx[n, c, ih, iw] = sum_{j, kh, kw}
    dz[n, c*COUT_G + j, oh, ow] * w[c*COUT_G + j, 0, kh, kw] over the taps whose (oh, ow) reads (ih, iw)
    (conv_tap, TRANSPOSED); grid (N * spatial tiles of TH x TW input pixels, channel tiles over all C channels).
    Each dz element is gathered by the KH*KW input pixels that it reaches, from cache after the first."""
    n, ih, iw, m_ok = _spatial_tile(tl.program_id(0), H, W, TH, TW)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = c < C
    co = c * COUT_G
    dz_base = dz_ptr + n * sdn + (co * sdc)[None, :]
    acc = tl.zeros((TH * TW, BLOCK_N), dtype=tl.float32)
    for j in range(COUT_G):
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                dzv = _dw_gather(dz_base + j * sdc, ih, iw, kh, kw, m_ok, n_ok, OH, OW, sdh, sdw,
                                 STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, True)
                wv = tl.load(w_ptr + (co + j) * swo + kh * swh + kw * sww, mask=n_ok, other=0.0)
                acc += dzv * wv.to(tl.float32)[None, :]
    offs_x = (ih * sxh + iw * sxw)[:, None] + (c * sxc)[None, :]
    tl.store(dx_ptr + n * sxn + offs_x, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _conv_dw_wgrad_kernel(dz_ptr, x_ptr, part_ptr,
                          H, W, COUT, COUT_G, OH, OW,
                          sdn, sdc, sdh, sdw, sxn, sxc, sxh, sxw,
                          STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr,
                          PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
                          KH: tl.constexpr, KW: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """Direct weight gradient for one input channel per group, this tile's share: part[tile, kh*KW + kw, co] =
    sum over the tile's output pixels of dz[n, co, oh, ow] * x[n, co // COUT_G, ih, iw] in fp32, a tree sum
    (tl.sum; the caller sums the tiles); grid (N * spatial tiles of TH x TW output pixels, channel tiles over
    all COUT channels). The dz tile is read once and kept for all KH*KW taps."""
    pid_m = tl.program_id(0)
    n, oh, ow, m_ok = _spatial_tile(pid_m, OH, OW, TH, TW)
    co = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = co < COUT
    dz = tl.load(dz_ptr + n * sdn + (oh * sdh + ow * sdw)[:, None] + (co * sdc)[None, :],
                 mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    x_base = x_ptr + n * sxn + (co // COUT_G * sxc)[None, :]
    part = part_ptr + pid_m.to(tl.int64) * (KH * KW) * COUT + co
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            xv = _dw_gather(x_base, oh, ow, kh, kw, m_ok, n_ok, H, W, sxh, sxw,
                            STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, False)
            tl.store(part + (kh * KW + kw) * COUT, tl.sum(dz * xv, axis=0), mask=n_ok)


@triton.jit
def _fma3(x0, x1, x2, d, a0, a1, a2):
    """(a0 + x0.d, a1 + x1.d, a2 + x2.d): one dz row times one input row's three column shifts."""
    return a0 + x0 * d, a1 + x1 * d, a2 + x2 * d


@triton.jit
def _conv_dw3_wgrad_kernel(dz_ptr, x_ptr, part_ptr,
                           H, W, COUT, COUT_G, OH, OW,
                           sdn, sdc, sdh, sdw, sxn, sxc, sxh, sxw,
                           STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                           TH: tl.constexpr, TW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The depthwise 3x3 weight gradient (dilation 1, STRIDE_H 1 or 2) as a walk down TH output rows of TW pixels
    x BLOCK_N channels, this tile's share as _conv_dw_wgrad_kernel's: part[tile, kh*3 + kw, co]. The nine taps'
    [TW, BLOCK_N] fp32 sums are carried down the rows by FMAs and reduced once at the end (not a tree sum per
    tap and tile); each input row is read once per kernel column and meets every dz row it reaches (stride 1:
    the last three, kept in registers; at stride 1 the loads run two rows ahead); a dz row past OH adds nothing
    (no 0 * inf). Grid as the forward walk's (_dw3_tile)."""
    n, oh0, ow, co, ow_ok, n_ok, c0, c1, c2, ok0, ok1, ok2 = _dw3_tile(OH, OW, W, COUT, sxw, STRIDE_W, PAD_W, TH, TW,
                                                                       BLOCK_N)
    x_base = x_ptr + n * sxn + (co // COUT_G * sxc)[None, :]
    rows = (x_base, H, sxh, c0, c1, c2, ok0, ok1, ok2)
    dz_cols = dz_ptr + n * sdn + (ow * sdw)[:, None] + (co * sdc)[None, :]
    d_ok = ow_ok[:, None] & n_ok[None, :]
    zero = tl.zeros((TW, BLOCK_N), dtype=tl.float32)
    a00, a01, a02, a10, a11, a12, a20, a21, a22 = zero, zero, zero, zero, zero, zero, zero, zero, zero
    if STRIDE_H == 1:
        d0, d1, d2 = zero, zero, zero  # the dz rows of output rows oh0 + j, oh0 + j - 1, oh0 + j - 2
        dz_ahead = tl.load(dz_cols + oh0 * sdh, mask=d_ok & (oh0 < OH), other=0.0)  # loads two rows ahead
        x_ahead = _dw3_load(oh0 - PAD_H, *rows)
        if TH > 1:
            dz_ahead2 = tl.load(dz_cols + (oh0 + 1) * sdh, mask=d_ok & (oh0 + 1 < OH), other=0.0)
        x_ahead2 = _dw3_load(oh0 - PAD_H + 1, *rows)
        # (the scalar branches also bound how far the compiler hoists loads: without the third, which padding makes
        # redundant, 16 x 16 x 64 at 16 bits spills 3.9 KB instead of taking 255 registers; sm_90, triton 3.8)
        for j in tl.static_range(TH + 2):  # input row oh0 - PAD_H + j: kernel row kh of output row oh0 + j - kh
            d2, d1 = d1, d0
            if j < TH:
                d0 = dz_ahead.to(tl.float32)
                if j + 1 < TH:
                    dz_ahead = dz_ahead2
                if j + 2 < TH:
                    dz_ahead2 = tl.load(dz_cols + (oh0 + j + 2) * sdh, mask=d_ok & (oh0 + j + 2 < OH), other=0.0)
            x0, x1, x2 = _dw3_f32(*x_ahead)
            x_ahead = x_ahead2
            if j < TH:
                x_ahead2 = _dw3_load(oh0 - PAD_H + j + 2, *rows)
                if oh0 + j < OH:
                    a00, a01, a02 = _fma3(x0, x1, x2, d0, a00, a01, a02)
            if j >= 1:
                if j <= TH:
                    if oh0 + j - 1 < OH:
                        a10, a11, a12 = _fma3(x0, x1, x2, d1, a10, a11, a12)
            if j >= 2:
                if oh0 + j - 2 < OH:
                    a20, a21, a22 = _fma3(x0, x1, x2, d2, a20, a21, a22)
    else:
        x0, x1, x2 = _dw3_x(oh0 * STRIDE_H - PAD_H, *rows)  # kernel row 0 of output row oh0
        for i in tl.static_range(TH):
            oh = oh0 + i
            if oh < OH:  # rows ih, ih + 1, ih + 2; the last is kernel row 0 of output row oh + 1
                ih = oh * STRIDE_H - PAD_H
                d = tl.load(dz_cols + oh * sdh, mask=d_ok, other=0.0).to(tl.float32)
                a00, a01, a02 = _fma3(x0, x1, x2, d, a00, a01, a02)
                x0, x1, x2 = _dw3_x(ih + 1, *rows)
                a10, a11, a12 = _fma3(x0, x1, x2, d, a10, a11, a12)
                x0, x1, x2 = _dw3_x(ih + 2, *rows)
                a20, a21, a22 = _fma3(x0, x1, x2, d, a20, a21, a22)
    part = part_ptr + tl.program_id(0).to(tl.int64) * 9 * COUT + co
    tl.store(part, tl.sum(a00, axis=0), mask=n_ok)
    tl.store(part + COUT, tl.sum(a01, axis=0), mask=n_ok)
    tl.store(part + 2 * COUT, tl.sum(a02, axis=0), mask=n_ok)
    tl.store(part + 3 * COUT, tl.sum(a10, axis=0), mask=n_ok)
    tl.store(part + 4 * COUT, tl.sum(a11, axis=0), mask=n_ok)
    tl.store(part + 5 * COUT, tl.sum(a12, axis=0), mask=n_ok)
    tl.store(part + 6 * COUT, tl.sum(a20, axis=0), mask=n_ok)
    tl.store(part + 7 * COUT, tl.sum(a21, axis=0), mask=n_ok)
    tl.store(part + 8 * COUT, tl.sum(a22, axis=0), mask=n_ok)


@triton.jit
def _conv_dgrad_kernel(dy_ptr, w_ptr, dx_ptr,
                       C_G, H, W, COUT_G, OH, OW, P, KH, KW,
                       sdn, sdc, sdh, sdw, swo, swc, swh, sww, sxn, sxc, sxh, sxw,
                       STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                       DIL_H: tl.constexpr, DIL_W: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """dx[n, g*C_G + c, ih, iw] = sum_{kh, kw, co} dy[n, g*COUT_G + co, oh, ow] * w[g*COUT_G + co, c, kh, kw]
    where oh*STRIDE_H == ih + PAD_H - kh*DIL_H (same for w); grid (input pixel tiles, channel tiles,
    groups), P = N*H*W."""
    g = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < P
    n_ok = offs_n < C_G
    n, ih, iw = pixel(offs_m, H, W)
    dy_base = dy_ptr + n * sdn + g * COUT_G * sdc
    c = g * C_G + offs_n
    w_base = w_ptr + g * COUT_G * swo + offs_n.to(tl.int64)[None, :] * swc
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One flat loop over (kh, kw, output-channel block), so that num_stages pipelines across taps too.
    k_blocks = tl.cdiv(COUT_G, BLOCK_K)
    for step in range(0, KH * KW * k_blocks):
        tap = step // k_blocks
        k0 = (step - tap * k_blocks) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        th = ih + PAD_H - kh * DIL_H
        tw = iw + PAD_W - kw * DIL_W
        oh = tl.maximum(th, 0) // STRIDE_H
        ow = tl.maximum(tw, 0) // STRIDE_W
        row_ok = (m_ok & (th >= 0) & (th % STRIDE_H == 0) & (oh < OH)
                  & (tw >= 0) & (tw % STRIDE_W == 0) & (ow < OW))
        k_ok = offs_k < COUT_G - k0
        a_ptrs = (dy_base + oh * sdh + ow * sdw)[:, None] + (k0 + offs_k)[None, :] * sdc
        b_ptrs = w_base + kh * swh + kw * sww + (k0 + offs_k)[:, None] * swo
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot_acc(acc, a, b, PRECISION)
    offs_x = (n * sxn + ih * sxh + iw * sxw)[:, None] + c.to(tl.int64)[None, :] * sxc
    tl.store(dx_ptr + offs_x, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _conv_wgrad_kernel(dy_ptr, x_ptr, dw_ptr,
                       C_G, H, W, COUT_G, OH, OW, P, KH, KW,
                       sdn, sdc, sdh, sdw, sxn, sxc, sxh, sxw, swo, swc, swh, sww, sws,
                       STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                       DIL_H: tl.constexpr, DIL_W: tl.constexpr, PRECISION: tl.constexpr, TAP_MAJOR: tl.constexpr,
                       ONE_TAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """dw[g*COUT_G + co, c, kh, kw] = sum_{n, oh, ow} dy[n, g*COUT_G + co, oh, ow] * x[n, g*C_G + c, ih, iw];
    columns j = (c, kh, kw), or (kh, kw, c) with TAP_MAJOR (channels_last x: a pixel's columns are then
    contiguous channels, not a scatter over taps); ONE_TAP (TAP_MAJOR, BLOCK_N divides C_G): a column tile
    lies within one tap, so each pixel's position and mask are computed once per row, not per element;
    grid (co tiles x column tiles, groups, splits of the N*OH*OW reduction); split s writes at
    dw + s * sws."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(C_G * KH * KW, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    g = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    k_first, k_last = split_range(split, P, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < COUT_G
    n_ok = offs_n < C_G * KH * KW
    if TAP_MAJOR:
        c = offs_n % C_G
        t = offs_n // C_G
        kw = t % KW
        kh = t // KW
    else:
        kw = offs_n % KW
        t = offs_n // KW
        kh = t % KH
        c = t // KH
    tap = pid_n * BLOCK_N // C_G
    tap_h = (tap // KW) * DIL_H  # (ONE_TAP: the tile's tap offsets, scalars)
    tap_w = (tap % KW) * DIL_W
    co = g * COUT_G + offs_m
    dy_base = dy_ptr + co.to(tl.int64)[:, None] * sdc
    x_base = x_ptr + (g * C_G + c).to(tl.int64)[None, :] * sxc
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = k_first * BLOCK_K + tl.arange(0, BLOCK_K)  # int32 (P < 2^31): the decode's divisions each step
    for kt in range(k_first, k_last):
        k_ok = offs_k < P
        n, oh, ow = pixel(offs_k, OH, OW)
        n, oh, ow = n.to(tl.int64), oh.to(tl.int64), ow.to(tl.int64)
        a = tl.load(dy_base + (n * sdn + oh * sdh + ow * sdw)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if ONE_TAP:
            ih = oh * STRIDE_H - PAD_H + tap_h
            iw = ow * STRIDE_W - PAD_W + tap_w
            row_ok = k_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            b = tl.load(x_base + (n * sxn + ih * sxh + iw * sxw)[:, None], mask=row_ok[:, None] & n_ok[None, :],
                        other=0.0)
        else:
            ih = oh[:, None] * STRIDE_H - PAD_H + kh[None, :] * DIL_H
            iw = ow[:, None] * STRIDE_W - PAD_W + kw[None, :] * DIL_W
            b_ok = k_ok[:, None] & n_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            b = tl.load(x_base + (n * sxn)[:, None] + ih * sxh + iw * sxw, mask=b_ok, other=0.0)
        acc = dot_acc(acc, a, b, PRECISION)
        offs_k += BLOCK_K
    offs_w = (split.to(tl.int64) * sws + co.to(tl.int64)[:, None] * swo
              + (c * swc + kh * swh + kw * sww)[None, :])
    tl.store(dw_ptr + offs_w, acc.to(dw_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _conv_act_grad_kernel(dy_ptr, z_ptr, dz_ptr, part_ptr,
                          COUT, OH, OW, P,
                          sdn, sdc, sdh, sdw, szn, szc, szh, szw,
                          ACT: tl.constexpr, COL_SUM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """dz = dy * act'(z) (dz and z share y's strides; skipped for ACT "none") and, with COL_SUM, the sum of
    dz over this tile's pixels into part[pid_p, c] (fp32); grid (pixel tiles, channel tiles)."""
    pid_p = tl.program_id(0)
    offs_p = pid_p.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = offs_p < P
    c_ok = offs_c < COUT
    mask = p_ok[:, None] & c_ok[None, :]
    n, oh, ow = pixel(offs_p, OH, OW)
    cc = offs_c.to(tl.int64)[None, :]
    dy = tl.load(dy_ptr + (n * sdn + oh * sdh + ow * sdw)[:, None] + cc * sdc, mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    if ACT != "none":
        offs_z = (n * szn + oh * szh + ow * szw)[:, None] + cc * szc
        z = tl.load(z_ptr + offs_z, mask=mask, other=0.0).to(tl.float32)
        dy = dy * activation_grad(z, ACT)
        tl.store(dz_ptr + offs_z, dy.to(dz_ptr.dtype.element_ty), mask=mask)
    if COL_SUM:
        tl.store(part_ptr + pid_p * COUT + offs_c, tl.sum(tl.where(mask, dy, 0.0), axis=0), mask=c_ok)


# --- 3. Launchers ----------------------------------------------------------------------------------------

# Tiles (BLOCK_M, BLOCK_N, BLOCK_K): M = pixels (fwd, dgrad) or output channels (wgrad), N = channels,
# K = the channels reduced per tap (fwd, dgrad) or pixels (wgrad). Clamped to the problem by _fit; the first
# fitting one is the untuned default.
_FWD_CONFIGS = [
    _autotune.config(64, 64, 32, 4, 3),
    _autotune.config(128, 64, 32, 4, 3),
    _autotune.config(128, 128, 32, 8, 3),
    _autotune.config(64, 128, 64, 4, 3),
    _autotune.config(32, 32, 16, 4, 2),
    _autotune.config(128, 64, 64, 4, 4),
    _autotune.config(128, 128, 64, 8, 4),
    _autotune.config(128, 256, 64, 8, 3),
]
# _conv_fwd_rows_kernel (fewer than 16 channels per group): BLOCK_K covers whole padded kernel rows (a 7x7 stem's
# 7 x 4 channels padded to 32 columns: 1-4 rows a step; on the H200 the stems took one row a step, 4 stages).
_ROWS_CONFIGS = [
    _autotune.config(128, 64, 64, 4, 3),
    _autotune.config(64, 64, 64, 4, 4),
    _autotune.config(128, 64, 128, 8, 3),
    _autotune.config(64, 64, 128, 4, 3),
    _autotune.config(128, 64, 32, 4, 4),
    _autotune.config(128, 128, 64, 8, 3),
]
# The TMA forward (_conv_fwd_tma_kernel): TH x TW output pixels, BLOCK_N channels, BLOCK_K input channels a
# step, OCC programs per SM (0: one per tile); on Hopper the untuned default where it applies (0.64-0.73x
# cuDNN on ResNet's stride-1 3x3 convs, where the pointer kernel gave 0.42-0.56x). The 8-warp tile, once set
# aside for 4-15x the error of the others on the 14x14 shape, now gives cuDNN's error on all four ResNet
# shapes (scratch/probe_tma8.py, fp16 2.1e-4) and is the fastest there (41 us vs 45);
# test_tma_forward_resnet_shapes holds every config to the 2x rule.
_FWD_TMA_CONFIGS = [
    dict(TH=8, TW=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, OCC=0),
    dict(TH=8, TW=8, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, OCC=0),
    dict(TH=8, TW=8, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, OCC=0),
    dict(TH=8, TW=16, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, OCC=0),
    dict(TH=8, TW=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, OCC=0),
    dict(TH=8, TW=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, OCC=1),
    dict(TH=8, TW=8, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, OCC=1),
    dict(TH=8, TW=8, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, OCC=2),
]
_DGRAD_CONFIGS = _FWD_CONFIGS
# The direct kernels for one input channel per group (depthwise): spatial tiles of TH x TW pixels x BLOCK_N
# channels, clamped to the image by _candidates. Forward order from the probe of 2026-11-22 (scratch/probe_dw.py,
# CvT-13's depthwise shapes, bf16 batch 64 on the H200): (2, 16) x 64 won or came within 5% on all six.
_DW_CONFIGS = [
    dict(TH=2, TW=16, BLOCK_N=64, num_warps=4),
    dict(TH=4, TW=8, BLOCK_N=64, num_warps=4),
    dict(TH=1, TW=32, BLOCK_N=64, num_warps=4),
    dict(TH=8, TW=8, BLOCK_N=64, num_warps=8),
    dict(TH=8, TW=8, BLOCK_N=32, num_warps=4),
    dict(TH=2, TW=8, BLOCK_N=64, num_warps=2),
    dict(TH=4, TW=4, BLOCK_N=128, num_warps=4),
]
_DW_DGRAD_CONFIGS = _DW_CONFIGS
# The depthwise 3x3 forward's walk (_conv_dw3_fwd_kernel): TH output rows of TW pixels x BLOCK_N channels. Order
# from the probe of 2026-11-24 with the loads two rows ahead (scratch/probe_dw7.py, CvT-13's six depthwise shapes,
# bf16 batch 64, H200): 16 x 8 x 64 won or came within 8% on all six. Wide rows last, for NCHW (seed 003's one channel).
_DW3_CONFIGS = [
    dict(TH=16, TW=8, BLOCK_N=64, num_warps=4),
    dict(TH=8, TW=16, BLOCK_N=64, num_warps=4),
    dict(TH=16, TW=16, BLOCK_N=64, num_warps=8),
    dict(TH=8, TW=4, BLOCK_N=64, num_warps=1),
    dict(TH=8, TW=8, BLOCK_N=64, num_warps=4),
    dict(TH=4, TW=8, BLOCK_N=128, num_warps=4),
    dict(TH=4, TW=32, BLOCK_N=32, num_warps=4),
]
# The depthwise 3x3 weight gradient's walk (_conv_dw3_wgrad_kernel): nine fp32 sums, three dz rows and three input
# columns of TW x BLOCK_N live in registers; taller tiles write fewer partials. sm_90 SASS (scratch/sass_wg.py):
# 8 elements a thread take 255 registers at 16 bits (loads two rows ahead; 166 one row ahead) and spill in fp32, 4
# take 102-115.
_DW3_WGRAD_CONFIGS = [
    dict(TH=16, TW=16, BLOCK_N=64, num_warps=4),
    dict(TH=8, TW=16, BLOCK_N=64, num_warps=4),
    dict(TH=32, TW=16, BLOCK_N=64, num_warps=4),
    dict(TH=16, TW=8, BLOCK_N=128, num_warps=4),
    dict(TH=16, TW=8, BLOCK_N=64, num_warps=4),
    dict(TH=16, TW=16, BLOCK_N=32, num_warps=4),
]
# Taller tiles for the weight gradient: fewer fp32 partials (KH*KW*BLOCK_N per tile) to write and sum, and
# more pixels per thread summed before the shuffles of each tap's tree sum. On sm_90 the 64-elements-a-thread
# tiles halve the shuffles per pixel at 16 bits without spills; in fp32 they spill.
_DW_WGRAD_CONFIGS = [
    dict(TH=8, TW=16, BLOCK_N=32, num_warps=4),
    dict(TH=8, TW=8, BLOCK_N=64, num_warps=4),
    dict(TH=8, TW=16, BLOCK_N=64, num_warps=8),
    dict(TH=16, TW=16, BLOCK_N=32, num_warps=4),
    dict(TH=16, TW=16, BLOCK_N=64, num_warps=8),
]
_WGRAD_CONFIGS = [
    _autotune.config(32, 64, 64, 4, 3, SPLIT_K=1),
    _autotune.config(64, 64, 64, 4, 3, SPLIT_K=1),
    _autotune.config(64, 128, 64, 8, 3, SPLIT_K=1),
    _autotune.config(32, 64, 64, 4, 3, SPLIT_K=4),
    _autotune.config(64, 64, 32, 4, 3, SPLIT_K=16),
    _autotune.config(64, 64, 64, 4, 3, SPLIT_K=64),
    _autotune.config(128, 128, 64, 8, 3, SPLIT_K=64),
    _autotune.config(128, 64, 64, 4, 3, SPLIT_K=32),
]
# The TMA weight gradient (_conv_wgrad_tma_kernel): BLOCK_M output x BLOCK_N input channels of one tap, TH x TW
# pixels a step; the N * pixel tiles split so that about OCC programs per SM run.
_WGRAD_TMA_CONFIGS = [
    dict(TH=8, TW=16, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, OCC=2),
    dict(TH=8, TW=16, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, OCC=2),
    dict(TH=8, TW=8, BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4, OCC=2),
    dict(TH=8, TW=16, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, OCC=4),
    dict(TH=8, TW=16, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, OCC=1),
]

_plans: dict = {}


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: tf32 where torch's convolutions allow it (cudnn.allow_tf32), else true fp32
    as tf32x3 (`_gemm.precision`)."""
    return _gemm.precision(dtype, torch.backends.cudnn.allow_tf32 and not _runtime.INTERPRET)


def _fit(cfg: dict, m: int, n: int, k: int, size: int, precision: str) -> dict:
    """cfg with its blocks shrunk to the problem (powers of two, at least 16 for tl.dot)."""
    cfg = dict(cfg)
    for name, extent in (("BLOCK_M", m), ("BLOCK_N", n), ("BLOCK_K", k)):
        cfg[name] = max(16, min(cfg[name], _runtime.next_power_of_2(max(extent, 1))))
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], _gemm.max_k(precision, size, tf32x3_k=64))
    return cfg


def _configs(configs, m, n, k, size, precision):
    """The implicit GEMM's candidates fitted to the problem (_fit), their stages cut to the shared memory."""
    out = []
    for cfg in configs:
        cfg = _fit(cfg, m, n, k, size, precision)
        if cfg not in out:
            out.append(cfg)
    return _gemm_staged(out, size)


def _gemm_staged(configs, size: int) -> list:
    """_staged for the implicit GEMM's tiles (fp32's 128 x 128 x 64 x 4 stages would need 256 KB)."""
    return _staged(configs, lambda c: (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * size)


def _out_format(x, w):
    return torch.channels_last if is_channels_last(x) or is_channels_last(w) else torch.contiguous_format


def conv_out_hw(H, W, KH, KW, stride, padding, dilation):
    """padding: (top, bottom, left, right)."""
    oh = (H + padding[0] + padding[1] - dilation[0] * (KH - 1) - 1) // stride[0] + 1
    ow = (W + padding[2] + padding[3] - dilation[1] * (KW - 1) - 1) // stride[1] + 1
    return oh, ow


def _geom(x, w, stride, padding, dilation, groups):
    N, C, H, W = x.shape
    COUT, C_G, KH, KW = w.shape
    OH, OW = conv_out_hw(H, W, KH, KW, stride, padding, dilation)
    return N, C_G, H, W, COUT // groups, OH, OW, KH, KW


def _geometry_meta(stride, padding, dilation):
    return dict(STRIDE_H=stride[0], STRIDE_W=stride[1], PAD_H=padding[0], PAD_W=padding[2],
                DIL_H=dilation[0], DIL_W=dilation[1])


def _conv_meta(stride, padding, dilation, precision):
    return dict(_geometry_meta(stride, padding, dilation), PRECISION=precision)


def _candidates(direct, gemm, depthwise: bool, oh: int, ow: int, channels: int, walk=()):
    """The configs tagged with their kernel: where depthwise (one input channel per group), the depthwise 3x3
    walk's (`walk`: given where it applies) and the direct kernel's first, their tiles clamped to the oh x ow
    image and their channel tile to the channels; then the implicit GEMM's (KERNEL "gemm" unless tagged
    already), still a candidate."""
    gemm = [dict(dict(KERNEL="gemm"), **c) for c in gemm]
    if not depthwise:
        return gemm
    fitted = []
    for kernel, configs in (("walk", walk), ("direct", direct)):
        for cfg in configs:
            cfg = dict(cfg, KERNEL=kernel, TH=min(cfg["TH"], _runtime.next_power_of_2(oh)),
                       TW=min(cfg["TW"], _runtime.next_power_of_2(ow)),
                       BLOCK_N=max(16, min(cfg["BLOCK_N"], _runtime.next_power_of_2(channels))))
            if cfg not in fitted:
                fitted.append(cfg)
    return fitted + gemm


def _rows_pad(kw: int, c_g: int) -> int:
    """_conv_fwd_rows_kernel's padded kernel row: KW x CP columns (CP: C_G up to a power of two), a power of two."""
    return _runtime.next_power_of_2(kw * _runtime.next_power_of_2(c_g))


def _rows_weight(w: torch.Tensor, kwp: int, traced: bool) -> torch.Tensor:
    """The weight as _conv_fwd_rows_kernel reads it: [KH, KWP, COUT], column kw * CP + c of row kh holding
    w[co, c, kh, kw], zeros where c >= C_G or past KW x CP (_derived)."""
    def make(w):
        cout, c_g, kh, kw = w.shape
        cp = _runtime.next_power_of_2(c_g)
        rows = F.pad(w.permute(2, 3, 1, 0), (0, 0, 0, cp - c_g)).reshape(kh, kw * cp, cout)
        return F.pad(rows, (0, 0, 0, kwp - kw * cp)).contiguous()
    return _derived(w, f"rows{kwp}", make, traced)


def _rows_launcher(x, w, y, r, padding, groups: int, grid, OH: int, OW: int, P: int, meta: dict, traced: bool):
    """The launch of _conv_fwd_rows_kernel (grid and _conv_fwd_kernel's constexprs given: its padding goes to
    the copy) after _pad_kernel's copy of x: padded by the conv's padding, C_G channels a group padded to CP,
    channels_last."""
    N, C, H, W = x.shape
    COUT, C_G, KH, KW = w.shape
    CP = _runtime.next_power_of_2(C_G)
    HP, WP = H + padding[0] + padding[1], W + padding[2] + padding[3]
    block_c = min(_runtime.next_power_of_2(groups * CP), 64)
    block_w = max(1, 1024 // block_c)
    pad = Launch(_pad_kernel, (N * HP, _runtime.cdiv(WP, block_w), _runtime.cdiv(groups * CP, block_c)),
                 dict(PAD_H=padding[0], PAD_W=padding[2], CP=CP, BLOCK_W=block_w, BLOCK_C=block_c), traced=traced)
    pad_scalars = (C_G, groups, H, W, HP, WP, *x.stride())
    row_pad = min(_rows_pad(KW, C_G), meta["BLOCK_K"])
    kwp = _runtime.cdiv(KW * CP, row_pad) * row_pad
    meta = {k: v for k, v in meta.items() if k not in ("PAD_H", "PAD_W")}
    launch = Launch(_conv_fwd_rows_kernel, grid, dict(meta, CP=CP, ROW_PAD=row_pad), traced=traced)
    scalars = (groups, HP, WP, COUT // groups, OH, OW, P, KH, KW, kwp, COUT, *y.stride(), *r.stride())

    def run(x, w, *tensors):
        xp = torch.empty((N, HP, WP, groups * CP), device=x.device, dtype=x.dtype)
        pad(x, xp, *pad_scalars)
        launch(xp, _rows_weight(w, kwp, traced), *tensors, *scalars)
    return run


def _tiles(oh: int, ow: int, cfg: dict) -> int:
    """Spatial tiles of the direct kernels in one oh x ow image (_spatial_tile)."""
    return _runtime.cdiv(oh, cfg["TH"]) * _runtime.cdiv(ow, cfg["TW"])


def _direct_tag(direct: bool, oh: int, ow: int) -> tuple:
    """The tuning key's part for the direct kernel: whether it is a candidate, and the image size its tiles
    are clamped to."""
    return ("direct", _runtime.next_power_of_2(oh), _runtime.next_power_of_2(ow)) if direct else ()


def _walk_rows(oh: int, th: int) -> int:
    """The rows of a walk's tile (unrolled: any count, not only powers of two): the oh rows split evenly into as
    few tiles as th rows a tile allow (28 rows and th 16: two tiles of 14, not 16 + 12 with 4 rows idle). A choice
    that only tunes (the walks take any rows a tile): a symbolic oh counts by its traced value, without a guard."""
    oh = _runtime.size_hint(oh)
    return _runtime.cdiv(oh, _runtime.cdiv(oh, th))


def _walk_meta(stride, padding) -> dict:
    """The walks' geometry constexprs (padding: top, bottom, left, right; the bottom and right ones follow from
    OH and OW)."""
    return dict(STRIDE_H=stride[0], STRIDE_W=stride[1], PAD_H=padding[0], PAD_W=padding[2])


def _dw3_walks(direct: bool, KH: int, KW: int, stride, dilation) -> bool:
    """Whether the depthwise 3x3 walks (forward, weight gradient) take this conv: the direct kernels do, the
    kernel is 3x3, dilation 1, the row stride 1 or 2."""
    return direct and (KH, KW) == (3, 3) and tuple(dilation) == (1, 1) and stride[0] <= 2


def _direct_fits(*ts) -> bool:
    """Whether the direct depthwise kernels' int32 offsets inside one image (all but the batch dim) reach every
    element of these 4-D tensors."""
    return all(sum((size - 1) * abs(st) for size, st in zip(t.shape[1:], t.stride()[1:])) < 2**31 for t in ts)


_DERIVED: dict = {}


def frozen(t: torch.Tensor) -> torch.Tensor:
    """Marks t, a tensor dropin made and never writes again (a folded weight), as one whose derived copies may be
    cached (`_derived`); returns it."""
    t._dropin_frozen = True
    return t


def _derived(w: torch.Tensor, kind: str, make, traced: bool) -> torch.Tensor:
    """make(w): a copy of a weight in the layout a kernel reads fastest, made once per version of the weight's
    data (`_common.versions`; every call for an inference tensor) and kept while the weight lives. Only for
    parameters and `frozen` tensors in eager calls; made anew for any other (compiled code reuses its buffers and
    writes them without bumping their version: torch.compile of an injected CvT read a stale copy of a folded
    weight), traced (the copy is part of the compiled graph) and during a CUDA graph capture (the copy is
    captured, so that each replay reads the weight as it is then: a kept one goes stale, or is freed), and for
    weights that require grad: FSDP2 gathers each step's weights into the same tensor without bumping its version
    (tests/test_distributed.py: the convs then read an earlier step's weights, in training and in no-grad calls
    between steps), so a trainable weight's copy is made anew in every eager call (frozen weights keep theirs)."""
    if not (isinstance(w, torch.nn.Parameter) or getattr(w, "_dropin_frozen", False)) or traced \
            or _runtime.capturing() or w.requires_grad:
        return make(w)
    key = (id(w), kind)
    hit = _DERIVED.get(key)
    version = versions(w)
    if hit is not None and hit[0]() is w and version is not None and hit[1] == version:
        return hit[2]
    out = make(w)
    if version is not None:
        _DERIVED[key] = (weakref.ref(w, lambda _, key=key: _DERIVED.pop(key, None)), version, out)
    return out


def _co_major(w: torch.Tensor, traced: bool) -> torch.Tensor:
    """The depthwise weight [COUT, 1, KH, KW] with the output channel innermost (stride 1), so that the direct
    kernels read a tap's weights as one vector instead of a scalar load per channel (measured: 15-20% of the
    depthwise forward)."""
    if w.stride(0) == 1 or w.shape[0] == 1:
        return w
    return _derived(w, "co_major", lambda w: w.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2), traced)


def _taps_f32(w: torch.Tensor, traced: bool) -> torch.Tensor:
    """The depthwise 3x3 weight [COUT, 1, 3, 3] as the walk (_conv_dw3_fwd_kernel) reads it: fp32 [9, COUT], tap
    major, so a tap's weights are one vector load and need no conversion. (One copy: `.float()` keeps the
    transposed strides, so `.contiguous()` after it copies twice.)"""
    def make(w):
        return torch.empty((9, w.shape[0]), device=w.device, dtype=torch.float32).copy_(w.reshape(w.shape[0], 9).t())
    return _derived(w, "taps_f32", make, traced)


def _flipped(w: torch.Tensor, traced: bool) -> torch.Tensor:
    """The weight of the convolution that is the input gradient of a stride-1 one: [C, COUT, KH, KW], the taps
    mirrored, channels_last (the TMA forward's layout)."""
    return _derived(w, "flipped", lambda w: w.flip(2, 3).transpose(0, 1).contiguous(memory_format=torch.channels_last),
                    traced)


def _tma_wgrad_configs(dz, x, stride, groups: int, precision: str, traced: bool) -> list:
    """_conv_wgrad_tma_kernel's candidates, none where it does not apply: the TMA forward's conditions on x
    (_tma_fwd_configs), and dz dense channels_last with at least 16 channels in 16-byte rows. A pixel tile is
    one MMA chain, whose every step truncates in true fp32: there at most _gemm.max_k pixels (TH cut), as the
    GEMMs' BLOCK_K (with 128-pixel tiles a short reduction reached 2x cuDNN's error; 64 keep it at 0.7x that)."""
    size, cout = dz.element_size(), dz.shape[1]  # (dz's layout checked in w's place)
    if not (_tma_fwd_configs(x, dz, stride, groups, traced) and cout >= 16 and cout * size % 16 == 0):
        return []
    pixels = _gemm.max_k(precision, size, tf32x3_k=64)
    fitting = [dict(c, KERNEL="tma", TH=min(c["TH"], max(1, pixels // c["TW"]))) for c in _WGRAD_TMA_CONFIGS
               if stride[1] == 1 or x.shape[1] % c["BLOCK_N"] == 0]
    return _staged(fitting, lambda c: c["TH"] * c["TW"] * (c["BLOCK_M"] + c["BLOCK_N"]) * size)


def _dgrad_as_conv(dz, x, w, stride, padding, dilation, groups: int, traced: bool):
    """(weight, padding) of the stride-1 convolution of dz that gives the input gradient: _flipped(w), padded by
    dilation * (K - 1) - the forward's padding (top, bottom, left, right), where the TMA forward takes it: one
    group, stride 1, channels_last x and dz, the forward's padding at most the kernel's reach. None elsewhere."""
    if tuple(stride) != (1, 1) or groups != 1 or not x.is_contiguous(memory_format=torch.channels_last):
        return None
    reach = [dilation[0] * (w.shape[2] - 1)] * 2 + [dilation[1] * (w.shape[3] - 1)] * 2
    if any(p > r for p, r in zip(padding, reach)):
        return None
    flipped = _flipped(w, traced)
    if not _tma_fwd_configs(dz, flipped, (1, 1), 1, traced):
        return None
    return flipped, tuple(r - p for p, r in zip(padding, reach))


def _dw3_dgrad(x, w, stride, padding, dilation, groups: int) -> bool:
    """Whether the input gradient of this depthwise 3x3 (stride and dilation 1, multiplier 1, padding at most 2,
    x dense) is taken as the forward's walk over dz with the taps mirrored and padding 2 - padding."""
    return (groups == x.shape[1] == w.shape[0] and tuple(w.shape[1:]) == (1, 3, 3) and tuple(stride) == (1, 1)
            and tuple(dilation) == (1, 1) and max(padding) <= 2
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)))


def _pick(name, key, configs, launcher, args):
    def prepare(cfg):  # a launch to time: built once, so it is timed on its fast path
        launch = launcher(cfg)
        return lambda: launch(*args)
    return launcher(_autotune.pick(name, key, configs, prepare))


def _tma_fwd_configs(x, w, stride, groups: int, traced: bool) -> list:
    """_conv_fwd_tma_kernel's candidates for this forward, none where it does not apply. It takes: Hopper, one
    group, at least 16 channels, x and w dense channels_last with 16-byte aligned pointers and channel rows,
    strides dividing H and W (its view of x by stride phase), and with a column stride over 1 only channel
    blocks that divide C (a box never reaches into the next phase's channels)."""
    size, C, H, W = x.element_size(), *x.shape[1:]
    if not (_runtime.is_hopper(x.device.index or 0) and groups == 1 and C >= 16 and C * size % 16 == 0
            and H % stride[0] == 0 and W % stride[1] == 0
            and all(t.is_contiguous(memory_format=torch.channels_last) and aligned(t, traced) for t in (x, w))):
        return []
    return _staged([dict(c, KERNEL="tma") for c in _FWD_TMA_CONFIGS if stride[1] == 1 or C % c["BLOCK_K"] == 0],
                   lambda c: (c["TH"] * c["TW"] + c["BLOCK_N"]) * c["BLOCK_K"] * size)


def _staged(configs: list, stage_bytes) -> list:
    """The TMA, rows and implicit GEMM configs with their pipeline stages cut to what 200 KB of shared memory holds
    (stage_bytes(config): one stage's tiles; fp32 doubles them), those with fewer than 2 stages left out."""
    out = []
    for c in configs:
        stages = min(c["num_stages"], 200 * 1024 // stage_bytes(c))
        if stages >= 2 and dict(c, num_stages=stages) not in out:
            out.append(dict(c, num_stages=stages))
    return out


def _fwd_impl(x, w, bias, residual, stride, padding, dilation, groups: int, activation: str, save_preact: bool,
              out: Optional[torch.Tensor] = None, traced: bool = False):
    """(y, z): y into `out` where given (any strides; not with save_preact). traced: under torch.compile
    (`_dispatch`)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = _geom(x, w, stride, padding, dilation, groups)
    fmt = _out_format(x, w)
    y = out if out is not None else empty_in((N, COUT_G * groups, OH, OW), fmt, x.dtype, x.device)
    z = torch.empty_like(y) if save_preact else y.new_empty(0)
    if y.numel() == 0:
        return y, z
    if C_G * KH * KW == 0:  # an empty reduction: bias (and residual) only
        y.copy_((bias if bias is not None else y.new_zeros(1)).view(1, -1, 1, 1).expand_as(y))
        y.add_(residual) if residual is not None else None
        z.copy_(y) if save_preact else None
        y.copy_(activation_ref(y, None if activation == "none" else activation))
        return y, z
    run, tensors = _fwd_plan(x, w, y, z, bias, residual, stride, padding, dilation, groups, activation, save_preact,
                             traced)
    run(*tensors)
    return y, z


def _fwd_plan(x, w, y, z, bias, residual, stride, padding, dilation, groups: int, activation: str,
              save_preact: bool, traced: bool):
    """(run, tensors): the forward's plan for this signature, run(*tensors), and its tensors (x, w, y, bias, z,
    residual; absent stand-ins for unused ones)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = _geom(x, w, stride, padding, dilation, groups)
    fmt = _out_format(x, w)
    precision = _precision(x.dtype)
    r = y if residual is None else residual
    key = ("fwd", x.shape, x.stride(), w.shape, w.stride(), y.stride(), r.stride(), x.dtype,
           *(None if t is None else aligned(t, traced) for t in (x, w, y, bias, residual)),
           stride, padding, dilation, groups, activation, save_preact, precision, fmt)
    tensors = (x, w, y, absent(y, traced) if bias is None else bias, z if save_preact else absent(y, traced),
               absent(y, traced) if residual is None else residual)

    def make():
        P = N * OH * OW
        scalars = (C_G, H, W, COUT_G, OH, OW, P, KH, KW, *x.stride(), *w.stride(), *y.stride(), *r.stride())
        rows = C_G < 16  # few channels per group: _conv_fwd_rows_kernel over a padded copy of x
        epilogue = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=activation,
                        STORE_Z=save_preact)

        def launcher(cfg):
            cfg = dict(cfg)
            kernel = cfg.pop("KERNEL")
            if kernel == "tma":
                tiles = N * _tiles(OH, OW, cfg) * _runtime.cdiv(COUT_G, cfg["BLOCK_N"])
                occupancy = cfg.pop("OCC")  # programs per SM; 0: one program per tile
                programs = min(tiles, occupancy * _runtime.num_sms(x.device.index or 0)) if occupancy else tiles
                meta = dict(_geometry_meta(stride, padding, dilation), KH=KH, KW=KW, PRECISION=precision, **epilogue,
                            **cfg)
                launch = Launch(_conv_fwd_tma_kernel, (programs,), meta, scratch=True, traced=traced)
                tma_scalars = (N, C_G, H, W, COUT_G, OH, OW, *y.stride(), *r.stride(), programs)
                return lambda *tensors: launch(*tensors, *tma_scalars)
            if kernel == "walk":
                cfg["TH"] = _walk_rows(OH, cfg["TH"])
                grid = (N * _tiles(OH, OW, cfg), _runtime.cdiv(COUT_G * groups, cfg["BLOCK_N"]))
                launch = Launch(_conv_dw3_fwd_kernel, grid, dict(_walk_meta(stride, padding), **epilogue, **cfg),
                                traced=traced)
                walk_scalars = (H, W, COUT_G * groups, COUT_G, OH, OW, *x.stride(), *y.stride(), *r.stride())
                return lambda x, w, *tensors: launch(x, _taps_f32(w, traced), *tensors, *walk_scalars)
            if kernel == "direct":
                ws = _co_major(w, traced).stride()
                dw_scalars = (H, W, COUT_G * groups, COUT_G, OH, OW, *x.stride(), ws[0], *ws[2:], *y.stride(),
                              *r.stride())
                grid = (N * _tiles(OH, OW, cfg), _runtime.cdiv(COUT_G * groups, cfg["BLOCK_N"]))
                meta = dict(_geometry_meta(stride, padding, dilation), KH=KH, KW=KW, **epilogue, **cfg)
                launch = Launch(_conv_dw_fwd_kernel, grid, meta, traced=traced)
                return lambda x, w, *tensors: launch(x, _co_major(w, traced), *tensors, *dw_scalars)
            grid = (_runtime.cdiv(P, cfg["BLOCK_M"]), _runtime.cdiv(COUT_G, cfg["BLOCK_N"]), groups)
            meta = dict(_conv_meta(stride, padding, dilation, precision), **epilogue, **cfg)
            if kernel == "rows":
                return _rows_launcher(x, w, y, r, padding, groups, grid, OH, OW, P, meta, traced)
            launch = Launch(_conv_fwd_kernel, grid, meta, traced=traced)
            return lambda *tensors: launch(*tensors, *scalars)

        if rows:  # BLOCK_K fitted to KH whole rows of KW x CP columns, padded
            fitted = _configs(_ROWS_CONFIGS, P, COUT_G, KH * _rows_pad(KW, C_G), x.element_size(), precision)
            gemm = [dict(c, KERNEL="rows") for c in fitted]
        else:
            gemm = _configs(_FWD_CONFIGS, P, COUT_G, C_G, x.element_size(), precision)
        direct = C_G == 1 and _direct_fits(x, y, r)
        walk = _dw3_walks(direct, KH, KW, stride, dilation)
        configs = _candidates(_DW_CONFIGS, gemm, direct, OH, OW, COUT_G * groups, _DW3_CONFIGS if walk else ())
        tma_configs = _tma_fwd_configs(x, w, stride, groups, traced)
        tma = bool(tma_configs)
        configs = tma_configs + configs
        # one channel per group is told apart from 2-15 (same bucket): only there is the direct kernel a candidate
        tkey = ("fwd", x.dtype, precision, fmt, KH, KW, stride, rows, residual is not None,
                *map(_autotune.bucket, (P, COUT_G, C_G, groups)), *_direct_tag(direct, OH, OW),
                *(("tma",) if tma else ()), *(("walk",) if walk else ()))
        return _pick("conv2d", tkey, configs, launcher, tensors)

    return plan(_plans, key, make, traced), tensors


def _fwd_shortcut(x, w, y, bias, residual, stride, padding, dilation, groups: int, activation: str, out: bool):
    """conv2d's later eager calls of this signature (`Shortcuts`): (input, weight, bias, residual, out) -> y, the
    forward's plan on a new output laid out as this call's y, or with `out` on the given out after its checks
    (x, w, y, bias, residual: this call's own tensors)."""
    if y.numel() == 0 or x.shape[1] // groups * w.shape[2] * w.shape[3] == 0:
        return None
    run = _fwd_plan(x, w, y, y, bias, residual, stride, padding, dilation, groups, activation, False, False)[0]

    def into(y, x, w, bias, residual, *out):
        run(x, w, y, y if bias is None else bias, y, y if residual is None else residual)
    if not out:
        return writing(y, into)

    def shortcut(x, w, bias, residual, out):
        _check_out(out, x, w, bias, residual)
        into(out, x, w, bias, residual)
        return out
    return shortcut


def _dgrad_impl(dz, x, w, stride, padding, dilation, groups: int, traced: bool = False):
    """The gradient of the input x (same strides as x where x is dense, else contiguous). Where the TMA forward
    takes it (_dgrad_as_conv), or the depthwise 3x3 walk (_dw3_dgrad), a stride-1 convolution of dz; else
    _conv_dgrad_kernel or the direct kernel."""
    if x.is_contiguous(memory_format=torch.channels_last):  # (a channels_last model's dz is; a copy otherwise)
        dz = dz.contiguous(memory_format=torch.channels_last)
    as_conv = _dgrad_as_conv(dz, x, w, stride, padding, dilation, groups, traced)
    if as_conv is not None:
        return _fwd_impl(dz, as_conv[0], None, None, (1, 1), as_conv[1], dilation, 1, "none", False, traced=traced)[0]
    if _dw3_dgrad(x, w, stride, padding, dilation, groups):
        dx = _fwd_impl(dz, _derived(w, "mirrored", lambda w: w.flip(2, 3), traced), None, None, (1, 1),
                       tuple(2 - p for p in padding), (1, 1), groups, "none", False, traced=traced)[0]
        return dx if dx.stride() == x.stride() else torch.empty_like(x).copy_(dx)  # (dz's layout was not x's)
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = _geom(x, w, stride, padding, dilation, groups)
    dx = torch.empty_like(x)
    if dx.numel() == 0:
        return dx
    if dz.numel() == 0 or COUT_G == 0:
        return dx.zero_()
    precision = _precision(x.dtype)
    key = ("dgrad", dz.shape, dz.stride(), dx.stride(), w.shape, w.stride(), x.shape, x.dtype,
           *(aligned(t, traced) for t in (dz, w, dx)), stride, padding, dilation, groups, precision)

    def make():
        P = N * H * W

        def launcher(cfg):
            cfg = dict(cfg)
            if cfg.pop("KERNEL") == "direct":
                ws = _co_major(w, traced).stride()
                scalars = (groups, H, W, COUT_G, OH, OW, *dz.stride(), ws[0], *ws[2:], *dx.stride())
                grid = (N * _tiles(H, W, cfg), _runtime.cdiv(groups, cfg["BLOCK_N"]))
                meta = dict(_geometry_meta(stride, padding, dilation), KH=KH, KW=KW, **cfg)
                launch = Launch(_conv_dw_dgrad_kernel, grid, meta, traced=traced)
                return lambda dz, w, dx: launch(dz, _co_major(w, traced), dx, *scalars)
            scalars = (C_G, H, W, COUT_G, OH, OW, P, KH, KW, *dz.stride(), *w.stride(), *dx.stride())
            grid = (_runtime.cdiv(P, cfg["BLOCK_M"]), _runtime.cdiv(C_G, cfg["BLOCK_N"]), groups)
            launch = Launch(_conv_dgrad_kernel, grid, dict(_conv_meta(stride, padding, dilation, precision), **cfg),
                            traced=traced)
            return lambda dz, w, dx: launch(dz, w, dx, *scalars)

        gemm = _configs(_DGRAD_CONFIGS, P, C_G, COUT_G, x.element_size(), precision)
        direct = C_G == 1 and _direct_fits(dz, dx)
        configs = _candidates(_DW_DGRAD_CONFIGS, gemm, direct, H, W, groups)
        tkey = ("dgrad", x.dtype, precision, is_channels_last(x), KH, KW, stride, C_G == 1,
                *map(_autotune.bucket, (P, COUT_G, C_G, groups)), *_direct_tag(direct, H, W))
        return _pick("conv2d", tkey, configs, launcher, (dz, w, dx))

    plan(_plans, key, make, traced)(dz, w, dx)
    return dx


def _wgrad_impl(dz, x, w, stride, padding, dilation, groups: int, traced: bool = False):
    """The gradient of the weight w (same strides as w where w is dense, else contiguous)."""
    if x.is_contiguous(memory_format=torch.channels_last):  # (a channels_last model's dz is; a copy otherwise)
        dz = dz.contiguous(memory_format=torch.channels_last)
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = _geom(x, w, stride, padding, dilation, groups)
    dw = torch.empty_like(w)
    if dw.numel() == 0:
        return dw
    if dz.numel() == 0:
        return dw.zero_()
    precision = _precision(x.dtype)
    key = ("wgrad", dz.shape, dz.stride(), x.shape, x.stride(), w.shape, dw.stride(), x.dtype,
           *(aligned(t, traced) for t in (dz, x, dw)), stride, padding, dilation, groups, precision)

    def make():
        P = N * OH * OW
        if P >= 2**31:
            raise RuntimeError(f"conv2d: dropin's weight gradient takes fewer than 2^31 output pixels, got N*OH*OW "
                               f"= {P}")
        cols = C_G * KH * KW
        tap_major = is_channels_last(x) and C_G > 1
        meta0 = _conv_meta(stride, padding, dilation, precision)
        base = (C_G, H, W, COUT_G, OH, OW, P, KH, KW, *dz.stride(), *x.stride())

        def launcher(cfg):
            cfg = dict(cfg)
            kernel = cfg.pop("KERNEL")
            if kernel == "tma":  # fp32 partials per split [splits, COUT, KH, KW, C], summed
                out_tiles = KH * KW * _runtime.cdiv(COUT_G, cfg["BLOCK_M"]) * _runtime.cdiv(C_G, cfg["BLOCK_N"])
                pixel_tiles = N * _tiles(OH, OW, cfg)
                programs = cfg.pop("OCC") * _runtime.num_sms(x.device.index or 0)
                per_split = _runtime.cdiv(pixel_tiles, max(1, min(pixel_tiles, programs // out_tiles)))
                splits = _runtime.cdiv(pixel_tiles, per_split)
                launch = Launch(_conv_wgrad_tma_kernel, (out_tiles, splits), dict(meta0, KH=KH, KW=KW, **cfg),
                                scratch=True, traced=traced)
                tma_scalars = (N, C_G, H, W, COUT_G, OH, OW, per_split)

                def run_tma(dz, x, dw):
                    part = torch.empty((splits, COUT_G, KH, KW, C_G), device=dz.device, dtype=torch.float32)
                    launch(dz, x, part, *tma_scalars)
                    dw.copy_(part.sum(0).permute(0, 3, 1, 2))
                return run_tma
            if kernel in ("direct", "walk"):  # fp32 partial sums per pixel tile, then one sum over the tiles
                if kernel == "walk":
                    cfg["TH"] = _walk_rows(OH, cfg["TH"])
                    direct_kernel, meta = _conv_dw3_wgrad_kernel, dict(_walk_meta(stride, padding), **cfg)
                else:
                    direct_kernel = _conv_dw_wgrad_kernel
                    meta = dict(_geometry_meta(stride, padding, dilation), KH=KH, KW=KW, **cfg)
                grid = (N * _tiles(OH, OW, cfg), _runtime.cdiv(groups * COUT_G, cfg["BLOCK_N"]))
                launch = Launch(direct_kernel, grid, meta, traced=traced)
                dw_scalars = (H, W, groups * COUT_G, COUT_G, OH, OW, *dz.stride(), *x.stride())
                part_shape = (grid[0], KH * KW, groups * COUT_G)
                block_c = min(32, _runtime.next_power_of_2(groups * COUT_G))
                tile_sum = Launch(sum_partials_kernel, (KH * KW, _runtime.cdiv(groups * COUT_G, block_c)),
                                  dict(KW=KW, TAPS=KH * KW, BLOCK_T=64, BLOCK_C=block_c), traced=traced)
                sum_scalars = (grid[0], groups * COUT_G, dw.stride(0), *dw.stride()[2:])

                def run_direct(dz, x, dw):
                    part = torch.empty(part_shape, device=dz.device, dtype=torch.float32)
                    launch(dz, x, part, *dw_scalars)
                    tile_sum(part, dw, *sum_scalars)
                return run_direct
            splits = max(1, min(cfg.pop("SPLIT_K"), _runtime.cdiv(P, cfg["BLOCK_K"])))
            grid = (_runtime.cdiv(COUT_G, cfg["BLOCK_M"]) * _runtime.cdiv(cols, cfg["BLOCK_N"]), groups, splits)
            one_tap = tap_major and C_G % cfg["BLOCK_N"] == 0
            launch = Launch(_conv_wgrad_kernel, grid, dict(meta0, TAP_MAJOR=tap_major, ONE_TAP=one_tap, **cfg),
                            traced=traced)
            if splits == 1:
                scalars = base + (*dw.stride(), 0)
                return lambda dz, x, dw: launch(dz, x, dw, *scalars)
            # fp32 partials [splits, COUT, C_G, KH, KW] laid out in the kernel's column order
            order = (0, 1, 3, 4, 2) if tap_major else (0, 1, 2, 3, 4)
            shape = [(splits, *w.shape)[i] for i in order]
            inverse = [order.index(i) for i in range(5)]
            strides = torch.empty(shape, device="meta").permute(inverse).stride()
            scalars = base + tuple(strides[1:]) + (w.numel(),)

            def run_split(dz, x, dw):  # (its own buffer: Inductor's copy-back of a written view can miscompile)
                partial = torch.empty_strided((splits, *w.shape), strides, device=dz.device, dtype=torch.float32)
                launch(dz, x, partial, *scalars)
                dw.copy_(partial.sum(0))
            return run_split

        gemm = _configs(_WGRAD_CONFIGS, COUT_G, cols, P, x.element_size(), precision)
        direct = C_G == 1 and _direct_fits(dz, x)
        walk = _dw3_walks(direct, KH, KW, stride, dilation)
        tma_configs = _tma_wgrad_configs(dz, x, stride, groups, precision, traced)
        configs = tma_configs + _candidates(_DW_WGRAD_CONFIGS, gemm, direct, OH, OW, groups * COUT_G,
                                            _DW3_WGRAD_CONFIGS if walk else ())
        tkey = ("wgrad", x.dtype, precision, is_channels_last(x), KH, KW, stride, C_G == 1,
                *map(_autotune.bucket, (P, COUT_G, C_G, groups)), *_direct_tag(direct, OH, OW),
                *(("tma",) if tma_configs else ()), *(("walk",) if walk else ()))
        return _pick("conv2d", tkey, configs, launcher, (dz, x, dw))

    plan(_plans, key, make, traced)(dz, x, dw)
    return dw


def _act_grad_impl(dy, z, activation: str, bias_grad: bool, traced: bool = False):
    """(dz, dbias) for y = act(z): dz in z's strides (empty for activation "none", where it is dy) and the
    bias gradient (empty unless bias_grad)."""
    N, COUT, OH, OW = dy.shape
    dz = torch.empty_like(z) if activation != "none" else dy.new_empty(0)
    P = N * OH * OW
    block_p, block_c = 64, min(64, _runtime.next_power_of_2(max(COUT, 1)))
    tiles_p = _runtime.cdiv(P, block_p)
    part = torch.empty((tiles_p, COUT) if bias_grad else (0,), device=dy.device, dtype=torch.float32)
    if P * COUT > 0:
        act = activation != "none"
        launch(_conv_act_grad_kernel, (tiles_p, _runtime.cdiv(COUT, block_c)), dy,
               z if act else absent(dy, traced), dz if act else absent(dy, traced), part, COUT, OH, OW, P,
               *dy.stride(), *(z if act else dy).stride(),
               ACT=activation, COL_SUM=bias_grad, BLOCK_P=block_p, BLOCK_C=block_c, traced=traced)
    if not bias_grad:
        return dz, dy.new_empty(0)
    return dz, column_sums(part, dy.new_empty(COUT), traced) if P * COUT > 0 else dy.new_zeros(COUT)


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ---------------------------------

@torch_op("dropin::conv2d", mutates_args=())
def _fwd_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
            stride: list[int], padding: list[int], dilation: list[int], groups: int, activation: str,
            save_preact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(x, w, bias, residual, tuple(stride), tuple(padding), tuple(dilation), groups, activation,
                     save_preact, traced=True)


@torch_op("dropin::conv2d_out", mutates_args=("out",))
def _fwd_out_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                stride: list[int], padding: list[int], dilation: list[int], groups: int, activation: str,
                out: torch.Tensor) -> None:
    _fwd_impl(x, w, bias, residual, tuple(stride), tuple(padding), tuple(dilation), groups, activation, False, out,
              traced=True)


@torch_op("dropin::conv2d_dgrad", mutates_args=())
def _dgrad_op(dz: torch.Tensor, x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
              dilation: list[int], groups: int) -> torch.Tensor:
    return _dgrad_impl(dz, x, w, tuple(stride), tuple(padding), tuple(dilation), groups, traced=True)


@torch_op("dropin::conv2d_wgrad", mutates_args=())
def _wgrad_op(dz: torch.Tensor, x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
              dilation: list[int], groups: int) -> torch.Tensor:
    return _wgrad_impl(dz, x, w, tuple(stride), tuple(padding), tuple(dilation), groups, traced=True)


@torch_op("dropin::conv2d_act_grad", mutates_args=())
def _act_grad_op(dy: torch.Tensor, z: torch.Tensor, activation: str,
                 bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _act_grad_impl(dy, z, activation, bias_grad, traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_dgrad = switch(_dgrad_op, _dgrad_impl)
_wgrad = switch(_wgrad_op, _wgrad_impl)
_act_grad = switch(_act_grad_op, _act_grad_impl)


# --- 5. Autograd -----------------------------------------------------------------------------------------

class _Conv2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, residual, stride, padding, dilation, groups, activation):
        save_preact = activation != "none" and any(ctx.needs_input_grad[:4])
        y, z = _fwd(x, w, bias, residual, stride, padding, dilation, groups, activation, save_preact)
        ctx.save_for_backward(x, w, z if save_preact else None)
        ctx.args = (stride, padding, dilation, groups)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, z = ctx.saved_tensors
        return *_backward(dy, x, w, z, ctx.args, ctx.activation, ctx.needs_input_grad[:4]), None, None, None, None, None


def _backward(dy, x, w, z, args: tuple, activation: str, needs) -> tuple:
    """The gradients of (x, w, bias, residual) where needs says, for args (stride, padding, dilation, groups)."""
    need_x, need_w, need_bias, need_residual = needs
    dz, dbias = dy, None
    if activation != "none" or need_bias:
        gz, gbias = _act_grad(dy, dy if z is None else z, activation, need_bias)
        dz = gz if activation != "none" else dy
        dbias = gbias if need_bias else None
    dx = _dgrad(dz, x, w, *args) if need_x else None
    dw = _wgrad(dz, x, w, *args) if need_w else None
    return dx, dw, dbias, dz if need_residual else None


class _ConvShortcut(Differentiable):
    """conv2d's later eager calls of this signature where autograd records them (`Differentiable`): (input, weight,
    bias, residual, out None) -> y, the forward's plan on a new y (and pre-activation, saved, where an activation's
    gradient is wanted) laid out as this call's; the backward as the op's own."""

    def __init__(self, x, w, y, bias, residual, args: tuple, activation: str, needs):
        super().__init__()
        self.save_preact = activation != "none" and any(needs)
        self.run = _fwd_plan(x, w, y, torch.empty_like(y) if self.save_preact else y, bias, residual, *args,
                             activation, self.save_preact, False)[0]
        self.y, self.args, self.activation, self.needs = (y.shape, y.stride()), args, activation, needs[:4]

    @staticmethod
    def make(x, w, y, bias, residual, args: tuple, activation: str, needs):
        """The shortcut; None where `_fwd_shortcut` has none."""
        if y.numel() == 0 or x.shape[1] // args[3] * w.shape[2] * w.shape[3] == 0:
            return None
        return _ConvShortcut(x, w, y, bias, residual, args, activation, needs)

    def forward(self, ctx, x, w, bias, residual, out):
        y = torch.empty_strided(*self.y, dtype=x.dtype, device=x.device)
        z = torch.empty_strided(*self.y, dtype=x.dtype, device=x.device) if self.save_preact else y
        self.run(x, w, y, y if bias is None else bias, z, y if residual is None else residual)
        ctx.save_for_backward(x, w, z if self.save_preact else None)
        return y

    def backward(self, ctx, dy):
        x, w, z = ctx.saved_tensors
        return *_backward(dy, x, w, z, self.args, self.activation, self.needs), None


# --- 6. Public function ----------------------------------------------------------------------------------

def _pair(op: str, value, name: str, positive: bool) -> tuple:
    if type(value) is int and (value > 0 or not positive and value == 0):  # the common case, checked fast
        return value, value
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


def _check_conv2d(input, weight, bias, residual, out, stride, padding, dilation, groups, activation) -> tuple:
    """conv2d's argument checks (those that hold for every call of these shapes, dtypes and devices; `_check_out`
    has the rest); (act, stride, pads, dilation, unbatched)."""
    act = check_activation(activation)
    _runtime.check_kernel_device("conv2d", input=input, weight=weight, bias=bias, residual=residual, out=out)
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in _DTYPES:
            raise RuntimeError(f"conv2d: argument '{name}' has dtype {t.dtype}; dropin supports {_DTYPES}")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual), ("out", out)):
        if t is not None and t.dtype != input.dtype:
            raise RuntimeError(f"conv2d: expected 'input' and '{name}' to have the same dtype, but got "
                               f"{input.dtype} and {t.dtype}")
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


def _check_out(out: torch.Tensor, *tensors) -> None:
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


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def conv2d(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, stride=1, padding=0,
           dilation=1, groups: int = 1, activation: Optional[str] = None,
           residual: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`activation(F.conv2d(input, weight, bias, stride, padding, dilation, groups) + residual)` in one kernel.

    input [N, C, H, W] or unbatched [C, H, W], any strides (NCHW and channels_last read without copies);
    weight [Cout, C / groups, KH, KW]; bias [Cout] or None; stride / padding / dilation an int or a pair,
    padding also 'valid' or 'same' (stride 1 only, the odd extra pixel on the bottom / right as in torch);
    activation None, "relu", "gelu", "gelu_tanh" or "silu"; residual None or a tensor of the output's size
    (e.g. a ResNet block's identity; any strides). With `fold_batchnorm`'s weight and bias, conv -> BatchNorm ->
    (+ identity) -> relu is this one call. float32 / float16 / bfloat16 (all the same),
    fp32 accumulation; float32 uses tf32 only where torch's convolutions would
    (`torch.backends.cudnn.allow_tf32`). The output is channels_last when input or weight is. Under torch.autocast
    input, weight, bias and residual are cast to its dtype, as F.conv2d's operands are.

    out: where given, the result is written there and `out` returned (inference only: no argument may require
    grad; any strides, e.g. a slice of a larger buffer, which saves a copy into it; no overlap with an operand)."""
    key, shortcut = _shortcuts.find((input, weight, bias, residual, out),
                                    (stride, padding, dilation, groups, activation))
    if shortcut is not None:
        return shortcut(input, weight, bias, residual, out)
    input, weight, bias, residual = _gemm.autocast(input, weight, bias, residual)
    act, stride, pads, dilation, unbatched = _checked.once(
        (input, weight, bias, residual, out), (stride, padding, dilation, groups, activation),
        lambda: _check_conv2d(input, weight, bias, residual, out, stride, padding, dilation, groups, activation))
    if out is not None:
        _check_out(out, input, weight, bias, residual)
    x = input.unsqueeze(0) if unbatched else input
    KH, KW = weight.shape[2:]
    if bias is not None and bias.stride(0) != 1:
        bias, key = bias.contiguous(), None  # the kernel reads bias with unit stride (a copy: no shortcut)
    key = None if unbatched else key
    if residual is not None and unbatched:
        residual = residual.unsqueeze(0)
    if out is not None:
        y = out.unsqueeze(0) if unbatched else out
        if torch.compiler.is_compiling():  # the registered op while torch.compile traces, as `switch` picks
            _fwd_out_op(x, weight, bias, residual, stride, pads, dilation, groups, act, y)
        else:
            _fwd_impl(x, weight, bias, residual, stride, pads, dilation, groups, act, False, y)
            _shortcuts.keep(key, lambda: _fwd_shortcut(x, weight, y, bias, residual, stride, pads, dilation, groups,
                                                       act, out=True))
        return out
    if (KH, KW, groups) == (1, 1, 1) and stride == (1, 1) and pads == (0, 0, 0, 0) and residual is None:
        pixels = x.permute(0, 2, 3, 1)
        if pixels.is_contiguous() and (x.dtype != torch.float32 or _precision(x.dtype) == _gemm.precision(x.dtype)):
            # A 1x1 conv over channels_last pixels is a GEMM [N*H*W, C] x [C, Cout]: matmul's kernels (TMA on
            # Hopper), bias and activation fused, its autograd; the output is channels_last as torch's is.
            # (matmul's product directly, not linear: the checks are done, and a call's CPU time counts here)
            (n, h, w, c), cout = pixels.shape, weight.shape[0]
            operands = (pixels.reshape(1, n * h * w, c), weight.reshape(cout, c).t().unsqueeze(0), bias)
            product = canonical_product(*operands, act)
            y = product.view(n, h, w, cout).permute(0, 3, 1, 2)
            if product.requires_grad:
                rows, w_shape = operands[0].shape, weight.shape  # (the lambdas hold no tensor: they are kept)
                _shortcuts.keep(key, lambda: ProductShortcut.make(
                    operands, (x, weight, bias), key[0], product, y, act,
                    lambda g, i: g.view(n, h, w, c).permute(0, 3, 1, 2) if i == 0 else g[0].t().reshape(w_shape)
                    if i == 1 else g, lambda dy: dy.permute(0, 2, 3, 1).reshape(rows[:2] + (cout,))), grad=True)
            else:
                _shortcuts.keep(key, lambda: product_shortcut(operands, (x, weight, bias), product, act, y))
            return y.squeeze(0) if unbatched else y
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, residual)):
        y = _Conv2dFunction.apply(x, weight, bias, residual, stride, pads, dilation, groups, act)
        _shortcuts.keep(key, lambda: _ConvShortcut.make(x, weight, y, bias, residual, (stride, pads, dilation, groups),
                                                        act, key[0]), grad=True)
    else:
        y = _fwd(x, weight, bias, residual, stride, pads, dilation, groups, act, False)[0]
        _shortcuts.keep(key, lambda: _fwd_shortcut(x, weight, y, bias, residual, stride, pads, dilation, groups, act,
                                                   out=False))
    return y.squeeze(0) if unbatched else y

