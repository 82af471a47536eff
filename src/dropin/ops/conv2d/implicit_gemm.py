"""conv2d's implicit GEMM kernels, read through strides (NCHW, channels_last or any other layout, no copies),
accumulated in fp32 with tl.dot, with masks for padding and edges; grid over (tiles, tiles, groups):
- forward `_conv_fwd_kernel`: output pixels (N*OH*OW) x output channels of a group, reduced over
  (KH, KW, Cin/groups); epilogue bias, activation, and the pre-activation kept for the backward.
- input gradient `_conv_dgrad_kernel` (a transposed convolution): input pixels (N*H*W) x input channels
  of a group, reduced over (KH, KW, Cout/groups), gathering from the output gradient; a program's pixels share
  their position modulo the stride (a phase), and it visits only the taps that reach them.
- weight gradient `_conv_wgrad_kernel`: output channels x (Cin/groups*KH*KW), reduced over N*OH*OW, with
  an optional split of that reduction (fp32 partials summed afterwards) for small weights on large images.
Fewer than 16 channels per group (stems) go forward through `_conv_fwd_rows_kernel` instead, over a copy of x
padded once per call (`_pad_kernel`), whole kernel rows a step, where that copy fits planning.WORKSPACE
(`rows_fit`)."""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ... import _runtime
from .. import _autotune, _gemm
from .._common import is_channels_last, pixel
from .._dispatch import Launch
from .._gemm import ACC_K, dot_acc, split_range
from .planning import WORKSPACE, conv_meta, staged
from .tiles import epilogue
from .weights import derived


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
        a_ptrs = (x_base + ih * sxh + iw * sxw)[:, None] + (c0 + offs_k).to(tl.int64)[None, :] * sxc
        b_ptrs = w_base + kh * swh + kw * sww + (c0 + offs_k)[:, None] * swc
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot_acc(acc, a, b, PRECISION)
    epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, n * syn + oh * syh + ow * syw, n * srn + oh * srh + ow * srw,
             co, m_ok, n_ok, syc, src, HAS_BIAS, HAS_RES, ACT, STORE_Z)


