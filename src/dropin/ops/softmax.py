"""softmax and log_softmax along any dim (torch.softmax / torch.log_softmax semantics); forward and backward.

One kernel pair for both, fp32 math (the row max, exp(x - max), their sum). Rows of up to `_common.MAX_ROW`
elements, BLOCK_M whole rows per program held in registers, so the input is read once and the output written once:
- `_softmax_fwd_kernel`: y = exp(x - max) / sum, or (LOG) x - max - log(sum).
- `_softmax_bwd_kernel`: dx = y * (dy - sum(dy * y)) (that sum in fp64), or (LOG) dy - exp(y) * sum(dy).
Longer rows, one row per program looping over chunks of BLOCK_N elements (`_common.chunk_config`), the same math in
two passes: `_softmax_fwd_long_kernel` (an online max and sum per lane, then y), `_softmax_bwd_long_kernel` (the
sum, then dx).
Rows are read through strides: the softmax dim is the row (any stride), the other dims M0 x M1 rows (any
view whose other dims merge into two; others are copied once). The output is contiguous, as torch's is.
"""
import torch
import triton
import triton.language as tl

from .. import _runtime
from ._common import check_float, chunk_config, long_row, row_config, row_offsets, row_start, row_view, rows_or_copy
from ._dispatch import Checks, Launch, Shortcuts, Unary, aligned, plan, switch, torch_op, writing

# --- 1. Reference ----------------------------------------------------------------------------------------

softmax_ref = torch.softmax
log_softmax_ref = torch.log_softmax


# --- 2. Kernels ------------------------------------------------------------------------------------------

