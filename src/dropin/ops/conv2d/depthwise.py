"""conv2d's direct kernels for one input channel per group (depthwise, any channel multiplier), the tuner's first
candidates in each pass (the implicit GEMM stays a candidate): [spatial tile of TH x TW pixels, channels] tiles
with the taps unrolled, int32 offsets inside an image and fp32 FMAs (`_conv_dw_fwd_kernel`,
`_conv_dw_dgrad_kernel`), and for the weight gradient per-tile tree sums of dz * x for each tap
(`_conv_dw_wgrad_kernel`) summed over the tiles by `_common.sum_partials_kernel`. A 3x3 of dilation 1 and row
stride 1 or 2 has a forward and a weight gradient that walk down the rows instead (`_conv_dw3_fwd_kernel`, whose
mirrored taps also give the input gradient of stride 1; `_conv_dw3_wgrad_kernel`, per-tile sums carried by FMAs)."""
import torch
import triton
import triton.language as tl

from ... import _runtime
from .._common import sum_partials_kernel
from .._dispatch import Launch
from .planning import WORKSPACE, geometry_meta, spatial_tiles
from .tiles import conv_tap, epilogue
from .weights import derived, keeps_copies


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
    epilogue(acc, y_ptr + n * syn, z_ptr + n * syn, bias_ptr, r_ptr + n * srn, oh * syh + ow * syw,
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
                         sxn, sxc, sxh, sxw, swo, swh, sww, syn, syc, syh, syw, srn, src, srh, srw,
                         STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                         TH: tl.constexpr, TW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The depthwise 3x3 forward (dilation 1, STRIDE_H 1 or 2) as a walk down TH output rows of TW pixels x
    BLOCK_N channels: each input row is read once per kernel column (3 loads, not one per tap: 9) and feeds the
    up to three output rows it reaches through partial sums carried in registers (the rows unrolled); the loads
    run two input rows ahead of the sums (in program order, as the stores between them keep them). The nine
    weights (the weight [COUT, 1, 3, 3] in any layout, read where it lies: a copy in another layout would be made
    anew on every call of a trainable weight) and the bias (the first sum of each output row) are loaded once, as
    fp32. Output channel co reads input channel co // COUT_G. Grid (N * row tiles * column tiles, channel tiles)."""
    n, oh0, ow, co, ow_ok, n_ok, c0, c1, c2, ok0, ok1, ok2 = _dw3_tile(OH, OW, W, COUT, sxw, STRIDE_W, PAD_W, TH, TW,
                                                                       BLOCK_N)
    wp = w_ptr + (co * swo)[None, :]
    w_ok = n_ok[None, :]
    w00 = tl.load(wp, mask=w_ok, other=0.0).to(tl.float32)
    w01 = tl.load(wp + sww, mask=w_ok, other=0.0).to(tl.float32)
    w02 = tl.load(wp + 2 * sww, mask=w_ok, other=0.0).to(tl.float32)
    w10 = tl.load(wp + swh, mask=w_ok, other=0.0).to(tl.float32)
    w11 = tl.load(wp + swh + sww, mask=w_ok, other=0.0).to(tl.float32)
    w12 = tl.load(wp + swh + 2 * sww, mask=w_ok, other=0.0).to(tl.float32)
    w20 = tl.load(wp + 2 * swh, mask=w_ok, other=0.0).to(tl.float32)
    w21 = tl.load(wp + 2 * swh + sww, mask=w_ok, other=0.0).to(tl.float32)
    w22 = tl.load(wp + 2 * swh + 2 * sww, mask=w_ok, other=0.0).to(tl.float32)
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
                epilogue(out, y_ptr + n * syn, z_ptr + n * syn, bias_ptr, r_ptr + n * srn, oh * syh + ow * syw,
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


# The direct kernels for one input channel per group (depthwise): spatial tiles of TH x TW pixels x BLOCK_N
# channels, clamped to the image by candidates. Forward order from the probe of 2026-11-22 (scratch/probe_dw.py,
# CvT-13's depthwise shapes, bf16 batch 64 on the H200): (2, 16) x 64 won or came within 5% on all six.
FWD_CONFIGS = [
    dict(TH=2, TW=16, BLOCK_N=64, num_warps=4),
    dict(TH=4, TW=8, BLOCK_N=64, num_warps=4),
    dict(TH=1, TW=32, BLOCK_N=64, num_warps=4),
    dict(TH=8, TW=8, BLOCK_N=64, num_warps=8),
    dict(TH=8, TW=8, BLOCK_N=32, num_warps=4),
    dict(TH=2, TW=8, BLOCK_N=64, num_warps=2),
    dict(TH=4, TW=4, BLOCK_N=128, num_warps=4),
]
DGRAD_CONFIGS = FWD_CONFIGS
# The depthwise 3x3 forward's walk (_conv_dw3_fwd_kernel): TH output rows of TW pixels x BLOCK_N channels. Order
# from the probe of 2026-11-24 with the loads two rows ahead (scratch/probe_dw7.py, CvT-13's six depthwise shapes,
# bf16 batch 64, H200): 16 x 8 x 64 won or came within 8% on all six. Wide rows last, for NCHW (seed 003's one channel).
WALK_FWD_CONFIGS = [
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
WALK_WGRAD_CONFIGS = [
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
WGRAD_CONFIGS = [
    dict(TH=8, TW=16, BLOCK_N=32, num_warps=4),
    dict(TH=8, TW=8, BLOCK_N=64, num_warps=4),
    dict(TH=8, TW=16, BLOCK_N=64, num_warps=8),
    dict(TH=16, TW=16, BLOCK_N=32, num_warps=4),
    dict(TH=16, TW=16, BLOCK_N=64, num_warps=8),
]


def _co_major(w: torch.Tensor, traced: bool) -> torch.Tensor:
    """The depthwise weight [COUT, 1, KH, KW] with the output channel innermost (stride 1), so that the direct
    kernels read a tap's weights as one vector instead of a scalar load per channel (measured: 15-20% of the
    depthwise forward)."""
    if w.stride(0) == 1 or w.shape[0] == 1:
        return w
    return derived(w, "co_major", lambda w: w.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2), traced)


def candidates(direct, gemm, depthwise: bool, oh: int, ow: int, channels: int, walk=()):
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


def direct_tag(direct: bool, oh: int, ow: int) -> tuple:
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


def walkable(direct: bool, KH: int, KW: int, stride, dilation) -> bool:
    """Whether the depthwise 3x3 walks (forward, weight gradient) take this conv: the direct kernels do, the
    kernel is 3x3, dilation 1, the row stride 1 or 2."""
    return direct and (KH, KW) == (3, 3) and tuple(dilation) == (1, 1) and stride[0] <= 2


def direct_fits(*ts) -> bool:
    """Whether the direct depthwise kernels' int32 offsets inside one image (all but the batch dim) reach every
    element of these 4-D tensors."""
    return all(sum((size - 1) * abs(st) for size, st in zip(t.shape[1:], t.stride()[1:])) < 2**31 for t in ts)


def dgrad_as_walk(x, w, stride, padding, dilation, groups: int) -> bool:
    """Whether the input gradient of this depthwise 3x3 (stride and dilation 1, multiplier 1, padding at most 2,
    x dense) is taken as the forward's walk over dz with the taps mirrored and padding 2 - padding."""
    return (groups == x.shape[1] == w.shape[0] and tuple(w.shape[1:]) == (1, 3, 3) and tuple(stride) == (1, 1)
            and tuple(dilation) == (1, 1) and max(padding) <= 2
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)))


def walk_fwd_launcher(cfg: dict, dims: tuple, x, w, y, r, stride, padding, groups: int, epilogue_meta: dict,
                      traced: bool):
    """_conv_dw3_fwd_kernel's launch for cfg (KERNEL taken out): run(x, w, y, bias, z, r)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    cfg["TH"] = _walk_rows(OH, cfg["TH"])
    grid = (N * spatial_tiles(OH, OW, cfg), _runtime.cdiv(COUT_G * groups, cfg["BLOCK_N"]))
    launch = Launch(_conv_dw3_fwd_kernel, grid, dict(_walk_meta(stride, padding), **epilogue_meta, **cfg),
                    traced=traced)
    ws = w.stride()
    scalars = (H, W, COUT_G * groups, COUT_G, OH, OW, *x.stride(), ws[0], *ws[2:], *y.stride(), *r.stride())
    return lambda x, *tensors: launch(x, *tensors, *scalars)


def direct_fwd_launcher(cfg: dict, dims: tuple, x, w, y, r, stride, padding, dilation, groups: int,
                        epilogue_meta: dict, traced: bool):
    """_conv_dw_fwd_kernel's launch for cfg (KERNEL taken out): run(x, w, y, bias, z, r)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    # the weight co-major where that copy is kept (frozen weights: a folded BatchNorm's); else read where it lies,
    # a tap's channels a strided load, rather than copied on every call (a trainable weight's: ConvNeXt's 18
    # depthwise convs in eager inference)
    co_major = keeps_copies(w, traced)
    ws = (_co_major(w, traced) if co_major else w).stride()
    scalars = (H, W, COUT_G * groups, COUT_G, OH, OW, *x.stride(), ws[0], *ws[2:], *y.stride(), *r.stride())
    grid = (N * spatial_tiles(OH, OW, cfg), _runtime.cdiv(COUT_G * groups, cfg["BLOCK_N"]))
    meta = dict(geometry_meta(stride, padding, dilation), KH=KH, KW=KW, **epilogue_meta, **cfg)
    launch = Launch(_conv_dw_fwd_kernel, grid, meta, traced=traced)
    if co_major:
        return lambda x, w, *tensors: launch(x, _co_major(w, traced), *tensors, *scalars)
    return lambda x, w, *tensors: launch(x, w, *tensors, *scalars)