@triton.jit
def _pad_kernel(x_ptr, xp_ptr, C_G, G, H, W, HP, WP, sxn, sxc, sxh, sxw,
                PAD_H: tl.constexpr, PAD_W: tl.constexpr, CP: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """xp[n, hp, wp, g * CP + c] = x[n, g * C_G + c, hp - PAD_H, wp - PAD_W], zero outside x and for c >= C_G:
    the padded channels_last copy that _conv_fwd_rows_kernel reads. Grid (N * HP, wp tiles, channel tiles)."""
    row = tl.program_id(0)
    n = (row // HP).to(tl.int64)
    ih = (row % HP - PAD_H).to(tl.int64)
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
    epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, n * syn + oh * syh + ow * syw, n * srn + oh * srh + ow * srw,
             co, m_ok, n_ok, syc, src, HAS_BIAS, HAS_RES, ACT, STORE_Z)


@triton.jit
def _phase_taps(p, PAD: tl.constexpr, DIL: tl.constexpr, STRIDE: tl.constexpr, K, TAP_STEP: tl.constexpr):
    """The taps of one spatial axis that reach input positions p + STRIDE * i from output positions: those k with
    (p + PAD - k * DIL) a multiple of STRIDE, k = k0 + TAP_STEP * t for t < count (TAP_STEP = STRIDE / gcd(DIL,
    STRIDE)), reaching from output position i + q - t * (DIL / gcd). Returns (k0, count, q); count 0 where none."""
    r = (p + PAD) % STRIDE
    k0 = K  # (none found: count 0)
    for t in tl.static_range(TAP_STEP - 1, -1, -1):  # the smallest match wins
        k0 = tl.where((t * DIL - r) % STRIDE == 0, t, k0)
    count = tl.where(k0 < K, tl.cdiv(K - k0, TAP_STEP), 0)
    return k0, count, (p + PAD - k0 * DIL) // STRIDE  # (an exact division where count > 0)


@triton.jit
def _conv_dgrad_kernel(dy_ptr, w_ptr, dx_ptr,
                       C_G, H, W, COUT_G, OH, OW, P, KH, KW,
                       sdn, sdc, sdh, sdw, swo, swc, swh, sww, sxn, sxc, sxh, sxw,
                       STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                       DIL_H: tl.constexpr, DIL_W: tl.constexpr, PRECISION: tl.constexpr,
                       TAP_STEP_H: tl.constexpr, TAP_STEP_W: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """dx[n, g*C_G + c, ih, iw] = sum_{kh, kw, co} dy[n, g*COUT_G + co, oh, ow] * w[g*COUT_G + co, c, kh, kw]
    where oh*STRIDE_H == ih + PAD_H - kh*DIL_H (same for w). The input pixels split into STRIDE_H x STRIDE_W
    phases (ih % STRIDE_H, iw % STRIDE_W), a program's pixels in one phase, so that it visits only the taps that
    reach them (a quarter of a 3x3 kernel's at stride 2). Grid (pixel tiles of a phase, phases x channel tiles,
    groups), P = N * cdiv(H, STRIDE_H) * cdiv(W, STRIDE_W)."""
    g = tl.program_id(2).to(tl.int64)
    tiles_n = tl.cdiv(C_G, BLOCK_N)
    phase = tl.program_id(1) // tiles_n
    ph = phase // STRIDE_W
    pw = phase % STRIDE_W
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(1) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n, i, j = pixel(offs_m, tl.cdiv(H, STRIDE_H), tl.cdiv(W, STRIDE_W))
    ih = ph + i * STRIDE_H
    iw = pw + j * STRIDE_W
    m_ok = (offs_m < P) & (ih < H) & (iw < W)
    n_ok = offs_n < C_G
    kh0, taps_h, qh = _phase_taps(ph, PAD_H, DIL_H, STRIDE_H, KH, TAP_STEP_H)
    kw0, taps_w, qw = _phase_taps(pw, PAD_W, DIL_W, STRIDE_W, KW, TAP_STEP_W)
    dy_base = dy_ptr + n * sdn + g * COUT_G * sdc
    c = g * C_G + offs_n
    w_base = w_ptr + g * COUT_G * swo + offs_n.to(tl.int64)[None, :] * swc
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One flat loop over (tap row, tap column, output-channel block), so that num_stages pipelines across taps too.
    k_blocks = tl.cdiv(COUT_G, BLOCK_K)
    for step in range(0, taps_h * taps_w * k_blocks):
        tap = step // k_blocks
        k0 = (step - tap * k_blocks) * BLOCK_K
        th = tap // taps_w
        tw = tap - th * taps_w
        oh = i + qh - th * (DIL_H * TAP_STEP_H // STRIDE_H)
        ow = j + qw - tw * (DIL_W * TAP_STEP_W // STRIDE_W)
        row_ok = m_ok & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
        k_ok = offs_k < COUT_G - k0
        a_ptrs = (dy_base + oh * sdh + ow * sdw)[:, None] + (k0 + offs_k).to(tl.int64)[None, :] * sdc
        b_ptrs = (w_base + (kh0 + th * TAP_STEP_H) * swh + (kw0 + tw * TAP_STEP_W) * sww
                  + (k0 + offs_k)[:, None] * swo)
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
    k_first, k_last = split_range(split, tl.num_programs(2), tl.cdiv(P, BLOCK_K))
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
    for k_share in range(k_first, k_last, ACC_K // BLOCK_K):  # (ACC_K: one MMA accumulator's reduction at most)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_share, tl.minimum(k_share + ACC_K // BLOCK_K, k_last)):
            k_ok = offs_k < P
            n, oh, ow = pixel(offs_k, OH, OW)
            n, oh, ow = n.to(tl.int64), oh.to(tl.int64), ow.to(tl.int64)
            a = tl.load(dy_base + (n * sdn + oh * sdh + ow * sdw)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if ONE_TAP:
                ih = oh * STRIDE_H - PAD_H + tap_h
                iw = ow * STRIDE_W - PAD_W + tap_w
                row_ok = k_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                b = tl.load(x_base + (n * sxn + ih * sxh + iw * sxw)[:, None],
                            mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            else:
                ih = oh[:, None] * STRIDE_H - PAD_H + kh[None, :] * DIL_H
                iw = ow[:, None] * STRIDE_W - PAD_W + kw[None, :] * DIL_W
                b_ok = k_ok[:, None] & n_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                b = tl.load(x_base + (n * sxn)[:, None] + ih * sxh + iw * sxw, mask=b_ok, other=0.0)
            part = dot_acc(part, a, b, PRECISION)
            offs_k += BLOCK_K
        acc += part
    offs_w = (split.to(tl.int64) * sws + co.to(tl.int64)[:, None] * swo
              + (c * swc + kh * swh + kw * sww)[None, :])
    tl.store(dw_ptr + offs_w, acc.to(dw_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Tiles (BLOCK_M, BLOCK_N, BLOCK_K): M = pixels (fwd, dgrad) or output channels (wgrad), N = channels,
# K = the channels reduced per tap (fwd, dgrad) or pixels (wgrad). Clamped to the problem by _fit; the first
# fitting one is the untuned default.
FWD_CONFIGS = [
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
ROWS_CONFIGS = [
    _autotune.config(128, 64, 64, 4, 3),
    _autotune.config(64, 64, 64, 4, 4),
    _autotune.config(128, 64, 128, 8, 3),
    _autotune.config(64, 64, 128, 4, 3),
    _autotune.config(128, 64, 32, 4, 4),
    _autotune.config(128, 128, 64, 8, 3),
]
DGRAD_CONFIGS = FWD_CONFIGS
WGRAD_CONFIGS = [
    _autotune.config(32, 64, 64, 4, 3, SPLIT_K=1),
    _autotune.config(64, 64, 64, 4, 3, SPLIT_K=1),
    _autotune.config(64, 128, 64, 8, 3, SPLIT_K=1),
    _autotune.config(32, 64, 64, 4, 3, SPLIT_K=4),
    _autotune.config(64, 64, 32, 4, 3, SPLIT_K=16),
    _autotune.config(64, 64, 64, 4, 3, SPLIT_K=64),
    _autotune.config(128, 128, 64, 8, 3, SPLIT_K=64),
    _autotune.config(128, 64, 64, 4, 3, SPLIT_K=32),
]


def _fit(cfg: dict, m: int, n: int, k: int, size: int, precision: str) -> dict:
    """cfg with its blocks shrunk to the problem (powers of two, at least 16 for tl.dot)."""
    cfg = dict(cfg)
    for name, extent in (("BLOCK_M", m), ("BLOCK_N", n), ("BLOCK_K", k)):
        cfg[name] = max(16, min(cfg[name], _runtime.next_power_of_2(max(extent, 1))))
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], _gemm.max_k(precision, size, chain=64))
    return cfg


def _configs(configs, m, n, k, size, precision):
    """The implicit GEMM's candidates fitted to the problem (_fit), their stages cut to the shared memory."""
    out = []
    for cfg in configs:
        cfg = _fit(cfg, m, n, k, size, precision)
        if cfg not in out:
            out.append(cfg)
    return gemm_staged(out, size)


def gemm_staged(configs, size: int) -> list:
    """staged for the implicit GEMM's tiles (fp32's 128 x 128 x 64 x 4 stages would need 256 KB)."""
    return staged(configs, lambda c: (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * size)


def fwd_configs(dims: tuple, rows: bool, size: int, precision: str) -> list:
    """The forward's candidates: with `rows` (fewer than 16 channels a group) the rows kernel's (KERNEL "rows"),
    BLOCK_K fitted to KH whole rows of KW x CP columns, padded; else _conv_fwd_kernel's."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    if rows:
        return [dict(c, KERNEL="rows")
                for c in _configs(ROWS_CONFIGS, N * OH * OW, COUT_G, KH * _rows_pad(KW, C_G), size, precision)]
    return _configs(FWD_CONFIGS, N * OH * OW, COUT_G, C_G, size, precision)


def dgrad_configs(dims: tuple, size: int, precision: str) -> list:
    """_conv_dgrad_kernel's candidates."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    return _configs(DGRAD_CONFIGS, N * H * W, C_G, COUT_G, size, precision)


def wgrad_configs(dims: tuple, size: int, precision: str) -> list:
    """_conv_wgrad_kernel's candidates."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    return _configs(WGRAD_CONFIGS, COUT_G, C_G * KH * KW, N * OH * OW, size, precision)

def rows_fit(dims: tuple, groups: int, padding, size: int) -> bool:
    """Whether the forward takes _conv_fwd_rows_kernel: fewer than 16 channels a group, and its padded copy of x
    fits WORKSPACE (a 2^31-element depthwise input's copy took 4-32 GiB); else _conv_fwd_kernel reads x in place."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    hp, wp = H + padding[0] + padding[1], W + padding[2] + padding[3]
    return C_G < 16 and N * hp * wp * groups * _runtime.next_power_of_2(C_G) * size <= WORKSPACE


def _rows_pad(kw: int, c_g: int) -> int:
    """_conv_fwd_rows_kernel's padded kernel row: KW x CP columns (CP: C_G up to a power of two), a power of two."""
    return _runtime.next_power_of_2(kw * _runtime.next_power_of_2(c_g))


def _rows_weight(w: torch.Tensor, kwp: int, traced: bool) -> torch.Tensor:
    """The weight as _conv_fwd_rows_kernel reads it: [KH, KWP, COUT], column kw * CP + c of row kh holding
    w[co, c, kh, kw], zeros where c >= C_G or past KW x CP (derived)."""
    def make(w):
        cout, c_g, kh, kw = w.shape
        cp = _runtime.next_power_of_2(c_g)
        rows = F.pad(w.permute(2, 3, 1, 0), (0, 0, 0, cp - c_g)).reshape(kh, kw * cp, cout)
        return F.pad(rows, (0, 0, 0, kwp - kw * cp)).contiguous()
    return derived(w, f"rows{kwp}", make, traced)


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


def fwd_launcher(kernel: str, cfg: dict, dims: tuple, x, w, y, r, stride, padding, dilation, groups: int,
                 precision: str, epilogue_meta: dict, traced: bool):
    """The launch of _conv_fwd_rows_kernel (kernel "rows") or _conv_fwd_kernel ("gemm") for cfg (KERNEL taken
    out): run(x, w, y, bias, z, r)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    P = N * OH * OW
    grid = (_runtime.cdiv(P, cfg["BLOCK_M"]), _runtime.cdiv(COUT_G, cfg["BLOCK_N"]), groups)
    meta = dict(conv_meta(stride, padding, dilation, precision), **epilogue_meta, **cfg)
    if kernel == "rows":
        return _rows_launcher(x, w, y, r, padding, groups, grid, OH, OW, P, meta, traced)
    launch = Launch(_conv_fwd_kernel, grid, meta, traced=traced)
    scalars = (C_G, H, W, COUT_G, OH, OW, P, KH, KW, *x.stride(), *w.stride(), *y.stride(), *r.stride())
    return lambda *tensors: launch(*tensors, *scalars)


def dgrad_launcher(cfg: dict, dims: tuple, dz, w, dx, stride, padding, dilation, groups: int, precision: str,
                   traced: bool):
    """_conv_dgrad_kernel's launch for cfg (KERNEL taken out): run(dz, w, dx)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    P = N * _runtime.cdiv(H, stride[0]) * _runtime.cdiv(W, stride[1])  # (pixels of one phase, padded)
    scalars = (C_G, H, W, COUT_G, OH, OW, P, KH, KW, *dz.stride(), *w.stride(), *dx.stride())
    grid = (_runtime.cdiv(P, cfg["BLOCK_M"]), stride[0] * stride[1] * _runtime.cdiv(C_G, cfg["BLOCK_N"]), groups)
    tap_steps = dict(TAP_STEP_H=stride[0] // math.gcd(dilation[0], stride[0]),
                     TAP_STEP_W=stride[1] // math.gcd(dilation[1], stride[1]))
    launch = Launch(_conv_dgrad_kernel, grid, dict(conv_meta(stride, padding, dilation, precision), **tap_steps,
                                                   **cfg), traced=traced)
    return lambda dz, w, dx: launch(dz, w, dx, *scalars)


def wgrad_launcher(cfg: dict, dims: tuple, dz, x, w, dw, stride, padding, dilation, groups: int, precision: str,
                   traced: bool):
    """_conv_wgrad_kernel's launch for cfg (KERNEL taken out): run(dz, x, dw), with SPLIT_K over 1 into fp32
    partials of the split reduction, summed."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    P = N * OH * OW
    cols = C_G * KH * KW
    tap_major = is_channels_last(x) and C_G > 1
    base = (C_G, H, W, COUT_G, OH, OW, P, KH, KW, *dz.stride(), *x.stride())
    splits = max(1, min(cfg.pop("SPLIT_K"), _runtime.cdiv(P, cfg["BLOCK_K"])))
    grid = (_runtime.cdiv(COUT_G, cfg["BLOCK_M"]) * _runtime.cdiv(cols, cfg["BLOCK_N"]), groups, splits)
    one_tap = tap_major and C_G % cfg["BLOCK_N"] == 0
    meta = dict(conv_meta(stride, padding, dilation, precision), TAP_MAJOR=tap_major, ONE_TAP=one_tap, **cfg)
    launch = Launch(_conv_wgrad_kernel, grid, meta, traced=traced)
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
