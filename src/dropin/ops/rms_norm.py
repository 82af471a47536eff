"""RMSNorm with HF Llama's numerics (LlamaRMSNorm) or Gemma's (GemmaRMSNorm) and an optional fused residual add;
forward and backward.

form "llama": y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype): the mean of squares in fp32 over the last
dim, the normalized row rounded to x's dtype before the weight multiplies it, the output in torch's promotion of
x's and weight's dtypes (HF: fp32 weights on bf16 activations give fp32).
form "gemma": y = ((x * rsqrt(mean(x^2) + eps)) * (1 + weight)).to(x.dtype), all in fp32 and rounded once, the
output in x's dtype. With `residual`, x is first replaced by s = x + residual (rounded to x's dtype, as
`residual + hidden_states` is) and (y, s) returned.

Row-wise kernels, launch settings following the hidden size (no autotune). Hidden sizes up to MAX_HIDDEN, the
whole row in one block: forward, BLOCK_R rows per program; it saves the fp32 1/rms of every row. Backward: each
program walks a contiguous range of rows, writes dx and its fp32 partial sum of the weight gradient; the partial
sums are then added up over programs (`_common.column_sums`).
Longer rows, one row per program looping over chunks of BLOCK_N elements (`_common.chunk_config`), the same
rounding points: `_rms_norm_fwd_long_kernel` (a pass for the mean of squares, one for y),
`_rms_norm_bwd_long_kernel` (a pass for the row sum, one for dx); `_rms_norm_bwd_w_kernel` sums the weight
gradient per column block over the rows (no [programs, N] partials: a long row would make them as large as x).
"""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _runtime
from ._common import check_float, chunk_config, column_sums_run, long_row
from ._dispatch import Checks, Differentiable, Launch, Shortcuts, absent, plan, switch, torch_op

FORMS = ("llama", "gemma")
MAX_HIDDEN = 32768  # the longest row the whole-row kernels hold in registers; longer rows loop


# --- 1. Reference -----------------------------------------------------------------------------------

def rms_norm_ref(x, weight, eps, residual=None, form="llama"):
    """HF LlamaRMSNorm, or GemmaRMSNorm for form "gemma" (after `x = residual + x` when residual is given)."""
    if residual is not None:
        x = x + residual
    input_dtype = x.dtype
    h = x.to(torch.float32) if input_dtype != torch.float64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if form == "gemma":
        y = (h * (1.0 + weight.to(h.dtype))).to(input_dtype)
    else:
        y = weight * h.to(input_dtype)
    return y if residual is None else (y, x)


# --- 2. Kernels -------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_fwd_kernel(x_ptr, res_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr,
                         R, N, stride_xr, stride_xn, stride_rr, stride_rn, stride_w, eps,
                         HAS_RES: tl.constexpr, GEMMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_R rows per program. y, s (the new residual) and rstd are contiguous; x, res and w any strides.
    GEMMA: y = x_normed * (1 + w) in fp32, else w * x_normed rounded to x's dtype (the module docstring)."""
    eps = tl.cast(eps, tl.float32)  # (Inductor passes Python floats as fp64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xn, mask=mask, other=0.0)
    out = rows[:, None] * N + cols[None, :]
    if HAS_RES:
        r = tl.load(res_ptr + rows[:, None] * stride_rr + cols[None, :] * stride_rn, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + out, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    x_normed = x * rstd[:, None]
    w = tl.load(w_ptr + cols * stride_w, mask=cols < N, other=0.0).to(tl.float32)
    if GEMMA:
        w += 1.0
    else:
        x_normed = x_normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + out, (w[None, :] * x_normed).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < R)


