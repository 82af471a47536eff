"""Layer normalization over the last dims (torch.nn.functional.layer_norm semantics); forward and backward.

Rows of N = prod(normalized_shape) elements, fp32 statistics, the variance centred (no E[x^2] - E[x]^2
cancellation). Rows of up to `_common.MAX_ROW` elements, BLOCK_M whole rows per program held in registers (mean,
then the centred variance from registers):
- `_ln_fwd_kernel`: y = (x - mean) * rstd * weight + bias; keeps mean and rstd (fp32) for the backward.
- `_ln_bwd_kernel`: dx per row; weight / bias gradients as per-program partial column sums (a persistent
  grid striding over row blocks), summed by `_common.column_sums`: deterministic, no atomics.
Longer rows, one row per program looping over chunks of BLOCK_N elements (`_common.chunk_config`):
- `_ln_fwd_long_kernel`: a pass for the statistics (Welford per lane, lanes merged by Chan's formula), one for y.
- `_ln_bwd_long_kernel`: a pass for the row sums, one for dx; `_ln_bwd_wb_kernel` sums the weight / bias gradients
  per column block over the rows (no [programs, N] partials: a long row would make them as large as x).
The input is read through its strides as M0 x M1 rows of one strided dim (any view that allows it: slices,
transposed batch dims); the output and dx are contiguous, as torch's are.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from ._common import (check_float, chunk_config, column_sums_run, flat_param, long_row, row_config, row_offsets,
                      row_start, rows_or_copy)
from ._dispatch import (Checks, Differentiable, Launch, Shortcuts, absent, aligned, plan, shaped, switch, torch_op,
                        writing)

# --- 1. Reference ----------------------------------------------------------------------------------------

layer_norm_ref = F.layer_norm


# --- 2. Kernels ------------------------------------------------------------------------------------------

@triton.jit
def _ln_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
                   M, M1, N, sx0, sx1, sxn, eps,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """y[r, :] = (x[r, :] - mean) * rstd * w + b for BLOCK_M rows; y contiguous; with STATS, mean and rstd too (for
    the backward); grid (row blocks,)."""
    eps = tl.cast(eps, tl.float32)  # (Inductor passes Python floats as fp64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    r_ok = rows < M
    c_ok = cols < N
    mask = r_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + row_offsets(rows, cols, M1, sx0, sx1, sxn), mask=mask, other=0.0).to(tl.float32)
    n = tl.zeros((BLOCK_M,), tl.float32) + N
    mean = tl.div_rn(tl.sum(x, axis=1), n)  # per-row scalars correctly rounded (plain / and sqrt approximate)
    d = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.div_rn(n * 0.0 + 1.0, tl.sqrt_rn(tl.div_rn(tl.sum(d * d, axis=1), n) + eps))
    y = d * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(mean_ptr + rows, mean, mask=r_ok)
        tl.store(rstd_ptr + rows, rstd, mask=r_ok)


@triton.jit
def _ln_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, part_ptr,
                   M, N, M1x, sx0, sx1, sxn, M1d, sd0, sd1, sdn,
                   HAS_W: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy * xhat)) per row, dx contiguous; with PARTIALS,
    this program's column sums of dy * xhat and dy into part[pid, 0, :] and part[pid, 1, :] (fp32).
    Grid (G,): program pid takes row blocks pid, pid + G, ..."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    c_ok = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK_N,), tl.float32)
    db = tl.zeros((BLOCK_N,), tl.float32)
    for rb in range(pid, tl.cdiv(M, BLOCK_M), G):
        rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        r_ok = rows < M
        mask = r_ok[:, None] & c_ok[None, :]
        x = tl.load(x_ptr + row_offsets(rows, cols, M1x, sx0, sx1, sxn), mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row_offsets(rows, cols, M1d, sd0, sd1, sdn), mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=r_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=r_ok, other=0.0)
        xhat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w if HAS_W else dy
        n = tl.zeros((BLOCK_M,), tl.float32) + N
        c1 = tl.div_rn(tl.sum(xhat * wdy, axis=1), n)
        c2 = tl.div_rn(tl.sum(wdy, axis=1), n)
        dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if PARTIALS:
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
    if PARTIALS:
        tl.store(part_ptr + pid * 2 * N + cols, dw, mask=c_ok)
        tl.store(part_ptr + pid * 2 * N + N + cols, db, mask=c_ok)


@triton.jit
def _ln_fwd_long_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
                        M1, N, sx0, sx1, sxn, eps,
                        HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_ln_fwd_kernel` for one row of any length, in chunks of BLOCK_N; grid (rows,). The statistics in one read
    of x (a mean pass, then a centred one, would read it twice): each lane keeps Welford's count, mean and centred
    sum of squares of its elements, and the lanes merge by Chan's formula, whose terms are all centred squares.
    The statistics are of x - x[0] (shifted data): a mean far from zero (|mean| / std of 1e3) would otherwise round
    the running means at its own ulps, not at the spread's; y = ((x - x[0]) - shifted mean) * rstd."""
    eps = tl.cast(eps, tl.float32)  # (Inductor passes Python floats as fp64)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row_start(row, M1, sx0, sx1)
    shift = tl.load(x_row).to(tl.float32)
    cols = tl.arange(0, BLOCK_N)
    count = tl.zeros((BLOCK_N,), tl.float32)
    mean_l = tl.zeros((BLOCK_N,), tl.float32)
    m2_l = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        ok = c < N
        x = tl.load(x_row + c.to(tl.int64) * sxn, mask=ok, other=0.0).to(tl.float32) - shift
        count += ok.to(tl.float32)
        delta = tl.where(ok, x - mean_l, 0.0)
        mean_l += delta / tl.maximum(count, 1.0)  # (approximate /: its error is below the sum's own rounding)
        m2_l += delta * tl.where(ok, x - mean_l, 0.0)
    n = tl.sum(count, axis=0)
    mean = tl.div_rn(tl.sum(count * mean_l, axis=0), n)  # per-row scalars correctly rounded
    d = mean_l - mean
    rstd = tl.div_rn(n * 0.0 + 1.0, tl.sqrt_rn(tl.div_rn(tl.sum(m2_l + count * d * d, axis=0), n) + eps))
    for start in range(0, N, BLOCK_N):
        c = start + cols
        ok = c < N
        x = tl.load(x_row + c.to(tl.int64) * sxn, mask=ok, other=0.0).to(tl.float32)
        y = ((x - shift) - mean) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + c, y.to(y_ptr.dtype.element_ty), mask=ok)
    if STATS:
        tl.store(mean_ptr + row, shift + mean)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _ln_bwd_long_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr,
                        N, M1x, sx0, sx1, sxn, M1d, sd0, sd1, sdn,
                        HAS_W: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_ln_bwd_kernel`'s dx for one row of any length, in chunks of BLOCK_N: a pass for the row sums of
    w*dy * xhat and w*dy (per-lane fp32 sums, then across lanes), one for dx; grid (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row_start(row, M1x, sx0, sx1)
    dy_row = dy_ptr + row_start(row, M1d, sd0, sd1)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    cols = tl.arange(0, BLOCK_N)
    s1 = tl.zeros((BLOCK_N,), tl.float32)
    s2 = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        ok = c < N
        xhat = tl.where(ok, (tl.load(x_row + c.to(tl.int64) * sxn, mask=ok, other=0.0).to(tl.float32) - mean) * rstd,
                        0.0)
        wdy = tl.load(dy_row + c.to(tl.int64) * sdn, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            wdy = wdy * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        s1 += xhat * wdy
        s2 += wdy
    n = tl.cast(N, tl.float32)
    c1 = tl.div_rn(tl.sum(s1, axis=0), n)
    c2 = tl.div_rn(tl.sum(s2, axis=0), n)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        ok = c < N
        xhat = (tl.load(x_row + c.to(tl.int64) * sxn, mask=ok, other=0.0).to(tl.float32) - mean) * rstd
        wdy = tl.load(dy_row + c.to(tl.int64) * sdn, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            wdy = wdy * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        dx = (wdy - xhat * c1 - c2) * rstd
        tl.store(dx_ptr + row * N + c, dx.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _ln_bwd_wb_kernel(x_ptr, dy_ptr, mean_ptr, rstd_ptr, dwb_ptr,
                      M, N, M1x, sx0, sx1, sxn, M1d, sd0, sd1, sdn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dwb[0, cols] = sum over rows of dy * xhat, dwb[1, cols] = sum of dy (fp32 sums, stored in dwb's dtype) for
    BLOCK_N columns, over all M rows in steps of BLOCK_M; grid (column blocks,)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    dw = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for r in range(0, M, BLOCK_M):
        rows = (r + tl.arange(0, BLOCK_M)).to(tl.int64)
        r_ok = rows < M
        mask = r_ok[:, None] & c_ok[None, :]
        x = tl.load(x_ptr + row_offsets(rows, cols, M1x, sx0, sx1, sxn), mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row_offsets(rows, cols, M1d, sd0, sd1, sdn), mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=r_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=r_ok, other=0.0)
        dw += dy * ((x - mean[:, None]) * rstd[:, None])
        db += dy
    tl.store(dwb_ptr + cols, tl.sum(dw, axis=0).to(dwb_ptr.dtype.element_ty), mask=c_ok)
    tl.store(dwb_ptr + N + cols, tl.sum(db, axis=0).to(dwb_ptr.dtype.element_ty), mask=c_ok)


# --- 3. Launchers ----------------------------------------------------------------------------------------

def _fwd_plan(x, n_last: int, w, b, eps: float, stats: bool, traced: bool):
    """(run, copies): the forward's launch for this signature, (mean, rstd) = run(x, w, b, y) (with stats mean and
    rstd new, [rows] fp32; else `absent` stand-ins, not written); copies: whether run reads x from a contiguous copy
    (`rows_or_copy`)."""
    rows, ((_, s0), (M1, s1), (N, sn)) = rows_or_copy(x, n_last)
    copies = rows is not x
    M = x.numel() // max(N, 1)
    flags = dict(HAS_W=w is not None, HAS_B=b is not None, STATS=stats)
    if long_row(N):
        launch = Launch(_ln_fwd_long_kernel, (M,), dict(**flags, **chunk_config(N)), traced=traced)
        scalars = (M1, N, s0, s1, sn, eps)
    else:
        cfg = row_config(N)
        launch = Launch(_ln_fwd_kernel, (_runtime.cdiv(M, cfg["BLOCK_M"]),), dict(**flags, **cfg), traced=traced)
        scalars = (M, M1, N, s0, s1, sn, eps)
    device = x.device

    def run(x, w, b, y):
        if stats:
            mean = torch.empty(M, device=device, dtype=torch.float32)
            rstd = torch.empty_like(mean)
        else:  # (nothing allocated: eager passes y, unwritten, in both slots)
            mean, rstd = absent(y, traced), absent(y, traced)
        launch(x.contiguous() if copies else x, absent(y, traced) if w is None else w,
               absent(y, traced) if b is None else b, y, mean, rstd, *scalars)
        return mean, rstd
    return run, copies


_plans: dict = {}


def _fwd_planned(x, n_last: int, w, b, eps: float, stats: bool, traced: bool):
    """`_fwd_plan`'s (run, copies) for this signature (x's shape, strides, dtype, device and 16-byte alignment,
    weight's and bias's dtype and alignment; y, a new contiguous tensor, is aligned and laid out by them), made
    once."""
    key = ("fwd", n_last, eps, stats, x.shape, x.stride(), x.dtype, x.device, aligned(x, traced),
           None if w is None else (w.dtype, aligned(w, traced)), None if b is None else (b.dtype, aligned(b, traced)))
    return plan(_plans, key, lambda: _fwd_plan(x, n_last, w, b, eps, stats, traced), traced)


def _fwd_impl(x, n_last: int, w, b, eps: float, stats: bool = True, traced: bool = False):
    """(y, mean, rstd): y contiguous in x's shape and dtype, mean and rstd [rows] fp32 with stats (else stand-ins
    to ignore). traced: under torch.compile (`_dispatch`)."""
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if x.numel() == 0:
        mean = torch.empty(0, device=x.device, dtype=torch.float32)
        return y, mean, torch.empty_like(mean)
    return y, *_fwd_planned(x, n_last, w, b, eps, stats, traced)[0](x, w, b, y)


def _bwd_config(n: int, dy_strided: bool) -> dict:
    """`_ln_bwd_kernel`'s launch settings for rows of n elements: up to 32 whole rows a program, 8192 elements (4096
    for rows of 512-1024), on 4 warps; rows of 2048-4096 one a program (8 warps at 4096); where dy's rows are not
    contiguous (dy_strided: a permuted NCHW map) and hold 512+ elements, 4 rows on 8 warps; longer rows as
    `row_config`. A CUDA-graph sweep on an H200 (probes/ln_backward_configs.py, bf16, each setting against
    row_config's 2048 elements on 8 warps): 1.6-4.5x at CvT-13's [200704, 64] and [50176, 192] (a warp holding
    whole rows keeps the row sums within it), 4.2x at [12608, 384] with dy contiguous (with dy permuted
    row_config's pick is that layout's best), 1.55x (contiguous) and 1.75x (permuted) at [4096, 4096]."""
    cfg = row_config(n)
    block_n = cfg["BLOCK_N"]
    if block_n > 4096:
        return cfg
    if dy_strided and block_n >= 512:
        return dict(BLOCK_M=4, BLOCK_N=block_n, num_warps=8)
    if block_n <= 1024:
        return dict(BLOCK_M=min(32, (8192 if block_n <= 256 else 4096) // block_n), BLOCK_N=block_n, num_warps=4)
    return dict(BLOCK_M=1, BLOCK_N=block_n, num_warps=4 if block_n <= 2048 else 8)


def _bwd_plan(dy, x, n_last: int, w, wb_dtype: Optional[torch.dtype], traced: bool):
    """The backward's launches for this signature: run(dy, x, w, mean, rstd, dx, dwb) writes dx and (wb_dtype not
    None) dwb; dy and x read from contiguous copies where their rows do not view (`rows_or_copy`)."""
    need_wb = wb_dtype is not None
    x_rows, ((_, sx0), (M1x, sx1), (N, sxn)) = rows_or_copy(x, n_last)
    dy_rows, ((_, sd0), (M1d, sd1), (_, sdn)) = rows_or_copy(dy, n_last)
    copies_x, copies_dy = x_rows is not x, dy_rows is not dy
    M = x.numel() // max(N, 1)
    if long_row(N):
        return _bwd_long_plan(w, M, N, copies_x, copies_dy, (M1x, sx0, sx1, sxn, M1d, sd0, sd1, sdn), need_wb, traced)
    cfg = _bwd_config(N, sdn != 1)
    G = min(_runtime.cdiv(M, cfg["BLOCK_M"]), 4 * _runtime.num_sms(x.device.index or 0))
    launch = Launch(_ln_bwd_kernel, (G,), dict(HAS_W=w is not None, PARTIALS=need_wb, **cfg), traced=traced)
    scalars = (M, N, M1x, sx0, sx1, sxn, M1d, sd0, sd1, sdn)
    device = x.device
    sums = column_sums_run(G, 2 * N, traced) if need_wb else None

    def run(dy, x, w, mean, rstd, dx, dwb):
        part = torch.empty((G, 2, N), device=device, dtype=torch.float32) if need_wb else absent(mean, traced)
        launch(x.contiguous() if copies_x else x, absent(dx, traced) if w is None else w,
               dy.contiguous() if copies_dy else dy, dx, mean, rstd, part, *scalars)
        if need_wb and traced:
            sums(part.view(G, 2 * N), dwb.view(2 * N))
        elif need_wb:  # (eager: the launch reads the addresses alone, no views)
            sums(part, dwb)
    return run


def _bwd_long_plan(w, M: int, N: int, copies_x: bool, copies_dy: bool, strides: tuple, need_wb: bool, traced: bool):
    """`_bwd_plan`'s run for rows longer than `_common.MAX_ROW`: dx one row per program, then (need_wb) the weight /
    bias gradients straight into dwb, a column block per program (`_ln_bwd_wb_kernel`'s tiles: 8 rows x 256
    columns)."""
    grads = Launch(_ln_bwd_long_kernel, (M,), dict(HAS_W=w is not None, **chunk_config(N)), traced=traced)
    sums = Launch(_ln_bwd_wb_kernel, (_runtime.cdiv(N, 256),), dict(BLOCK_M=8, BLOCK_N=256, num_warps=4),
                  traced=traced) if need_wb else None

    def run(dy, x, w, mean, rstd, dx, dwb):
        x, dy = x.contiguous() if copies_x else x, dy.contiguous() if copies_dy else dy
        grads(x, absent(dx, traced) if w is None else w, dy, dx, mean, rstd, N, *strides)
        if need_wb:
            sums(x, dy, mean, rstd, dwb, M, N, *strides)
    return run


def _bwd_impl(dy, x, n_last: int, w, mean, rstd, wb_dtype: Optional[torch.dtype], traced: bool = False):
    """(dx, [dweight; dbias]): dx contiguous; the second [2, N] in wb_dtype, or empty where wb_dtype is None."""
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    N = math.prod(x.shape[x.dim() - n_last:])
    allocate = torch.empty if x.numel() > 0 else torch.zeros  # (the launch writes every element)
    dwb = allocate((2, N), device=x.device, dtype=wb_dtype) if wb_dtype is not None else dx.new_empty(0)
    if x.numel() > 0:
        key = ("bwd", n_last, wb_dtype, dy.shape, dy.stride(), dy.dtype, aligned(dy, traced), x.stride(), x.dtype,
               x.device, aligned(x, traced), None if w is None else (w.dtype, aligned(w, traced)))
        plan(_plans, key, lambda: _bwd_plan(dy, x, n_last, w, wb_dtype, traced), traced)(dy, x, w, mean, rstd, dx, dwb)
    return dx, dwb


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) --------------------------------

@torch_op("dropin::layer_norm", mutates_args=())
def _fwd_op(x: torch.Tensor, n_last: int, w: Optional[torch.Tensor], b: Optional[torch.Tensor],
            eps: float, stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_impl(x, n_last, w, b, eps, stats, traced=True)


@torch_op("dropin::layer_norm_backward", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, n_last: int, w: Optional[torch.Tensor], mean: torch.Tensor,
            rstd: torch.Tensor, wb_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    return _bwd_impl(dy, x, n_last, w, mean, rstd, wb_dtype, traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_bwd = switch(_bwd_op, _bwd_impl)


# --- 5. Autograd -----------------------------------------------------------------------------------------

class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n_last, w, b, eps):
        y, mean, rstd = _fwd(x, n_last, w, b, eps, True)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.n_last = n_last
        ctx.b_dtype = None if b is None else b.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        need_w, need_b = ctx.needs_input_grad[2:4]
        wb_dtype = (w.dtype if w is not None else ctx.b_dtype) if need_w or need_b else None
        dx, dwb = _bwd(dy, x, ctx.n_last, w, mean, rstd, wb_dtype)
        return (dx, None, dwb[0] if need_w else None, dwb[1].to(ctx.b_dtype) if need_b else None, None)


# --- 6. Public function ----------------------------------------------------------------------------------

def _check_layer_norm(input, normalized_shape, weight, bias) -> int:
    """layer_norm's argument checks; the number of normalized dims."""
    op = "layer_norm"
    _runtime.check_kernel_device(op, input=input, weight=weight, bias=bias)
    check_float(op, input=input, weight=weight, bias=bias)
    shape = [normalized_shape] if isinstance(normalized_shape, int) else normalized_shape
    valid = isinstance(shape, (list, tuple, torch.Size)) and len(shape) > 0
    for s in shape if valid else ():  # (a loop, not all() of a generator: Dynamo traces each as a call)
        valid = valid and isinstance(s, int) and not isinstance(s, bool)
    if not valid:
        raise RuntimeError(f"{op}: expected 'normalized_shape' to be an int or a non-empty list of ints, "
                           f"but got {normalized_shape!r}")
    shape = list(shape)
    n_last = len(shape)
    if input.dim() < n_last or list(input.shape[input.dim() - n_last:]) != shape:
        raise RuntimeError(f"{op}: given normalized_shape={shape}, expected 'input' with shape [*, "
                           f"{', '.join(map(str, shape))}], but got input of size {list(input.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and list(t.shape) != shape:
            raise RuntimeError(f"{op}: expected '{name}' of the same shape as normalized_shape={shape}, but got "
                               f"{name} of size {list(t.shape)}")
    return n_last


def _fwd_shortcut(x, n_last: int, w, b, eps: float, y, weight, bias):
    """layer_norm's later eager calls of this signature (`Shortcuts`): (input, weight, bias) -> y, the forward's
    plan on a new y (w, b: weight and bias as the launch takes them); None where there is no work or a copy made
    x, w or b."""
    if x.numel() == 0 or any(t is not None and u.data_ptr() != t.data_ptr() for u, t in ((w, weight), (b, bias))):
        return None
    run, copies = _fwd_planned(x, n_last, w, b, eps, False, False)
    return None if copies else writing(y, lambda y, x, w, b: run(x, w, b, y))


class _LayerNormShortcut(Differentiable):
    """layer_norm's later eager calls of this signature where autograd records them (`Differentiable`): (input,
    weight, bias) -> y, the forward's plan with stats on a new y (mean and rstd saved), and the backward's for each
    layout of dy, into new dx and [dweight; dbias]."""

    def __init__(self, x, n_last: int, w, b, eps: float, needs, weight, bias):
        super().__init__()
        self.forward_run = _fwd_planned(x, n_last, w, b, eps, True, False)[0]
        self.n_last, self.needs = n_last, needs
        self.shapes = (None, *(None if t is None or t.dim() == 1 else t.shape for t in (weight, bias)))  # (views)
        self.b_dtype = None if b is None else b.dtype
        self.wb_dtype = (self.b_dtype if w is None else w.dtype) if any(needs[1:]) else None
        self.cast_b = self.b_dtype != self.wb_dtype  # (dbias computed in the weight's dtype)
        self.N = math.prod(x.shape[x.dim() - n_last:])

    @staticmethod
    def make(x, n_last: int, w, b, eps: float, needs, weight, bias):
        """The shortcut; None where there is no work or a copy made w or b."""
        if x.numel() == 0 or any(t is not None and u.data_ptr() != t.data_ptr() for u, t in ((w, weight), (b, bias))):
            return None
        return _LayerNormShortcut(x, n_last, w, b, eps, needs, weight, bias)

    def forward(self, ctx, x, weight, bias):
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        mean, rstd = self.forward_run(x, weight, bias, y)
        # weight flat, as the op's own path saves it (a checkpoint's recomputation served here saves the same)
        ctx.save_for_backward(x, weight if self.shapes[1] is None else weight.view(-1), mean, rstd)
        return y

    def backward(self, ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        run = self.backward_plan((dy,), lambda: _bwd_plan(dy, x, self.n_last, w, self.wb_dtype, False))
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dwb = dx if self.wb_dtype is None else torch.empty((2, self.N), device=x.device, dtype=self.wb_dtype)
        run(dy, x, w, mean, rstd, dx, dwb)
        need_w, need_b = self.needs[1:]
        return (dx, shaped(dwb[0], self.shapes[1]) if need_w else None,
                shaped(dwb[1].to(self.b_dtype) if self.cast_b else dwb[1], self.shapes[2]) if need_b else None)


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def layer_norm(input: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """`F.layer_norm(input, normalized_shape, weight, bias, eps)`: normalizes over the last
    len(normalized_shape) dims (rows of any length) with fp32 mean and variance (biased, as torch), then
    * weight + bias (each None or of normalized_shape).

    input of any shape ending in normalized_shape, float32 / float16 / bfloat16, read through its strides;
    weight / bias any of those dtypes. The output (and the input's gradient) is contiguous, in input's dtype."""
    key, shortcut = _shortcuts.find((input, weight, bias), (normalized_shape, eps))
    if shortcut is not None:
        return shortcut(input, weight, bias)
    n_last = _checked.once((input, weight, bias), (normalized_shape,),
                           lambda: _check_layer_norm(input, normalized_shape, weight, bias))
    w, b = flat_param(weight), flat_param(bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        y = _LayerNormFunction.apply(input, n_last, w, b, float(eps))
        _shortcuts.keep(key, lambda: _LayerNormShortcut.make(input, n_last, w, b, float(eps), key[0], weight, bias),
                        grad=True)
        return y
    y = _fwd(input, n_last, w, b, float(eps), False)[0]  # (no autograd: no mean and rstd)
    _shortcuts.keep(key, lambda: _fwd_shortcut(input, n_last, w, b, float(eps), y, weight, bias))
    return y