@triton.jit
def _softmax_fwd_kernel(x_ptr, y_ptr,
                        M, N, M1x, sx0, sx1, sxn, M1y, sy0, sy1, syn,
                        LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = softmax(x) (or log_softmax) over rows of N for BLOCK_M rows; grid (row blocks,)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    r_ok = rows < M
    mask = r_ok[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + row_offsets(rows, cols, M1x, sx0, sx1, sxn), mask=mask, other=float("-inf")).to(tl.float32)
    z = x - tl.where(r_ok, tl.max(x, axis=1), 0.0)[:, None]  # rows past M: -inf - 0, not -inf - -inf
    e = tl.exp(z)
    s = tl.where(r_ok, tl.sum(e, axis=1), 1.0)
    if LOG:
        y = z - tl.log(s)[:, None]
    else:
        y = tl.div_rn(e, s[:, None])
    tl.store(y_ptr + row_offsets(rows, cols, M1y, sy0, sy1, syn), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_kernel(dy_ptr, y_ptr, dx_ptr,
                        M, N, M1d, sd0, sd1, sdn, M1y, sy0, sy1, syn,
                        LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx from dy and the forward's output y (dx and y contiguous, read through the same strides);
    grid (row blocks,)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = tl.load(dy_ptr + row_offsets(rows, cols, M1d, sd0, sd1, sdn), mask=mask, other=0.0).to(tl.float32)
    offs_y = row_offsets(rows, cols, M1y, sy0, sy1, syn)
    y = tl.load(y_ptr + offs_y, mask=mask, other=0.0).to(tl.float32)
    if LOG:
        dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
    else:
        # sum(dy * y) in fp64 (exact products; the GPU has the fp64 rate to spare in a memory-bound kernel),
        # kept as fp32 hi + lo: where dy is near the sum (the dominant entries), dy - sum cancels, and one
        # fp32 rounding of the sum would show
        c = tl.sum(dy.to(tl.float64) * y.to(tl.float64), axis=1)
        hi = c.to(tl.float32)
        lo = (c - hi.to(tl.float64)).to(tl.float32)
        dx = y * ((dy - hi[:, None]) - lo[:, None])
    tl.store(dx_ptr + offs_y, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_long_kernel(x_ptr, y_ptr,
                             N, M1x, sx0, sx1, sxn, M1y, sy0, sy1, syn,
                             LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_softmax_fwd_kernel` for one row of any length, in chunks of BLOCK_N; grid (rows,). The first pass keeps
    each lane's running max and its sum of exp(x - max), rescaled as the max grows (one read of x, where a max pass
    and a sum pass would read it twice); the second writes y."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row_start(row, M1x, sx0, sx1)
    y_row = y_ptr + row_start(row, M1y, sy0, sy1)
    cols = tl.arange(0, BLOCK_N)
    m_l = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_l = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c.to(tl.int64) * sxn, mask=c < N, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_l, x)
        none = m_new == float("-inf")  # only -inf so far: the sum stays 0 (not exp(-inf - -inf), NaN)
        s_l = s_l * tl.where(none, 1.0, tl.exp(m_l - m_new)) + tl.where(none, 0.0, tl.exp(x - m_new))
        m_l = m_new
    m = tl.max(m_l, axis=0)
    s = tl.sum(s_l * tl.exp(m_l - m), axis=0)  # (a row of only -inf: NaN, as torch's)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        ok = c < N
        z = tl.load(x_row + c.to(tl.int64) * sxn, mask=ok, other=0.0).to(tl.float32) - m
        if LOG:
            y = z - tl.log(s)
        else:
            y = tl.div_rn(tl.exp(z), s)
        tl.store(y_row + c.to(tl.int64) * syn, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _softmax_bwd_long_kernel(dy_ptr, y_ptr, dx_ptr,
                             N, M1d, sd0, sd1, sdn, M1y, sy0, sy1, syn,
                             LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_softmax_bwd_kernel` for one row of any length, in chunks of BLOCK_N: a pass for the sum (per-lane sums,
    then across lanes), one for dx; grid (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    dy_row = dy_ptr + row_start(row, M1d, sd0, sd1)
    y_off = row_start(row, M1y, sy0, sy1)
    cols = tl.arange(0, BLOCK_N)
    if LOG:
        s_l = tl.zeros((BLOCK_N,), tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            s_l += tl.load(dy_row + c.to(tl.int64) * sdn, mask=c < N, other=0.0).to(tl.float32)
        hi = tl.sum(s_l, axis=0)
    else:
        # sum(dy * y) in fp64, kept as fp32 hi + lo, as `_softmax_bwd_kernel`'s
        s_l64 = tl.zeros((BLOCK_N,), tl.float64)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            ok = c < N
            dy = tl.load(dy_row + c.to(tl.int64) * sdn, mask=ok, other=0.0).to(tl.float64)
            s_l64 += dy * tl.load(y_ptr + y_off + c.to(tl.int64) * syn, mask=ok, other=0.0).to(tl.float64)
        c64 = tl.sum(s_l64, axis=0)
        hi = c64.to(tl.float32)
        lo = (c64 - hi.to(tl.float64)).to(tl.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        ok = c < N
        dy = tl.load(dy_row + c.to(tl.int64) * sdn, mask=ok, other=0.0).to(tl.float32)
        offs_y = y_off + c.to(tl.int64) * syn
        y = tl.load(y_ptr + offs_y, mask=ok, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp(y) * hi
        else:
            dx = y * ((dy - hi) - lo)
        tl.store(dx_ptr + offs_y, dx.to(dx_ptr.dtype.element_ty), mask=ok)


# --- 3. Launchers ----------------------------------------------------------------------------------------

_LOOPED = {_softmax_fwd_kernel: _softmax_fwd_long_kernel, _softmax_bwd_kernel: _softmax_bwd_long_kernel}


def _rows_plan(kernel, a, out, dim: int, log: bool, traced: bool):
    """(run, copies): kernel's launch over the rows along dim of this signature (its looped peer in `_LOOPED` for
    rows longer than `_common.MAX_ROW`), run(rows, *tensors) with rows a.movedim(dim, -1) (a contiguous copy where
    copies: its other dims do not merge into two) and tensors (out,) or (y, out), y with out's strides."""
    moved = a.movedim(dim, -1)
    rows, ((_, sa0), (M1a, sa1), (N, san)) = rows_or_copy(moved, 1)
    (_, so0), (M1o, so1), (_, son) = row_view(out.movedim(dim, -1), 1)
    M = a.numel() // max(N, 1)
    scalars = (N, M1a, sa0, sa1, san, M1o, so0, so1, son)
    if long_row(N):
        launch = Launch(_LOOPED[kernel], (M,), dict(LOG=log, **chunk_config(N)), traced=traced)
    else:
        cfg = row_config(N)
        launch = Launch(kernel, (_runtime.cdiv(M, cfg["BLOCK_M"]),), dict(LOG=log, **cfg), traced=traced)
        scalars = (M, *scalars)
    return (lambda rows, *tensors: launch(rows, *tensors, *scalars)), rows is not moved


_plans: dict = {}


def _rows_planned(kernel, a, y, out, dim: int, log: bool, traced: bool):
    """`_rows_plan`'s (run, copies) for this signature (a's shape, strides, dtype, device and 16-byte alignment,
    y's dtype and alignment; out, a new contiguous tensor, is aligned and laid out by them), made once."""
    key = (kernel, dim, log, a.shape, a.stride(), a.dtype, a.device, aligned(a, traced),
           None if y is None else (y.dtype, aligned(y, traced)))
    return plan(_plans, key, lambda: _rows_plan(kernel, a, out, dim, log, traced), traced)


def _launch(kernel, a, y, out, dim: int, log: bool, traced: bool):
    """kernel over rows along dim: reads a and y (y None: reads only a; else y has out's strides), writes out."""
    run, copies = _rows_planned(kernel, a, y, out, dim, log, traced)
    rows = a.movedim(dim, -1)
    run(rows.contiguous() if copies else rows, *((out,) if y is None else (y, out)))


def _fwd_impl(x, dim: int, log: bool, traced: bool = False):
    """softmax (log: log_softmax) of x along dim, contiguous. traced: under torch.compile (`_dispatch`)."""
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if x.numel() > 0:
        _launch(_softmax_fwd_kernel, x, None, y, dim, log, traced)
    return y


def _bwd_impl(dy, y, dim: int, log: bool, traced: bool = False):
    dx = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    if y.numel() > 0:
        _launch(_softmax_bwd_kernel, dy, y, dx, dim, log, traced)
    return dx


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) --------------------------------

@torch_op("dropin::softmax", mutates_args=())
def _fwd_op(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return _fwd_impl(x, dim, log, traced=True)


@torch_op("dropin::softmax_backward", mutates_args=())
def _bwd_op(dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return _bwd_impl(dy, y, dim, log, traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_bwd = switch(_bwd_op, _bwd_impl)


# --- 5. Autograd -----------------------------------------------------------------------------------------

class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, log):
        y = _fwd(x, dim, log)
        ctx.save_for_backward(y)
        ctx.args = (dim, log)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _bwd(dy, y, *ctx.args), None, None


# --- 6. Public functions ---------------------------------------------------------------------------------

def _check_softmax(op: str, input, dim) -> int:
    """softmax's and log_softmax's argument checks; dim in [0, input.dim()) (a scalar: its one-element view)."""
    _runtime.check_kernel_device(op, input=input)
    check_float(op, input=input)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}: argument 'dim' must be int, not {type(dim).__name__}")
    ndim = max(input.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{op}: 'dim' out of range (expected to be in range of [{-ndim}, {ndim - 1}], "
                         f"but got {dim})")
    dim %= ndim
    return dim


def _fwd_shortcut(input, x, y, dim: int, log: bool):
    """softmax's and log_softmax's later eager calls of this signature (`Shortcuts`): input -> output, the
    forward's plan for x (input, or a scalar's one-element view) and its output y, run on input and a new output
    laid out as this call's; None where there is no work or the plan copies x."""
    if x.numel() == 0:
        return None
    run, copies = _rows_planned(_softmax_fwd_kernel, x, None, y, dim, log, False)
    return None if copies else writing(y.view(input.shape), lambda out, input: run(input, out))


def _grad_shortcut(input, y, dim: int, log: bool):
    """The same where autograd records the calls (`Unary`, the output saved): the backward's plan for each layout
    of dy; None where `_fwd_shortcut` is, or for a scalar."""
    forward_run = None if input.dim() == 0 else _fwd_shortcut(input, input, y, dim, log)

    def backward_run(dy, y):
        dx = torch.empty(y.shape, device=y.device, dtype=y.dtype)
        run, copies = _rows_planned(_softmax_bwd_kernel, dy, y, dx, dim, log, False)
        return None if copies else writing(dx, lambda dx, dy, y: run(dy, y, dx))
    return None if forward_run is None else Unary(forward_run, True, backward_run,
                                                  lambda dy, y: _bwd_impl(dy, y, dim, log))


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def _softmax(op: str, input: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    key, shortcut = _shortcuts.find((input,), (dim, log))
    if shortcut is not None:
        return shortcut(input)
    dim = _checked.once((input,), (op, dim), lambda: _check_softmax(op, input, dim))
    x = input.reshape(1) if input.dim() == 0 else input
    if torch.is_grad_enabled() and input.requires_grad:
        y = _SoftmaxFunction.apply(x, dim, log)
        _shortcuts.keep(key, lambda: _grad_shortcut(input, y, dim, log), grad=True)
    else:
        y = _fwd(x, dim, log)
        _shortcuts.keep(key, lambda: _fwd_shortcut(input, x, y, dim, log))
    return y.reshape(()) if input.dim() == 0 else y


def softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`torch.softmax(input, dim)`: exp(x - max) / sum along dim, fp32 math; rows of any length.
    input of any shape and strides, float32 / float16 / bfloat16; the output is contiguous."""
    return _softmax("softmax", input, dim, False)


def log_softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`torch.log_softmax(input, dim)`: x - max - log(sum(exp(x - max))) along dim; as `softmax` otherwise."""
    return _softmax("log_softmax", input, dim, True)
