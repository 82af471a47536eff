"""Batch normalization (torch.nn.functional.batch_norm semantics), inference and training; fwd and bwd.

input [N, C, *spatial] is read through its strides as (N, C, H, W) pixels x channels (NCHW, channels_last
or any view whose spatial dims merge into two alike with the other tensors of a launch: `_layout`; others are
copied once), in tiles of BLOCK_P pixels x BLOCK_C channels. Three kernels, each used forward and backward:
- `_bn_reduce_kernel`: per channel, over a split of the N*H*W pixels: training statistics (the sums of x - K
  and of its square), or for the backward the sums of dy and dy * (x - mean). Grid (channel tiles, splits),
  fp64 sums and partials (fp32 inputs: x - K exact in fp64; 16-bit: fp32 entries and tile sums; no fp32 error
  grows with the pixel count).
- `_bn_finalize_kernel`: merges the splits per channel in fp64; saves the centre and invstd; updates
  running_mean and running_var in place as torch does (momentum, unbiased variance); writes per-channel
  coefficients, each rounded once to fp32.
- `_bn_apply_kernel`: out = ((u - Uh) - Ul) * A + Cc [+ ((v - Vh) - Vl) * B], per channel: y from x
  forward, dx from dy (and x, in training) backward. Weight and bias gradients come from the finalize step.
The statistics are taken of x - K, K near each channel's mean (that of its first 16 pixels), the mean kept as
hi + lo, two fp32 numbers: x - mean stays exact to fp32 even where |mean| >> std (fp32 rounding of the mean
alone would cost |mean| * 2^-24 there).
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from ._common import check_float, empty_in, flat_param, is_channels_last, joint_dims, merge_dims, pixel, pixel_tiles
from ._dispatch import (Checks, Differentiable, Launch, Shortcuts, absent, aligned, plan, shaped, switch, torch_op,
                        writing)

# --- 1. Reference ----------------------------------------------------------------------------------------

batch_norm_ref = F.batch_norm


# --- 2. Kernels ------------------------------------------------------------------------------------------

@triton.jit
def _tile_ptrs(ptr, offs_p, cc, H, W, sn, sc, sh, sw):
    n, h, w = pixel(offs_p, H, W)
    return ptr + (n * sn + h * sh + w * sw)[:, None] + cc * sc


@triton.jit
def _load_row(ptr, row, offs_c, C, c_ok):
    return tl.load(ptr + row * C + offs_c, mask=c_ok, other=0.0).to(tl.float32)


@triton.jit
def _bn_reduce_kernel(x_ptr, dy_ptr, center_ptr, part_ptr,
                      C, H, W, P, PER_SPLIT,
                      sxn, sxc, sxh, sxw, sdn, sdc, sdh, sdw,
                      GRAD: tl.constexpr, EXACT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Split s = program_id(1) covers pixels [s * PER_SPLIT, min(P, (s + 1) * PER_SPLIT)) of channel tile
    program_id(0); with d = x - center (center[0] + center[1]), part[0 / 1, s, c] (fp64) gets sum(d) and
    sum(d * d) (GRAD False; center = K, which split 0 stores in center[0]), or sum(dy) and sum(dy * d) (GRAD
    True; center = the mean). Each entry of the [BLOCK_P, BLOCK_C] tile keeps its own running sums over the
    split, reduced over the pixels once at the end (a reduction across warps at every step made this kernel 4x
    torch's time). EXACT (fp32 inputs): d, the products and the sums in fp64 (a sum over pixels in fp32 has no
    tree to keep its error small everywhere). 16-bit inputs: in fp32 (relative error ~2^-24 times a split's
    steps, far below their dtype's), the final sums in fp64."""
    split = tl.program_id(1)
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    cc = offs_c.to(tl.int64)[None, :]
    p_first = split.to(tl.int64) * PER_SPLIT
    p_end = tl.minimum(P, p_first + PER_SPLIT)
    if GRAD:
        hi = _load_row(center_ptr, 0, offs_c, C, c_ok)
        lo = _load_row(center_ptr, 1, offs_c, C, c_ok)[None, :]  # (fp32: exact in the fp64 difference)
    else:  # the shift K: the mean of the channel's first (up to) 16 pixels, the same in every program
        first = tl.arange(0, 16)
        hi = tl.load(_tile_ptrs(x_ptr, first, cc, H, W, sxn, sxc, sxh, sxw),
                     mask=(first < P)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        hi = tl.sum(hi, axis=0) / tl.minimum(P, 16)
        if split == 0:
            tl.store(center_ptr + offs_c, hi, mask=c_ok)
        lo = 0.0
    hi = hi.to(tl.float64)[None, :] if EXACT else hi[None, :]
    a = tl.zeros((BLOCK_P, BLOCK_C), tl.float32)  # entrywise sums, reduced over the pixels once at the end
    if EXACT:
        a = a.to(tl.float64)
    b = a
    for p0 in range(p_first, p_end, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask = (offs_p < p_end)[:, None] & c_ok[None, :]
        x = tl.load(_tile_ptrs(x_ptr, offs_p, cc, H, W, sxn, sxc, sxh, sxw), mask=mask, other=0.0)
        x = x.to(tl.float64) if EXACT else x.to(tl.float32)
        d = tl.where(mask, (x - hi) - lo, 0.0)
        if GRAD:
            v = tl.load(_tile_ptrs(dy_ptr, offs_p, cc, H, W, sdn, sdc, sdh, sdw), mask=mask, other=0.0)
            v = v.to(tl.float64) if EXACT else v.to(tl.float32)
        else:
            v = d
        a += v
        b += v * d
    S = tl.num_programs(1)
    tl.store(part_ptr + split * C + offs_c, tl.sum(a.to(tl.float64), axis=0), mask=c_ok)
    tl.store(part_ptr + (S + split) * C + offs_c, tl.sum(b.to(tl.float64), axis=0), mask=c_ok)


@triton.jit
def _bn_finalize_kernel(part_ptr, w_ptr, b_ptr, rm_ptr, rv_ptr, center_ptr, invstd_ptr, coef_ptr, dwb_ptr,
                        C, P, S, eps, momentum,
                        GRAD: tl.constexpr, TRAINING: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                        UPDATE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per channel, grid (channel tiles,), in fp64, each result rounded once to fp32. Forward (GRAD False):
    the mean as center[0] + center[1] and invstd from the S partials (TRAINING, updating running_mean /
    running_var when UPDATE) or from the running statistics; coefficients of y = ((x - hi) - lo) * w * invstd
    + b. Backward (GRAD True): dwb[0] = sum(dy * xhat), dwb[1] = sum(dy), and the coefficients of
    dx = (dy - mean(dy)) * w * invstd - (x - mean) * w * invstd^2 * mean(dy * xhat) (training), or
    dx = dy * w * invstd (inference). coef[k, c], k: Uh, Ul, A, Vh, Vl, B, Cc (see _bn_apply_kernel). The partials
    are read BLOCK_S splits a step (one split a step, a chain of dependent loads, took ~20 us for 33 splits)."""
    eps = tl.cast(eps, tl.float32)  # (Inductor passes Python floats as fp64)
    momentum = tl.cast(momentum, tl.float32)
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    zero = tl.zeros((BLOCK_C,), tl.float64)
    a = zero
    b = zero
    for s in range(0, S, BLOCK_S):
        rows = s + tl.arange(0, BLOCK_S)
        mask = (rows < S)[:, None] & c_ok[None, :]
        a += tl.sum(tl.load(part_ptr + rows[:, None] * C + offs_c[None, :], mask=mask, other=0.0), axis=0)
        b += tl.sum(tl.load(part_ptr + (S + rows)[:, None] * C + offs_c[None, :], mask=mask, other=0.0), axis=0)
    w = _load_row(w_ptr, 0, offs_c, C, c_ok).to(tl.float64) if HAS_W else zero + 1.0
    uh = zero
    ul = zero
    vh = zero
    vl = zero
    bv = zero
    cst = zero
    if GRAD:
        invstd = _load_row(invstd_ptr, 0, offs_c, C, c_ok).to(tl.float64)
        b = b * invstd  # sum(dy * xhat)
        tl.store(dwb_ptr + offs_c, b.to(dwb_ptr.dtype.element_ty), mask=c_ok)
        tl.store(dwb_ptr + C + offs_c, a.to(dwb_ptr.dtype.element_ty), mask=c_ok)
        scale = w * invstd
        if TRAINING:
            uh = a / P
            vh = _load_row(center_ptr, 0, offs_c, C, c_ok).to(tl.float64)
            vl = _load_row(center_ptr, 1, offs_c, C, c_ok).to(tl.float64)
            bv = -scale * invstd * (b / P)
    else:
        if TRAINING:  # mean = K + a / P as hi + lo
            mean = _load_row(center_ptr, 0, offs_c, C, c_ok).to(tl.float64) + a / P
            uh = mean.to(tl.float32).to(tl.float64)
            ul = mean - uh
            var = tl.maximum(b / P - (a / P) * (a / P), 0.0)
            if UPDATE:
                rm = _load_row(rm_ptr, 0, offs_c, C, c_ok)
                rv = _load_row(rv_ptr, 0, offs_c, C, c_ok)
                tl.store(rm_ptr + offs_c, ((1.0 - momentum) * rm + momentum * mean).to(rm_ptr.dtype.element_ty),
                         mask=c_ok)
                tl.store(rv_ptr + offs_c, ((1.0 - momentum) * rv + momentum * (var * P / (P - 1))).to(
                    rv_ptr.dtype.element_ty), mask=c_ok)
        else:
            uh = _load_row(rm_ptr, 0, offs_c, C, c_ok).to(tl.float64)
            var = _load_row(rv_ptr, 0, offs_c, C, c_ok).to(tl.float64)
        invstd = 1.0 / tl.sqrt(var + eps)
        tl.store(center_ptr + offs_c, uh.to(tl.float32), mask=c_ok)
        tl.store(center_ptr + C + offs_c, ul.to(tl.float32), mask=c_ok)
        tl.store(invstd_ptr + offs_c, invstd.to(tl.float32), mask=c_ok)
        scale = w * invstd
        if HAS_B:
            cst = _load_row(b_ptr, 0, offs_c, C, c_ok).to(tl.float64)
    tl.store(coef_ptr + offs_c, uh.to(tl.float32), mask=c_ok)
    tl.store(coef_ptr + C + offs_c, ul.to(tl.float32), mask=c_ok)
    tl.store(coef_ptr + 2 * C + offs_c, scale.to(tl.float32), mask=c_ok)
    tl.store(coef_ptr + 3 * C + offs_c, vh.to(tl.float32), mask=c_ok)
    tl.store(coef_ptr + 4 * C + offs_c, vl.to(tl.float32), mask=c_ok)
    tl.store(coef_ptr + 5 * C + offs_c, bv.to(tl.float32), mask=c_ok)
    tl.store(coef_ptr + 6 * C + offs_c, cst.to(tl.float32), mask=c_ok)


@triton.jit
def _bn_apply_kernel(u_ptr, v_ptr, out_ptr, coef_ptr,
                     C, H, W, P,
                     sun, suc, suh, suw, svn, svc, svh, svw, son, soc, soh, sow,
                     HAS_V: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out = ((u - Uh) - Ul) * A + Cc (+ ((v - Vh) - Vl) * B with HAS_V), per-channel coefficients from
    coef[7, C]; grid (pixel tiles over N*H*W, channel tiles)."""
    offs_p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    mask = (offs_p < P)[:, None] & c_ok[None, :]
    cc = offs_c.to(tl.int64)[None, :]
    u = tl.load(_tile_ptrs(u_ptr, offs_p, cc, H, W, sun, suc, suh, suw), mask=mask, other=0.0).to(tl.float32)
    out = ((u - _load_row(coef_ptr, 0, offs_c, C, c_ok)[None, :]) - _load_row(coef_ptr, 1, offs_c, C, c_ok)[None, :])
    out = out * _load_row(coef_ptr, 2, offs_c, C, c_ok)[None, :] + _load_row(coef_ptr, 6, offs_c, C, c_ok)[None, :]
    if HAS_V:
        v = tl.load(_tile_ptrs(v_ptr, offs_p, cc, H, W, svn, svc, svh, svw), mask=mask, other=0.0).to(tl.float32)
        v = (v - _load_row(coef_ptr, 3, offs_c, C, c_ok)[None, :]) - _load_row(coef_ptr, 4, offs_c, C, c_ok)[None, :]
        out += v * _load_row(coef_ptr, 5, offs_c, C, c_ok)[None, :]
    tl.store(_tile_ptrs(out_ptr, offs_p, cc, H, W, son, soc, soh, sow), out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bn_eval_kernel(x_ptr, out_ptr, rm_ptr, rv_ptr, w_ptr, b_ptr,
                    C, H, W, P, eps,
                    sxn, sxc, sxh, sxw, son, soc, soh, sow,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Inference that saves no statistics, in one launch: out = (x - running_mean) * w * invstd + b, each
    program making its channels' coefficients as _bn_finalize_kernel makes them (fp64, each rounded once to fp32:
    the same numbers as finalize + apply); grid (pixel tiles over N*H*W, channel tiles)."""
    eps = tl.cast(eps, tl.float32)  # (Inductor passes Python floats as fp64)
    offs_p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    mask = (offs_p < P)[:, None] & c_ok[None, :]
    cc = offs_c.to(tl.int64)[None, :]
    invstd = 1.0 / tl.sqrt(_load_row(rv_ptr, 0, offs_c, C, c_ok).to(tl.float64) + eps)
    scale = _load_row(w_ptr, 0, offs_c, C, c_ok).to(tl.float64) * invstd if HAS_W else invstd
    shift = _load_row(b_ptr, 0, offs_c, C, c_ok) if HAS_B else tl.zeros((BLOCK_C,), tl.float32)
    u = tl.load(_tile_ptrs(x_ptr, offs_p, cc, H, W, sxn, sxc, sxh, sxw), mask=mask, other=0.0).to(tl.float32)
    out = (u - _load_row(rm_ptr, 0, offs_c, C, c_ok)[None, :]) * scale.to(tl.float32)[None, :] + shift[None, :]
    tl.store(_tile_ptrs(out_ptr, offs_p, cc, H, W, son, soc, soh, sow), out.to(out_ptr.dtype.element_ty), mask=mask)


# --- 3. Launchers ----------------------------------------------------------------------------------------

def _layout(inputs: tuple, out: torch.Tensor):
    """(copies, (N, C, H, W), strides): the tensors of one launch, inputs and out (one shape [N, C, *spatial]), as
    N x C x H x W, the spatial dims merged into two (H, W) alike in all of them, and each one's strides
    (sn, sc, sh, sw), out's last. Where their dims do not merge into two alike, the inputs whose own spatial dims
    do not merge into one are read from contiguous copies (copies[i] for inputs[i]): then all merge into one."""
    def merged(views):
        return joint_dims(out.shape[2:], [t.stride()[2:] for t in views])

    views = (*inputs, out)
    spatial = merged(views)
    copies = (False,) * len(inputs)
    if len(spatial) > 2:
        copies = tuple(len(merge_dims(t.shape[2:], t.stride()[2:])) > 1 for t in inputs)
        views = (*(t.new_empty(t.shape) if c else t for t, c in zip(inputs, copies)), out)  # (a copy's layout)
        spatial = merged(views)
    (H, sh), (W, sw) = [(1, (0,) * len(views))] * (2 - len(spatial)) + spatial
    return copies, (*out.shape[:2], H, W), [(t.stride(0), t.stride(1), sh[i], sw[i]) for i, t in enumerate(views)]


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    fmt = torch.channels_last if is_channels_last(x) else torch.contiguous_format
    return empty_in(x.shape, fmt, x.dtype, x.device)


def _reduce_plan(dims, sx, sd, x, traced: bool):
    """(run, splits): part = run(x, dy, center), the per-split partials [2, splits, C] (fp64) of the training
    statistics (sd None: no dy) or of the backward sums; x and dy of dims (N, C, H, W), strides sx and sd."""
    N, C, H, W = dims
    P = N * H * W
    block_p, block_c = pixel_tiles(P, C, sx[1] == 1 and C > 1)
    c_tiles = _runtime.cdiv(C, block_c)
    splits = max(1, min(_runtime.cdiv(4 * _runtime.num_sms(x.device.index or 0), c_tiles), _runtime.cdiv(P, block_p)))
    per_split = _runtime.cdiv(_runtime.cdiv(P, splits), block_p) * block_p
    splits = _runtime.cdiv(P, per_split)
    launch = Launch(_bn_reduce_kernel, (c_tiles, splits), dict(GRAD=sd is not None, EXACT=x.dtype == torch.float32,
                                                              BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8),
                    traced=traced)
    scalars = (C, H, W, P, per_split, *sx, *(sx if sd is None else sd))
    device = x.device

    def run(x, dy, center):
        part = torch.empty((2, splits, C), device=device, dtype=torch.float64)
        launch(x, absent(x, traced) if dy is None else dy, center, part, *scalars)
        return part
    return run, splits


def _finalize_plan(C: int, P: int, splits: int, w, b, rm, eps: float, momentum: float, grad: bool, training: bool,
                   device, traced: bool):
    """coef = run(part, w, b, rm, rv, center, invstd, dwb), the coefficients [7, C] for _bn_apply_kernel; part
    None: no partials to merge (inference); None for any other tensor that the flags leave unread. Channels in
    tiles of 4 or more, ~16 programs (one program read all 64 channels of up to 528 splits, a channels_last map's:
    CvT-13's 78 calls a training step took 21 us each on the H200)."""
    block_c = min(_runtime.next_power_of_2(_runtime.cdiv(C, 16)), 256)
    block_c = min(max(block_c, 4), _runtime.next_power_of_2(C))
    block_s = max(1, min(_runtime.next_power_of_2(splits), 4096 // block_c))
    launch = Launch(_bn_finalize_kernel, (_runtime.cdiv(C, block_c),),
                    dict(GRAD=grad, TRAINING=training, HAS_W=w is not None, HAS_B=b is not None,
                         UPDATE=training and rm is not None, BLOCK_S=block_s, BLOCK_C=block_c, num_warps=4),
                    traced=traced)
    scalars = (C, P, splits, eps, momentum)

    def run(part, w, b, rm, rv, center, invstd, dwb):
        coef = torch.empty((7, C), device=device, dtype=torch.float32)
        launch(*[absent(coef, traced) if t is None else t for t in (part, w, b, rm, rv)], center, invstd, coef,
               absent(coef, traced) if dwb is None else dwb, *scalars)
        return coef
    return run


def _apply_plan(dims, su, sv, so, traced: bool):
    """run(u, v, coef, out): _bn_apply_kernel from u (and v; sv None: none) into out, all of dims (N, C, H, W),
    strides su, sv and so."""
    N, C, H, W = dims
    P = N * H * W
    block_p, block_c = pixel_tiles(P, C, su[1] == 1 and C > 1)
    launch = Launch(_bn_apply_kernel, (_runtime.cdiv(P, block_p), _runtime.cdiv(C, block_c)),
                    dict(HAS_V=sv is not None, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8), traced=traced)
    scalars = (C, H, W, P, *su, *(su if sv is None else sv), *so)
    return lambda u, v, coef, out: launch(u, absent(u, traced) if v is None else v, out, coef, *scalars)


def _saved(C: int, device):
    """New center [2, C] (the mean as hi + lo) and invstd [C], fp32: what the backward reads."""
    return torch.empty((2, C), device=device, dtype=torch.float32), torch.empty(C, device=device, dtype=torch.float32)


def _fwd_plan(x, w, b, rm, rv, y, training: bool, momentum: float, eps: float, stats: bool, traced: bool):
    """(run, copies): the forward's launches for this signature, (center, invstd) = run(x, w, b, rm, rv, y): the
    training statistics (training), the coefficients (updating rm and rv in training), y; copies: whether run
    reads x from a contiguous copy (`_layout`). Inference without stats: `_bn_eval_kernel` alone, center and invstd
    `absent` stand-ins."""
    if len(merge_dims(y.shape[2:], y.stride()[2:])) > 2:
        # y in x's strides, whose spatial dims do not merge into two (permuted, 3+ of them): written in x's
        # memory format, then copied into y
        staged, copies = _fwd_plan(x, w, b, rm, rv, _empty_like(x), training, momentum, eps, stats, traced)

        def run_staged(x, w, b, rm, rv, y):
            out = _empty_like(x)
            saved = staged(x, w, b, rm, rv, out)
            y.copy_(out)
            return saved
        return run_staged, copies
    (copies,), dims, (sx, sy) = _layout((x,), y)
    C = dims[1]
    if not (training or stats):
        P = x.numel() // C
        block_p, block_c = pixel_tiles(P, C, sx[1] == 1 and C > 1)
        launch = Launch(_bn_eval_kernel, (_runtime.cdiv(P, block_p), _runtime.cdiv(C, block_c)),
                        dict(HAS_W=w is not None, HAS_B=b is not None, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8),
                        traced=traced)
        scalars = (*dims[1:], P, eps, *sx, *sy)

        def run_eval(x, w, b, rm, rv, y):
            launch(x.contiguous() if copies else x, y, rm, rv, *(absent(y, traced) if t is None else t for t in (w, b)),
                   *scalars)
            return absent(y, traced), absent(y, traced)
        return run_eval, copies
    reduce, splits = _reduce_plan(dims, sx, None, x, traced) if training else (None, 0)
    finalize = _finalize_plan(C, x.numel() // C, splits, w, b, rm, eps, momentum, False, training, x.device, traced)
    apply = _apply_plan(dims, sx, None, sy, traced)
    device = x.device

    def run(x, w, b, rm, rv, y):
        x = x.contiguous() if copies else x
        center, invstd = _saved(C, device)
        coef = finalize(reduce(x, None, center) if training else None, w, b, rm, rv, center, invstd, None)
        apply(x, None, coef, y)
        return center, invstd
    return run, copies


_plans: dict = {}


def _fwd_planned(x, w, b, rm, rv, y, training: bool, momentum: float, eps: float, stats: bool, traced: bool):
    """`_fwd_plan`'s (run, copies) for this signature (x's shape, strides, dtype, device and 16-byte alignment,
    the parameters' dtypes and alignment; y, new, is laid out by x), made once."""
    key = ("fwd", training, momentum, eps, stats, x.shape, x.stride(), x.dtype, x.device, aligned(x, traced),
           *[None if t is None else (t.dtype, aligned(t, traced)) for t in (w, b, rm, rv)])
    return plan(_plans, key, lambda: _fwd_plan(x, w, b, rm, rv, y, training, momentum, eps, stats, traced), traced)


def _fwd_impl(x, w, b, running_mean, running_var, training: bool, momentum: float, eps: float, stats: bool = True,
              traced: bool = False):
    """x [N, C, ...] (any strides), w, b [C] or None -> (y in x's layout, and in fp32 center [2, C], the
    mean as hi + lo, and invstd [C]; in inference without stats stand-ins to ignore). Training with running
    statistics updates them in place, once (the finalize kernel). traced: under torch.compile (`_dispatch`).
    y is torch's: x's strides where x is dense, else x's memory format (empty_like; the input gradient takes
    the memory format alone, `_empty_like`, as torch's backward)."""
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y, *_saved(x.shape[1], x.device)
    run = _fwd_planned(x, w, b, running_mean, running_var, y, training, momentum, eps, stats, traced)[0]
    return y, *run(x, w, b, running_mean, running_var, y)


def _bwd_plan(dy, x, w, dx, training: bool, wb_dtype: Optional[torch.dtype], traced: bool):
    """The backward's launches for this signature: run(dy, x, w, center, invstd, dx, dwb) writes dx and dwb (the
    weight and bias gradients, where wb_dtype is not None); dy and x read from contiguous copies where `_layout`
    says. Inference without weight / bias gradients reads no x: dx = dy * w * invstd, no reduction."""
    reads_x = training or wb_dtype is not None
    copies, dims, strides = _layout((dy, x) if reads_x else (dy,), dx)
    sd, sx, so = strides[0], strides[1] if reads_x else None, strides[-1]
    C = dims[1]
    reduce, splits = _reduce_plan(dims, sx, sd, x, traced) if reads_x else (None, 0)
    finalize = _finalize_plan(C, x.numel() // C, splits, w, None, None, 0.0, 0.0, True, training, x.device, traced)
    apply = _apply_plan(dims, sd, sx if training else None, so, traced)

    def run(dy, x, w, center, invstd, dx, dwb):
        dy = dy.contiguous() if copies[0] else dy
        x = x.contiguous() if reads_x and copies[1] else x
        coef = finalize(reduce(x, dy, center) if reads_x else None, w, None, None, None, center, invstd, dwb)
        apply(dy, x if training else None, coef, dx)
    return run


def _bwd_impl(dy, x, w, center, invstd, training: bool, wb_dtype: Optional[torch.dtype], traced: bool = False):
    """dy, x [N, C, ...] (any strides), the forward's center and invstd -> (dx in x's memory format, dwb [2, C]:
    the weight and bias gradients in wb_dtype; fp32 and unused when wb_dtype is None)."""
    dx = _empty_like(x)
    dwb = torch.empty((2, x.shape[1]), device=x.device, dtype=wb_dtype or torch.float32)
    if x.numel() == 0:
        return dx, dwb.zero_()
    key = ("bwd", training, wb_dtype, dy.shape, dy.stride(), dy.dtype, aligned(dy, traced), x.stride(), x.dtype,
           x.device, aligned(x, traced), None if w is None else (w.dtype, aligned(w, traced)))
    plan(_plans, key, lambda: _bwd_plan(dy, x, w, dx, training, wb_dtype, traced), traced)(dy, x, w, center, invstd,
                                                                                            dx, dwb)
    return dx, dwb


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ------------------------------

@torch_op("dropin::batch_norm", mutates_args=("running_mean", "running_var"))
def _fwd_op(x: torch.Tensor, w: Optional[torch.Tensor], b: Optional[torch.Tensor],
            running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], training: bool,
            momentum: float, eps: float, stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_impl(x, w, b, running_mean, running_var, training, momentum, eps, stats, traced=True)


@torch_op("dropin::batch_norm_backward", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, w: Optional[torch.Tensor], center: torch.Tensor,
            invstd: torch.Tensor, training: bool, wb_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    return _bwd_impl(dy, x, w, center, invstd, training, wb_dtype, traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_bwd = switch(_bwd_op, _bwd_impl)


# --- 5. Autograd -----------------------------------------------------------------------------------------

class _BatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, running_mean, running_var, training, momentum, eps):
        y, center, invstd = _fwd(x, w, b, running_mean, running_var, training, momentum, eps, True)
        ctx.save_for_backward(x, w, center, invstd)
        ctx.training = training
        ctx.b_dtype = None if b is None else b.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, center, invstd = ctx.saved_tensors
        need_w, need_b = ctx.needs_input_grad[1:3]
        wb_dtype = (w.dtype if w is not None else ctx.b_dtype) if need_w or need_b else None
        dx, dwb = _bwd(dy, x, w, center, invstd, ctx.training, wb_dtype)
        return (dx, dwb[0] if need_w else None, dwb[1].to(ctx.b_dtype) if need_b else None) + (None,) * 5


# --- 6. Public function ----------------------------------------------------------------------------------

def _check_batch_norm(input, running_mean, running_var, weight, bias, training, momentum) -> None:
    """batch_norm's argument checks that the tensors' shapes, dtypes and devices decide (`Checks`)."""
    op = "batch_norm"
    params = dict(running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    _runtime.check_kernel_device(op, input=input, **params)
    check_float(op, input=input, **params)
    if input.dim() < 2:
        raise RuntimeError(f"{op}: expected 'input' with at least 2 dims [N, C, ...], but got input of size "
                           f"{list(input.shape)}")
    C = input.shape[1]
    for name, t in params.items():
        if t is not None and t.numel() != C:
            raise RuntimeError(f"{op}: '{name}' should contain {C} elements (input's channels), not {t.numel()}")
    if (running_mean is None) != (running_var is None):
        raise RuntimeError(f"{op}: pass both 'running_mean' and 'running_var' or neither")
    if not training and running_mean is None:
        raise RuntimeError(f"{op}: 'running_mean' and 'running_var' must be defined in evaluation mode")
    if not isinstance(momentum, (int, float)) or isinstance(momentum, bool):
        raise TypeError(f"{op}: argument 'momentum' must be float, not {type(momentum).__name__}")
    if training and input.numel() // max(C, 1) == 1:
        raise ValueError(f"{op}: expected more than 1 value per channel when training, got 'input' of size "
                         f"{list(input.shape)}")


def _fwd_shortcut(x, w, b, rm, rv, y, training: bool, momentum: float, eps: float, weight, bias):
    """batch_norm's later eager calls of this signature (`Shortcuts`): (input, running_mean, running_var, weight,
    bias) -> y, the forward's plan on a new y (training: updating running_mean and running_var; w, b: weight and
    bias as the launches take them); None where there is no work or a copy made x, w or b."""
    if x.numel() == 0 or any(t is not None and u.data_ptr() != t.data_ptr() for u, t in ((w, weight), (b, bias))):
        return None
    run, copies = _fwd_planned(x, w, b, rm, rv, y, training, momentum, eps, False, False)
    return None if copies else writing(y, lambda y, x, rm, rv, w, b: run(x, w, b, rm, rv, y))


class _BatchNormShortcut(Differentiable):
    """batch_norm's later eager calls of this signature where autograd records them (`Differentiable`): (input,
    running_mean, running_var, weight, bias) -> y, the forward's plan on a new y (center and invstd saved), and the
    backward's for each layout of dy, into new dx and [dweight; dbias]."""

    def __init__(self, x, w, b, rm, rv, y, training: bool, momentum: float, eps: float, needs, weight, bias):
        super().__init__()
        self.forward_run = _fwd_planned(x, w, b, rm, rv, y, training, momentum, eps, True, False)[0]
        self.training, self.needs, self.C = training, needs, x.shape[1]
        self.dx_format = torch.channels_last if is_channels_last(x) else torch.contiguous_format  # (`_empty_like`)
        self.shapes = tuple(None if t is None or t.dim() == 1 else t.shape for t in (weight, bias))  # (views)
        self.b_dtype = None if b is None else b.dtype
        self.wb_dtype = (self.b_dtype if w is None else w.dtype) if any(needs[3:]) else None
        self.cast_b = self.b_dtype != self.wb_dtype  # (dbias computed in the weight's dtype)

    @staticmethod
    def make(x, w, b, rm, rv, y, training: bool, momentum: float, eps: float, needs, weight, bias):
        """The shortcut; None where there is no work or a copy made w or b."""
        if x.numel() == 0 or any(t is not None and u.data_ptr() != t.data_ptr() for u, t in ((w, weight), (b, bias))):
            return None
        return _BatchNormShortcut(x, w, b, rm, rv, y, training, momentum, eps, needs, weight, bias)

    def forward(self, ctx, x, rm, rv, weight, bias):
        y = torch.empty_like(x)  # (as `_fwd_impl`'s)
        center, invstd = self.forward_run(x, weight, bias, rm, rv, y)
        # weight flat, as the op's own path saves it (a checkpoint's recomputation served here saves the same)
        ctx.save_for_backward(x, weight if self.shapes[0] is None else weight.view(-1), center, invstd)
        return y

    def backward(self, ctx, dy):
        x, w, center, invstd = ctx.saved_tensors
        dx = torch.empty_like(x, memory_format=self.dx_format)  # (the op's own path's: x's memory format)
        run = self.backward_plan((dy,), lambda: _bwd_plan(dy, x, w, dx, self.training, self.wb_dtype, False))
        dwb = torch.empty((2, self.C), device=x.device, dtype=self.wb_dtype or torch.float32)
        run(dy, x, w, center, invstd, dx, dwb)
        need_w, need_b = self.needs[3:]
        return (dx, None, None, shaped(dwb[0], self.shapes[0]) if need_w else None,
                shaped(dwb[1].to(self.b_dtype) if self.cast_b else dwb[1], self.shapes[1]) if need_b else None)


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def batch_norm(input: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
               weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
    """`F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)`.

    input [N, C, *spatial] (2-D, 3-D, 4-D, ...; NCHW, channels_last or any strides; the output keeps
    channels_last), float32 / float16 / bfloat16; running_mean / running_var / weight / bias [C] (any of those
    dtypes; the running statistics contiguous: they are updated in place). Inference (training=False)
    normalizes with the running statistics. Training normalizes with the batch's mean and biased variance
    (one pass, fp64 sums of x - K, K near the mean) and, where running statistics are given, updates them as
    torch does: running = (1 - momentum) * running + momentum * batch statistic, with the unbiased variance."""
    key, shortcut = _shortcuts.find((input, running_mean, running_var, weight, bias), (training, momentum, eps))
    if shortcut is not None:
        return shortcut(input, running_mean, running_var, weight, bias)
    _checked.once((input, running_mean, running_var, weight, bias), (training, momentum),
                  lambda: _check_batch_norm(input, running_mean, running_var, weight, bias, training, momentum))
    if running_mean is not None and not (running_mean.is_contiguous() and running_var.is_contiguous()):
        raise RuntimeError("batch_norm: 'running_mean' and 'running_var' must be contiguous (they are updated in "
                           "place)")
    w, b = flat_param(weight), flat_param(bias)  # [C]
    args = (bool(training), float(momentum), float(eps))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        y = _BatchNormFunction.apply(input, w, b, running_mean, running_var, *args)
        _shortcuts.keep(key, lambda: _BatchNormShortcut.make(input, w, b, running_mean, running_var, y, *args,
                                                             key[0], weight, bias), grad=True)
        return y
    y = _fwd(input, w, b, running_mean, running_var, *args, False)[0]  # (no autograd: no center and invstd)
    _shortcuts.keep(key, lambda: _fwd_shortcut(input, w, b, running_mean, running_var, y, *args, weight, bias))
    return y