@triton.jit
def _bwd_rows(r, row_end, cols, col_mask, dy_ptr, ds_ptr, x_ptr, rstd_ptr,
              stride_dyr, stride_dyn, stride_dsr, stride_dsn, stride_xr, stride_xn,
              HAS_DS: tl.constexpr, BLOCK_R: tl.constexpr):
    """The backward's loads for rows [r, r + BLOCK_R) below row_end (none past it): x, dy, ds (fp32, or 0
    without HAS_DS) and rstd."""
    rows = (r + tl.arange(0, BLOCK_R)).to(tl.int64)
    mask = (rows < row_end)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xn, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dyr + cols[None, :] * stride_dyn, mask=mask, other=0.0)
    ds = 0.0
    if HAS_DS:
        ds = tl.load(ds_ptr + rows[:, None] * stride_dsr + cols[None, :] * stride_dsn, mask=mask, other=0.0)
        ds = ds.to(tl.float32)
    return x, dy.to(tl.float32), ds, tl.load(rstd_ptr + rows, mask=rows < row_end, other=0.0)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, ds_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr,
                         R, N, stride_dyr, stride_dyn, stride_dsr, stride_dsn, stride_xr, stride_xn, stride_w,
                         rows_per_program,
                         HAS_DS: tl.constexpr, GEMMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx = rstd * (dxn - xn * mean(dxn * xn)) + ds with dxn = dy * w (GEMMA: dy * (1 + w)), for this program's
    rows; the program's sum of dy * xn (xn rounded to x's dtype unless GEMMA) over its rows goes to
    dw[program_id, :] (fp32). dx is contiguous. The next rows are loaded before this one's dx is stored: a load
    after a store that may alias it waits for it."""
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(w_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
    if GEMMA:
        w += 1.0
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = tl.program_id(0) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, R)
    x, dy, ds, rstd = _bwd_rows(row_start, row_end, cols, col_mask, dy_ptr, ds_ptr, x_ptr, rstd_ptr,
                                stride_dyr, stride_dyn, stride_dsr, stride_dsn, stride_xr, stride_xn, HAS_DS, BLOCK_R)
    for r in range(row_start, row_end, BLOCK_R):
        x_next, dy_next, ds_next, rstd_next = _bwd_rows(
            r + BLOCK_R, row_end, cols, col_mask, dy_ptr, ds_ptr, x_ptr, rstd_ptr,
            stride_dyr, stride_dyn, stride_dsr, stride_dsn, stride_xr, stride_xn, HAS_DS, BLOCK_R)
        rows = (r + tl.arange(0, BLOCK_R)).to(tl.int64)
        x_normed = x.to(tl.float32) * rstd[:, None]
        if GEMMA:
            dw += tl.sum(dy * x_normed, axis=0)
        else:
            dw += tl.sum(dy * x_normed.to(x_ptr.dtype.element_ty).to(tl.float32), axis=0)
        dxn = dy * w[None, :]
        dx = rstd[:, None] * (dxn - x_normed * (tl.sum(dxn * x_normed, axis=1) / N)[:, None])
        if HAS_DS:
            dx += ds
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=(rows < row_end)[:, None] & col_mask[None, :])
        x, dy, ds, rstd = x_next, dy_next, ds_next, rstd_next
    tl.store(dw_ptr + tl.program_id(0) * N + cols, dw, mask=col_mask)


@triton.jit
def _fwd_chunk(x_ptr, res_ptr, s_ptr, row, c, ok, N, stride_xr, stride_xn, stride_rr, stride_rn,
               HAS_RES: tl.constexpr, STORE_S: tl.constexpr):
    """Elements c (int64) of row `row` of x, or (HAS_RES) of s = x + res rounded to x's dtype (stored where
    STORE_S), in fp32."""
    x = tl.load(x_ptr + row * stride_xr + c * stride_xn, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_rr + c * stride_rn, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_S:
            tl.store(s_ptr + row * N + c, x, mask=ok)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_fwd_long_kernel(x_ptr, res_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr,
                              N, stride_xr, stride_xn, stride_rr, stride_rn, stride_w, eps,
                              HAS_RES: tl.constexpr, GEMMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_rms_norm_fwd_kernel` for one row of any length, in chunks of BLOCK_N; grid (rows,). A pass for the sum
    of squares (per-lane fp32 sums, then across lanes; it stores s), one for y, which makes s again from x and
    res rather than reading back what other threads stored."""
    eps = tl.cast(eps, tl.float32)  # (Inductor passes Python floats as fp64)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    sq = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):
        c = (start + cols).to(tl.int64)
        x = _fwd_chunk(x_ptr, res_ptr, s_ptr, row, c, c < N, N, stride_xr, stride_xn, stride_rr, stride_rn,
                       HAS_RES, True)
        sq += x * x
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / N + eps)
    for start in range(0, N, BLOCK_N):
        c = (start + cols).to(tl.int64)
        ok = c < N
        x_normed = _fwd_chunk(x_ptr, res_ptr, s_ptr, row, c, ok, N, stride_xr, stride_xn, stride_rr, stride_rn,
                              HAS_RES, False) * rstd
        w = tl.load(w_ptr + c * stride_w, mask=ok, other=0.0).to(tl.float32)
        if GEMMA:
            w += 1.0
        else:
            x_normed = x_normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * N + c, (w * x_normed).to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_chunk(dy_ptr, x_ptr, w_ptr, row, c, ok, rstd, stride_dyr, stride_dyn, stride_xr, stride_xn, stride_w,
               GEMMA: tl.constexpr):
    """(xn, dxn) for elements c (int64) of row `row`: xn = x * rstd and dxn = dy * w (GEMMA: dy * (1 + w)), fp32."""
    x = tl.load(x_ptr + row * stride_xr + c * stride_xn, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dyr + c * stride_dyn, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c * stride_w, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:
        w += 1.0
    return x * rstd, dy * w


@triton.jit
def _rms_norm_bwd_long_kernel(dy_ptr, ds_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr,
                              N, stride_dyr, stride_dyn, stride_dsr, stride_dsn, stride_xr, stride_xn, stride_w,
                              HAS_DS: tl.constexpr, GEMMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_rms_norm_bwd_kernel`'s dx for one row of any length, in chunks of BLOCK_N: a pass for the row sum of
    dxn * xn (per-lane fp32 sums, then across lanes), one for dx; grid (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    rstd = tl.load(rstd_ptr + row)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):
        c = (start + cols).to(tl.int64)
        xn, dxn = _bwd_chunk(dy_ptr, x_ptr, w_ptr, row, c, c < N, rstd, stride_dyr, stride_dyn, stride_xr,
                             stride_xn, stride_w, GEMMA)
        acc += dxn * xn
    mean = tl.sum(acc, axis=0) / N
    for start in range(0, N, BLOCK_N):
        c = (start + cols).to(tl.int64)
        ok = c < N
        xn, dxn = _bwd_chunk(dy_ptr, x_ptr, w_ptr, row, c, ok, rstd, stride_dyr, stride_dyn, stride_xr,
                             stride_xn, stride_w, GEMMA)
        dx = rstd * (dxn - xn * mean)
        if HAS_DS:
            dx += tl.load(ds_ptr + row * stride_dsr + c * stride_dsn, mask=ok, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * N + c, dx.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_bwd_w_kernel(dy_ptr, x_ptr, rstd_ptr, dw_ptr, R, N, stride_dyr, stride_dyn, stride_xr, stride_xn,
                           GEMMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[cols] = the sum over rows of dy * xn (xn rounded to x's dtype unless GEMMA; fp32 sums, stored in dw's
    dtype) for BLOCK_N columns, over all R rows in steps of BLOCK_R; grid (column blocks,)."""
    cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    dw = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for r in range(0, R, BLOCK_R):
        x, dy, _, rstd = _bwd_rows(r, R, cols, col_mask, dy_ptr, dy_ptr, x_ptr, rstd_ptr,
                                   stride_dyr, stride_dyn, 0, 0, stride_xr, stride_xn, False, BLOCK_R)
        x_normed = x.to(tl.float32) * rstd[:, None]
        if not GEMMA:
            x_normed = x_normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        dw += dy * x_normed
    tl.store(dw_ptr + cols, tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)


# --- 3. Launchers -----------------------------------------------------------------------------------

def _launch_settings(N: int):
    """(BLOCK_N, BLOCK_R, num_warps): the whole row in one block, rows stacked up to 4096 numbers a tile,
    4 warps up to 2048 numbers, 8 up to 8192, 16 beyond."""
    block_n = _runtime.next_power_of_2(N)
    block_r = max(1, min(16, 4096 // block_n))
    tile = block_n * block_r
    return block_n, block_r, 4 if tile <= 2048 else 8 if tile <= 8192 else 16


_plans: dict = {}


def _fwd_plan(x, weight, residual: Optional[torch.Tensor], gemma: bool, traced: bool = False):
    """run(x, weight, residual, y, s, rstd, eps): the forward's launch for this signature, made once (x's, weight's
    and residual's shapes, strides, dtypes and 16-byte alignment, the device, the form); y, s and rstd as
    `_rms_norm_fwd_impl` allocates them (s is not read without residual)."""
    key = None if traced else (
        "fwd", gemma, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, weight.stride(0), weight.dtype,
        weight.data_ptr() & 15, None if residual is None else (residual.stride(), residual.dtype,
                                                                residual.data_ptr() & 15))
    return plan(_plans, key, lambda: _make_fwd_plan(x, weight, residual, gemma, traced), traced)


def _make_fwd_plan(x, weight, residual, gemma, traced):
    R, N = x.shape
    flags = dict(HAS_RES=residual is not None, GEMMA=gemma)
    scalars = (N, *x.stride(), *(x if residual is None else residual).stride(), weight.stride(0))
    if long_row(N, MAX_HIDDEN):
        launch = Launch(_rms_norm_fwd_long_kernel, (R,), dict(**flags, **chunk_config(N)), traced=traced)
    else:
        block_n, block_r, warps = _launch_settings(N)
        launch = Launch(_rms_norm_fwd_kernel, (_runtime.cdiv(R, block_r),),
                        dict(**flags, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps), traced=traced)
        scalars = (R, *scalars)
    if residual is None:
        return lambda x, weight, residual, y, s, rstd, eps: launch(x, absent(x, traced), weight, y, absent(x, traced),
                                                                   rstd, *scalars, eps)
    return lambda x, weight, residual, y, s, rstd, eps: launch(x, residual, weight, y, s, rstd, *scalars, eps)


def _rms_norm_fwd_impl(x, weight, residual: Optional[torch.Tensor], eps: float, gemma: bool, traced: bool = False):
    """x, residual [R, N] (any strides), weight [N] -> (y [R, N], s [R, N] (empty without residual),
    rstd [R] fp32), all contiguous. gemma: Gemma's form. traced: under torch.compile (`_dispatch`)."""
    R, N = x.shape
    y = x.new_empty((R, N), dtype=x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype))
    s = x.new_empty((R, N) if residual is not None else (0,))
    rstd = x.new_empty((R,), dtype=torch.float32)
    if R * N == 0:
        return y, s, rstd
    _fwd_plan(x, weight, residual, gemma, traced)(x, weight, residual, y, s, rstd, eps)
    return y, s, rstd


def _bwd_plan(dy, ds: Optional[torch.Tensor], x, weight, rstd, gemma: bool, traced: bool = False):
    """run(dy, ds, x, weight, rstd, dx, dw) writes dx and, where dw is not None, dw (the fp32 partial sums of each
    program added up): the backward's launches for this signature, made once (the tensors' shapes, strides, dtypes
    and 16-byte alignment, the device); dx as `_rms_norm_bwd_impl` allocates it."""
    key = None if traced else (
        "bwd", gemma, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, dy.stride(), dy.dtype,
        dy.data_ptr() & 15,
        None if ds is None else (ds.stride(), ds.dtype, ds.data_ptr() & 15), weight.stride(0), weight.dtype,
        weight.data_ptr() & 15, rstd.data_ptr() & 15)
    return plan(_plans, key, lambda: _make_bwd_plan(dy, ds, x, weight, gemma, traced), traced)


def _make_bwd_plan(dy, ds, x, weight, gemma, traced):
    R, N = x.shape
    if long_row(N, MAX_HIDDEN):
        return _make_bwd_long_plan(dy, ds, x, weight, gemma, traced)
    block_n, block_r, warps = _launch_settings(N)
    # 2 programs per SM: with the next rows loaded ahead, fwd+bwd of Llama-3-8B's 8192 x 4096 bf16 takes 94 us
    # in the bench (H200, CUDA graph) against 101 with 4; under the profiler 4 looked faster (54 us against 68
    # for this kernel). Fewer programs also leave fewer fp32 partial sums of dw to add up.
    programs = min(_runtime.cdiv(R, block_r), 2 * _runtime.num_sms(x.device.index or 0))
    rows = _runtime.cdiv(_runtime.cdiv(R, programs), block_r) * block_r
    programs = _runtime.cdiv(R, rows)
    launch = Launch(_rms_norm_bwd_kernel, (programs,),
                    dict(HAS_DS=ds is not None, GEMMA=gemma, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps),
                    traced=traced)
    scalars = (R, N, *dy.stride(), *(dy if ds is None else ds).stride(), *x.stride(), weight.stride(0), rows)

    sums = column_sums_run(programs, N, traced)

    def run(dy, ds, x, weight, rstd, dx, dw):
        partial = torch.empty((programs, N), device=x.device, dtype=torch.float32)
        launch(dy, absent(dy, traced) if ds is None else ds, x, weight, rstd, dx, partial, *scalars)
        if dw is not None:
            sums(partial, dw)
    return run


def _make_bwd_long_plan(dy, ds, x, weight, gemma, traced):
    """`_make_bwd_plan`'s run for rows longer than MAX_HIDDEN: dx one row per program, then (where dw is not None)
    the weight gradient straight into dw, a column block per program (`_rms_norm_bwd_w_kernel`'s tiles: 8 rows x
    256 columns)."""
    R, N = x.shape
    grads = Launch(_rms_norm_bwd_long_kernel, (R,), dict(HAS_DS=ds is not None, GEMMA=gemma, **chunk_config(N)),
                   traced=traced)
    sums = Launch(_rms_norm_bwd_w_kernel, (_runtime.cdiv(N, 256),),
                  dict(GEMMA=gemma, BLOCK_R=8, BLOCK_N=256, num_warps=4), traced=traced)
    scalars = (N, *dy.stride(), *(dy if ds is None else ds).stride(), *x.stride(), weight.stride(0))
    w_scalars = (R, N, *dy.stride(), *x.stride())

    def run(dy, ds, x, weight, rstd, dx, dw):
        grads(dy, absent(dy, traced) if ds is None else ds, x, weight, rstd, dx, *scalars)
        if dw is not None:
            sums(dy, x, rstd, dw, *w_scalars)
    return run


def _rms_norm_bwd_impl(dy, ds: Optional[torch.Tensor], x, weight, rstd, gemma: bool, traced: bool = False):
    """dy, ds [R, N] (any strides; ds the gradient of the new residual, or None), x [R, N] the normalized
    input (any strides), rstd [R] -> (dx [R, N] contiguous in x's dtype, dw [N] in weight's dtype)."""
    R, N = x.shape
    dx = x.new_empty((R, N))
    if R * N == 0:
        return dx, torch.zeros_like(weight)
    dw = torch.empty(N, device=x.device, dtype=weight.dtype)
    _bwd_plan(dy, ds, x, weight, rstd, gemma, traced)(dy, ds, x, weight, rstd, dx, dw)
    return dx, dw


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ------------------------------

@torch_op("dropin::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor],
                     eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rms_norm_fwd_impl(x, weight, residual, eps, gemma, traced=True)


@torch_op("dropin::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: torch.Tensor, ds: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                     rstd: torch.Tensor, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_bwd_impl(dy, ds, x, weight, rstd, gemma, traced=True)


_rms_norm_fwd = switch(_rms_norm_fwd_op, _rms_norm_fwd_impl)
_rms_norm_bwd = switch(_rms_norm_bwd_op, _rms_norm_bwd_impl)


# --- 5. Autograd --------------------------------------------------------------------------------------

class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps, gemma):
        y, s, rstd = _rms_norm_fwd(x, weight, residual, eps, gemma)
        if residual is not None and not (ctx.needs_input_grad[0] or ctx.needs_input_grad[2]):
            ctx.mark_non_differentiable(s)  # (x + residual of constants, as torch's sum)
        ctx.has_residual, ctx.gemma = residual is not None, gemma
        ctx.save_for_backward(s if residual is not None else x, weight, rstd)
        return (y, s) if residual is not None else y

    @staticmethod
    def backward(ctx, dy, ds=None):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_bwd(dy, ds, x, weight, rstd, ctx.gemma)
        need_x, need_w, need_res = ctx.needs_input_grad[:3]
        return dx if need_x else None, dw if need_w else None, dx if need_res else None, None, None


# --- 6. Public function -------------------------------------------------------------------------------

def _check(x, weight, eps, residual, form):
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rms_norm: argument '{name}' must be a Tensor, got {type(t).__name__}")
    _runtime.check_kernel_device("rms_norm", x=x, weight=weight, residual=residual)
    check_float("rms_norm", x=x, weight=weight, residual=residual)
    if x.dim() == 0:
        raise RuntimeError("rms_norm: argument 'x' must be at least 1-D, got 0-D")
    N = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != N:
        raise RuntimeError(f"rms_norm: argument 'weight' must have shape ({N},) (the hidden size of 'x' "
                           f"{tuple(x.shape)}), got {tuple(weight.shape)}")
    if residual is not None:
        if residual.shape != x.shape:
            raise RuntimeError(f"rms_norm: argument 'residual' must have the shape of 'x' {tuple(x.shape)}, "
                               f"got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise RuntimeError(f"rms_norm: expected 'x' and 'residual' to have the same dtype, "
                               f"but got {x.dtype} and {residual.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"rms_norm: argument 'eps' must be a finite number >= 0, got {eps!r}")
    if form not in FORMS:
        raise ValueError(f"rms_norm: argument 'form' must be one of {FORMS}, got {form!r}")


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None,
             form: str = "llama"):
    """HF Llama's RMSNorm over the last dim: `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`; form "gemma":
    Gemma's, `((x * rsqrt(mean(x^2) + eps)) * (1 + weight)).to(x.dtype)` computed in fp32; rows of any length.

    x [..., N] (any strides), weight [N]; float32 / float16 / bfloat16 (weight may differ from x: the
    output has their promoted dtype, as in HF; form "gemma": x's dtype). With residual (x's shape and dtype), the
    fused `s = x + residual` comes first and `(rms_norm(s), s)` is returned, s being the next residual stream.
    Differentiable in x, weight and residual."""
    key, shortcut = _shortcuts.find((x, weight, residual), (eps, form))
    if shortcut is not None:
        return shortcut(x, weight, residual)
    _checked.once((x, weight, residual), (eps, form), lambda: _check(x, weight, eps, residual, form))
    gemma = form == "gemma"
    N = x.shape[-1]
    # Leading dims flatten into rows: a view whenever they collapse (e.g. any contiguous or row-sliced x),
    # a copy only otherwise; the kernels read rows with any row and column stride.
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, N)
    res2 = None if residual is None else residual.reshape(rows, N)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or residual is not None and residual.requires_grad):
        out = _RMSNormFunction.apply(x2, weight, res2, float(eps), gemma)
        y, s = (out, None) if residual is None else out
    else:  # no autograd node (its cost is a small op's whole launch)
        y, s, _ = _rms_norm_fwd(x2, weight, res2, float(eps), gemma)
    out = y.view(x.shape) if residual is None else (y.view(x.shape), s.view(x.shape))
    if torch.is_grad_enabled() and (y.requires_grad or s is not None and s.requires_grad):
        _shortcuts.keep(key, lambda: _RMSNormShortcut.make(x, x2, weight, residual, res2, float(eps), gemma, out,
                                                                key[0]),
                        grad=True)
    else:
        _shortcuts.keep(key, lambda: _rms_norm_shortcut(x, x2, weight, residual, res2, float(eps), gemma, out))
    return out


def _rms_norm_shortcut(x, x2, weight, residual, res2, eps: float, gemma: bool, out, saves: bool = False):
    """rms_norm's later eager calls of this signature (`Shortcuts`): (x, weight, residual) -> y, or (y, s) with
    residual, new outputs laid out as this call's out, the forward's plan run on x and residual themselves (saves:
    -> ((y, s), rstd)); None where flattening copied one (leading dims that do not collapse) or there are no rows."""
    if x2.numel() == 0 or x2.data_ptr() != x.data_ptr() \
            or residual is not None and res2.data_ptr() != residual.data_ptr():
        return None
    run = _fwd_plan(x2, weight, res2, gemma)
    layouts = [(t.shape, t.stride(), t.dtype) for t in (out if residual is not None else (out,))]
    rows, device = x2.shape[0], x.device

    def shortcut(x, weight, residual):
        outs = [torch.empty_strided(shape, strides, dtype=dtype, device=device) for shape, strides, dtype in layouts]
        # (outs[-1]: s, or without residual y as its unread stand-in)
        rstd = torch.empty(rows, dtype=torch.float32, device=device)
        run(x, weight, residual, outs[0], outs[-1], rstd, eps)
        out = outs[0] if residual is None else tuple(outs)
        return (out, rstd) if saves else out
    return shortcut


class _RMSNormShortcut(Differentiable):
    """rms_norm's later eager calls of this signature where autograd records them (`Differentiable`): the forward
    as `_rms_norm_shortcut`'s (rstd and x, or s, saved) and the backward's plan for each layout of (dy, ds), into new
    dx and dweight."""

    def __init__(self, forward_run, rows: int, N: int, residual: bool, gemma: bool, needs):
        super().__init__()
        self.forward_run, self.rows, self.N, self.residual, self.needs = forward_run, rows, N, residual, needs
        self.gemma = gemma

    @staticmethod
    def make(x, x2, weight, residual, res2, eps: float, gemma: bool, out, needs):
        """The shortcut; None where `_rms_norm_shortcut` has none."""
        forward_run = _rms_norm_shortcut(x, x2, weight, residual, res2, eps, gemma, out, saves=True)
        return None if forward_run is None else _RMSNormShortcut(forward_run, *x2.shape, residual is not None, gemma,
                                                                 needs)

    def forward(self, ctx, x, weight, residual):
        out, rstd = self.forward_run(x, weight, residual)
        if self.residual and not (ctx.needs_input_grad[1] or ctx.needs_input_grad[3]):
            ctx.mark_non_differentiable(out[1])  # (as the op's own path)
        # [R, N] rows, as the op's own path saves them (a checkpoint's recomputation served here saves the same)
        ctx.save_for_backward((out[1] if self.residual else x).view(self.rows, self.N), weight, rstd)
        return out

    def backward(self, ctx, dy, ds=None):
        x, weight, rstd = ctx.saved_tensors
        dy2, ds2 = (None if t is None else t.reshape(self.rows, self.N) for t in (dy, ds))
        run = self.backward_plan((dy2, ds2), lambda: _bwd_plan(dy2, ds2, x, weight, rstd, self.gemma))
        dx = torch.empty(dy.shape, device=x.device, dtype=x.dtype)
        dw = torch.empty(self.N, device=x.device, dtype=weight.dtype) if self.needs[1] else None
        run(dy2, ds2, x, weight, rstd, dx, dw)  # (x's, or s's, rows)
        return dx if self.needs[0] else None, dw, dx if self.needs[2] else None