def dgrad_launcher(cfg: dict, dims: tuple, dz, w, dx, stride, padding, dilation, groups: int, traced: bool):
    """_conv_dw_dgrad_kernel's launch for cfg (KERNEL taken out): run(dz, w, dx)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    ws = w.stride()  # (read where it lies: a trainable weight's copy would be made anew on every call)
    scalars = (groups, H, W, COUT_G, OH, OW, *dz.stride(), ws[0], *ws[2:], *dx.stride())
    grid = (N * spatial_tiles(H, W, cfg), _runtime.cdiv(groups, cfg["BLOCK_N"]))
    meta = dict(geometry_meta(stride, padding, dilation), KH=KH, KW=KW, **cfg)
    launch = Launch(_conv_dw_dgrad_kernel, grid, meta, traced=traced)
    return lambda dz, w, dx: launch(dz, w, dx, *scalars)


def wgrad_launcher(kernel: str, cfg: dict, dims: tuple, dz, x, dw, stride, padding, dilation, groups: int,
                   traced: bool):
    """The launch of _conv_dw3_wgrad_kernel (kernel "walk") or _conv_dw_wgrad_kernel ("direct") for cfg (KERNEL
    taken out): run(dz, x, dw), fp32 partial sums per pixel tile, then one sum over the tiles; in chunks of images
    where the partials would pass WORKSPACE (the walk's took 1.1 GiB on a 2^31-element output)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    if kernel == "walk":
        cfg["TH"] = _walk_rows(OH, cfg["TH"])
        direct_kernel, meta = _conv_dw3_wgrad_kernel, dict(_walk_meta(stride, padding), **cfg)
    else:
        direct_kernel = _conv_dw_wgrad_kernel
        meta = dict(geometry_meta(stride, padding, dilation), KH=KH, KW=KW, **cfg)
    cout, tiles = groups * COUT_G, spatial_tiles(OH, OW, cfg)
    images = max(1, min(N, WORKSPACE // (tiles * KH * KW * cout * 4)))  # a chunk's fp32 partials in WORKSPACE
    scalars = (H, W, cout, COUT_G, OH, OW, *dz.stride(), *x.stride())
    block_c = min(32, _runtime.next_power_of_2(cout))

    def chunk(n: int, out_strides: tuple):
        """run(dz, x, out) over n images: partials [n * tiles, KH * KW, cout], summed into out (strides given)."""
        launch = Launch(direct_kernel, (n * tiles, _runtime.cdiv(cout, cfg["BLOCK_N"])), meta, traced=traced)
        tile_sum = Launch(sum_partials_kernel, (KH * KW, _runtime.cdiv(cout, block_c)),
                          dict(KW=KW, TAPS=KH * KW, BLOCK_T=64, BLOCK_C=block_c), traced=traced)

        def run(dz, x, out):
            part = torch.empty((n * tiles, KH * KW, cout), device=dz.device, dtype=torch.float32)
            launch(dz, x, part, *scalars)
            tile_sum(part, out, n * tiles, cout, out_strides[0], *out_strides[2:])
        return run
    if images == N:
        return chunk(N, dw.stride())
    # chunks of images (their views of dz and x), each chunk's sum added up in fp32
    sum_strides = (KH * KW, KH * KW, KW, 1)
    full, rest = chunk(images, sum_strides), chunk(N % images, sum_strides) if N % images else None

    def run_chunks(dz, x, dw):
        total = torch.zeros((cout, 1, KH, KW), device=dz.device, dtype=torch.float32)
        for n0 in range(0, N, images):
            part_sum = torch.empty_like(total)
            (full if n0 + images <= N else rest)(dz[n0:n0 + images], x[n0:n0 + images], part_sum)
            total += part_sum
        dw.copy_(total)
    return run_chunks


def wgrad_fits(cfg: dict, dims: tuple, groups: int) -> bool:
    """Whether one image's fp32 partials in the direct or walk weight gradient (cfg's KERNEL; KH * KW * COUT per
    spatial tile) fit WORKSPACE, the chunk that wgrad_launcher's loop takes at least; any other config fits."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    if cfg["KERNEL"] not in ("direct", "walk"):
        return True
    th = _walk_rows(OH, cfg["TH"]) if cfg["KERNEL"] == "walk" else cfg["TH"]
    return spatial_tiles(OH, OW, dict(cfg, TH=th)) * KH * KW * groups * COUT_G * 4 <= WORKSPACE
